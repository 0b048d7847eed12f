//! LeNet forward + backward on every device, and conv2d GFLOP/s at LeNet's
//! second layer, next to PyTorch's CPU build timed in the same run.
//!
//! ```text
//! cargo run --release --example lenet_bench                   # batch 256, table
//! cargo run --release --example lenet_bench -- --json l.json  # and JSON
//! cargo run --release --example lenet_bench -- --quick        # batch 32
//! ```
//!
//! PyTorch is `examples/peers/lenet_torch.py`, run with the Python that can
//! import `torch` (`LAZYFLOW_PYTHON`, else `python3`, else `/usr/bin/python3`,
//! where Debian's `python3-torch` installs it), with as many threads as the
//! engine's CPU device uses. Without it the report says `"pytorch": null`.

mod demos;

use demos::{Cli, DemoResult, Progress};
use lazyflow::nn::{self, Module};
use lazyflow::{Device, Engine, Reduction, Tensor};
use serde_json::{json, Value};
use std::process::Command;
use std::time::Instant;

/// The second convolution of LeNet: [batch, 20, 13, 13] * [50, 20, 5, 5].
fn conv2_flops(batch: usize) -> f64 {
    2.0 * (batch * 50 * 9 * 9 * 20 * 5 * 5) as f64
}

/// Seconds per forward + backward of LeNet on `device` for one batch.
fn lenet_step_s(engine: &Engine, device: Device, batch: usize, reps: usize) -> DemoResult<f64> {
    let net = nn::lenet(engine, 0)?.replica_on(device)?;
    let x = Tensor::rand_uniform_in(engine, [batch, 1, 28, 28], 0.0, 1.0, 7)?.to(device)?;
    let labels: Vec<u32> = (0..batch as u32).map(|i| (i * 7 + 3) % 10).collect();
    let params = net.parameters();
    let step = || -> DemoResult<()> {
        for p in &params {
            p.zero_grad();
        }
        let loss = net.forward(&x)?.cross_entropy(&labels, Reduction::Mean)?;
        loss.backward()?;
        // The step is done when every gradient is (one synchronisation, as the
        // PyTorch loop has after its backward).
        engine.wait_all()?;
        Ok(())
    };
    step()?; // warm-up: pipelines, buffers, the replica's transfers
    let t = Instant::now();
    for _ in 0..reps {
        step()?;
    }
    Ok(t.elapsed().as_secs_f64() / reps as f64)
}

/// GFLOP/s of conv2d at LeNet's second layer, and of the matmul it lowers to.
fn conv_gflops(
    engine: &Engine,
    device: Device,
    batch: usize,
    reps: usize,
) -> DemoResult<(f64, f64)> {
    let x = Tensor::rand_uniform_in(engine, [batch, 20, 13, 13], -1.0, 1.0, 1)?.to(device)?;
    let w = Tensor::rand_uniform_in(engine, [50, 20, 5, 5], -1.0, 1.0, 2)?.to(device)?;
    let time = |f: &dyn Fn() -> lazyflow::Result<Tensor>| -> DemoResult<f64> {
        f()?.wait_to_read()?; // warm-up
        let t = Instant::now();
        let outs = (0..reps)
            .map(|_| f())
            .collect::<lazyflow::Result<Vec<_>>>()?;
        engine.wait_all()?;
        let s = t.elapsed().as_secs_f64() / reps as f64;
        drop(outs);
        Ok(s)
    };
    let conv = time(&|| x.conv2d(&w, None, (1, 1), (0, 0)))?;
    // The same product as one GEMM: [batch * 81, 500] @ [500, 50].
    let a = Tensor::rand_uniform_in(engine, [batch * 81, 500], -1.0, 1.0, 3)?.to(device)?;
    let b = Tensor::rand_uniform_in(engine, [500, 50], -1.0, 1.0, 4)?.to(device)?;
    let mm = time(&|| a.matmul(&b))?;
    let flops = conv2_flops(batch);
    Ok((flops / conv / 1e9, flops / mm / 1e9))
}

/// PyTorch's figures, or `None` when no Python here imports torch.
fn pytorch(batch: usize, reps: usize, threads: usize) -> Option<Value> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/peers/lenet_torch.py");
    let pythons = std::env::var("LAZYFLOW_PYTHON")
        .into_iter()
        .chain(["python3".to_string(), "/usr/bin/python3".to_string()]);
    for python in pythons {
        let out = Command::new(&python)
            .args([
                script,
                &batch.to_string(),
                &reps.to_string(),
                &threads.to_string(),
            ])
            .output();
        if let Ok(out) = out {
            if out.status.success() {
                if let Ok(v) = serde_json::from_slice::<Value>(&out.stdout) {
                    return Some(v);
                }
            }
        }
    }
    None
}

fn main() -> DemoResult<()> {
    let cli = Cli::parse();
    let (batch, reps) = if cli.sizes.quick { (32, 2) } else { (256, 5) };
    let engine = Engine::builder().build()?;
    let devices = demos::measured_devices(&engine);
    let threads = engine.cpu_threads();
    let p = Progress::new(devices.len() + 1);
    let mut rows = Vec::new();
    for &device in &devices {
        p.part(format!("{device}: LeNet forward + backward, batch {batch}"));
        // lavapipe runs GPU code on the host's cores, slowly: fewer repetitions.
        let reps = if demos::on_host_cores(&engine, device) && device != Device::Cpu {
            1
        } else {
            reps
        };
        let step = lenet_step_s(&engine, device, batch, reps)?;
        let (conv, mm) = conv_gflops(&engine, device, batch, reps)?;
        let (name, backend) = demos::device_header(&engine, device);
        p.println(format!(
            "{device:<7} {:>10.1} ms/batch {:>9.0} images/s   conv2d {conv:>7.2} GFLOP/s (its GEMM alone {mm:>7.2})",
            step * 1e3,
            batch as f64 / step
        ));
        rows.push(json!({
            "device": device.to_string(),
            "name": name,
            "backend": backend,
            "batch": batch,
            "fwd_bwd_s": step,
            "images_per_s": batch as f64 / step,
            "conv2d_gflops": conv,
            "conv2d_gemm_gflops": mm,
        }));
    }
    p.part(format!("PyTorch CPU, {threads} threads"));
    let torch = pytorch(batch, reps, threads);
    p.finish();
    match &torch {
        Some(t) => println!(
            "pytorch {:>10.1} ms/batch {:>9.0} images/s   conv2d {:>7.2} GFLOP/s ({} threads, torch {})",
            t["fwd_bwd_s"].as_f64().unwrap_or(f64::NAN) * 1e3,
            t["images_per_s"].as_f64().unwrap_or(f64::NAN),
            t["conv2d_gflops"].as_f64().unwrap_or(f64::NAN),
            t["threads"],
            t["version"].as_str().unwrap_or("?"),
        ),
        None => println!("pytorch: not found (install Debian's python3-torch, or set LAZYFLOW_PYTHON)"),
    }
    cli.write_json(&json!({
        "machine": demos::machine(&engine),
        "cpu_threads": threads,
        "devices": rows,
        "pytorch": torch,
    }))
}
