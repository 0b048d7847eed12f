//! The memory of the graph's nodes and of Var storages: mimalloc's
//! (`libmimalloc-sys`), whatever the program's global allocator is.
//!
//! Why: the shapes that make a node and a Var per operation and read them
//! back a level or a round later (`tree`, `random_dag` in
//! `benches/scheduler.rs`, a frontend that makes a fresh output per step)
//! touch them in the order they were made. glibc's allocator hands out
//! memory freed a round earlier in an order of its own (its bins, and the
//! chunks it merges), so consecutive nodes and Vars lie far apart and nearly
//! every access of the next round is a cache miss. mimalloc takes blocks of
//! one size from pages of that size, in address order, and a block freed on
//! another thread goes back to its page without a lock. With mimalloc (or
//! jemalloc) as the global allocator of `node_cost`, `tree` and
//! `random_dag` ran 25-30% faster, and most of the gain was outside the
//! allocator: reading a parent's Var and its last writer (`TaskBuilder::declare`,
//! `Node::fill`) and dropping node references (`docs/per-node-overhead.md`,
//! "Nodes and Var storages in mimalloc's memory").
//!
//! Only these two kinds of block: the rest of the engine's memory (closures,
//! lists, tensors) stays the global allocator's, which the program chooses.

use std::alloc::Layout;
use std::ptr::NonNull;

/// Memory for a `T` (not zero-sized), uninitialized; given back with
/// [`free`].
fn alloc<T>() -> NonNull<T> {
    let layout = Layout::new::<T>();
    debug_assert!(layout.size() > 0, "no zero-sized blocks");
    // SAFETY: a size above zero and an alignment that is a power of two.
    let p = unsafe { libmimalloc_sys::mi_malloc_aligned(layout.size(), layout.align()) };
    match NonNull::new(p.cast::<T>()) {
        Some(p) => p,
        None => std::alloc::handle_alloc_error(layout),
    }
}

/// `value` in memory of its own from [`alloc`].
pub(crate) fn boxed<T>(value: T) -> NonNull<T> {
    let p = alloc::<T>();
    // SAFETY: new memory for a `T`, which nothing else reaches.
    unsafe { p.as_ptr().write(value) };
    p
}

/// Gives back memory from [`boxed`] (of any `T`) that holds no value any
/// more: dropped or moved out.
///
/// # Safety
/// `p` came from [`boxed`], is given back once, and is not used after.
pub(crate) unsafe fn free<T>(p: *mut T) {
    // SAFETY: the caller's promise; mimalloc finds the block's size itself.
    unsafe { libmimalloc_sys::mi_free(p.cast()) }
}

/// Drops the value at `p` and gives its memory back.
///
/// # Safety
/// As [`free`], and `p` holds a value that nothing else reaches.
pub(crate) unsafe fn drop_and_free<T>(p: *mut T) {
    // SAFETY: the caller's promise: dropped once, then freed once.
    unsafe {
        std::ptr::drop_in_place(p);
        free(p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Noted<'a>(&'a AtomicUsize, [u64; 9]);
    impl Drop for Noted<'_> {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Values come back intact, aligned as their type asks, dropped once,
    /// and memory freed on another thread is reused without error.
    #[test]
    fn blocks_hold_their_values_and_drop_them_once() {
        #[repr(align(64))]
        struct Wide([u8; 100]);
        let drops = AtomicUsize::new(0);
        let blocks: Vec<_> = (0..1000u64).map(|i| boxed(Noted(&drops, [i; 9]))).collect();
        for (i, b) in blocks.iter().enumerate() {
            // SAFETY: written by `boxed`, not freed yet.
            assert_eq!(unsafe { b.as_ref() }.1, [i as u64; 9]);
        }
        let wide = boxed(Wide([7; 100]));
        assert_eq!(wide.as_ptr() as usize % 64, 0);
        // SAFETY: written by `boxed`, not freed yet.
        assert_eq!(unsafe { wide.as_ref() }.0, [7; 100]);
        // SAFETY: from `boxed`, freed once.
        unsafe { drop_and_free(wide.as_ptr()) };
        let addresses: Vec<usize> = blocks.iter().map(|b| b.as_ptr() as usize).collect();
        std::thread::scope(|s| {
            s.spawn(|| {
                for a in addresses {
                    // SAFETY: each block from `boxed`, freed once, here.
                    unsafe { drop_and_free(a as *mut Noted<'_>) };
                }
            });
        });
        assert_eq!(drops.load(Ordering::Relaxed), 1000);
        let again = boxed(Noted(&drops, [5; 9]));
        // SAFETY: from `boxed`, freed once.
        unsafe { drop_and_free(again.as_ptr()) };
        assert_eq!(drops.load(Ordering::Relaxed), 1001);
    }
}
