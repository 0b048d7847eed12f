//! 3. Blockers: `wait_to_read` on one value returns while unrelated work is still
//!    pending; `to_vec`, `item` and printing block until their value is there.
//!    The counts come from the engine's statistics.

use super::{reference, DemoResult, Progress};
use lazyflow::{Device, Engine, Tensor};
use serde_json::{json, Value};
use std::time::Instant;

pub struct Report {
    /// `z.wait_to_read()` with the unrelated work recorded before it.
    pub wait_to_read_s: f64,
    /// Unrelated nodes still unfinished when it returned.
    pub pending_after_wait_to_read: usize,
    /// The `wait_all` that then ran the unrelated work.
    pub wait_all_s: f64,
    /// Blocker counts over the demonstration (engine statistics).
    pub explicit_blockers: u64,
    pub implicit_blockers: u64,
    /// What `to_vec`, `item` and printing returned.
    pub z: Vec<f32>,
    pub z_sum: f32,
    pub printed: String,
    /// The unrelated work: `tanh(a @ a)`, then `steps` times `y = tanh(y @ a)`;
    /// its input and result, for the tests.
    pub n: usize,
    pub steps: usize,
    pub a: Vec<f32>,
    pub unrelated: Vec<f32>,
}

impl Report {
    pub fn json(&self) -> Value {
        json!({
            "wait_to_read_s": self.wait_to_read_s,
            "pending_after_wait_to_read": self.pending_after_wait_to_read,
            "wait_all_s": self.wait_all_s,
            "explicit_blockers": self.explicit_blockers,
            "implicit_blockers": self.implicit_blockers,
        })
    }
}

/// Runs on `device` of `engine`, which must be in Lazy mode: unrelated work then
/// waits, deterministically, until something demands it.
pub fn run(
    engine: &Engine,
    device: Device,
    sizes: &super::Sizes,
    p: &Progress,
) -> DemoResult<Report> {
    let (n, steps) = (sizes.blockers_n, 8);
    p.part(format!("{device}: blockers"));
    if engine.mode() != lazyflow::Mode::Lazy {
        return Err("the blockers demonstration needs an engine in Lazy mode".into());
    }
    let x = Tensor::ones_in(engine, [4]).to(device)?;
    let a = Tensor::rand_uniform_in(engine, [n, n], -1.0, 1.0, 5)?.to(device)?;
    let scaled = &a * (1.0 / (n as f32).sqrt());
    engine.wait_all()?;
    let before = engine.stats();

    // Unrelated work first, then the value we want.
    let mut y = scaled.matmul(&scaled)?.tanh();
    for _ in 0..steps {
        y = y.matmul(&scaled)?.tanh();
    }
    let z = &x + 1.0;
    let start = Instant::now();
    z.wait_to_read()?;
    let wait_to_read_s = start.elapsed().as_secs_f64();
    let pending = engine.stats().live_nodes;
    p.println(format!(
        "{device}: z.wait_to_read() returned after {wait_to_read_s:.6} sec with {pending} unrelated nodes still pending"
    ));

    // Implicit blockers: each needs the value itself.
    let z_host = z.to_vec()?;
    let z_sum = z.sum().item()?;
    let printed = format!("{z}");
    p.println(format!(
        "{device}: z.to_vec() = {z_host:?}, z.sum().item() = {z_sum}, print: {printed}"
    ));

    let start = Instant::now();
    engine.wait_all()?;
    let wait_all_s = start.elapsed().as_secs_f64();
    let after = engine.stats();
    let r = Report {
        wait_to_read_s,
        pending_after_wait_to_read: pending,
        wait_all_s,
        explicit_blockers: after.blockers - before.blockers,
        implicit_blockers: after.implicit_blockers - before.implicit_blockers,
        z: z_host,
        z_sum,
        printed,
        n,
        steps,
        a: scaled.to_vec()?,
        unrelated: y.to_vec()?,
    };
    p.println(format!(
        "{device}: then wait_all ran them in {wait_all_s:.4} sec; blockers counted: {} explicit, {} implicit (to_vec, item, print)",
        r.explicit_blockers, r.implicit_blockers
    ));
    if after.live_nodes != 0 {
        return Err(format!("{device}: {} nodes left after wait_all", after.live_nodes).into());
    }
    Ok(r)
}

/// The unrelated work of [`run`] computed by the naive reference.
pub fn reference_unrelated(r: &Report) -> Vec<f32> {
    let first: Vec<f32> = reference::matmul(&r.a, &r.a, r.n, r.n, r.n)
        .into_iter()
        .map(f32::tanh)
        .collect();
    reference::tanh_chain(&first, &r.a, r.n, r.steps)
}
