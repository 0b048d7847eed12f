//! Engine counters: relaxed atomics bumped on the hot paths, read as a snapshot.

use crate::sync::{AtomicU64, AtomicUsize, Ordering};
use crossbeam_utils::CachePadded;

/// What the engine has done so far; see [`crate::Engine::stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Nodes recorded (a record-time batch of elementwise ops counts once
    /// per op it holds, here and in `completed` and the live counts).
    pub recorded: u64,
    /// Nodes finished (ran, failed or skipped).
    pub completed: u64,
    /// Nodes that ran and failed.
    pub failed: u64,
    /// Nodes skipped because an input was poisoned by a failure.
    pub skipped: u64,
    /// Flushes: targeted (blockers), global (`wait_all`) and backpressure.
    pub flushes: u64,
    /// Explicit blockers (`wait_to_read`, `wait_all`, task `wait`).
    pub blockers: u64,
    /// Implicit blockers (`to_vec`, `item`, `get`, printing).
    pub implicit_blockers: u64,
    /// Times recording stalled at the backpressure high mark.
    pub backpressure_stalls: u64,
    /// Recorded nodes not yet finished.
    pub live_nodes: usize,
    /// Highest `live_nodes` seen since the start or [`crate::Engine::reset_peak`],
    /// as the count stood when a node was recorded: it may include nodes that
    /// had just finished, which workers count out in groups of up to 64 ops
    /// (the count the backpressure bound applies to).
    pub peak_live_nodes: usize,
    /// Vars whose data is still allocated (handles or pending accesses left).
    pub live_vars: usize,
    /// Vars with handles left (that new nodes can still name).
    pub tracked_vars: usize,
    /// Elementwise CPU ops of record-time batches that were never computed:
    /// nothing could read their value when their batch was recorded (a
    /// `y = x + 1` whose `y` was dropped, say).
    pub elided_ops: u64,
    /// Record-time batches recorded, each as one node (counted once per op
    /// it holds in `recorded`).
    pub batches: u64,
}

/// Counts bumped on the hot paths (Relaxed: statistics only).
///
/// The counters a frontend bumps on every record and those that a worker or a
/// drop on another thread bumps sit on cache lines of their own: sharing a line
/// would move it between cores twice per node. Nodes completed are not counted
/// at all: they are the nodes recorded less the live ones.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) failed: AtomicU64,
    pub(crate) skipped: AtomicU64,
    pub(crate) flushes: AtomicU64,
    pub(crate) blockers: AtomicU64,
    pub(crate) implicit_blockers: AtomicU64,
    pub(crate) backpressure_stalls: AtomicU64,
    /// Raised where a Var is made (the frontend) and lowered where its
    /// storage dies (usually a worker): striped, see [`Striped`].
    pub(crate) live_vars: Striped,
    pub(crate) tracked_vars: Striped,
    pub(crate) elided_ops: AtomicU64,
    pub(crate) batches: AtomicU64,
}

impl Counters {
    #[inline]
    pub(crate) fn blocker(&self, implicit: bool) {
        let c = if implicit {
            &self.implicit_blockers
        } else {
            &self.blockers
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// `recorded` counts the nodes recorded (under the locks of the
    /// registry's shards, see `Registry::recorded`) and `live` reads the
    /// engine's count of live nodes, after it: a record counts itself live
    /// (SeqCst) before it counts itself recorded under its shard's lock, so
    /// `completed` never exceeds the nodes that finished.
    pub(crate) fn snapshot(
        &self,
        recorded: u64,
        live: impl FnOnce() -> usize,
        peak: usize,
    ) -> Stats {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let live_nodes = live();
        Stats {
            recorded,
            completed: recorded.saturating_sub(live_nodes as u64),
            failed: r(&self.failed),
            skipped: r(&self.skipped),
            flushes: r(&self.flushes),
            blockers: r(&self.blockers),
            implicit_blockers: r(&self.implicit_blockers),
            backpressure_stalls: r(&self.backpressure_stalls),
            live_nodes,
            peak_live_nodes: peak.max(live_nodes),
            live_vars: self.live_vars.sum(),
            tracked_vars: self.tracked_vars.sum(),
            elided_ops: r(&self.elided_ops),
            batches: r(&self.batches),
        }
    }
}

/// Slots of a [`Striped`] count.
const STRIPES: usize = 16;

/// A count that each thread raises and lowers in a slot of its own (by
/// thread number), summed when read.
///
/// Why: a Var is counted live on the thread that makes it and counted out
/// where its storage dies, which for a Var made per node is a worker. With
/// one counter its cache line moved between the two cores twice per Var: in
/// a `perf` profile of `node_cost dynamic_chain` the worker's decrement was
/// three quarters of the samples of the storage's drop, and the
/// frontend's increment over half of those of making the Var. A slot is
/// written by the threads of its number only.
///
/// A slot may hold more decrements than increments (a Var made on one
/// thread and dropped on another): each is read as a signed number, and a
/// sum taken while counts move, which may be short of one that has been
/// raised in a slot read before, is clamped at zero. At rest (after a
/// barrier, say) the sum is exact.
#[derive(Default)]
pub(crate) struct Striped([CachePadded<AtomicUsize>; STRIPES]);

impl Striped {
    #[inline]
    fn slot(&self) -> &AtomicUsize {
        &self.0[crate::sync::thread_number() % STRIPES]
    }

    /// Counts one more.
    #[inline]
    pub(crate) fn raise(&self) {
        self.slot().fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one fewer (wrapping within the slot).
    #[inline]
    pub(crate) fn lower(&self) {
        self.slot().fetch_sub(1, Ordering::Relaxed);
    }

    /// The count: the slots summed as signed numbers, at least zero.
    pub(crate) fn sum(&self) -> usize {
        let total = self
            .0
            .iter()
            .map(|s| s.load(Ordering::Relaxed) as isize)
            .fold(0isize, isize::wrapping_add);
        total.max(0) as usize
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::Striped;

    #[test]
    fn a_striped_count_sums_what_threads_raised_and_lowered_elsewhere() {
        let c = std::sync::Arc::new(Striped::default());
        // Raised on this thread, lowered on others: their slots go below
        // zero, and the sum is still the count.
        for _ in 0..1_000 {
            c.raise();
        }
        let lowerers: Vec<_> = (0..4)
            .map(|_| {
                let c = c.clone();
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        c.lower();
                    }
                })
            })
            .collect();
        for t in lowerers {
            t.join().unwrap();
        }
        assert_eq!(c.sum(), 200);
        // A read that sees more lowered than raised says zero.
        let short = Striped::default();
        std::thread::scope(|s| {
            s.spawn(|| short.lower());
        });
        assert_eq!(short.sum(), 0);
        short.raise();
        assert_eq!(short.sum(), 0);
        short.raise();
        assert_eq!(short.sum(), 1);
    }
}
