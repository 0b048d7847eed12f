//! The nodes each thread recorded, in record order: what `wait_all`,
//! backpressure and a retiring engine demand in Lazy mode, what DOT export
//! shows, and the memory of finished nodes that the next records reuse.
//!
//! One shard per recording thread (threads are spread over the shards
//! round-robin), locked for the whole record: the record takes a finished
//! node to record in and puts the new node at the back in one critical section,
//! uncontended unless another thread records into the same shard or a
//! barrier walks it.
//!
//! Why one list for both jobs: a node is reached by every list that holds it,
//! and the two lists this replaces (a registry of Lazy nodes and a bin of node
//! memory per thread) each cost a push, a reference and a pop or prune per
//! node; together they were about a fifth of the frontend's instructions for
//! an independent node (`wide` under callgrind).
//!
//! **Reuse.** A node is allocated by the frontend and its last reference
//! usually goes away on a worker (the dependent that held it finishes there).
//! With glibc's allocator that is a free into another thread's arena, and the
//! frontend's next allocation then takes the slow path; on a 1,000,000-node
//! chain the two took about a third of the time per node (measured by swapping
//! in another allocator). Taskflow pools its nodes for the same reason. Here:
//! a node whose only reference is the list's is reused in place (its count
//! proves that nobody else can reach it, checked again by `graph::record`),
//! so the memory stays with the thread that records. A record looks at the
//! oldest two nodes only (amortized O(1)); a finished node still referred to
//! elsewhere (the last writer of a Var, a task handle) leaves the list there,
//! and goes to [`NODES`] when its last reference goes, wherever that is
//! (`graph/node_ref.rs`); a record that finds no spare of its own takes
//! what that pool holds.
//!
//! **Demand.** Every node recorded and not finished is in a list until it
//! finishes (only finished nodes leave), so a barrier demands the nodes of
//! every shard, one by one, without walking their dependencies: see
//! [`Registry::demand_all`]. A shard remembers how far it was demanded, so
//! that a demand starts there; and in Lazy mode a recording thread that has
//! recorded [`lookahead`] ops since its shard was last demanded demands them
//! (`Shared::record_job`): they run while it records on.
//!
//! **Bounds.** A shard drops the finished nodes that something else holds
//! when it has doubled since the last time (amortized O(1)), keeping the
//! others as spares; `wait_all` keeps [`KEEP`] spares per shard and frees
//! what [`NODES`] holds (between barriers it holds no more nodes than a
//! program let go of since the last records took them). Unfinished
//! nodes are bounded by backpressure.
//!
//! Tried and not kept: `wait_all` keeping a backpressure bound of spares
//! (16,384) instead. Fewer instructions when a program records more than
//! that between barriers, but slower where it records fewer: cold memory
//! where the allocator hands back warm. The Async `dynamic_chain` of
//! `benches/scheduler.rs` took 670-790 ns per node against 440-480, and
//! `record_tensor_op` 250-350 ns per op against 215-250.

use super::{Job, NodeRef};
use crate::graph::NodePool;
use crate::sync::{lock, Mutex, MutexGuard};
use crossbeam_utils::CachePadded;
use std::collections::VecDeque;

const SHARDS: usize = 8;
/// Length of a shard at which it is first pruned.
const PRUNE_MIN: usize = 64;
/// Spares a shard keeps past `wait_all`, and room its lists keep when they
/// shrink.
pub(super) const KEEP: usize = 256;
/// Nodes a record looks at for a spare.
const SCAN: usize = 2;

/// Ops (nodes, each batched op counted) a Lazy recording thread records
/// undemanded before it demands them, for a backpressure high mark of `high`
/// (which counts ops too): an eighth of it, and at least 64.
///
/// Lazy mode ran nothing before a blocker, a barrier or the backpressure
/// stall, and the default low mark makes the stall wait until everything
/// recorded has finished: recording and running took turns, one core at a
/// time. Demanding a window of nodes once the recorder is that far ahead
/// lets the workers run them while it records the next, still far enough
/// behind it that the two seldom touch the same nodes. The frontend stays
/// ahead by the window: record-time batches, fusion and the values nothing
/// reads are decided as before. Measured in `docs/per-node-overhead.md`
/// ("A window of demanded nodes"): no window was best on every shape.
pub(super) fn lookahead(high: usize) -> usize {
    (high / 8).max(64)
}

pub(super) struct Shard {
    /// Nodes recorded into this shard, oldest first: every unfinished one,
    /// and finished ones not yet reused, moved to `spares` or dropped.
    nodes: VecDeque<NodeRef>,
    /// Finished nodes that nothing else refers to (nothing else can come to
    /// refer to them: only this list reaches them), moved here by a prune.
    spares: Vec<NodeRef>,
    prune_at: usize,
    /// Ops recorded into this shard (see [`Registry::recorded`]).
    recorded: u64,
    /// The nodes before this place in `nodes` were demanded (each one's
    /// dependencies too): a demand of the shard starts here.
    demanded: usize,
    /// Ops recorded into the shard since it was last demanded.
    since_demand: usize,
    /// The shard's number: the [`crate::graph::NodeMeta::group`] of the
    /// nodes recorded into it.
    pub(super) group: u32,
}

/// Whether only the list refers to `n` and it finished: its memory may be
/// reused.
fn reusable(n: &NodeRef) -> bool {
    NodeRef::strong_count(n) == 1 && n.is_done()
}

impl Shard {
    /// A finished node to record the next one in: a spare, or the oldest
    /// node if it is one; lets go of the oldest finished nodes that are
    /// shared.
    #[inline]
    pub(super) fn take(&mut self) -> Option<NodeRef> {
        if let Some(spare) = self.spares.pop() {
            return Some(spare);
        }
        for _ in 0..SCAN {
            let front = self.nodes.front()?;
            if !front.is_done() {
                return None;
            }
            // A finished node was demanded: it leaves the demanded part.
            self.demanded = self.demanded.saturating_sub(1);
            if reusable(front) {
                return self.nodes.pop_front();
            }
            self.nodes.pop_front();
        }
        None
    }

    /// Ops recorded into the shard since it was last demanded (some may
    /// have been demanded since by other means).
    #[inline]
    pub(super) fn undemanded(&self) -> usize {
        self.since_demand
    }

    /// Demands the nodes listed since the shard was last demanded (see
    /// `graph::demand_listed`, which needs every node before them demanded),
    /// handing out the ready ones through `ready`.
    pub(super) fn demand_rest(&mut self, ready: &mut impl FnMut(super::Ready)) {
        crate::graph::demand_listed(self.nodes.range(self.demanded..), ready);
        self.demanded = self.nodes.len();
        self.since_demand = 0;
    }

    /// Counts `ops` recorded.
    #[inline]
    pub(super) fn count(&mut self, ops: usize) {
        self.recorded += ops as u64;
        self.since_demand += ops;
    }

    /// Lists a node just recorded.
    #[inline]
    pub(super) fn push(&mut self, node: NodeRef) {
        if self.nodes.len() >= self.prune_at {
            self.prune(usize::MAX);
        }
        self.nodes.push_back(node);
    }

    /// Drops the finished nodes but up to `keep` spares in all (nodes nothing
    /// else refers to), which move to `spares`; the unfinished ones stay, in
    /// record order.
    fn prune(&mut self, keep: usize) {
        let nodes = self.nodes.make_contiguous();
        let mut stay = 0;
        let mut demanded = 0;
        for i in 0..nodes.len() {
            let n = &nodes[i];
            if !n.is_done() {
                nodes.swap(stay, i);
                stay += 1;
                if i < self.demanded {
                    demanded += 1;
                }
            } else if self.spares.len() < keep && NodeRef::strong_count(n) == 1 {
                self.spares.push(n.clone());
            }
        }
        self.nodes.truncate(stay);
        self.demanded = demanded;
        self.spares.truncate(keep);
        self.prune_at = (self.nodes.len() * 2).max(PRUNE_MIN);
        let room = self.nodes.len().max(KEEP);
        if self.nodes.capacity() > 4 * room {
            self.nodes.shrink_to(room);
        }
        if self.spares.capacity() > 4 * self.spares.len().max(KEEP) {
            self.spares.shrink_to(self.spares.len().max(KEEP));
        }
    }
}

/// Where a finished node goes when its last reference goes elsewhere than
/// a shard (see `graph/node_ref.rs`): a node that left its shard's list
/// while something else held it (the last writer of a live Var, a
/// dependent's list of dependencies) would be freed there, wherever that
/// is, and the next record allocate. One for every engine, as Taskflow's
/// pool of nodes: a node's memory is not an engine's.
pub(super) static NODES: NodePool<Job> = NodePool::new();

pub(crate) struct Registry {
    shards: [CachePadded<Mutex<Shard>>; SHARDS],
}

impl Default for Registry {
    fn default() -> Self {
        Registry {
            shards: std::array::from_fn(|i| {
                CachePadded::new(Mutex::new(Shard {
                    nodes: VecDeque::new(),
                    spares: Vec::new(),
                    prune_at: PRUNE_MIN,
                    recorded: 0,
                    demanded: 0,
                    since_demand: 0,
                    group: i as u32,
                }))
            }),
        }
    }
}

fn my_shard() -> usize {
    crate::sync::thread_number() % SHARDS
}

impl Registry {
    /// The calling thread's shard, locked: a record takes its spare and
    /// lists its node under this one lock.
    #[inline]
    pub(super) fn mine(&self) -> MutexGuard<'_, Shard> {
        lock(&self.shards[my_shard()])
    }

    /// A finished node to record the next one in: from `shard` (see
    /// [`Shard::take`]), else from [`NODES`], whose nodes all move to the
    /// shard's spares.
    #[inline]
    pub(super) fn take(&self, shard: &mut Shard) -> Option<NodeRef> {
        if let Some(n) = shard.take() {
            return Some(n);
        }
        // `take` found no spares: they are empty. The stack comes newest
        // first, and spares are taken from the back: turned around, so that
        // the node let go of last, the likeliest still in cache, goes first.
        shard.spares.extend(NODES.take_all());
        shard.spares.reverse();
        shard.spares.pop()
    }

    /// Demands every node listed (Lazy mode), shard by shard under that
    /// shard's lock (records on other threads go on), handing out the ones
    /// that become ready through `ready`.
    ///
    /// No walk of dependencies for a node that waits only for nodes of its
    /// own shard (`graph::demand_listed`). That misses nothing because every
    /// unfinished node recorded before the barrier began is listed (nodes
    /// leave a list only once finished), and the caller raised
    /// `global_demand` first, so that a node recorded since is demanded,
    /// with its dependencies, by its recorder (which reads `global_demand`
    /// and lists the node in one hold of its shard's lock: if it read zero,
    /// this walk locks the shard after it and finds the node).
    pub(super) fn demand_all(&self, ready: &mut impl FnMut(super::Ready)) {
        for shard in &self.shards {
            lock(shard).demand_rest(ready);
        }
    }

    /// Drops the finished nodes of every shard, keeping at most `keep`
    /// spares in each, and frees the nodes of [`NODES`].
    pub(super) fn prune(&self, keep: usize) {
        for shard in &self.shards {
            lock(shard).prune(keep);
        }
        // The spares dropped went to the pool: freed with the rest of it.
        drop(NODES.take_all());
    }

    /// Ops recorded so far, over every shard (each read under its lock).
    pub(crate) fn recorded(&self) -> u64 {
        self.shards.iter().map(|s| lock(s).recorded).sum()
    }

    /// The unfinished nodes, in record order per shard.
    pub(crate) fn snapshot(&self) -> Vec<NodeRef> {
        let mut out = Vec::new();
        for shard in &self.shards {
            let s = lock(shard);
            out.extend(s.nodes.iter().filter(|n| !n.is_done()).cloned());
        }
        out
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use crate::device::Device;
    use crate::engine::{device_lane, Access, Accesses, NodeRef};
    use crate::error::Location;
    use crate::graph::NodeMeta;
    use crate::{Engine, Mode, Var};

    /// Records a node that writes `x` (so that the nodes run in record
    /// order, each completed and let go of by the worker before the next).
    fn record(e: &Engine, x: &Var<()>) -> NodeRef {
        let meta = NodeMeta {
            name: "t",
            location: Location::caller(),
            lane: device_lane(Device::Cpu),
            weight: 1,
            group: 0,
        };
        let mut accesses = Accesses::new();
        accesses.push(Access {
            var: x.queue(),
            read: false,
            write: true,
        });
        e.shared()
            .record(meta, &mut accesses, || Ok(()), true)
            .unwrap()
            .expect("a handle was asked for")
    }

    #[test]
    fn a_finished_node_nothing_else_holds_is_recorded_in_again() {
        let e = Engine::builder()
            .mode(Mode::Lazy)
            .workers(1)
            .build()
            .unwrap();
        let x = e.var(());
        let a = record(&e, &x);
        let held = record(&e, &x);
        let a_at = a.key();
        drop(a);
        // The last writer of `x`: `a` and `held` finished before it did,
        // and the barrier returns once it has.
        let last = record(&e, &x);
        e.wait_all().unwrap();
        assert!(held.is_done());
        // `a` finished and only the list holds it: the next node is made in
        // its memory. `held` is not: a handle holds it.
        let b = record(&e, &x);
        assert_eq!(b.key(), a_at);
        // The barrier let go of `held`: only the handle refers to it now.
        assert_eq!(NodeRef::strong_count(&held), 1);
        e.wait_all().unwrap();
        assert!(last.is_done() && b.is_done());
    }

    /// Receives `n` messages from `rx` within a minute, or fails naming
    /// `what`.
    fn receive(rx: &std::sync::mpsc::Receiver<u32>, n: usize, what: &str) -> Vec<u32> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        (0..n)
            .map(|i| {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                rx.recv_timeout(left).unwrap_or_else(|_| {
                    panic!("{what}: {i} of {n} ran, and no more within a minute")
                })
            })
            .collect()
    }

    /// A Lazy engine of 2 workers with a bound of 1,024, and its window.
    fn windowed() -> (Engine, usize) {
        let e = Engine::builder()
            .mode(Mode::Lazy)
            .workers(2)
            .backpressure(1024, 0)
            .build()
            .unwrap();
        (e, super::lookahead(1024))
    }

    #[test]
    fn a_lazy_recorder_a_window_ahead_has_the_window_run_without_a_blocker() {
        let (e, window) = windowed();
        assert_eq!(window, 128);
        let (tx, rx) = std::sync::mpsc::channel();
        // Fewer than the high mark: no stall. Nothing waits, and nothing
        // reads what the tasks write.
        let tasks = 1000;
        for i in 0..tasks {
            let tx = tx.clone();
            e.task("window").push(move || _ = tx.send(i)).unwrap();
        }
        let whole = tasks as usize / window * window;
        let ran = receive(&rx, whole, "the demanded windows");
        assert_eq!(e.stats().backpressure_stalls, 0);
        assert_eq!(e.stats().flushes, 0);
        assert!(ran.iter().all(|&i| (i as usize) < whole));
        // The last, partial window waits for a blocker.
        assert!(rx.try_recv().is_err());
        e.wait_all().unwrap();
        assert_eq!(rx.try_iter().count(), tasks as usize % window);
    }

    #[test]
    fn a_window_that_waits_for_another_threads_undemanded_node_demands_it() {
        let (e, window) = windowed();
        let v = e.var(0u32);
        let (tx, rx) = std::sync::mpsc::channel();
        // Another thread writes `v`, undemanded, into its own shard.
        let (e2, v2) = (e.clone(), v.clone());
        let theirs = std::thread::spawn(move || {
            let mut t = e2.task("theirs");
            let w = t.write(&v2);
            t.push(move || *w.write() = 7).unwrap();
            super::my_shard()
        })
        .join()
        .unwrap();
        // This thread's window starts with a reader of `v`; a thread of
        // another shard records it (the shards are handed out round-robin).
        let mut recorded = false;
        for _ in 0..2 * super::SHARDS {
            let (e3, v3, tx3) = (e.clone(), v.clone(), tx.clone());
            recorded = std::thread::spawn(move || {
                if super::my_shard() == theirs {
                    return false;
                }
                let mut t = e3.task("reader");
                let r = t.read(&v3);
                let tx = tx3.clone();
                t.push(move || _ = tx.send(*r.read())).unwrap();
                for _ in 1..window {
                    e3.task("filler").push(|| {}).unwrap();
                }
                true
            })
            .join()
            .unwrap();
            if recorded {
                break;
            }
        }
        assert!(recorded, "no thread of another shard");
        assert_eq!(receive(&rx, 1, "the reader"), vec![7]);
        e.wait_all().unwrap();
    }
}
