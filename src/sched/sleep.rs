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
    /// Idle workers looking for work, not parked: a producer that sees one
    /// wakes nobody, and the last one to find work wakes a parked worker to
    /// take its place (see `README.md`). Written and read around the same
    /// SeqCst fences as `sleepers`.
    spinning: AtomicUsize,
    lock: Mutex<()>,
    wakeup: Condvar,
}

impl Sleep {
    pub(crate) fn new() -> Self {
        Sleep {
            sleepers: AtomicUsize::new(0),
            spinning: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wakeup: Condvar::new(),
        }
    }

    /// Notes an idle worker that starts looking for work.
    #[inline]
    pub(crate) fn start_spinning(&self) {
        self.spinning.fetch_add(1, Ordering::Relaxed);
    }

    /// Notes a looking worker that found work; if it was the last one
    /// looking, wakes a parked worker to look instead (work published while
    /// it looked may have woken nobody, counting on it).
    #[inline]
    pub(crate) fn found_work(&self) {
        if self.spinning.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.wake(1);
        }
    }

    /// Notes a looking worker that stops looking without work (it parks or
    /// exits next): the check of the queues that follows it (in
    /// [`Sleep::sleep`], or the pool's exit) finds what was published while
    /// it looked.
    #[inline]
    pub(crate) fn stop_spinning(&self) {
        self.spinning.fetch_sub(1, Ordering::Relaxed);
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
        // A looking worker takes the work, or wakes a parked one when it
        // finds other work (`found_work`), or sees it before it parks.
        if self.spinning.load(Ordering::Relaxed) > 0 || self.sleepers.load(Ordering::Relaxed) == 0 {
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

    /// Two workers that look for work before they park (as `worker_main`
    /// does) and one producer that publishes two items and wakes: the
    /// producer wakes nobody while a worker looks, and the last looker to
    /// find work wakes a parked one. In every interleaving both items are
    /// taken (no worker parks forever with an item left). Three threads
    /// and a condition variable: explored up to three preemptions (loom's
    /// advice for models of this size; unbounded, it ran past ten minutes).
    #[test]
    fn a_looking_worker_stands_in_for_a_wake_up() {
        use crate::sync::AtomicUsize;
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(3);
        model.check(|| {
            let sleep = Arc::new(Sleep::new());
            let items = Arc::new(AtomicUsize::new(0));
            let take = |items: &AtomicUsize| {
                let mut n = items.load(Ordering::Acquire);
                while n > 0 {
                    match items.compare_exchange(n, n - 1, Ordering::AcqRel, Ordering::Acquire) {
                        Ok(_) => return true,
                        Err(now) => n = now,
                    }
                }
                false
            };
            let workers: Vec<_> = (0..2)
                .map(|_| {
                    let (s, q) = (sleep.clone(), items.clone());
                    loom::thread::spawn(move || loop {
                        s.start_spinning();
                        if take(&q) {
                            s.found_work();
                            return;
                        }
                        s.stop_spinning();
                        s.sleep(|| q.load(Ordering::Acquire) > 0);
                    })
                })
                .collect();
            items.store(2, Ordering::Release);
            sleep.wake(2);
            for w in workers {
                w.join().unwrap();
            }
        });
    }
}
