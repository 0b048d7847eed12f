//! Every demonstration of the tour at quick sizes, on every device: its JSON has
//! every key with a finite, positive value, and what it computed matches a naive
//! CPU reference (`examples/demos/reference.rs`: plain loops). No timing
//! assertions: the figures only have to be real measurements.
//!
//! With `LAZYFLOW_REQUIRE_GPU=1` finding no GPU adapter is a failure.

#[path = "../examples/demos/mod.rs"]
mod demos;

use demos::{reference, Progress, Sizes};
use lazyflow::{Device, Engine, Mode, DEFAULT_HIGH_WATERMARK};
use serde_json::Value;
use std::sync::Mutex;

/// The parallel demonstration sets `LP_NUM_THREADS` while it opens its adapter;
/// no other test of this file may open one meanwhile.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn require_gpu() -> bool {
    std::env::var("LAZYFLOW_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// The measured devices, failing if a GPU is required and none is there.
fn devices(engine: &Engine) -> Vec<Device> {
    let devices = demos::measured_devices(engine);
    assert_eq!(devices[0], Device::Cpu);
    if require_gpu() {
        assert!(
            devices.len() >= 2,
            "LAZYFLOW_REQUIRE_GPU=1 but no GPU adapter was found"
        );
    }
    devices
}

/// `v[key]` is a finite number greater than zero.
#[track_caller]
fn positive(v: &Value, key: &str) -> f64 {
    let x = v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} missing or not a number in {v}"));
    assert!(x.is_finite() && x > 0.0, "{key} = {x} in {v}");
    x
}

#[track_caller]
fn all_positive(v: &Value, keys: &[&str]) {
    for k in keys {
        positive(v, k);
    }
}

#[test]
fn asynchronous_benchmark_on_every_device() {
    let _s = serial();
    let sizes = Sizes::quick();
    let engine = Engine::builder().mode(Mode::Async).build().unwrap();
    for d in devices(&engine) {
        let r = demos::async_matmul::run(&engine, d, &sizes, &Progress::quiet()).unwrap();
        all_positive(
            &r.json(),
            &[
                "dispatch_s",
                "synced_s",
                "cpu_gemm_s",
                "gflops",
                "cpu_gemm_gflops",
            ],
        );
        let n = r.n;
        let want = reference::matmul(&r.input, &r.input, n, n, n);
        reference::check_close(&format!("{d}: x @ x"), &r.output, &want, 1e-4).unwrap();
    }
}

#[test]
fn sync_vs_async_on_every_device() {
    let _s = serial();
    let sizes = Sizes::quick();
    let engine = Engine::builder().build().unwrap();
    for d in devices(&engine) {
        // `run` checks every value it computed against 2 and `ops`.
        let r = demos::sync_async::run(&engine, d, &sizes, &Progress::quiet()).unwrap();
        assert_eq!(r.ops, sizes.loop_ops);
        for l in [&r.increment, &r.kept, &r.chain] {
            let j = l.json();
            all_positive(
                &j,
                &[
                    "sync_s",
                    "async_s",
                    "ratio",
                    "sync_kernels",
                    "async_kernels",
                ],
            );
            // Synchronizing after each op runs each op on its own.
            assert!(l.sync_kernels >= r.ops as u64, "{d}: {j}");
            assert!(l.async_kernels <= l.sync_kernels, "{d}: {j}");
        }
        if d == Device::Cpu {
            // The CPU computes only the last y (the only one left to read),
            // and every kept one.
            assert_eq!(r.increment.async_kernels, 1, "{d}");
            assert!(r.kept.async_kernels >= r.ops as u64, "{d}");
        } else {
            // A GPU computes only the last y (the only one left to read), and
            // fuses the kept ones.
            assert_eq!(r.increment.async_kernels, 1, "{d}");
            assert!(r.kept.async_kernels < r.ops as u64, "{d}");
        }
    }
}

#[test]
fn blockers_on_every_device() {
    let _s = serial();
    let sizes = Sizes::quick();
    let engine = Engine::builder().mode(Mode::Lazy).build().unwrap();
    for d in devices(&engine) {
        let r = demos::blockers::run(&engine, d, &sizes, &Progress::quiet()).unwrap();
        let j = r.json();
        all_positive(
            &j,
            &[
                "wait_to_read_s",
                "pending_after_wait_to_read",
                "wait_all_s",
                "explicit_blockers",
                "implicit_blockers",
            ],
        );
        // In Lazy mode nothing demanded the unrelated matmul and tanh nodes.
        assert_eq!(r.pending_after_wait_to_read, 2 * (r.steps + 1), "{d}");
        assert_eq!(r.implicit_blockers, 3, "{d}: to_vec, item, print");
        assert_eq!(r.z, vec![2.0; 4]);
        assert_eq!(r.z_sum, 8.0);
        assert!(r.printed.contains("[2.0, 2.0, 2.0, 2.0]"), "{}", r.printed);
        let want = demos::blockers::reference_unrelated(&r);
        reference::check_close(&format!("{d}: unrelated work"), &r.unrelated, &want, 1e-4).unwrap();
    }
}

#[test]
fn parallel_on_two_devices() {
    let _s = serial();
    let r = demos::parallel::run(&Sizes::quick(), &Progress::quiet()).unwrap();
    let r = match r {
        Ok(r) => r,
        Err(why) => {
            assert!(!require_gpu(), "parallel demonstration skipped: {why}");
            return;
        }
    };
    all_positive(
        &r.json(),
        &["dev0_s", "dev1_s", "both_s", "barrier_s", "speedup"],
    );
    assert_ne!(r.devices[0], r.devices[1]);
    for i in 0..2 {
        let want = reference::tanh_chain(&r.y0[i], &r.w[i], r.n, r.steps[i]);
        reference::check_close(&r.names[i], &r.out[i], &want, 1e-4).unwrap();
    }
}

#[test]
fn overlap_on_the_first_gpu() {
    let _s = serial();
    let engine = Engine::builder().build().unwrap();
    let Some(&gpu) = devices(&engine).get(1) else {
        return; // no GPU, and none required
    };
    let r = demos::overlap::run(&engine, gpu, &Sizes::quick(), &Progress::quiet()).unwrap();
    all_positive(
        &r.json(),
        &["serial_s", "overlap_s", "compute_s", "copy_s", "speedup"],
    );
    assert_eq!(r.ws.len(), Sizes::quick().overlap_k);
    for (i, w) in r.ws.iter().enumerate() {
        let want = reference::matmul(&r.a, w, r.n, r.n, r.n);
        reference::check_close("serialized copy", &r.serial[i], &want, 1e-4).unwrap();
        reference::check_close("overlapped copy", &r.overlapped[i], &want, 1e-4).unwrap();
    }
}

#[test]
fn bounded_queue_stays_under_the_bound() {
    let _s = serial();
    let sizes = Sizes::quick();
    assert!(sizes.backpressure_ops > DEFAULT_HIGH_WATERMARK);
    let r = demos::bounded_queue::run(&sizes, &Progress::quiet()).unwrap();
    let ops = sizes.backpressure_ops;
    assert!(
        r.bounded_peak_nodes <= DEFAULT_HIGH_WATERMARK,
        "{}",
        r.json()
    );
    assert!(r.unbounded_peak_nodes >= ops, "{}", r.json());
    assert_eq!(r.bounded_result, vec![ops as f32; 16]);
    assert_eq!(r.unbounded_result, vec![ops as f32; 16]);
    let keys = ["bounded_peak_nodes", "unbounded_peak_nodes"];
    all_positive(&r.json(), &keys);
    if cfg!(target_os = "linux") {
        all_positive(&r.json(), &["bounded_peak_rss_mb", "unbounded_peak_rss_mb"]);
    }
}

/// The whole tour, as `tour --quick --json` writes it: the shape the README and
/// the issue give, every figure finite and positive.
#[test]
fn tour_json_has_every_key() {
    let _s = serial();
    let tour = demos::tour(&Sizes::quick(), &Progress::quiet()).unwrap();
    let j = tour.json();
    positive(&j["machine"], "cores");
    let devices = j["devices"].as_array().unwrap();
    assert_eq!(devices.len(), tour.devices.len());
    assert_eq!(devices[0]["backend"], "cpu");
    if require_gpu() {
        assert!(devices.len() >= 2);
    }
    for d in devices {
        assert!(d["name"].as_str().is_some_and(|n| !n.is_empty()), "{d}");
        let backend = d["backend"].as_str().unwrap();
        assert!(
            ["cpu", "vulkan", "gl", "metal", "dx12"].contains(&backend),
            "{backend}"
        );
        all_positive(
            &d["async_matmul"],
            &["dispatch_s", "synced_s", "cpu_gemm_s"],
        );
        all_positive(
            &d["increment"],
            &[
                "sync_s",
                "async_s",
                "ratio",
                "sync_kernels",
                "async_kernels",
            ],
        );
        for key in ["increment_kept", "chain"] {
            all_positive(&d[key], &["sync_s", "async_s", "ratio", "async_kernels"]);
        }
    }
    let gpu = devices.len() >= 2;
    if gpu {
        all_positive(
            &j["parallel"],
            &["dev0_s", "dev1_s", "both_s", "barrier_s", "speedup"],
        );
        assert_eq!(j["parallel"]["devices"].as_array().unwrap().len(), 2);
        all_positive(&j["overlap"], &["serial_s", "overlap_s"]);
    } else {
        assert!(j["parallel"]["skipped"].is_string());
        assert!(j["overlap"]["skipped"].is_string());
    }
    let keys = ["bounded_peak_nodes", "unbounded_peak_nodes"];
    all_positive(&j["backpressure"], &keys);
    if cfg!(target_os = "linux") {
        all_positive(
            &j["backpressure"],
            &["bounded_peak_rss_mb", "unbounded_peak_rss_mb"],
        );
    }
}
