//! Per-node cost of the engine on empty generic tasks, recording included, and
//! the cost of a blocker inside a task while many nodes are live; then the
//! tour's small-tensor CPU loops against candle-core's eager CPU tensors.
//!
//! `cargo bench --bench scheduler` prints nodes per second (criterion's
//! `Throughput::Elements`); the README turns them into ns per node next to
//! Taskflow's figures for the same shapes, measured alternately in the same
//! session by `../shared/peers/taskflow/run_ab.sh`, and next to rayon measured in
//! the same run (`baseline/*`).

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use lazyflow::{Engine, Mode, Tensor, Var};
use std::time::{Duration, Instant};

#[path = "../examples/demos/shapes.rs"]
mod shapes;
use shapes::{
    chain, dynamic_chain, many_reads, many_reads_inputs, random_dag, random_inputs, tree, wide,
};

const WORKERS: usize = 2;

/// Waits for everything `e` recorded (the shapes only record) and passes
/// `nodes` through.
fn done(e: &Engine, nodes: usize) -> usize {
    e.wait_all().unwrap();
    nodes
}

fn engine(mode: Mode) -> Engine {
    Engine::builder()
        .mode(mode)
        .workers(WORKERS)
        .build()
        .unwrap()
}

/// `threads` frontends, each recording an independent chain of `per_thread`
/// nodes into the same engine, at the same time.
fn frontends(e: &Engine, threads: usize, per_thread: usize) {
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let x = e.var(());
                for _ in 0..per_thread {
                    let mut t = e.task("frontend");
                    let w = t.write(&x);
                    t.push(move || drop(w)).unwrap();
                }
            });
        }
    });
    e.wait_all().unwrap();
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("scheduler");
    g.sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));

    let lazy = engine(Mode::Lazy);
    const N: usize = 1_000_000;
    g.throughput(Throughput::Elements(N as u64));
    g.bench_function("chain", |b| b.iter(|| done(&lazy, chain(&lazy, N))));
    g.bench_function("wide", |b| b.iter(|| done(&lazy, wide(&lazy, N, || {}))));

    let tree_nodes = done(&lazy, tree(&lazy, 19));
    g.throughput(Throughput::Elements(tree_nodes as u64));
    g.bench_function("tree", |b| b.iter(|| done(&lazy, tree(&lazy, 19))));

    let inputs = random_inputs(100_000);
    g.throughput(Throughput::Elements(inputs.len() as u64));
    g.bench_function("random_dag", |b| {
        b.iter(|| done(&lazy, random_dag(&lazy, &inputs, || {})))
    });

    let asynchronous = engine(Mode::Async);
    g.throughput(Throughput::Elements(100_000));
    g.bench_function("dynamic_chain", |b| {
        b.iter(|| done(&asynchronous, dynamic_chain(&asynchronous, 100_000)))
    });

    // Declared accesses per second (the goal is stated per access).
    let (plan, accesses) = many_reads_inputs(100_000);
    let vars: Vec<Var<u64>> = (0..100).map(|_| lazy.var(0u64)).collect();
    g.throughput(Throughput::Elements(accesses as u64));
    g.bench_function("many_reads", |b| {
        b.iter(|| done(&lazy, many_reads(&lazy, &vars, &plan)))
    });

    let asynchronous_frontends = engine(Mode::Async);
    for threads in [1, 2, 4] {
        let per_thread = 400_000 / threads;
        g.throughput(Throughput::Elements((per_thread * threads) as u64));
        g.bench_function(format!("frontends_{threads}"), |b| {
            b.iter(|| frontends(&asynchronous_frontends, threads, per_thread))
        });
    }

    // Recording only, in rounds of 10,000 ops: each round's nodes pile up
    // unrun (backpressure off) and are run outside the timed region, so the
    // graph stays the size a program would have between two barriers (one
    // long run of millions of unrun nodes measured the page faults of a
    // growing heap instead).
    let recorder = Engine::builder()
        .mode(Mode::Lazy)
        .workers(WORKERS)
        .unbounded()
        .build()
        .unwrap();
    let x = Tensor::ones_in(&recorder, [4]);
    let y = Tensor::ones_in(&recorder, [4]);
    g.throughput(Throughput::Elements(1));
    g.bench_function("record_tensor_op", |b| {
        b.iter_custom(|iters| {
            const ROUND: u64 = 10_000;
            let mut elapsed = Duration::ZERO;
            let mut left = iters;
            let mut outs = Vec::with_capacity(ROUND as usize);
            while left > 0 {
                let round = left.min(ROUND);
                let start = Instant::now();
                for _ in 0..round {
                    outs.push(&x + &y);
                }
                elapsed += start.elapsed();
                outs.clear();
                recorder.wait_all().unwrap();
                left -= round;
            }
            elapsed
        })
    });
    // A blocker inside a task while many unrelated nodes are live: the task
    // records a node and waits for it, 100 times. The deadlock check used to
    // copy the whole live graph into petgraph for every such wait; it now walks
    // the waited node's own dependencies.
    let busy = engine(Mode::Lazy);
    for _ in 0..20_000 {
        let v = busy.var(());
        let mut t = busy.task("unrelated");
        let w = t.write(&v);
        t.push(move || drop(w)).unwrap();
    }
    g.throughput(Throughput::Elements(100));
    g.bench_function("blocker_in_task_20k_live", |b| {
        b.iter(|| {
            let v = busy.var(0u32);
            busy.task("waits")
                .run(move || {
                    for i in 0..100 {
                        v.set(i).unwrap();
                        v.wait_to_read().unwrap();
                    }
                })
                .unwrap()
                .wait()
                .unwrap()
        })
    });
    g.finish();

    // Peers measured in the same run: rayon's scope spawn and join on a pool of the
    // same size, for the same number of empty tasks as `wide`.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(WORKERS)
        .build()
        .unwrap();
    let mut g = c.benchmark_group("baseline");
    g.sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    g.throughput(Throughput::Elements(N as u64));
    g.bench_function("rayon_scope_spawn_wide", |b| {
        b.iter(|| {
            pool.scope(|s| {
                for _ in 0..N {
                    s.spawn(|_| {});
                }
            })
        })
    });
    // The same many_reads work as a plain loop on one thread, per declared access.
    let (plan, accesses) = many_reads_inputs(100_000);
    g.throughput(Throughput::Elements(accesses as u64));
    g.bench_function("many_reads_sequential", |b| {
        b.iter(|| {
            let mut vals = vec![0u64; 100];
            for (w, reads) in &plan {
                let s: u64 = reads.iter().map(|&i| vals[i]).sum();
                vals[*w] = s % 1_000_003 + 1;
            }
            std::hint::black_box(vals)
        })
    });
    g.throughput(Throughput::Elements(N as u64));
    g.bench_function("rayon_join_tree", |b| {
        fn split(n: usize) {
            if n > 1 {
                rayon::join(|| split(n / 2), || split(n - n / 2));
            }
        }
        b.iter_batched(|| (), |_| pool.install(|| split(N)), BatchSize::SmallInput)
    });
    g.finish();
}

/// The tour's CPU loops (`examples/demos/sync_async.rs`): `y = x + 1` on a
/// `[1, 2]` tensor 10,000 times with only the last `y` kept, with every `y`
/// kept, and the chain `x = x + 1`, each ending in one barrier (Lazy mode, the
/// tour's engine). The peer in the same run is candle-core's eager CPU tensor
/// doing the same ops (each returns with its result computed).
fn tensor_loops(c: &mut Criterion) {
    const OPS: usize = 10_000;
    let mut g = c.benchmark_group("tensor_loops");
    g.sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Elements(OPS as u64));

    let e = engine(Mode::Lazy);
    let x = Tensor::ones_in(&e, [1, 2]);
    g.bench_function("lazyflow_discarded", |b| {
        b.iter(|| {
            let mut y = None;
            for _ in 0..OPS {
                y = Some(&x + 1.0);
            }
            e.wait_all().unwrap();
            y
        })
    });
    g.bench_function("lazyflow_kept", |b| {
        b.iter(|| {
            let ys: Vec<Tensor> = (0..OPS).map(|_| &x + 1.0).collect();
            e.wait_all().unwrap();
            ys
        })
    });
    g.bench_function("lazyflow_chain", |b| {
        b.iter(|| {
            let mut y = x.clone();
            for _ in 0..OPS {
                y = &y + 1.0;
            }
            e.wait_all().unwrap();
            y
        })
    });

    use candle_core::{DType, Device as CandleDevice, Tensor as CandleTensor};
    let cx = CandleTensor::ones((1, 2), DType::F32, &CandleDevice::Cpu).unwrap();
    g.bench_function("candle_discarded", |b| {
        b.iter(|| {
            let mut y = None;
            for _ in 0..OPS {
                y = Some((&cx + 1.0).unwrap());
            }
            y
        })
    });
    g.bench_function("candle_kept", |b| {
        b.iter(|| {
            (0..OPS)
                .map(|_| (&cx + 1.0).unwrap())
                .collect::<Vec<CandleTensor>>()
        })
    });
    g.bench_function("candle_chain", |b| {
        b.iter(|| {
            let mut y = cx.clone();
            for _ in 0..OPS {
                y = (&y + 1.0).unwrap();
            }
            y
        })
    });
    g.finish();
}

criterion_group!(benches, bench, tensor_loops);
criterion_main!(benches);
