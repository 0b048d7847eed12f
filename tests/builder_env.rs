//! `Engine::builder()` reads `LAZYFLOW_*` environment variables; explicit
//! settings win over them, and invalid values are configuration errors that name
//! the variable.
//!
//! Setting environment variables races with any other test of the same process
//! that builds an engine, so this file holds exactly one test.

use lazyflow::{Device, Engine, Error, Mode, Tensor};

const VARS: [&str; 7] = [
    "LAZYFLOW_AUTOTUNE",
    "LAZYFLOW_MATMUL_KERNEL",
    "LAZYFLOW_MODE",
    "LAZYFLOW_WORKERS",
    "LAZYFLOW_CPU_THREADS",
    "LAZYFLOW_FUSION",
    "LAZYFLOW_BACKENDS",
];

/// Sets `key` to `value` (or removes it for `None`).
fn set(key: &str, value: Option<&str>) {
    match value {
        Some(v) => std::env::set_var(key, v),
        None => std::env::remove_var(key),
    }
}

/// Builds an engine with only `key=value` set, and returns the configuration
/// error it gives.
#[track_caller]
fn config_error(key: &str, value: &str) -> String {
    set(key, Some(value));
    let result = Engine::builder().build();
    set(key, None);
    match result {
        Err(Error::Config(message)) => message,
        Err(other) => panic!("{key}={value:?}: expected a configuration error, got {other}"),
        Ok(_) => panic!("{key}={value:?}: expected a configuration error, got an engine"),
    }
}

/// Kernels dispatched on `gpu` by a chain of three elementwise ops.
fn chain_kernels(e: &Engine, gpu: Device) -> u64 {
    let before = e.kernels_dispatched(gpu);
    let x = Tensor::ones_in(e, [64]).to(gpu).unwrap();
    let y = ((&x + 1.0) * 2.0).exp();
    assert!((y.to_vec().unwrap()[0] - 4f32.exp()).abs() < 1e-3);
    e.kernels_dispatched(gpu) - before
}

#[test]
fn builder_reads_and_validates_the_environment() {
    for key in VARS {
        set(key, None);
    }

    // Defaults without the variables.
    let e = Engine::builder().build().unwrap();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert_eq!(
        (e.mode(), e.workers(), e.cpu_threads()),
        (Mode::Lazy, cores, cores)
    );
    drop(e);

    // Each variable is read (case and surrounding blanks do not matter for the
    // mode; blank values count as unset).
    for (value, mode) in [
        ("async", Mode::Async),
        (" SYNC ", Mode::Sync),
        ("lazy", Mode::Lazy),
    ] {
        set("LAZYFLOW_MODE", Some(value));
        assert_eq!(Engine::builder().build().unwrap().mode(), mode, "{value:?}");
    }
    set("LAZYFLOW_MODE", Some("  "));
    assert_eq!(Engine::builder().build().unwrap().mode(), Mode::Lazy);
    set("LAZYFLOW_MODE", None);

    set("LAZYFLOW_WORKERS", Some("3"));
    assert_eq!(Engine::builder().build().unwrap().workers(), 3);
    set("LAZYFLOW_WORKERS", None);

    set("LAZYFLOW_CPU_THREADS", Some("1"));
    assert_eq!(Engine::builder().build().unwrap().cpu_threads(), 1);
    set("LAZYFLOW_CPU_THREADS", None);

    // No backend: the CPU only, even where a GPU exists.
    set("LAZYFLOW_BACKENDS", Some("none"));
    assert_eq!(
        Engine::builder().build().unwrap().devices(),
        vec![Device::Cpu]
    );
    set("LAZYFLOW_BACKENDS", None);

    // Fusion is visible in the kernel count where there is a GPU: one generated
    // kernel for the chain, or one per op.
    let probe = Engine::builder().workers(1).build().unwrap();
    let gpu = probe.devices().into_iter().find(|d| *d != Device::Cpu);
    drop(probe);
    match gpu {
        Some(gpu) => {
            for (value, kernels) in [("0", 3), ("off", 3), ("1", 1), ("true", 1)] {
                set("LAZYFLOW_FUSION", Some(value));
                let e = Engine::builder().workers(1).build().unwrap();
                assert_eq!(chain_kernels(&e, gpu), kernels, "LAZYFLOW_FUSION={value}");
            }
            set("LAZYFLOW_FUSION", None);
        }
        None => eprintln!("no GPU adapter: LAZYFLOW_FUSION is only checked for invalid values"),
    }

    // Explicit settings win over the environment, even over invalid values.
    set("LAZYFLOW_MODE", Some("async"));
    set("LAZYFLOW_WORKERS", Some("many"));
    set("LAZYFLOW_CPU_THREADS", Some("-1"));
    set("LAZYFLOW_FUSION", Some("maybe"));
    set("LAZYFLOW_BACKENDS", Some("opengl"));
    let e = Engine::builder()
        .mode(Mode::Sync)
        .workers(2)
        .cpu_threads(1)
        .fusion(true)
        .backends("none")
        .build()
        .unwrap();
    assert_eq!(
        (e.mode(), e.workers(), e.cpu_threads(), e.devices()),
        (Mode::Sync, 2, 1, vec![Device::Cpu])
    );
    drop(e);
    for key in VARS {
        set(key, None);
    }

    // Invalid values are configuration errors that say what is wrong.
    let message = config_error("LAZYFLOW_MODE", "fast");
    assert!(
        message.contains("LAZYFLOW_MODE") && message.contains("fast"),
        "{message}"
    );
    for value in ["many", "-1", "2.5"] {
        let message = config_error("LAZYFLOW_WORKERS", value);
        assert!(
            message.contains("LAZYFLOW_WORKERS") && message.contains(value),
            "{message}"
        );
        let message = config_error("LAZYFLOW_CPU_THREADS", value);
        assert!(
            message.contains("LAZYFLOW_CPU_THREADS") && message.contains(value),
            "{message}"
        );
    }
    let message = config_error("LAZYFLOW_WORKERS", "0");
    assert!(message.contains("worker"), "{message}");
    let message = config_error("LAZYFLOW_CPU_THREADS", "0");
    assert!(message.contains("thread"), "{message}");
    let message = config_error("LAZYFLOW_FUSION", "maybe");
    assert!(
        message.contains("LAZYFLOW_FUSION") && message.contains("maybe"),
        "{message}"
    );
    let message = config_error("LAZYFLOW_BACKENDS", "vulkan,opengl");
    assert!(message.contains("opengl"), "{message}");
    let message = config_error("LAZYFLOW_AUTOTUNE", "maybe");
    assert!(
        message.contains("LAZYFLOW_AUTOTUNE") && message.contains("maybe"),
        "{message}"
    );
    // A pinned matmul kernel must be one of the variants; the error lists them.
    let message = config_error("LAZYFLOW_MATMUL_KERNEL", "fastest");
    assert!(
        message.contains("fastest") && message.contains("s64x64k16t4x4"),
        "{message}"
    );
    set("LAZYFLOW_MATMUL_KERNEL", Some(" d32x32t4x4 "));
    assert!(Engine::builder().build().is_ok());
    set("LAZYFLOW_MATMUL_KERNEL", None);
}
