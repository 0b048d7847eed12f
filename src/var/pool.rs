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
//! 30-40% faster (`docs/per-node-overhead.md`, "Completions counted out in
//! groups").
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
//! stack. The memory is mimalloc's (`mem.rs`), which finds a block's size
//! itself when it is given back, whatever type was built in it since.
//!
//! Bounds: storages of up to [`LARGEST`] bytes are kept, and a class keeps
//! at most [`KEPT_BYTES`] of them on its stack (a storage pushed past that is
//! freed), so a program that made a million Vars once does not keep their
//! memory. A thread keeps what it took (at most a stack's worth) until it
//! uses it or exits, then it is freed: per class, a stack and a list per
//! thread that makes Vars of that size.

use crossbeam_utils::CachePadded;
use std::cell::Cell;
use std::marker::PhantomData;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

/// Largest storage kept, in bytes, with its count (a Var's queue, counts
/// and lock take about 128 of them; the rest is room for a small value).
const LARGEST: usize = 512;
/// Most bytes of storages one size class keeps on its stack.
const KEPT_BYTES: usize = 256 << 10;
/// Every class holds storages of this alignment (a storage holds a `u64`
/// counter; a value of larger alignment is not kept).
const ALIGN: usize = 8;
const CLASSES: usize = LARGEST / ALIGN + 1;

/// The first words of a kept block, written over its dropped value.
struct Block {
    /// The next block of the same stack or list.
    next: *mut Block,
}

/// One size class's stack of kept blocks.
struct Class {
    head: AtomicPtr<Block>,
    /// About how many blocks the stack holds: raised (up to the class's
    /// most, in one step: see `admit`) before a push links its block,
    /// zeroed by a take after its swap, so it can run short by the pushes
    /// in flight at a take, never grow without bound.
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
        // SAFETY: a block of a list only the caller reaches (a
        // `Counted`'s memory from `mem::boxed`, its value dropped); it is
        // read before it is freed, and freed once.
        unsafe {
            let next = (*at).next;
            crate::mem::free(at);
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

/// A value with the count of its references, in one allocation (`repr(C)`:
/// the value at the same offset whatever its type, so that a value built in
/// a block has the address the block's last value had).
#[repr(C)]
struct Counted<S> {
    refs: AtomicUsize,
    value: S,
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

/// Counts one more block kept, unless `most` are: one step, so that a
/// take's zeroing cannot fall between a raise and its undoing (the count
/// wrapped then, and with the stack empty nothing zeroed it again).
fn admit(kept: &AtomicUsize, most: usize) -> bool {
    kept.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |k| {
        (k < most).then_some(k + 1)
    })
    .is_ok()
}

/// Pushes a block of `class` on its stack, or frees it if the stack is full.
fn push(class: usize, b: *mut Block) {
    let stack = &STACKS[class];
    let most = KEPT_BYTES / (class * ALIGN);
    if !admit(&stack.kept, most) {
        // SAFETY: the caller's block (memory from `mem::boxed`, its value
        // dropped), which nothing else reaches.
        unsafe { crate::mem::free(b) };
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

/// A counted reference to a value (`Arc`'s protocol, without weak
/// references), whose last reference drops the value where it goes and
/// keeps the memory for the next [`Pooled::new`] of the same size (see the
/// module's comment).
///
/// Its own count and not an `Arc`'s: to see that a reference is the last,
/// an `Arc` must be read before its decrement (`strong_count`), and on a
/// count that the recorder and a worker both change (every token of a Var
/// clones it on the recorder and drops it on a worker) that read is one
/// more transfer of the cache line: `node_cost chain` (no Var per node,
/// a token per node) ran 10% slower with it. Here the decrement itself
/// says so, as in `Arc`'s own drop.
pub(crate) struct Pooled<S> {
    ptr: NonNull<Counted<S>>,
    _owns: PhantomData<Counted<S>>,
}

// SAFETY: as `Arc<S>`: the value is shared between threads and dropped on
// whichever lets go of it last.
unsafe impl<S: Send + Sync> Send for Pooled<S> {}
// SAFETY: as `Arc<S>`.
unsafe impl<S: Send + Sync> Sync for Pooled<S> {}

impl<S> Pooled<S> {
    /// `value` in a kept block when there is one, else a new allocation.
    #[inline]
    pub(crate) fn new(value: S) -> Self {
        let counted = Counted {
            refs: AtomicUsize::new(1),
            value,
        };
        let ptr = match class_of::<Counted<S>>().and_then(take) {
            Some(b) => {
                let p = b.cast::<Counted<S>>();
                // SAFETY: a kept block of `Counted<S>`'s size and
                // alignment from `mem::boxed`, holding nothing (its value
                // was dropped), that only this thread reaches.
                unsafe { p.write(counted) };
                // SAFETY: not null (a block of a list).
                unsafe { NonNull::new_unchecked(p) }
            }
            None => crate::mem::boxed(counted),
        };
        Pooled {
            ptr,
            _owns: PhantomData,
        }
    }

    fn counted(&self) -> &Counted<S> {
        // SAFETY: alive while a reference (this one) is.
        unsafe { self.ptr.as_ref() }
    }

    /// The value, mutably, if this is its only reference.
    pub(crate) fn get_mut(&mut self) -> Option<&mut S> {
        // Acquire: every use through a reference dropped elsewhere happens
        // before what the caller does here (as `Arc::get_mut`).
        if self.counted().refs.load(Ordering::Acquire) != 1 {
            return None;
        }
        // SAFETY: the one reference, borrowed mutably: nothing else can
        // reach the value or make another reference meanwhile.
        Some(unsafe { &mut self.ptr.as_mut().value })
    }

    /// Two more references to a value that this one alone reaches, counted
    /// with a plain store instead of two locked increments; `None` if
    /// another reference exists. Borrowed mutably and the only reference:
    /// no other thread can count meanwhile, and the references given are
    /// published to other threads (if ever) by whatever sends them.
    pub(crate) fn two_more_if_unique(&mut self) -> Option<(Self, Self)> {
        let refs = &self.counted().refs;
        // Acquire, as `get_mut`.
        if refs.load(Ordering::Acquire) != 1 {
            return None;
        }
        refs.store(3, Ordering::Relaxed);
        let more = || Pooled {
            ptr: self.ptr,
            _owns: PhantomData,
        };
        Some((more(), more()))
    }

    /// How many references there are (this one included).
    pub(crate) fn count(&self) -> usize {
        self.counted().refs.load(Ordering::Acquire)
    }

    /// The value's address: equal for references to the same value.
    pub(crate) fn as_ptr(&self) -> *const S {
        &self.counted().value
    }

    pub(crate) fn ptr_eq(a: &Self, b: &Self) -> bool {
        a.ptr == b.ptr
    }
}

impl<S> Clone for Pooled<S> {
    #[inline]
    fn clone(&self) -> Self {
        // Relaxed, as `Arc::clone`: a new reference comes from one held.
        let old = self.counted().refs.fetch_add(1, Ordering::Relaxed);
        if old > isize::MAX as usize {
            // As `Arc`: a count this high means references were leaked.
            std::process::abort();
        }
        Pooled {
            ptr: self.ptr,
            _owns: PhantomData,
        }
    }
}

impl<S> std::ops::Deref for Pooled<S> {
    type Target = S;
    #[inline]
    fn deref(&self) -> &S {
        &self.counted().value
    }
}

impl<S> Drop for Pooled<S> {
    #[inline]
    fn drop(&mut self) {
        // Release, then an Acquire load, as `Arc`'s drop: every use through
        // another reference happens before the value is dropped.
        if self.counted().refs.fetch_sub(1, Ordering::Release) != 1 {
            return;
        }
        let _ = self.counted().refs.load(Ordering::Acquire);
        keep(self.ptr.as_ptr());
    }
}

/// Drops the value of a `Counted<S>` nothing else reaches any more and keeps
/// its memory, or frees it (a size that is not kept).
fn keep<S>(p: *mut Counted<S>) {
    let Some(class) = class_of::<Counted<S>>() else {
        // SAFETY: allocated by `mem::boxed` (a size not kept is never built
        // in a block), and the last reference is gone.
        unsafe { crate::mem::drop_and_free(p) };
        return;
    };
    // SAFETY: the last reference is gone: the value is dropped once, and
    // its memory is not read as a `Counted<S>` until `Pooled::new` writes
    // a new one. A panic in the value's drop leaks the block.
    unsafe { ptr::drop_in_place(p) };
    let b = p.cast::<Block>();
    // SAFETY: `Counted<S>` is at least a `Block` in size and alignment
    // (`class_of`), and its memory holds nothing now.
    unsafe {
        b.write(Block {
            next: ptr::null_mut(),
        })
    };
    push(class, b);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value that counts its drops.
    struct Noted<'a>(&'a AtomicUsize, [u64; 3]);

    impl Drop for Noted<'_> {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn the_last_reference_drops_the_value_once_and_the_memory_is_reused() {
        let drops = AtomicUsize::new(0);
        let a = Pooled::new(Noted(&drops, [1, 2, 3]));
        let mut b = a.clone();
        assert_eq!((b.1, a.count()), ([1, 2, 3], 2));
        assert!(b.get_mut().is_none(), "not the only reference");
        let addr = a.as_ptr() as usize;
        drop(a);
        assert_eq!(drops.load(Ordering::Relaxed), 0, "a reference is left");
        assert_eq!(b.get_mut().map(|n| n.1[2]), Some(3));
        drop(b);
        assert_eq!(drops.load(Ordering::Relaxed), 1);
        // Same size and alignment, another type: built in the kept block
        // (this thread takes the class's stack, which holds it: no other
        // test keeps this size, see `the_tests_sizes_are_not_a_vars`).
        let next: Vec<_> = (0..8).map(|i| Pooled::new([i as u64; 4])).collect();
        assert_eq!(next[0].as_ptr() as usize, addr);
        for (i, p) in next.iter().enumerate() {
            assert_eq!(**p, [i as u64; 4], "a value built in a kept block");
            assert_eq!(p.count(), 1);
        }
        drop(next);
        assert_eq!(drops.load(Ordering::Relaxed), 1, "never dropped again");
    }

    #[test]
    fn a_last_reference_on_another_thread_keeps_the_block_for_this_one() {
        let drops = AtomicUsize::new(0);
        // A class no other test uses: 8 words with the count.
        struct Seven<'a>(Noted<'a>, [u64; 3]);
        let v = Pooled::new(Seven(Noted(&drops, [4; 3]), [5; 3]));
        assert_eq!((v.0 .1, v.1), ([4; 3], [5; 3]));
        let addr = v.as_ptr() as usize;
        std::thread::scope(|s| {
            s.spawn(move || drop(v));
        });
        assert_eq!(drops.load(Ordering::Relaxed), 1);
        let w = Pooled::new([9u64; 7]);
        assert_eq!(w.as_ptr() as usize, addr, "the block came back");
        assert_eq!(*w, [9; 7]);
    }

    #[test]
    fn a_full_class_frees_what_it_cannot_keep() {
        // 13 words with the count: a class no other test uses (a Var's
        // storage is larger); its stack keeps 2,520 blocks.
        let most = KEPT_BYTES / size_of::<Counted<[u64; 12]>>();
        let all: Vec<_> = (0..most + 100).map(|_| Pooled::new([1u64; 12])).collect();
        drop(all);
        let class = class_of::<Counted<[u64; 12]>>().unwrap();
        assert_eq!(STACKS[class].kept.load(Ordering::Relaxed), most);
        // Taken, the list is this thread's alone to walk.
        let mut at = take_stack(class);
        let taken = at;
        let mut on_stack = 0;
        while !at.is_null() {
            on_stack += 1;
            // SAFETY: a list this thread took.
            at = unsafe { (*at).next };
        }
        free_list(taken);
        assert_eq!(on_stack, most);
    }

    /// Two more references made from the only one count as two clones: the
    /// value goes once, with the last of the four; refused while another
    /// reference exists.
    #[test]
    fn two_more_references_of_the_only_one_count_as_clones() {
        struct Big<'a>(&'a AtomicUsize, [u64; LARGEST / 8]);
        impl Drop for Big<'_> {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
        // Too large to be kept: no other test's class is touched.
        assert_eq!(class_of::<Counted<Big>>(), None);
        let drops = AtomicUsize::new(0);
        let mut a = Pooled::new(Big(&drops, [7; LARGEST / 8]));
        let (b, c) = a.two_more_if_unique().expect("the only reference");
        assert_eq!((a.count(), b.1[0], c.1[LARGEST / 8 - 1]), (3, 7, 7));
        let mut d = b.clone();
        assert!(d.two_more_if_unique().is_none(), "four references");
        assert_eq!(d.count(), 4);
        drop((a, b, c));
        assert_eq!((drops.load(Ordering::Relaxed), d.count()), (0, 1));
        drop(d);
        assert_eq!(drops.load(Ordering::Relaxed), 1);
    }

    /// The sizes these tests keep are classes of their own: smaller than
    /// any Var's storage, which other tests of the crate make at once.
    #[test]
    fn the_tests_sizes_are_not_a_vars() {
        let var = size_of::<Counted<super::super::Storage<()>>>();
        for size in [
            size_of::<Counted<Noted>>(),
            size_of::<Counted<[u64; 7]>>(),
            size_of::<Counted<[u64; 12]>>(),
        ] {
            assert!(size < var, "{size} bytes, a Var's storage {var}");
        }
    }

    /// A push to a full class racing a take that empties it: the count of
    /// kept blocks must not wrap (it did when a push's raise and its
    /// undoing were two steps and the take's zeroing fell between them;
    /// with the stack empty, nothing zeroed it again and the class freed
    /// every block from then on).
    #[test]
    fn a_take_racing_a_push_to_a_full_class_leaves_a_true_count() {
        let kept = AtomicUsize::new(0);
        let stop = std::sync::atomic::AtomicBool::new(false);
        let rounds = if cfg!(miri) { 100 } else { 2_000_000 };
        let wrapped = std::thread::scope(|s| {
            // The take's zeroing, over and over.
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    kept.store(0, Ordering::Relaxed);
                }
            });
            let mut wrapped = 0;
            for _ in 0..rounds {
                admit(&kept, 1);
                if kept.load(Ordering::Relaxed) > 1 {
                    wrapped += 1;
                }
            }
            stop.store(true, Ordering::Relaxed);
            wrapped
        });
        assert_eq!(wrapped, 0, "a class of 1 block counted more");
    }

    #[test]
    fn values_too_large_or_too_aligned_are_not_kept() {
        assert_eq!(class_of::<Counted<[u64; LARGEST / 8]>>(), None);
        #[repr(align(64))]
        struct Wide([u8; 64]);
        assert_eq!(class_of::<Counted<Wide>>(), None);
        // Still built, shared and dropped, from and back to the allocator.
        let drops = AtomicUsize::new(0);
        let w = Pooled::new((Wide([3; 64]), Noted(&drops, [0; 3])));
        let v = w.clone();
        drop(w);
        assert_eq!((v.0 .0[63], drops.load(Ordering::Relaxed)), (3, 0));
        drop(v);
        assert_eq!(drops.load(Ordering::Relaxed), 1);
    }
}
