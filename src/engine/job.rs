//! A node's job: its closure in a box that outlives the call, so that the
//! next node recorded in the same memory (see `registry.rs`) writes its own
//! closure into the box and allocates nothing.
//!
//! The engine's one `unsafe` is here (`var/pool.rs` does the same for a
//! Var's storage, keyed by size): a spent box is written over by a
//! closure of another type when the two have the same size and alignment.
//! Every call site has a closure type of its own and a program's ops mix
//! many, so reuse by type alone was a hit for few nodes: `tree` in
//! `benches/scheduler.rs`, whose levels record closures of three types,
//! allocated a box per node. [`Body`] is an `unsafe` trait, so that only
//! this module, which keeps its promise, implements it.

use super::Completion;
use std::alloc::Layout;

/// What a node does when it runs: `Err` fails it with the message. Boxed once
/// and called through `&mut`, so that the box outlives the call (see [`job`]).
pub(crate) type Job = Box<dyn Body>;

/// A job's closure in its box.
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

/// Boxes `f` as a job, in `spent`'s box if that has the size and alignment
/// of `f`'s slot, whatever closure it held (the spent closure, if it was
/// never called, is dropped first).
pub(crate) fn job<F>(f: F, spent: Option<Job>) -> Job
where
    F: FnOnce() -> std::result::Result<(), String> + Send + 'static,
{
    match spent {
        Some(b) => refill(b, Slot(Some(f))),
        None => Box::new(Slot(Some(f))),
    }
}

/// Boxes `f` as a deferred job (it finishes through its [`Completion`]).
pub(crate) fn deferred_job<F>(f: F) -> Job
where
    F: FnOnce(Completion) + Send + 'static,
{
    Box::new(DeferredSlot(Some(f)))
}

/// `slot` in `spent`'s memory if the two have the same layout, else in a new
/// box (and `spent` is freed).
fn refill<B: Body>(mut spent: Job, slot: B) -> Job {
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
    use super::{job, Job};

    fn addr(j: &Job) -> *const () {
        &**j as *const dyn super::Body as *const ()
    }

    fn counting(hits: &std::sync::Arc<std::sync::atomic::AtomicU32>) -> Job {
        let h = hits.clone();
        job(
            move || {
                h.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Ok(())
            },
            None,
        )
    }

    #[test]
    fn a_spent_job_box_holds_the_next_closure_of_its_type() {
        let make = |n: u32, spent: Option<Job>| job(move || Err(format!("{n}")), spent);
        let mut first = make(1, None);
        assert_eq!(first.call(), Err("1".to_string()));
        // Called once: the closure is gone.
        assert_eq!(first.call(), Ok(()));
        let at = addr(&first);
        let mut second = make(2, Some(first));
        assert_eq!(addr(&second), at, "same type: same box");
        assert_eq!(second.call(), Err("2".to_string()));
        // A closure of another size gets a box of its own (the spent one is
        // freed).
        let mut third = job(|| Err("3".to_string()), Some(second));
        assert_eq!(third.call(), Err("3".to_string()));
    }

    #[test]
    fn a_spent_job_box_holds_the_next_closure_of_its_layout_whatever_its_type() {
        // Two call sites, two types, each capturing one `Arc`: the same
        // layout.
        let hits = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let mut first = counting(&hits);
        assert_eq!(first.call(), Ok(()));
        let at = addr(&first);
        let h = hits.clone();
        let mut second = job(
            move || {
                h.fetch_add(10, std::sync::atomic::Ordering::Relaxed);
                Err("second".to_string())
            },
            Some(first),
        );
        assert_eq!(addr(&second), at, "same layout: same box");
        assert_eq!(second.call(), Err("second".to_string()));
        assert_eq!(hits.load(std::sync::atomic::Ordering::Relaxed), 11);
        assert_eq!(std::sync::Arc::strong_count(&hits), 1, "captures dropped");
        // A box whose closure was never called (a job given back unrun):
        // its captures are dropped once, before the box is written over.
        let unrun = counting(&hits);
        assert_eq!(std::sync::Arc::strong_count(&hits), 2);
        let at = addr(&unrun);
        let h = hits.clone();
        let mut third = job(
            move || {
                h.fetch_add(100, std::sync::atomic::Ordering::Relaxed);
                Ok(())
            },
            Some(unrun),
        );
        assert_eq!(addr(&third), at);
        assert_eq!(
            std::sync::Arc::strong_count(&hits),
            2,
            "the unrun one's dropped"
        );
        assert_eq!(third.call(), Ok(()));
        assert_eq!(hits.load(std::sync::atomic::Ordering::Relaxed), 111);
        assert_eq!(std::sync::Arc::strong_count(&hits), 1);
    }

    #[test]
    fn a_cleared_job_drops_its_closure_uncalled() {
        let hits = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let mut j = counting(&hits);
        assert_eq!(std::sync::Arc::strong_count(&hits), 2);
        j.clear();
        assert_eq!(std::sync::Arc::strong_count(&hits), 1, "captures dropped");
        assert_eq!(j.call(), Ok(()));
        assert_eq!(hits.load(std::sync::atomic::Ordering::Relaxed), 0);
    }
}
