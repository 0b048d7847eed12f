//! Trains LeNet on Fashion-MNIST over several processes: the book's parameter
//! server and allreduce, each process data-parallel over its own devices.
//! Under `mpirun` (built with `--features mpi`) every process is an MPI rank;
//! without it, one process trains alone with the same code.
//!
//! ```text
//! cargo build --release --features mpi --example train_distributed
//! mpirun -np 2 --oversubscribe target/release/examples/train_distributed --quick
//! mpirun -np 4 --oversubscribe target/release/examples/train_distributed --strategy allreduce
//! mpirun -np 2 --oversubscribe target/release/examples/train_distributed --quick --bench-allreduce
//! cargo run --release --example train_distributed -- --quick          # one process
//! ```
//!
//! Rank 0 prints one row per run (strategy, overlap): seconds per epoch and
//! per step, the share of the epoch the communication thread spent in
//! collectives, and the test accuracy; `--json` writes them.

use clap::Parser;
use lazyflow::data::FashionMnist;
use lazyflow::dist::Dist;
use lazyflow::nn::{self, Init};
use lazyflow::train::{self, Overlap, StepLr, Strategy, TrainConfig};
use lazyflow::{Engine, Tensor};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(about = "Train LeNet on Fashion-MNIST over several processes (MPI)")]
struct Args {
    /// `ps` (parameter server), `allreduce`, or `both`.
    #[arg(long, default_value = "both")]
    strategy: String,
    /// `per-layer`, `after-backward`, or `both` (to measure the overlap).
    #[arg(long, default_value = "per-layer")]
    overlap: String,
    /// This process's devices: cpu, gpu:0, cpu,gpu:0 ...
    #[arg(long, default_value = "cpu")]
    devices: String,
    #[arg(long, default_value_t = 10)]
    epochs: usize,
    /// The global minibatch (over all processes together).
    #[arg(long, default_value_t = 256)]
    batch_size: usize,
    #[arg(long, default_value_t = 0.2)]
    lr: f32,
    #[arg(long, default_value_t = 0.0)]
    momentum: f32,
    #[arg(long, default_value_t = 0.0)]
    wd: f32,
    /// Trains on at most this many images (0: all 50,000 after validation).
    #[arg(long, default_value_t = 0)]
    train: usize,
    /// Validation images held out of the training set.
    #[arg(long, default_value_t = 10_000)]
    valid: usize,
    /// Tests on at most this many images (0: all 10,000).
    #[arg(long, default_value_t = 0)]
    test: usize,
    /// Weight initialisation: `book` (normal x 0.01) or `kaiming`.
    #[arg(long, default_value = "book")]
    init: String,
    /// Worker threads per process (0: the cores divided among the processes
    /// on this machine).
    #[arg(long, default_value_t = 0)]
    workers: usize,
    /// A short run for CI: 1 epoch of 2,000 images (1,000 validation and
    /// test), batch 32, Kaiming initialisation, `TrainConfig::quick()`'s
    /// learning rate, momentum and weight decay.
    #[arg(long)]
    quick: bool,
    /// Also measures the allreduce of 1 to 64 MB against the transport's own
    /// (`MPI_Allreduce`) called directly.
    #[arg(long)]
    bench_allreduce: bool,
    /// Directory of the IDX files (else LAZYFLOW_DATA, else Debian's path).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Writes rank 0's results as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn main() {
    let args = Args::parse();
    // The communicator outlives `run`, so an error is printed before it is
    // dropped (dropping it after a timeout ends the whole MPI job).
    let dist = match Dist::from_env() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("train_distributed: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&args, &dist) {
        eprintln!("train_distributed: rank {}: {e}", dist.rank());
        std::process::exit(1);
    }
}

fn list<T: std::str::FromStr<Err = lazyflow::Error>>(
    s: &str,
    all: &[&str],
) -> lazyflow::Result<Vec<T>> {
    match s {
        "both" => all.iter().map(|v| v.parse()).collect(),
        one => Ok(vec![one.parse()?]),
    }
}

fn run(args: &Args, dist: &Dist) -> lazyflow::Result<()> {
    let local_ranks: usize = std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let workers = match args.workers {
        0 => (cores / local_ranks).max(1),
        w => w,
    };
    let engine = Engine::builder().workers(workers).build()?;
    let devices = train::parse_devices(&engine, &args.devices)?;
    let strategies: Vec<Strategy> = list(&args.strategy, &["allreduce", "ps"])?;
    let overlaps: Vec<Overlap> = list(&args.overlap, &["per-layer", "after-backward"])?;
    let root = dist.is_root();
    if root {
        println!(
            "{} ({} workers per process), devices per process: {}",
            dist.transport(),
            workers,
            args.devices
        );
    }

    // 1. Every process reads the data; each takes its share of every batch.
    let data = FashionMnist::load(args.data.as_deref())?;
    let (train_n, valid_n, test_n) = if args.quick {
        (2_000, 1_000, 1_000)
    } else {
        (args.train, args.valid, args.test)
    };
    let (train_set, valid) = data.train.split(valid_n, 0);
    let train_set = if train_n > 0 {
        train_set.take(train_n)
    } else {
        train_set
    };
    let test = if test_n > 0 {
        data.test.take(test_n)
    } else {
        data.test
    };
    let config = if args.quick {
        TrainConfig {
            epochs: 1,
            progress: false,
            ..TrainConfig::quick()
        }
    } else {
        TrainConfig {
            epochs: args.epochs,
            batch_size: args.batch_size,
            lr: StepLr {
                base: args.lr,
                period: 0,
                decay: 1.0,
            },
            momentum: args.momentum,
            weight_decay: args.wd,
            seed: 0,
            progress: root,
            weights: None,
        }
    };
    let init = if args.quick {
        Init::KaimingNormal
    } else {
        Init::Normal {
            mean: 0.0,
            std: 0.01,
        }
    };

    let mut rows = Vec::new();
    if root {
        println!(
            "{:<17} {:<15} {:>10} {:>9} {:>11} {:>9}",
            "strategy", "overlap", "s/epoch", "ms/step", "comm share", "test acc"
        );
    }
    for &strategy in &strategies {
        for &overlap in &overlaps {
            let net = nn::lenet_with(&engine, init, 0)?;
            let (_, report) = train::fit_distributed(
                &engine, dist, &net, &train_set, &valid, &test, &devices, &config, strategy,
                overlap,
            )?;
            let seconds: f64 = report.epochs.iter().map(|e| e.seconds).sum();
            let comm: f64 = report.epochs.iter().map(|e| e.comm_seconds).sum();
            let epochs = report.epochs.len().max(1) as f64;
            let steps = epochs * (train_set.len() / config.batch_size).max(1) as f64;
            let row = serde_json::json!({
                "strategy": strategy.to_string(),
                "overlap": format!("{overlap:?}"),
                "processes": dist.size(),
                "seconds_per_epoch": seconds / epochs,
                "ms_per_step": seconds / steps * 1e3,
                "comm_share": comm / seconds,
                "train_loss": report.epochs.last().map(|e| e.train_loss),
                "valid_acc": report.epochs.last().map(|e| e.valid_acc),
                "test_acc": report.test_acc,
            });
            if root {
                println!(
                    "{:<17} {:<15} {:>10.2} {:>9.1} {:>10.0}% {:>9.3}",
                    strategy.to_string(),
                    format!("{overlap:?}"),
                    seconds / epochs,
                    seconds / steps * 1e3,
                    comm / seconds * 100.0,
                    report.test_acc
                );
            }
            rows.push(row);
        }
    }

    let mut bench = Vec::new();
    if args.bench_allreduce {
        if root {
            println!(
                "\nallreduce of f32 buffers over {} processes (best of 5)",
                dist.size()
            );
            println!(
                "{:>6} {:>14} {:>14} {:>16} {:>16}",
                "MB", "lazyflow ms", "MPI ms", "lazyflow GB/s", "MPI GB/s"
            );
        }
        for mb in [1usize, 4, 16, 64] {
            let n = mb * (1 << 20) / 4;
            let x = Tensor::full_in(&engine, [n], 1.0);
            x.to_vec()?;
            let (mut ours, mut theirs) = (f64::MAX, f64::MAX);
            for _ in 0..5 {
                let start = std::time::Instant::now();
                let s = dist.allreduce_sum(&x, "benchmark")?;
                s.wait_to_read()?;
                ours = ours.min(start.elapsed().as_secs_f64());
                let (_, took) = dist.raw_allreduce(vec![1.0; n])?;
                theirs = theirs.min(took.as_secs_f64());
            }
            let gbs = |t: f64| (mb << 20) as f64 / t / 1e9;
            if root {
                println!(
                    "{:>6} {:>14.2} {:>14.2} {:>16.2} {:>16.2}",
                    mb,
                    ours * 1e3,
                    theirs * 1e3,
                    gbs(ours),
                    gbs(theirs)
                );
            }
            bench.push(serde_json::json!({
                "mb": mb, "lazyflow_ms": ours * 1e3, "mpi_ms": theirs * 1e3,
            }));
        }
    }
    if let (Some(path), true) = (&args.json, root) {
        let json = serde_json::json!({
            "transport": dist.transport(),
            "processes": dist.size(),
            "workers_per_process": workers,
            "runs": rows,
            "allreduce": bench,
        });
        std::fs::write(
            path,
            serde_json::to_string_pretty(&json).unwrap_or_default(),
        )
        .map_err(|e| lazyflow::Error::Config(format!("cannot write {}: {e}", path.display())))?;
    }
    Ok(())
}
