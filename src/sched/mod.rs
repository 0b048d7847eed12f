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
use crate::error::{Location, SharedError};
use crate::graph::{NodeId, Outcome, Ready, VarId};
use crate::sync::{Arc, Ordering};
use crossbeam_deque::{Steal, Worker};
use smallvec::SmallVec;
use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// What a node does when it runs, plus where to report how it ended.
pub(crate) struct Task {
    pub(crate) run: Box<dyn FnOnce() -> Result<(), String> + Send>,
    pub(crate) status: Option<Arc<crate::task::TaskStatus>>,
    /// The op's name and where it was recorded, for what it writes (GPU
    /// buffers name their writer in later errors).
    pub(crate) op: (&'static str, Location),
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
    /// The op of the innermost task running on this thread.
    static CURRENT_OP: std::cell::Cell<Option<(&'static str, Location)>> = const { std::cell::Cell::new(None) };
    /// The nodes this thread is running, innermost last: a blocker inside a task
    /// runs other tasks while it waits, so several can be suspended on one stack
    /// (for deadlock checks in blockers).
    static RUNNING: RefCell<Vec<NodeId>> = const { RefCell::new(Vec::new()) };
    /// Vars this thread reads inside [`crate::Var::with`], with their engine:
    /// a wait for a write to one of them could never end.
    static BORROWED: RefCell<Vec<(u64, VarId)>> = const { RefCell::new(Vec::new()) };
    /// A node this worker ran, until it is completed (see [`run_chain`]).
    static PENDING: RefCell<Vec<Finished>> = const { RefCell::new(Vec::new()) };
}

/// Marks a Var as read by this thread until the guard is dropped.
pub(crate) struct Borrow;

impl Borrow {
    pub(crate) fn new(engine: u64, var: VarId) -> Borrow {
        BORROWED.with(|b| b.borrow_mut().push((engine, var)));
        Borrow
    }
}

impl Drop for Borrow {
    fn drop(&mut self) {
        BORROWED.with(|b| b.borrow_mut().pop());
    }
}

/// The Vars of `engine` this thread is reading inside `Var::with`.
pub(crate) fn borrowed_vars(engine: u64) -> SmallVec<[VarId; 2]> {
    BORROWED.with(|b| {
        b.borrow()
            .iter()
            .filter(|(e, _)| *e == engine)
            .map(|(_, v)| *v)
            .collect()
    })
}

/// Whether the calling thread is a worker of any engine (where a drop must not
/// block).
pub(crate) fn on_any_worker() -> bool {
    WORKER.with(|w| w.borrow().is_some())
}

/// Whether the calling thread is one of `engine`'s workers.
#[inline]
pub(crate) fn on_worker_of(engine: u64) -> bool {
    WORKER.with(|w| matches!(&*w.borrow(), Some(c) if c.engine == engine))
}

/// The name and record site of the op running on this thread, if any.
pub(crate) fn current_op() -> Option<(&'static str, Location)> {
    CURRENT_OP.with(|c| c.get())
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
pub(crate) fn worker_main(shared: std::sync::Arc<Shared>, local: Worker<Work>) {
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
            // The engine is retiring and was drained: exit, unless work came in.
            let mut local = WORKER.with(|w| w.borrow_mut().take().map(|c| c.local));
            if shared.retire_worker(&mut local) {
                return;
            }
            if let Some(local) = local {
                WORKER.with(|w| {
                    *w.borrow_mut() = Some(WorkerCtx {
                        engine: shared.id,
                        local,
                    })
                });
            }
            continue;
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

/// A node that ran, waiting to be completed.
pub(crate) type Finished = (NodeId, Outcome, Option<Arc<crate::task::TaskStatus>>);

/// Runs `work` and completes it, and then the first dependent it releases, with
/// no queue in between, so a chain stays on one thread.
///
/// A finished node is completed before the worker starts anything else, waiting
/// for the engine lock if another thread holds it. Completions used to be
/// deferred while the lock was busy and batched with the next tasks from the
/// worker's deque; that held a finished node back for as long as an unrelated
/// long task ran after it, so a blocker on the node waited for that task (and
/// deadlocked if the task waited for the blocker's caller).
pub(crate) fn run_chain(shared: &Shared, mut work: Work) {
    loop {
        let node = work.node;
        let (outcome, status) = execute(work);
        PENDING.with(|p| p.borrow_mut().push((node, outcome, status)));
        match complete_pending(shared) {
            Some(next) => work = next,
            None => return,
        }
    }
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

fn execute(work: Work) -> (Outcome, Option<Arc<crate::task::TaskStatus>>) {
    let Ready { node, job, skip } = work;
    let Task { run, status, op } = job;
    if let Some(err) = skip {
        // The closure's captures are dropped without running it; a panicking
        // Drop must not take the worker down with it.
        let _ = catch_unwind(AssertUnwindSafe(move || drop(run)));
        return (Outcome::Skipped(err), status);
    }
    RUNNING.with(|r| r.borrow_mut().push(node));
    let outer = CURRENT_OP.with(|c| c.replace(Some(op)));
    let result = catch_unwind(AssertUnwindSafe(run));
    CURRENT_OP.with(|c| c.set(outer));
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
