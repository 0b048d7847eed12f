//! Synchronization primitives used by the scheduler, in one place so that a loom
//! build (`RUSTFLAGS="--cfg loom"`) can swap them for model-checked ones.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{
    AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering,
};
#[cfg(loom)]
pub(crate) use loom::sync::{Arc, Condvar, Mutex, MutexGuard};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{
    AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering,
};
#[cfg(not(loom))]
pub(crate) use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Locks a mutex, ignoring poisoning: every critical section in the engine leaves
/// its data consistent before anything in it can panic, and user code never runs
/// under an engine-internal lock.
#[inline]
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// A sequentially consistent fence (the Dekker-style half of the sleep protocol).
#[inline]
pub(crate) fn fence_seq_cst() {
    #[cfg(loom)]
    loom::sync::atomic::fence(Ordering::SeqCst);
    #[cfg(not(loom))]
    std::sync::atomic::fence(Ordering::SeqCst);
}

/// The data of a mutex reached through `&mut` (no locking), ignoring poisoning
/// as [`lock`] does.
#[inline]
pub(crate) fn get_mut<T>(m: &mut Mutex<T>) -> &mut T {
    match m.get_mut() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// A cell reached without a lock by one thread at a time, in an order that the
/// caller's protocol sets (a node's job: see `graph/README.md`); under loom,
/// loom's cell, which fails a model where two threads reach it at once.
#[cfg(not(loom))]
pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> UnsafeCell<T> {
    pub(crate) const fn new(value: T) -> Self {
        UnsafeCell(std::cell::UnsafeCell::new(value))
    }

    /// Calls `f` with a pointer to the value; dereferencing it is the
    /// caller's promise that no other thread reaches the value meanwhile.
    #[inline]
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

#[cfg(loom)]
pub(crate) struct UnsafeCell<T>(loom::cell::UnsafeCell<T>);

#[cfg(loom)]
impl<T> UnsafeCell<T> {
    pub(crate) fn new(value: T) -> Self {
        UnsafeCell(loom::cell::UnsafeCell::new(value))
    }

    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        self.0.with_mut(f)
    }
}

/// The calling thread's number, given out in turn to threads as they first
/// ask: which shard or slot of a structure spread over threads a thread
/// uses (modulo the structure's count: past that, threads share one).
/// std's atomic also under loom: placement, not part of a protocol a model
/// checks.
#[inline]
pub(crate) fn thread_number() -> usize {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    thread_local! {
        static NUMBER: usize = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    NUMBER.try_with(|n| *n).unwrap_or(0)
}
