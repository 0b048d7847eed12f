//! Training on one or several devices: the book's `train_ch13`, with the
//! engine doing the overlap.
//!
//! [`fit`] runs epochs of [`DataParallel::train_batch`] over shuffled
//! minibatches. The batch loop only records: each device's loss sum and
//! correct count accumulate in tensors on the device and are read once per
//! epoch, so the loop contains no blocker (the report counts them from the
//! engine's statistics), and memory stays bounded by the engine's backpressure
//! instead of a wait per minibatch.

mod distributed;
mod optim;
mod parallel;

pub use distributed::{Distributed, Overlap, Strategy};
pub use optim::{Sgd, StepLr};
pub use parallel::{
    allreduce, split_batch, split_batch_weighted, BatchMetrics, DataParallel, Shard,
};

use crate::data::Dataset;
use crate::device::Device;
use crate::dist::Dist;
use crate::error::{Error, Result};
use crate::nn::Sequential;
use crate::tensor::Tensor;
use crate::Engine;
use std::path::Path;
use std::time::Instant;

/// Parses a device list such as `cpu`, `gpu:0,gpu:1` or `cpu,gpu:0` (`gpu`
/// means `gpu:0`; a device may repeat, which puts two replicas on it) and
/// checks every device exists in `engine`.
///
/// ```
/// use lazyflow::{train::parse_devices, Device, Engine};
/// let engine = Engine::builder().workers(1).build().unwrap();
/// assert_eq!(parse_devices(&engine, "cpu,cpu").unwrap(), vec![Device::Cpu, Device::Cpu]);
/// assert!(parse_devices(&engine, "tpu:0").is_err());
/// assert!(parse_devices(&engine, "").is_err());
/// ```
#[track_caller]
pub fn parse_devices(engine: &Engine, spec: &str) -> Result<Vec<Device>> {
    let location = crate::error::Location::caller();
    let err = |reason: String| Error::InvalidArgument {
        op: "devices",
        shape: String::new(),
        reason,
        location,
    };
    let present = engine.devices();
    let mut out = Vec::new();
    for name in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let device = match name {
            "cpu" => Device::Cpu,
            "gpu" => Device::Gpu(0),
            _ => match name.strip_prefix("gpu:").and_then(|i| i.parse().ok()) {
                Some(i) => Device::Gpu(i),
                None => {
                    return Err(err(format!(
                        "unknown device {name:?} (expected cpu, gpu or gpu:N)"
                    )))
                }
            },
        };
        if !present.contains(&device) {
            let names: Vec<String> = present.iter().map(|d| d.to_string()).collect();
            return Err(err(format!(
                "{device} does not exist here (devices: {})",
                names.join(", ")
            )));
        }
        out.push(device);
    }
    if out.is_empty() {
        return Err(err(format!("no devices in {spec:?}")));
    }
    Ok(out)
}

/// What [`fit`] does.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// Passes over the training set.
    pub epochs: usize,
    /// Examples per minibatch (over all devices together).
    pub batch_size: usize,
    /// The learning rate per epoch.
    pub lr: StepLr,
    /// SGD momentum.
    pub momentum: f32,
    /// L2 weight decay.
    pub weight_decay: f32,
    /// Seeds the shuffling.
    pub seed: u64,
    /// Shows a progress bar on the terminal.
    pub progress: bool,
    /// Relative shard sizes per device (`None`: equal).
    pub weights: Option<Vec<f64>>,
}

impl Default for TrainConfig {
    /// The book's: 10 epochs, batch 256, learning rate 0.2, plain SGD.
    fn default() -> Self {
        TrainConfig {
            epochs: 10,
            batch_size: 256,
            lr: StepLr {
                base: 0.2,
                period: 0,
                decay: 1.0,
            },
            momentum: 0.0,
            weight_decay: 0.0,
            seed: 0,
            progress: true,
            weights: None,
        }
    }
}

impl TrainConfig {
    /// A short run that learns, for tests and CI: 3 epochs, batch 32, SGD with
    /// learning rate 0.04 halved every epoch, momentum 0.9, weight decay 1e-4.
    /// With Kaiming-initialised weights ([`crate::nn::lenet_with`]) it takes
    /// LeNet to about 75% validation accuracy on 2,000 Fashion-MNIST images
    /// (the book's initialisation, normal × 0.01, needs about an epoch of
    /// 50,000 images before the loss moves).
    pub fn quick() -> TrainConfig {
        TrainConfig {
            epochs: 3,
            batch_size: 32,
            lr: StepLr {
                base: 0.04,
                period: 1,
                decay: 0.5,
            },
            momentum: 0.9,
            weight_decay: 1e-4,
            seed: 0,
            progress: false,
            weights: None,
        }
    }
}

/// One epoch's figures.
#[derive(Clone, Debug, PartialEq)]
pub struct EpochStats {
    /// Counted from 1.
    pub epoch: usize,
    /// The learning rate used.
    pub lr: f32,
    /// Mean cross-entropy over the epoch's training examples.
    pub train_loss: f64,
    /// Fraction of training examples classified correctly (as trained).
    pub train_acc: f64,
    /// Fraction of validation examples classified correctly after the epoch.
    pub valid_acc: f64,
    /// Seconds of training (the batch loop and the wait for its work).
    pub seconds: f64,
    /// Training examples per second.
    pub images_per_s: f64,
    /// Blockers the batch loop waited on (0: it only recorded).
    pub blockers: u64,
    /// Seconds this process spent in collectives with other processes during
    /// the epoch (0 for a single process; see [`crate::dist::CommStats`]).
    pub comm_seconds: f64,
}

/// What [`fit`] measured.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainReport {
    /// The devices trained on.
    pub devices: Vec<String>,
    /// One entry per epoch.
    pub epochs: Vec<EpochStats>,
    /// Accuracy on the test set after training.
    pub test_acc: f64,
}

impl TrainReport {
    /// The per-epoch table, as text.
    pub fn table(&self) -> String {
        let mut out = format!(
            "{:>5} {:>7} {:>10} {:>9} {:>9} {:>8} {:>9} {:>8}\n",
            "epoch",
            "lr",
            "train_loss",
            "train_acc",
            "valid_acc",
            "seconds",
            "images/s",
            "blockers"
        );
        for e in &self.epochs {
            out.push_str(&format!(
                "{:>5} {:>7.4} {:>10.4} {:>9.4} {:>9.4} {:>8.2} {:>9.0} {:>8}\n",
                e.epoch,
                e.lr,
                e.train_loss,
                e.train_acc,
                e.valid_acc,
                e.seconds,
                e.images_per_s,
                e.blockers
            ));
        }
        out.push_str(&format!(
            "test accuracy {:.4} on {}\n",
            self.test_acc,
            self.devices.join(", ")
        ));
        out
    }

    /// The report as JSON: `{"devices", "epochs": [{"epoch", "lr",
    /// "train_loss", "train_acc", "valid_acc", "seconds", "images_per_s",
    /// "blockers"}], "test_acc"}`.
    pub fn to_json(&self) -> serde_json::Value {
        let epochs: Vec<serde_json::Value> = self
            .epochs
            .iter()
            .map(|e| {
                serde_json::json!({
                    "epoch": e.epoch, "lr": e.lr, "train_loss": e.train_loss,
                    "train_acc": e.train_acc, "valid_acc": e.valid_acc, "seconds": e.seconds,
                    "images_per_s": e.images_per_s, "blockers": e.blockers,
                    "comm_seconds": e.comm_seconds,
                })
            })
            .collect();
        serde_json::json!({"devices": self.devices, "epochs": epochs, "test_acc": self.test_acc})
    }

    /// Writes the three curves per epoch (training loss, training accuracy,
    /// validation accuracy) as an SVG plot.
    pub fn plot(&self, path: &Path) -> Result<()> {
        use plotters::prelude::*;
        let fail = |e: &dyn std::fmt::Display| Error::Data {
            path: path.display().to_string(),
            reason: format!("cannot draw the plot: {e}"),
        };
        let root = SVGBackend::new(path, (640, 420)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| fail(&e))?;
        let last = self.epochs.len().max(1) as f64;
        let top = self
            .epochs
            .iter()
            .map(|e| e.train_loss)
            .fold(1.0f64, f64::max)
            .min(10.0);
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!("training on {}", self.devices.join(", ")),
                ("sans-serif", 18),
            )
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(44)
            .build_cartesian_2d(1.0f64..last.max(2.0), 0.0f64..top)
            .map_err(|e| fail(&e))?;
        chart
            .configure_mesh()
            .x_desc("epoch")
            .draw()
            .map_err(|e| fail(&e))?;
        type Curve = (&'static str, RGBColor, fn(&EpochStats) -> f64);
        let curves: [Curve; 3] = [
            ("train loss", BLUE, |e| e.train_loss),
            ("train acc", MAGENTA, |e| e.train_acc),
            ("valid acc", GREEN, |e| e.valid_acc),
        ];
        for (name, color, f) in curves {
            chart
                .draw_series(LineSeries::new(
                    self.epochs.iter().map(|e| (e.epoch as f64, f(e).min(top))),
                    color.stroke_width(2),
                ))
                .map_err(|e| fail(&e))?
                .label(name)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| fail(&e))?;
        root.present().map_err(|e| fail(&e))?;
        Ok(())
    }
}

/// What the epoch loop needs of a model trained on this process's devices
/// ([`DataParallel`]) or over several processes ([`Distributed`]).
trait Trainer {
    fn train_batch(&mut self, x: &Tensor, y: &[u32], lr: f32) -> Result<Vec<BatchMetrics>>;
    fn correct(&self, x: &Tensor, y: &[u32]) -> Result<Vec<Tensor>>;
    /// Smaller minibatches are skipped.
    fn min_batch(&self) -> usize;
    /// The sum of running sums (one per device, or over every rank too).
    fn total(&self, acc: &[Option<Tensor>]) -> Result<f64>;
    /// Seconds spent communicating with other processes so far.
    fn comm_seconds(&self) -> f64;
}

impl Trainer for DataParallel {
    fn train_batch(&mut self, x: &Tensor, y: &[u32], lr: f32) -> Result<Vec<BatchMetrics>> {
        DataParallel::train_batch(self, x, y, lr)
    }

    fn correct(&self, x: &Tensor, y: &[u32]) -> Result<Vec<Tensor>> {
        DataParallel::correct(self, x, y)
    }

    fn min_batch(&self) -> usize {
        self.devices().len()
    }

    fn total(&self, acc: &[Option<Tensor>]) -> Result<f64> {
        let mut t = 0.0;
        for s in acc.iter().flatten() {
            t += s.item()? as f64;
        }
        Ok(t)
    }

    fn comm_seconds(&self) -> f64 {
        0.0
    }
}

impl Trainer for Distributed {
    fn train_batch(&mut self, x: &Tensor, y: &[u32], lr: f32) -> Result<Vec<BatchMetrics>> {
        Distributed::train_batch(self, x, y, lr)
    }

    fn correct(&self, x: &Tensor, y: &[u32]) -> Result<Vec<Tensor>> {
        Distributed::correct(self, x, y)
    }

    fn min_batch(&self) -> usize {
        Distributed::min_batch(self)
    }

    /// Sums this rank's parts on the CPU, then over the ranks (a collective
    /// every rank makes at the same point).
    fn total(&self, acc: &[Option<Tensor>]) -> Result<f64> {
        let mut sum: Option<Tensor> = None;
        for s in acc.iter().flatten() {
            let s = s.to(Device::Cpu)?;
            sum = Some(match sum {
                Some(t) => t.add(&s)?,
                None => s,
            });
        }
        let mine = match sum {
            Some(s) => s,
            None => {
                let params = self.parameters();
                let engine = params.first().map_or(Engine::global(), |p| p.engine());
                Tensor::scalar_in(engine, 0.0)
            }
        };
        Ok(self.dist().allreduce_sum(&mine, "a running sum")?.item()? as f64)
    }

    fn comm_seconds(&self) -> f64 {
        self.dist().stats().seconds
    }
}

/// Adds `parts` (one scalar tensor per device) to the running sums in `acc`,
/// each on its own device: recorded, nothing waits.
fn accumulate(acc: &mut Vec<Option<Tensor>>, parts: Vec<Tensor>) -> Result<()> {
    if acc.len() < parts.len() {
        acc.resize(parts.len(), None);
    }
    for (slot, part) in acc.iter_mut().zip(parts) {
        *slot = Some(match slot.take() {
            Some(sum) => sum.add(&part)?,
            None => part,
        });
    }
    Ok(())
}

/// Correctly classified examples of `data`, evaluated on `model`'s devices.
fn evaluate(engine: &Engine, model: &dyn Trainer, data: &Dataset, batch: usize) -> Result<f64> {
    if data.is_empty() {
        return Ok(f64::NAN);
    }
    let mut acc = Vec::new();
    for (x, y) in data.batches_in_order(engine, batch) {
        accumulate(&mut acc, model.correct(&x, &y)?)?;
    }
    Ok(model.total(&acc)? / data.len() as f64)
}

/// Trains `model` (copied onto each of `devices`) on `train`, reporting
/// validation accuracy on `valid` after each epoch and test accuracy on `test`
/// at the end. Returns the trained replicas and the report. A last minibatch
/// smaller than the number of devices is skipped.
///
/// ```no_run
/// use lazyflow::{data::FashionMnist, nn, train, Device, Engine};
/// let engine = Engine::builder().build()?;
/// let data = FashionMnist::load(None)?;
/// let (train_set, valid) = data.train.split(10_000, 0);
/// let net = nn::lenet(&engine, 0)?;
/// let config = train::TrainConfig::default(); // the book's: 10 epochs, batch 256, lr 0.2
/// let (_, report) = train::fit(&engine, &net, &train_set, &valid, &data.test, &[Device::Cpu], &config)?;
/// print!("{}", report.table());
/// # Ok::<(), lazyflow::Error>(())
/// ```
pub fn fit(
    engine: &Engine,
    model: &Sequential,
    train: &Dataset,
    valid: &Dataset,
    test: &Dataset,
    devices: &[Device],
    config: &TrainConfig,
) -> Result<(DataParallel, TrainReport)> {
    let mut dp = DataParallel::new(model, devices, config.momentum, config.weight_decay)?;
    if let Some(w) = &config.weights {
        dp.set_weights(w)?;
    }
    let names = devices.iter().map(|d| d.to_string()).collect();
    let report = epochs(engine, &mut dp, train, valid, test, config, names)?;
    Ok((dp, report))
}

/// [`fit`] over several processes: every rank calls it with the same data,
/// model shapes and `config` (checked at the start), and its own `devices`.
/// Each global minibatch of `config.batch_size` is shared out over the ranks
/// and their devices; gradients are combined by `strategy`, and communicated
/// per layer or after the backward pass by `overlap`. Every rank gets the
/// same report (sums are reduced over the ranks); only rank 0 shows progress.
///
/// ```
/// use lazyflow::{data::Dataset, dist::Dist, nn, train, Device, Engine};
/// let engine = Engine::builder().workers(1).build()?;
/// let images: Vec<f32> = (0..8 * 784).map(|i| (i % 7) as f32 / 7.0).collect();
/// let labels: Vec<u32> = (0..8).map(|i| i % 10).collect();
/// let data = Dataset { images, labels, rows: 28, cols: 28 };
/// let net = nn::lenet(&engine, 0)?;
/// let config = train::TrainConfig { epochs: 1, batch_size: 4, progress: false, ..train::TrainConfig::quick() };
/// let (_, report) = train::fit_distributed(
///     &engine, &Dist::single(), &net, &data, &data, &data, &[Device::Cpu],
///     &config, train::Strategy::AllReduce, train::Overlap::PerLayer,
/// )?;
/// assert_eq!(report.epochs.len(), 1);
/// # Ok::<(), lazyflow::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn fit_distributed(
    engine: &Engine,
    dist: &Dist,
    model: &Sequential,
    train: &Dataset,
    valid: &Dataset,
    test: &Dataset,
    devices: &[Device],
    config: &TrainConfig,
    strategy: Strategy,
    overlap: Overlap,
) -> Result<(Distributed, TrainReport)> {
    let hyper = format!(
        "{} epochs; batch {}; lr {:?}; seed {}; {} training, {} validation, {} test examples",
        config.epochs,
        config.batch_size,
        config.lr,
        config.seed,
        train.len(),
        valid.len(),
        test.len()
    );
    let mut model = Distributed::new(
        dist,
        model,
        devices,
        config.momentum,
        config.weight_decay,
        strategy,
        overlap,
        &hyper,
    )?;
    if let Some(w) = &config.weights {
        model.set_weights(w)?;
    }
    let config = TrainConfig {
        progress: config.progress && dist.is_root(),
        ..config.clone()
    };
    let names = devices
        .iter()
        .map(|d| format!("rank {} {d}", dist.rank()))
        .collect();
    let report = epochs(engine, &mut model, train, valid, test, &config, names)?;
    Ok((model, report))
}

/// The epoch loop of [`fit`] and [`fit_distributed`].
fn epochs(
    engine: &Engine,
    dp: &mut dyn Trainer,
    train: &Dataset,
    valid: &Dataset,
    test: &Dataset,
    config: &TrainConfig,
    devices: Vec<String>,
) -> Result<TrainReport> {
    let batches_per_epoch = train.len().div_ceil(config.batch_size.max(1)) as u64;
    let bar = if config.progress {
        indicatif::ProgressBar::new(batches_per_epoch * config.epochs as u64)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:30}] {pos}/{len} batches, {elapsed} elapsed, {eta} left",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut epochs = Vec::with_capacity(config.epochs);
    for epoch in 0..config.epochs {
        let lr = config.lr.at(epoch);
        bar.set_message(format!("epoch {}/{}", epoch + 1, config.epochs));
        let start = Instant::now();
        let comm_before = dp.comm_seconds();
        let blockers_before = engine.stats().blockers;
        let (mut loss, mut correct) = (Vec::new(), Vec::new());
        let mut seen = 0;
        for (x, y) in train.batches(
            engine,
            config.batch_size,
            config.seed.wrapping_add(epoch as u64),
        ) {
            bar.inc(1);
            if y.len() < dp.min_batch() {
                continue;
            }
            let metrics = dp.train_batch(&x, &y, lr)?;
            seen += y.len();
            accumulate(
                &mut loss,
                metrics.iter().map(|m| m.loss_sum.clone()).collect(),
            )?;
            accumulate(
                &mut correct,
                metrics.into_iter().map(|m| m.correct).collect(),
            )?;
        }
        let blockers = engine.stats().blockers - blockers_before;
        engine.wait_all()?;
        let train_loss = dp.total(&loss)? / seen.max(1) as f64;
        let train_acc = dp.total(&correct)? / seen.max(1) as f64;
        let seconds = start.elapsed().as_secs_f64();
        let comm_seconds = dp.comm_seconds() - comm_before;
        let valid_acc = evaluate(engine, dp, valid, config.batch_size)?;
        let stats = EpochStats {
            epoch: epoch + 1,
            lr,
            train_loss,
            train_acc,
            valid_acc,
            seconds,
            images_per_s: seen as f64 / seconds,
            blockers,
            comm_seconds,
        };
        bar.println(format!(
            "epoch {:>3}: loss {:.4}, train acc {:.4}, valid acc {:.4}, {:.0} images/s, {} blockers in the batch loop",
            stats.epoch, stats.train_loss, stats.train_acc, stats.valid_acc, stats.images_per_s, stats.blockers
        ));
        epochs.push(stats);
    }
    bar.finish_and_clear();
    let test_acc = evaluate(engine, dp, test, config.batch_size)?;
    Ok(TrainReport {
        devices,
        epochs,
        test_acc,
    })
}
