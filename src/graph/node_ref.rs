//! A counted reference to a node ([`NodeRef`]), whose memory goes back to a
//! pool ([`NodePool`]) when the last reference goes, wherever that is.
//!
//! Why not `Arc`: a node's last reference goes on whatever thread lets go of
//! it last: a worker completing a dependent, a Var going away with its last
//! writer, a record that finds a Var's last writer finished. With `Arc`, the
//! memory went back to the allocator there, and the frontend's next record
//! allocated a node (and its job's box, and the spilled lists it had grown).
//! The engine's registry (`engine/registry.rs`) reuses the nodes of which it
//! holds the last reference, but a node that something else held when it
//! left the registry's list was freed elsewhere: `random_dag` in
//! `benches/scheduler.rs` allocated 96 of every 100 nodes, `tree` 90. Taskflow
//! recycles its nodes through a pool for the same reason.
//!
//! The count lives in the node ([`Node::refs`]), and a node recorded for an
//! engine names the pool it goes back to ([`Node::home`]: a `static`, so
//! that a pooled node holds nothing that keeps the pool alive). A node goes
//! back only if it finished (a node let go of unfinished, by an engine torn
//! down mid-way, is dropped). The pool is a stack pushed with a
//! compare-and-swap and taken whole with one swap: no pop of one node, hence
//! no ABA problem.

use super::Node;
use crate::sync::Ordering;
use std::ptr::NonNull;
use std::sync::atomic::AtomicPtr;

/// A node, shared by whoever must reach it: the Var queues, its dependencies'
/// dependent lists, the queues of the pool, blockers and task handles. The
/// API is `Arc`'s, where the graph uses it.
pub(crate) struct NodeRef<J> {
    ptr: NonNull<Node<J>>,
}

// SAFETY: as for `Arc<Node<J>>`: the node is shared between threads, and
// whoever lets go of it last may drop it.
unsafe impl<J: Send> Send for NodeRef<J> where Node<J>: Send + Sync {}
// SAFETY: as above.
unsafe impl<J: Send> Sync for NodeRef<J> where Node<J>: Send + Sync {}

impl<J> NodeRef<J> {
    /// The first reference to `node`, a new allocation.
    pub(crate) fn new(node: Node<J>) -> Self {
        node.refs.store(1, Ordering::Relaxed);
        NodeRef {
            ptr: crate::mem::boxed(node),
        }
    }

    /// References to the node (Relaxed, as `Arc::strong_count`).
    #[inline]
    pub(crate) fn strong_count(this: &Self) -> usize {
        this.refs.load(Ordering::Relaxed)
    }

    /// Whether this is the only reference; Acquire: what every reference let
    /// go of before did to the node happens before what the caller does
    /// next.
    #[inline]
    pub(crate) fn is_unique(this: &Self) -> bool {
        this.refs.load(Ordering::Acquire) == 1
    }

    #[inline]
    pub(crate) fn as_ptr(this: &Self) -> *const Node<J> {
        this.ptr.as_ptr()
    }

    #[cfg(loom)]
    pub(crate) fn ptr_eq(a: &Self, b: &Self) -> bool {
        a.ptr == b.ptr
    }

    /// The reference as an address, its count kept (see [`NodeRef::from_raw`]).
    #[inline]
    pub(crate) fn into_raw(this: Self) -> *const Node<J> {
        let p = this.ptr.as_ptr();
        std::mem::forget(this);
        p
    }

    /// The reference that [`NodeRef::into_raw`] made an address of.
    ///
    /// # Safety
    /// `p` comes from [`NodeRef::into_raw`], once.
    #[inline]
    pub(crate) unsafe fn from_raw(p: *const Node<J>) -> Self {
        NodeRef {
            // SAFETY: `into_raw` gave a node's (non-null) address.
            ptr: unsafe { NonNull::new_unchecked(p.cast_mut()) },
        }
    }

    /// Lets go of a reference made an address by [`NodeRef::into_raw`].
    ///
    /// # Safety
    /// As for [`NodeRef::from_raw`].
    #[inline]
    pub(crate) unsafe fn decrement_strong_count(p: *const Node<J>) {
        // SAFETY: the caller's.
        drop(unsafe { Self::from_raw(p) });
    }
}

impl<J> Clone for NodeRef<J> {
    #[inline]
    fn clone(&self) -> Self {
        // Relaxed, as `Arc::clone`: a new reference is made from one held.
        let before = self.refs.fetch_add(1, Ordering::Relaxed);
        if before > isize::MAX as usize {
            // As `Arc`: a count this large means references were leaked.
            std::process::abort();
        }
        NodeRef { ptr: self.ptr }
    }
}

impl<J> std::ops::Deref for NodeRef<J> {
    type Target = Node<J>;

    #[inline]
    fn deref(&self) -> &Node<J> {
        // SAFETY: the node lives while a reference does.
        unsafe { self.ptr.as_ref() }
    }
}

impl<J> Drop for NodeRef<J> {
    #[inline]
    fn drop(&mut self) {
        // Release, then an Acquire load, as `Arc`: every use of the node
        // through another reference happens before it is reused or freed.
        if self.refs.fetch_sub(1, Ordering::Release) != 1 {
            return;
        }
        let _ = self.refs.load(Ordering::Acquire);
        let node = self.ptr.as_ptr();
        // SAFETY: the last reference: nothing else reaches the node.
        if let Some(home) = unsafe { &*node }.home.0 {
            // A node that finished holds nothing to let go of (its
            // dependencies and waiters went when it completed), and may be
            // recorded in again.
            if unsafe { &*node }.done.load(Ordering::Relaxed) {
                // SAFETY: a `static`'s address (see `Home`).
                unsafe { home.as_ref() }.push(node);
                return;
            }
        }
        // SAFETY: allocated by `NodeRef::new`, and nothing else reaches it.
        unsafe { crate::mem::drop_and_free(node) };
    }
}

/// Finished nodes nothing refers to, for records to reuse: a stack linked
/// through [`Node::pool_next`], pushed by whoever lets go of a node last
/// and taken whole by a recorder.
pub(crate) struct NodePool<J> {
    head: AtomicPtr<Node<J>>,
}

impl<J> NodePool<J> {
    /// An empty pool (a `static`'s: see the module's comment).
    pub(crate) const fn new() -> Self {
        NodePool {
            head: AtomicPtr::new(std::ptr::null_mut()),
        }
    }

    /// Puts a node nothing refers to on the stack.
    fn push(&self, node: *mut Node<J>) {
        let mut head = self.head.load(std::sync::atomic::Ordering::Relaxed);
        loop {
            // SAFETY: nothing else reaches the node (its count is zero).
            unsafe { &*node }
                .pool_next
                .store(head, std::sync::atomic::Ordering::Relaxed);
            // Release: whoever takes the stack sees the node as left here.
            match self.head.compare_exchange_weak(
                head,
                node,
                std::sync::atomic::Ordering::Release,
                std::sync::atomic::Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(now) => head = now,
            }
        }
    }

    /// Takes every node on the stack, each as its one reference.
    pub(crate) fn take_all(&self) -> Taken<J> {
        let head = if self
            .head
            .load(std::sync::atomic::Ordering::Relaxed)
            .is_null()
        {
            std::ptr::null_mut()
        } else {
            // Acquire: pairs with the pushes' Release.
            self.head
                .swap(std::ptr::null_mut(), std::sync::atomic::Ordering::Acquire)
        };
        Taken { at: head }
    }
}

/// The nodes taken from a [`NodePool`], one reference each; those not
/// iterated go back to the allocator.
pub(crate) struct Taken<J> {
    at: *mut Node<J>,
}

impl<J> Iterator for Taken<J> {
    type Item = NodeRef<J>;

    #[inline]
    fn next(&mut self) -> Option<NodeRef<J>> {
        let node = NonNull::new(self.at)?;
        // SAFETY: a node taken off the stack: this walk alone reaches it.
        let n = unsafe { node.as_ref() };
        self.at = n.pool_next.load(std::sync::atomic::Ordering::Relaxed);
        n.refs.store(1, Ordering::Relaxed);
        Some(NodeRef { ptr: node })
    }
}

impl<J> Drop for Taken<J> {
    fn drop(&mut self) {
        for n in self.by_ref() {
            // Freed, not pooled again: the caller wanted no more.
            let p = NodeRef::into_raw(n).cast_mut();
            // SAFETY: allocated by `NodeRef::new`, the one reference.
            unsafe { crate::mem::drop_and_free(p) };
        }
    }
}
