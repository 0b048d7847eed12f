//! The memory of the graph's nodes (with the chunks of their lists of
//! dependents) and of Var storages: mimalloc's (`libmimalloc-sys`),
//! whatever the program's global allocator is.
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
//! Only these kinds of block: the rest of the engine's memory (closures,
//! other lists, tensors) stays the global allocator's, which the program
//! chooses.

use std::alloc::Layout;
use std::ptr::NonNull;

/// The alignment up to which `mi_malloc` suffices: as C's `malloc` must,
/// it aligns a block for any object of the block's size with a
/// fundamental alignment, up to `max_align_t`'s 16 bytes (mimalloc's
/// `MI_MAX_ALIGN_SIZE`). A Rust type's size is a multiple of its
/// alignment, so a type aligned to 16 or less needs nothing more.
const MALLOC_ALIGN: usize = 16;

/// Memory for a `T` (not zero-sized), uninitialized; given back with
/// [`free`].
///
/// A type aligned to 16 or less (a node, a Var's storage, a chunk of
/// dependents) takes plain `mi_malloc` (see [`MALLOC_ALIGN`]).
/// `mi_malloc_aligned` takes a block of the size's own class
/// only while the thread's current page of that class has a free one;
/// otherwise, for a size that is not a power of two, it over-allocates by
/// the alignment less one. Today's sizes land in their own class either
/// way (a node's 304 bytes and 311 are both in the 320-byte class), but a
/// size near the top of a class (320 bytes: 327 is in the 384-byte class)
/// would never make a page of its own and would take the next class up,
/// every block through mimalloc's slow path.
fn alloc<T>() -> NonNull<T> {
    let layout = Layout::new::<T>();
    debug_assert!(layout.size() > 0, "no zero-sized blocks");
    // SAFETY: a size above zero and an alignment that is a power of two.
    let p = unsafe {
        if layout.align() <= MALLOC_ALIGN {
            libmimalloc_sys::mi_malloc(layout.size())
        } else {
            libmimalloc_sys::mi_malloc_aligned(layout.size(), layout.align())
        }
    };
    debug_assert_eq!(p as usize % layout.align(), 0, "{layout:?}");
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

    // Declared here: `libmimalloc-sys` declares them only with a feature
    // that brings in another crate.
    extern "C" {
        fn mi_usable_size(p: *const std::ffi::c_void) -> usize;
        fn mi_good_size(size: usize) -> usize;
    }

    /// Blocks of a size at the top of its class take that class, however
    /// many are made: with `mi_malloc_aligned` they took the next class up.
    #[test]
    fn blocks_take_the_class_of_their_size() {
        struct Node320([u64; 40]);
        // SAFETY: a query of mimalloc's classes.
        let class = unsafe { mi_good_size(size_of::<Node320>()) };
        assert!(class < 384, "320 bytes have a class of their own: {class}");
        let blocks: Vec<_> = (0..5000u64).map(|i| boxed(Node320([i; 40]))).collect();
        for (i, b) in blocks.iter().enumerate() {
            // SAFETY: from `boxed`, not freed yet.
            let usable = unsafe { mi_usable_size(b.as_ptr().cast()) };
            assert_eq!(usable, class, "block {i} of 5000");
            // SAFETY: as above.
            assert_eq!(unsafe { b.as_ref() }.0, [i as u64; 40]);
            assert_eq!(b.as_ptr() as usize % align_of::<Node320>(), 0);
        }
        for b in blocks {
            // SAFETY: from `boxed`, freed once.
            unsafe { drop_and_free(b.as_ptr()) };
        }
    }
}
