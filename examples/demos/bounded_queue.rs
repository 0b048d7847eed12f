//! 6. Bounded queue: a frontend loop of 1,000,000 ops recorded without waiting,
//!    with the default backpressure bound vs the bound disabled: peak pending
//!    nodes and peak resident memory of each.

use super::{field_kb, DemoResult, Progress};
use lazyflow::{Engine, Tensor};
use serde_json::{json, Value};

pub struct Report {
    pub ops: usize,
    pub bounded_peak_nodes: usize,
    pub bounded_peak_rss_mb: f64,
    pub unbounded_peak_nodes: usize,
    pub unbounded_peak_rss_mb: f64,
    /// Resident memory before each loop, so that growth can be told from what
    /// the process held already.
    pub bounded_base_rss_mb: f64,
    pub unbounded_base_rss_mb: f64,
    /// The accumulator after the loop, per variant (every element should be `ops`).
    pub bounded_result: Vec<f32>,
    pub unbounded_result: Vec<f32>,
}

impl Report {
    pub fn json(&self) -> Value {
        json!({
            "ops": self.ops,
            "bounded_peak_nodes": self.bounded_peak_nodes,
            "bounded_peak_rss_mb": self.bounded_peak_rss_mb,
            "unbounded_peak_nodes": self.unbounded_peak_nodes,
            "unbounded_peak_rss_mb": self.unbounded_peak_rss_mb,
            "bounded_base_rss_mb": self.bounded_base_rss_mb,
            "unbounded_base_rss_mb": self.unbounded_base_rss_mb,
        })
    }
}

/// Runs on the CPU device of two engines of its own. Peak RSS is the process's
/// (Linux `VmHWM`, reset before each variant); elsewhere it reads 0.
pub fn run(sizes: &super::Sizes, p: &Progress) -> DemoResult<Report> {
    let ops = sizes.backpressure_ops;
    let run = |engine: Engine| -> DemoResult<(usize, f64, f64, Vec<f32>)> {
        reset_peak_rss();
        let base = peak_rss_mb();
        let x = Tensor::ones_in(&engine, [16]);
        let mut acc = Tensor::zeros_in(&engine, [16]);
        for _ in 0..ops {
            acc = &acc + &x;
        }
        let result = acc.to_vec()?;
        Ok((engine.stats().peak_live_nodes, base, peak_rss_mb(), result))
    };
    p.part(format!("bounded queue: {ops} ops, default bound"));
    let (bounded_peak_nodes, bounded_base_rss_mb, bounded_peak_rss_mb, bounded_result) =
        run(Engine::builder().build()?)?;
    p.println(format!(
        "{ops} ops, default bound: peak {bounded_peak_nodes} pending nodes, peak RSS {bounded_peak_rss_mb:.0} MB (from {bounded_base_rss_mb:.0} MB)"
    ));
    p.part(format!("bounded queue: {ops} ops, no bound"));
    let (unbounded_peak_nodes, unbounded_base_rss_mb, unbounded_peak_rss_mb, unbounded_result) =
        run(Engine::builder().unbounded().build()?)?;
    p.println(format!(
        "{ops} ops, no bound:      peak {unbounded_peak_nodes} pending nodes, peak RSS {unbounded_peak_rss_mb:.0} MB (from {unbounded_base_rss_mb:.0} MB)"
    ));
    for (what, r) in [
        ("bounded", &bounded_result),
        ("unbounded", &unbounded_result),
    ] {
        if r.iter().any(|v| *v != ops as f32) {
            return Err(format!("bounded queue, {what}: got {r:?}, expected {ops}").into());
        }
    }
    Ok(Report {
        ops,
        bounded_peak_nodes,
        bounded_peak_rss_mb,
        unbounded_peak_nodes,
        unbounded_peak_rss_mb,
        bounded_base_rss_mb,
        unbounded_base_rss_mb,
        bounded_result,
        unbounded_result,
    })
}

/// Resets the kernel's resident-set high-water mark (Linux; elsewhere a no-op).
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Peak resident set size in MB since the last reset (Linux; 0 elsewhere).
fn peak_rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| field_kb(&s, "VmHWM:"))
        .map_or(0.0, |kb| kb / 1024.0)
}
