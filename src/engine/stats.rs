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
    pub(crate) live_vars: CachePadded<AtomicUsize>,
    pub(crate) tracked_vars: CachePadded<AtomicUsize>,
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
            live_vars: self.live_vars.load(Ordering::Relaxed),
            tracked_vars: self.tracked_vars.load(Ordering::Relaxed),
            elided_ops: r(&self.elided_ops),
            batches: r(&self.batches),
        }
    }
}
