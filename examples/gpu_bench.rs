//! GPU figures on every adapter found: per-op cost of tiny ops, matmul GFLOP/s,
//! and two logical devices in parallel, each with the kernels actually dispatched.
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

use lazyflow::{Device, Engine, Mode, Tensor};
use serde_json::json;
use std::time::Instant;

fn main() -> lazyflow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let json_path = args
        .iter()
        .position(|a| a == "--json")
        .and_then(|i| args.get(i + 1).cloned());
    let ops = if quick { 200 } else { 10_000 };
    let sizes: &[usize] = if quick {
        &[64, 128]
    } else {
        &[256, 1024, 4096]
    };

    let engine = Engine::builder()
        .mode(Mode::Lazy)
        .logical_devices(2)
        .build()?;
    let gpus: Vec<Device> = engine
        .devices()
        .into_iter()
        .filter(|d| *d != Device::Cpu)
        .collect();
    if gpus.is_empty() {
        println!("no GPU adapter found; nothing to measure");
        return Ok(());
    }
    // The first logical device of each adapter.
    let adapters: Vec<Device> = gpus
        .iter()
        .copied()
        .filter(|d| engine.gpu_info(*d).is_some_and(|i| i.logical == 0))
        .collect();
    let mut reports = Vec::new();
    for &gpu in &adapters {
        println!("== {gpu}: {} ==", engine.describe(gpu));
        let kernels = || engine.kernels_dispatched(gpu);
        let x = Tensor::ones_in(&engine, [1, 2]).to(gpu)?;
        x.wait_to_read()?;

        let timed = |name: &str,
                     f: &mut dyn FnMut() -> lazyflow::Result<()>|
         -> lazyflow::Result<(f64, u64)> {
            f()?; // warm-up (pipelines, pool)
            engine.wait_all()?;
            let k0 = kernels();
            let t = Instant::now();
            f()?;
            engine.wait_all()?;
            let s = t.elapsed().as_secs_f64();
            let k = kernels() - k0;
            println!(
                "{name:<46} {:>9.2} us/op {k:>7} kernels",
                s / ops as f64 * 1e6
            );
            Ok((s, k))
        };
        let sync = timed("y = x + 1, wait_to_read after each", &mut || {
            for _ in 0..ops {
                (&x + 1.0).wait_to_read()?;
            }
            Ok(())
        })?;
        let lazy = timed("y = x + 1, one wait_all", &mut || {
            for _ in 0..ops {
                let _y = &x + 1.0;
            }
            Ok(())
        })?;
        let kept = timed("y = x + 1 kept alive, one wait_all", &mut || {
            let ys: Vec<Tensor> = (0..ops).map(|_| &x + 1.0).collect();
            engine.wait_all()?;
            drop(ys);
            Ok(())
        })?;
        let chain = timed("x = x + 1 chain, one read", &mut || {
            let mut y = x.clone();
            for _ in 0..ops {
                y = &y + 1.0;
            }
            y.wait_to_read()
        })?;

        let mut matmuls = Vec::new();
        for &n in sizes {
            let a = Tensor::rand_uniform_in(&engine, [n, n], -1.0, 1.0, 1)?.to(gpu)?;
            a.matmul(&a)?.wait_to_read()?;
            let reps = match n {
                4096.. => 1,
                1024.. => 3,
                _ => 10,
            };
            let t = Instant::now();
            let mut last = None;
            for _ in 0..reps {
                last = Some(a.matmul(&a)?);
            }
            let recorded = t.elapsed().as_secs_f64();
            if let Some(l) = last {
                l.wait_to_read()?;
            }
            engine.wait_all()?;
            let s = t.elapsed().as_secs_f64();
            let gflops = 2.0 * (n as f64).powi(3) * reps as f64 / s / 1e9;
            println!(
                "matmul {n}x{n}: {gflops:>8.2} GFLOP/s (recording {reps} took {:.3} ms)",
                recorded * 1e3
            );
            matmuls.push(json!({"n": n, "gflops": gflops, "record_ms": recorded * 1e3}));
        }

        let per =
            |(s, k): (f64, u64)| json!({"s": s, "us_per_op": s / ops as f64 * 1e6, "kernels": k});
        reports.push(json!({
            "device": gpu.to_string(),
            "name": engine.gpu_info(gpu).map(|i| i.name),
            "backend": engine.gpu_info(gpu).map(|i| i.backend),
            "ops": ops,
            "increment_sync": per(sync),
            "increment_async": per(lazy),
            "increment_kept": per(kept),
            "chain": per(chain),
            "matmul": matmuls,
        }));
    }

    // Two logical devices on the first adapter: the same independent work alone,
    // together, and with a barrier between them.
    let mut parallel = serde_json::Value::Null;
    if gpus.len() >= 2 && engine.gpu_info(gpus[1]).is_some_and(|i| i.logical == 1) {
        let (g0, g1) = (gpus[0], gpus[1]);
        let n = if quick { 128 } else { 512 };
        let a0 = Tensor::rand_uniform_in(&engine, [n, n], -1.0, 1.0, 2)?.to(g0)?;
        let a1 = Tensor::rand_uniform_in(&engine, [n, n], -1.0, 1.0, 3)?.to(g1)?;
        let work = |a: &Tensor| -> lazyflow::Result<Tensor> {
            let mut y = a.clone();
            for _ in 0..4 {
                y = y.matmul(a)?.tanh();
            }
            Ok(y)
        };
        work(&a0)?.wait_to_read()?;
        work(&a1)?.wait_to_read()?;
        let time = |f: &dyn Fn() -> lazyflow::Result<()>| -> lazyflow::Result<f64> {
            let t = Instant::now();
            f()?;
            engine.wait_all()?;
            Ok(t.elapsed().as_secs_f64())
        };
        let dev0 = time(&|| work(&a0)?.wait_to_read())?;
        let dev1 = time(&|| work(&a1)?.wait_to_read())?;
        let both = time(&|| {
            let (y0, y1) = (work(&a0)?, work(&a1)?);
            y0.wait_to_read()?;
            y1.wait_to_read()
        })?;
        let barrier = time(&|| {
            work(&a0)?.wait_to_read()?;
            work(&a1)?.wait_to_read()
        })?;
        println!(
            "two logical devices: {dev0:.4} s + {dev1:.4} s alone, {both:.4} s together, {barrier:.4} s with a barrier (speedup {:.2}x; both share the adapter's cores)",
            barrier / both
        );
        parallel = json!({"devices": [g0.to_string(), g1.to_string()], "dev0_s": dev0, "dev1_s": dev1, "both_s": both, "barrier_s": barrier, "speedup": barrier / both});
    }

    if let Some(path) = json_path {
        let fusion = std::env::var("LAZYFLOW_FUSION").map_or(true, |v| v != "0");
        let report = json!({"gpus": reports, "parallel": parallel, "fusion": fusion});
        std::fs::write(&path, serde_json::to_string_pretty(&report).unwrap())
            .unwrap_or_else(|e| panic!("writing {path}: {e}"));
        println!("wrote {path}");
    }
    Ok(())
}
