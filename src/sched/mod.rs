//! The worker pool: threads that take jobs from crossbeam-deque queues and hand
//! them to their [`Host`]. The pool knows nothing of nodes, Vars or engines; a
//! host runs a job and returns the next one to run on the same thread. See
//! `README.md` beside this file for the sleep/wake protocol.
//!
//! Queues: one global `Injector` (fed by threads outside the pool: the frontend's
//! flushes and records) and one LIFO `Worker` deque per thread (fed by jobs the
//! thread made ready), whose `Stealer`s the other threads raid when idle. The job
//! a host returns from [`Host::run`] is run at once without touching any queue, so
//! a chain runs on one thread without wake-ups.
//!
//! State is grouped by who touches it: `injector`, `stealers`, `sleep` and
//! `shutdown` are reachable from every thread; `threads` (the worker threads and
//! their parked deques) sits behind a small lock taken only to start, retire or
//! join workers.

pub(crate) mod sleep;

use crate::sync::{AtomicBool, Ordering};
use crossbeam_deque::{Injector, Steal, Stealer, Worker};
use sleep::Sleep;
use std::any::Any;
use std::cell::RefCell;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// What the pool runs its jobs for.
pub(crate) trait Host: Send + Sync + 'static {
    /// One unit of work.
    type Job: Send + 'static;
    /// The pool this host's jobs run on.
    fn pool(&self) -> &Pool<Self::Job>;
    /// Runs `job` to its end, publishing what it makes ready, and returns one job
    /// for the same thread to run next.
    fn run(&self, job: Self::Job) -> Option<Self::Job>;
    /// Whether an idle worker may exit after [`Pool::set_shutdown`]: asked under
    /// the pool's thread lock, with the queues found empty.
    fn may_exit(&self) -> bool;
    /// Called on a worker each time it finds no work, before it spins, sleeps
    /// or exits: what the host put off while the worker was busy is settled
    /// here.
    fn idle(&self) {}
}

struct Threads<J> {
    /// Worker threads running.
    alive: usize,
    /// The deques of workers that exited, for the ones started again (their
    /// stealers stay in `Pool::stealers`).
    idle: Vec<Worker<J>>,
    handles: Vec<std::thread::JoinHandle<()>>,
}

/// A fixed set of worker threads over work-stealing queues.
pub(crate) struct Pool<J> {
    /// Identifies the pool's worker threads (see [`Pool::is_worker`]).
    id: u64,
    size: usize,
    injector: Injector<J>,
    stealers: Vec<Stealer<J>>,
    sleep: Sleep,
    /// Set (Release) by the host when its workers may exit once idle; read
    /// (Acquire) in the worker loop.
    shutdown: AtomicBool,
    threads: Mutex<Threads<J>>,
    /// Signalled when a worker exits.
    exited: Condvar,
}

struct WorkerCtx {
    pool: u64,
    /// This thread's `Worker<J>` deque, type-erased (the thread-local cannot be
    /// generic).
    local: Box<dyn Any>,
}

thread_local! {
    /// Set on worker threads for their whole life.
    static WORKER: RefCell<Option<WorkerCtx>> = const { RefCell::new(None) };
}

/// Locks one of the pool's own (std) mutexes, ignoring poisoning: no user code
/// runs under them. (They stay std under loom: the models do not start pools.)
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

static NEXT_POOL_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Whether the calling thread is a worker of any pool (where a drop must not
/// block).
pub(crate) fn on_any_worker() -> bool {
    WORKER.with(|w| w.borrow().is_some())
}

impl<J: Send + 'static> Pool<J> {
    /// A pool of `size` workers, none started yet (see [`Pool::start`]).
    pub(crate) fn new(size: usize) -> Self {
        let idle: Vec<Worker<J>> = (0..size).map(|_| Worker::new_lifo()).collect();
        let stealers = idle.iter().map(|l| l.stealer()).collect();
        Pool {
            id: NEXT_POOL_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            size,
            injector: Injector::new(),
            stealers,
            sleep: Sleep::new(),
            shutdown: AtomicBool::new(false),
            threads: Mutex::new(Threads {
                alive: 0,
                idle,
                handles: Vec::new(),
            }),
            exited: Condvar::new(),
        }
    }

    /// Starts workers until `size` run; returns how many run.
    pub(crate) fn start<H: Host<Job = J>>(&self, host: &Arc<H>, name: &str) -> usize {
        let mut t = lock(&self.threads);
        while t.alive < self.size {
            let Some(local) = t.idle.pop() else {
                break;
            };
            let host = host.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("{name}-{}", t.alive))
                .spawn(move || worker_main(host, local));
            match spawned {
                Ok(handle) => {
                    t.alive += 1;
                    t.handles.push(handle);
                }
                Err(e) => {
                    eprintln!("lazyflow: could not start a worker thread: {e}");
                    break;
                }
            }
        }
        t.alive
    }

    /// Whether the calling thread is one of this pool's workers.
    #[inline]
    pub(crate) fn is_worker(&self) -> bool {
        WORKER.with(|w| matches!(&*w.borrow(), Some(c) if c.pool == self.id))
    }

    /// Queues a job from any thread: onto this worker's own deque when called on
    /// one of the pool's workers, onto the injector otherwise. The caller wakes
    /// sleepers with [`Pool::wake`] once it has published what it has.
    #[inline]
    pub(crate) fn publish(&self, job: J) {
        let job = WORKER.with(|w| match &*w.borrow() {
            Some(c) if c.pool == self.id => {
                let local = c
                    .local
                    .downcast_ref::<Worker<J>>()
                    .expect("the pool's deque");
                local.push(job);
                None
            }
            _ => Some(job),
        });
        if let Some(job) = job {
            self.injector.push(job);
        }
    }

    /// Queues a job on the injector, for any worker (work a helping blocker does
    /// not need).
    pub(crate) fn publish_global(&self, job: J) {
        self.injector.push(job);
    }

    /// Wakes up to `n` parked workers after `n` jobs were published.
    #[inline]
    pub(crate) fn wake(&self, n: usize) {
        self.sleep.wake(n);
    }

    /// Takes one job: own deque first, then the injector, then the others.
    pub(crate) fn find_work(&self) -> Option<J> {
        WORKER.with(|w| {
            let ctx = w.borrow();
            let local = ctx
                .as_ref()
                .filter(|c| c.pool == self.id)
                .and_then(|c| c.local.downcast_ref::<Worker<J>>());
            if let Some(job) = local.and_then(|l| l.pop()) {
                return Some(job);
            }
            loop {
                let mut retry = false;
                let stolen = match local {
                    Some(l) => self.injector.steal_batch_and_pop(l),
                    None => self.injector.steal(),
                };
                match stolen {
                    Steal::Success(j) => return Some(j),
                    Steal::Retry => retry = true,
                    Steal::Empty => {}
                }
                for s in self.stealers.iter() {
                    match s.steal() {
                        Steal::Success(j) => return Some(j),
                        Steal::Retry => retry = true,
                        Steal::Empty => {}
                    }
                }
                if !retry {
                    return None;
                }
            }
        })
    }

    /// Whether any queue holds work.
    pub(crate) fn has_queued_work(&self) -> bool {
        !self.injector.is_empty() || self.stealers.iter().any(|s| !s.is_empty())
    }

    /// Lets idle workers exit (when the host agrees) or keeps them.
    pub(crate) fn set_shutdown(&self, on: bool) {
        self.shutdown.store(on, Ordering::Release);
        if on {
            self.sleep.wake_all();
        }
    }

    /// Waits (until `deadline`) for every worker to exit while `still` holds,
    /// then joins them. Gives up without joining when `still` stops holding (the
    /// host wants its workers again) or the deadline passes.
    pub(crate) fn join_exited(&self, deadline: Instant, still: impl Fn() -> bool) {
        let mut t = lock(&self.threads);
        while still() && t.alive > 0 {
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            let wait = (deadline - now).min(Duration::from_millis(50));
            t = match self.exited.wait_timeout(t, wait) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        if !still() {
            return;
        }
        let handles = std::mem::take(&mut t.handles);
        drop(t);
        for h in handles {
            let _ = h.join();
        }
    }

    /// An idle worker after shutdown: exits (parking its deque) if the host
    /// agrees and nothing is queued.
    fn try_exit<H: Host<Job = J>>(&self, host: &H) -> bool {
        let mut t = lock(&self.threads);
        if !self.shutdown.load(Ordering::Acquire) || !host.may_exit() || self.has_queued_work() {
            return false;
        }
        let local = WORKER.with(|w| w.borrow_mut().take());
        if let Some(l) = local.and_then(|c| c.local.downcast::<Worker<J>>().ok()) {
            t.idle.push(*l);
        }
        t.alive -= 1;
        self.exited.notify_all();
        true
    }
}

/// The body of a worker thread.
fn worker_main<H: Host>(host: Arc<H>, local: Worker<H::Job>) {
    let pool = host.pool();
    WORKER.with(|w| {
        *w.borrow_mut() = Some(WorkerCtx {
            pool: pool.id,
            local: Box::new(local),
        })
    });
    let mut idle_rounds = 0u32;
    // Counted in `Sleep::spinning` while it looks for work.
    let mut looking = false;
    loop {
        if let Some(mut job) = pool.find_work() {
            if looking {
                looking = false;
                pool.sleep.found_work();
            }
            idle_rounds = 0;
            while let Some(next) = host.run(job) {
                job = next;
            }
            continue;
        }
        host.idle();
        if pool.shutdown.load(Ordering::Acquire) {
            if looking {
                looking = false;
                pool.sleep.stop_spinning();
            }
            if pool.try_exit(&*host) {
                return;
            }
        }
        if !looking {
            looking = true;
            pool.sleep.start_spinning();
        }
        // Spin briefly before parking: a frontend recording one node at a time
        // (Async mode) hands out work every few hundred nanoseconds, and a futex
        // round trip per node would cost more than the node.
        idle_rounds += 1;
        if idle_rounds < 64 {
            std::hint::spin_loop();
            continue;
        }
        if idle_rounds < 96 {
            std::thread::yield_now();
            continue;
        }
        looking = false;
        pool.sleep.stop_spinning();
        pool.sleep
            .sleep(|| pool.has_queued_work() || pool.shutdown.load(Ordering::Acquire));
        idle_rounds = 0;
    }
}
