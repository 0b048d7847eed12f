//! Running one test body on every device, one named test per device.
//!
//! `device_test!(name)` turns `fn name(device: Device)` into three tests:
//! `name::cpu`, `name::gpu0` (the first GPU adapter the engine lists) and
//! `name::gpu_others` (every further adapter). `gpu_test!(name)` generates only the
//! two GPU tests, for behaviour the CPU does not have. Devices are discovered at
//! run time: when there is no GPU adapter, `gpu0` prints that it was skipped and
//! passes, unless `LAZYFLOW_REQUIRE_GPU=1` (set by `.ci/run`), where it fails;
//! `gpu_others` says so when there is no second adapter, which is not a failure.
//!
//! A body builds its own engines (with the mode, fusion and workers it needs)
//! and runs on `device` in them: with one logical device per adapter, which is
//! the default, `Device::Gpu(i)` is adapter `i` in every engine of the process.

#![allow(dead_code)]

use lazyflow::{Device, Engine};
use std::sync::mpsc::{channel, RecvTimeoutError};
use std::sync::OnceLock;
use std::time::Duration;

/// Runs `f` on its own thread and returns its result, failing if it takes more
/// than `secs` (a hang: the hung thread is leaked) or panics (with its panic).
pub fn within<T: Send + 'static>(
    secs: u64,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = channel();
    let scenario = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(value) => value,
        Err(RecvTimeoutError::Timeout) => panic!("HANG: {what} did not finish in {secs} s"),
        Err(RecvTimeoutError::Disconnected) => match scenario.join() {
            Err(panic) => std::panic::resume_unwind(panic),
            Ok(()) => panic!("{what}: scenario ended without a result"),
        },
    }
}

/// Whether the environment demands a GPU (`LAZYFLOW_REQUIRE_GPU=1`).
pub fn gpu_required() -> bool {
    std::env::var("LAZYFLOW_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// An engine that lists the devices, opened once per test binary.
fn probe() -> &'static Engine {
    static PROBE: OnceLock<Engine> = OnceLock::new();
    PROBE.get_or_init(|| Engine::builder().workers(1).build().unwrap())
}

/// The GPU devices the engine finds, in its order.
pub fn gpus() -> Vec<Device> {
    probe()
        .devices()
        .into_iter()
        .filter(|d| *d != Device::Cpu)
        .collect()
}

/// What `device` is, for the test's output.
pub fn describe(device: Device) -> String {
    probe().describe(device)
}

/// The name and backend of the adapter behind a GPU device (to find it in
/// engines with other settings).
pub fn adapter(device: Device) -> Option<(String, String)> {
    probe().gpu_info(device).map(|i| (i.name, i.backend))
}

/// Runs `body` on the CPU device.
pub fn on_cpu(test: &str, body: fn(Device)) {
    eprintln!("{test}: running on the cpu");
    body(Device::Cpu);
}

/// Runs `body` on the first GPU adapter; skips (or fails, when a GPU is
/// required) without one.
pub fn on_gpu0(test: &str, body: fn(Device)) {
    match gpus().first() {
        Some(&gpu) => {
            eprintln!("{test}: running on {gpu}: {}", describe(gpu));
            body(gpu);
        }
        None if gpu_required() => {
            panic!("{test}: LAZYFLOW_REQUIRE_GPU=1 but no GPU adapter was found")
        }
        None => eprintln!("{test}: SKIPPED on gpu:0: no GPU adapter was found"),
    }
}

/// Runs `body` on every GPU adapter after the first, saying so when there is
/// none.
pub fn on_other_gpus(test: &str, body: fn(Device)) {
    let others: Vec<Device> = gpus().into_iter().skip(1).collect();
    if others.is_empty() {
        eprintln!("{test}: no GPU adapter besides gpu:0, nothing to run");
    }
    for gpu in others {
        eprintln!("{test}: running on {gpu}: {}", describe(gpu));
        body(gpu);
    }
}

/// One test per device (`name::cpu`, `name::gpu0`, `name::gpu_others`) for
/// `fn name(device: Device)`.
#[allow(unused_macros)]
macro_rules! device_test {
    ($name:ident) => {
        mod $name {
            #[test]
            fn cpu() {
                crate::common::on_cpu(concat!(stringify!($name), "::cpu"), super::$name);
            }

            #[test]
            fn gpu0() {
                crate::common::on_gpu0(concat!(stringify!($name), "::gpu0"), super::$name);
            }

            #[test]
            fn gpu_others() {
                crate::common::on_other_gpus(
                    concat!(stringify!($name), "::gpu_others"),
                    super::$name,
                );
            }
        }
    };
}

/// One test per GPU (`name::gpu0`, `name::gpu_others`) for `fn name(device:
/// Device)`, for behaviour that only GPUs have.
#[allow(unused_macros)]
macro_rules! gpu_test {
    ($name:ident) => {
        mod $name {
            #[test]
            fn gpu0() {
                crate::common::on_gpu0(concat!(stringify!($name), "::gpu0"), super::$name);
            }

            #[test]
            fn gpu_others() {
                crate::common::on_other_gpus(
                    concat!(stringify!($name), "::gpu_others"),
                    super::$name,
                );
            }
        }
    };
}

// Not every test file uses both.
#[allow(unused_imports)]
pub(crate) use {device_test, gpu_test};

/// A comparison's result as the tensor ops give it: 1.0 or 0.0.
pub fn flag(b: bool) -> f32 {
    if b {
        1.0
    } else {
        0.0
    }
}

/// numpy's maximum: NaN if either operand is NaN.
pub fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

/// numpy's minimum: NaN if either operand is NaN.
pub fn nan_min(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.min(b)
    }
}
