//! The record inbox: in Lazy mode, recording appends to a short queue under its
//! own lock instead of taking the graph lock for every node.
//!
//! A Lazy node does nothing until it is demanded, so it need not be in the graph
//! the moment it is recorded; it must only be there, in program order, before
//! anything looks at the graph. Every path that reads or demands the graph
//! (blockers, `wait_all`, backpressure, statistics) takes the graph lock and then
//! applies the inbox first (lock order: graph, then inbox). The frontend takes the
//! graph lock once per [`Inbox::batch`] nodes, and workers completing nodes under
//! the graph lock no longer contend with every record.
//!
//! Var handles are dropped through the inbox too, so a drop is applied after every
//! record that named the Var (those happened before the last handle was dropped).
//! New Var ids come from a small pool reserved under the graph lock in chunks.

use crate::graph::{NodeMeta, VarId};
use crate::sched::Task;
use smallvec::SmallVec;

/// One deferred change to the graph, in program order.
pub(crate) enum Entry {
    Record {
        meta: NodeMeta,
        reads: SmallVec<[VarId; 4]>,
        writes: SmallVec<[VarId; 2]>,
        task: Task,
    },
    DropVar(VarId),
}

/// What the inbox lock protects.
pub(crate) struct Inbox {
    pub(crate) entries: Vec<Entry>,
    /// An emptied entry buffer kept for the next swap (no allocation per batch).
    pub(crate) spare: Vec<Entry>,
    /// Var ids reserved in the graph and not yet handed out.
    pub(crate) free_vars: Vec<VarId>,
}

/// Var ids reserved per trip to the graph lock.
pub(crate) const VAR_CHUNK: usize = 64;

impl Inbox {
    pub(crate) fn new() -> Self {
        Inbox {
            entries: Vec::new(),
            spare: Vec::new(),
            free_vars: Vec::new(),
        }
    }

    /// Nodes recorded per graph-lock acquisition in Lazy mode: 64, but never more
    /// than the gap between the backpressure marks, so that applying a batch
    /// after draining to the low mark cannot overshoot the high mark.
    pub(crate) fn batch(high: usize, low: usize) -> usize {
        if high == usize::MAX {
            return 64; // unbounded
        }
        (high - low).clamp(1, 64)
    }
}
