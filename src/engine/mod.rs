//! The engine: owns the live graph (behind its one lock), the worker pool and the
//! counters; records nodes, flushes the subgraphs that blockers need, and applies
//! backpressure.
//!
//! State is grouped by who touches it:
//! - `state` — behind the one lock: the graph, and who is waiting for what.
//! - `injector`, `stealers`, `sleep` — reachable from every worker, lock-free.
//! - `config`, `id` — shared read-only.
//! - `counters` — relaxed atomics, read only for statistics.

mod builder;
mod inbox;
mod stats;

pub use builder::{
    EngineBuilder, Mode, DEFAULT_GPU_TIMEOUT, DEFAULT_HIGH_WATERMARK, DEFAULT_LOW_WATERMARK,
};
pub use stats::Stats;
pub(crate) use stats::{Counters, Tally};

use crate::device::{gpu::Gpu, Device, GpuInfo};
use crate::error::{Error, Location, Result};
use crate::graph::{Graph, NodeId, NodeMeta, Outcome, VarId};
use crate::sched::{self, sleep::Sleep, Task, Work};
use crate::sync::{lock, AtomicBool, Condvar, Mutex, MutexGuard, Ordering};
use crossbeam_deque::{Injector, Stealer};
use inbox::{Entry, Inbox, VAR_CHUNK};
use smallvec::SmallVec;
use std::sync::OnceLock;
use std::time::Duration;

/// A handle to an engine: cheap to clone, `Send + Sync`.
///
/// The engine's life is that of its `Engine` handles: when the last one is
/// dropped, everything recorded so far is demanded and still runs (user tasks may
/// have effects beyond the values they write), and the worker threads exit once
/// it has. Vars, Tensors and task handles keep the engine's data reachable but not
/// its threads, so a recorded task that holds a Var cannot keep an engine alive
/// forever. Using such a value after the last handle is gone still works: its
/// work runs at once, on workers started again for it.
///
/// Dropping the last handle on a plain thread waits for the recorded work and for
/// the worker threads to exit; on any engine's worker thread (inside a task) it
/// does not block, and the workers exit on their own once the work has run.
///
/// ```
/// use lazyflow::Engine;
/// let engine = Engine::builder().workers(2).build().unwrap();
/// let x = engine.var(1u64);
/// let mut task = engine.task("double");
/// let w = task.write(&x);
/// task.run(move || *w.write() *= 2).unwrap();
/// assert_eq!(x.get().unwrap(), 2);
/// drop(engine);                                   // the workers exit
/// assert_eq!(x.get().unwrap(), 2);                // the value is still there
/// ```
pub struct Engine {
    // std's Arc (not `crate::sync`): workers are started again from a `Weak`
    // self-reference, which loom's Arc does not offer; the loom models do not
    // build engines.
    shared: std::sync::Arc<Shared>,
    /// Whether this handle counts toward the engine's life: those the user holds
    /// do; the ones inside Vars, Tensors and task handles do not.
    counted: bool,
}

impl Clone for Engine {
    /// A new handle that counts toward the engine's life (also when cloned from
    /// the handle a Var or Tensor returns).
    fn clone(&self) -> Self {
        self.shared.acquire_handle();
        Engine {
            shared: self.shared.clone(),
            counted: true,
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if self.counted {
            self.shared.release_handle();
        }
    }
}

/// Execution settings fixed when the engine is built.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) mode: Mode,
    pub(crate) workers: usize,
    /// Backpressure: recording stalls at `high` live nodes until `low` remain.
    pub(crate) high: usize,
    pub(crate) low: usize,
    /// wgpu backends to look for GPU adapters on.
    pub(crate) backends: wgpu::Backends,
    /// Logical devices (wgpu Device + Queue) opened per adapter.
    pub(crate) logical_devices: usize,
    /// Fuse elementwise GPU ops into generated kernels.
    pub(crate) fusion: bool,
    /// Threads one CPU kernel may use.
    pub(crate) cpu_threads: usize,
    /// How long a wait for a GPU may take before the device counts as lost.
    pub(crate) gpu_timeout: Duration,
}

/// What the lock protects.
pub(crate) struct Locked {
    pub(crate) graph: Graph<Task>,
    /// Threads inside `wait_all`.
    all_waiters: usize,
    /// Frontend threads stalled by backpressure.
    bp_waiters: usize,
    /// The backpressure waiters were woken since one of them last went to sleep
    /// (one notification per wait, not one per completion below the low mark).
    bp_signalled: bool,
    /// Threads in `wait_all` or stalled by backpressure in Lazy mode. While there
    /// are any, every node entering the graph is demanded at once: those waits
    /// end only when the graph drains, so nothing may sit there undemanded.
    global_demand: usize,
    peak_live: usize,
    /// The last `Engine` handle is gone: everything recorded is demanded at once
    /// (`global_demand` holds one count for it) and the workers exit when the
    /// graph and the inbox are empty. Cleared when a handle is made again.
    retiring: bool,
    /// Worker threads running (they exit only while `retiring`).
    alive: usize,
    /// The deques of workers that exited, for the ones started again (their
    /// stealers stay in `Shared::stealers`).
    idle_deques: Vec<crossbeam_deque::Worker<Work>>,
    /// The worker threads started (joined by a retiring drop on a plain thread).
    threads: Vec<std::thread::JoinHandle<()>>,
    /// Blockers inside tasks, for cross-thread deadlock checks: the nodes running
    /// or suspended on each waiting thread, and what that thread waits for.
    pub(crate) waits: Vec<WaitEntry>,
    next_wait: u64,
    /// Counted under the lock that is held anyway (no extra shared cache lines
    /// on the hot paths).
    pub(crate) tally: Tally,
}

/// Everything the workers and the handles share.
pub(crate) struct Shared {
    pub(crate) id: u64,
    pub(crate) config: Config,
    pub(crate) state: Mutex<Locked>,
    /// Signalled when a waited-for node completes, when the graph empties under
    /// `wait_all`, and when it drains to the low mark under backpressure.
    changed: Condvar,
    pub(crate) injector: Injector<Work>,
    pub(crate) stealers: Vec<Stealer<Work>>,
    pub(crate) sleep: Sleep,
    /// Set (Release) when the engine is retiring and its graph and inbox are
    /// empty, Acquire in the worker loop: workers may then exit. Written under
    /// the state lock.
    pub(crate) shutdown: AtomicBool,
    /// `Locked::retiring`, readable without the lock by the Lazy record path
    /// (SeqCst with the inbox lock; see [`Shared::record`]).
    retiring: AtomicBool,
    /// `Engine` handles that count (see [`Engine`]).
    handles: std::sync::atomic::AtomicUsize,
    /// This engine itself, to start workers again after they exited.
    me: std::sync::Weak<Shared>,
    pub(crate) counters: std::sync::Arc<Counters>,
    /// Lazy-mode records and Var drops not yet applied to the graph; see
    /// `inbox.rs`. Lock order: `state`, then `inbox`.
    inbox: Mutex<Inbox>,
    /// Entries in the inbox (a hint, Relaxed: exact values are read under the
    /// inbox lock).
    inbox_len: std::sync::atomic::AtomicUsize,
    /// Entries per inbox batch.
    batch: usize,
    /// GPU devices, opened on first use (opening one takes tens of milliseconds).
    gpus: OnceLock<Vec<std::sync::Arc<Gpu>>>,
}

static NEXT_ENGINE_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl Engine {
    /// A builder with defaults taken from the environment (`LAZYFLOW_MODE`,
    /// `LAZYFLOW_WORKERS`) where set.
    pub fn builder() -> EngineBuilder {
        EngineBuilder::default()
    }

    /// The process-wide default engine, created on first use from the environment.
    /// An invalid environment setting is reported on stderr once and the defaults
    /// are used instead.
    pub fn global() -> &'static Engine {
        static GLOBAL: OnceLock<Engine> = OnceLock::new();
        GLOBAL.get_or_init(|| match Engine::builder().build() {
            Ok(e) => e,
            Err(err) => {
                eprintln!("lazyflow: {err}; using default settings");
                EngineBuilder::defaults_only()
                    .build()
                    .expect("default configuration is valid")
            }
        })
    }

    pub(crate) fn start(config: Config) -> Result<Engine> {
        let (config_high, config_low) = (config.high, config.low);
        let locals: Vec<_> = (0..config.workers)
            .map(|_| crossbeam_deque::Worker::new_lifo())
            .collect();
        let stealers = locals.iter().map(|l| l.stealer()).collect();
        let shared = std::sync::Arc::new_cyclic(|me| Shared {
            id: NEXT_ENGINE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            stealers,
            config,
            state: Mutex::new(Locked {
                graph: Graph::default(),
                all_waiters: 0,
                bp_waiters: 0,
                bp_signalled: false,
                global_demand: 0,
                peak_live: 0,
                retiring: false,
                alive: 0,
                idle_deques: locals,
                threads: Vec::new(),
                waits: Vec::new(),
                next_wait: 0,
                tally: Tally::default(),
            }),
            changed: Condvar::new(),
            injector: Injector::new(),
            sleep: Sleep::new(),
            shutdown: AtomicBool::new(false),
            retiring: AtomicBool::new(false),
            handles: std::sync::atomic::AtomicUsize::new(1),
            me: me.clone(),
            counters: std::sync::Arc::new(Counters::default()),
            inbox: Mutex::new(Inbox::new()),
            inbox_len: std::sync::atomic::AtomicUsize::new(0),
            batch: Inbox::batch(config_high, config_low),
            gpus: OnceLock::new(),
        });
        let engine = Engine {
            shared,
            counted: true,
        };
        let mut st = lock(&engine.shared.state);
        engine.shared.start_workers(&mut st);
        if st.alive == 0 {
            drop(st);
            return Err(Error::Config("could not start any worker thread".into()));
        }
        drop(st);
        Ok(engine)
    }

    /// A handle that does not count toward the engine's life (held by Vars,
    /// Tensors and task handles).
    pub(crate) fn uncounted(&self) -> Engine {
        Engine {
            shared: self.shared.clone(),
            counted: false,
        }
    }

    #[inline]
    pub(crate) fn shared(&self) -> &Shared {
        &self.shared
    }

    pub(crate) fn counters(&self) -> &std::sync::Arc<Counters> {
        &self.shared.counters
    }

    /// Threads one CPU kernel may use; see [`EngineBuilder::cpu_threads`].
    pub fn cpu_threads(&self) -> usize {
        self.shared().config.cpu_threads
    }

    /// Whether two handles refer to the same engine.
    pub fn same(&self, other: &Engine) -> bool {
        std::sync::Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// The execution mode this engine was built with.
    pub fn mode(&self) -> Mode {
        self.shared().config.mode
    }

    /// Number of worker threads.
    pub fn workers(&self) -> usize {
        self.shared().config.workers
    }

    /// The global barrier: demands every recorded node and waits until none is left
    /// unfinished, including the work queued on every GPU. Failures of nodes are
    /// reported by blockers on the values they poisoned, not here; GPU batches
    /// that failed since the last call, and lost GPU devices, are reported here
    /// too (after waiting for every device). Called inside a task it returns [`Error::WouldDeadlock`],
    /// since that task itself is unfinished.
    pub fn wait_all(&self) -> Result<()> {
        self.counters().blocker(false);
        self.shared().wait_all()?;
        // GPU nodes complete when encoded: wait for every device too (all of
        // them, even after one failed), and report the batch failures since the
        // last call and any lost device.
        let mut failures = Vec::new();
        for (i, gpu) in self.shared().opened_gpus().iter().enumerate() {
            if let Err(message) = gpu.synchronize().and_then(|()| gpu.take_failures()) {
                failures.push(format!("gpu:{i} ({}): {message}", gpu.info.name));
            }
        }
        if failures.is_empty() {
            Ok(())
        } else {
            Err(Error::Failed {
                op: "wait_all".to_string(),
                location: Location::caller(),
                message: failures.join("; "),
            })
        }
    }

    /// Every device of this engine: the CPU first, then one per GPU adapter found
    /// (times the logical devices asked for per adapter). GPUs are looked for and
    /// opened on the first call.
    pub fn devices(&self) -> Vec<Device> {
        let n = self.shared().gpus().len();
        std::iter::once(Device::Cpu)
            .chain((0..n).map(Device::Gpu))
            .collect()
    }

    /// What a GPU device is (`None` for the CPU or an unknown index).
    pub fn gpu_info(&self, device: Device) -> Option<GpuInfo> {
        match device {
            Device::Gpu(i) => self.shared().gpus().get(i).map(|g| g.info.clone()),
            Device::Cpu => None,
        }
    }

    /// A one-line description of a device, e.g. `cpu (2 workers)` or
    /// `llvmpipe (LLVM 15.0.6, 256 bits) via vulkan, logical device 0`.
    pub fn describe(&self, device: Device) -> String {
        match device {
            Device::Cpu => format!("cpu ({} workers)", self.workers()),
            Device::Gpu(_) => match self.gpu_info(device) {
                Some(i) => format!("{} via {}, logical device {}", i.name, i.backend, i.logical),
                None => format!("{device} (no such device)"),
            },
        }
    }

    /// Kernels dispatched so far on a GPU device (0 for the CPU, whose nodes
    /// are counted in [`Stats::completed`]).
    pub fn kernels_dispatched(&self, device: Device) -> u64 {
        match device {
            Device::Gpu(i) => self.shared().gpus().get(i).map_or(0, |g| {
                g.dispatched.load(std::sync::atomic::Ordering::Relaxed)
            }),
            Device::Cpu => 0,
        }
    }

    /// Arms a failure at one point of a GPU device, for tests of how failures
    /// reach values (see `device/gpu.rs`). Not part of the stable API.
    #[doc(hidden)]
    pub fn inject_gpu_fault(&self, device: Device, fault: crate::device::gpu::GpuFault) -> bool {
        match device {
            Device::Gpu(i) => match self.gpu(i) {
                Some(g) => {
                    g.inject(fault);
                    true
                }
                None => false,
            },
            Device::Cpu => false,
        }
    }

    pub(crate) fn gpu(&self, index: usize) -> Option<&std::sync::Arc<Gpu>> {
        self.shared().gpus().get(index)
    }

    /// A snapshot of the engine's counters.
    pub fn stats(&self) -> Stats {
        let shared = self.shared();
        let st = shared.lock_applied();
        // Ids reserved for future Vars are not Vars yet.
        let reserved = lock(&shared.inbox).free_vars.len();
        shared.counters.snapshot(
            &st.tally,
            st.graph.live_nodes(),
            st.peak_live,
            st.graph.tracked_vars() - reserved,
        )
    }

    /// Resets the peak of live nodes reported by [`Engine::stats`] to the current
    /// count.
    pub fn reset_peak(&self) {
        let mut st = self.shared().lock_applied();
        st.peak_live = st.graph.live_nodes();
    }

    /// The live graph (recorded, unfinished nodes) in Graphviz DOT. Demanded nodes
    /// are bold.
    ///
    /// ```
    /// use lazyflow::{Engine, Mode};
    /// let engine = Engine::builder().mode(Mode::Lazy).build().unwrap();
    /// let x = engine.var(0u32);
    /// let mut t = engine.task("bump");
    /// let w = t.write(&x);
    /// t.push(move || *w.write() += 1).unwrap();
    /// assert!(engine.to_dot().contains("bump"));
    /// ```
    pub fn to_dot(&self) -> String {
        self.shared().lock_applied().graph.analysis().to_dot()
    }
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("id", &self.shared().id)
            .field("mode", &self.mode())
            .field("workers", &self.workers())
            .finish()
    }
}

impl Shared {
    /// A counted handle is made (see [`Engine`]'s `Clone`). The first one after
    /// the engine began retiring cancels that.
    fn acquire_handle(&self) {
        if self.handles.fetch_add(1, Ordering::AcqRel) == 0 {
            self.revive();
        }
    }

    #[cold]
    fn revive(&self) {
        let mut st = lock(&self.state);
        // A release that raced with this acquire may not have retired yet; it
        // re-checks the count under the lock and then does nothing.
        if !st.retiring || self.handles.load(Ordering::Acquire) == 0 {
            return;
        }
        st.retiring = false;
        self.retiring.store(false, Ordering::SeqCst);
        st.global_demand -= 1;
        self.shutdown.store(false, Ordering::Release);
        self.start_workers(&mut st);
    }

    /// A counted handle is dropped; the last one retires the engine.
    fn release_handle(&self) {
        if self.handles.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        self.retire();
    }

    /// The last `Engine` handle is gone: demand everything recorded (and, through
    /// `global_demand`, everything recorded from now on), let the workers exit
    /// once it has run, and wait for it on a plain thread. Never blocks a worker
    /// thread of any engine.
    #[cold]
    fn retire(&self) {
        let mut st = lock(&self.state);
        if st.retiring || self.handles.load(Ordering::Acquire) != 0 {
            return;
        }
        st.retiring = true;
        self.retiring.store(true, Ordering::SeqCst);
        st.global_demand += 1;
        self.apply_inbox(&mut st);
        self.demand_all(&mut st);
        self.check_drained(&mut st);
        drop(st);
        if !sched::on_any_worker() {
            let _ = self.wait_all();
            self.join_retired_workers();
        }
    }

    /// On a plain thread after the last handle's barrier: waits (a little) for
    /// the workers to exit and joins them, so that they are gone when the drop
    /// returns. Gives up without joining if the engine is revived meanwhile or
    /// a worker is still busy (work recorded after the barrier).
    fn join_retired_workers(&self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        let mut st = lock(&self.state);
        while st.retiring && st.alive > 0 {
            let now = std::time::Instant::now();
            if now >= deadline {
                return;
            }
            st = match self.changed.wait_timeout(st, deadline - now) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        if !st.retiring {
            return;
        }
        // Every worker started so far has counted itself out: their threads
        // are ending.
        let threads = std::mem::take(&mut st.threads);
        drop(st);
        for t in threads {
            let _ = t.join();
        }
    }

    /// Demands every node in the graph and hands out the ready ones.
    fn demand_all(&self, st: &mut Locked) {
        let mut pushed = 0;
        st.graph.demand_all(&mut |r| {
            sched::publish(self, r);
            pushed += 1;
        });
        st.tally.flushes += 1;
        self.sleep.wake(pushed);
    }

    /// While retiring, lets the workers exit once nothing is left to run.
    fn check_drained(&self, st: &mut Locked) {
        if !st.retiring {
            return;
        }
        // Vars dropped meanwhile wait in the inbox; records there are demanded
        // when applied.
        self.apply_inbox(st);
        if st.graph.live_nodes() == 0 {
            self.shutdown.store(true, Ordering::Release);
            self.sleep.wake_all();
        }
    }

    /// Work entered the graph: while retiring, the workers must stay (or come
    /// back).
    fn keep_workers(&self, st: &mut Locked) {
        if st.retiring {
            self.shutdown.store(false, Ordering::Release);
            self.start_workers(st);
        }
    }

    /// Starts workers until the configured number runs.
    fn start_workers(&self, st: &mut Locked) {
        let Some(me) = self.me.upgrade() else {
            return;
        };
        while st.alive < self.config.workers {
            let Some(local) = st.idle_deques.pop() else {
                return;
            };
            let shared = me.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("lazyflow-worker-{}", st.alive))
                .spawn(move || sched::worker_main(shared, local));
            match spawned {
                Ok(handle) => {
                    st.alive += 1;
                    st.threads.push(handle);
                }
                Err(e) => {
                    eprintln!("lazyflow: could not start a worker thread: {e}");
                    return;
                }
            }
        }
    }

    /// Called by a worker that found no work after `shutdown` was set: whether it
    /// may exit (then its deque is kept for a later start).
    pub(crate) fn retire_worker(&self, local: &mut Option<crossbeam_deque::Worker<Work>>) -> bool {
        let mut st = lock(&self.state);
        if !st.retiring {
            return false;
        }
        self.apply_inbox(&mut st);
        if st.graph.live_nodes() != 0 || self.has_queued_work() {
            return false;
        }
        if let Some(l) = local.take() {
            st.idle_deques.push(l);
        }
        st.alive -= 1;
        if st.alive == 0 {
            self.changed.notify_all();
        }
        true
    }

    /// Records one node. In Lazy mode it goes to the inbox (applied to the graph
    /// in batches); in Async and Sync modes it enters the graph and is demanded at
    /// once, and Sync also waits for it. Stalls at the backpressure high mark
    /// (frontend threads only).
    pub(crate) fn record(
        &self,
        meta: NodeMeta,
        reads: SmallVec<[VarId; 4]>,
        writes: SmallVec<[VarId; 2]>,
        task: Task,
    ) -> Result<()> {
        // Records from inside a task go straight to the graph: a worker never
        // waits on backpressure, so it must not leave work in the inbox for a
        // stalled frontend to find.
        if self.config.mode == Mode::Lazy && !sched::on_worker_of(self.id) {
            let full = {
                let mut inbox = lock(&self.inbox);
                inbox.entries.push(Entry::Record {
                    meta,
                    reads,
                    writes,
                    task,
                });
                let n = inbox.entries.len();
                self.inbox_len
                    .store(n, std::sync::atomic::Ordering::Relaxed);
                n >= self.batch
            };
            // SeqCst, after the push under the inbox lock: if the engine began
            // retiring before this push, `retire` applied the inbox before it and
            // we see the flag here, so the entry is committed (and demanded) now
            // rather than left for workers that may have exited.
            if full || self.retiring.load(Ordering::SeqCst) {
                self.commit_batch();
            }
            return Ok(());
        }
        let mut pushed = 0;
        let on_worker = sched::on_worker_of(self.id);
        let mut st = lock(&self.state);
        if st.graph.live_nodes() >= self.config.high && !on_worker {
            st = self.backpressure(st);
        }
        // Keep program order with what this thread queued (other threads' entries
        // are unordered with this record anyway; the hint is exact for our own).
        if self.inbox_len.load(std::sync::atomic::Ordering::Relaxed) > 0 {
            self.apply_inbox(&mut st);
        }
        let status = task.status.clone();
        let id = st.graph.record(meta, &reads, &writes, task);
        if let Some(s) = &status {
            s.set_node(id);
        }
        st.tally.recorded += 1;
        let live = st.graph.live_nodes();
        if live > st.peak_live {
            st.peak_live = live;
        }
        if self.config.mode != Mode::Lazy || st.global_demand > 0 {
            st.graph.demand(&[id], &mut |r| {
                sched::publish(self, r);
                pushed += 1;
            });
        }
        self.keep_workers(&mut st);
        drop(st);
        self.sleep.wake(pushed);
        if self.config.mode == Mode::Sync {
            // The node's own failure is reported by the caller through the values
            // it wrote or its task handle; a wait that cannot happen (a record
            // inside a task that depends on that task) is this call's error.
            self.wait_for(|_| SmallVec::from_slice(&[id]))?;
        }
        Ok(())
    }

    /// Applies a full inbox, first stalling at the high mark if the frontend is
    /// that far ahead.
    #[cold]
    fn commit_batch(&self) {
        let mut st = lock(&self.state);
        let queued = self.inbox_len.load(std::sync::atomic::Ordering::Relaxed);
        if st.graph.live_nodes() + queued > self.config.high && !sched::on_worker_of(self.id) {
            st = self.backpressure(st);
        }
        self.apply_inbox(&mut st);
        self.keep_workers(&mut st);
    }

    fn gpus(&self) -> &[std::sync::Arc<Gpu>] {
        self.gpus.get_or_init(|| {
            crate::device::gpu::discover(
                self.config.backends,
                self.config.logical_devices,
                self.config.fusion,
                self.config.gpu_timeout,
            )
        })
    }

    /// The GPUs opened so far (none if nothing asked for one).
    fn opened_gpus(&self) -> &[std::sync::Arc<Gpu>] {
        self.gpus.get().map_or(&[], |g| g.as_slice())
    }

    /// Locks the graph with every deferred record and drop applied.
    pub(crate) fn lock_applied(&self) -> MutexGuard<'_, Locked> {
        let mut st = lock(&self.state);
        self.apply_inbox(&mut st);
        st
    }

    /// Moves the inbox into the graph, in order. Called with the graph lock held.
    fn apply_inbox(&self, st: &mut Locked) {
        let entries = {
            let mut inbox = lock(&self.inbox);
            if inbox.entries.is_empty() {
                return;
            }
            self.inbox_len
                .store(0, std::sync::atomic::Ordering::Relaxed);
            let spare = std::mem::take(&mut inbox.spare);
            std::mem::replace(&mut inbox.entries, spare)
        };
        let mut entries = entries;
        let mut pushed = 0;
        let mut recorded = false;
        for entry in entries.drain(..) {
            match entry {
                Entry::Record {
                    meta,
                    reads,
                    writes,
                    task,
                } => {
                    let status = task.status.clone();
                    let id = st.graph.record(meta, &reads, &writes, task);
                    if let Some(s) = status {
                        s.set_node(id);
                    }
                    st.tally.recorded += 1;
                    recorded = true;
                    if st.global_demand > 0 {
                        st.graph.demand(&[id], &mut |r| {
                            sched::publish(self, r);
                            pushed += 1;
                        });
                    }
                }
                Entry::DropVar(v) => st.graph.drop_var(v),
            }
        }
        if recorded {
            self.keep_workers(st);
        }
        let live = st.graph.live_nodes();
        if live > st.peak_live {
            st.peak_live = live;
        }
        // Keep the emptied buffer for the next swap: no allocation per batch.
        let mut inbox = lock(&self.inbox);
        if inbox.spare.capacity() < entries.capacity() {
            inbox.spare = entries;
        }
        drop(inbox);
        self.sleep.wake(pushed);
    }

    /// A new Var id, from the pool reserved in the graph.
    pub(crate) fn new_var(&self) -> VarId {
        if let Some(v) = lock(&self.inbox).free_vars.pop() {
            return v;
        }
        let mut st = lock(&self.state);
        let mut inbox = lock(&self.inbox);
        if inbox.free_vars.is_empty() {
            for _ in 0..VAR_CHUNK {
                let v = st.graph.new_var();
                inbox.free_vars.push(v);
            }
        }
        inbox.free_vars.pop().expect("just reserved")
    }

    /// A new Var id that is poisoned from the start.
    pub(crate) fn new_poisoned_var(&self, err: crate::error::SharedError) -> VarId {
        let v = self.new_var();
        lock(&self.state).graph.poison_var(v, err);
        v
    }

    /// Forgets a Var whose last handle is gone, after every record that named it.
    pub(crate) fn drop_var(&self, var: VarId) {
        let mut inbox = lock(&self.inbox);
        inbox.entries.push(Entry::DropVar(var));
        self.inbox_len
            .store(inbox.entries.len(), std::sync::atomic::Ordering::Relaxed);
    }

    #[cold]
    fn backpressure<'a>(&'a self, mut st: MutexGuard<'a, Locked>) -> MutexGuard<'a, Locked> {
        self.counters
            .backpressure_stalls
            .fetch_add(1, Ordering::Relaxed);
        let lazy = self.config.mode == Mode::Lazy;
        if lazy {
            self.demand_all(&mut st);
            st.global_demand += 1;
        }
        st.bp_waiters += 1;
        // Resume below the high mark even when the marks are equal.
        let resume_at = self.config.low.min(self.config.high - 1);
        while st.graph.live_nodes() > resume_at {
            // Re-armed by every waiter that goes (back) to sleep: another frontend
            // may have refilled the graph since the last notification.
            st.bp_signalled = false;
            st = wait(&self.changed, st);
        }
        st.bp_waiters -= 1;
        if lazy {
            st.global_demand -= 1;
        }
        st
    }

    /// Removes finished nodes (draining `finished`) and returns the first
    /// dependent they made ready, to be run next by the same thread; other ready
    /// dependents go to the queues.
    pub(crate) fn complete(&self, finished: &mut Vec<sched::Finished>) -> Option<Work> {
        self.complete_locked(lock(&self.state), finished)
    }

    fn complete_locked(
        &self,
        st: MutexGuard<'_, Locked>,
        finished: &mut Vec<sched::Finished>,
    ) -> Option<Work> {
        let mut next = None;
        let mut pushed = 0;
        let notify = {
            let mut st = st;
            let mut notify = false;
            for (node, outcome, status) in finished.drain(..) {
                match &outcome {
                    Outcome::Done => {}
                    Outcome::Failed(_) => st.tally.failed += 1,
                    Outcome::Skipped(_) => st.tally.skipped += 1,
                }
                st.tally.completed += 1;
                let (waited, err) = st.graph.complete(node, outcome, &mut |r| {
                    if next.is_none() {
                        next = Some(r);
                    } else {
                        sched::publish(self, r);
                        pushed += 1;
                    }
                });
                // Under the lock, so a blocker that sees the node gone sees its
                // status.
                sched::report(status, err);
                notify |= waited;
            }
            if st.retiring {
                self.check_drained(&mut st);
            }
            let live = st.graph.live_nodes();
            let drained = st.bp_waiters > 0
                && !st.bp_signalled
                && live <= self.config.low.min(self.config.high - 1);
            if drained {
                st.bp_signalled = true;
            }
            notify || drained || (st.all_waiters > 0 && live == 0)
        };
        if notify {
            self.changed.notify_all();
        }
        self.sleep.wake(pushed);
        next
    }

    /// Whether any queue holds work (checked by a worker before it parks).
    pub(crate) fn has_queued_work(&self) -> bool {
        !self.injector.is_empty() || self.stealers.iter().any(|s| !s.is_empty())
    }

    /// The targeted flush: demands the nodes `targets` picks (and their ancestors,
    /// nothing else) and waits until they finished. On a worker thread it runs other
    /// work while it waits, and refuses to wait for the task it is running.
    pub(crate) fn wait_for(
        &self,
        targets: impl FnOnce(&Graph<Task>) -> SmallVec<[NodeId; 4]>,
    ) -> Result<()> {
        let on_worker = sched::on_worker_of(self.id);
        if on_worker {
            // What this worker has finished must be completed before it waits:
            // the value may come from one of those nodes.
            if let Some(next) = sched::complete_pending(self) {
                sched::publish(self, next);
                self.sleep.wake(1);
            }
        }
        let mut st = self.lock_applied();
        let roots = targets(&st.graph);
        if roots.is_empty() {
            return Ok(());
        }
        let borrowed = sched::borrowed_vars(self.id);
        // Only waits that can deadlock need the walk (a frontend wait over a
        // long Lazy chain would otherwise pay it on every blocker).
        let ancestors = if on_worker || !borrowed.is_empty() {
            st.graph.ancestors(&roots)
        } else {
            std::collections::HashSet::new()
        };
        if !borrowed.is_empty() {
            if let Some(n) = st.graph.writer_among(ancestors.iter().copied(), &borrowed) {
                return Err(deadlock_error(
                    st.graph.meta(n),
                    "writes a Var that this thread is reading in Var::with",
                ));
            }
        }
        let mut registered = None;
        if on_worker {
            let running = sched::running_nodes();
            // Any task suspended on this thread (not only the innermost) that the
            // targets depend on can never finish while this wait lasts.
            if let Some(&n) = running.iter().rev().find(|n| ancestors.contains(n)) {
                return Err(deadlock_error(
                    st.graph.meta(n),
                    "would wait on its own output: it is the task that waits, or one suspended under it on the same thread",
                ));
            }
            // Nor can one whose finish needs, through blockers inside tasks on
            // other threads, what this wait keeps from finishing.
            if let Some(n) = waits_cycle(&st, &ancestors, &running) {
                return Err(deadlock_error(
                    st.graph.meta(n),
                    "waits, through blockers inside tasks on other threads, for this wait to end",
                ));
            }
            let id = st.next_wait;
            st.next_wait += 1;
            st.waits.push(WaitEntry {
                id,
                stack: running,
                roots: roots.clone(),
            });
            registered = Some(id);
        }
        let mut pushed = 0;
        st.graph.demand(&roots, &mut |r| {
            sched::publish(self, r);
            pushed += 1;
        });
        st.tally.flushes += 1;
        for &r in &roots {
            st.graph.set_waited(r);
        }
        self.sleep.wake(pushed);
        let done = |g: &Graph<Task>| roots.iter().all(|r| !g.is_live(*r));
        if let Some(id) = registered {
            drop(st);
            self.help_until(done, &ancestors);
            lock(&self.state).waits.retain(|w| w.id != id);
            return Ok(());
        }
        while !done(&st.graph) {
            st = wait(&self.changed, st);
        }
        Ok(())
    }

    /// Demands everything and waits until the graph is empty.
    pub(crate) fn wait_all(&self) -> Result<()> {
        if sched::on_worker_of(self.id) {
            if let Some(current) = sched::current_node() {
                let meta = lock(&self.state).graph.meta(current);
                return Err(deadlock_error(
                    meta,
                    "is the task that waits for everything",
                ));
            }
        }
        let mut st = lock(&self.state);
        let borrowed = sched::borrowed_vars(self.id);
        if !borrowed.is_empty() {
            self.apply_inbox(&mut st);
            if let Some(n) = st.graph.writer_among(st.graph.node_ids(), &borrowed) {
                return Err(deadlock_error(
                    st.graph.meta(n),
                    "writes a Var that this thread is reading in Var::with",
                ));
            }
        }
        st.global_demand += 1;
        self.apply_inbox(&mut st);
        self.demand_all(&mut st);
        st.all_waiters += 1;
        loop {
            // Whatever entered the inbox meanwhile is part of the barrier too.
            self.apply_inbox(&mut st);
            if st.graph.live_nodes() == 0 {
                break;
            }
            st = wait(&self.changed, st);
        }
        st.all_waiters -= 1;
        st.global_demand -= 1;
        Ok(())
    }

    /// A worker blocked inside a task keeps the pool going: it runs queued work
    /// that the wait needs (`allowed`: the targets and their ancestors, fixed when
    /// the wait began, since a later node cannot be an ancestor) until `done`
    /// holds, and naps briefly when there is none (the work it waits for may be
    /// running on another thread). Running anything else could suspend, under this
    /// wait, a task that itself needs a task suspended further down this stack.
    #[cold]
    fn help_until(
        &self,
        done: impl Fn(&Graph<Task>) -> bool,
        allowed: &std::collections::HashSet<NodeId>,
    ) {
        let mut others = Vec::new();
        loop {
            if done(&lock(&self.state).graph) {
                break;
            }
            let mut ran = false;
            while let Some(work) = sched::find_work(self) {
                if allowed.contains(&work.node) {
                    sched::run_completing(self, work, |n| allowed.contains(&n));
                    ran = true;
                    break;
                }
                others.push(work);
                if others.len() >= 64 {
                    break;
                }
            }
            // Work this wait does not need goes back for the other workers.
            let n = others.len();
            for work in others.drain(..) {
                self.injector.push(work);
            }
            self.sleep.wake(n);
            if ran {
                continue;
            }
            let st = lock(&self.state);
            if done(&st.graph) {
                break;
            }
            let _ = self.changed.wait_timeout(st, Duration::from_micros(200));
        }
    }
}

fn deadlock_error(meta: Option<NodeMeta>, reason: &str) -> Error {
    let (op, location) = match meta {
        Some(m) => (m.name.to_string(), m.location),
        None => ("<unknown>".to_string(), Location::caller()),
    };
    Error::WouldDeadlock {
        op,
        location,
        reason: reason.to_string(),
    }
}

/// A blocker inside a task, waiting on `roots`, on a thread where `stack` runs
/// (outermost first).
pub(crate) struct WaitEntry {
    id: u64,
    stack: Vec<NodeId>,
    roots: SmallVec<[NodeId; 4]>,
}

/// Whether a new wait, whose targets need `needed` (the targets and their
/// ancestors), closes a cycle through the waits of other threads: a node in
/// `needed` that is running on a thread suspended in a blocker finishes only
/// after that blocker's targets (and their ancestors) do, so those are needed
/// too. Returns the node of `running` (this thread's stack) found needed.
fn waits_cycle(
    st: &Locked,
    needed: &std::collections::HashSet<NodeId>,
    running: &[NodeId],
) -> Option<NodeId> {
    if st.waits.is_empty() {
        return None;
    }
    let mut needed = needed.clone();
    let mut merged = vec![false; st.waits.len()];
    loop {
        let mut grew = false;
        for (i, w) in st.waits.iter().enumerate() {
            if !merged[i] && w.stack.iter().any(|n| needed.contains(n)) {
                merged[i] = true;
                needed.extend(st.graph.ancestors(&w.roots));
                grew = true;
            }
        }
        if !grew {
            break;
        }
    }
    running.iter().rev().copied().find(|n| needed.contains(n))
}

fn wait<'a, T>(cv: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    match cv.wait(guard) {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}
