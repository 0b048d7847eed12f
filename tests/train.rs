//! Data-parallel training: allreduce against host sums, one device against
//! several (the same maths), the IDX reader's errors, a short run that learns,
//! and a batch loop without blockers.

mod common;

use common::device_test;
use lazyflow::data::{Dataset, FashionMnist, Idx};
use lazyflow::nn::{self, Init, Module};
use lazyflow::train::{self, allreduce, split_batch, DataParallel, TrainConfig};
use lazyflow::{Device, Engine, Error, Tensor};
use std::io::Write;

fn engine() -> Engine {
    // Two logical devices on every GPU adapter: gpu:0 and gpu:1 share one.
    Engine::builder()
        .workers(2)
        .logical_devices(2)
        .build()
        .unwrap()
}

fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

/// The device lists each test runs: the CPU alone or twice, and where there is
/// a GPU adapter its two logical devices and the CPU next to one of them.
fn device_sets(e: &Engine, k: usize) -> Vec<Vec<Device>> {
    let mut sets = vec![vec![Device::Cpu; k]];
    let g: Vec<Device> = e
        .devices()
        .into_iter()
        .filter(|d| *d != Device::Cpu)
        .collect();
    if g.len() >= 2 {
        let mut mixed = vec![Device::Cpu];
        mixed.extend(g.iter().take(k - 1));
        sets.push(mixed);
        if k == 2 {
            sets.push(vec![g[0], g[1]]);
        }
    } else if common::gpu_required() {
        panic!("LAZYFLOW_REQUIRE_GPU=1 but no GPU adapter was found");
    }
    sets
}

#[test]
fn allreduce_sums_over_two_and_three_devices() {
    let e = engine();
    for k in [2, 3] {
        for devices in device_sets(&e, k) {
            let parts: Vec<Vec<f32>> = (0..k).map(|i| data(37, i as u64)).collect();
            let tensors: Vec<Tensor> = parts
                .iter()
                .zip(&devices)
                .map(|(p, &d)| Tensor::from_slice_in(&e, p, [37]).unwrap().to(d).unwrap())
                .collect();
            let sums = allreduce(&tensors).unwrap();
            let want: Vec<f64> = (0..37)
                .map(|j| parts.iter().map(|p| p[j] as f64).sum())
                .collect();
            for (s, &d) in sums.iter().zip(&devices) {
                assert_eq!(s.device(), d);
                for (g, w) in s.to_vec().unwrap().iter().zip(&want) {
                    assert!((*g as f64 - w).abs() < 1e-5, "{devices:?}: {g} vs {w}");
                }
            }
        }
    }
    // Replicas of different shapes are refused.
    let a = Tensor::zeros_in(&e, [3]);
    let b = Tensor::zeros_in(&e, [4]);
    let err = allreduce(&[a, b]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Shape {
                op: "allreduce",
                ..
            }
        ),
        "{err}"
    );
}

/// Trains `steps` minibatches on `devices` and returns every replica's
/// parameters on the host.
fn train_steps(
    e: &Engine,
    devices: &[Device],
    weights: Option<&[f64]>,
    steps: usize,
) -> Vec<Vec<Vec<f32>>> {
    let net = nn::lenet_with(e, Init::KaimingNormal, 5).unwrap();
    let mut dp = DataParallel::new(&net, devices, 0.9, 1e-3).unwrap();
    if let Some(w) = weights {
        dp.set_weights(w).unwrap();
    }
    let batch = 12;
    for step in 0..steps {
        let x = Tensor::from_vec_in(
            e,
            data(batch * 28 * 28, 100 + step as u64)
                .iter()
                .map(|v| v.abs())
                .collect(),
            [batch, 1, 28, 28],
        )
        .unwrap();
        let y: Vec<u32> = (0..batch as u32)
            .map(|i| (i * 3 + step as u32) % 10)
            .collect();
        dp.train_batch(&x, &y, 0.05).unwrap();
        // Every replica holds the same values after each update.
        let first: Vec<Vec<f32>> = dp.replicas()[0]
            .parameters()
            .iter()
            .map(|p| p.to_vec().unwrap())
            .collect();
        for r in &dp.replicas()[1..] {
            for (p, q) in r.parameters().iter().zip(&first) {
                for (a, b) in p.to_vec().unwrap().iter().zip(q) {
                    assert!(
                        (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                        "{devices:?} step {step}: replicas differ: {a} vs {b}"
                    );
                }
            }
        }
    }
    dp.replicas()
        .iter()
        .map(|r| r.parameters().iter().map(|p| p.to_vec().unwrap()).collect())
        .collect()
}

#[test]
fn several_devices_give_the_parameters_of_one() {
    let e = engine();
    let one = train_steps(&e, &[Device::Cpu], None, 3);
    let start = nn::lenet_with(&e, Init::KaimingNormal, 5).unwrap();
    let moved = start
        .parameters()
        .iter()
        .zip(&one[0])
        .any(|(p, q)| p.to_vec().unwrap() != *q);
    assert!(moved, "training changed the parameters");
    let mut runs: Vec<(Vec<Device>, Option<Vec<f64>>)> =
        device_sets(&e, 2).into_iter().map(|d| (d, None)).collect();
    // Unequal shards (weighted by device) change nothing either.
    runs.push((vec![Device::Cpu; 2], Some(vec![1.0, 3.0])));
    for (devices, weights) in runs {
        let many = train_steps(&e, &devices, weights.as_deref(), 3);
        for (i, (p, q)) in many[0].iter().zip(&one[0]).enumerate() {
            let scale = q.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in p.iter().zip(q) {
                assert!(
                    (a - b).abs() <= 1e-3 * scale,
                    "{devices:?} parameter {i}: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn bad_input_is_an_error() {
    let e = engine();
    let net = nn::lenet(&e, 0).unwrap();
    assert!(
        DataParallel::new(&net, &[], 0.0, 0.0).is_err(),
        "no devices"
    );
    let err = train::parse_devices(&e, "cpu,npu:3").unwrap_err();
    assert!(
        err.to_string().contains("unknown device \"npu:3\""),
        "{err}"
    );
    let err = train::parse_devices(&e, "gpu:99").unwrap_err();
    assert!(err.to_string().contains("gpu:99 does not exist"), "{err}");
    assert!(train::parse_devices(&e, " , ").is_err());
    let x = Tensor::zeros_in(&e, [2, 1, 28, 28]);
    let err = split_batch(&x, &[0, 1], &[Device::Cpu; 3]).unwrap_err();
    assert!(
        err.to_string()
            .contains("a batch of 2 cannot be split over 3 devices"),
        "{err}"
    );
    assert!(
        split_batch(&x, &[0], &[Device::Cpu]).is_err(),
        "labels and examples"
    );
    let ten = Tensor::zeros_in(&e, [10, 3]);
    let labels: Vec<u32> = (0..10).collect();
    let sizes = |w: &[f64]| -> Vec<usize> {
        train::split_batch_weighted(&ten, &labels, &vec![Device::Cpu; w.len()], w)
            .unwrap()
            .iter()
            .map(|s| s.y.len())
            .collect()
    };
    assert_eq!(sizes(&[1.0, 4.0]), vec![2, 8]);
    assert_eq!(sizes(&[1.0, 1.0, 1.0]), vec![4, 3, 3]);
    assert_eq!(sizes(&[1.0, 1000.0]), vec![1, 9], "every device gets one");
    assert!(train::split_batch_weighted(&ten, &labels, &[Device::Cpu; 2], &[1.0, 0.0]).is_err());
    assert!(dp_weights_refused(&e));
    let mut dp =
        DataParallel::new(&net, &[Device::Cpu, Device::Cpu, Device::Cpu], 0.0, 0.0).unwrap();
    assert!(dp.train_batch(&x, &[0, 1], 0.1).is_err());
    // Labels out of range fail when recorded, naming the op.
    let err = dp
        .train_batch(&Tensor::zeros_in(&e, [3, 1, 28, 28]), &[0, 1, 12], 0.1)
        .unwrap_err();
    assert!(err.to_string().contains("cross_entropy"), "{err}");
    // The engine and its workers go on.
    assert_eq!((Tensor::ones_in(&e, [4]) * 2.0).sum().item().unwrap(), 8.0);
}

fn dp_weights_refused(e: &Engine) -> bool {
    let net = nn::lenet(e, 0).unwrap();
    let mut dp = DataParallel::new(&net, &[Device::Cpu, Device::Cpu], 0.0, 0.0).unwrap();
    dp.set_weights(&[1.0]).is_err()
        && dp.set_weights(&[1.0, f64::NAN]).is_err()
        && dp.set_weights(&[1.0, 2.0]).is_ok()
}

fn idx_bytes(magic: [u8; 4], dims: &[u32], body: &[u8]) -> Vec<u8> {
    let mut v = magic.to_vec();
    for d in dims {
        v.extend(d.to_be_bytes());
    }
    v.extend(body);
    v
}

#[test]
fn malformed_idx_files_give_the_documented_errors() {
    let p = std::path::Path::new("x.idx");
    let ok = idx_bytes([0, 0, 8, 2], &[2, 3], &[1, 2, 3, 4, 5, 6]);
    assert_eq!(Idx::parse(&ok, p).unwrap().dims, vec![2, 3]);
    let err = Idx::parse(&idx_bytes([0x12, 0, 8, 2], &[2, 3], &[0; 6]), p).unwrap_err();
    assert!(err.to_string().contains("wrong magic number"), "{err}");
    assert!(
        err.to_string().starts_with("x.idx: "),
        "names the file: {err}"
    );
    let err = Idx::parse(&idx_bytes([0, 0, 0x0d, 1], &[2], &[0; 8]), p).unwrap_err();
    assert!(err.to_string().contains("not unsigned bytes"), "{err}");
    let err = Idx::parse(&ok[..ok.len() - 1], p).unwrap_err();
    assert!(err.to_string().contains("truncated"), "{err}");
    assert!(Idx::parse(&ok[..9], p)
        .unwrap_err()
        .to_string()
        .contains("truncated"));
    // Gzipped, as Debian ships it.
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&ok).unwrap();
    assert_eq!(
        Idx::parse(&gz.finish().unwrap(), p).unwrap().data,
        vec![1, 2, 3, 4, 5, 6]
    );
    // Image and label counts that disagree.
    let images = Idx::parse(&idx_bytes([0, 0, 8, 3], &[2, 2, 2], &[0; 8]), p).unwrap();
    let labels = Idx::parse(&idx_bytes([0, 0, 8, 1], &[3], &[0, 1, 2]), p).unwrap();
    let err = Dataset::from_idx(images, labels, p).unwrap_err();
    assert!(err.to_string().contains("2 images but 3 labels"), "{err}");
    // A directory without the data says how to get it.
    let err = FashionMnist::load(Some(std::path::Path::new("/nonexistent"))).unwrap_err();
    assert!(
        err.to_string()
            .contains("apt-get install dataset-fashion-mnist"),
        "{err}"
    );
}

fn fashion_mnist() -> FashionMnist {
    // A missing data set fails: CI installs Debian's package.
    FashionMnist::load(None).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn fashion_mnist_loads_whole() {
    let d = fashion_mnist();
    assert_eq!((d.train.len(), d.test.len()), (60_000, 10_000));
    assert_eq!((d.train.rows, d.train.cols), (28, 28));
    assert!(d.train.labels.iter().all(|&l| l < 10));
    assert!(d.train.images.iter().all(|&p| (0.0..=1.0).contains(&p)));
    let (t, v) = d.train.split(10_000, 3);
    assert_eq!((t.len(), v.len()), (50_000, 10_000));
    // Each class about a tenth of the training set.
    for c in 0..10 {
        let n = d.train.labels.iter().filter(|&&l| l == c).count();
        assert_eq!(n, 6_000, "class {c}");
    }
}

/// The quick run (`TrainConfig::quick`, as `train_lenet --quick`) must learn:
/// 70% validation accuracy.
fn a_short_run_learns(device: Device) {
    // One logical device per adapter, as the test macro numbers them.
    let e = Engine::builder().workers(2).build().unwrap();
    let d = fashion_mnist();
    let (train_set, valid) = d.train.split(1_000, 11);
    let train_set = train_set.take(2_000);
    let test = d.test.take(1_000);
    let net = nn::lenet_with(&e, Init::KaimingNormal, 11).unwrap();
    let config = TrainConfig {
        seed: 11,
        ..TrainConfig::quick()
    };
    let (_, report) = train::fit(&e, &net, &train_set, &valid, &test, &[device], &config).unwrap();
    eprintln!("{}", report.table());
    let last = report.epochs.last().unwrap();
    assert!(
        last.valid_acc >= 0.70,
        "{device}: validation accuracy {}",
        last.valid_acc
    );
    assert!(
        report.test_acc >= 0.65,
        "{device}: test accuracy {}",
        report.test_acc
    );
    assert!(last.train_loss < report.epochs[0].train_loss);
    // The batch loop only recorded.
    assert!(
        report.epochs.iter().all(|e| e.blockers == 0),
        "{:?}",
        report.epochs
    );
    assert_eq!(report.epochs[2].lr, 0.01);
}
device_test!(a_short_run_learns);
