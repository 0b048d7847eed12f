//! Vars: typed data whose accesses the engine orders.
//!
//! A [`Var`] is a handle to one allocation holding the Var's access queue and
//! its data; tasks reach the data through access tokens ([`Read`], [`Write`])
//! handed out when the task is recorded; the engine guarantees that a token is only used while its access is
//! the one the dependency graph allows, so the lock inside is never contended by
//! correctly recorded tasks (it is there so that a mistake is a wait, not a race).

use crate::engine::{Engine, Tracked, VarQueue};
use crate::error::{Result, SharedError};
use crate::sync::Ordering;
use std::cell::{Cell, RefCell};
use std::sync::atomic::AtomicUsize;
// std, not `crate::sync`: handles are type-erased (`Arc<dyn Tracked>`), which
// loom's Arc cannot do; the loom models do not involve Vars.
use std::sync::Arc;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

// The module with `unsafe` here: a dead storage's memory kept for the next
// Var, built in place.
#[allow(unsafe_code)]
mod pool;
use pool::Pooled;

/// A value managed by an engine: every access to it goes through recorded tasks or
/// blockers, so readers see exactly the writes that precede them in program order.
///
/// Cloning a `Var` clones the handle, not the data. The data is freed when the last
/// handle is dropped and every pending access to it has finished.
///
/// ```
/// use lazyflow::Engine;
/// let engine = Engine::builder().workers(1).build().unwrap();
/// let counter = engine.var(0u32);
/// for _ in 0..3 {
///     let mut t = engine.task("increment");
///     let w = t.write(&counter);
///     t.push(move || *w.write() += 1).unwrap();
/// }
/// assert_eq!(counter.get().unwrap(), 3);
/// ```
pub struct Var<T> {
    inner: Pooled<Storage<T>>,
}

impl<T> Clone for Var<T> {
    fn clone(&self) -> Self {
        self.inner.handles.fetch_add(1, Ordering::Relaxed);
        Var {
            inner: self.inner.clone(),
        }
    }
}

impl<T> Drop for Var<T> {
    fn drop(&mut self) {
        // Release: the handle's last use happens before a thread that sees the
        // count at zero (the batch deciding a value is not kept) acts on it.
        if self.inner.handles.fetch_sub(1, Ordering::Release) == 1 {
            self.inner.engine.counters().tracked_vars.lower();
            if self.inner.spares.is_some() {
                self.keep_storage();
            }
        }
    }
}

impl<T> Var<T> {
    /// The last handle of a Var whose storage has a list of spares (an
    /// output of the tensor layer's CPU ops) goes: if nothing else reaches
    /// the storage (no token of a pending task), it is emptied and kept
    /// there for the next output, instead of freed here and allocated
    /// again (with outputs let go of after their ops ran, the allocation and
    /// the copy of a new storage were a fifth of the frontend's
    /// instructions per op).
    #[cold]
    fn keep_storage(&mut self) {
        let Some(s) = self.inner.get_mut() else {
            return;
        };
        let Some(reset) = s.spares.as_ref().map(|sp| sp.reset) else {
            return;
        };
        if !empty(s, reset) {
            return;
        }
        let spare = Spare(Some(self.inner.clone()));
        if let Some(spares) = &self.inner.spares {
            spares.keep(spare);
        }
    }
}

/// A Var's queue and data in one allocation, reached by its handles and by
/// the access tokens of its pending tasks; counted in
/// [`crate::Stats::live_vars`] while it exists, and in
/// [`crate::Stats::tracked_vars`] while handles are left.
///
/// One allocation per Var (not a handle and a separate block of data that
/// outlives it): a Var is made for every op's output, and its last token
/// usually goes on a worker. That memory is not freed there but kept for
/// the next Var of the same size (see `pool.rs`): freed, it went back to
/// the frontend's arena under glibc's lock, which the frontend's next
/// allocation took too.
pub(crate) struct Storage<T> {
    /// The Var's access queue in the dependency graph.
    queue: VarQueue,
    /// Uncounted: keeps the engine's memory, not its life. Every pending
    /// task runs before an engine retires, so the tokens inside tasks let go.
    engine: Engine,
    /// Writes recorded so far (see [`Var::version`]).
    version: std::sync::atomic::AtomicU64,
    /// `Var` handles alive (tokens not counted).
    handles: std::sync::atomic::AtomicUsize,
    value: RwLock<T>,
    /// Where the storage is kept when its last handle goes and nothing else
    /// reaches it (see [`Var::keep_storage`]); `None`: freed then.
    spares: Option<Arc<Spares<T>>>,
}

impl<T: Send + Sync> Tracked for Pooled<Storage<T>> {
    fn queue(&self) -> &VarQueue {
        &self.queue
    }
}

impl<T> Storage<T> {
    fn read(&self) -> RwLockReadGuard<'_, T> {
        self.value.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, T> {
        self.value.write().unwrap_or_else(|p| p.into_inner())
    }

    /// A read guard for a task's token: refuses (by panicking, which fails the
    /// task) when this thread holds the write guard, which would wait forever.
    fn token_read(&self) -> ReadGuard<'_, T> {
        let held = Held::take(self.key(), false);
        ReadGuard {
            guard: self.read(),
            _held: held,
        }
    }

    /// A write guard for a task's token: refuses when this thread holds any
    /// guard of the same data (a task that declared a Var both read and write
    /// and borrowed it through both tokens at once).
    fn token_write(&self) -> WriteGuard<'_, T> {
        let held = Held::take(self.key(), true);
        WriteGuard {
            guard: self.write(),
            _held: held,
        }
    }

    fn key(&self) -> usize {
        self as *const Self as *const () as usize
    }
}

/// Guards a thread notes in place; more go to a list (`HELD_MORE`).
const HELD_INLINE: usize = 16;

/// The Var data this thread holds guards of: each entry the data's address
/// (a storage's, 8-aligned) with its low bit set for a write guard. In
/// place and with no destructor, so that noting a guard is a few
/// instructions: a task that reads many Vars takes a guard per read, and a
/// `RefCell<Vec>` cost about 100 instructions per guard taken and let go
/// of (`node_cost many_reads` under callgrind, a tenth of all).
struct HeldList {
    len: Cell<usize>,
    inline: [Cell<usize>; HELD_INLINE],
}

thread_local! {
    static HELD: HeldList = const {
        HeldList {
            len: Cell::new(0),
            inline: [const { Cell::new(0) }; HELD_INLINE],
        }
    };
    /// The entries past the first [`HELD_INLINE`].
    static HELD_MORE: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// One guard held by this thread, noted until dropped.
struct Held {
    entry: usize,
}

impl Held {
    #[inline]
    fn take(key: usize, write: bool) -> Held {
        debug_assert!(key & 1 == 0, "a storage's address is aligned");
        let entry = key | write as usize;
        // A read clashes with a write guard of the same data, a write with
        // any guard of it.
        let clash = |e: usize| e & !1 == key && (write || e & 1 == 1);
        let clashed = HELD.with(|h| {
            let n = h.len.get();
            let clashed = h.inline[..n.min(HELD_INLINE)]
                .iter()
                .any(|e| clash(e.get()))
                || (n > HELD_INLINE && HELD_MORE.with(|m| m.borrow().iter().any(|&e| clash(e))));
            if !clashed {
                if n < HELD_INLINE {
                    h.inline[n].set(entry);
                } else {
                    HELD_MORE.with(|m| m.borrow_mut().push(entry));
                }
                h.len.set(n + 1);
            }
            clashed
        });
        if clashed {
            // Caught by the scheduler: the task fails with this message instead
            // of waiting for itself forever.
            panic!(
                "a task took the {} guard of a Var while holding its {} guard on the same thread, which would wait forever; drop the first guard (or use the write token's `read`/`write` alone)",
                if write { "write" } else { "read" },
                if write { "read or write" } else { "write" },
            );
        }
        Held { entry }
    }
}

impl Drop for Held {
    #[inline]
    fn drop(&mut self) {
        let entry = self.entry;
        HELD.with(|h| {
            let n = h.len.get();
            // Entries are a set (order does not matter): the one let go of
            // is filled from the end, the first `HELD_INLINE` in place.
            if n > HELD_INLINE {
                let _ = HELD_MORE.try_with(|m| {
                    let mut m = m.borrow_mut();
                    if let Some(i) = m.iter().rposition(|&e| e == entry) {
                        m.swap_remove(i);
                    } else if let Some(i) = h.inline.iter().rposition(|e| e.get() == entry) {
                        h.inline[i].set(m.pop().unwrap_or(0));
                    }
                });
            } else if let Some(i) = h.inline[..n].iter().rposition(|e| e.get() == entry) {
                h.inline[i].set(h.inline[n - 1].get());
            }
            h.len.set(n.saturating_sub(1));
        });
    }
}

/// Shared access to a Var's data inside a task (see [`Read::read`]).
pub struct ReadGuard<'a, T> {
    guard: RwLockReadGuard<'a, T>,
    _held: Held,
}

impl<T> std::ops::Deref for ReadGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

/// Exclusive access to a Var's data inside a task (see [`Write::write`]).
pub struct WriteGuard<'a, T> {
    guard: RwLockWriteGuard<'a, T>,
    _held: Held,
}

impl<T> std::ops::Deref for WriteGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> std::ops::DerefMut for WriteGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

impl<T> Drop for Storage<T> {
    fn drop(&mut self) {
        self.engine.counters().live_vars.lower();
    }
}

/// Read access to a Var's data, granted to one recorded task.
///
/// Use it only inside the task it was created for: there the engine has ordered it
/// after the Var's last write.
pub struct Read<T> {
    storage: Pooled<Storage<T>>,
}

impl<T> Read<T> {
    /// Borrows the data.
    ///
    /// Taking it while the same thread holds the write guard of the same Var
    /// (a task that declared it both read and write) fails the task with a
    /// message instead of waiting forever.
    pub fn read(&self) -> ReadGuard<'_, T> {
        self.storage.token_read()
    }

    /// Identifies the data (equal for tokens of the same Var).
    pub(crate) fn data_id(&self) -> usize {
        self.storage.as_ptr() as *const () as usize
    }

    /// Borrows the data without noting the guard on this thread: for the
    /// engine's own kernels, which never take a second guard of a Var they
    /// hold one of (the note is a thread-local list, searched and changed
    /// twice per guard).
    pub(crate) fn read_kernel(&self) -> RwLockReadGuard<'_, T> {
        self.storage.read()
    }

    /// A second token for the same declared read (an op that reads one value
    /// twice).
    pub(crate) fn duplicate(&self) -> Read<T> {
        Read {
            storage: self.storage.clone(),
        }
    }
}

/// Write access to a Var's data, granted to one recorded task.
///
/// Use it only inside the task it was created for: there the engine has ordered it
/// after every earlier access to the Var.
pub struct Write<T> {
    storage: Pooled<Storage<T>>,
}

impl<T> Write<T> {
    /// Borrows the data mutably.
    ///
    /// Taking it while the same thread holds another guard of the same Var fails
    /// the task with a message instead of waiting forever:
    ///
    /// ```
    /// use lazyflow::Engine;
    /// let engine = Engine::builder().workers(1).build().unwrap();
    /// let x = engine.var(1u32);
    /// let mut t = engine.task("both");
    /// let (r, w) = (t.read(&x), t.write(&x));
    /// let handle = t.run(move || {
    ///     let old = r.read();
    ///     *w.write() = *old + 1; // the read guard is still held
    /// }).unwrap();
    /// let err = handle.wait().unwrap_err().to_string();
    /// assert!(err.contains("both") && err.contains("guard"), "{err}");
    /// ```
    pub fn write(&self) -> WriteGuard<'_, T> {
        self.storage.token_write()
    }

    /// As [`Read::read_kernel`], mutably.
    pub(crate) fn write_kernel(&self) -> RwLockWriteGuard<'_, T> {
        self.storage.write()
    }

    /// Borrows the data (a writer may also read what it is about to change).
    pub fn read(&self) -> ReadGuard<'_, T> {
        self.storage.token_read()
    }

    /// Identifies the data (equal for tokens of the same Var).
    pub(crate) fn data_id(&self) -> usize {
        self.storage.as_ptr() as *const () as usize
    }

    /// How many handles and tokens reach the data, this one included: 1 means
    /// nothing else can ever read what is written through this token.
    pub(crate) fn reach(&self) -> usize {
        self.storage.count()
    }
}

/// The storage of a dead Var, emptied, to make a new Var in without an
/// allocation (see [`Spares`]); `None` once made into a Var. Not counted in
/// [`crate::Stats::live_vars`].
pub(crate) struct Spare<T>(Option<Pooled<Storage<T>>>);

impl<T> Drop for Spare<T> {
    fn drop(&mut self) {
        if let Some(s) = &self.0 {
            // The storage's own drop counts it out again.
            s.engine.counters().live_vars.raise();
        }
    }
}

impl<T: Default + Send + Sync + 'static> Spare<T> {
    /// A new Var of `engine` holding `T::default()`, made in the last of
    /// `local` (spares of `engine`) when there is one. With `keep`, its
    /// storage goes to that list when its last handle goes and nothing else
    /// reaches it (a storage made in a spare kept its list).
    pub(crate) fn var(
        local: &mut Vec<Spare<T>>,
        engine: &Engine,
        keep: Option<&Arc<Spares<T>>>,
    ) -> Var<T> {
        let Some(storage) = local.pop().and_then(|mut s| s.0.take()) else {
            return engine.var_with_queue(VarQueue::new(None), T::default(), keep.cloned());
        };
        debug_assert!(storage.engine.same(engine), "spares are per engine");
        storage.handles.store(1, Ordering::Relaxed);
        let counters = engine.counters();
        counters.tracked_vars.raise();
        counters.live_vars.raise();
        Var { inner: storage }
    }
}

/// Empties `storage` into a [`Spare`] if nothing else reaches it (the Var is
/// dead: no handle, no other token): its value and its queue are dropped
/// here, on the calling thread.
fn into_spare<T: Default>(mut storage: Pooled<Storage<T>>) -> Option<Spare<T>> {
    let s = storage.get_mut()?;
    empty(s, |v| *v = T::default()).then(|| Spare(Some(storage)))
}

/// Empties the storage of a dead Var (no handle, nothing else reaches it)
/// to make a new Var in, with `reset` for its value, and counts it out of
/// the live Vars (a [`Spare`] is not counted). Refuses (false) a value
/// poisoned by a panic.
fn empty<T>(s: &mut Storage<T>, reset: impl FnOnce(&mut T)) -> bool {
    if s.value.is_poisoned() {
        return false;
    }
    debug_assert!(
        !s.queue.is_held(),
        "a batch that names a Var holds a handle"
    );
    reset(s.value.get_mut().unwrap_or_else(|p| p.into_inner()));
    s.queue = VarQueue::new(None);
    *s.version.get_mut() = 0;
    *s.handles.get_mut() = 0;
    s.engine.counters().live_vars.lower();
    true
}

impl<T: Default> Read<T> {
    /// Lets go of the token, keeping the Var's storage as a [`Spare`] if
    /// this was the last reference to it.
    pub(crate) fn into_spare(self) -> Option<Spare<T>> {
        into_spare(self.storage)
    }
}

impl<T: Default> Write<T> {
    /// As [`Read::into_spare`].
    pub(crate) fn into_spare(self) -> Option<Spare<T>> {
        into_spare(self.storage)
    }
}

/// Storages of dead Vars of one engine, kept to make new Vars in.
///
/// Why: the tensor layer makes a Var for every op's output on the frontend,
/// and the last token of a dead one goes away on a worker, after its op ran:
/// a free into another thread's arena, which glibc's allocator pays for on
/// both sides (the frontend's next allocation takes its slow path). Kept
/// here instead, the memory goes back to the frontend without the allocator.
/// At most [`Spares::MOST`] are kept (a spare holds no value: a few hundred
/// bytes each); [`Spares::close`] drops them and keeps no more (the storages
/// refer to the engine, which refers to this list).
pub(crate) struct Spares<T> {
    /// Empties a value (to `T::default()`, set where that is known).
    reset: fn(&mut T),
    list: std::sync::Mutex<(Vec<Spare<T>>, bool)>,
    /// How many the list holds, written under its lock and read without it:
    /// a recorder that finds none does not take the lock (two locked
    /// instructions an op while the outputs die on the frontend, where no
    /// spare is kept). Read Relaxed: a stale zero costs an allocation.
    kept: AtomicUsize,
}

impl<T: Default> Default for Spares<T> {
    fn default() -> Self {
        Spares {
            reset: |v| *v = T::default(),
            list: std::sync::Mutex::new((Vec::new(), false)),
            kept: AtomicUsize::new(0),
        }
    }
}

impl<T> Spares<T> {
    /// The most spares kept: the default backpressure bound, so that the
    /// outputs of one bound's worth of ops, recorded before any ran, come
    /// back in full.
    pub(crate) const MOST: usize = crate::engine::DEFAULT_HIGH_WATERMARK;

    fn list(&self) -> std::sync::MutexGuard<'_, (Vec<Spare<T>>, bool)> {
        self.list.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps one spare, if it fits (none once closed).
    fn keep(&self, spare: Spare<T>) {
        let mut list = self.list();
        if !list.1 && list.0.len() < Self::MOST {
            list.0.push(spare);
            self.kept.store(list.0.len(), Ordering::Relaxed);
            return;
        }
        drop(list);
        drop(spare);
    }
}

impl<T: Default + Send + Sync + 'static> Spares<T> {
    /// Moves the spares kept into `local`: a list of a recording thread's
    /// own, which [`Spare::var`] draws from without this list's lock.
    pub(crate) fn take_into(&self, local: &mut Vec<Spare<T>>) {
        if self.kept.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut list = self.list();
        if local.is_empty() {
            std::mem::swap(&mut list.0, local);
        } else {
            local.append(&mut list.0);
        }
        self.kept.store(0, Ordering::Relaxed);
    }

    /// Keeps `spares` (as many as fit; none once closed).
    pub(crate) fn give(&self, mut spares: Vec<Spare<T>>) {
        if spares.is_empty() {
            return;
        }
        let mut list = self.list();
        if !list.1 {
            let room = Self::MOST.saturating_sub(list.0.len());
            let kept = spares.len().min(room);
            list.0.extend(spares.drain(..kept));
            self.kept.store(list.0.len(), Ordering::Relaxed);
        }
        drop(list);
        drop(spares);
    }

    /// How many are kept.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.list().0.len()
    }

    /// Drops the spares and keeps none from now on (the engine retires).
    pub(crate) fn close(&self) {
        let all = {
            let mut list = self.list();
            list.1 = true;
            self.kept.store(0, Ordering::Relaxed);
            std::mem::take(&mut list.0)
        };
        drop(all);
    }
}

impl Engine {
    /// Puts `value` under this engine's management.
    pub fn var<T: Send + Sync + 'static>(&self, value: T) -> Var<T> {
        self.var_with_queue(VarQueue::new(None), value, None)
    }

    pub(crate) fn poisoned_var<T: Send + Sync + 'static>(
        &self,
        value: T,
        err: SharedError,
    ) -> Var<T> {
        self.var_with_queue(VarQueue::new(Some(err)), value, None)
    }

    fn var_with_queue<T>(
        &self,
        queue: VarQueue,
        value: T,
        spares: Option<Arc<Spares<T>>>,
    ) -> Var<T> {
        let counters = self.counters();
        counters.tracked_vars.raise();
        counters.live_vars.raise();
        Var {
            inner: Pooled::new(Storage {
                queue,
                engine: self.uncounted(),
                version: std::sync::atomic::AtomicU64::new(0),
                handles: std::sync::atomic::AtomicUsize::new(1),
                value: RwLock::new(value),
                spares,
            }),
        }
    }
}

impl<T> Var<T> {
    /// The Var's access queue in the dependency graph.
    #[inline]
    pub(crate) fn queue(&self) -> &VarQueue {
        &self.inner.queue
    }

    /// The engine that manages this Var.
    pub fn engine(&self) -> &Engine {
        &self.inner.engine
    }

    pub(crate) fn read_token(&self) -> Read<T> {
        Read {
            storage: self.inner.clone(),
        }
    }

    /// [`Var::clone`] and [`Var::write_token`] for a Var made for an op's
    /// output: when this handle is the storage's only reference (nothing
    /// else can reach it, so no other thread counts), the counts are raised
    /// with plain stores instead of locked instructions.
    pub(crate) fn new_output_handles(&mut self) -> (Var<T>, Write<T>) {
        let Some((var, write)) = self.inner.two_more_if_unique() else {
            return (self.clone(), self.write_token());
        };
        let (handles, version) = (&self.inner.handles, &self.inner.version);
        handles.store(handles.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        version.store(version.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        (Var { inner: var }, Write { storage: write })
    }

    pub(crate) fn write_token(&self) -> Write<T> {
        // Relaxed: only the recording thread compares versions (the tape checks
        // that a value it saved was not overwritten by a later recorded write).
        self.inner
            .version
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Write {
            storage: self.inner.clone(),
        }
    }

    /// How many writes of this value have been recorded: a value saved at one
    /// version and seen at another was overwritten in between.
    pub(crate) fn version(&self) -> u64 {
        self.inner
            .version
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Records the open record-time batches first if one names this Var.
    #[inline]
    fn close_batches(&self) {
        if self.queue().is_held() {
            self.engine().shared().close_batches();
        }
    }

    /// Handles of this Var alive (tokens not counted).
    pub(crate) fn handles(&self) -> usize {
        self.inner.handles.load(Ordering::Acquire)
    }

    /// Whether two handles refer to the same data.
    pub fn same(&self, other: &Var<T>) -> bool {
        Pooled::ptr_eq(&self.inner, &other.inner)
    }

    /// Explicit blocker: runs exactly the recorded work this value depends on (and
    /// nothing else) and waits for it. Returns the failure that poisoned the value,
    /// if any, naming the op that failed and where it was recorded.
    ///
    /// Inside a running task it runs other queued work while it waits, and returns
    /// [`crate::Error::WouldDeadlock`] if the value depends on that task itself.
    pub fn wait_to_read(&self) -> Result<()> {
        self.engine().counters().blocker(false);
        self.settle_read()
    }

    fn settle_read(&self) -> Result<()> {
        self.close_batches();
        if let Some(writer) = self.queue().writer() {
            self.engine()
                .shared()
                .wait_for(std::iter::once(writer).collect())?;
        }
        match self.queue().poison() {
            Some(err) => Err((*err).clone()),
            None => Ok(()),
        }
    }

    /// Explicit blocker for a write from the frontend: waits until every recorded
    /// access to this value (reads included) has finished.
    pub fn wait_to_write(&self) -> Result<()> {
        self.engine().counters().blocker(false);
        self.close_batches();
        let accessors = self.queue().accessors();
        self.engine().shared().wait_for(accessors)
    }

    /// Implicit blocker: waits for the value like [`Var::wait_to_read`] and calls
    /// `f` on it.
    ///
    /// While `f` runs, a blocker on this thread that would wait for a write to
    /// this Var (a `get` after a `set` of it, or a `set` in [`crate::Mode::Sync`])
    /// returns [`crate::Error::WouldDeadlock`] instead of waiting forever: the
    /// write cannot run before `f` lets go of the value.
    ///
    /// ```
    /// use lazyflow::{Engine, Error};
    /// let engine = Engine::builder().workers(1).build().unwrap();
    /// let x = engine.var(1u32);
    /// let r = x.with(|v| {
    ///     x.set(*v + 1).unwrap();
    ///     x.get()
    /// });
    /// assert!(matches!(r, Ok(Err(Error::WouldDeadlock { .. }))));
    /// assert_eq!(x.get().unwrap(), 2);
    /// ```
    pub fn with<R>(&self, f: impl FnOnce(&T) -> R) -> Result<R>
    where
        T: Send + Sync + 'static,
    {
        self.engine().counters().blocker(true);
        self.settle_read()?;
        // The list of borrowed Vars is type-erased: a reference in an `Arc`
        // (an allocation per call, on a path that waits anyway).
        let _borrow =
            crate::engine::Borrow::new(self.engine().shared().id, Arc::new(self.inner.clone()));
        Ok(f(&self.inner.read()))
    }

    /// Reads the value without waiting or counting a blocker: for callers that
    /// have just waited for it (the storage lock orders it with any later
    /// writer that already started).
    pub(crate) fn peek<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        f(&self.inner.read())
    }

    /// Implicit blocker: waits for the value and returns a copy of it.
    pub fn get(&self) -> Result<T>
    where
        T: Clone + Send + Sync + 'static,
    {
        self.with(T::clone)
    }

    /// Records a task that replaces the value (ordered after every earlier access,
    /// like any write). Clears a poisoned value once it runs.
    #[track_caller]
    pub fn set(&self, value: T) -> Result<()>
    where
        T: Send + Sync + 'static,
    {
        let mut t = self.engine().task("set");
        let w = t.write(self);
        t.push(move || *w.write() = value)
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for Var<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Var")
            .field("id", &self.queue().key())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::{Held, HELD, HELD_INLINE};
    use crate::Engine;

    /// Guards past the few noted in place: clashes are still found there,
    /// and guards let go of in any order leave the list empty.
    #[test]
    fn guards_past_the_inline_few_clash_and_go_in_any_order() {
        let keys: Vec<usize> = (1..=40).map(|i| i * 64).collect();
        assert!(keys.len() > 2 * HELD_INLINE);
        let mut held: Vec<Option<Held>> =
            keys.iter().map(|&k| Some(Held::take(k, false))).collect();
        let again = Held::take(keys[30], false);
        for k in [keys[30], keys[3]] {
            let clash = std::panic::catch_unwind(|| drop(Held::take(k, true)));
            assert!(clash.is_err(), "a write guard while a read guard is held");
        }
        let w = Held::take(8, true);
        let clash = std::panic::catch_unwind(|| drop(Held::take(8, false)));
        assert!(clash.is_err(), "a read guard while the write guard is held");
        drop(w);
        drop(again);
        for i in 0..keys.len() {
            held[i * 7 % keys.len()] = None;
            if i == 20 {
                // Index 27 is still held, 30 went at i = 10.
                assert!(std::panic::catch_unwind(|| drop(Held::take(keys[27], true))).is_err());
                drop(Held::take(keys[30], true));
            }
        }
        assert_eq!(HELD.with(|h| h.len.get()), 0);
        for &k in &keys {
            drop(Held::take(k, true));
        }
        assert_eq!(HELD.with(|h| h.len.get()), 0);
    }

    /// A Var whose last token goes on a worker leaves its memory for the
    /// next Var of its size, on another engine too: the counts of both
    /// engines stay right, the new Var holds its own value, and the first
    /// engine's memory is freed (a kept block refers to no engine).
    #[test]
    fn a_dead_vars_memory_makes_the_next_var_without_keeping_its_engine() {
        let a = Engine::builder().workers(1).build().unwrap();
        let shared = std::sync::Arc::downgrade(&a.shared);
        // A value size no other test of the crate makes Vars of.
        let x = a.var([7u64; 5]);
        let addr = x.inner.as_ptr() as usize;
        let mut t = a.task("last token");
        let w = t.write(&x);
        t.push(move || w.write()[0] += 1).unwrap();
        // Lazy: the task runs at the barrier, after the handle went.
        drop(x);
        a.wait_all().unwrap();
        let s = a.stats();
        assert_eq!((s.live_vars, s.tracked_vars), (0, 0));
        drop(a);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while shared.strong_count() > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(shared.strong_count(), 0, "the engine's memory is freed");

        let b = Engine::builder().workers(1).build().unwrap();
        let ys: Vec<_> = (0..4u64).map(|i| b.var([i; 5])).collect();
        assert!(
            ys.iter().any(|y| y.inner.as_ptr() as usize == addr),
            "the dead Var's memory was reused"
        );
        for (i, y) in ys.iter().enumerate() {
            assert_eq!(y.get().unwrap(), [i as u64; 5]);
            assert_eq!(y.version(), 0);
        }
        let s = b.stats();
        assert_eq!((s.live_vars, s.tracked_vars), (4, 4));
        drop(ys);
        let s = b.stats();
        assert_eq!((s.live_vars, s.tracked_vars), (0, 0));
    }
}
