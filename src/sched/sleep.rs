//! Parking idle workers without losing a wake-up. The protocol is written up in
//! `src/sched/README.md`.

use crate::sync::{lock, AtomicUsize, Condvar, Mutex, Ordering};

/// Where idle workers park.
pub(crate) struct Sleep {
    /// Workers parked or about to park. The accesses are Relaxed: the SeqCst
    /// fence after the increment in [`Sleep::sleep`] pairs with the SeqCst fence
    /// before the load in [`Sleep::wake`], so that either the sleeper sees the new
    /// work or the waker sees the sleeper.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wakeup: Condvar,
}

impl Sleep {
    pub(crate) fn new() -> Self {
        Sleep {
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wakeup: Condvar::new(),
        }
    }

    /// Parks the calling worker unless `has_work()` (checked after announcing the
    /// sleeper) says there is something to do. May return spuriously.
    pub(crate) fn sleep(&self, has_work: impl Fn() -> bool) {
        let guard = lock(&self.lock);
        self.sleepers.fetch_add(1, Ordering::Relaxed);
        crate::sync::fence_seq_cst();
        if has_work() {
            self.sleepers.fetch_sub(1, Ordering::Relaxed);
            return;
        }
        // The waker must take `lock` to notify, and we hold it until `wait`
        // releases it atomically: a notify cannot fall between check and wait.
        let guard = match self.wakeup.wait(guard) {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        self.sleepers.fetch_sub(1, Ordering::Relaxed);
        drop(guard);
    }

    /// Wakes up to `n` parked workers after new work was published.
    #[inline]
    pub(crate) fn wake(&self, n: usize) {
        if n == 0 {
            return;
        }
        crate::sync::fence_seq_cst();
        if self.sleepers.load(Ordering::Relaxed) == 0 {
            return;
        }
        self.wake_slow(n);
    }

    #[cold]
    fn wake_slow(&self, n: usize) {
        let _guard = lock(&self.lock);
        let sleepers = self.sleepers.load(Ordering::Relaxed);
        if n >= sleepers {
            self.wakeup.notify_all();
        } else {
            for _ in 0..n {
                self.wakeup.notify_one();
            }
        }
    }

    /// Wakes every parked worker (shutdown).
    pub(crate) fn wake_all(&self) {
        let _guard = lock(&self.lock);
        self.wakeup.notify_all();
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::Sleep;
    use crate::sync::{Arc, AtomicBool, Ordering};

    /// A worker that finds no work parks; a producer publishes one item and wakes.
    /// In every interleaving the worker ends up seeing the item (no lost wake-up).
    #[test]
    fn no_lost_wakeup() {
        loom::model(|| {
            let sleep = Arc::new(Sleep::new());
            let queue = Arc::new(AtomicBool::new(false));
            let (s2, q2) = (sleep.clone(), queue.clone());
            let worker = loom::thread::spawn(move || loop {
                if q2.load(Ordering::Acquire) {
                    return;
                }
                s2.sleep(|| q2.load(Ordering::Acquire));
            });
            queue.store(true, Ordering::Release);
            sleep.wake(1);
            worker.join().unwrap();
        });
    }
}
