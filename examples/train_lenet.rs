//! Trains the book's LeNet on Fashion-MNIST, data-parallel over the devices
//! given, with the book's training function: per-epoch loss and accuracies, a
//! progress bar, a table, an SVG plot and a JSON report.
//!
//! ```text
//! cargo run --release --example train_lenet                              # CPU, the book's settings
//! cargo run --release --example train_lenet -- --devices gpu:0,gpu:1 --logical 2
//! cargo run --release --example train_lenet -- --devices cpu,gpu:0 --plot p.svg --json r.json
//! cargo run --release --example train_lenet -- --quick                   # a subset, for CI
//! ```

use clap::Parser;
use lazyflow::data::FashionMnist;
use lazyflow::train::{self, StepLr, TrainConfig};
use lazyflow::{nn, Engine};
use std::path::PathBuf;

/// Command-line flags (defaults: the book's).
#[derive(Parser, Debug)]
#[command(about = "Train LeNet on Fashion-MNIST, data-parallel over several devices")]
struct Args {
    /// Devices: cpu, gpu:0, gpu:0,gpu:1, cpu,gpu:0 (one replica each).
    #[arg(long, default_value = "cpu")]
    devices: String,
    /// Relative shard sizes per device, e.g. `1,4` (default: equal).
    #[arg(long, value_delimiter = ',')]
    weights: Option<Vec<f64>>,
    /// Logical devices to open per GPU adapter.
    #[arg(long, default_value_t = 1)]
    logical: usize,
    #[arg(long, default_value_t = 10)]
    epochs: usize,
    #[arg(long, default_value_t = 256)]
    batch_size: usize,
    #[arg(long, default_value_t = 0.2)]
    lr: f32,
    #[arg(long, default_value_t = 0.0)]
    momentum: f32,
    /// Weight decay.
    #[arg(long, default_value_t = 0.0)]
    wd: f32,
    /// Epochs between learning-rate decays (0: never).
    #[arg(long, default_value_t = 0)]
    lr_period: usize,
    /// Factor applied to the learning rate each period.
    #[arg(long, default_value_t = 0.1)]
    lr_decay: f32,
    /// Validation images held out of the training set.
    #[arg(long, default_value_t = 10_000)]
    valid: usize,
    /// Trains on at most this many images (0: all).
    #[arg(long, default_value_t = 0)]
    train: usize,
    /// Tests on at most this many images (0: all 10,000).
    #[arg(long, default_value_t = 0)]
    test: usize,
    /// Directory of the IDX files (else LAZYFLOW_DATA, else Debian's path).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Writes the curves as SVG.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Writes the report as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// A short run that learns, for CI: 2,000 training and 1,000 validation
    /// and test images, Kaiming initialisation and `TrainConfig::quick()` (3
    /// epochs, batch 32, lr 0.04 halved every epoch, momentum 0.9, weight
    /// decay 1e-4) in place of the other settings.
    #[arg(long)]
    quick: bool,
    /// Weight initialisation: `book` (normal x 0.01, the book's) or `kaiming`.
    #[arg(long, default_value = "book")]
    init: String,
    /// Also trains the same LeNet with PyTorch's CPU build (Debian's
    /// python3-torch), same threads and settings, after this run.
    #[arg(long)]
    pytorch: bool,
    /// Seed of the weights and the shuffling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// Runs `examples/peers/train_lenet_torch.py` with the Python that imports
/// torch (`LAZYFLOW_PYTHON`, `python3`, `/usr/bin/python3`).
fn pytorch(
    dir: &std::path::Path,
    epochs: usize,
    args: &Args,
    threads: usize,
    limit: usize,
) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/peers/train_lenet_torch.py"
    );
    let pythons = std::env::var("LAZYFLOW_PYTHON")
        .into_iter()
        .chain(["python3".to_string(), "/usr/bin/python3".to_string()]);
    let mut last = String::from("no Python found");
    for python in pythons {
        // Quietly skip interpreters without torch and numpy.
        let usable = std::process::Command::new(&python)
            .args(["-c", "import torch, numpy"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !usable {
            last = format!("{python} cannot import torch and numpy");
            continue;
        }
        let out = std::process::Command::new(&python)
            .arg(script)
            .arg(dir)
            .args([epochs, args.batch_size].map(|v| v.to_string()))
            .args([args.lr, args.momentum, args.wd].map(|v| v.to_string()))
            .args([threads, limit].map(|v| v.to_string()))
            .stderr(std::process::Stdio::inherit())
            .output();
        match out {
            Ok(out) if out.status.success() => return Ok(serde_json::from_slice(&out.stdout)?),
            Ok(out) => last = format!("{python} exited with {}", out.status),
            Err(e) => last = format!("{python}: {e}"),
        }
    }
    Err(format!(
        "the PyTorch peer did not run ({last}); install python3-torch or set LAZYFLOW_PYTHON"
    )
    .into())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let engine = Engine::builder().logical_devices(args.logical).build()?;
    let devices = train::parse_devices(&engine, &args.devices)?;
    let data = FashionMnist::load(args.data.as_deref())?;
    let valid_len = if args.quick { 1_000 } else { args.valid };
    let (mut train_set, mut valid) = data.train.split(valid_len, args.seed);
    let mut test = data.test;
    if args.train > 0 {
        train_set = train_set.take(args.train);
    }
    if args.test > 0 {
        test = test.take(args.test);
    }
    let mut config = TrainConfig {
        epochs: args.epochs,
        batch_size: args.batch_size,
        lr: StepLr {
            base: args.lr,
            period: args.lr_period,
            decay: args.lr_decay,
        },
        momentum: args.momentum,
        weight_decay: args.wd,
        seed: args.seed,
        progress: true,
        weights: args.weights.clone(),
    };
    let mut init = args.init.clone();
    if args.quick {
        train_set = train_set.take(2_000);
        valid = valid.take(1_000);
        test = test.take(1_000);
        config = TrainConfig {
            seed: args.seed,
            progress: true,
            ..TrainConfig::quick()
        };
        init = "kaiming".to_string();
    }
    let epochs = config.epochs;
    for d in &devices {
        println!("{d}: {}", engine.describe(*d));
    }
    println!(
        "{} training, {} validation, {} test images; {epochs} epochs, batch {}, lr {} (x{} every {} epochs), momentum {}, weight decay {}, init {init}",
        train_set.len(),
        valid.len(),
        test.len(),
        config.batch_size,
        config.lr.base,
        config.lr.decay,
        config.lr.period,
        config.momentum,
        config.weight_decay
    );
    let net = match init.as_str() {
        "book" => nn::lenet(&engine, args.seed)?,
        "kaiming" => nn::lenet_with(&engine, nn::Init::KaimingNormal, args.seed)?,
        other => return Err(format!("unknown --init {other:?} (book or kaiming)").into()),
    };
    let (_, report) = train::fit(&engine, &net, &train_set, &valid, &test, &devices, &config)?;
    print!("{}", report.table());
    let mut json = report.to_json();
    if let Some(path) = &args.plot {
        report.plot(path)?;
        println!("wrote {}", path.display());
        json["plot"] = path.display().to_string().into();
    } else {
        json["plot"] = serde_json::Value::Null;
    }
    json["machine"] = serde_json::json!({
        "cpu_threads": engine.cpu_threads(),
        "devices": devices.iter().map(|d| engine.describe(*d)).collect::<Vec<_>>(),
    });
    json["pytorch"] = serde_json::Value::Null;
    if args.pytorch {
        if args.lr_period != 0 || init != "book" {
            return Err(
                "--pytorch runs the book's setup: no --lr-period, --init book, --quick".into(),
            );
        }
        let dir = args
            .data
            .clone()
            .or_else(|| std::env::var_os("LAZYFLOW_DATA").map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from(lazyflow::data::DEBIAN_DIR));
        let limit = if args.quick { train_set.len() } else { 0 };
        let peer = pytorch(&dir, epochs, &args, engine.cpu_threads(), limit)?;
        println!("pytorch (same settings, {} threads):", peer["threads"]);
        for e in peer["epochs"].as_array().into_iter().flatten() {
            println!(
                "{:>5} {:>7} {:>10.4} {:>9.4} {:>9.4} {:>8.2} {:>9.0}",
                e["epoch"],
                "",
                e["train_loss"].as_f64().unwrap_or(f64::NAN),
                e["train_acc"].as_f64().unwrap_or(f64::NAN),
                e["valid_acc"].as_f64().unwrap_or(f64::NAN),
                e["seconds"].as_f64().unwrap_or(f64::NAN),
                e["images_per_s"].as_f64().unwrap_or(f64::NAN)
            );
        }
        println!(
            "pytorch test accuracy {:.4}",
            peer["test_acc"].as_f64().unwrap_or(f64::NAN)
        );
        json["pytorch"] = peer;
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
