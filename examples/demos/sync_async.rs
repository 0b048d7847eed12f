//! 2. Sync vs async: 10,000 times `y = x + 1`, with `wait_to_read` after each op
//!    vs one `wait_all` after the loop (the book: 3.16 s vs 0.93 s on MXNet);
//!    the same with every `y` kept alive; and the dependent chain `x = x + 1`,
//!    where nothing can be skipped. Each variant counts the kernels it ran, so
//!    that work skipped or fused is visible.

use super::{kernels, DemoResult, Progress};
use lazyflow::{Benchmark, Device, Engine, Tensor};
use serde_json::{json, Value};

/// One loop, both ways.
pub struct Loop {
    pub sync_s: f64,
    pub async_s: f64,
    pub sync_kernels: u64,
    pub async_kernels: u64,
}

impl Loop {
    pub fn ratio(&self) -> f64 {
        self.sync_s / self.async_s
    }

    pub fn json(&self) -> Value {
        json!({
            "sync_s": self.sync_s,
            "async_s": self.async_s,
            "ratio": self.ratio(),
            "sync_kernels": self.sync_kernels,
            "async_kernels": self.async_kernels,
        })
    }
}

pub struct Report {
    pub ops: usize,
    /// `y = x + 1`, `y` dropped.
    pub increment: Loop,
    /// `y = x + 1`, every `y` pushed into a Vec.
    pub kept: Loop,
    /// `x = x + 1`.
    pub chain: Loop,
}

/// Runs the three loops on `device`. The values each computes are checked
/// (`y` is 2, the chain ends at `ops`); a wrong one is an `Err`.
pub fn run(
    engine: &Engine,
    device: Device,
    sizes: &super::Sizes,
    p: &Progress,
) -> DemoResult<Report> {
    let ops = sizes.loop_ops;
    // Each body returns the values it computed that the loop's caller can still
    // read; they are checked after the clock stops.
    let measure = |name: &str,
                   want: f32,
                   body: &dyn Fn(bool) -> DemoResult<Vec<Tensor>>|
     -> DemoResult<Loop> {
        p.part(format!("{device}: {name}, {ops} ops"));
        // Warm-up. Its values are held until the barrier, as the measured
        // run's are: which values a fused kernel writes depends on what the
        // program still holds, so dropping them first would warm up another
        // kernel and leave the measured run to compile its own.
        let warm = body(false)?;
        engine.wait_all()?;
        drop(warm);
        let k0 = kernels(engine, device);
        let timer = Benchmark::new(engine, "").quiet();
        let synced = body(true)?;
        let sync_s = timer.stop();
        let k1 = kernels(engine, device);
        let timer = Benchmark::new(engine, "").quiet();
        let lazy = body(false)?;
        let async_s = timer.stop();
        let k2 = kernels(engine, device);
        for y in synced.iter().chain(&lazy) {
            let got = y.to_vec()?;
            if got.iter().any(|v| *v != want) {
                return Err(format!("{device}: {name}: got {got:?}, expected {want}").into());
            }
        }
        let l = Loop {
            sync_s,
            async_s,
            sync_kernels: k1 - k0,
            async_kernels: k2 - k1,
        };
        p.println(format!(
            "{device}: {name}: wait_to_read after each {sync_s:.4} sec ({} kernels), one wait_all {async_s:.4} sec ({} kernels): {:.1}x",
            l.sync_kernels,
            l.async_kernels,
            l.ratio()
        ));
        Ok(l)
    };

    let x = Tensor::ones_in(engine, [1, 2]).to(device)?;
    let increment = measure("y = x + 1", 2.0, &|sync| {
        let mut y = None;
        for _ in 0..ops {
            let v = &x + 1.0;
            if sync {
                v.wait_to_read()?;
            }
            y = Some(v);
        }
        // Only the last `y` outlives the loop.
        Ok(y.into_iter().collect())
    })?;
    let kept = measure("y = x + 1, every y kept", 2.0, &|sync| {
        let mut ys = Vec::with_capacity(ops);
        for _ in 0..ops {
            let y = &x + 1.0;
            if sync {
                y.wait_to_read()?;
            }
            ys.push(y);
        }
        engine.wait_all()?;
        // All were computed; reading back three of them is enough of a check.
        Ok([0, ops / 2, ops - 1].map(|i| ys[i].clone()).to_vec())
    })?;
    let chain = measure("x = x + 1 (dependent chain)", ops as f32, &|sync| {
        let mut x = Tensor::zeros_in(engine, [1, 2]).to(device)?;
        for _ in 0..ops {
            x = &x + 1.0;
            if sync {
                x.wait_to_read()?;
            }
        }
        Ok(vec![x])
    })?;
    Ok(Report {
        ops,
        increment,
        kept,
        chain,
    })
}
