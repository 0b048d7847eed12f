//! The tour: the demonstrations of *Dive into Deep Learning* ch. 13.2
//! (asynchronous computation), measured on the CPU device.
//!
//! ```text
//! cargo run --release --example tour                 # print the table
//! cargo run --release --example tour -- --json out.json
//! cargo run --release --example tour -- --quick      # small sizes (tests)
//! ```
//!
//! 1. Asynchronous benchmark: ten 1000x1000 matmuls. The time until the frontend
//!    regains control says nothing about the work; the time with the blocker does.
//!    Next to it, the GEMM crate (faer) called directly, and numpy when python3 with
//!    numpy is installed.
//! 2. Sync vs async: 10,000 times `y = x + 1`, with `wait_to_read` after each op
//!    vs one `wait_all` after the loop; the same with every `y` kept alive; and the
//!    dependent chain `x = x + 1`.
//! 3. Bounded queue: a frontend loop of 1,000,000 ops with the default bound vs none.

use lazyflow::{Benchmark, Engine, Mode, Tensor};
use serde_json::json;
use std::time::Instant;

struct Sizes {
    matmul: usize,
    matmul_reps: usize,
    loop_ops: usize,
    backpressure_ops: usize,
}

fn main() -> lazyflow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let json_path = args
        .iter()
        .position(|a| a == "--json")
        .and_then(|i| args.get(i + 1).cloned());
    let sizes = if quick {
        Sizes {
            matmul: 64,
            matmul_reps: 3,
            loop_ops: 200,
            backpressure_ops: 20_000,
        }
    } else {
        Sizes {
            matmul: 1000,
            matmul_reps: 10,
            loop_ops: 10_000,
            backpressure_ops: 1_000_000,
        }
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("lazyflow tour on the CPU device ({cores} cores)\n");

    let matmul = async_matmul(&sizes)?;
    let loops = sync_vs_async(&sizes)?;
    let bp = bounded_queue(&sizes)?;

    println!("\n== results ==");
    println!(
        "{:<44} {:>12} {:>12} {:>8} {:>9}",
        "demonstration", "sync / s", "async / s", "ratio", "kernels"
    );
    for (name, l) in [
        ("y = x + 1, y discarded", &loops.increment),
        ("y = x + 1, every y kept", &loops.kept),
        ("x = x + 1, dependent chain", &loops.chain),
    ] {
        println!(
            "{:<44} {:>12.4} {:>12.4} {:>8.1} {:>9}",
            name,
            l.sync_s,
            l.async_s,
            l.sync_s / l.async_s,
            l.async_kernels
        );
    }
    println!(
        "async per op: {:.3} us (discarded), {:.3} us (kept), {:.3} us (chain)",
        loops.increment.async_s / sizes.loop_ops as f64 * 1e6,
        loops.kept.async_s / sizes.loop_ops as f64 * 1e6,
        loops.chain.async_s / sizes.loop_ops as f64 * 1e6
    );

    if let Some(path) = json_path {
        let lp = |l: &LoopTimes| {
            json!({"sync_s": l.sync_s, "async_s": l.async_s, "ratio": l.sync_s / l.async_s,
                   "sync_kernels": l.sync_kernels, "async_kernels": l.async_kernels})
        };
        let report = json!({
            "machine": {"cores": cores, "os": std::env::consts::OS, "arch": std::env::consts::ARCH},
            "devices": [{
                "name": "cpu",
                "backend": "cpu",
                "async_matmul": {
                    "dispatch_s": matmul.dispatch_s,
                    "synced_s": matmul.synced_s,
                    "cpu_gemm_s": matmul.cpu_gemm_s,
                    "gflops": matmul.gflops,
                    "cpu_gemm_gflops": matmul.cpu_gemm_gflops,
                    "numpy_gflops": matmul.numpy_gflops,
                },
                "increment": lp(&loops.increment),
                "increment_kept": lp(&loops.kept),
                "chain": lp(&loops.chain),
            }],
            "backpressure": {
                "ops": sizes.backpressure_ops,
                "bounded_peak_nodes": bp.bounded_peak_nodes,
                "bounded_peak_rss_mb": bp.bounded_peak_rss_mb,
                "unbounded_peak_nodes": bp.unbounded_peak_nodes,
                "unbounded_peak_rss_mb": bp.unbounded_peak_rss_mb,
            },
        });
        std::fs::write(&path, serde_json::to_string_pretty(&report).unwrap())
            .unwrap_or_else(|e| panic!("writing {path}: {e}"));
        println!("wrote {path}");
    }
    Ok(())
}

struct MatmulTimes {
    dispatch_s: f64,
    synced_s: f64,
    cpu_gemm_s: f64,
    gflops: f64,
    cpu_gemm_gflops: f64,
    numpy_gflops: Option<f64>,
}

fn async_matmul(sizes: &Sizes) -> lazyflow::Result<MatmulTimes> {
    let (n, reps) = (sizes.matmul, sizes.matmul_reps);
    println!("== 1. asynchronous benchmark: {reps} x ({n}x{n} @ {n}x{n}) ==");
    // Async mode: each op starts as soon as it is recorded, as in MXNet.
    let engine = Engine::builder().mode(Mode::Async).build()?;
    let x = Tensor::rand_uniform_in(&engine, [n, n], -1.0, 1.0, 0)?;
    x.matmul(&x)?.wait_to_read()?; // warm-up

    // Only the recording: the frontend regains control long before the work is done.
    let start = Instant::now();
    let mut ys = Vec::with_capacity(reps);
    for _ in 0..reps {
        ys.push(x.matmul(&x)?);
    }
    let dispatch_s = start.elapsed().as_secs_f64();
    println!("lazyflow, without waiting: {dispatch_s:.4} sec");
    engine.wait_all()?;
    drop(ys);

    // With the blocker inside the timed region: the real cost.
    let timer = Benchmark::new(&engine, "lazyflow, with wait_all");
    for _ in 0..reps {
        let _y = x.matmul(&x)?;
    }
    let synced_s = timer.stop();

    // The GEMM crate called directly, with the same parallelism setting.
    let a = faer::Mat::<f32>::from_fn(n, n, |i, j| ((i * 7 + j * 13) % 17) as f32 / 17.0 - 0.5);
    let mut c = faer::Mat::<f32>::zeros(n, n);
    let par = faer::Par::rayon(0);
    faer::linalg::matmul::matmul(
        c.as_mut(),
        faer::Accum::Replace,
        a.as_ref(),
        a.as_ref(),
        1.0,
        par,
    );
    let start = Instant::now();
    for _ in 0..reps {
        faer::linalg::matmul::matmul(
            c.as_mut(),
            faer::Accum::Replace,
            a.as_ref(),
            a.as_ref(),
            1.0,
            par,
        );
    }
    let cpu_gemm_s = start.elapsed().as_secs_f64();
    println!("faer called directly: {cpu_gemm_s:.4} sec");

    let flop = 2.0 * (n as f64).powi(3) * reps as f64;
    let numpy_gflops = numpy_gflops(n, reps);
    match numpy_gflops {
        Some(g) => println!("numpy (same run): {g:.1} GFLOP/s"),
        None => println!("numpy: not available (python3 with numpy not found)"),
    }
    let t = MatmulTimes {
        dispatch_s,
        synced_s,
        cpu_gemm_s,
        gflops: flop / synced_s / 1e9,
        cpu_gemm_gflops: flop / cpu_gemm_s / 1e9,
        numpy_gflops,
    };
    println!(
        "lazyflow {:.1} GFLOP/s, faer direct {:.1} GFLOP/s\n",
        t.gflops, t.cpu_gemm_gflops
    );
    Ok(t)
}

/// Times numpy's matmul in a python3 subprocess, if numpy is installed.
fn numpy_gflops(n: usize, reps: usize) -> Option<f64> {
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

struct LoopTimes {
    sync_s: f64,
    async_s: f64,
    sync_kernels: u64,
    async_kernels: u64,
}

struct Loops {
    increment: LoopTimes,
    kept: LoopTimes,
    chain: LoopTimes,
}

fn sync_vs_async(sizes: &Sizes) -> lazyflow::Result<Loops> {
    let ops = sizes.loop_ops;
    println!("== 2. sync vs async: {ops} x (y = x + 1) ==");
    let engine = Engine::builder().build()?;
    let kernels = |engine: &Engine| engine.stats().completed;

    let measure =
        |name: &str, body: &dyn Fn(bool) -> lazyflow::Result<()>| -> lazyflow::Result<LoopTimes> {
            body(false)?; // warm-up
            engine.wait_all()?;
            let k0 = kernels(&engine);
            let timer = Benchmark::new(&engine, format!("{name}, wait_to_read after each"));
            body(true)?;
            let sync_s = timer.stop();
            let k1 = kernels(&engine);
            let timer = Benchmark::new(&engine, format!("{name}, one wait_all"));
            body(false)?;
            let async_s = timer.stop();
            let k2 = kernels(&engine);
            Ok(LoopTimes {
                sync_s,
                async_s,
                sync_kernels: k1 - k0,
                async_kernels: k2 - k1,
            })
        };

    let x = Tensor::ones_in(&engine, [1, 2]);
    let increment = measure("y = x + 1", &|sync| {
        for _ in 0..ops {
            let y = &x + 1.0;
            if sync {
                y.wait_to_read()?;
            }
        }
        Ok(())
    })?;
    let kept = measure("y = x + 1 kept", &|sync| {
        let mut ys = Vec::with_capacity(ops);
        for _ in 0..ops {
            let y = &x + 1.0;
            if sync {
                y.wait_to_read()?;
            }
            ys.push(y);
        }
        engine.wait_all()?;
        assert!(ys.iter().all(|y| y.to_vec().unwrap() == [2.0, 2.0]));
        Ok(())
    })?;
    let chain = measure("x = x + 1", &|sync| {
        let mut x = Tensor::zeros_in(&engine, [1, 2]);
        for _ in 0..ops {
            x = &x + 1.0;
            if sync {
                x.wait_to_read()?;
            }
        }
        assert_eq!(x.to_vec()?, vec![ops as f32; 2]);
        Ok(())
    })?;
    Ok(Loops {
        increment,
        kept,
        chain,
    })
}

struct Backpressure {
    bounded_peak_nodes: usize,
    bounded_peak_rss_mb: f64,
    unbounded_peak_nodes: usize,
    unbounded_peak_rss_mb: f64,
}

fn bounded_queue(sizes: &Sizes) -> lazyflow::Result<Backpressure> {
    let ops = sizes.backpressure_ops;
    println!("\n== 3. bounded queue: {ops} ops recorded without waiting ==");
    let run = |engine: Engine| -> lazyflow::Result<(usize, f64)> {
        reset_peak_rss();
        let x = Tensor::ones_in(&engine, [16]);
        let mut acc = Tensor::zeros_in(&engine, [16]);
        for _ in 0..ops {
            acc = &acc + &x;
        }
        assert_eq!(acc.to_vec()?, vec![ops as f32; 16]);
        Ok((engine.stats().peak_live_nodes, peak_rss_mb()))
    };
    let (bounded_peak_nodes, bounded_peak_rss_mb) = run(Engine::builder().build()?)?;
    println!("default bound: peak {bounded_peak_nodes} pending nodes, peak RSS {bounded_peak_rss_mb:.0} MB");
    let (unbounded_peak_nodes, unbounded_peak_rss_mb) =
        run(Engine::builder().unbounded().build()?)?;
    println!("no bound:      peak {unbounded_peak_nodes} pending nodes, peak RSS {unbounded_peak_rss_mb:.0} MB");
    Ok(Backpressure {
        bounded_peak_nodes,
        bounded_peak_rss_mb,
        unbounded_peak_nodes,
        unbounded_peak_rss_mb,
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
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}
