//! Worker scaling: ns per node of the scheduler benchmark's `wide` and
//! `random_dag` shapes (`benches/scheduler.rs`, same inputs) for 1, 2, 4, 8, 16
//! workers, with empty tasks (the engine's own cost) and with tasks of a few
//! microseconds of work (what parallel workers should speed up).
//!
//! ```text
//! cargo run --release --example scaling [-- --workers 1,2,4,8,16] [--reps 5] [--work-us 5] [--json PATH]
//! ```
//!
//! By default the worker counts are the powers of two up to the machine's
//! cores. Each line is the median of `--reps` runs, each on a fresh engine in
//! Lazy mode with the default backpressure, recording included; the speedup is
//! against the same shape on one worker.

mod demos;

use clap::Parser;
use demos::shapes::{random_dag, random_inputs, wide};
use lazyflow::{Engine, Mode};
use serde_json::json;
use std::time::Instant;

#[derive(Parser)]
struct Args {
    /// Worker counts, comma-separated (default: powers of two up to the cores).
    #[arg(long, value_delimiter = ',')]
    workers: Vec<usize>,
    /// Runs per line; the median is reported.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Microseconds of work in each task of the busy variants.
    #[arg(long, default_value_t = 5.0)]
    work_us: f64,
    /// Write the table as JSON here.
    #[arg(long)]
    json: Option<String>,
}

/// Spins for about `us` microseconds (a task's work, not a sleep: the worker
/// stays busy).
fn work(us: f64) {
    if us <= 0.0 {
        return;
    }
    let end = Instant::now() + std::time::Duration::from_secs_f64(us * 1e-6);
    while Instant::now() < end {
        std::hint::spin_loop();
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> demos::DemoResult<()> {
    let args = Args::parse();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let workers = if args.workers.is_empty() {
        let mut w: Vec<usize> = (0..)
            .map(|k| 1usize << k)
            .take_while(|&w| w <= cores)
            .collect();
        if !w.contains(&cores) {
            w.push(cores);
        }
        w
    } else {
        args.workers.clone()
    };
    if workers.contains(&0) || args.reps == 0 {
        return Err("--workers and --reps must be at least 1".into());
    }
    println!(
        "{} ({cores} cores, {}), Lazy mode, median of {} runs",
        demos::cpu_model(),
        demos::simd_width(),
        args.reps
    );
    let us = args.work_us;
    let dag_empty = random_inputs(100_000);
    let dag_busy = random_inputs(20_000);
    let busy = move || work(us);
    // Each records its nodes and returns how many; the loop below waits.
    type Shape<'a> = (&'static str, Box<dyn Fn(&Engine) -> usize + 'a>);
    let shapes: Vec<Shape> = vec![
        ("wide", Box::new(|e| wide(e, 1_000_000, || {}))),
        ("random_dag", Box::new(|e| random_dag(e, &dag_empty, || {}))),
        ("wide_busy", Box::new(move |e| wide(e, 20_000, busy))),
        (
            "random_dag_busy",
            Box::new(|e| random_dag(e, &dag_busy, busy)),
        ),
    ];
    println!(
        "{:<16} {:>8} {:>12} {:>9}",
        "shape", "workers", "ns/node", "speedup"
    );
    let mut rows = Vec::new();
    for (name, run) in &shapes {
        let mut one = None;
        for &w in &workers {
            let e = Engine::builder().mode(Mode::Lazy).workers(w).build()?;
            // Warm-up: threads started, node memory allocated.
            let nodes = run(&e);
            e.wait_all()?;
            let mut times = Vec::with_capacity(args.reps);
            for _ in 0..args.reps {
                let t = Instant::now();
                run(&e);
                e.wait_all()?;
                times.push(t.elapsed().as_secs_f64());
            }
            let ns = median(times) * 1e9 / nodes as f64;
            let base = *one.get_or_insert(ns);
            println!("{name:<16} {w:>8} {ns:>12.1} {:>8.2}x", base / ns);
            rows.push(json!({"shape": name, "workers": w, "nodes": nodes, "ns_per_node": ns, "speedup": base / ns}));
        }
    }
    if let Some(path) = &args.json {
        let out = json!({
            "cpu": demos::cpu_model(), "simd": demos::simd_width(), "cores": cores,
            "work_us": us, "reps": args.reps, "rows": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&out)?)?;
        println!("wrote {path}");
    }
    Ok(())
}
