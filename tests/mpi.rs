//! Training over MPI ranks (`cargo test --release --features mpi --test mpi`,
//! with Open MPI installed): each test starts this test binary under
//! `mpirun -np 2`, running one of the ignored `rank_*` tests below as every
//! rank, and checks what the ranks wrote and printed.
#![cfg(feature = "mpi")]

use lazyflow::dist::Dist;
use lazyflow::nn::{Activation, Init, Linear, Module, Sequential};
use lazyflow::train::{DataParallel, Distributed, Overlap, Strategy};
use lazyflow::{Device, Engine, Tensor};
use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const STEPS: usize = 4;
const BATCH: usize = 12;

fn engine() -> Engine {
    Engine::builder().workers(2).build().unwrap()
}

fn mlp(e: &Engine, hidden: usize) -> Sequential {
    Sequential::new()
        .add(Linear::new(e, 6, hidden, Init::KaimingNormal, 3).unwrap())
        .add(Activation::Relu)
        .add(Linear::new(e, hidden, 4, Init::XavierUniform, 4).unwrap())
}

fn batch(e: &Engine, step: usize) -> (Tensor, Vec<u32>) {
    let x: Vec<f32> = (0..BATCH * 6)
        .map(|i| ((i * 37 + step * 11) % 17) as f32 / 17.0 - 0.4)
        .collect();
    let y = (0..BATCH).map(|i| ((i + step) % 4) as u32).collect();
    (Tensor::from_vec_in(e, x, [BATCH, 6]).unwrap(), y)
}

fn flat(params: &[Tensor]) -> Vec<f32> {
    params.iter().flat_map(|p| p.to_vec().unwrap()).collect()
}

/// Runs the ignored test `name` as 2 MPI ranks with `env`, killed after two
/// minutes; returns whether mpirun succeeded, its output, and how long it took.
fn mpirun(name: &str, env: &[(&str, &str)]) -> (bool, String, Duration) {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new("mpirun");
    cmd.args(["-np", "2", "--oversubscribe", "--allow-run-as-root"])
        .arg(exe)
        .args([
            "--exact",
            name,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .expect("mpirun is installed (apt-get install openmpi-bin)");
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    (status.success(), out, start.elapsed())
}

#[test]
fn two_ranks_reach_the_parameters_of_one_process() {
    let e = engine();
    let mut dp = DataParallel::new(&mlp(&e, 8), &[Device::Cpu], 0.9, 1e-3).unwrap();
    for step in 0..STEPS {
        let (x, y) = batch(&e, step);
        dp.train_batch(&x, &y, 0.1).unwrap();
    }
    let reference = flat(&dp.replicas()[0].parameters());
    for strategy in ["allreduce", "ps"] {
        for overlap in ["per-layer", "after-backward"] {
            let dir = std::env::temp_dir().join(format!(
                "lazyflow-mpi-{}-{strategy}-{overlap}",
                std::process::id()
            ));
            std::fs::create_dir_all(&dir).unwrap();
            let (ok, out, _) = mpirun(
                "rank_trains",
                &[
                    ("LAZYFLOW_TEST_STRATEGY", strategy),
                    ("LAZYFLOW_TEST_OVERLAP", overlap),
                    ("LAZYFLOW_TEST_OUT", dir.to_str().unwrap()),
                ],
            );
            assert!(ok, "{strategy} {overlap}: mpirun failed:\n{out}");
            for rank in 0..2 {
                let text = std::fs::read_to_string(dir.join(format!("rank{rank}.txt")))
                    .unwrap_or_else(|e| panic!("rank {rank} wrote nothing ({e}):\n{out}"));
                let got: Vec<f32> = text
                    .split_whitespace()
                    .map(|v| v.parse().unwrap())
                    .collect();
                assert_eq!(got.len(), reference.len());
                for (i, (a, b)) in got.iter().zip(&reference).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                        "{strategy} {overlap} rank {rank} value {i}: {a} vs {b}"
                    );
                }
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

#[test]
#[ignore = "run as an MPI rank by two_ranks_reach_the_parameters_of_one_process"]
fn rank_trains() {
    let var = |k: &str| std::env::var(k).unwrap();
    let dist = Dist::from_env().unwrap();
    assert_eq!(dist.size(), 2, "{}", dist.transport());
    let e = engine();
    let mut m = Distributed::new(
        &dist,
        &mlp(&e, 8),
        &[Device::Cpu],
        0.9,
        1e-3,
        var("LAZYFLOW_TEST_STRATEGY").parse().unwrap(),
        var("LAZYFLOW_TEST_OVERLAP").parse().unwrap(),
        "test",
    )
    .unwrap();
    for step in 0..STEPS {
        let (x, y) = batch(&e, step);
        m.train_batch(&x, &y, 0.1).unwrap();
    }
    let text: Vec<String> = flat(&m.parameters())
        .iter()
        .map(|v| v.to_string())
        .collect();
    let path =
        std::path::Path::new(&var("LAZYFLOW_TEST_OUT")).join(format!("rank{}.txt", dist.rank()));
    std::fs::write(path, text.join(" ")).unwrap();
}

#[test]
fn mismatched_shapes_and_wrong_sizes_are_errors_without_a_hang() {
    for (fault, expected) in [
        ("shapes", "rank 1 has the model's parameter shapes"),
        ("size", "rank 1 sent 3 values, this rank (0) has 2"),
    ] {
        let (ok, out, took) = mpirun("rank_faults", &[("LAZYFLOW_TEST_FAULT", fault)]);
        assert!(ok, "{fault}: the ranks' checks failed:\n{out}");
        assert!(out.contains(expected), "{fault}: {out}");
        assert!(took < Duration::from_secs(60), "{fault} took {took:?}");
    }
}

#[test]
#[ignore = "run as an MPI rank by mismatched_shapes_and_wrong_sizes_are_errors_without_a_hang"]
fn rank_faults() {
    let dist = Dist::from_env().unwrap();
    let e = engine();
    let other = 1 - dist.rank();
    let err = match std::env::var("LAZYFLOW_TEST_FAULT").unwrap().as_str() {
        "shapes" => {
            let hidden = if dist.rank() == 1 { 9 } else { 8 };
            Distributed::new(
                &dist,
                &mlp(&e, hidden),
                &[Device::Cpu],
                0.9,
                0.0,
                Strategy::AllReduce,
                Overlap::PerLayer,
                "",
            )
            .err()
            .expect("different models refuse to start")
            .to_string()
        }
        _ => {
            let n = if dist.rank() == 1 { 3 } else { 2 };
            let x = Tensor::full_in(&e, [n], 1.0);
            let err = dist.allreduce_sum(&x, "x").unwrap().to_vec().unwrap_err();
            // The ranks are still in step after a mismatch they all saw.
            let ok = dist
                .allreduce_sum(&Tensor::full_in(&e, [2], 1.0), "y")
                .unwrap();
            assert_eq!(ok.to_vec().unwrap(), vec![2.0, 2.0]);
            err.to_string()
        }
    };
    println!("rank {}: {err}", dist.rank());
    assert!(err.contains(&format!("rank {other}")), "{err}");
}

#[test]
fn a_rank_that_stops_taking_part_is_named_after_the_timeout() {
    let (ok, out, took) = mpirun("rank_stops", &[("LAZYFLOW_DIST_TIMEOUT", "2")]);
    // Rank 0 reports rank 1 and ends the job (MPI_Abort): mpirun fails.
    assert!(!ok, "{out}");
    assert!(
        out.contains("rank 1 did not reach this step within 2 s"),
        "{out}"
    );
    assert!(took < Duration::from_secs(60), "took {took:?}");
}

#[test]
#[ignore = "run as an MPI rank by a_rank_that_stops_taking_part_is_named_after_the_timeout"]
fn rank_stops() {
    let dist = Dist::from_env().unwrap();
    let e = engine();
    let x = Tensor::full_in(&e, [2], 1.0);
    assert_eq!(
        dist.allreduce_sum(&x, "x").unwrap().to_vec().unwrap(),
        vec![2.0; 2]
    );
    if dist.rank() == 1 {
        // Leaves without the second step.
        return;
    }
    let err = dist.allreduce_sum(&x, "y").unwrap().to_vec().unwrap_err();
    println!("rank 0: {err}");
}
