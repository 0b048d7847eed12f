//! A timing guard for demonstrations, like the book's `d2l.Benchmark`.

use crate::engine::Engine;
use std::time::{Duration, Instant};

/// Times a region of frontend code *including* the work it recorded: stopping the
/// clock first waits for every recorded node ([`Engine::wait_all`]), because a
/// timer that does not synchronize only measures how fast work was queued.
///
/// Prints `name: X.XXXX sec` when stopped or dropped.
///
/// ```
/// use lazyflow::{Benchmark, Engine, Tensor};
/// let engine = Engine::builder().workers(1).build().unwrap();
/// let x = Tensor::ones_in(&engine, [16]);
/// let timer = Benchmark::new(&engine, "sum of ones");
/// let total = x.sum();
/// let secs = timer.stop();
/// assert!(secs >= 0.0);
/// assert_eq!(total.item().unwrap(), 16.0);
/// ```
pub struct Benchmark<'e> {
    engine: &'e Engine,
    name: String,
    start: Instant,
    quiet: bool,
    stopped: bool,
}

impl<'e> Benchmark<'e> {
    /// Starts the clock.
    pub fn new(engine: &'e Engine, name: impl Into<String>) -> Self {
        Benchmark {
            engine,
            name: name.into(),
            start: Instant::now(),
            quiet: false,
            stopped: false,
        }
    }

    /// Does not print when stopped.
    pub fn quiet(mut self) -> Self {
        self.quiet = true;
        self
    }

    /// Waits for all recorded work, stops the clock, prints and returns the elapsed
    /// seconds.
    pub fn stop(mut self) -> f64 {
        self.finish().as_secs_f64()
    }

    fn finish(&mut self) -> Duration {
        self.stopped = true;
        // A failure inside the timed work is reported by the blockers on its
        // values; the timing itself is still meaningful.
        let _ = self.engine.wait_all();
        let elapsed = self.start.elapsed();
        if !self.quiet {
            println!("{}: {:.4} sec", self.name, elapsed.as_secs_f64());
        }
        elapsed
    }
}

impl Drop for Benchmark<'_> {
    fn drop(&mut self) {
        if !self.stopped {
            self.finish();
        }
    }
}
