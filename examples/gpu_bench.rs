//! GPU figures beyond the tour, on every adapter found: the per-op loops of the
//! tour (`demos::sync_async`) with the kernels each ran, and matmul GFLOP/s at
//! several sizes.
//!
//! ```text
//! cargo run --release --example gpu_bench                  # table
//! cargo run --release --example gpu_bench -- --json g.json # and JSON
//! cargo run --release --example gpu_bench -- --quick       # small sizes
//! LAZYFLOW_FUSION=0 cargo run --release --example gpu_bench # fusion off
//! ```
//!
//! With fusion on (the default) elementwise ops join generated kernels, and the
//! kernel counts show how many ran; results nobody can read are not computed.

mod demos;

use demos::{Cli, DemoResult, Progress};
use lazyflow::{Device, Engine, Mode, Tensor};
use serde_json::json;
use std::time::Instant;

fn main() -> DemoResult<()> {
    let cli = Cli::parse();
    let sizes: &[usize] = if cli.sizes.quick {
        &[64, 128]
    } else {
        &[256, 1024, 4096]
    };
    let engine = Engine::builder().mode(Mode::Lazy).build()?;
    let gpus: Vec<Device> = demos::measured_devices(&engine)
        .into_iter()
        .filter(|d| *d != Device::Cpu)
        .collect();
    if gpus.is_empty() {
        println!("no GPU adapter found; nothing to measure");
        return Ok(());
    }
    let p = Progress::new(gpus.len() * (3 + sizes.len()));
    let mut reports = Vec::new();
    for &gpu in &gpus {
        p.println(format!("== {gpu}: {} ==", engine.describe(gpu)));
        let loops = demos::sync_async::run(&engine, gpu, &cli.sizes, &p)?;
        let mut matmuls = Vec::new();
        for &n in sizes {
            p.part(format!("{gpu}: matmul {n}x{n}"));
            let a = Tensor::rand_uniform_in(&engine, [n, n], -1.0, 1.0, 1)?.to(gpu)?;
            a.matmul(&a)?.wait_to_read()?; // warm-up
            let reps = match n {
                4096.. => 1,
                1024.. => 3,
                _ => 10,
            };
            let t = Instant::now();
            let ys = (0..reps)
                .map(|_| a.matmul(&a))
                .collect::<lazyflow::Result<Vec<_>>>()?;
            let recorded = t.elapsed().as_secs_f64();
            engine.wait_all()?;
            let s = t.elapsed().as_secs_f64();
            drop(ys);
            let gflops = 2.0 * (n as f64).powi(3) * reps as f64 / s / 1e9;
            p.println(format!(
                "{gpu}: matmul {n}x{n}: {gflops:>8.2} GFLOP/s (recording {reps} took {:.3} ms)",
                recorded * 1e3
            ));
            matmuls.push(json!({"n": n, "gflops": gflops, "record_ms": recorded * 1e3}));
        }
        let info = engine.gpu_info(gpu);
        reports.push(json!({
            "device": gpu.to_string(),
            "name": info.as_ref().map(|i| i.name.clone()),
            "backend": info.as_ref().map(|i| i.backend.clone()),
            "ops": loops.ops,
            "increment": loops.increment.json(),
            "increment_kept": loops.kept.json(),
            "chain": loops.chain.json(),
            "matmul": matmuls,
        }));
    }
    p.finish();
    let fusion = std::env::var("LAZYFLOW_FUSION").map_or(true, |v| v != "0");
    cli.write_json(&json!({"machine": demos::machine(&engine), "gpus": reports, "fusion": fusion}))
}
