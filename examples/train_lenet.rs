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
    /// Directory of the IDX files (else LAZYFLOW_DATA, else Debian's path).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Writes the curves as SVG.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Writes the report as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// A subset (12,000 training and 2,000 validation and test images, 3
    /// epochs), for CI.
    #[arg(long)]
    quick: bool,
    /// Weight initialisation: `book` (normal x 0.01, the book's) or `kaiming`.
    #[arg(long, default_value = "book")]
    init: String,
    /// Seed of the weights and the shuffling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let engine = Engine::builder().logical_devices(args.logical).build()?;
    let devices = train::parse_devices(&engine, &args.devices)?;
    let data = FashionMnist::load(args.data.as_deref())?;
    let (mut train_set, mut valid) = data.train.split(args.valid, args.seed);
    let mut test = data.test;
    let mut epochs = args.epochs;
    if args.quick {
        train_set = train_set.take(12_000);
        valid = valid.take(2_000);
        test = test.take(2_000);
        epochs = epochs.min(3);
    }
    for d in &devices {
        println!("{d}: {}", engine.describe(*d));
    }
    println!(
        "{} training, {} validation, {} test images; batch {}, lr {} (x{} every {} epochs), momentum {}, weight decay {}",
        train_set.len(), valid.len(), test.len(), args.batch_size, args.lr, args.lr_decay, args.lr_period, args.momentum, args.wd
    );
    let config = TrainConfig {
        epochs,
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
    };
    let net = match args.init.as_str() {
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
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
