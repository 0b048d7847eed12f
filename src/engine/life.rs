//! The engine's life: it ends with its last counted `Engine` handle and starts
//! again when a value outlives it (see [`super::Engine`]).
//!
//! Retiring: `global_demand` gets one count (so everything recorded from now on
//! is demanded at once), `retiring` is set, everything recorded is demanded, and
//! once `live` is 0 the pool's shutdown lets idle workers exit. A record into a
//! retiring engine increments `live` and then reads `retiring` (both SeqCst);
//! a worker exits only after reading `live == 0` under the pool's thread lock.
//! So either the worker sees the new node, or the record sees `retiring` and
//! starts workers again (taking the same lock, after the worker left).

use super::Shared;
use crate::sync::{lock, Ordering};
use std::time::{Duration, Instant};

impl Shared {
    /// A counted handle is made (see `Engine`'s `Clone`). The first one after
    /// the engine began retiring cancels that.
    pub(super) fn acquire_handle(&self) {
        if self.handles.fetch_add(1, Ordering::AcqRel) == 0 {
            self.revive();
        }
    }

    #[cold]
    fn revive(&self) {
        let _life = lock(&self.life);
        // A release that raced with this acquire may not have retired yet; it
        // re-checks the count under the lock and then does nothing.
        if !self.retiring.load(Ordering::SeqCst) || self.handles.load(Ordering::Acquire) == 0 {
            return;
        }
        self.retiring.store(false, Ordering::SeqCst);
        self.global_demand.fetch_sub(1, Ordering::SeqCst);
        self.pool.set_shutdown(false);
        self.start_workers();
    }

    /// A counted handle is dropped; the last one retires the engine.
    pub(super) fn release_handle(&self) {
        if self.handles.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        self.retire();
    }

    /// The last `Engine` handle is gone: demand everything recorded (and,
    /// through `global_demand`, everything recorded from now on), let the
    /// workers exit once it has run, and wait for it on a plain thread. Never
    /// blocks a worker thread of any engine.
    #[cold]
    fn retire(&self) {
        self.close_batches();
        {
            let _life = lock(&self.life);
            if self.retiring.load(Ordering::SeqCst) || self.handles.load(Ordering::Acquire) != 0 {
                return;
            }
            self.global_demand.fetch_add(1, Ordering::SeqCst);
            self.retiring.store(true, Ordering::SeqCst);
        }
        self.retire_batches();
        self.demand_all();
        self.check_drained();
        if !crate::sched::on_any_worker() {
            let _ = self.wait_all();
            // Wait (a little) for the workers to exit and join them, so that
            // they are gone when the drop returns; give up if the engine is
            // revived meanwhile or a worker is still busy.
            self.pool
                .join_exited(Instant::now() + Duration::from_secs(2), || {
                    self.retiring.load(Ordering::SeqCst)
                });
        }
    }

    /// While retiring, lets the workers exit once nothing is left to run.
    pub(super) fn check_drained(&self) {
        if self.retiring.load(Ordering::SeqCst) && self.live.load(Ordering::SeqCst) == 0 {
            self.pool.set_shutdown(true);
        }
    }

    /// Work was recorded while retiring: the workers must stay (or come back).
    #[cold]
    pub(super) fn keep_workers(&self) {
        self.pool.set_shutdown(false);
        self.start_workers();
        // The work may have finished before the shutdown was lifted.
        self.check_drained();
    }

    fn start_workers(&self) {
        if let Some(me) = self.me.upgrade() {
            self.pool.start(&me, "lazyflow-worker");
        }
    }
}
