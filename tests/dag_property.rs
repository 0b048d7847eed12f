//! Random DAGs of generic tasks against sequential execution in program order.
//!
//! Every task reads and writes a random subset of a handful of Vars. A Var holds a
//! value and the log of the tasks that wrote it; each task records which write it
//! observed on every Var it reads. Final values, write logs, observations and the
//! values seen by blockers interleaved with the recording must all equal what a
//! sequential interpreter computes, in every mode and with 1, 2 and 4 workers.
//!
//! A second property runs four such programs at once, from four frontend threads
//! recording into one engine: each must still match its own sequential run, and
//! a counter that every writing task of every thread bumps (read, then write,
//! through separate guards, so that two bumps run at once would lose one) must
//! count them all.

use lazyflow::{Engine, Mode, Var};
use proptest::prelude::*;
use std::sync::{Arc, Mutex, OnceLock};

#[derive(Clone, Debug, Default, PartialEq)]
struct Cell {
    value: u64,
    writers: Vec<usize>,
}

#[derive(Clone, Debug)]
enum Step {
    Task {
        reads: Vec<usize>,
        writes: Vec<usize>,
    },
    Read(usize),
}

fn mix(a: u64, b: u64) -> u64 {
    (a ^ b.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .rotate_left(17)
        .wrapping_mul(0xBF58_476D_1CE4_E5B9)
}

/// What a task observed: for each read, (var, last writer seen).
type Seen = Vec<(usize, Option<usize>)>;

fn task_value(i: usize, seen_values: &[u64]) -> u64 {
    seen_values.iter().fold(i as u64 + 1, |h, &v| mix(h, v))
}

fn sequential(n_vars: usize, steps: &[Step]) -> (Vec<Cell>, Vec<Seen>, Vec<Cell>) {
    let mut cells = vec![Cell::default(); n_vars];
    let mut seen = Vec::new();
    let mut reads = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        match step {
            Step::Task {
                reads: r,
                writes: w,
            } => {
                let s: Seen = r
                    .iter()
                    .map(|&v| (v, cells[v].writers.last().copied()))
                    .collect();
                let vals: Vec<u64> = r.iter().map(|&v| cells[v].value).collect();
                let h = task_value(i, &vals);
                for &v in w {
                    cells[v].value = mix(cells[v].value, h);
                    cells[v].writers.push(i);
                }
                seen.push(s);
            }
            Step::Read(v) => reads.push(cells[*v].clone()),
        }
    }
    (cells, seen, reads)
}

fn run_engine(
    engine: &Engine,
    n_vars: usize,
    steps: &[Step],
    counter: Option<&Var<u64>>,
) -> (Vec<Cell>, Vec<Seen>, Vec<Cell>) {
    let vars: Vec<Var<Cell>> = (0..n_vars).map(|_| engine.var(Cell::default())).collect();
    let n_tasks = steps
        .iter()
        .filter(|s| matches!(s, Step::Task { .. }))
        .count();
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::new(Mutex::new(vec![Vec::new(); n_tasks]));
    let mut reads = Vec::new();
    let mut task_no = 0;
    for (i, step) in steps.iter().enumerate() {
        match step {
            Step::Task {
                reads: r,
                writes: w,
            } => {
                let mut t = engine.task("step");
                // A Var both read and written is reached through its write token.
                let rtok: Vec<_> = r
                    .iter()
                    .filter(|v| !w.contains(v))
                    .map(|&v| (v, t.read(&vars[v])))
                    .collect();
                let wtok: Vec<_> = w.iter().map(|&v| (v, t.write(&vars[v]))).collect();
                let bump = counter.filter(|_| !w.is_empty()).map(|c| t.write(c));
                let (r, seen, slot) = (r.clone(), seen.clone(), task_no);
                t.push(move || {
                    if let Some(c) = &bump {
                        let old = *c.read();
                        std::thread::yield_now();
                        *c.write() = old + 1;
                    }
                    let mut s = Vec::new();
                    let mut vals = Vec::new();
                    for v in &r {
                        let cell = match rtok.iter().find(|(x, _)| x == v) {
                            Some((_, tok)) => tok.read().clone(),
                            None => wtok.iter().find(|(x, _)| x == v).unwrap().1.read().clone(),
                        };
                        s.push((*v, cell.writers.last().copied()));
                        vals.push(cell.value);
                    }
                    let h = task_value(i, &vals);
                    for (_, tok) in &wtok {
                        let mut c = tok.write();
                        c.value = mix(c.value, h);
                        c.writers.push(i);
                    }
                    seen.lock().unwrap()[slot] = s;
                })
                .unwrap();
                task_no += 1;
            }
            Step::Read(v) => reads.push(vars[*v].get().unwrap()),
        }
    }
    engine.wait_all().unwrap();
    let cells = vars.iter().map(|v| v.get().unwrap()).collect();
    let seen = seen.lock().unwrap().clone();
    (cells, seen, reads)
}

fn engines() -> &'static Vec<Engine> {
    static ENGINES: OnceLock<Vec<Engine>> = OnceLock::new();
    ENGINES.get_or_init(|| {
        let mut out = Vec::new();
        for mode in [Mode::Lazy, Mode::Async, Mode::Sync] {
            for workers in [1, 2, 4] {
                // A small bound so that backpressure also takes part.
                out.push(
                    Engine::builder()
                        .mode(mode)
                        .workers(workers)
                        .backpressure(16, 4)
                        .build()
                        .unwrap(),
                );
            }
        }
        out
    })
}

fn subset(n_vars: usize, max: usize) -> impl Strategy<Value = Vec<usize>> {
    proptest::collection::btree_set(0..n_vars, 0..=max).prop_map(|s| s.into_iter().collect())
}

fn program() -> impl Strategy<Value = (usize, Vec<Step>)> {
    (1usize..=6).prop_flat_map(|n_vars| {
        let step = prop_oneof![
            8 => (subset(n_vars, 3), subset(n_vars, 2))
                .prop_map(|(reads, writes)| Step::Task { reads, writes }),
            1 => (0..n_vars).prop_map(Step::Read),
        ];
        (Just(n_vars), proptest::collection::vec(step, 1..60))
    })
}

proptest! {
    // CI sets PROPTEST_CASES=1000; the default keeps a local run short.
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
    ))]

    #[test]
    fn random_dags_match_sequential_execution((n_vars, steps) in program()) {
        let expected = sequential(n_vars, &steps);
        for engine in engines() {
            let got = run_engine(engine, n_vars, &steps, None);
            prop_assert_eq!(&got, &expected, "mode {:?}, {} workers", engine.mode(), engine.workers());
            let stats = engine.stats();
            prop_assert_eq!(stats.live_nodes, 0);
        }
    }
}

fn shared_engines() -> &'static Vec<Engine> {
    static ENGINES: OnceLock<Vec<Engine>> = OnceLock::new();
    ENGINES.get_or_init(|| {
        [Mode::Lazy, Mode::Async, Mode::Sync]
            .into_iter()
            .map(|mode| {
                Engine::builder()
                    .mode(mode)
                    .workers(2)
                    .backpressure(16, 4)
                    .build()
                    .unwrap()
            })
            .collect()
    })
}

fn writing_tasks(steps: &[Step]) -> u64 {
    steps
        .iter()
        .filter(|s| matches!(s, Step::Task { writes, .. } if !writes.is_empty()))
        .count() as u64
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256) / 4
    ))]

    #[test]
    fn four_frontends_recording_at_once_match_sequential_execution(
        programs in proptest::collection::vec(program(), 4)
    ) {
        for engine in shared_engines() {
            let counter = engine.var(0u64);
            let results: Vec<_> = std::thread::scope(|s| {
                let handles: Vec<_> = programs
                    .iter()
                    .map(|(n_vars, steps)| {
                        let counter = &counter;
                        s.spawn(move || run_engine(engine, *n_vars, steps, Some(counter)))
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for ((n_vars, steps), got) in programs.iter().zip(&results) {
                let expected = sequential(*n_vars, steps);
                prop_assert_eq!(got, &expected, "mode {:?}", engine.mode());
            }
            let total: u64 = programs.iter().map(|(_, steps)| writing_tasks(steps)).sum();
            prop_assert_eq!(counter.get().unwrap(), total, "mode {:?}", engine.mode());
            engine.wait_all().unwrap();
            prop_assert_eq!(engine.stats().live_nodes, 0);
        }
    }
}
