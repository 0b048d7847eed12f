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
