//! GPU figures beyond the tour, on every adapter found: the per-op loops of the
//! tour (`demos::sync_async`) with the kernels each ran, matmul GFLOP/s at
//! several sizes, and random elementwise programs in Lazy and Async mode (a
//! first pass, which compiles the fused kernels, and the same programs again).
//!
//! ```text
//! cargo run --release --example gpu_bench                  # table
//! cargo run --release --example gpu_bench -- --json g.json # and JSON
//! cargo run --release --example gpu_bench -- --quick       # small sizes
//! cargo run --release --example gpu_bench -- --peer burn.json  # beside a peer
//! LAZYFLOW_FUSION=0 cargo run --release --example gpu_bench # fusion off
//! ```
//!
//! `--peer` takes the JSON of `../shared/peers/burn` (same loops and sizes, run
//! right before or after this on the same adapter) and prints its figures in a
//! column beside this run's, with the ratio.
//!
//! With fusion on (the default) elementwise ops join generated kernels, and the
//! kernel counts show how many ran; results nobody can read are not computed.

mod demos;

use demos::{Cli, DemoResult, Progress};
use lazyflow::{Device, Engine, Mode, Tensor, TuneSource};
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde_json::{json, Value};
use std::time::Instant;

fn main() -> DemoResult<()> {
    let cli = Cli::parse_with_peer();
    let peer = match &cli.peer {
        Some(path) => Some(read_peer(path)?),
        None => None,
    };
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
    let p = Progress::new(gpus.len() * (5 + sizes.len()));
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
            // The variant the warm-up chose, and what each took on the trial.
            let class = lazyflow::matmul_class(n, n, n);
            let tuned = engine
                .tuned_kernels(gpu)
                .into_iter()
                .find(|t| t.kernel == "matmul" && t.class == class);
            let (kernel, trials) = match &tuned {
                Some(t) => match &t.source {
                    TuneSource::Measured(times) => (
                        t.variant.clone(),
                        times
                            .iter()
                            .map(|(v, d)| (v.clone(), d.as_secs_f64() * 1e3))
                            .collect(),
                    ),
                    _ => (format!("{} (from the cache file)", t.variant), Vec::new()),
                },
                None => ("default or pinned (not tuned)".to_string(), Vec::new()),
            };
            p.println(format!(
                "{gpu}: matmul {n}x{n}: {gflops:>8.2} GFLOP/s with {kernel} (recording {reps} took {:.3} ms)",
                recorded * 1e3
            ));
            if !trials.is_empty() {
                let list: Vec<String> = trials
                    .iter()
                    .map(|(v, ms)| format!("{v} {ms:.2}"))
                    .collect();
                p.println(format!("    trials (ms): {}", list.join(", ")));
            }
            matmuls.push(json!({
                "n": n, "gflops": gflops, "record_ms": recorded * 1e3,
                "kernel": kernel, "trials_ms": trials.into_iter().map(|(v, ms)| (v, json!(ms))).collect::<serde_json::Map<String, Value>>(),
            }));
        }
        let programs = random_programs(gpu, cli.sizes.quick, &p)?;
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
            "random_programs": programs,
        }));
    }
    p.finish();
    if let Some(peer) = &peer {
        for report in &reports {
            print_beside(report, peer);
        }
    }
    let fusion = std::env::var("LAZYFLOW_FUSION").map_or(true, |v| v != "0");
    cli.write_json(&json!({"machine": demos::machine(&engine), "gpus": reports, "fusion": fusion}))
}

/// A peer's results (`--peer`): its JSON, checked for the fields compared.
fn read_peer(path: &str) -> DemoResult<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading {path}: {e}"))?;
    let peer: Value = serde_json::from_str(&text).map_err(|e| format!("{path}: {e}"))?;
    if peer["gpus"][0]["chain"]["async_s"].as_f64().is_none() {
        return Err(format!(
            "{path}: no gpus[0].chain.async_s: not the JSON of a gpu_bench peer (see ../shared/peers/burn)"
        )
        .into());
    }
    Ok(peer)
}

/// Prints one device's figures beside the peer's, with lazyflow / peer ratios
/// (above 1: lazyflow takes longer, or computes faster for GFLOP/s).
fn print_beside(report: &Value, peer: &Value) {
    let name = peer["framework"].as_str().unwrap_or("peer");
    let theirs = &peer["gpus"][0];
    let ops = report["ops"].as_f64().unwrap_or(1.0);
    let peer_ops = theirs["ops"].as_f64().unwrap_or(1.0);
    println!(
        "\n{} ({}) beside {name} ({}), lazyflow / {name}:",
        report["device"].as_str().unwrap_or("?"),
        report["name"].as_str().unwrap_or("?"),
        theirs["name"].as_str().unwrap_or("?"),
    );
    println!("| | lazyflow | {name} | ratio |\n|---|---|---|---|");
    let row = |what: &str, ours: Option<f64>, peers: Option<f64>, unit: &str| {
        let fmt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2} {unit}"));
        let ratio = match (ours, peers) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
            _ => "-".to_string(),
        };
        println!("| {what} | {} | {} | {ratio} |", fmt(ours), fmt(peers));
    };
    for (key, what) in [
        ("increment", "`y = x + 1`, one sync at the end"),
        ("increment_kept", "same, every `y` kept"),
        ("chain", "chain `x = x + 1`"),
    ] {
        let per_op = |v: &Value, n: f64| v["async_s"].as_f64().map(|s| s / n * 1e6);
        row(
            what,
            per_op(&report[key], ops),
            per_op(&theirs[key], peer_ops),
            "µs/op",
        );
        let kernels = |v: &Value| v["async_kernels"].as_f64();
        row(
            "  kernels",
            kernels(&report[key]),
            kernels(&theirs[key]),
            "",
        );
    }
    let sync = |v: &Value, n: f64| v["increment"]["sync_s"].as_f64().map(|s| s / n * 1e6);
    row(
        "`y = x + 1`, sync after each",
        sync(report, ops),
        sync(theirs, peer_ops),
        "µs/op",
    );
    let empty = Vec::new();
    for m in report["matmul"].as_array().unwrap_or(&empty) {
        let n = m["n"].as_u64().unwrap_or(0);
        let peers = theirs["matmul"]
            .as_array()
            .unwrap_or(&empty)
            .iter()
            .find(|p| p["n"].as_u64() == Some(n))
            .and_then(|p| p["gflops"].as_f64());
        row(
            &format!("matmul {n}²"),
            m["gflops"].as_f64(),
            peers,
            "GFLOP/s",
        );
    }
}

/// Random elementwise programs on `gpu`: 8 tensors, each op reading one or
/// two of them (or a scalar) and overwriting one, and every 50 ops one tensor
/// read back. The same programs run in a Lazy and an Async engine, twice each:
/// the first pass compiles the fused kernels, the second should find them
/// compiled. Both modes must compute the same values.
fn random_programs(gpu: Device, quick: bool, p: &Progress) -> DemoResult<Value> {
    let (programs, ops, len) = if quick {
        (2, 100, 256)
    } else {
        (10, 400, 4096)
    };
    let plans: Vec<Vec<(u8, usize, usize, usize)>> = (0..programs)
        .map(|seed| {
            let mut rng = StdRng::seed_from_u64(seed as u64);
            (0..ops)
                .map(|_| {
                    (
                        rng.random_range(0..7u8),
                        rng.random_range(0..8),
                        rng.random_range(0..8),
                        rng.random_range(0..8),
                    )
                })
                .collect()
        })
        .collect();
    let run = |e: &Engine| -> DemoResult<(f64, u64, Vec<Vec<f32>>)> {
        let k0 = e.kernels_dispatched(gpu);
        let mut reads = Vec::new();
        let start = Instant::now();
        for plan in &plans {
            let mut v: Vec<Tensor> = (0..8)
                .map(|i| Tensor::rand_uniform_in(e, [len], -1.0, 1.0, i as u64)?.to(gpu))
                .collect::<lazyflow::Result<_>>()?;
            for (i, &(op, out, a, b)) in plan.iter().enumerate() {
                let (x, y) = (&v[a], &v[b]);
                v[out] = match op {
                    0 => x.add(y)?,
                    1 => x.sub(y)?,
                    2 => x.mul(y)?.tanh(),
                    3 => x.maximum(y)?,
                    4 => x * 0.5,
                    5 => x + 0.25,
                    _ => x.tanh(),
                };
                if i % 50 == 49 {
                    reads.push(v[out].to_vec()?);
                }
            }
            for t in &v {
                reads.push(t.to_vec()?);
            }
        }
        Ok((
            start.elapsed().as_secs_f64(),
            e.kernels_dispatched(gpu) - k0,
            reads,
        ))
    };
    let mut out = serde_json::Map::new();
    let mut values = Vec::new();
    for mode in [Mode::Lazy, Mode::Async] {
        p.part(format!("{gpu}: random programs, {mode:?}"));
        let e = Engine::builder().mode(mode).build()?;
        // Open the devices outside the clock (tens of milliseconds).
        e.devices();
        let (first_s, first_k, first) = run(&e)?;
        let (again_s, again_k, again) = run(&e)?;
        if first != again {
            return Err(format!(
                "random programs: {mode:?}: the second pass computed other values"
            )
            .into());
        }
        let per = |s: f64| s / programs as f64 * 1e3;
        p.println(format!(
            "{gpu}: random programs ({programs} x {ops} ops of {len}), {mode:?}: first pass {:.1} ms/program ({first_k} kernels), again {:.1} ms/program ({again_k} kernels)",
            per(first_s),
            per(again_s)
        ));
        out.insert(
            format!("{mode:?}").to_lowercase(),
            json!({"first_ms": per(first_s), "again_ms": per(again_s), "first_kernels": first_k, "again_kernels": again_k}),
        );
        values.push(first);
    }
    for (i, (a, b)) in values[0].iter().zip(&values[1]).enumerate() {
        let worst = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        if worst > 1e-5 {
            return Err(format!(
                "random programs: read {i} differs between Lazy and Async by {worst}"
            )
            .into());
        }
    }
    let ratio = |k: &str| {
        out["async"][k].as_f64().unwrap_or(f64::NAN) / out["lazy"][k].as_f64().unwrap_or(f64::NAN)
    };
    p.println(format!(
        "{gpu}: random programs, Async / Lazy: first pass {:.2}x, again {:.2}x",
        ratio("first_ms"),
        ratio("again_ms")
    ));
    out.insert("programs".into(), json!(programs));
    out.insert("ops".into(), json!(ops));
    out.insert("len".into(), json!(len));
    Ok(Value::Object(out))
}
