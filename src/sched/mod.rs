//! The worker pool: threads that take ready nodes from crossbeam-deque queues and
//! run them, then release their dependents. See `README.md` beside this file for
//! the sleep/wake protocol and for how blockers inside tasks help instead of
//! deadlocking.
//!
//! Queues: one global `Injector` (fed by the frontend: flushes, Async/Sync records)
//! and one LIFO `Worker` deque per thread (fed by completions), whose `Stealer`s the
//! other threads raid when idle. A completion keeps the first dependent it makes
//! ready in a local "next" slot and runs it at once without touching any queue, so a
//! chain runs on one thread without wake-ups.

pub(crate) mod sleep;

use crate::engine::Shared;
use crate::error::SharedError;
use crate::graph::{NodeId, Outcome, Ready};
use crate::sync::{Arc, Ordering};
use crossbeam_deque::{Steal, Worker};
use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

/// What a node does when it runs, plus where to report how it ended.
pub(crate) struct Task {
    pub(crate) run: Box<dyn FnOnce() -> Result<(), String> + Send>,
    pub(crate) status: Option<Arc<crate::task::TaskStatus>>,
}

/// A ready node on its way to a worker.
pub(crate) type Work = Ready<Task>;

struct WorkerCtx {
    engine: u64,
    local: Worker<Work>,
}

thread_local! {
    /// Set on worker threads for their whole life.
    static WORKER: RefCell<Option<WorkerCtx>> = const { RefCell::new(None) };
    /// The nodes this thread is running, innermost last: a blocker inside a task
    /// runs other tasks while it waits, so several can be suspended on one stack
    /// (for deadlock checks in blockers).
    static RUNNING: RefCell<Vec<NodeId>> = const { RefCell::new(Vec::new()) };
    /// Nodes this worker ran whose completion is batched (see [`run_chain`]).
    static PENDING: RefCell<Vec<Finished>> = const { RefCell::new(Vec::new()) };
}

/// Whether the calling thread is one of `engine`'s workers.
#[inline]
pub(crate) fn on_worker_of(engine: u64) -> bool {
    WORKER.with(|w| matches!(&*w.borrow(), Some(c) if c.engine == engine))
}

/// The node the calling thread is running, if it is inside a task.
pub(crate) fn current_node() -> Option<NodeId> {
    RUNNING.with(|r| r.borrow().last().copied())
}

/// Every node suspended or running on this thread, innermost last.
pub(crate) fn running_nodes() -> Vec<NodeId> {
    RUNNING.with(|r| r.borrow().clone())
}

/// Publishes ready work from any thread: onto this worker's own deque when called
/// on a worker of the same engine, onto the global injector otherwise.
pub(crate) fn publish(shared: &Shared, work: Work) {
    let work = WORKER.with(|w| match &*w.borrow() {
        Some(c) if c.engine == shared.id => {
            c.local.push(work);
            None
        }
        _ => Some(work),
    });
    if let Some(work) = work {
        shared.injector.push(work);
    }
}

/// The body of a worker thread.
pub(crate) fn worker_main(shared: Arc<Shared>, local: Worker<Work>) {
    WORKER.with(|w| {
        *w.borrow_mut() = Some(WorkerCtx {
            engine: shared.id,
            local,
        })
    });
    let mut idle_rounds = 0u32;
    loop {
        if let Some(work) = find_work(&shared) {
            idle_rounds = 0;
            run_chain(&shared, work);
            continue;
        }
        if shared.shutdown.load(Ordering::Acquire) {
            break;
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
        shared
            .sleep
            .sleep(|| shared.has_queued_work() || shared.shutdown.load(Ordering::Acquire));
        idle_rounds = 0;
    }
    WORKER.with(|w| w.borrow_mut().take());
}

/// Takes one piece of work: own deque first, then the injector, then the others.
pub(crate) fn find_work(shared: &Shared) -> Option<Work> {
    WORKER.with(|w| {
        let ctx = w.borrow();
        let local = ctx
            .as_ref()
            .filter(|c| c.engine == shared.id)
            .map(|c| &c.local);
        if let Some(work) = local.and_then(|l| l.pop()) {
            return Some(work);
        }
        loop {
            let mut retry = false;
            let stolen = match local {
                Some(l) => shared.injector.steal_batch_and_pop(l),
                None => shared.injector.steal(),
            };
            match stolen {
                Steal::Success(w) => return Some(w),
                Steal::Retry => retry = true,
                Steal::Empty => {}
            }
            for s in shared.stealers.iter() {
                match s.steal() {
                    Steal::Success(w) => return Some(w),
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

/// At most this many finished nodes wait for one completion under the lock.
const BATCH: usize = 32;
/// A batch of finished nodes is completed at the latest this long after the first
/// of them finished, so that long tasks release their dependents at once.
const BATCH_WINDOW: Duration = Duration::from_micros(20);

/// A node that ran, waiting to be completed.
pub(crate) type Finished = (NodeId, Outcome, Option<Arc<crate::task::TaskStatus>>);

/// Runs `work` and completes it, and then the first dependent it releases, with
/// no queue in between, so a chain stays on one thread.
///
/// When the engine lock is busy at the moment a node finishes, its completion
/// is deferred and the worker goes on with its own deque, completing the
/// finished nodes together later: one lock acquisition per batch instead of per
/// node, which is what keeps two workers running tiny independent nodes from
/// spending their time handing the lock back and forth. A batch closes when it
/// is full, when the deque is empty, or when the lock is free again, and it is
/// not extended after [`BATCH_WINDOW`]. A node is thus only held back while other
/// threads are busy in the engine, and never across a blocker (which completes
/// this thread's batch before it waits).
pub(crate) fn run_chain(shared: &Shared, mut work: Work) {
    // When the current batch's first node finished; read lazily, so that the
    // uncontended path pays no clock reads.
    let mut opened: Option<Instant> = None;
    loop {
        let node = work.node;
        let (outcome, status) = execute(work);
        let pending = PENDING.with(|p| {
            let mut p = p.borrow_mut();
            p.push((node, outcome, status));
            p.len()
        });
        if pending < BATCH {
            match try_complete_pending(shared) {
                Some(Some(next)) => {
                    opened = None;
                    work = next;
                    continue;
                }
                Some(None) => {
                    opened = None;
                    match pop_local(shared) {
                        Some(more) => {
                            work = more;
                            continue;
                        }
                        None => return,
                    }
                }
                // The lock is busy: keep the node in the batch and go on.
                None => {
                    if let Some(more) = pop_local(shared) {
                        let opened_at = *opened.get_or_insert_with(Instant::now);
                        if opened_at.elapsed() < BATCH_WINDOW {
                            work = more;
                            continue;
                        }
                        opened = None;
                        if let Some(next) = complete_pending(shared) {
                            publish(shared, next);
                        }
                        work = more;
                        continue;
                    }
                }
            }
        }
        opened = None;
        match complete_pending(shared) {
            Some(next) => work = next,
            None => return,
        }
    }
}

/// [`complete_pending`] if the engine lock is free; `None` if it is busy.
fn try_complete_pending(shared: &Shared) -> Option<Option<Work>> {
    let mut batch = PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()));
    let result = shared.try_complete(&mut batch);
    PENDING.with(|p| {
        let mut p = p.borrow_mut();
        if result.is_none() {
            // Not completed: put the batch back (nothing was added meanwhile).
            *p = batch;
        } else if p.is_empty() {
            *p = batch;
        }
    });
    result
}

/// Runs `work` and completes it at once, then the dependents it releases for as
/// long as `allowed` accepts them (the rest go to the queues). Used by blockers
/// inside tasks, which must only run what they wait for.
pub(crate) fn run_completing(shared: &Shared, mut work: Work, allowed: impl Fn(NodeId) -> bool) {
    loop {
        let node = work.node;
        let (outcome, status) = execute(work);
        let mut one = vec![(node, outcome, status)];
        match shared.complete(&mut one) {
            Some(next) if allowed(next.node) => work = next,
            Some(next) => {
                publish(shared, next);
                shared.sleep.wake(1);
                return;
            }
            None => return,
        }
    }
}

/// Completes the nodes this thread has finished but not yet completed. Called
/// when a batch closes, and by a blocker inside a task before it waits (the value
/// it waits for may have been produced by a node in this very batch).
pub(crate) fn complete_pending(shared: &Shared) -> Option<Work> {
    let mut batch = PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()));
    if batch.is_empty() {
        return None;
    }
    let next = shared.complete(&mut batch);
    // Give the (now empty) buffer back, keeping its allocation.
    PENDING.with(|p| {
        let mut p = p.borrow_mut();
        if p.is_empty() {
            *p = batch;
        }
    });
    next
}

/// Pops from this worker's own deque (never from other queues: stolen work would
/// wait in this batch while its owner could have run it).
fn pop_local(shared: &Shared) -> Option<Work> {
    WORKER.with(|w| match &*w.borrow() {
        Some(c) if c.engine == shared.id => c.local.pop(),
        _ => None,
    })
}

fn execute(work: Work) -> (Outcome, Option<Arc<crate::task::TaskStatus>>) {
    let Ready { node, job, skip } = work;
    let Task { run, status } = job;
    if let Some(err) = skip {
        // The closure's captures are dropped without running it; a panicking
        // Drop must not take the worker down with it.
        let _ = catch_unwind(AssertUnwindSafe(move || drop(run)));
        return (Outcome::Skipped(err), status);
    }
    RUNNING.with(|r| r.borrow_mut().push(node));
    let result = catch_unwind(AssertUnwindSafe(run));
    RUNNING.with(|r| r.borrow_mut().pop());
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
    (outcome, status)
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

/// Reports a finished node's status to its handle, if it has one.
pub(crate) fn report(status: Option<Arc<crate::task::TaskStatus>>, err: Option<SharedError>) {
    if let Some(s) = status {
        s.finish(err);
    }
}
