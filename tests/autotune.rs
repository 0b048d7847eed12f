//! The matrix product's kernel variants and the autotuner that picks among
//! them, on every GPU adapter: each variant against a plain f64 reference on
//! odd and vec4-aligned sizes (one test per variant), the tuner's choice and its cache file,
//! and a second process that starts warm from that file.

mod common;

use common::gpu_test;
use lazyflow::{Device, Engine, Error, Tensor, TuneSource};

/// `a (batch x m x k) @ b (k x n, or batch x k x n)`, in f64, by the
/// definition.
fn reference(
    a: &[f32],
    b: &[f32],
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
    b_batched: bool,
) -> Vec<f32> {
    let mut out = vec![0f32; batch * m * n];
    for z in 0..batch {
        let bz = if b_batched { z * k * n } else { 0 };
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k)
                    .map(|p| f64::from(a[z * m * k + i * k + p]) * f64::from(b[bz + p * n + j]))
                    .sum();
                out[z * m * n + i * n + j] = s as f32;
            }
        }
    }
    out
}

fn data(len: usize, seed: u32) -> Vec<f32> {
    (0..len)
        .map(|i| {
            ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

fn assert_close(got: &[f32], want: &[f32], k: usize, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    // Terms are in [-1, 1]: an f32 sum of k of them is off by at most about
    // k * 2^-24 * k.
    let tol = 1e-5 * (k as f32).max(1.0);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol,
            "{what}: element {i}: {g} vs reference {w}"
        );
    }
}

/// One product on `device` in `engine`, checked against the reference.
fn check(
    engine: &Engine,
    device: Device,
    (batch, m, k, n): (usize, usize, usize, usize),
    b_batched: bool,
    what: &str,
) {
    let a = data(batch * m * k, 1);
    let b = data(if b_batched { batch * k * n } else { k * n }, 2);
    let ta = Tensor::from_vec_in(engine, a.clone(), [batch, m, k])
        .unwrap()
        .to(device)
        .unwrap();
    let b_shape: Vec<usize> = if b_batched {
        vec![batch, k, n]
    } else {
        vec![k, n]
    };
    let tb = Tensor::from_vec_in(engine, b.clone(), b_shape)
        .unwrap()
        .to(device)
        .unwrap();
    let got = ta.matmul(&tb).unwrap().to_vec().unwrap();
    let want = reference(&a, &b, batch, m, k, n, b_batched);
    assert_close(
        &got,
        &want,
        k,
        &format!("{what}: {batch} x {m}x{k} @ {k}x{n}"),
    );
}

/// Sizes that leave partial tiles of every variant (1, primes, just past 64
/// and 128), batched and shared right-hand sides.
const SHAPES: [((usize, usize, usize, usize), bool); 6] = [
    ((1, 1, 1, 1), false),
    ((1, 37, 19, 53), false),
    ((1, 65, 70, 3), false),
    ((1, 130, 33, 67), false),
    ((3, 17, 9, 23), true),
    ((2, 29, 41, 5), false),
];

/// Sizes whose k and n are multiples of 4 (the `v4` variants compute only
/// those; on the odd sizes above they hand over to the default), with partial
/// tiles along m and n.
const ALIGNED: [((usize, usize, usize, usize), bool); 6] = [
    ((1, 1, 4, 4), false),
    ((1, 37, 20, 52), false),
    ((1, 130, 36, 132), false),
    ((3, 17, 12, 24), true),
    ((2, 29, 44, 8), false),
    // Empty along k: the product is zeros (and binds an empty operand).
    ((1, 5, 0, 8), false),
];

fn variant_matches_the_reference(device: Device, name: &str) {
    let engine = Engine::builder()
        .workers(2)
        .matmul_kernel(name)
        .build()
        .unwrap();
    for (shape, b_batched) in SHAPES.into_iter().chain(ALIGNED) {
        check(&engine, device, shape, b_batched, name);
    }
    // The product of a tensor with itself binds one buffer twice.
    let x = data(31 * 31, 3);
    let t = Tensor::from_vec_in(&engine, x.clone(), [31, 31])
        .unwrap()
        .to(device)
        .unwrap();
    let got = t.matmul(&t).unwrap().to_vec().unwrap();
    assert_close(
        &got,
        &reference(&x, &x, 1, 31, 31, 31, false),
        31,
        &format!("{name}: x @ x"),
    );
}

/// One test per variant (`name::gpu0`, `name::gpu_others`).
macro_rules! variant_tests {
    ($($name:ident),* $(,)?) => {
        const TESTED: &[&str] = &[$(stringify!($name)),*];
        $(
            #[allow(non_snake_case)]
            fn $name(device: Device) {
                variant_matches_the_reference(device, stringify!($name));
            }
            gpu_test!($name);
        )*
    };
}

variant_tests!(
    s64x64k16t4x4,
    s32x32k16t4x4,
    s128x64k8t8x4,
    s16x16k16t1x1,
    d32x32t4x4,
    d64x32t8x4,
    d16x64t1x4,
    d16x16t1x1,
    d128x32t16x4,
    d64x64t8x4,
    d256x32t32x4,
    d256x32t32x4v4,
    d128x64t16x8v4,
    d128x128t16x16v4,
    d256x128t32x16v4,
    d512x128t64x16v4,
    d256x256t32x32v4,
);

#[test]
fn every_variant_has_a_test() {
    let mut tested = TESTED.to_vec();
    let mut variants = lazyflow::matmul_kernels();
    tested.sort_unstable();
    variants.sort_unstable();
    assert_eq!(tested, variants);
}

#[test]
fn an_unknown_variant_is_a_configuration_error_naming_the_variants() {
    match Engine::builder().matmul_kernel("fastest").build() {
        Err(Error::Config(message)) => {
            assert!(message.contains("fastest"), "{message}");
            for name in lazyflow::matmul_kernels() {
                assert!(message.contains(name), "{message}");
            }
        }
        Err(other) => panic!("expected a configuration error, got {other}"),
        Ok(_) => panic!("expected a configuration error, got an engine"),
    }
}

fn a_scratch_file(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("lazyflow-autotune-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("cache.txt");
    let _ = std::fs::remove_file(&path);
    path
}

/// The first product of a shape class times every variant, keeps the fastest,
/// writes it to the cache file, and the result is exact.
fn the_tuner_keeps_the_fastest_variant_and_writes_it_down(device: Device) {
    let path = a_scratch_file(&format!("tuner-{device}"));
    let engine = Engine::builder()
        .workers(2)
        .autotune_cache(&path)
        .build()
        .unwrap();
    // A class no other test of this binary uses: m1024.k256.n1024.
    check(&engine, device, (1, 300, 200, 500), false, "tuned");
    let tuned = engine.tuned_kernels(device);
    let entry = tuned
        .iter()
        .find(|t| t.kernel == "matmul" && t.class == "m1024.k256.n1024")
        .unwrap_or_else(|| panic!("no choice for the class: {tuned:?}"));
    let TuneSource::Measured(timings) = &entry.source else {
        panic!("expected a measured choice: {entry:?}");
    };
    assert!(!timings.is_empty(), "no variant ran");
    let fastest = timings.iter().min_by_key(|(_, t)| *t).unwrap();
    assert_eq!(entry.variant, fastest.0, "{timings:?}");
    assert!(lazyflow::matmul_kernels().contains(&entry.variant.as_str()));
    let file = std::fs::read_to_string(&path).unwrap();
    assert!(
        file.lines()
            .any(|l| l.contains("m1024.k256.n1024") && l.contains(&entry.variant)),
        "{file}"
    );
    // The same class again is not timed again: the choice stands.
    check(&engine, device, (1, 290, 210, 510), false, "tuned again");
    assert_eq!(engine.tuned_kernels(device), tuned);
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}
gpu_test!(the_tuner_keeps_the_fastest_variant_and_writes_it_down);

/// Off, a product takes the adapter's default and nothing is timed.
fn with_tuning_off_nothing_is_timed(device: Device) {
    let engine = Engine::builder()
        .workers(2)
        .autotune(false)
        .build()
        .unwrap();
    // A class no other test of this binary uses: m256.k1024.n256.
    check(&engine, device, (1, 200, 700, 150), false, "untuned");
    assert!(
        !engine
            .tuned_kernels(device)
            .iter()
            .any(|t| t.class == "m256.k1024.n256"),
        "{:?}",
        engine.tuned_kernels(device)
    );
}
gpu_test!(with_tuning_off_nothing_is_timed);

/// Run as a child process by the test below: one tuned product, then one line
/// per choice (`TUNED class variant measured|cached`).
#[test]
#[ignore = "a child of a_second_process_starts_warm_from_the_cache_file"]
fn tuning_child() {
    let device: Device = match std::env::var("LAZYFLOW_TEST_DEVICE").as_deref() {
        Ok("gpu:0") => Device::Gpu(0),
        Ok(other) => Device::Gpu(other.trim_start_matches("gpu:").parse().unwrap()),
        Err(_) => return,
    };
    let engine = Engine::builder().workers(2).build().unwrap();
    check(&engine, device, (1, 200, 90, 400), false, "child");
    for t in engine.tuned_kernels(device) {
        let how = match t.source {
            TuneSource::Measured(_) => "measured",
            _ => "cached",
        };
        println!("TUNED {} {} {how}", t.class, t.variant);
    }
}

/// The cache file carries a choice from one process to the next.
fn a_second_process_starts_warm_from_the_cache_file(device: Device) {
    let path = a_scratch_file(&format!("warm-{device}"));
    let run = || {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "tuning_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("LAZYFLOW_TEST_DEVICE", device.to_string())
            .env("LAZYFLOW_AUTOTUNE_CACHE", &path)
            .env_remove("LAZYFLOW_AUTOTUNE")
            .env_remove("LAZYFLOW_MATMUL_KERNEL")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // The harness prints the test's name on the same line.
        let line = stdout
            .lines()
            .find_map(|l| l.find("TUNED m256.k256.n1024 ").map(|at| &l[at..]))
            .unwrap_or_else(|| panic!("no choice for the class in:\n{stdout}"))
            .to_string();
        line.split(' ')
            .skip(2)
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let first = run();
    assert_eq!(first[1], "measured", "{first:?}");
    let second = run();
    assert_eq!(second, [first[0].clone(), "cached".to_string()]);
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}
gpu_test!(a_second_process_starts_warm_from_the_cache_file);
