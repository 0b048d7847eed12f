//! The one error type of the crate, and where in the frontend an op was recorded.

use std::fmt;
use std::sync::Arc;

/// Where the frontend recorded an op: the caller of the public function, captured
/// with `#[track_caller]`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Location(&'static std::panic::Location<'static>);

impl Location {
    /// The location of the caller of the (`#[track_caller]`) function that calls this.
    #[track_caller]
    #[inline]
    pub fn caller() -> Self {
        Location(std::panic::Location::caller())
    }

    /// Source file of the recording call.
    pub fn file(&self) -> &'static str {
        self.0.file()
    }

    /// Line of the recording call.
    pub fn line(&self) -> u32 {
        self.0.line()
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.0.file(), self.0.line(), self.0.column())
    }
}

impl fmt::Debug for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Everything that can go wrong in lazyflow.
///
/// Record-time validation returns the variants that describe bad input at once;
/// failures while running come back from the next blocker on an affected value as
/// [`Error::Failed`], naming the op that failed and where it was recorded.
///
/// ```
/// use lazyflow::{Engine, Tensor};
/// let engine = Engine::builder().workers(1).build().unwrap();
/// let a = Tensor::zeros_in(&engine, [2, 3]);
/// let b = Tensor::zeros_in(&engine, [4]);
/// let err = a.add(&b).unwrap_err();
/// assert!(err.to_string().contains("add"));
/// assert!(err.to_string().contains("[2, 3]"));
/// ```
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// Shapes that the op cannot combine.
    #[error("{op}: incompatible shapes {shapes} (recorded at {location}): {reason}")]
    Shape {
        /// The op that was being recorded.
        op: &'static str,
        /// The shapes involved, formatted as `[2, 3] and [4]`.
        shapes: String,
        /// Why they do not fit.
        reason: String,
        /// Where the frontend recorded the op.
        location: Location,
    },
    /// An argument out of range (an axis, an index, a length).
    #[error("{op}: {reason} (shape {shape}, recorded at {location})")]
    InvalidArgument {
        /// The op that was being recorded.
        op: &'static str,
        /// The shape of the input the argument refers to.
        shape: String,
        /// What is wrong.
        reason: String,
        /// Where the frontend recorded the op.
        location: Location,
    },
    /// Operands live on different devices.
    #[error("{op}: operands on different devices ({devices}) (recorded at {location})")]
    DeviceMismatch {
        /// The op that was being recorded.
        op: &'static str,
        /// The devices involved.
        devices: String,
        /// Where the frontend recorded the op.
        location: Location,
    },
    /// The op has no kernel on the device of its operands yet.
    #[error("{op}: not supported on {device} (recorded at {location})")]
    Unsupported {
        /// The op that was being recorded.
        op: &'static str,
        /// The device.
        device: String,
        /// Where the frontend recorded the op.
        location: Location,
    },
    /// A data set that is missing or malformed.
    #[error("{path}: {reason}")]
    Data {
        /// The file or directory.
        path: String,
        /// What is wrong, and for a missing data set how to get it.
        reason: String,
    },
    /// Values from two different engines were combined in one op.
    #[error("{op}: operands belong to different engines (recorded at {location})")]
    EngineMismatch {
        /// The op that was being recorded.
        op: &'static str,
        /// Where the frontend recorded the op.
        location: Location,
    },
    /// An op failed while running (a panicking task, a kernel error), or depended on
    /// a value that such an op should have produced.
    #[error("{op} (recorded at {location}) failed: {message}")]
    Failed {
        /// The op that failed first.
        op: String,
        /// Where the frontend recorded the op that failed.
        location: Location,
        /// What went wrong: the panic message or the kernel's error.
        message: String,
    },
    /// A wait that could never end, refused instead of hanging: a blocker inside a
    /// running task on a value that needs that same task, blockers inside tasks
    /// on several threads that wait on each other in a cycle, or a wait (or a
    /// Sync-mode record) for a write to a Var this thread is reading in
    /// [`crate::Var::with`].
    #[error("waiting here would deadlock: {op} (recorded at {location}) {reason}")]
    WouldDeadlock {
        /// The op the wait would never see finish.
        op: String,
        /// Where that op was recorded.
        location: Location,
        /// Why it could never finish.
        reason: String,
    },
    /// A step of communication between processes failed (see [`crate::dist`]):
    /// another rank died, hangs, disagrees, or sent a buffer of another size.
    #[error("{step}: {reason}")]
    Distributed {
        /// The step ("agreeing on the model's shapes", "step #12 (allreduce of ...)").
        step: String,
        /// What went wrong, naming the rank.
        reason: String,
    },
    /// The engine configuration (builder or environment) is invalid.
    #[error("invalid engine configuration: {0}")]
    Config(String),
    /// A blocker found a value whose producer was dropped before it ran.
    #[error("value was never computed: its producer {op} (recorded at {location}) was discarded")]
    Discarded {
        /// The discarded op.
        op: String,
        /// Where it was recorded.
        location: Location,
    },
}

/// `Result` with lazyflow's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A failure shared by every value it poisons.
pub(crate) type SharedError = Arc<Error>;

pub(crate) fn shapes_list(shapes: &[&[usize]]) -> String {
    shapes
        .iter()
        .map(|s| format!("{s:?}"))
        .collect::<Vec<_>>()
        .join(" and ")
}

/// The op of one task running on a thread: its name and where it was recorded,
/// with an identity for deadlock checks.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RunningOp {
    /// Identifies the node (equal for the same node on every thread).
    pub(crate) key: usize,
    pub(crate) name: &'static str,
    pub(crate) location: Location,
}

thread_local! {
    /// The ops whose tasks run on this thread, innermost last: a blocker inside a
    /// task runs other tasks while it waits, so several can be suspended on one
    /// stack. Errors raised inside a task name the innermost (GPU buffers name
    /// their writer), and deadlock checks look at all of them.
    static RUNNING: std::cell::RefCell<Vec<RunningOp>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Marks `op` as running on this thread until the guard is dropped.
pub(crate) struct Running(());

impl Running {
    #[inline]
    pub(crate) fn enter(op: RunningOp) -> Running {
        RUNNING.with(|r| r.borrow_mut().push(op));
        Running(())
    }
}

impl Drop for Running {
    #[inline]
    fn drop(&mut self) {
        RUNNING.with(|r| r.borrow_mut().pop());
    }
}

/// The name and record site of the innermost op running on this thread.
pub(crate) fn current_op() -> Option<(&'static str, Location)> {
    RUNNING.with(|r| r.borrow().last().map(|o| (o.name, o.location)))
}

/// Every op running or suspended on this thread, innermost last.
pub(crate) fn running_ops() -> Vec<RunningOp> {
    RUNNING.with(|r| r.borrow().clone())
}
