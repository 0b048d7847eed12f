//! 5. Computation and communication: `k` products on a GPU, each copied to the
//!    CPU and summed there. Serialized: compute all, wait, then copy all, wait.
//!    Overlapped: each copy is recorded right after its product, so earlier
//!    results travel while later ones are computed.

use super::{DemoResult, Progress};
use lazyflow::{Device, Engine, Tensor};
use serde_json::{json, Value};
use std::time::Instant;

pub struct Report {
    pub device: Device,
    pub n: usize,
    /// Serialized: the compute phase, the copy phase, and both.
    pub compute_s: f64,
    pub copy_s: f64,
    pub serial_s: f64,
    /// Overlapped.
    pub overlap_s: f64,
    /// `a` and the `w_i`, and the products as they arrived on the CPU in each
    /// variant, for the tests.
    pub a: Vec<f32>,
    pub ws: Vec<Vec<f32>>,
    pub serial: Vec<Vec<f32>>,
    pub overlapped: Vec<Vec<f32>>,
}

impl Report {
    pub fn json(&self) -> Value {
        json!({
            "device": self.device.to_string(),
            "n": self.n,
            "k": self.ws.len(),
            "compute_s": self.compute_s,
            "copy_s": self.copy_s,
            "serial_s": self.serial_s,
            "overlap_s": self.overlap_s,
            "speedup": self.serial_s / self.overlap_s,
        })
    }
}

/// Runs on GPU `device` of `engine`.
pub fn run(
    engine: &Engine,
    device: Device,
    sizes: &super::Sizes,
    p: &Progress,
) -> DemoResult<Report> {
    let (n, k) = (sizes.overlap_n, sizes.overlap_k);
    p.part(format!(
        "{device}: computation and communication, {k} x {n}x{n} matmul"
    ));
    let scale = 1.0 / (n as f32).sqrt();
    let a = (Tensor::rand_uniform_in(engine, [n, n], -1.0, 1.0, 11)? * scale).to(device)?;
    let ws = (0..k)
        .map(|i| {
            Ok(
                (Tensor::rand_uniform_in(engine, [n, n], -1.0, 1.0, 12 + i as u64)? * scale)
                    .to(device)?,
            )
        })
        .collect::<DemoResult<Vec<Tensor>>>()?;
    // Warm-up: the kernel's pipeline, the pool, one readback.
    a.matmul(&ws[0])?.to(Device::Cpu)?.sum().wait_to_read()?;
    engine.wait_all()?;

    // Serialized: a barrier between computing and copying.
    let start = Instant::now();
    let ys = ws
        .iter()
        .map(|w| a.matmul(w))
        .collect::<lazyflow::Result<Vec<_>>>()?;
    engine.wait_all()?;
    let compute_s = start.elapsed().as_secs_f64();
    let copies: Vec<Tensor> = ys
        .iter()
        .map(|y| y.to(Device::Cpu))
        .collect::<lazyflow::Result<_>>()?;
    let sums: Vec<Tensor> = copies.iter().map(|c| c.sum()).collect();
    engine.wait_all()?;
    let serial_s = start.elapsed().as_secs_f64();
    let copy_s = serial_s - compute_s;
    drop((ys, sums));

    // Overlapped: the copy of each product is recorded right after it.
    let start = Instant::now();
    let mut overlapped = Vec::with_capacity(k);
    let mut sums = Vec::with_capacity(k);
    for w in &ws {
        let c = a.matmul(w)?.to(Device::Cpu)?;
        sums.push(c.sum());
        overlapped.push(c);
    }
    engine.wait_all()?;
    let overlap_s = start.elapsed().as_secs_f64();

    let r = Report {
        device,
        n,
        compute_s,
        copy_s,
        serial_s,
        overlap_s,
        a: a.to_vec()?,
        ws: ws
            .iter()
            .map(|w| w.to_vec())
            .collect::<lazyflow::Result<_>>()?,
        serial: copies
            .iter()
            .map(|c| c.to_vec())
            .collect::<lazyflow::Result<_>>()?,
        overlapped: overlapped
            .iter()
            .map(|c| c.to_vec())
            .collect::<lazyflow::Result<_>>()?,
    };
    p.println(format!(
        "{device}: compute {compute_s:.4} sec, then copy to the CPU {copy_s:.4} sec: {serial_s:.4} sec serialized, {overlap_s:.4} sec overlapped ({:.2}x)",
        serial_s / overlap_s
    ));
    Ok(r)
}
