//! Generic tasks: any CPU closure with declared reads and writes, recorded as a node.

use crate::device::Device;
use crate::engine::{device_lane, Access, Accesses, Completion, Engine, Mode, NodeRef};
use crate::error::{Location, Result};
use crate::graph::NodeMeta;
use crate::var::{Read, Var, Write};
use smallvec::SmallVec;
use std::fmt::Display;

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
///
/// The builder borrows the Vars it names until the task is recorded, so the
/// last handle of one cannot go away before the record (which would forget
/// the Var's pending writer); the mistake does not compile:
///
/// ```compile_fail,E0505
/// use lazyflow::Engine;
/// let engine = Engine::builder().workers(1).build().unwrap();
/// let v = engine.var(1u32);
/// let mut t = engine.task("copy");
/// let r = t.read(&v);
/// drop(v);
/// t.push(move || drop(r)).unwrap();
/// ```
#[must_use = "a task is recorded only by run, try_run or push"]
pub struct TaskBuilder<'e> {
    engine: &'e Engine,
    meta: NodeMeta,
    /// The Vars named, each with whether it is read and written, as the
    /// graph records them: borrowed from the caller's handles, which outlive
    /// the builder (a counted handle per access, taken and let go of, was
    /// two locked instructions per access).
    vars: Accesses<'e>,
    mismatch: bool,
    /// Demanded at record time also in Lazy mode (deferred tasks only).
    eager: bool,
}

/// A recorded task that can be waited on.
#[derive(Clone)]
pub struct TaskHandle {
    engine: Engine,
    node: NodeRef,
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
        self.engine
            .shared()
            .wait_for(std::iter::once(self.node.clone()).collect())?;
        match self.node.error() {
            None => Ok(()),
            Some(err) => Err((*err).clone()),
        }
    }

    /// Whether the task has finished (ran, failed or was skipped).
    pub fn is_finished(&self) -> bool {
        self.node.is_done()
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
                lane: device_lane(Device::Cpu),
                weight: 1,
                group: 0,
            },
            vars: SmallVec::new(),
            mismatch: false,
            eager: false,
        }
    }
}

impl<'e> TaskBuilder<'e> {
    /// Declares a read of `var` and returns the token to read it in the task.
    /// The Var is borrowed until the task is recorded.
    pub fn read<T: Send + Sync + 'static>(&mut self, var: &'e Var<T>) -> Read<T> {
        self.declare(var, true, false);
        var.read_token()
    }

    /// Declares a write of `var` and returns the token to write it in the task. A
    /// Var may be both read and written by one task (an in-place update). The
    /// Var is borrowed until the task is recorded.
    pub fn write<T: Send + Sync + 'static>(&mut self, var: &'e Var<T>) -> Write<T> {
        self.declare(var, false, true);
        var.write_token()
    }

    /// Counts the task as `ops` ops (a record-time batch) in the live count,
    /// the backpressure bound and [`crate::Stats`].
    pub(crate) fn weight(&mut self, ops: u32) -> &mut Self {
        self.meta.weight = ops.max(1);
        self
    }

    /// Sets the device the task runs on (default: [`Device::Cpu`]).
    pub fn device(&mut self, device: Device) -> &mut Self {
        self.meta.lane = device_lane(device);
        self
    }

    fn declare<T: Send + Sync + 'static>(&mut self, var: &'e Var<T>, read: bool, write: bool) {
        if var.queue().is_held() {
            // An open record-time batch writes or reads it: recorded first.
            self.engine.shared().close_batches();
        }
        self.declare_unchecked(var, read, write);
    }

    /// Declares an access without a token and without closing the batches
    /// that name the Var (a record-time batch being closed declares its own
    /// Vars). A Var named twice is merged by the graph when the task is
    /// recorded (it sorts the accesses anyway), so that declaring costs the
    /// same whatever was declared before: a search here cost a task of n
    /// accesses n²/2 comparisons.
    pub(crate) fn declare_unchecked<T: Send + Sync + 'static>(
        &mut self,
        var: &'e Var<T>,
        read: bool,
        write: bool,
    ) {
        self.check_engine(var);
        if self.vars.len() == self.vars.inline_size() {
            spill(&mut self.vars);
        }
        self.vars.push(Access {
            var: var.queue(),
            read,
            write,
        });
    }

    /// Notes a Var of another engine (the record then fails).
    fn check_engine<T>(&mut self, var: &Var<T>) {
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
        let node = self
            .record(move || f().map_err(|e| e.to_string()), true)?
            .expect("a handle was asked for");
        if engine.mode() == Mode::Sync {
            if let Some(err) = node.error() {
                return Err((*err).clone());
            }
        }
        Ok(TaskHandle { engine, node })
    }

    /// Records a task that finishes after its closure returned: the closure
    /// gets a [`Completion`] and hands it to whatever does the work (another
    /// thread, a network callback), which calls [`Completion::finish`]. The
    /// worker that ran the closure is free at once; the task's writes are
    /// unreadable, and its dependents wait, until it finishes. This is what
    /// lets communication with other processes overlap with computation
    /// (`crate::dist`).
    ///
    /// ```
    /// use lazyflow::Engine;
    /// let engine = Engine::builder().workers(1).build().unwrap();
    /// let x = engine.var(1u32);
    /// let mut t = engine.task("remote");
    /// let w = t.write(&x);
    /// let handle = t
    ///     .run_deferred(move |done| {
    ///         std::thread::spawn(move || {
    ///             *w.write() += 1;
    ///             done.finish(Err::<(), _>("the peer went away"));
    ///         });
    ///     })
    ///     .unwrap();
    /// assert!(handle.wait().unwrap_err().to_string().contains("the peer went away"));
    /// ```
    pub fn run_deferred(
        mut self,
        f: impl FnOnce(Completion) + Send + 'static,
    ) -> Result<TaskHandle> {
        self.check()?;
        let engine = self.engine.uncounted();
        let node =
            self.engine
                .shared()
                .record_deferred(self.meta, &mut self.vars, f, self.eager)?;
        if engine.mode() == Mode::Sync {
            if let Some(err) = node.error() {
                return Err((*err).clone());
            }
        }
        Ok(TaskHandle { engine, node })
    }

    /// Makes a deferred task run as soon as its inputs are ready also in
    /// Lazy mode, as if demanded at record time (communication must start in
    /// the same order on every process, whatever each one reads).
    pub(crate) fn eager(&mut self) -> &mut Self {
        self.eager = true;
        self
    }

    /// Records the task without a handle (the cheapest way; failures surface at the
    /// blockers of the Vars it writes).
    pub fn push(self, f: impl FnOnce() + Send + 'static) -> Result<()> {
        self.record(
            move || {
                f();
                Ok(())
            },
            false,
        )
        .map(drop)
    }

    /// Like [`TaskBuilder::push`] for a closure that can fail with a message.
    pub(crate) fn push_fallible(
        self,
        f: impl FnOnce() -> std::result::Result<(), String> + Send + 'static,
    ) -> Result<()> {
        self.record(f, false).map(drop)
    }

    /// Like [`TaskBuilder::push_fallible`], for a task that declared
    /// nothing: it makes `accesses` (Vars of this engine, each once), which
    /// the caller keeps alive until this returns. For the tensor layer's
    /// batches, whose Vars are held meanwhile: no handle per access to take
    /// and drop.
    pub(crate) fn push_accesses(
        self,
        accesses: &mut Accesses<'_>,
        f: impl FnOnce() -> std::result::Result<(), String> + Send + 'static,
    ) -> Result<()> {
        debug_assert!(self.vars.is_empty(), "declared and given accesses");
        self.engine
            .shared()
            .record(self.meta, accesses, f, false)
            .map(drop)
    }

    /// Records the task; with `handle`, returns its node (to wait on).
    #[inline]
    fn record<F>(mut self, f: F, handle: bool) -> Result<Option<NodeRef>>
    where
        F: FnOnce() -> std::result::Result<(), String> + Send + 'static,
    {
        self.check()?;
        self.engine
            .shared()
            .record(self.meta, &mut self.vars, f, handle)
    }

    /// The error for a Var of another engine, if one was declared.
    #[inline]
    fn check(&self) -> Result<()> {
        if self.mismatch {
            return Err(crate::error::Error::EngineMismatch {
                op: self.meta.name,
                location: self.meta.location,
            });
        }
        Ok(())
    }
}

/// Past the inline few, room for 16 declared Vars at once rather than a
/// reallocation per doubling.
#[cold]
fn spill(vars: &mut Accesses<'_>) {
    vars.reserve(16 - vars.len());
}
