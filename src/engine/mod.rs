//! The engine: the glue between the graph (`graph/`), the worker pool (`sched/`)
//! and the devices. It records nodes, runs and completes them, flushes the
//! subgraphs that blockers need, and applies backpressure. There is no engine
//! lock: see `ARCHITECTURE.md` for the path of one op through these files.
//!
//! State is grouped by who touches it:
//! - shared read-only: `id`, `config`, `me`;
//! - reachable from every thread, lock-free: `pool`, `live`, `global_demand`,
//!   `retiring`, `handles`, `counters`;
//! - small locks on cold or sharded paths: `recorded` (one shard per
//!   recording thread), `drained` (threads waiting for the graph to drain),
//!   `waits` (blockers inside tasks), `life` (retiring and reviving).

mod builder;
mod deadlock;
// The engine's one `unsafe`: a small closure kept in the node's job in
// place, and a spent job's box written over by the next closure of the same
// layout (see `job.rs`).
#[allow(unsafe_code)]
mod job;
mod life;
mod registry;
mod stats;

pub use builder::{
    EngineBuilder, Mode, DEFAULT_GPU_TIMEOUT, DEFAULT_HIGH_WATERMARK, DEFAULT_LOW_WATERMARK,
};
pub(crate) use deadlock::Borrow;
pub(crate) use job::{deferred_job, job, Job};
pub(crate) use stats::Counters;
pub use stats::Stats;

use crate::device::{gpu::Gpu, Device, GpuInfo};
use crate::error::{Error, Location, Result, Running, RunningOp};
use crate::graph::{self, Latch, NodeMeta, Outcome};
use crate::sched::{Host, Pool};
use crate::sync::{lock, AtomicBool, AtomicUsize, Condvar, Mutex, Ordering};
use registry::Registry;
use smallvec::SmallVec;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;
use std::time::Duration;

/// The end of a task that finishes after its closure returned (MXNet's
/// asynchronous functions): the task's node stays unfinished, and the Vars it
/// writes stay unreadable, until [`Completion::finish`] is called, on any
/// thread. The worker that started the task is free in the meantime, so a
/// task that waits for the network or another process does not hold a
/// worker.
///
/// Dropping a `Completion` without finishing fails the task (nothing waits
/// forever for a completion that was lost, e.g. by a panic).
///
/// ```
/// use lazyflow::Engine;
/// let engine = Engine::builder().workers(1).build().unwrap();
/// let x = engine.var(0u32);
/// let mut t = engine.task("elsewhere");
/// let w = t.write(&x);
/// t.run_deferred(move |done| {
///     // Hand the work to another thread; the worker returns at once.
///     std::thread::spawn(move || {
///         *w.write() = 7;
///         done.finish(Ok::<(), String>(()));
///     });
/// })
/// .unwrap();
/// assert_eq!(x.get().unwrap(), 7);
/// ```
pub struct Completion {
    node: Option<NodeRef>,
    shared: std::sync::Arc<Shared>,
}

impl std::fmt::Debug for Completion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completion")
            .field("op", &self.node.as_ref().map(|n| n.meta.name))
            .finish()
    }
}

impl Completion {
    /// Finishes the task: `Ok` completes it, `Err` fails it with the error's
    /// message (its readers get the error, and tasks that depend on it are
    /// skipped, as for a panic).
    pub fn finish<E: std::fmt::Display>(mut self, result: std::result::Result<(), E>) {
        let outcome = match result {
            Ok(()) => Outcome::Done,
            Err(e) => Outcome::Failed(e.to_string()),
        };
        self.end(outcome);
    }

    fn end(&mut self, outcome: Outcome) {
        let Some(node) = self.node.take() else { return };
        // Not a worker's loop: the released dependent goes to the queues.
        if let Some(next) = self.shared.complete(&node, outcome, false) {
            self.shared.pool.publish(next);
            self.shared.pool.wake(1);
        }
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        if self.node.is_some() {
            self.end(Outcome::Failed(
                "the task's completion was dropped without finishing".into(),
            ));
        }
    }
}

/// A node of this engine's graph.
pub(crate) type NodeRef = graph::NodeRef<Job>;
/// A node of this engine's graph, handed out to run.
pub(crate) type Ready = graph::Ready<Job>;
/// The access queue of one Var.
pub(crate) type VarQueue = graph::VarQueue<Job>;
/// One Var named by a node being recorded.
pub(crate) type Access<'a> = graph::Access<'a, Job>;
pub(crate) type Accesses<'a> = graph::Accesses<'a, Job>;

/// A Var handle, type-erased: what the engine needs of a Var.
pub(crate) trait Tracked: Send + Sync {
    fn queue(&self) -> &VarQueue;
}

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
    pub(crate) shared: std::sync::Arc<Shared>,
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
    /// Fusion, timeout and autotuning of every GPU device.
    pub(crate) gpu: crate::device::gpu::GpuOptions,
    /// Threads one CPU kernel may use.
    pub(crate) cpu_threads: usize,
}

/// Everything the workers and the handles share.
pub(crate) struct Shared {
    // Shared read-only.
    pub(crate) id: u64,
    pub(crate) config: Config,
    /// A stalled frontend resumes at this many live nodes (below the high mark
    /// even when the marks are equal).
    resume_at: usize,
    /// Lazy mode: a recording thread demands what it recorded since the
    /// last demand of its shard once that is this many ops
    /// (`registry::lookahead`).
    lookahead: usize,
    /// This engine itself, to start workers again after they exited.
    me: std::sync::Weak<Shared>,

    // Reachable from every thread, lock-free.
    pool: Pool<Ready>,
    /// Recorded, unfinished nodes. SeqCst: pairs with `drained.barrier` and `drained.stalled` (a
    /// completion that brings it down reads the waiters; a waiter that announced
    /// itself reads it) and with `retiring` (see `life.rs`).
    /// On a cache line of its own: every record and completion changes it,
    /// and the read-mostly fields beside it would move between cores with it.
    live: crossbeam_utils::CachePadded<AtomicUsize>,
    /// Highest `live` seen (a statistic; Relaxed).
    peak_live: AtomicUsize,
    /// Ops workers completed and have not counted out of `live` yet, one
    /// slot per few workers (see [`OWED_MOST`]).
    owed: [crossbeam_utils::CachePadded<AtomicUsize>; OWED_SLOTS],
    /// Threads counting what a slot of `owed` held out of `live`: a reader
    /// of the count waits for them (see [`Shared::settle_owed`]).
    paying: AtomicUsize,
    /// Threads in `wait_all` or stalled by backpressure in Lazy mode, plus one
    /// while retiring. While there are any, every node recorded is demanded at
    /// once: those waits end only when the graph drains. SeqCst with the
    /// listing of each node in `record` (see `demand_all`).
    global_demand: AtomicUsize,
    /// The last `Engine` handle is gone (see `life.rs`).
    retiring: AtomicBool,
    /// `Engine` handles that count (see [`Engine`]).
    handles: AtomicUsize,
    pub(crate) counters: std::sync::Arc<Counters>,

    // Small locks on cold or sharded paths.
    /// The nodes recorded and not finished, and finished ones kept to record
    /// in again: for `wait_all`, backpressure and DOT export in Lazy mode,
    /// and for reuse (sharded by recording thread; see `registry.rs`).
    pub(crate) recorded: Registry,
    /// Threads waiting for `live` to drop (`wait_all`, backpressure, a retiring
    /// drop).
    drained: Drained,
    /// Blockers inside tasks, for cross-thread deadlock checks.
    waits: Mutex<deadlock::Waits>,
    /// Serializes retiring and reviving.
    life: Mutex<()>,
    /// GPU devices, opened on first use (opening one takes tens of milliseconds).
    gpus: OnceLock<Vec<std::sync::Arc<Gpu>>>,
    /// Open record-time batches, one set per device that has had one (see
    /// `tensor/batch.rs`): closed before anything touches a Var they name,
    /// and by every barrier.
    batches: Mutex<Vec<std::sync::Arc<dyn Batches>>>,
    /// A slot for the tensor layer's record-time batches of the CPU device
    /// (the GPUs have theirs in their device).
    pub(crate) cpu_frontend: OnceLock<std::sync::Arc<dyn std::any::Any + Send + Sync>>,
}

/// The most ops a worker completes before it counts them out of `live`.
///
/// Why not one by one: `live` is written by every record, and a worker's
/// decrement per node took its line from the recorder once a node; with
/// recording and running overlapped (the Lazy window) the recorder's load
/// and add of `live` were most of `Shared::record_job`'s time on `chain`
/// of `benches/scheduler.rs`. A worker adds what it completes to a slot of
/// [`Shared::owed`] (a line of its own) instead, and moves the slot into
/// `live` once it holds this many, whenever the worker finds no work
/// ([`Host::idle`]), and before it blocks inside a task. So `live` only
/// ever runs high by what is owed (`live == 0` still means nothing is
/// left), every wait on it ends, and [`Engine::stats`], which moves every
/// slot first, counts a node out as soon as it finished.
const OWED_MOST: usize = 64;
/// Slots of [`Shared::owed`]: workers share one only past this many.
const OWED_SLOTS: usize = 16;

/// The slot of [`Shared::owed`] of the calling worker.
fn owed_slot() -> usize {
    crate::sync::thread_number() % OWED_SLOTS
}

thread_local! {
    /// Set while this thread records under a lock that a task's own records
    /// may need (a record-time batch's): no stall there, or the tasks the
    /// stall waits for could wait for that lock. The caller throttles before
    /// taking the lock instead.
    static STALL_HELD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with backpressure stalls held off on this thread (see
/// `STALL_HELD`).
pub(crate) fn without_stalls<R>(f: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            STALL_HELD.with(|h| h.set(self.0));
        }
    }
    let _reset = Reset(STALL_HELD.with(|h| h.replace(true)));
    f()
}

/// Record-time batches of the tensor layer, as the engine closes them.
pub(crate) trait Batches: Send + Sync {
    /// Records the open batch, if any, as a node of `engine`.
    fn close(&self, engine: &Engine);
    /// Lets go of what the batches keep for later ops (the engine retires).
    fn retire(&self) {}
}

/// When a barrier that hands out many nodes wakes a worker: for the first
/// node, then one per [`WAKE_EVERY`] (the workers take the injector's nodes
/// in batches, and a wake-up, a fence, per node was a tenth of the
/// hand-out), and once more after the last if it came after the last
/// wake-up. Without that last one, a barrier that handed out a multiple of
/// 16 nodes could leave 15 in the injector while every worker slept, and
/// wait for them forever.
#[derive(Default)]
struct WakeEvery {
    published: usize,
    woken_at: usize,
}

/// Nodes a barrier hands out per wake-up.
const WAKE_EVERY: usize = 16;

impl WakeEvery {
    /// Notes a node published; whether to wake a worker for it now.
    fn published(&mut self) -> bool {
        self.published += 1;
        let wake = (self.published - 1).is_multiple_of(WAKE_EVERY);
        if wake {
            self.woken_at = self.published;
        }
        wake
    }

    /// Whether one more wake-up is owed once the last node is published.
    fn owed(&self) -> bool {
        self.published > self.woken_at
    }
}

/// Where threads wait for the number of live nodes to drop.
struct Drained {
    lock: Mutex<()>,
    cv: Condvar,
    /// Threads waiting for the graph to drain completely (`wait_all`, a
    /// retiring drop). SeqCst: a waiter increments it and then reads `live`; a
    /// completion decrements `live` and then reads it. At least one sees the
    /// other; the waiter holds `lock` from its check to its wait, and the
    /// completion takes `lock` to notify, so no wake-up falls in between.
    barrier: AtomicUsize,
    /// Frontends stalled by backpressure, waiting for the low mark (SeqCst, as
    /// `barrier`).
    stalled: AtomicUsize,
}

/// Whether a completion that left `live` nodes must wake the threads waiting
/// in [`Drained`]: those in a barrier only at zero, stalled frontends at the
/// low mark (`resume_at`). Waking a barrier at every completion below the low
/// mark would cost a futex call per node while it waits.
fn wants_notify(live: usize, resume_at: usize, barrier: usize, stalled: usize) -> bool {
    (stalled > 0 && live <= resume_at) || (barrier > 0 && live == 0)
}

impl Drained {
    /// Waits until `done`, checking it at every notification and at least
    /// once a millisecond, each time after `settle` (without the lock: it
    /// may notify): what a worker owes (see [`OWED_MOST`]) is counted out
    /// by the waiter itself when no worker pays it (a worker blocked inside
    /// a task on something outside the engine, say).
    fn wait_until(&self, waiters: &AtomicUsize, settle: impl Fn(), done: impl Fn() -> bool) {
        waiters.fetch_add(1, Ordering::SeqCst);
        loop {
            settle();
            let g = lock(&self.lock);
            if done() {
                break;
            }
            #[cfg(not(loom))]
            drop(self.cv.wait_timeout(g, Duration::from_millis(1)));
            #[cfg(loom)]
            drop(self.cv.wait(g));
        }
        waiters.fetch_sub(1, Ordering::SeqCst);
    }

    #[cold]
    fn notify(&self) {
        let _g = lock(&self.lock);
        self.cv.notify_all();
    }
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
        let shared = std::sync::Arc::new_cyclic(|me| Shared {
            id: NEXT_ENGINE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            resume_at: config.low.min(config.high - 1),
            lookahead: registry::lookahead(config.high),
            pool: Pool::new(config.workers),
            config,
            me: me.clone(),
            live: crossbeam_utils::CachePadded::new(AtomicUsize::new(0)),
            peak_live: AtomicUsize::new(0),
            owed: std::array::from_fn(|_| Default::default()),
            paying: AtomicUsize::new(0),
            global_demand: AtomicUsize::new(0),
            retiring: AtomicBool::new(false),
            handles: AtomicUsize::new(1),
            counters: std::sync::Arc::new(Counters::default()),
            recorded: Registry::default(),
            drained: Drained {
                lock: Mutex::new(()),
                cv: Condvar::new(),
                barrier: AtomicUsize::new(0),
                stalled: AtomicUsize::new(0),
            },
            waits: Mutex::new(deadlock::Waits::default()),
            life: Mutex::new(()),
            gpus: OnceLock::new(),
            batches: Mutex::new(Vec::new()),
            cpu_frontend: OnceLock::new(),
        });
        if shared.pool.start(&shared, "lazyflow-worker") == 0 {
            return Err(Error::Config("could not start any worker thread".into()));
        }
        Ok(Engine {
            shared,
            counted: true,
        })
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

    /// Kernels dispatched so far on a GPU device (0 for the CPU, whose ops
    /// are counted in [`Stats::completed`], less [`Stats::elided_ops`] for
    /// the ops of record-time batches that were never computed).
    pub fn kernels_dispatched(&self, device: Device) -> u64 {
        match device {
            Device::Gpu(i) => self.shared().gpus().get(i).map_or(0, |g| {
                g.dispatched.load(std::sync::atomic::Ordering::Relaxed)
            }),
            Device::Cpu => 0,
        }
    }

    /// Tensor buffers given memory so far on a GPU device (taken from its pool
    /// of idle buffers or created; 0 for the CPU). A fused elementwise op's
    /// value that nothing outside its kernel reads is never given any.
    pub fn gpu_buffers_backed(&self, device: Device) -> u64 {
        match device {
            Device::Gpu(i) => self.shared().gpus().get(i).map_or(0, |g| {
                g.buffers_backed.load(std::sync::atomic::Ordering::Relaxed)
            }),
            Device::Cpu => 0,
        }
    }

    /// Kernels compiled so far on a GPU device (0 for the CPU): the misses of
    /// its compiled-kernel cache. A program that runs again should compile
    /// nothing new: fused kernels are cached by their structure.
    pub fn kernels_compiled(&self, device: Device) -> u64 {
        match device {
            Device::Gpu(i) => self
                .shared()
                .gpus()
                .get(i)
                .map_or(0, |g| g.compiled.load(std::sync::atomic::Ordering::Relaxed)),
            Device::Cpu => 0,
        }
    }

    /// The autotuner's choices for `device`'s adapter (none on the CPU): one
    /// per kernel and shape class seen so far in this process or read from
    /// the cache file (see [`EngineBuilder::autotune`]).
    ///
    /// ```
    /// use lazyflow::{Device, Engine};
    /// let engine = Engine::builder().build().unwrap();
    /// assert!(engine.tuned_kernels(Device::Cpu).is_empty());
    /// ```
    pub fn tuned_kernels(&self, device: Device) -> Vec<crate::TunedKernel> {
        match device {
            Device::Gpu(i) => self
                .gpu(i)
                .map_or_else(Vec::new, |g| crate::device::tune::entries(&g.adapter)),
            Device::Cpu => Vec::new(),
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

    /// A snapshot of the engine's counters. A node seen finished before the
    /// call (a blocker on it returned, say) is not in `live_nodes`: the
    /// completions its workers had not yet counted out (they count in
    /// groups) are counted out first.
    pub fn stats(&self) -> Stats {
        let shared = self.shared();
        shared.counters.snapshot(
            shared.recorded.recorded(),
            || {
                shared.settle_owed();
                shared.live.load(Ordering::SeqCst)
            },
            shared.peak_live.load(Ordering::Relaxed),
        )
    }

    /// Resets the peak of live nodes reported by [`Engine::stats`] to the current
    /// count.
    pub fn reset_peak(&self) {
        let s = self.shared();
        s.peak_live
            .store(s.live.load(Ordering::SeqCst), Ordering::Relaxed);
    }

    /// The nodes recorded in Lazy mode and not finished, with everything they
    /// wait for, in Graphviz DOT. Demanded nodes are bold. (In Async and Sync
    /// modes every node is demanded at once and none is listed.)
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
        self.shared().close_batches();
        let nodes = if self.mode() == Mode::Lazy {
            self.shared().recorded.snapshot()
        } else {
            Vec::new()
        };
        graph::to_dot(&nodes, |lane| lane_device(lane).to_string())
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

/// The graph's lane of a node that runs on `device`.
pub(crate) fn device_lane(device: Device) -> u32 {
    match device {
        Device::Cpu => 0,
        Device::Gpu(i) => i as u32 + 1,
    }
}

fn lane_device(lane: u32) -> Device {
    match lane {
        0 => Device::Cpu,
        i => Device::Gpu(i as usize - 1),
    }
}

impl Host for Shared {
    type Job = Ready;

    fn pool(&self) -> &Pool<Ready> {
        &self.pool
    }

    /// Runs a node and completes it; returns the first dependent it released.
    #[inline]
    fn run(&self, node: Ready) -> Option<Ready> {
        let outcome = execute(self, &node)?;
        self.complete(&node, outcome, true)
    }

    fn may_exit(&self) -> bool {
        self.retiring.load(Ordering::SeqCst) && self.live.load(Ordering::SeqCst) == 0
    }

    fn idle(&self) {
        self.pay(owed_slot());
    }
}

/// Runs a node's job on this thread (or skips it when an input is poisoned),
/// catching panics, and gives the spent job back to the node (the next node
/// recorded in its memory may reuse its box). Returns how it ended; `None` for
/// a deferred job that was started (it completes through its
/// [`Completion`]). `node` was handed out to this thread.
fn execute(shared: &Shared, node: &Ready) -> Option<Outcome> {
    let Some((mut job, skip)) = node.take_job() else {
        // Unreachable: a node is handed out once.
        return Some(Outcome::Failed("the node's job was taken twice".into()));
    };
    if let Some(err) = skip {
        // The closure's captures are dropped without running it; a panicking
        // Drop must not take the worker down with it.
        let _ = catch_unwind(AssertUnwindSafe(|| job.clear()));
        node.give_back(job);
        return Some(Outcome::Skipped(err));
    }
    if job.deferred() {
        return start_deferred(shared, node, job);
    }
    let running = Running::enter(RunningOp {
        key: node.key(),
        name: node.meta.name,
        location: node.meta.location,
    });
    let result = catch_unwind(AssertUnwindSafe(|| job.call()));
    drop(running);
    let outcome = match result {
        Ok(Ok(())) => Outcome::Done,
        Ok(Err(message)) => Outcome::Failed(message),
        Err(payload) => {
            let message = panic_message(payload.as_ref());
            // Dropping a panic payload can itself panic; never let that escape.
            let _ = catch_unwind(AssertUnwindSafe(move || drop(payload)));
            Outcome::Failed(message)
        }
    };
    node.give_back(job);
    Some(outcome)
}

/// Starts a deferred job. A panic before it handed its completion on drops the
/// completion, which fails the node; a panic after that leaves the ending to
/// whoever holds it.
#[cold]
fn start_deferred(shared: &Shared, node: &NodeRef, mut job: Job) -> Option<Outcome> {
    let Some(me) = shared.me.upgrade() else {
        let _ = catch_unwind(AssertUnwindSafe(move || drop(job)));
        return Some(Outcome::Failed("the engine is gone".into()));
    };
    let done = Completion {
        node: Some(node.clone()),
        shared: me,
    };
    let running = Running::enter(RunningOp {
        key: node.key(),
        name: node.meta.name,
        location: node.meta.location,
    });
    let result = catch_unwind(AssertUnwindSafe(|| job.start(done)));
    drop(running);
    if let Err(payload) = result {
        let _ = catch_unwind(AssertUnwindSafe(move || drop(payload)));
    }
    let _ = catch_unwind(AssertUnwindSafe(move || drop(job)));
    None
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        format!("panicked: {s}")
    } else if let Some(s) = payload.downcast_ref::<String>() {
        format!("panicked: {s}")
    } else {
        "panicked".to_string()
    }
}

impl Shared {
    fn gpus(&self) -> &[std::sync::Arc<Gpu>] {
        self.gpus.get_or_init(|| {
            crate::device::gpu::discover(
                self.config.backends,
                self.config.logical_devices,
                &self.config.gpu,
            )
        })
    }

    /// The GPUs opened so far (none if nothing asked for one).
    fn opened_gpus(&self) -> &[std::sync::Arc<Gpu>] {
        self.gpus.get().map_or(&[], |g| g.as_slice())
    }

    /// Registers a device's record-time batches.
    pub(crate) fn add_batches(&self, b: std::sync::Arc<dyn Batches>) {
        lock(&self.batches).push(b);
    }

    /// Records every open record-time batch (before an access to a Var one
    /// names, and at barriers).
    #[cold]
    pub(crate) fn close_batches(&self) {
        let all: Vec<std::sync::Arc<dyn Batches>> = lock(&self.batches).clone();
        if all.is_empty() {
            return;
        }
        let Some(shared) = self.me.upgrade() else {
            return;
        };
        let engine = Engine {
            shared,
            counted: false,
        };
        for b in all {
            b.close(&engine);
        }
    }

    /// Tells every device's record-time batches that the engine retires.
    pub(crate) fn retire_batches(&self) {
        let all: Vec<std::sync::Arc<dyn Batches>> = lock(&self.batches).clone();
        for b in all {
            b.retire();
        }
    }

    /// Whether the calling thread is one of this engine's workers.
    #[inline]
    pub(crate) fn on_worker(&self) -> bool {
        self.pool.is_worker()
    }

    /// Records one node. In Async and Sync modes it is demanded at once (and
    /// Sync waits for it); in Lazy mode it waits for a demand. Stalls at the
    /// backpressure high mark (frontend threads only: a worker never waits
    /// there). Returns the node (task handles wait on it).
    pub(crate) fn record<F>(
        &self,
        meta: NodeMeta,
        accesses: &mut Accesses<'_>,
        f: F,
        handle: bool,
    ) -> Result<Option<NodeRef>>
    where
        F: FnOnce() -> std::result::Result<(), String> + Send + 'static,
    {
        self.record_job(meta, accesses, move |spent| job(f, spent), handle)
    }

    /// Records a node whose job finishes through a [`Completion`]. With
    /// `eager` it is demanded at once also in Lazy mode (with its ancestors).
    pub(crate) fn record_deferred<F>(
        &self,
        meta: NodeMeta,
        accesses: &mut Accesses<'_>,
        f: F,
        eager: bool,
    ) -> Result<NodeRef>
    where
        F: FnOnce(Completion) + Send + 'static,
    {
        let node = self
            .record_job(meta, accesses, move |_| deferred_job(f), true)?
            .expect("a handle was asked for");
        if eager && self.config.mode == Mode::Lazy && !node.is_done() {
            self.demand(std::slice::from_ref(&node));
        }
        Ok(node)
    }

    /// Records a node whose job `job` makes from the spent job of a spare
    /// (a finished node of the recording thread's list, reused if nobody
    /// else holds it).
    pub(crate) fn record_job(
        &self,
        meta: NodeMeta,
        accesses: &mut Accesses<'_>,
        job: impl FnOnce(Option<Job>) -> Job,
        handle: bool,
    ) -> Result<Option<NodeRef>> {
        let mode = self.config.mode;
        let weight = meta.weight as usize;
        self.throttle(weight);
        let live = self.live.fetch_add(weight, Ordering::SeqCst) + weight;
        if live > self.peak_live.load(Ordering::Relaxed) {
            self.peak_live.fetch_max(live, Ordering::Relaxed);
        }
        let lazy = mode == Mode::Lazy;
        // The spare taken and the node listed under one lock of this thread's
        // shard (see `registry.rs`); in Lazy mode the node is demanded here
        // if a barrier is under way.
        let mut shard = self.recorded.mine();
        // After `live` (see `Counters::snapshot`), under the lock the record
        // holds anyway: a locked add of its own cost about 8 ns a node on
        // some machines.
        shard.count(weight);
        let meta = NodeMeta {
            group: shard.group,
            ..meta
        };
        let (node, ready) = graph::record(
            meta,
            accesses,
            job,
            !lazy,
            self.recorded.take(&mut shard),
            Some(&registry::NODES),
        );
        if let Some(ready) = ready {
            self.pool.publish(ready);
            self.pool.wake(1);
        }
        // SeqCst, with the shard locked (the node's place in it does not
        // matter): a `demand_all` that began before this load either finds
        // the node in the shard or is seen here (see `Registry::demand_all`).
        if lazy && self.global_demand.load(Ordering::SeqCst) > 0 {
            self.demand(std::slice::from_ref(&node));
        }
        // The list takes the node itself when nothing else needs it (`push`):
        // one reference fewer to take and let go per node.
        let node = if handle || mode == Mode::Sync {
            shard.push(node.clone());
            Some(node)
        } else {
            shard.push(node);
            None
        };
        // Far enough ahead: the window recorded since the last demand runs
        // while this thread records on (see `registry::lookahead`).
        if lazy && shard.undemanded() >= self.lookahead {
            self.hand_out_all(|ready| shard.demand_rest(&mut |r| ready(r)));
        }
        drop(shard);
        if self.retiring.load(Ordering::SeqCst) {
            self.keep_workers();
        }
        if mode == Mode::Sync {
            // The node's own failure is reported by the caller through the values
            // it wrote or its task handle; a wait that cannot happen (a record
            // inside a task that depends on that task) is this call's error.
            let node = node.expect("kept in Sync mode");
            self.wait_for(std::iter::once(node.clone()).collect())?;
            return Ok(handle.then_some(node));
        }
        Ok(node.filter(|_| handle))
    }

    /// Stalls a frontend until `weight` more ops fit under the backpressure
    /// bound (in Lazy mode it first demands everything recorded). A node of
    /// several ops stalls where it would cross the high mark, unless the
    /// graph is already down to the low mark (one batch may weigh more than a
    /// small bound). Never on a worker, nor under a batch's lock (see
    /// `STALL_HELD`).
    #[inline]
    pub(crate) fn throttle(&self, weight: usize) {
        let now = self.live.load(Ordering::Relaxed);
        if now + weight > self.config.high
            && now > self.resume_at
            && !self.on_worker()
            && !STALL_HELD.with(|h| h.get())
        {
            self.backpressure();
        }
    }

    /// Demands `roots` and their unfinished ancestors and hands out the ready
    /// ones.
    fn demand(&self, roots: &[NodeRef]) {
        graph::demand(roots, &mut |r| self.hand_out(r));
    }

    /// Publishes a node the demand walk found ready, and wakes a worker for it
    /// at once: the walk of a large graph takes a while, and its first ready
    /// nodes can run meanwhile.
    fn hand_out(&self, node: Ready) {
        self.pool.publish(node);
        self.pool.wake(1);
    }

    /// Demands every node recorded so far (Lazy mode). The caller has raised
    /// `global_demand`, so that what other threads record meanwhile is
    /// demanded too (see `Registry::demand_all`).
    fn demand_all(&self) {
        self.counters.flushes.fetch_add(1, Ordering::Relaxed);
        if self.config.mode != Mode::Lazy {
            return;
        }
        debug_assert!(self.global_demand.load(Ordering::SeqCst) > 0);
        self.hand_out_all(|ready| self.recorded.demand_all(&mut |r| ready(r)));
    }

    /// Runs a demand of many nodes, `demand`, handing out what it finds
    /// ready onto the injector (the caller is not running a node of its own
    /// deque: a frontend, or a retiring drop; a recording worker's nodes may
    /// go to any worker), with wake-ups as [`WakeEvery`] says.
    fn hand_out_all(&self, demand: impl FnOnce(&mut dyn FnMut(Ready))) {
        let mut wakes = WakeEvery::default();
        demand(&mut |r| {
            self.pool.publish_global(r);
            if wakes.published() {
                self.pool.wake(1);
            }
        });
        if wakes.owed() {
            self.pool.wake(1);
        }
    }

    /// Completes a node that ran: releases its dependents (the first one is
    /// returned for this thread to run next, the others are published) and
    /// wakes whoever waits for it or for the graph to drain. With `owe` (a
    /// worker's own loop), the node is counted out of `live` later, with
    /// others (see [`OWED_MOST`]).
    fn complete(&self, node: &NodeRef, outcome: Outcome, owe: bool) -> Option<Ready> {
        match &outcome {
            Outcome::Done => {}
            Outcome::Failed(_) => {
                self.counters.failed.fetch_add(1, Ordering::Relaxed);
            }
            Outcome::Skipped(_) => {
                self.counters.skipped.fetch_add(1, Ordering::Relaxed);
            }
        }
        // The node is counted out (or owed) and marked finished before any
        // dependent it releases is handed out: nobody sees a dependent run
        // while the node still looks unfinished, and a reader of the count
        // that saw the node finished finds it owed. The first one released
        // runs next on this thread; the others are published.
        let finished = graph::complete(node, outcome);
        let weight = node.meta.weight as usize;
        let live = if owe {
            let slot = owed_slot();
            if self.owed[slot].fetch_add(weight, Ordering::SeqCst) + weight >= OWED_MOST {
                self.pay(slot);
            }
            None
        } else {
            Some(self.live.fetch_sub(weight, Ordering::SeqCst) - weight)
        };
        let mut next = None;
        let mut pushed = 0;
        finished.wake(&mut |r| {
            if next.is_none() {
                next = Some(r);
            } else {
                self.pool.publish(r);
                pushed += 1;
            }
        });
        self.pool.wake(pushed);
        if let Some(live) = live {
            self.counted_out(live);
        }
        next
    }

    /// Counts what slot `slot` of [`Shared::owed`] holds out of `live`.
    fn pay(&self, slot: usize) {
        if self.owed[slot].load(Ordering::Relaxed) == 0 {
            return;
        }
        self.paying.fetch_add(1, Ordering::SeqCst);
        let owed = self.owed[slot].swap(0, Ordering::SeqCst);
        let live = (owed > 0).then(|| self.live.fetch_sub(owed, Ordering::SeqCst) - owed);
        self.paying.fetch_sub(1, Ordering::SeqCst);
        if let Some(live) = live {
            self.counted_out(live);
        }
    }

    /// Counts everything owed out of `live`, and waits (briefly) for the
    /// threads doing the same meanwhile, so that a node seen finished
    /// before this call is not in the count read after it (see
    /// [`OWED_MOST`]).
    fn settle_owed(&self) {
        for slot in 0..OWED_SLOTS {
            self.pay(slot);
        }
        // A payer that took a slot before this thread did raised `paying`
        // first; its part of `live` is settled once it lowers it again.
        // Bounded: under a steady stream of completions the count read is
        // a moment's anyway.
        for _ in 0..10_000 {
            if self.paying.load(Ordering::SeqCst) == 0 {
                break;
            }
            std::hint::spin_loop();
        }
    }

    /// Wakes whoever waits for `live` to drop, now that a completion left
    /// it at `live`.
    fn counted_out(&self, live: usize) {
        if live <= self.resume_at
            && wants_notify(
                live,
                self.resume_at,
                self.drained.barrier.load(Ordering::SeqCst),
                self.drained.stalled.load(Ordering::SeqCst),
            )
        {
            self.drained.notify();
        }
        if live == 0 && self.retiring.load(Ordering::SeqCst) {
            self.check_drained();
        }
    }

    /// Recording stalls: in Lazy mode everything recorded is demanded (and so
    /// is what other threads record meanwhile), then the frontend waits until
    /// the graph drained to the low mark.
    #[cold]
    fn backpressure(&self) {
        self.counters
            .backpressure_stalls
            .fetch_add(1, Ordering::Relaxed);
        let lazy = self.config.mode == Mode::Lazy;
        if lazy {
            self.global_demand.fetch_add(1, Ordering::SeqCst);
            self.demand_all();
        }
        self.drained.wait_until(
            &self.drained.stalled,
            || self.settle_owed(),
            || self.live.load(Ordering::SeqCst) <= self.resume_at,
        );
        if lazy {
            self.global_demand.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// The targeted flush: demands `targets` (and their ancestors, nothing else)
    /// and waits until they finished. On a worker thread it runs the work it
    /// needs while it waits, and refuses to wait for the task it is running.
    pub(crate) fn wait_for(&self, targets: SmallVec<[NodeRef; 4]>) -> Result<()> {
        if self.on_worker() {
            // A task that blocks: its worker's part of what is owed is
            // counted out first, so that no wait on `live` waits for the
            // task's end (see `OWED_MOST`).
            self.pay(owed_slot());
        }
        let targets: SmallVec<[NodeRef; 4]> =
            targets.into_iter().filter(|t| !t.is_done()).collect();
        if targets.is_empty() {
            return Ok(());
        }
        self.counters.flushes.fetch_add(1, Ordering::Relaxed);
        let on_worker = self.on_worker();
        let check = self.check_wait(&targets, on_worker)?;
        self.demand(&targets);
        match check {
            Some((entry, allowed)) => {
                self.help_until(&targets, &allowed);
                self.end_wait(entry);
            }
            None => {
                // One latch per target: each completion wakes only this thread.
                for t in &targets {
                    let latch = crate::sync::Arc::new(Latch::default());
                    if t.add_waiter(&latch) {
                        latch.wait();
                    }
                }
            }
        }
        Ok(())
    }

    /// Demands everything and waits until no node is left unfinished.
    pub(crate) fn wait_all(&self) -> Result<()> {
        self.close_batches();
        self.check_wait_all()?;
        self.global_demand.fetch_add(1, Ordering::SeqCst);
        self.demand_all();
        self.drained.wait_until(
            &self.drained.barrier,
            || self.settle_owed(),
            || self.live.load(Ordering::SeqCst) == 0,
        );
        self.global_demand.fetch_sub(1, Ordering::SeqCst);
        self.recorded.prune(registry::KEEP);
        Ok(())
    }

    /// A worker blocked inside a task keeps the pool going: it runs queued work
    /// that the wait needs (`allowed`: the targets and their ancestors, fixed when
    /// the wait began, since a later node cannot be an ancestor) until the
    /// targets finished, and naps briefly on the first unfinished target when
    /// there is none (the work it waits for may be running on another thread).
    /// Running anything else could suspend, under this wait, a task that itself
    /// needs a task suspended further down this stack.
    #[cold]
    fn help_until(&self, targets: &[NodeRef], allowed: &std::collections::HashMap<usize, NodeRef>) {
        let mut others = Vec::new();
        let mut napping: Option<(usize, crate::sync::Arc<Latch>)> = None;
        while let Some(waiting) = targets.iter().find(|t| !t.is_done()) {
            let mut ran = false;
            while let Some(node) = self.pool.find_work() {
                if allowed.contains_key(&node.key()) {
                    self.run_completing(node, allowed);
                    ran = true;
                    break;
                }
                others.push(node);
                if others.len() >= 64 {
                    break;
                }
            }
            // Work this wait does not need goes back for the other workers.
            let n = others.len();
            for node in others.drain(..) {
                self.pool.publish_global(node);
            }
            self.pool.wake(n);
            if ran {
                continue;
            }
            // One latch per target for the whole wait: registering a new one
            // at every nap would grow the node's waiter list for as long as
            // the wait lasts.
            let latch = match &napping {
                Some((key, latch)) if *key == waiting.key() => Some(latch.clone()),
                _ => {
                    let latch = crate::sync::Arc::new(Latch::default());
                    let registered = waiting.add_waiter(&latch);
                    napping = Some((waiting.key(), latch.clone()));
                    registered.then_some(latch)
                }
            };
            if let Some(latch) = latch {
                latch.wait_timeout(Duration::from_micros(200));
            }
        }
    }

    /// Runs `node` and completes it, then the dependents it releases for as long
    /// as the wait needs them (the rest go to the queues).
    fn run_completing(&self, mut node: Ready, allowed: &std::collections::HashMap<usize, NodeRef>) {
        loop {
            let Some(outcome) = execute(self, &node) else {
                return;
            };
            match self.complete(&node, outcome, false) {
                Some(next) if allowed.contains_key(&next.key()) => node = next,
                Some(next) => {
                    self.pool.publish(next);
                    self.pool.wake(1);
                    return;
                }
                None => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{wants_notify, WakeEvery, WAKE_EVERY};

    /// Every node a barrier hands out is followed by a wake-up (its own or
    /// the last one): a node published after the last wake-up can sit in the
    /// injector while every worker sleeps, and the barrier waits for it
    /// forever. One wake-up per `WAKE_EVERY` nodes, give or take two.
    #[test]
    fn every_node_a_barrier_hands_out_is_followed_by_a_wake_up() {
        for n in 1..=5 * WAKE_EVERY + 3 {
            let mut wakes = WakeEvery::default();
            let (mut last_woken, mut count) = (None, 0);
            for i in 0..n {
                if wakes.published() {
                    last_woken = Some(i);
                    count += 1;
                }
            }
            if wakes.owed() {
                last_woken = Some(n - 1);
                count += 1;
            }
            assert_eq!(last_woken, Some(n - 1), "{n} nodes handed out");
            assert!(count <= n / WAKE_EVERY + 2, "{n} nodes: {count} wake-ups");
        }
    }

    #[test]
    fn a_barrier_is_woken_at_zero_and_a_stalled_frontend_at_the_low_mark() {
        // A barrier alone: only the last completion wakes it, whatever the
        // low mark (an unbounded engine's is the largest count there is).
        assert!(!wants_notify(5, usize::MAX - 1, 1, 0));
        assert!(!wants_notify(1, 100, 1, 0));
        assert!(wants_notify(0, 100, 1, 0));
        // A stalled frontend: at the low mark and below.
        assert!(!wants_notify(101, 100, 0, 1));
        assert!(wants_notify(100, 100, 0, 1));
        assert!(wants_notify(3, 100, 1, 1));
        // Nobody waiting: nobody to wake.
        assert!(!wants_notify(0, 100, 0, 0));
    }
}
