//! Several processes, as ranks in one process (the MPI runs are in
//! `tests/mpi.rs`): deferred tasks, collectives against sums by hand, the
//! errors for a missing rank, a wrong-sized buffer and a different model, and
//! training over 2 ranks against 1 process on the same batches.

use lazyflow::dist::Dist;
use lazyflow::nn::{self, Activation, Init, Linear, Module, Sequential};
use lazyflow::train::{DataParallel, Distributed, Overlap, Strategy};
use lazyflow::{Device, Engine, Error, Tensor};
use std::time::{Duration, Instant};

fn engine() -> Engine {
    Engine::builder().workers(2).build().unwrap()
}

/// Runs `f` on one thread per rank, each with its own engine (like separate
/// processes), and returns what each returned, by rank.
fn on_ranks<T: Send>(ranks: Vec<Dist>, f: impl Fn(&Engine, &Dist) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = ranks
            .iter()
            .map(|d| s.spawn(move || f(&engine(), d)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_deferred_task_holds_its_dependents_until_it_finishes() {
    let e = engine();
    let x = e.var(0u32);
    let mut t = e.task("slow");
    let w = t.write(&x);
    t.run_deferred(move |done| {
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            *w.write() = 5;
            done.finish(Ok::<(), String>(()));
        });
    })
    .unwrap();
    let y = e.var(0u32);
    let mut t = e.task("after");
    let (r, w) = (t.read(&x), t.write(&y));
    t.run(move || *w.write() = *r.read() * 2).unwrap();
    assert_eq!(y.get().unwrap(), 10);
}

#[test]
fn a_lost_completion_fails_the_task_and_skips_its_dependents() {
    for panic in [false, true] {
        let e = engine();
        let x = e.var(1u32);
        let mut t = e.task("lost");
        let w = t.write(&x);
        let handle = t
            .run_deferred(move |done| {
                let _w = w;
                if panic {
                    panic!("before handing it on");
                }
                drop(done);
            })
            .unwrap();
        let y = e.var(0u32);
        let mut t = e.task("dependent");
        let (r, w) = (t.read(&x), t.write(&y));
        t.run(move || *w.write() = *r.read()).unwrap();
        let err = handle.wait().unwrap_err().to_string();
        assert!(err.contains("lost") && err.contains("completion"), "{err}");
        assert!(y.get().is_err(), "the dependent was skipped");
        // Other work goes on.
        let z = e.var(2u32);
        assert_eq!(z.get().unwrap(), 2);
        e.wait_all().unwrap();
    }
}

#[test]
fn collectives_agree_with_sums_by_hand_whatever_order_inputs_are_ready() {
    let out = on_ranks(Dist::in_process(3).unwrap(), |e, d| {
        let r = d.rank() as f32;
        // The first collective's input is ready last: the communication
        // thread must still run them in the recorded order.
        let slow = e.var(0u32);
        let mut t = e.task("slow");
        let w = t.write(&slow);
        t.run(move || {
            std::thread::sleep(Duration::from_millis(20));
            *w.write() = 1;
        })
        .unwrap();
        let a = Tensor::from_vec_in(e, vec![r, 1.0], [2])
            .unwrap()
            .exp()
            .log();
        let sum = d.allreduce_sum(&a, "a").unwrap();
        let b = Tensor::from_vec_in(e, vec![r * 10.0], [1]).unwrap();
        let reduced = d.reduce_sum(&b, 2, "b").unwrap();
        let c = Tensor::from_vec_in(e, vec![r, r, r], [3]).unwrap();
        let cast = d.broadcast(&c, 1, "c").unwrap();
        slow.get().unwrap();
        (
            sum.to_vec().unwrap(),
            reduced.to_vec().unwrap(),
            cast.to_vec().unwrap(),
            d.stats().collectives,
        )
    });
    for (rank, (sum, reduced, cast, n)) in out.into_iter().enumerate() {
        assert!(
            (sum[0] - 3.0).abs() < 1e-5 && (sum[1] - 3.0).abs() < 1e-5,
            "{sum:?}"
        );
        let own = rank as f32 * 10.0;
        assert_eq!(reduced, vec![if rank == 2 { 30.0 } else { own }]);
        assert_eq!(cast, vec![1.0; 3]);
        assert_eq!(n, 3);
    }
}

#[test]
fn a_collective_on_a_gpu_tensor_comes_back_to_the_gpu() {
    let e = engine();
    let Some(gpu) = e.devices().into_iter().find(|d| *d != Device::Cpu) else {
        assert!(
            std::env::var("LAZYFLOW_REQUIRE_GPU").is_err(),
            "no GPU adapter found"
        );
        return;
    };
    let out = on_ranks(Dist::in_process(2).unwrap(), |e, d| {
        let x = Tensor::full_in(e, [4], d.rank() as f32 + 1.0)
            .to(gpu)
            .unwrap();
        let s = d.allreduce_sum(&x, "x").unwrap();
        (s.device(), s.to_vec().unwrap())
    });
    for (device, v) in out {
        assert_eq!(device, gpu);
        assert_eq!(v, vec![3.0; 4]);
    }
}

#[test]
fn a_wrong_sized_buffer_is_an_error_on_every_rank() {
    let out = on_ranks(Dist::in_process(2).unwrap(), |e, d| {
        let n = if d.rank() == 1 { 3 } else { 2 };
        let x = Tensor::full_in(e, [n], 1.0);
        d.allreduce_sum(&x, "gradient of layer 0")
            .unwrap()
            .to_vec()
            .unwrap_err()
            .to_string()
    });
    assert!(
        out[0].contains("rank 1 sent 3 values, this rank (0) has 2"),
        "{}",
        out[0]
    );
    assert!(
        out[1].contains("rank 0 sent 2 values, this rank (1) has 3"),
        "{}",
        out[1]
    );
    assert!(out[0].contains("gradient of layer 0"), "{}", out[0]);
}

#[test]
fn a_rank_that_never_arrives_is_named_after_the_timeout() {
    let ranks = Dist::in_process_with(3, Duration::from_millis(300)).unwrap();
    let start = Instant::now();
    let out = on_ranks(ranks, |e, d| {
        if d.rank() == 2 {
            return None;
        }
        let x = Tensor::full_in(e, [2], 1.0);
        let first = d.allreduce_sum(&x, "x").unwrap().to_vec().unwrap_err();
        // Later steps fail at once with the first failure.
        let second = d.allreduce_sum(&x, "y").unwrap().to_vec().unwrap_err();
        Some((first.to_string(), second.to_string()))
    });
    assert!(start.elapsed() < Duration::from_secs(20));
    for (first, second) in out.into_iter().flatten() {
        assert!(first.contains("rank 2 did not reach this step"), "{first}");
        assert!(first.contains("step #0 (allreduce of x)"), "{first}");
        assert!(second.contains("an earlier step failed"), "{second}");
    }
}

fn mlp(e: &Engine, hidden: usize, seed: u64) -> Sequential {
    Sequential::new()
        .add(Linear::new(e, 6, hidden, Init::KaimingNormal, seed).unwrap())
        .add(Activation::Relu)
        .add(Linear::new(e, hidden, 4, Init::XavierUniform, seed + 1).unwrap())
}

#[test]
fn ranks_with_different_models_or_settings_refuse_to_start() {
    let out = on_ranks(Dist::in_process(2).unwrap(), |e, d| {
        let net = mlp(e, if d.rank() == 1 { 9 } else { 8 }, 0);
        let err = Distributed::new(
            d,
            &net,
            &[Device::Cpu],
            0.9,
            0.0,
            Strategy::AllReduce,
            Overlap::PerLayer,
            "",
        )
        .err()
        .map(|e| e.to_string());
        let net = mlp(e, 8, 0);
        let lr = format!("lr {}", if d.rank() == 0 { 0.1 } else { 0.2 });
        let hyper = Distributed::new(
            d,
            &net,
            &[Device::Cpu],
            0.9,
            0.0,
            Strategy::AllReduce,
            Overlap::PerLayer,
            &lr,
        )
        .err()
        .map(|e| e.to_string());
        (err, hyper)
    });
    let (shapes, hyper) = &out[0];
    let shapes = shapes.as_deref().unwrap_or("no error");
    assert!(
        shapes.contains("the model's parameter shapes") && shapes.contains("rank 1 has"),
        "{shapes}"
    );
    assert!(
        shapes.contains("[9, 4]") && shapes.contains("[8, 4]"),
        "{shapes}"
    );
    let hyper = hyper.as_deref().unwrap_or("no error");
    assert!(
        hyper.contains("hyperparameters") && hyper.contains("lr 0.2"),
        "{hyper}"
    );
    assert!(out[1].0.as_deref().unwrap_or("").contains("rank 0 has"));
}

/// A batch of `n` examples with 6 features and 4 classes.
fn batch(e: &Engine, n: usize, step: usize) -> (Tensor, Vec<u32>) {
    let x: Vec<f32> = (0..n * 6)
        .map(|i| ((i * 37 + step * 11) % 17) as f32 / 17.0 - 0.4)
        .collect();
    let y = (0..n).map(|i| ((i + step) % 4) as u32).collect();
    (Tensor::from_vec_in(e, x, [n, 6]).unwrap(), y)
}

const STEPS: usize = 4;

fn one_process() -> Vec<Vec<f32>> {
    let e = engine();
    let mut dp = DataParallel::new(&mlp(&e, 8, 3), &[Device::Cpu], 0.9, 1e-3).unwrap();
    for step in 0..STEPS {
        let (x, y) = batch(&e, 10, step);
        dp.train_batch(&x, &y, 0.1).unwrap();
    }
    dp.replicas()[0]
        .parameters()
        .iter()
        .map(|p| p.to_vec().unwrap())
        .collect()
}

fn close(a: &[Vec<f32>], b: &[Vec<f32>], what: &str) {
    assert_eq!(a.len(), b.len());
    for (i, (p, q)) in a.iter().zip(b).enumerate() {
        for (x, y) in p.iter().zip(q) {
            assert!(
                (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                "{what}: parameter {i}: {x} vs {y}"
            );
        }
    }
}

#[test]
fn two_ranks_reach_the_parameters_of_one_process() {
    let reference = one_process();
    let start: Vec<Vec<f32>> = {
        let e = engine();
        mlp(&e, 8, 3)
            .parameters()
            .iter()
            .map(|p| p.to_vec().unwrap())
            .collect()
    };
    assert_ne!(reference, start, "training moved the parameters");
    for strategy in [Strategy::AllReduce, Strategy::ParameterServer] {
        for overlap in [Overlap::PerLayer, Overlap::AfterBackward] {
            // Rank 1 starts from other weights: rank 0's are broadcast.
            let out = on_ranks(Dist::in_process(2).unwrap(), |e, d| {
                let devices = if d.rank() == 0 {
                    vec![Device::Cpu]
                } else {
                    vec![Device::Cpu; 2]
                };
                let net = mlp(e, 8, 3 + d.rank() as u64 * 100);
                let mut m =
                    Distributed::new(d, &net, &devices, 0.9, 1e-3, strategy, overlap, "").unwrap();
                for step in 0..STEPS {
                    let (x, y) = batch(e, 10, step);
                    m.train_batch(&x, &y, 0.1).unwrap();
                }
                m.parameters()
                    .iter()
                    .map(|p| p.to_vec().unwrap())
                    .collect::<Vec<_>>()
            });
            for (rank, params) in out.iter().enumerate() {
                close(
                    params,
                    &reference,
                    &format!("{strategy}, {overlap:?}, rank {rank}"),
                );
            }
        }
    }
}

#[test]
fn lenet_trains_over_two_ranks_with_a_report_on_each() {
    let images: Vec<f32> = (0..24 * 784)
        .map(|i| ((i * 7) % 255) as f32 / 255.0)
        .collect();
    let labels: Vec<u32> = (0..24).map(|i| (i % 10) as u32).collect();
    let data = lazyflow::data::Dataset {
        images,
        labels,
        rows: 28,
        cols: 28,
    };
    let config = lazyflow::train::TrainConfig {
        epochs: 1,
        batch_size: 8,
        progress: false,
        ..lazyflow::train::TrainConfig::quick()
    };
    let out = on_ranks(Dist::in_process(2).unwrap(), |e, d| {
        let net = nn::lenet(e, 0).unwrap();
        let (_, report) = lazyflow::train::fit_distributed(
            e,
            d,
            &net,
            &data,
            &data,
            &data,
            &[Device::Cpu],
            &config,
            Strategy::ParameterServer,
            Overlap::PerLayer,
        )
        .unwrap();
        (
            report.epochs[0].train_loss,
            report.test_acc,
            report.epochs[0].comm_seconds,
        )
    });
    // Sums are reduced over the ranks: both report the same figures.
    assert_eq!(out[0].0, out[1].0);
    assert_eq!(out[0].1, out[1].1);
    assert!(out[0].0.is_finite() && out[0].2 > 0.0, "{out:?}");
}

#[test]
fn without_the_mpi_feature_several_ranks_are_an_error() {
    if cfg!(feature = "mpi") {
        return;
    }
    // The variable mpirun sets; read by `Dist::from_env` only.
    std::env::set_var("OMPI_COMM_WORLD_SIZE", "2");
    let err = Dist::from_env().unwrap_err();
    std::env::remove_var("OMPI_COMM_WORLD_SIZE");
    assert!(matches!(err, Error::Config(_)));
    assert!(err.to_string().contains("--features mpi"), "{err}");
}

#[test]
fn a_rank_whose_input_failed_tells_the_others_instead_of_leaving_them_waiting() {
    let out = on_ranks(Dist::in_process(2).unwrap(), |e, d| {
        // Rank 1's input cannot be allocated (2^42 floats): its task fails,
        // and the collective that reads it never runs.
        let n = if d.rank() == 1 { 1usize << 42 } else { 2 };
        let x = Tensor::full_in(e, [n], 1.0);
        let first = d
            .allreduce_sum(&x, "x")
            .unwrap()
            .to_vec()
            .unwrap_err()
            .to_string();
        // Every rank saw it: they stay in step.
        let y = d.allreduce_sum(&Tensor::full_in(e, [1], 1.0), "y").unwrap();
        (first, y.to_vec().unwrap())
    });
    assert!(
        out[0].0.contains("rank 1 could not take part"),
        "{}",
        out[0].0
    );
    assert!(out[1].0.contains("out of memory"), "{}", out[1].0);
    for (_, y) in out {
        assert_eq!(y, vec![2.0]);
    }
}
