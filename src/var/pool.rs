//! The memory of dead Var storages, kept for the next Var of the same size.
//!
//! Why: a program that makes a Var per node (`dynamic_chain`, `tree` and
//! `random_dag` in `benches/scheduler.rs`, or any frontend that makes a fresh
//! output per step) allocates each storage on its recording thread, and the
//! storage dies on a worker, where the task that held its last token ran.
//! With glibc's allocator that free goes back to the recorder's arena under
//! the arena's lock, which the recorder's next allocation takes too: on
//! `node_cost dynamic_chain` a tenth of all samples were futex wakes of that
//! lock, and with jemalloc preloaded the shapes that make a Var per node ran
//! 30-40% faster (README, "Completions counted out in groups").
//!
//! How: the last reference to a storage ([`Pooled`], held by every handle and
//! token) drops the storage's fields where it goes, as before, but keeps the
//! memory on a lock-free stack of its size class instead of freeing it. A
//! thread that makes a Var takes the whole stack into a list of its own (one
//! swap; nothing else reaches that list, so no ABA), and builds the new
//! storage in place. This is the scheme of the graph's pool of nodes
//! (`graph/node_ref.rs`), for a memory block whose type varies.
//!
//! The memory is not an engine's: a kept block holds no value, no queue and
//! no engine (its fields were dropped), so nothing needs closing when an
//! engine retires, and a block of one engine's Var is reused for another's.
//! Blocks are classed by the size of the storage (every storage has the
//! same alignment), so `Var<()>` and `Var<u64>` storages, say, each have a
//! stack, and `Arc::from_raw` is documented to accept a pointer that came
//! from an `Arc` of another type of the same size and alignment.
//!
//! Bounds: storages of up to [`LARGEST`] bytes are kept, and a class keeps
//! at most [`KEPT_BYTES`] of them on its stack (a storage pushed past that is
//! freed), so a program that made a million Vars once does not keep their
//! memory. A thread keeps what it took until it uses it or exits (then it is
//! freed).

use crossbeam_utils::CachePadded;
use std::cell::Cell;
use std::mem::{ManuallyDrop, MaybeUninit};
use std::ptr;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::Arc;

/// Largest storage kept, in bytes (a Var's queue, counts and lock take about
/// 120 of them; the rest is room for a small value).
pub(crate) const LARGEST: usize = 512;
/// Most bytes of storages one size class keeps on its stack.
pub(crate) const KEPT_BYTES: usize = 256 << 10;
/// Every class holds storages of this alignment (a storage holds a `u64`
/// counter; a value of larger alignment is not kept).
const ALIGN: usize = 8;
const CLASSES: usize = LARGEST / ALIGN + 1;

/// The first words of a kept block, written over its dropped value.
struct Block {
    /// The next block of the same stack or list.
    next: *mut Block,
    /// Frees the block (for the type it was allocated as).
    free: unsafe fn(*mut Block),
}

/// One size class's stack of kept blocks.
struct Class {
    head: AtomicPtr<Block>,
    /// About how many blocks the stack holds: raised before a push links
    /// its block, zeroed by a take after its swap, so it can run short by
    /// the pushes in flight at a take, never grow without bound.
    kept: AtomicUsize,
}

static STACKS: [CachePadded<Class>; CLASSES] = [const {
    CachePadded::new(Class {
        head: AtomicPtr::new(ptr::null_mut()),
        kept: AtomicUsize::new(0),
    })
}; CLASSES];

thread_local! {
    /// The lists this thread took, one per class: only this thread reaches
    /// their blocks.
    static TAKEN: Taken = const { Taken([const { Cell::new(ptr::null_mut()) }; CLASSES]) };
}

struct Taken([Cell<*mut Block>; CLASSES]);

impl Drop for Taken {
    fn drop(&mut self) {
        for list in &self.0 {
            free_list(list.replace(ptr::null_mut()));
        }
    }
}

/// Frees every block of a list nothing else reaches.
fn free_list(mut at: *mut Block) {
    while !at.is_null() {
        // SAFETY: a block of a list only the caller reaches; it is read
        // before it is freed, and freed once.
        unsafe {
            let next = (*at).next;
            ((*at).free)(at);
            at = next;
        }
    }
}

/// The class of `S`'s blocks, or `None` when `S` is not kept.
const fn class_of<S>() -> Option<usize> {
    let (size, align) = (size_of::<S>(), align_of::<S>());
    if align != ALIGN || size > LARGEST || size < size_of::<Block>() {
        return None;
    }
    Some(size / ALIGN)
}

/// Frees a kept block that was allocated as an `Arc<S>`.
///
/// # Safety
/// `b` came from [`keep`] for this `S`, and nothing else reaches it.
unsafe fn free<S>(b: *mut Block) {
    // SAFETY: an `Arc<S>`'s value pointer with its count at one; as a
    // `MaybeUninit<S>` (same size and alignment) the dropped value is not
    // dropped again, and the memory goes back with `S`'s layout.
    drop(unsafe { Arc::from_raw(b.cast::<MaybeUninit<S>>().cast_const()) });
}

/// A block of `class` to build a value in: from this thread's list, else
/// the class's whole stack becomes that list.
#[inline]
fn take(class: usize) -> Option<*mut Block> {
    TAKEN
        .try_with(|taken| {
            let list = &taken.0[class];
            let mut b = list.get();
            if b.is_null() {
                b = take_stack(class);
                if b.is_null() {
                    return None;
                }
            }
            // SAFETY: a block of this thread's list: only it reaches it.
            list.set(unsafe { (*b).next });
            Some(b)
        })
        .ok()
        .flatten()
}

/// Takes a class's whole stack (null when empty).
fn take_stack(class: usize) -> *mut Block {
    let stack = &STACKS[class];
    if stack.head.load(Ordering::Relaxed).is_null() {
        return ptr::null_mut();
    }
    // Acquire: pairs with the pushes' Release, so the blocks' links (and
    // the drops before them) are seen.
    let head = stack.head.swap(ptr::null_mut(), Ordering::Acquire);
    stack.kept.store(0, Ordering::Relaxed);
    head
}

/// Pushes a block of `class` on its stack, or frees it if the stack is full.
fn push(class: usize, b: *mut Block) {
    let stack = &STACKS[class];
    let most = KEPT_BYTES / (class * ALIGN);
    if stack.kept.fetch_add(1, Ordering::Relaxed) >= most {
        stack.kept.fetch_sub(1, Ordering::Relaxed);
        // SAFETY: the caller's block, which nothing else reaches.
        unsafe { ((*b).free)(b) };
        return;
    }
    let mut head = stack.head.load(Ordering::Relaxed);
    loop {
        // SAFETY: the caller's block, not on the stack yet.
        unsafe { (*b).next = head };
        // Release: the taker sees the link and the dropped fields.
        match stack
            .head
            .compare_exchange_weak(head, b, Ordering::Release, Ordering::Relaxed)
        {
            Ok(_) => return,
            Err(now) => head = now,
        }
    }
}

/// `Arc::new(value)`, built in the memory of a dead value of the same size
/// where one is kept.
fn new_arc<S>(value: S) -> Arc<S> {
    let Some(b) = class_of::<S>().and_then(take) else {
        return Arc::new(value);
    };
    let p = b.cast::<S>();
    // SAFETY: a kept block of `S`'s size and alignment is the value of an
    // `Arc` with its count at one whose value was dropped (see `keep`);
    // only this thread reaches it. Writing the value makes it that `Arc`'s
    // again, and `from_raw` takes the one reference back.
    unsafe {
        p.write(value);
        Arc::from_raw(p.cast_const())
    }
}

/// Lets go of `arc`; if it was the last reference, drops its value here and
/// keeps the memory (see the module's comment).
#[inline]
fn release<S>(arc: Arc<S>) {
    // Another reference left: an ordinary drop (which frees the memory if
    // that reference went meanwhile: a block missed, no more).
    if class_of::<S>().is_none() || Arc::strong_count(&arc) != 1 {
        return drop(arc);
    }
    keep(arc);
}

fn keep<S>(mut arc: Arc<S>) {
    let Some(class) = class_of::<S>() else {
        return drop(arc);
    };
    // Acquire inside: every use through a reference dropped elsewhere
    // happens before the drop here.
    if Arc::get_mut(&mut arc).is_none() {
        return drop(arc);
    }
    let p = Arc::into_raw(arc).cast_mut();
    // SAFETY: the one reference (`get_mut` succeeded, and no `Weak` of a
    // storage is ever made), taken out of its `Arc`: the value is dropped
    // once, and its memory is not read as an `S` until a `new_arc` writes
    // a new one. A panic in the value's drop leaks the block.
    unsafe { ptr::drop_in_place(p) };
    let b = p.cast::<Block>();
    // SAFETY: `S` is at least a `Block` in size and alignment (`class_of`),
    // and its memory holds nothing now.
    unsafe {
        b.write(Block {
            next: ptr::null_mut(),
            free: free::<S>,
        })
    };
    push(class, b);
}

/// An `Arc<S>` whose last reference keeps the memory for the next
/// [`Pooled::new`] of the same size (see the module's comment).
pub(crate) struct Pooled<S>(ManuallyDrop<Arc<S>>);

impl<S> Pooled<S> {
    /// `value` in a kept block when there is one, else a new allocation.
    #[inline]
    pub(crate) fn new(value: S) -> Self {
        Pooled(ManuallyDrop::new(new_arc(value)))
    }

    pub(crate) fn from_arc(arc: Arc<S>) -> Self {
        Pooled(ManuallyDrop::new(arc))
    }

    /// The `Arc`, whose last reference frees its memory as usual.
    pub(crate) fn into_arc(self) -> Arc<S> {
        let mut me = ManuallyDrop::new(self);
        // SAFETY: taken once; `me` is not dropped.
        unsafe { ManuallyDrop::take(&mut me.0) }
    }
}

impl<S> Clone for Pooled<S> {
    #[inline]
    fn clone(&self) -> Self {
        Pooled(self.0.clone())
    }
}

impl<S> std::ops::Deref for Pooled<S> {
    type Target = Arc<S>;
    #[inline]
    fn deref(&self) -> &Arc<S> {
        &self.0
    }
}

impl<S> std::ops::DerefMut for Pooled<S> {
    #[inline]
    fn deref_mut(&mut self) -> &mut Arc<S> {
        &mut self.0
    }
}

impl<S> Drop for Pooled<S> {
    #[inline]
    fn drop(&mut self) {
        // SAFETY: taken once, in the drop.
        release(unsafe { ManuallyDrop::take(&mut self.0) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value that counts its drops.
    struct Counted<'a>(&'a AtomicUsize, [u64; 3]);

    impl Drop for Counted<'_> {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn the_last_reference_drops_the_value_once_and_the_memory_is_reused() {
        let drops = AtomicUsize::new(0);
        let a = Pooled::new(Counted(&drops, [1, 2, 3]));
        let b = a.clone();
        let counted: &Counted = &b;
        assert_eq!(counted.1, [1, 2, 3]);
        let addr = Arc::as_ptr(&a) as usize;
        drop(a);
        assert_eq!(drops.load(Ordering::Relaxed), 0, "a reference is left");
        drop(b);
        assert_eq!(drops.load(Ordering::Relaxed), 1);
        // Same size and alignment, another type: built in the kept block
        // (this thread takes the class's stack, whose newest block is it,
        // unless another test's block of that class came after: so look
        // among the next few).
        let next: Vec<_> = (0..8).map(|i| Pooled::new([i as u64; 4])).collect();
        assert!(next.iter().any(|p| Arc::as_ptr(p) as usize == addr));
        for (i, p) in next.iter().enumerate() {
            assert_eq!(***p, [i as u64; 4], "a value built in a kept block");
        }
        drop(next);
        assert_eq!(drops.load(Ordering::Relaxed), 1, "never dropped again");
    }

    #[test]
    fn a_last_reference_on_another_thread_keeps_the_block_for_this_one() {
        let drops = AtomicUsize::new(0);
        // A class no other test uses: 7 words.
        struct Seven<'a>(Counted<'a>, [u64; 3]);
        let v = Pooled::new(Seven(Counted(&drops, [4; 3]), [5; 3]));
        let seven: &Seven = &v;
        assert_eq!((seven.0 .1, seven.1), ([4; 3], [5; 3]));
        let addr = Arc::as_ptr(&v) as usize;
        std::thread::scope(|s| {
            s.spawn(move || drop(v));
        });
        assert_eq!(drops.load(Ordering::Relaxed), 1);
        let w = Pooled::new([9u64; 7]);
        assert_eq!(Arc::as_ptr(&w) as usize, addr, "the block came back");
        assert_eq!(**w, [9; 7]);
    }

    #[test]
    fn a_full_class_frees_what_it_cannot_keep() {
        // 13 words: a class no other test uses (a Var's storage is larger);
        // its stack keeps 2,520 blocks.
        let most = KEPT_BYTES / size_of::<[u64; 13]>();
        let all: Vec<_> = (0..most + 100).map(|_| Pooled::new([1u64; 13])).collect();
        drop(all);
        let class = class_of::<[u64; 13]>().unwrap();
        let mut on_stack = 0;
        let mut at = STACKS[class].head.load(Ordering::Acquire);
        while !at.is_null() {
            on_stack += 1;
            // SAFETY: no other thread uses this class in these tests.
            at = unsafe { (*at).next };
        }
        assert_eq!(on_stack, most);
    }

    #[test]
    fn values_too_large_or_too_aligned_are_not_kept() {
        assert_eq!(class_of::<[u64; LARGEST / 8 + 1]>(), None);
        #[repr(align(64))]
        struct Wide([u8; 64]);
        assert_eq!(class_of::<Wide>(), None);
        assert_eq!(class_of::<u8>(), None);
        // Still built and dropped as any `Arc`.
        let w = Pooled::new(Wide([3; 64]));
        let wide: &Wide = &w;
        assert_eq!(wide.0[63], 3);
        let arc = Pooled::new([5u64; 2]).into_arc();
        assert_eq!(*arc, [5, 5]);
    }
}
