//! 1. Asynchronous benchmark: ten n x n matmuls. The time until the frontend
//!    regains control says nothing about the work; the time with the blocker
//!    does. Next to it, the GEMM crate (faer) called directly on the CPU.

use super::{reference, DemoResult, Progress};
use lazyflow::{Benchmark, Device, Engine, Tensor};
use serde_json::{json, Value};
use std::time::Instant;

pub struct Report {
    pub n: usize,
    pub reps: usize,
    /// Recording `reps` products, without waiting.
    pub dispatch_s: f64,
    /// Recording them and waiting for them (`Benchmark` stops at `wait_all`).
    pub synced_s: f64,
    /// faer called directly on the same data, on the CPU.
    pub cpu_gemm_s: f64,
    /// The input `x` and the last `x @ x` the engine computed, on the host.
    pub input: Vec<f32>,
    pub output: Vec<f32>,
    /// Relative difference between `output` and faer's product.
    pub err_vs_gemm: f32,
}

impl Report {
    pub fn gflops(&self, secs: f64) -> f64 {
        2.0 * (self.n as f64).powi(3) * self.reps as f64 / secs / 1e9
    }

    pub fn json(&self) -> Value {
        json!({
            "n": self.n,
            "reps": self.reps,
            "dispatch_s": self.dispatch_s,
            "synced_s": self.synced_s,
            "cpu_gemm_s": self.cpu_gemm_s,
            "gflops": self.gflops(self.synced_s),
            "cpu_gemm_gflops": self.gflops(self.cpu_gemm_s),
        })
    }
}

/// Runs on `device` of `engine`, which should be in Async mode (like MXNet: each
/// product starts as soon as it is recorded).
pub fn run(
    engine: &Engine,
    device: Device,
    sizes: &super::Sizes,
    p: &Progress,
) -> DemoResult<Report> {
    let (n, reps) = (sizes.matmul, sizes.matmul_reps);
    p.part(format!(
        "{device}: asynchronous benchmark, {reps} x {n}x{n} matmul"
    ));
    let x = Tensor::rand_uniform_in(engine, [n, n], -1.0, 1.0, 0)?.to(device)?;
    x.matmul(&x)?.wait_to_read()?; // warm-up: pipelines, buffer pool

    // Only the recording: the frontend is back long before the work is done.
    let start = Instant::now();
    let mut ys = Vec::with_capacity(reps);
    for _ in 0..reps {
        ys.push(x.matmul(&x)?);
    }
    let dispatch_s = start.elapsed().as_secs_f64();
    engine.wait_all()?;
    drop(ys);

    // With the blocker inside the timed region: the real cost.
    let timer = Benchmark::new(engine, "").quiet();
    let mut last = None;
    for _ in 0..reps {
        last = Some(x.matmul(&x)?);
    }
    let synced_s = timer.stop();
    let output = last.expect("reps > 0").to_vec()?;
    let input = x.to_vec()?;

    // The GEMM crate called directly, on the same data.
    let a = faer::Mat::<f32>::from_fn(n, n, |i, j| input[i * n + j]);
    let mut c = faer::Mat::<f32>::zeros(n, n);
    let gemm = |c: &mut faer::Mat<f32>| {
        faer::linalg::matmul::matmul(
            c.as_mut(),
            faer::Accum::Replace,
            a.as_ref(),
            a.as_ref(),
            1.0,
            faer::Par::rayon(0),
        )
    };
    gemm(&mut c);
    let start = Instant::now();
    for _ in 0..reps {
        gemm(&mut c);
    }
    let cpu_gemm_s = start.elapsed().as_secs_f64();
    let gemm_out: Vec<f32> = (0..n * n).map(|k| c[(k / n, k % n)]).collect();
    let err_vs_gemm = reference::check_close(
        &format!("{device}: matmul against faer"),
        &output,
        &gemm_out,
        1e-4,
    )?;

    let r = Report {
        n,
        reps,
        dispatch_s,
        synced_s,
        cpu_gemm_s,
        input,
        output,
        err_vs_gemm,
    };
    p.println(format!(
        "{device}: {reps} x {n}x{n} matmul, without waiting: {dispatch_s:.4} sec"
    ));
    p.println(format!(
        "{device}: {reps} x {n}x{n} matmul, with wait_all: {synced_s:.4} sec ({:.1} GFLOP/s)",
        r.gflops(synced_s)
    ));
    p.println(format!(
        "{device}: faer called directly: {cpu_gemm_s:.4} sec ({:.1} GFLOP/s); results agree to {err_vs_gemm:.1e}",
        r.gflops(cpu_gemm_s)
    ));
    Ok(r)
}

/// numpy's matmul GFLOP/s on `reps` products of `n x n` random f32 matrices, in a
/// python3 subprocess: a peer measured in the same run. `None` without python3
/// and numpy.
pub fn numpy_gflops(n: usize, reps: usize) -> Option<f64> {
    let script = format!(
        "import numpy as np, time\n\
         a = np.random.rand({n}, {n}).astype(np.float32)\n\
         a @ a\n\
         t = time.perf_counter()\n\
         for _ in range({reps}): a @ a\n\
         print(2 * {n}**3 * {reps} / (time.perf_counter() - t) / 1e9)\n"
    );
    let out = std::process::Command::new("python3")
        .args(["-c", &script])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}
