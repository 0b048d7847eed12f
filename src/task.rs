//! Generic tasks: any CPU closure with declared reads and writes, recorded as a node.

use crate::device::Device;
use crate::engine::{Engine, Mode};
use crate::error::{Error, Location, Result, SharedError};
use crate::graph::{NodeId, NodeMeta};
use crate::sched::Task;
use crate::sync::Arc;
use crate::var::{Read, Var, VarIds, Write};
use smallvec::SmallVec;
use std::fmt::Display;
use std::sync::OnceLock;

/// Records one task: declare what it reads and writes, then hand it the closure.
///
/// Each [`TaskBuilder::read`] / [`TaskBuilder::write`] returns the token the closure
/// uses to reach the data. The task runs after every earlier conflicting access
/// (read-after-write, write-after-write, write-after-read) and before every later
/// one, on a worker thread, when something demands it (see [`Mode`]).
///
/// ```
/// use lazyflow::Engine;
/// let engine = Engine::builder().workers(2).build().unwrap();
/// let a = engine.var(vec![1.0f32, 2.0, 3.0]);
/// let total = engine.var(0.0f32);
/// let mut t = engine.task("sum");
/// let (r, w) = (t.read(&a), t.write(&total));
/// let handle = t.run(move || *w.write() = r.read().iter().sum()).unwrap();
/// handle.wait().unwrap();
/// assert_eq!(total.get().unwrap(), 6.0);
/// ```
#[must_use = "a task is recorded only by run, try_run or push"]
pub struct TaskBuilder<'e> {
    engine: &'e Engine,
    meta: NodeMeta,
    reads: VarIds,
    writes: SmallVec<[crate::graph::VarId; 2]>,
    /// The handles of every Var named, until the task is recorded: dropping the
    /// last handle of a Var queues its removal from the graph, which must come
    /// after this record.
    keep: SmallVec<[std::sync::Arc<dyn crate::var::KeepAlive>; 4]>,
    mismatch: bool,
}

/// How a finished task ended, set once under the engine lock before the node
/// leaves the graph (so a blocker that sees the node gone also sees this).
pub(crate) struct TaskStatus {
    /// The node, once it is in the graph (Lazy records wait in the inbox).
    node: OnceLock<NodeId>,
    done: OnceLock<Option<SharedError>>,
}

impl TaskStatus {
    pub(crate) fn set_node(&self, node: NodeId) {
        let _ = self.node.set(node);
    }

    pub(crate) fn finish(&self, err: Option<SharedError>) {
        let _ = self.done.set(err);
    }
}

/// A recorded task that can be waited on.
#[derive(Clone)]
pub struct TaskHandle {
    engine: Engine,
    status: Arc<TaskStatus>,
}

impl std::fmt::Debug for TaskHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskHandle")
            .field("finished", &self.is_finished())
            .finish()
    }
}

impl TaskHandle {
    /// Explicit blocker: runs this task's ancestors and the task, waits for it and
    /// returns its failure (or the failure that made it skip) if any.
    pub fn wait(&self) -> Result<()> {
        self.engine.counters().blocker(false);
        let status = &self.status;
        // The graph is locked with the inbox applied: the node id is set.
        self.engine.shared().wait_for(|g| match status.node.get() {
            Some(&node) if g.is_live(node) => SmallVec::from_slice(&[node]),
            _ => SmallVec::new(),
        })?;
        match self.status.done.get() {
            Some(None) => Ok(()),
            Some(Some(err)) => Err((**err).clone()),
            // Unreachable: the status is set before the node leaves the graph.
            None => Err(Error::Config("task status missing after completion".into())),
        }
    }

    /// Whether the task has finished (ran, failed or was skipped).
    pub fn is_finished(&self) -> bool {
        self.status.done.get().is_some()
    }
}

impl Engine {
    /// Starts recording a task named `name` (used in errors and DOT export) at the
    /// caller's location.
    #[track_caller]
    pub fn task(&self, name: &'static str) -> TaskBuilder<'_> {
        self.task_at(name, Location::caller())
    }

    pub(crate) fn task_at(&self, name: &'static str, location: Location) -> TaskBuilder<'_> {
        TaskBuilder {
            engine: self,
            meta: NodeMeta {
                name,
                location,
                device: Device::Cpu,
            },
            reads: SmallVec::new(),
            writes: SmallVec::new(),
            keep: SmallVec::new(),
            mismatch: false,
        }
    }
}

impl<'e> TaskBuilder<'e> {
    /// Declares a read of `var` and returns the token to read it in the task.
    pub fn read<T: Send + Sync + 'static>(&mut self, var: &Var<T>) -> Read<T> {
        self.check(var);
        if !self.reads.contains(&var.id()) {
            self.reads.push(var.id());
            self.keep.push(var.keep_alive());
        }
        var.read_token()
    }

    /// Declares a write of `var` and returns the token to write it in the task. A
    /// Var may be both read and written by one task (an in-place update).
    pub fn write<T: Send + Sync + 'static>(&mut self, var: &Var<T>) -> Write<T> {
        self.check(var);
        if !self.writes.contains(&var.id()) {
            self.writes.push(var.id());
            self.keep.push(var.keep_alive());
        }
        var.write_token()
    }

    /// Sets the device the task runs on (default: [`Device::Cpu`]).
    pub fn device(&mut self, device: Device) -> &mut Self {
        self.meta.device = device;
        self
    }

    fn check<T>(&mut self, var: &Var<T>) {
        if !var.engine().same(self.engine) {
            self.mismatch = true;
        }
    }

    /// Records the task and returns a handle to wait on. In [`Mode::Sync`] the task
    /// has run when this returns, and its failure is returned here.
    pub fn run(self, f: impl FnOnce() + Send + 'static) -> Result<TaskHandle> {
        self.try_run(move || {
            f();
            Ok::<(), std::convert::Infallible>(())
        })
    }

    /// Like [`TaskBuilder::run`], for a closure that can fail: an `Err` fails the
    /// node with the error's message, exactly like a panic would.
    pub fn try_run<E: Display>(
        self,
        f: impl FnOnce() -> std::result::Result<(), E> + Send + 'static,
    ) -> Result<TaskHandle> {
        let engine = self.engine.uncounted();
        let status = Arc::new(TaskStatus {
            node: OnceLock::new(),
            done: OnceLock::new(),
        });
        self.record(
            Box::new(move || f().map_err(|e| e.to_string())),
            Some(status.clone()),
        )?;
        let handle = TaskHandle { engine, status };
        if handle.engine.mode() == Mode::Sync {
            if let Some(Some(err)) = handle.status.done.get() {
                return Err((**err).clone());
            }
        }
        Ok(handle)
    }

    /// Records the task without a handle (the cheapest way; failures surface at the
    /// blockers of the Vars it writes).
    pub fn push(self, f: impl FnOnce() + Send + 'static) -> Result<()> {
        self.record(
            Box::new(move || {
                f();
                Ok(())
            }),
            None,
        )
    }

    /// Like [`TaskBuilder::push`] for a closure that can fail with a message.
    pub(crate) fn push_fallible(
        self,
        f: impl FnOnce() -> std::result::Result<(), String> + Send + 'static,
    ) -> Result<()> {
        self.record(Box::new(f), None)
    }

    #[inline]
    fn record(
        self,
        run: Box<dyn FnOnce() -> std::result::Result<(), String> + Send>,
        status: Option<Arc<TaskStatus>>,
    ) -> Result<()> {
        if self.mismatch {
            return Err(Error::EngineMismatch {
                op: self.meta.name,
                location: self.meta.location,
            });
        }
        let keep = self.keep;
        let task = Task {
            run,
            status,
            op: (self.meta.name, self.meta.location),
        };
        let recorded = self
            .engine
            .shared()
            .record(self.meta, self.reads, self.writes, task);
        // Only now may a Var named here be forgotten.
        drop(keep);
        recorded
    }
}
