//! The dependency graph as a data structure, with no global structure and no
//! global lock: nodes that carry an atomic count of what they wait for, and one
//! access queue per Var.
//!
//! - **Recording** ([`record`]) locks only the queues of the Vars the node names
//!   (all of them at once, in address order, so that two threads recording at the
//!   same time are serialized on the Vars they share and can never wire a cycle).
//!   A queue remembers the Var's last writer and the readers since that write, so
//!   the node waits for exactly what it must: the last writer of what it reads
//!   (read-after-write), and the last writer plus the readers of what it writes
//!   (write-after-write, write-after-read). The new node joins each such
//!   node's list of dependents: slots of that node's own, claimed with one
//!   add and filled with a compare-and-swap (`dependents.rs`), with no lock
//!   or reference count per edge, and no allocation past a node's first few
//!   dependents (with the node's job and its count, below, the graph's
//!   `unsafe` code; see `README.md`).
//! - **The count** ([`Node::pending`]): unfinished dependencies, plus one while
//!   the node is being recorded, plus a bit until it is demanded (Lazy mode).
//!   Whoever brings it to zero hands the node out, exactly once.
//! - **Completing** ([`complete`]) touches only the finished node and its
//!   dependents' counts; the Var queues keep the finished writer (its outcome is
//!   the Var's poison) until the next write replaces it.
//! - **Demanding** ([`demand`]) walks the node's own dependency lists.
//! - **Running**: the node goes to the caller as a [`Ready`], of which there
//!   is one per recorded node; its holder takes the job and gives the spent
//!   job back without a lock.
//! - **Memory** ([`NodeRef`], `node_ref.rs`): a node counts its own
//!   references, and a finished node whose last reference goes, on any
//!   thread, goes back to the pool its recorder named, for the next records.
//!
//! Why per-node dependents and not a FIFO of waiting accesses per Var (MXNet's
//! ThreadedVar): the edges are exact, a completion releases its dependents without
//! visiting any Var, and the demand walk of Lazy mode needs the dependency lists
//! anyway. The protocol is written up in `README.md` beside this file.
//!
//! Everything here is generic over the job payload `J`, so it is unit-tested with
//! fake jobs and model-checked with loom; the graph knows nothing of devices
//! (DOT labels come from the caller).

mod analysis;

use crate::error::{Error, Location, SharedError};
use crate::sync::{
    fence_seq_cst, get_mut, lock, Arc, AtomicBool, AtomicU32, AtomicUsize, Condvar, Mutex,
    MutexGuard, Ordering, UnsafeCell,
};
use smallvec::SmallVec;

pub(crate) use analysis::to_dot;

mod dependents;
mod node_ref;
use dependents::Dependents;
pub(crate) use node_ref::{NodePool, NodeRef};

/// What a node is, for errors, traces and DOT export.
#[derive(Clone, Copy, Debug)]
pub(crate) struct NodeMeta {
    pub(crate) name: &'static str,
    pub(crate) location: Location,
    /// An opaque number the engine gives the node (the device it runs on); the
    /// graph only passes it to the caller's label function.
    pub(crate) lane: u32,
    /// How many ops the node stands for: 1, or the ops of a record-time batch
    /// (the engine's live count and backpressure count ops, not nodes).
    pub(crate) weight: u32,
    /// An opaque number the engine gives the node: the list it keeps the
    /// node in (see [`demand_listed`]).
    pub(crate) group: u32,
}

/// How a node ended.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// It ran and succeeded.
    Done,
    /// It ran and failed with this message (a panic, a kernel error).
    Failed(String),
    /// It did not run: an input was poisoned by this earlier failure.
    Skipped(SharedError),
}

/// The bit of a [`Link::key`] that says the node reads what that dependency
/// writes (a failure there skips it). Node addresses are aligned, so the bit
/// is free.
const READS: usize = 1;

/// One of a node's dependencies, as the node joined its list of dependents
/// (see `dependents.rs`).
pub(crate) struct Link {
    /// The dependency's address, with [`READS`] set if the node reads what
    /// it writes (fixed once the node is filled, read without the lock).
    key: usize,
}

impl Link {
    fn new(key: usize) -> Self {
        Link { key }
    }

    /// The dependency's address (its [`Node::key`]).
    #[inline]
    fn dep(&self) -> usize {
        self.key & !READS
    }

    /// Whether the node reads what the dependency writes.
    #[inline]
    fn reads(&self) -> bool {
        self.key & READS != 0
    }
}

/// Dependencies above which [`Node::fill`] makes room for all at once, and
/// finds one met twice in a table instead of a search.
const MANY_DEPS: usize = 8;

/// Slots of that table (a power of two): used for up to half as many
/// dependencies, so that a probe stays short.
const SEEN_SLOTS: usize = 128;

/// A node's slot in the table of [`Node::fill`]: Fibonacci hashing of its
/// address (whose low bits are all zero).
fn seen_slot(key: usize) -> usize {
    (((key as u64) >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - SEEN_SLOTS.trailing_zeros()))
        as usize
}

/// A node a record conflicts with, as the walk of its Var queues meets it:
/// still held by the queue (the last writer of a Var it only reads), or
/// taken from it (the last writer and the readers of a Var it writes, which
/// the new node replaces there). A taken reference moves into the node's
/// dependencies: cloning it there and dropping it from the queue were two
/// locked instructions per such dependency.
enum Met<'a, J> {
    Held(&'a NodeRef<J>),
    Taken(NodeRef<J>),
}

impl<J> Met<'_, J> {
    #[inline(always)]
    fn key(&self) -> usize {
        match self {
            Met::Held(n) => n.key(),
            Met::Taken(n) => n.key(),
        }
    }
}

/// Adds `d` to a node's dependencies, or marks the one at `found` (the same
/// node) as read from when `reads`.
#[inline(always)]
fn add_dep<J>(
    deps: &mut SmallVec<[NodeRef<J>; 2]>,
    links: &mut SmallVec<[Link; 2]>,
    found: Option<usize>,
    d: Met<'_, J>,
    reads: bool,
) {
    let bit = if reads { READS } else { 0 };
    match found {
        Some(i) => links[i].key |= bit,
        None => {
            links.push(Link::new(d.key() | bit));
            deps.push(match d {
                Met::Held(n) => n.clone(),
                Met::Taken(n) => n,
            });
        }
    }
}

/// The walk of [`Node::fill`] over the locked queues of its accesses: `add`
/// meets each unfinished node it conflicts with (and whether it reads what
/// that node writes), `writes` gets the Vars it writes, and `skip` the poison
/// of the first Var it reads that a failed node left behind. The queues of
/// the Vars it writes are left without a last writer and readers: the
/// caller makes the node their last writer before it lets go of them.
#[inline(always)]
fn walk<J>(
    accesses: &[Access<'_, J>],
    guards: &mut [MutexGuard<'_, VarState<J>>],
    writes: &mut SmallVec<[usize; 2]>,
    skip: &mut Option<SharedError>,
    mut add: impl FnMut(Met<'_, J>, bool),
) {
    for (a, v) in accesses.iter().zip(guards.iter_mut()) {
        v.settle();
        let v = &mut **v;
        let writer = if a.write {
            v.last_writer.take().map(Met::Taken)
        } else {
            v.last_writer.as_ref().map(Met::Held)
        };
        match writer {
            Some(w) => add(w, a.read),
            None => {
                if a.read && skip.is_none() {
                    skip.clone_from(&v.poison);
                }
            }
        }
        if a.write {
            writes.push(a.var.key());
            // Finished readers are let go of here, under the lock, as the
            // queue's clearing did. (No drain of an empty list: most written
            // Vars are new outputs.)
            if !v.readers.is_empty() {
                for r in v.readers.drain(..) {
                    if !r.is_done() {
                        add(Met::Taken(r), false);
                    }
                }
            }
        }
    }
}

/// One unit of [`Node::pending`] held while the node is being recorded.
const RECORDING: u32 = 1;
/// The bit of [`Node::pending`] set until the node is demanded: the first
/// demand clears it with one `fetch_and`, which both marks the node and
/// tells whether that made it ready (a flag of its own and a decrement were
/// two locked instructions per node, about 8 ns each on some machines).
const UNDEMANDED: u32 = 1 << 31;

/// Clears [`UNDEMANDED`]: `None` if the node was demanded before, else
/// whether it is ready now (the caller hands it out).
#[inline]
fn take_demand<J>(n: &Node<J>) -> Option<bool> {
    let old = n.pending.fetch_and(!UNDEMANDED, Ordering::AcqRel);
    (old & UNDEMANDED != 0).then_some(old == UNDEMANDED)
}

/// A node's job until it is taken to run, then the spent job, whose box the
/// next node recorded in the same memory may reuse. No lock: one thread at a
/// time reaches it, each after the one before (see `README.md`): the
/// recorder filling the node, the one thread the node is handed out to
/// ([`Ready::take_job`], [`Ready::give_back`]), and a recorder that reuses the
/// node once nobody else holds it. A lock here was two locked instructions
/// per node, about 15 ns on some machines.
struct JobSlot<J>(UnsafeCell<Option<J>>);

// SAFETY: one thread at a time reaches the job (above), and `J: Send` lets it
// move from one to the next.
unsafe impl<J: Send> Sync for JobSlot<J> {}

impl<J> JobSlot<J> {
    /// The job, reached through `&mut` (the recorder filling or reusing the
    /// node).
    #[inline]
    fn get_mut(&mut self) -> &mut Option<J> {
        // SAFETY: `&mut self`: nothing else reaches the cell.
        self.0.with_mut(|j| unsafe { &mut *j })
    }
}

/// One operation in the graph.
///
/// `repr(C)`, in this order: what another thread's record or completion
/// touches on a node it depends on or releases (the count of references, the
/// count of what it waits for, the flags and the first slots of the list of
/// dependents) comes first, in the first cache line; the fields only the node's own
/// recorder and runner reach come after. With the compiler's order, a
/// record that named the node as a dependency read `done`, pushed onto
/// `dependents` and took a reference through `refs` on three lines (offsets
/// 276, 48 and 208 of 288), each a miss for a node recorded long ago: the
/// first of them was half of `Node::fill`'s samples in a `perf` profile of
/// `node_cost tree`.
#[repr(C)]
pub(crate) struct Node<J> {
    /// References to the node (see [`NodeRef`]).
    refs: AtomicUsize,
    /// Unfinished dependencies, plus [`RECORDING`] until [`record`] is done
    /// wiring the node, plus the bit [`UNDEMANDED`] until [`demand`] reaches
    /// it. AcqRel: the thread that brings it to zero hands the node out and
    /// must see what every earlier change published (the `skip` set before
    /// it).
    pending: AtomicU32,
    /// Set (Release) by [`Finished::wake`], once the caller of [`complete`] has
    /// also counted the node out: whoever sees it set sees the node entirely
    /// finished (its outcome, its dependents released, the engine's count).
    /// Read (Acquire) without the lock by recorders and blockers.
    done: AtomicBool,
    /// Set by a blocker registering its latch before it reads `done` again, and
    /// read by [`Finished::wake`] after it set `done`, with a SeqCst fence
    /// between each store and load (Dekker-style): one of the two sees the
    /// other, so a latch is either taken and set by the waker or not waited on.
    has_waiters: AtomicBool,
    /// Whether it failed or was skipped (Release, before the dependent list
    /// closes), so that a recorder locks `state` only to fetch an error that
    /// exists.
    failed: AtomicBool,
    /// Whether an input's failure was stored in `State::skip` (set under the
    /// lock before the unit of the one storing it is removed, so seen by the
    /// thread the node is handed out to), so that [`Ready::take_job`] locks
    /// only to fetch a failure that exists.
    skipped: AtomicBool,
    /// Whether the node holds the strong count of its links: taken by
    /// [`record`] before it fills its first slot in a list of dependents, and given up (or
    /// handed out with the node) by whoever brings [`Node::pending`] to
    /// zero.
    linked: AtomicBool,
    /// The nodes waiting for this one, in slots of the node's own
    /// (`dependents.rs`): a recorder claims one and fills it, and
    /// [`complete`] closes the list (a recorder that finds it closed counts
    /// the node out instead of joining). Each waiting node is held by one
    /// strong count of its own while it is in any list ([`Node::linked`]).
    /// Placed after the flags: the count of claims and the first slots share
    /// the first cache line with them.
    dependents: Dependents,
    /// Whether it waits for a node of another [`NodeMeta::group`] (fixed
    /// when filled): [`demand_listed`] walks its dependencies.
    outside: bool,
    /// The pool the node goes back to when its last reference goes, if it
    /// finished (see `node_ref.rs`).
    home: Home<J>,
    /// The next node in its pool's stack, while it is in one.
    pool_next: std::sync::atomic::AtomicPtr<Node<J>>,
    pub(crate) meta: NodeMeta,
    job: JobSlot<J>,
    /// The Vars it writes, by address (deadlock checks of blockers).
    writes: SmallVec<[usize; 2]>,
    /// The nodes it waited for when recorded, in the order of `State::deps`
    /// (their keys are fixed, read without the lock; compared only with
    /// nodes the caller holds, whose addresses no other node can have
    /// taken).
    links: SmallVec<[Link; 2]>,
    state: Mutex<State<J>>,
}

/// The pool a node goes back to: a `static`'s address, or none.
#[derive(Clone, Copy)]
struct Home<J>(Option<std::ptr::NonNull<NodePool<J>>>);

// SAFETY: the address of a `static` (`NodePool` is `Sync`: an atomic
// pointer), reached from any thread.
unsafe impl<J> Send for Home<J> {}
// SAFETY: as above.
unsafe impl<J> Sync for Home<J> {}

struct State<J> {
    /// The failure of an input: the node is skipped instead of run.
    skip: Option<SharedError>,
    /// The node's own failure, once it completed.
    err: Option<SharedError>,
    /// Nodes this one waits for (the demand walk and deadlock checks follow
    /// them); cleared on completion, so finished nodes do not hold a chain.
    /// They also keep alive the nodes whose lists of dependents the node joined.
    deps: SmallVec<[NodeRef<J>; 2]>,
    /// Blockers to wake on completion.
    waiters: SmallVec<[Arc<Latch>; 1]>,
}

impl<J> Node<J> {
    /// A node with no job, as if finished: [`Node::fill`] makes it a new one.
    fn blank(meta: NodeMeta, home: Option<&'static NodePool<J>>) -> Self {
        Node {
            meta,
            pending: AtomicU32::new(0),
            done: AtomicBool::new(true),
            has_waiters: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            skipped: AtomicBool::new(false),
            job: JobSlot(UnsafeCell::new(None)),
            dependents: Dependents::closed(),
            linked: AtomicBool::new(false),
            outside: false,
            writes: SmallVec::new(),
            links: SmallVec::new(),
            state: Mutex::new(State {
                skip: None,
                err: None,
                deps: SmallVec::new(),
                waiters: SmallVec::new(),
            }),
            refs: AtomicUsize::new(0),
            home: Home(home.map(std::ptr::NonNull::from)),
            pool_next: std::sync::atomic::AtomicPtr::new(std::ptr::null_mut()),
        }
    }

    /// Makes this node (new, or finished and reached by nobody else) the one
    /// recorded for `accesses`, whose queues are locked in `guards`: it waits
    /// for the unfinished nodes it conflicts with, and its count is theirs
    /// plus `hold` (the units of [`RECORDING`] and [`UNDEMANDED`] it starts
    /// with: it starts demanded when `hold` has no [`UNDEMANDED`] bit).
    fn fill(
        &mut self,
        meta: NodeMeta,
        job: J,
        hold: u32,
        accesses: &[Access<'_, J>],
        guards: &mut [MutexGuard<'_, VarState<J>>],
        most_deps: usize,
    ) {
        self.meta = meta;
        self.done.store(false, Ordering::Relaxed);
        self.has_waiters.store(false, Ordering::Relaxed);
        self.failed.store(false, Ordering::Relaxed);
        *self.job.get_mut() = Some(job);
        self.dependents.reopen();
        self.linked.store(false, Ordering::Relaxed);
        self.writes.clear();
        self.links.clear();
        let st = get_mut(&mut self.state);
        st.skip = None;
        st.err = None;
        // Emptied when the node completed (its lists) and woke (its waiters).
        debug_assert!(st.deps.is_empty() && st.waiters.is_empty());
        // Room made once for a node of many accesses (or dependencies), which
        // would otherwise grow each list by reallocation, costlier than the
        // rest of the record. Not for a few: `most_deps` is a bound, and room
        // made for 3 of which 2 were needed spilled lists that fit in place.
        if most_deps > MANY_DEPS {
            st.deps.reserve(most_deps);
            self.links.reserve(most_deps);
        }
        // A dependency met twice (the last writer of one Var and a reader of
        // another, say) is added once: found by a search of the list for a
        // few, by a small table of their places for many (the search was a
        // tenth of the instructions of `many_reads`, about 20 per node). Two
        // copies of the walk, so that the few pay nothing for the table.
        let (deps, skip, links) = (&mut st.deps, &mut st.skip, &mut self.links);
        let writes = &mut self.writes;
        if most_deps > MANY_DEPS && most_deps <= SEEN_SLOTS / 2 {
            let mut places = [0u32; SEEN_SLOTS];
            walk(
                accesses,
                guards,
                writes,
                skip,
                #[inline(always)]
                |d, reads| {
                    let key = d.key();
                    let mut h = seen_slot(key);
                    let found = loop {
                        match places[h] {
                            0 => {
                                places[h] = links.len() as u32 + 1;
                                break None;
                            }
                            p if links[p as usize - 1].dep() == key => break Some(p as usize - 1),
                            _ => h = (h + 1) % SEEN_SLOTS,
                        }
                    };
                    add_dep(deps, links, found, d, reads);
                },
            );
        } else {
            walk(
                accesses,
                guards,
                writes,
                skip,
                #[inline(always)]
                |d, reads| {
                    let key = d.key();
                    let found = links.iter().position(|l| l.dep() == key);
                    add_dep(deps, links, found, d, reads);
                },
            );
        }
        self.outside = st.deps.iter().any(|d| d.meta.group != meta.group);
        // A Var read that a failed write poisoned skips the node.
        self.skipped.store(st.skip.is_some(), Ordering::Relaxed);
        self.pending
            .store(st.deps.len() as u32 + hold, Ordering::Relaxed);
    }

    /// Whether the node has completed (Acquire: its outcome is visible then).
    #[inline]
    pub(crate) fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Its failure (or the failure that made it skip), once it completed.
    pub(crate) fn error(&self) -> Option<SharedError> {
        if self.failed.load(Ordering::Acquire) {
            lock(&self.state).err.clone()
        } else {
            None
        }
    }

    /// Whether it writes the Var whose queue is at `var` (see [`VarQueue::key`]).
    pub(crate) fn writes(&self, var: usize) -> bool {
        self.writes.contains(&var)
    }

    /// The node's address: equal for every reference to the same node.
    #[inline]
    pub(crate) fn key(&self) -> usize {
        self as *const Self as *const () as usize
    }

    /// Notes an input's failure, which makes the node skip instead of run;
    /// before the unit of the one noting it is removed.
    fn set_skip(&self, s: &mut State<J>, err: &SharedError) {
        if s.skip.is_none() {
            s.skip = Some(err.clone());
            self.skipped.store(true, Ordering::Relaxed);
        }
    }

    /// Registers `latch` to be set when the node completes. Returns false (and
    /// registers nothing) if it already has.
    pub(crate) fn add_waiter(&self, latch: &Arc<Latch>) -> bool {
        let mut s = lock(&self.state);
        if self.done.load(Ordering::Relaxed) {
            return false;
        }
        s.waiters.push(latch.clone());
        self.has_waiters.store(true, Ordering::Relaxed);
        fence_seq_cst();
        if self.done.load(Ordering::Relaxed) {
            // The waker may have looked for waiters before this one came.
            s.waiters.pop();
            return false;
        }
        true
    }

    /// The nodes it waits for that have not finished.
    pub(crate) fn deps(&self) -> SmallVec<[NodeRef<J>; 2]> {
        let s = lock(&self.state);
        s.deps.iter().filter(|d| !d.is_done()).cloned().collect()
    }

    /// Whether it waited for `other` directly when it was recorded (`other`
    /// held by the caller).
    #[cfg(test)]
    pub(crate) fn waits_for(&self, other: &Node<J>) -> bool {
        self.links.iter().any(|l| l.dep() == other.key())
    }

    /// Whether it was demanded (or is a finished node's memory).
    pub(crate) fn is_demanded(&self) -> bool {
        self.pending.load(Ordering::Acquire) & UNDEMANDED == 0
    }

    /// [`Node::is_demanded`], Relaxed: for walks that only skip work by it.
    #[inline]
    fn seen_demanded(&self) -> bool {
        self.pending.load(Ordering::Relaxed) & UNDEMANDED == 0
    }
}

/// A node handed out to run. Only the graph makes one, as it hands the node
/// out (the thread that brings the node's count to zero does, once per
/// recorded node), and it cannot be cloned: its holder alone reaches the
/// node's job, without a lock (see [`JobSlot`]). It derefs to the node.
pub(crate) struct Ready<J>(NodeRef<J>);

impl<J> std::ops::Deref for Ready<J> {
    type Target = NodeRef<J>;

    #[inline]
    fn deref(&self) -> &NodeRef<J> {
        &self.0
    }
}

impl<J> Ready<J> {
    /// Takes the job to run it, with the failure that makes it skip instead.
    /// `None` if it was taken already.
    pub(crate) fn take_job(&self) -> Option<(J, Option<SharedError>)> {
        let node = &self.0;
        // SAFETY: only the holder of the node's one `Ready` reaches the
        // job, and the hand-out happened after the fill (the count's AcqRel
        // decrements, then the queues of the pool).
        let job = node.job.0.with_mut(|j| unsafe { (*j).take() })?;
        // Acquire (Relaxed would do: the hand-out follows every store).
        let skip = if node.skipped.load(Ordering::Acquire) {
            lock(&node.state).skip.clone()
        } else {
            None
        };
        Some((job, skip))
    }

    /// Gives the job back after it ran: its allocation may hold the job of
    /// the next node recorded in this node's memory (see [`record`], which
    /// reuses it only once nobody else holds the node: this `Ready` is let
    /// go of first).
    pub(crate) fn give_back(&self, spent: J) {
        // SAFETY: as in `take_job`.
        self.0.job.0.with_mut(|j| unsafe { *j = Some(spent) });
    }
}

/// The access queue of one Var: its last writer and the readers since.
pub(crate) struct VarQueue<J> {
    inner: Mutex<VarState<J>>,
    /// Open record-time batches that name the Var (see `tensor/batch.rs`):
    /// while it is above zero, whoever records an access to the Var or waits
    /// for it closes those batches first. SeqCst: a batch raises it before it
    /// lets go of its lock, and lowers it only after recording its node.
    held: AtomicU32,
}

struct VarState<J> {
    /// The node that writes the Var last. Kept after it finished (until the
    /// next write, or until a record or blocker finds it finished and moves its
    /// outcome to `poison`): its outcome is the Var's.
    last_writer: Option<NodeRef<J>>,
    /// Nodes that read the Var since its last write (some may have finished).
    readers: SmallVec<[NodeRef<J>; 2]>,
    /// Length of `readers` at which finished readers are pruned (amortized O(1)).
    prune_at: usize,
    /// The failure that poisons the value when there is no last writer: the
    /// last one's, moved here, or one given at creation.
    poison: Option<SharedError>,
}

const PRUNE_MIN: usize = 8;

impl<J> Default for VarQueue<J> {
    fn default() -> Self {
        VarQueue::new(None)
    }
}

impl<J> VarQueue<J> {
    /// A queue with no accesses yet, poisoned from the start if `poison` is set
    /// (a value rejected at record time by an op that cannot return `Err`).
    pub(crate) fn new(poison: Option<SharedError>) -> Self {
        VarQueue {
            inner: Mutex::new(VarState {
                last_writer: None,
                readers: SmallVec::new(),
                prune_at: PRUNE_MIN,
                poison,
            }),
            held: AtomicU32::new(0),
        }
    }

    /// Notes that an open batch names the Var.
    pub(crate) fn hold(&self) {
        self.held.fetch_add(1, Ordering::SeqCst);
    }

    /// [`VarQueue::hold`] for the Var of a new value that no other thread
    /// can reach yet (nothing held it before): a plain store. Whoever gets
    /// the Var later gets it through something that orders this store
    /// before (the batch's lock, the handing over of the handle).
    pub(crate) fn hold_new(&self) {
        debug_assert_eq!(self.held.load(Ordering::Relaxed), 0, "a new Var");
        self.held.store(1, Ordering::Relaxed);
    }

    /// Notes that a batch that named the Var has recorded its node.
    pub(crate) fn release(&self) {
        self.held.fetch_sub(1, Ordering::SeqCst);
    }

    /// Whether an open batch names the Var.
    #[inline]
    pub(crate) fn is_held(&self) -> bool {
        self.held.load(Ordering::SeqCst) > 0
    }

    /// The queue's address: identifies the Var in [`Node::writes`].
    #[inline]
    pub(crate) fn key(&self) -> usize {
        self as *const Self as *const () as usize
    }

    /// The unfinished node a reader of the Var must wait for, if any.
    pub(crate) fn writer(&self) -> Option<NodeRef<J>> {
        let mut v = lock(&self.inner);
        v.settle();
        v.last_writer.clone()
    }

    /// Every unfinished node a writer of the Var must wait for.
    pub(crate) fn accessors(&self) -> SmallVec<[NodeRef<J>; 4]> {
        let mut v = lock(&self.inner);
        v.settle();
        let mut out: SmallVec<[NodeRef<J>; 4]> = v.last_writer.iter().cloned().collect();
        out.extend(v.readers.iter().filter(|r| !r.is_done()).cloned());
        out
    }

    /// The failure that poisons the value, as of the writes finished so far.
    pub(crate) fn poison(&self) -> Option<SharedError> {
        let mut v = lock(&self.inner);
        v.settle();
        match &v.last_writer {
            Some(_) => None,
            None => v.poison.clone(),
        }
    }
}

impl<J> VarState<J> {
    /// Moves a finished last writer's outcome to `poison` and lets it go.
    #[inline(always)]
    fn settle(&mut self) {
        if self.last_writer.as_ref().is_some_and(|w| w.is_done()) {
            let w = self.last_writer.take().expect("checked");
            self.poison = w.error();
        }
    }
}

/// The Vars a node being recorded names. Inline up to 4: inline up to 16
/// (and the locks taken over them), `many_reads` ran 1% fewer instructions
/// and `chain` 13% more (the list is moved, and the locks' list made, for
/// every record).
pub(crate) type Accesses<'a, J> = SmallVec<[Access<'a, J>; 4]>;

/// One Var named by a node being recorded.
pub(crate) struct Access<'a, J> {
    pub(crate) var: &'a VarQueue<J>,
    pub(crate) read: bool,
    pub(crate) write: bool,
}

/// Records a node that makes `accesses` (a Var may appear twice, as a read and
/// as a write: the two merge) and wires it after exactly the unfinished nodes it
/// conflicts with. `demanded`: the node counts as demanded from the start (Async
/// and Sync modes, where every earlier node was demanded too); otherwise it waits
/// for [`demand`].
///
/// `spare`: a finished node nothing else refers to any more, whose memory the
/// new node reuses (see `engine/registry.rs`); it is checked here, and a node
/// still shared or unfinished is left alone and a new one allocated. `job`
/// makes the node's job from the spare's spent job, if it is reused and one
/// was given back (its allocation may hold the new job).
///
/// Returns the node, and the node handed out if it is ready now.
pub(crate) fn record<J>(
    meta: NodeMeta,
    accesses: &mut Accesses<'_, J>,
    job: impl FnOnce(Option<J>) -> J,
    demanded: bool,
    spare: Option<NodeRef<J>>,
    home: Option<&'static NodePool<J>>,
) -> (NodeRef<J>, Option<Ready<J>>) {
    // The one check that the spare is ours: `unique` proves nobody else can
    // reach it, and the reference it gives is held until the node is filled.
    let mut spare = spare;
    let mut slot = spare
        .as_mut()
        .and_then(unique)
        .filter(|n| n.done.load(Ordering::Relaxed));
    // Made before any lock is taken: it may allocate.
    let job = job(slot.as_mut().and_then(|n| n.job.get_mut().take()));

    // Address order, duplicates merged: every recorder locks shared Vars in the
    // same order, so two records that share Vars are serialized, never crossed.
    if accesses.len() > 1 {
        accesses.sort_unstable_by_key(|a| a.var.key());
        accesses.dedup_by(|later, kept| {
            if later.var.key() == kept.var.key() {
                kept.read |= later.read;
                kept.write |= later.write;
                true
            } else {
                false
            }
        });
    }
    let mut guards: SmallVec<[MutexGuard<'_, VarState<J>>; 4]> =
        SmallVec::with_capacity(accesses.len());
    let mut most_deps = 0;
    for a in accesses.iter() {
        let v = lock(&a.var.inner);
        most_deps += 1 + if a.write { v.readers.len() } else { 0 };
        guards.push(v);
    }

    // A spare is filled in place, field by field: building a new node and
    // moving it over the spare dropped the old one's lists and copied the
    // whole node, a third of the record's instructions.
    let hold = RECORDING + if demanded { 0 } else { UNDEMANDED };
    let node = match slot {
        Some(slot) => {
            slot.fill(meta, job, hold, accesses, &mut guards, most_deps);
            spare.expect("matched above")
        }
        None => {
            // Filled in its box: filled on the stack and then boxed, the
            // node (about 300 bytes) was copied three times: about 65 of
            // the 1,960 instructions per node of the frontend of `node_cost
            // tree 16`.
            let mut fresh = NodeRef::new(Node::blank(meta, home));
            unique(&mut fresh)
                .expect("a new node has one reference")
                .fill(meta, job, hold, accesses, &mut guards, most_deps);
            fresh
        }
    };
    for (a, v) in accesses.iter().zip(guards.iter_mut()) {
        if a.write {
            v.last_writer = Some(node.clone());
            v.readers.clear();
            v.prune_at = PRUNE_MIN;
        } else {
            if v.readers.len() >= v.prune_at {
                v.readers.retain(|r| !r.is_done());
                v.prune_at = (v.readers.len() * 2).max(PRUNE_MIN);
            }
            v.readers.push(node.clone());
        }
    }
    drop(guards);

    // Join each dependency's list, or count it out if it finished meanwhile
    // (its outcome is final then: a failed writer of an input skips the
    // node). A slot claimed with one add and filled with a compare-and-swap
    // (`dependents.rs`): no lock, no allocation past a dependency's first
    // few dependents, and no reference per edge; the node is held for all
    // its lists by one strong count, taken before it fills its first slot.
    // A demand that reaches the node meanwhile sees every dependency: they
    // were fixed before its Vars' queues let go.
    let me = NodeRef::as_ptr(&node) as usize;
    let mut released = RECORDING;
    let mut skip = None;
    let mut linked = false;
    for link in node.links.iter() {
        // SAFETY: the key is a dependency's address, and `deps` holds that
        // dependency until this node completes, which waits for the
        // RECORDING unit released below.
        let d = unsafe { &*(link.dep() as *const Node<J>) };
        let joined = d.dependents.join(me | (link.key & READS), || {
            if !linked {
                let _count = NodeRef::into_raw(node.clone());
                node.linked.store(true, Ordering::Relaxed);
                linked = true;
            }
        });
        if !joined {
            if link.reads() && skip.is_none() && d.failed.load(Ordering::Acquire) {
                skip.clone_from(&lock(&d.state).err);
            }
            released += 1;
        }
    }
    if let Some(e) = &skip {
        node.set_skip(&mut lock(&node.state), e);
    }
    let ready = node.pending.fetch_sub(released, Ordering::AcqRel) == released;
    if ready {
        // Every list released the node (or it joined none): the lists' count goes.
        let_go_of_links(&node);
        let handed = Ready(node.clone());
        return (node, Some(handed));
    }
    (node, None)
}

/// The node behind `n` if `n` is its only reference (`Arc::get_mut`).
#[inline]
fn unique<J>(n: &mut NodeRef<J>) -> Option<&mut Node<J>> {
    if !NodeRef::is_unique(n) {
        return None;
    }
    // SAFETY: the only reference, held mutably: nothing else reaches the
    // node while the returned borrow lives, and `is_unique`'s Acquire
    // ordered what every earlier holder did before.
    Some(unsafe { &mut *NodeRef::as_ptr(n).cast_mut() })
}

/// Gives up the strong count a node held for its lists of dependents, if it took one; by
/// whoever brought its count to zero through something else than a list
/// (which hands the count out instead), while holding a reference of its
/// own.
#[inline]
fn let_go_of_links<J>(node: &NodeRef<J>) {
    // Relaxed: the caller's AcqRel decrement to zero follows the recorder's
    // last decrement, which followed the store.
    if node.linked.load(Ordering::Relaxed) {
        // SAFETY: the count taken in `record` with `NodeRef::into_raw`, given up
        // once: only by the one that brought the count to zero.
        unsafe { NodeRef::decrement_strong_count(NodeRef::as_ptr(node)) };
    }
}

/// Marks `roots` and every unfinished node they wait for as demanded and hands
/// out (through `ready`) those that are ready. Stops at nodes demanded before:
/// a demanded node's dependencies are demanded too, by whoever demanded it
/// (or, for [`demand_listed`], by the barrier under way, which does not stop
/// before it has demanded every node), so each node is walked once over its
/// life.
///
/// The roots are walked one after the other in the order given, each with
/// what it waits for: given oldest first (record order), the first
/// nodes handed out can run while the walk goes on, instead of after it.
pub(crate) fn demand<J>(roots: &[NodeRef<J>], ready: &mut impl FnMut(Ready<J>)) -> usize {
    let mut marked = 0;
    let mut stack: SmallVec<[NodeRef<J>; 16]> = SmallVec::new();
    for root in roots {
        if !root.is_done() && !root.seen_demanded() {
            stack.push(root.clone());
            marked += demand_from(&mut stack, ready);
        }
    }
    marked
}

/// Marks `nodes` as demanded and hands out (through `ready`) those that are
/// ready. Returns how many it marked.
///
/// `nodes` are the nodes of one [`NodeMeta::group`] in record order (the
/// engine's list of a recording thread, `engine/registry.rs`), or the end of
/// such a list whose earlier nodes were all demanded. A node that waits only
/// for nodes of its own group is marked by itself, one atomic operation: its
/// dependencies come before it in the list, so they were demanded before or
/// in this call. A node that waits for a node of another group is walked as
/// [`demand`] walks (which locks each node that waits for something, to read
/// its list): that dependency may not be demanded yet, and a demanded node's
/// dependencies must be, or a blocker's walk that stops at the node would
/// leave them waiting.
pub(crate) fn demand_listed<'a, J: 'a>(
    nodes: impl Iterator<Item = &'a NodeRef<J>>,
    ready: &mut impl FnMut(Ready<J>),
) -> usize {
    let mut marked = 0;
    let mut stack: SmallVec<[NodeRef<J>; 16]> = SmallVec::new();
    for n in nodes {
        if n.is_done() || n.seen_demanded() {
            continue;
        }
        if n.outside {
            stack.push(n.clone());
            marked += demand_from(&mut stack, ready);
            continue;
        }
        let Some(now_ready) = take_demand(n) else {
            continue;
        };
        marked += 1;
        if now_ready {
            let_go_of_links(n);
            ready(Ready(n.clone()));
        }
    }
    marked
}

/// The walk of [`demand`] from the nodes on `stack`.
fn demand_from<J>(
    stack: &mut SmallVec<[NodeRef<J>; 16]>,
    ready: &mut impl FnMut(Ready<J>),
) -> usize {
    let mut marked = 0;
    while let Some(n) = stack.pop() {
        if n.is_done() {
            continue;
        }
        let Some(now_ready) = take_demand(&n) else {
            continue;
        };
        marked += 1;
        if now_ready {
            // Every dependency has finished: nothing to walk.
            let_go_of_links(&n);
            ready(Ready(n));
            continue;
        }
        // Only what this walk has still to mark: a dependency demanded before
        // (by this walk or another) needs no reference taken, and most of a
        // node's dependencies are shared with its neighbours'.
        // Plain pushes: `extend` of a filter cost as much as the rest of the
        // step for the one or two dependencies most nodes have.
        // No lock for a node that waits for nothing (its links mirror its
        // dependencies, and are fixed). The node may complete meanwhile
        // (its dependencies then have): its list is empty then.
        if !n.links.is_empty() {
            for d in lock(&n.state).deps.iter() {
                if !d.is_done() && !d.seen_demanded() {
                    stack.push(d.clone());
                }
            }
        }
    }
    marked
}

/// A completed node, to mark finished once the caller has counted it out (a
/// blocker that returns must not see it still counted live):
/// [`Finished::wake`] sets [`Node::is_done`], wakes the blockers and then
/// releases the dependents, so that none is handed out while the node still
/// looks unfinished.
#[must_use = "the node must be marked finished"]
pub(crate) struct Finished<'a, J> {
    node: &'a Node<J>,
    /// How many slots of the node's list of dependents were claimed when it
    /// closed (settled by [`complete`] if more than one): the unit of each
    /// dependent in them is still held here.
    dependents: u32,
    /// The failure that skips the dependents that read what the node wrote.
    err: Option<SharedError>,
}

impl<J> Finished<'_, J> {
    /// Marks the node finished, wakes its blockers and releases its
    /// dependents (those that become ready go to `ready`, in record order).
    pub(crate) fn wake(self, ready: &mut impl FnMut(Ready<J>)) {
        let node = self.node;
        node.done.store(true, Ordering::Release);
        fence_seq_cst();
        if node.has_waiters.load(Ordering::Relaxed) {
            let waiters = std::mem::take(&mut lock(&node.state).waiters);
            for w in waiters {
                w.set();
            }
        }
        // SAFETY (both): a dependent in the list, after the settle: it
        // cannot complete (nor be reused) before its unit is released below,
        // and it was filled before the compare-and-swap that put it in its
        // slot (acquired by the settle). Nothing of it is touched after the
        // release.
        let release = |v: usize| {
            let owner = (v & !READS) as *const Node<J>;
            let d = unsafe { &*owner };
            if v & READS != 0 {
                if let Some(e) = &self.err {
                    d.set_skip(&mut lock(&d.state), e);
                }
            }
            if d.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
                // SAFETY: the count taken with `NodeRef::into_raw` in `record`,
                // handed out by the one that brought the count to zero.
                ready(Ready(unsafe { NodeRef::from_raw(owner) }));
            }
        };
        if self.dependents > 1 {
            node.dependents.each(self.dependents, release);
        } else {
            node.dependents.settle(self.dependents, release);
        }
    }
}

/// Completes a node that ran (or was skipped): stores its outcome and closes
/// its list of dependents. The caller counts it out of its own books, then
/// [`Finished::wake`] marks it finished and releases the dependents.
pub(crate) fn complete<J>(node: &NodeRef<J>, outcome: Outcome) -> Finished<'_, J> {
    let err: Option<SharedError> = match outcome {
        Outcome::Done => None,
        Outcome::Failed(message) => Some(std::sync::Arc::new(Error::Failed {
            op: node.meta.name.to_string(),
            location: node.meta.location,
            message,
        })),
        Outcome::Skipped(e) => Some(e),
    };
    // The lock only for a failure to store or dependencies to let go of
    // (whose list a demand walk may be reading): a node that waited for
    // nothing and ran completes without one.
    let deps = if err.is_some() || !node.links.is_empty() {
        let mut s = lock(&node.state);
        s.err.clone_from(&err);
        std::mem::take(&mut s.deps)
    } else {
        SmallVec::new()
    };
    node.failed.store(err.is_some(), Ordering::Release);
    // AcqRel (the close): a recorder that finds the list closed sees
    // `failed` (and the error under the lock).
    let dependents = node.dependents.close();
    keep_room(node, deps);
    // With several dependents, the list is settled here (slots still empty
    // are marked passed: their recorders count this node out), and each
    // dependent's count is fetched for writing, all at once, so that the
    // releases in `Finished::wake` (after the caller's books) find them in
    // cache instead of missing on each in turn. One is settled as it is
    // released.
    if dependents > 1 {
        node.dependents
            .settle(dependents, |v| prefetch_write(v & !READS));
    }
    Finished {
        node,
        dependents,
        err,
    }
}

/// Asks for the cache line at `addr` to be fetched for writing (a hint: no
/// effect on what the program does, and none where the target has no such
/// instruction or under loom).
#[inline(always)]
fn prefetch_write(addr: usize) {
    #[cfg(all(target_arch = "x86_64", not(loom)))]
    // SAFETY: a prefetch reads nothing and faults on no address.
    #[allow(unused_unsafe)]
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET0};
        _mm_prefetch::<_MM_HINT_ET0>(addr as *const i8);
    }
    #[cfg(not(all(target_arch = "x86_64", not(loom))))]
    let _ = addr;
}

/// Lets go of a completed node's dependencies (outside its lock: the last
/// reference to one may go here), and gives an emptied list that had spilled
/// back to the node, so that the next node recorded in its memory (see
/// `engine/registry.rs`) has room for as many without an allocation. Without
/// it, a node of many dependencies cost a `malloc` on the frontend and a `free`
/// on a worker (where glibc's allocator takes its slow path).
fn keep_room<J>(node: &Node<J>, mut deps: SmallVec<[NodeRef<J>; 2]>) {
    if !deps.spilled() {
        return;
    }
    deps.clear();
    let mut s = lock(&node.state);
    // Nothing refills the list of a completed node (a record reuses it only
    // once the worker completing it has let go of it).
    if s.deps.capacity() < deps.capacity() {
        s.deps = deps;
    }
}

/// `roots` and every unfinished node they wait for, directly or not, by
/// address, walking the nodes' own dependency lists.
pub(crate) fn ancestors<J>(roots: &[NodeRef<J>]) -> std::collections::HashMap<usize, NodeRef<J>> {
    let mut seen = std::collections::HashMap::new();
    let mut stack: SmallVec<[NodeRef<J>; 16]> = roots.iter().cloned().collect();
    while let Some(n) = stack.pop() {
        if n.is_done() || seen.contains_key(&n.key()) {
            continue;
        }
        stack.extend(n.deps());
        seen.insert(n.key(), n);
    }
    seen
}

/// A one-shot flag a blocker waits on: set by the completion of the node it
/// waits for. One per waiting blocker, so a completion wakes only its own.
pub(crate) struct Latch {
    set: Mutex<bool>,
    cv: Condvar,
}

impl Default for Latch {
    fn default() -> Self {
        Latch {
            set: Mutex::new(false),
            cv: Condvar::new(),
        }
    }
}

impl Latch {
    pub(crate) fn set(&self) {
        *lock(&self.set) = true;
        self.cv.notify_all();
    }

    /// Waits until set.
    pub(crate) fn wait(&self) {
        let mut s = lock(&self.set);
        while !*s {
            s = match self.cv.wait(s) {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
        }
    }

    /// Waits until set or for `timeout`; returns whether it is set. (Loom does
    /// not model time: there it waits until set.)
    #[cfg(loom)]
    pub(crate) fn wait_timeout(&self, _timeout: std::time::Duration) -> bool {
        self.wait();
        true
    }

    /// Waits until set or for `timeout`; returns whether it is set.
    #[cfg(not(loom))]
    pub(crate) fn wait_timeout(&self, timeout: std::time::Duration) -> bool {
        let s = lock(&self.set);
        if *s {
            return true;
        }
        match self.cv.wait_timeout(s, timeout) {
            Ok((g, _)) => *g,
            Err(p) => *p.into_inner().0,
        }
    }
}

#[cfg(test)]
mod tests;

#[cfg(all(test, loom))]
mod loom_tests;
