//! A node's job: its closure, kept in the node itself when it is small,
//! else in a box that outlives the call.
//!
//! **Inline.** A closure of up to [`INLINE`] bytes (alignment up to 8) is
//! written into the job, which sits in the node: no allocation, and the
//! worker that runs the node reads the closure from the node's own lines
//! instead of from a box the frontend wrote elsewhere. Every shape of
//! `benches/scheduler.rs` records such closures (two or three tokens, or a
//! `Vec` of them and a token); their boxes were about a fifth of the
//! allocations of `tree` and `random_dag`: a fresh node (one taken from the
//! allocator, not a finished one reused) came with a fresh box, and a
//! reused node's box was freed when the next closure had another size.
//!
//! **Boxed.** A larger closure, or a deferred one (see [`deferred_job`]),
//! is boxed, and the box outlives the call, so that the next node recorded
//! in the same memory (see `registry.rs`) writes its own closure into it and
//! allocates nothing: a spent box is written over by a closure of another
//! type when the two have the same size and alignment. Every call site has
//! a closure type of its own and a program's ops mix many, so reuse by type
//! alone was a hit for few nodes. [`Body`] is an `unsafe` trait, so that
//! only this module, which keeps its promise, implements it.
//!
//! Both are the engine's `unsafe` code (`var/pool.rs` does the same as the
//! box's reuse for a Var's storage, keyed by size).

use super::Completion;
use std::alloc::Layout;
use std::mem::MaybeUninit;

/// Largest closure kept in the job itself, in bytes: a `Vec` and a token,
/// or four tokens.
const INLINE: usize = 32;

/// What a node does when it runs: `Err` fails it with the message. Called
/// through `&mut`, so that a boxed closure's box outlives the call (see
/// [`job`]).
pub(crate) struct Job(Kind);

enum Kind {
    /// A closure kept in place, with the functions that call and drop it.
    Inline {
        ops: &'static Ops,
        data: MaybeUninit<[u64; INLINE / 8]>,
    },
    /// A closure in place was called or dropped: nothing is left.
    Spent,
    Boxed(Box<dyn Body>),
}

/// How to call or drop the closure of one type kept in place.
struct Ops {
    /// Reads the closure out of the bytes and calls it.
    call: unsafe fn(*mut u8) -> std::result::Result<(), String>,
    /// Drops the closure in the bytes.
    drop: unsafe fn(*mut u8),
}

/// # Safety
/// `at` holds an `F`, written by [`job`], which is read out here (the
/// caller no longer treats the bytes as holding it).
unsafe fn call_in_place<F: FnOnce() -> std::result::Result<(), String>>(
    at: *mut u8,
) -> std::result::Result<(), String> {
    // SAFETY: the caller's promise; `data` is aligned to 8, `F` to at most 8.
    let f = unsafe { at.cast::<F>().read() };
    f()
}

/// # Safety
/// As [`call_in_place`].
unsafe fn drop_in_place<F>(at: *mut u8) {
    // SAFETY: as in `call_in_place`.
    unsafe { at.cast::<F>().drop_in_place() }
}

// SAFETY: an inline closure is `Send` (`job` requires it), and so is a box
// of `Body`; the `Ops` are plain functions.
unsafe impl Send for Job {}

impl Job {
    /// Takes the closure out and calls it (once; later calls do nothing).
    #[inline]
    pub(crate) fn call(&mut self) -> std::result::Result<(), String> {
        match &mut self.0 {
            Kind::Boxed(b) => b.call(),
            Kind::Spent => Ok(()),
            Kind::Inline { ops, data } => {
                // The bytes copied out and the job marked spent before the
                // call: a panic in it drops the closure (it was read out),
                // and the job holds nothing.
                let (ops, mut data) = (*ops, *data);
                self.0 = Kind::Spent;
                // SAFETY: `data` holds the closure `ops` was made for, and
                // the job no longer does.
                unsafe { (ops.call)(data.as_mut_ptr().cast()) }
            }
        }
    }

    /// Drops the closure without calling it (a skipped node).
    pub(crate) fn clear(&mut self) {
        match &mut self.0 {
            Kind::Boxed(b) => b.clear(),
            Kind::Spent => {}
            Kind::Inline { ops, data } => {
                let (ops, mut data) = (*ops, *data);
                self.0 = Kind::Spent;
                // SAFETY: as in `call`.
                unsafe { (ops.drop)(data.as_mut_ptr().cast()) }
            }
        }
    }

    /// Whether the job finishes later, through a [`Completion`] (see
    /// [`Job::start`]), instead of when `call` returns.
    #[inline]
    pub(crate) fn deferred(&self) -> bool {
        match &self.0 {
            Kind::Boxed(b) => b.deferred(),
            _ => false,
        }
    }

    /// Starts a deferred job: it completes its node through `done`, on any
    /// thread.
    pub(crate) fn start(&mut self, done: Completion) {
        match &mut self.0 {
            Kind::Boxed(b) => b.start(done),
            _ => drop(done),
        }
    }

    /// Whether the closure is kept in place (tests).
    #[cfg(test)]
    fn inline(&self) -> bool {
        !matches!(self.0, Kind::Boxed(_))
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        self.clear();
    }
}

/// A boxed job's closure in its box.
///
/// # Safety
/// An implementation owns nothing but its closure: once [`Body::clear`] has
/// run, its memory holds nothing to drop, and [`job`] may write another
/// closure's slot over it without dropping it.
pub(crate) unsafe trait Body: Send + 'static {
    /// Takes the closure out and calls it (once; later calls do nothing).
    fn call(&mut self) -> std::result::Result<(), String>;
    /// Drops the closure without calling it (a skipped node).
    fn clear(&mut self);
    /// Whether the job finishes later, through a [`Completion`] (see
    /// [`Body::start`]), instead of when `call` returns.
    fn deferred(&self) -> bool {
        false
    }
    /// Starts a deferred job: it completes its node through `done`, on any
    /// thread (only called when [`Body::deferred`] is true).
    fn start(&mut self, done: Completion) {
        drop(done);
    }
}

struct Slot<F>(Option<F>);

// SAFETY: the slot owns its closure and nothing else; `clear` drops it.
unsafe impl<F: FnOnce() -> std::result::Result<(), String> + Send + 'static> Body for Slot<F> {
    fn call(&mut self) -> std::result::Result<(), String> {
        match self.0.take() {
            Some(f) => f(),
            None => Ok(()),
        }
    }

    fn clear(&mut self) {
        self.0 = None;
    }
}

struct DeferredSlot<F>(Option<F>);

// SAFETY: the slot owns its closure and nothing else; `clear` drops it.
unsafe impl<F: FnOnce(Completion) + Send + 'static> Body for DeferredSlot<F> {
    fn call(&mut self) -> std::result::Result<(), String> {
        Err("a deferred task was called without its completion".into())
    }

    fn clear(&mut self) {
        self.0 = None;
    }

    fn deferred(&self) -> bool {
        true
    }

    fn start(&mut self, done: Completion) {
        if let Some(f) = self.0.take() {
            f(done);
        }
    }
}

/// Makes `f` a job: in place if it fits (see [`INLINE`]), else in
/// `spent`'s box if that is a box with the size and alignment of `f`'s slot,
/// whatever closure it held (the spent closure, if it was never called, is
/// dropped first), else in a new box.
pub(crate) fn job<F>(f: F, spent: Option<Job>) -> Job
where
    F: FnOnce() -> std::result::Result<(), String> + Send + 'static,
{
    if size_of::<F>() <= INLINE && align_of::<F>() <= align_of::<u64>() {
        let mut data = MaybeUninit::<[u64; INLINE / 8]>::uninit();
        // SAFETY: `data` has room for `F` and is aligned for it (checked
        // above); `ops` are `F`'s, so the bytes are read back as an `F`.
        unsafe { data.as_mut_ptr().cast::<F>().write(f) };
        let ops = const {
            &Ops {
                call: call_in_place::<F>,
                drop: drop_in_place::<F>,
            }
        };
        // A spare's spent box, if it had one, is freed here.
        drop(spent);
        return Job(Kind::Inline { ops, data });
    }
    // The spare's box, if it had one (a closure still in place is put
    // back, and dropped with its job).
    let spent = spent.and_then(|mut s| match std::mem::replace(&mut s.0, Kind::Spent) {
        Kind::Boxed(b) => Some(b),
        other => {
            s.0 = other;
            None
        }
    });
    match spent {
        Some(b) => Job(Kind::Boxed(refill(b, Slot(Some(f))))),
        None => Job(Kind::Boxed(Box::new(Slot(Some(f))))),
    }
}

/// Boxes `f` as a deferred job (it finishes through its [`Completion`]).
pub(crate) fn deferred_job<F>(f: F) -> Job
where
    F: FnOnce(Completion) + Send + 'static,
{
    Job(Kind::Boxed(Box::new(DeferredSlot(Some(f)))))
}

/// `slot` in `spent`'s memory if the two have the same layout, else in a new
/// box (and `spent` is freed).
fn refill<B: Body>(mut spent: Box<dyn Body>, slot: B) -> Box<dyn Body> {
    if Layout::for_value(&*spent) != Layout::new::<B>() {
        return Box::new(slot);
    }
    // What the spent closure still owns is dropped: nothing is left to drop
    // in its memory (`Body`'s promise).
    spent.clear();
    let at = Box::into_raw(spent).cast::<B>();
    // SAFETY: `at` was allocated by the global allocator with a layout equal
    // to `B`'s and holds nothing to drop; it is written whole before the box
    // is made again, which frees it with that same layout.
    unsafe {
        at.write(slot);
        Box::from_raw(at)
    }
}

#[cfg(test)]
mod tests {
    use super::{job, Job, Kind};
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    /// The box of a boxed job.
    fn addr(j: &Job) -> *const () {
        match &j.0 {
            Kind::Boxed(b) => &**b as *const dyn super::Body as *const (),
            _ => panic!("a job in place has no box"),
        }
    }

    /// Counts its drops.
    struct Dropped(Arc<AtomicU32>);

    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A closure too large to keep in place: it captures `pad`.
    fn large(hits: &Arc<AtomicU32>, add: u32) -> Job {
        let (h, pad) = (hits.clone(), [u64::from(add); 6]);
        job(
            move || {
                h.fetch_add(std::hint::black_box(pad)[0] as u32, Ordering::Relaxed);
                Ok(())
            },
            None,
        )
    }

    #[test]
    fn a_small_closure_is_kept_in_place_and_called_once() {
        let hits = Arc::new(AtomicU32::new(0));
        let h = hits.clone();
        let n = 5u32;
        let mut j = job(
            move || {
                h.fetch_add(n, Ordering::Relaxed);
                Err(format!("{n}"))
            },
            None,
        );
        assert!(j.inline());
        assert_eq!(Arc::strong_count(&hits), 2);
        assert_eq!(j.call(), Err("5".to_string()));
        assert_eq!(Arc::strong_count(&hits), 1, "captures dropped by the call");
        assert_eq!(j.call(), Ok(()), "called once");
        assert_eq!(hits.load(Ordering::Relaxed), 5);
        // A zero-sized closure too.
        let mut z = job(|| Err("z".to_string()), None);
        assert!(z.inline());
        assert_eq!(z.call(), Err("z".to_string()));
        // Too large for the place: boxed, and called the same.
        let mut l = large(&hits, 10);
        assert!(!l.inline());
        assert_eq!(l.call(), Ok(()));
        assert_eq!(hits.load(Ordering::Relaxed), 15);
        assert_eq!(Arc::strong_count(&hits), 1);
    }

    #[test]
    fn a_job_cleared_or_dropped_unrun_drops_its_closure_once() {
        for inline in [true, false] {
            let drops = Arc::new(AtomicU32::new(0));
            let make = |d: Dropped| {
                let pad = [0u64; 6];
                if inline {
                    job(
                        move || {
                            drop(d);
                            Ok(())
                        },
                        None,
                    )
                } else {
                    job(
                        move || {
                            drop((d, std::hint::black_box(pad)));
                            Ok(())
                        },
                        None,
                    )
                }
            };
            let mut j = make(Dropped(drops.clone()));
            assert_eq!(j.inline(), inline);
            j.clear();
            assert_eq!(
                drops.load(Ordering::Relaxed),
                1,
                "cleared (inline {inline})"
            );
            assert_eq!(j.call(), Ok(()));
            drop(j);
            assert_eq!(drops.load(Ordering::Relaxed), 1, "once (inline {inline})");
            // Dropped without a call or a clear.
            drop(make(Dropped(drops.clone())));
            assert_eq!(
                drops.load(Ordering::Relaxed),
                2,
                "dropped (inline {inline})"
            );
            // Given as the spent job of a large closure: dropped there.
            let hits = Arc::new(AtomicU32::new(0));
            let (h, pad) = (hits.clone(), [0u64; 6]);
            let mut next = job(
                move || {
                    h.fetch_add(1 + std::hint::black_box(pad)[0] as u32, Ordering::Relaxed);
                    Ok(())
                },
                Some(make(Dropped(drops.clone()))),
            );
            assert_eq!(drops.load(Ordering::Relaxed), 3, "spent (inline {inline})");
            assert_eq!(next.call(), Ok(()));
            assert_eq!(hits.load(Ordering::Relaxed), 1);
        }
    }

    #[test]
    fn a_closure_in_place_that_panics_drops_its_captures_once() {
        let drops = Arc::new(AtomicU32::new(0));
        let d = Dropped(drops.clone());
        let mut j = job(
            move || {
                let _keep = &d;
                panic!("inside");
            },
            None,
        );
        assert!(j.inline());
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| j.call()));
        assert!(caught.is_err());
        assert_eq!(drops.load(Ordering::Relaxed), 1, "unwound");
        assert_eq!(j.call(), Ok(()), "nothing left to call");
        j.clear();
        drop(j);
        assert_eq!(drops.load(Ordering::Relaxed), 1, "and never again");
    }

    #[test]
    fn a_spent_job_box_holds_the_next_large_closure_of_its_layout_whatever_its_type() {
        let hits = Arc::new(AtomicU32::new(0));
        let mut first = large(&hits, 1);
        assert_eq!(first.call(), Ok(()));
        let at = addr(&first);
        // Another call site, another type, the same layout.
        let (h, pad) = (hits.clone(), [10u64; 6]);
        let mut second = job(
            move || {
                h.fetch_add(std::hint::black_box(pad)[0] as u32, Ordering::Relaxed);
                Err("second".to_string())
            },
            Some(first),
        );
        assert_eq!(addr(&second), at, "same layout: same box");
        assert_eq!(second.call(), Err("second".to_string()));
        assert_eq!(hits.load(Ordering::Relaxed), 11);
        assert_eq!(Arc::strong_count(&hits), 1, "captures dropped");
        // A box whose closure was never called (a job given back unrun):
        // its captures are dropped once, before the box is written over.
        let unrun = large(&hits, 1_000);
        assert_eq!(Arc::strong_count(&hits), 2);
        let at = addr(&unrun);
        let mut third = {
            let (h, pad) = (hits.clone(), [100u64; 6]);
            job(
                move || {
                    h.fetch_add(std::hint::black_box(pad)[0] as u32, Ordering::Relaxed);
                    Ok(())
                },
                Some(unrun),
            )
        };
        assert_eq!(addr(&third), at);
        assert_eq!(Arc::strong_count(&hits), 2, "the unrun one's dropped");
        assert_eq!(third.call(), Ok(()));
        assert_eq!(hits.load(Ordering::Relaxed), 111);
        assert_eq!(Arc::strong_count(&hits), 1);
        // A closure of another size gets a box of its own; a small one
        // goes in place, and the spent box is freed.
        let mut small = job(|| Err("3".to_string()), Some(third));
        assert!(small.inline());
        assert_eq!(small.call(), Err("3".to_string()));
    }
}
