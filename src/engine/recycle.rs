//! Node memory recycled on the thread that records: each recording thread keeps
//! the nodes it recorded, in record order, and reuses the memory of the first
//! ones once they finished and nothing else refers to them.
//!
//! Why: a node is allocated by the frontend and its last reference usually goes
//! away on a worker (the dependent that held it finishes there). With glibc's
//! allocator that is a free into another thread's arena, and the frontend's next
//! allocation then takes the slow path; on a 1,000,000-node chain the two took
//! about a third of the time per node (measured by swapping in another
//! allocator). Taskflow pools its nodes for the same reason. Here, in safe Rust:
//! the bin holds one reference to every node its thread recorded; a node whose
//! only reference is the bin's is reused in place ([`std::sync::Arc::get_mut`]
//! proves that nobody else can reach it), so the memory stays with the thread
//! that allocates it.
//!
//! Bounds: the bin looks at its first nodes only (two per record, amortized
//! O(1)); a finished node still referred to elsewhere (the last writer of a Var,
//! a task handle) leaves the bin and is freed wherever its last reference goes.
//! At most [`KEEP`] nodes are kept once the bin has been trimmed (every
//! `wait_all` trims the calling thread's bin), and at most [`RECENT`] are held at
//! any time; a node pushed out unfinished is simply no longer tracked.

use super::NodeRef;
use std::cell::RefCell;
use std::collections::VecDeque;

/// The most nodes a bin holds, finished or not.
const RECENT: usize = 1 << 16;
/// Finished nodes a trimmed bin keeps for reuse.
const KEEP: usize = 256;
/// Nodes looked at per record.
const SCAN: usize = 2;

#[derive(Default)]
struct Bin {
    /// Nodes this thread recorded, oldest first.
    recent: VecDeque<NodeRef>,
}

thread_local! {
    static BIN: RefCell<Bin> = RefCell::new(Bin::default());
}

/// Whether only the bin refers to `n` and it finished: its memory may be reused.
fn reusable(n: &NodeRef) -> bool {
    crate::sync::Arc::strong_count(n) == 1 && n.is_done()
}

impl Bin {
    /// A finished node to reuse, if the oldest ones are; drops the oldest
    /// finished nodes that are shared, and the oldest node past [`RECENT`].
    fn take(&mut self) -> Option<NodeRef> {
        for _ in 0..SCAN {
            let front = self.recent.front()?;
            if reusable(front) {
                return self.recent.pop_front();
            }
            if !front.is_done() && self.recent.len() < RECENT {
                return None;
            }
            self.recent.pop_front();
        }
        None
    }

    /// Keeps at most [`KEEP`] finished nodes nothing else refers to, and no node
    /// that is shared and finished.
    fn trim(&mut self) {
        let mut kept = 0;
        self.recent.retain(|n| {
            if !n.is_done() {
                return true;
            }
            if crate::sync::Arc::strong_count(n) == 1 && kept < KEEP {
                kept += 1;
                return true;
            }
            false
        });
        // Unfinished nodes stay in record order, behind the spares.
        self.recent.make_contiguous().sort_by_key(|n| !reusable(n));
        if self.recent.capacity() > 4 * self.recent.len().max(KEEP) {
            self.recent.shrink_to(self.recent.len().max(KEEP));
        }
    }
}

/// A finished node of this thread's that nothing else refers to, to record the
/// next node in ([`crate::graph::record`] checks it again).
#[inline]
pub(super) fn take() -> Option<NodeRef> {
    BIN.try_with(|b| b.borrow_mut().take()).ok().flatten()
}

/// Remembers a node this thread recorded.
#[inline]
pub(super) fn keep(node: &NodeRef) {
    keep_owned(node.clone());
}

/// Remembers a node this thread recorded, taking the caller's reference.
#[inline]
pub(super) fn keep_owned(node: NodeRef) {
    let _ = BIN.try_with(|b| b.borrow_mut().recent.push_back(node));
}

/// Lets go of what this thread's bin need not hold (after a barrier).
pub(super) fn trim() {
    let _ = BIN.try_with(|b| b.borrow_mut().trim());
}
