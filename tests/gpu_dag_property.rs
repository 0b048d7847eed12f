//! Random programs of tensor ops spread over the CPU and two logical GPU devices
//! (transfers included), against a sequential reference on plain vectors: every
//! read and the final values must be exactly what program order gives (the ops
//! used are exactly rounded on every device). Runs on every adapter found; with
//! `LAZYFLOW_REQUIRE_GPU=1` finding none is a failure.

use lazyflow::{Device, Engine, Mode, Tensor};
use proptest::prelude::*;
use std::sync::OnceLock;

const LEN: usize = 5;

#[derive(Clone, Copy, Debug)]
enum Op {
    Add,
    Sub,
    Max,
    Min,
}

impl Op {
    fn apply(self, a: f32, b: f32) -> f32 {
        match self {
            Op::Add => a + b,
            Op::Sub => a - b,
            Op::Max => a.max(b),
            Op::Min => a.min(b),
        }
    }

    fn tensor(self, a: &Tensor, b: &Tensor) -> Tensor {
        match self {
            Op::Add => a.add(b),
            Op::Sub => a.sub(b),
            Op::Max => a.maximum(b),
            Op::Min => a.minimum(b),
        }
        .unwrap()
    }
}

#[derive(Clone, Debug)]
enum Step {
    /// `vars[dst] = op(vars[a], vars[b])`, computed on device `dev`.
    Assign {
        dst: usize,
        a: usize,
        b: usize,
        op: Op,
        dev: usize,
    },
    /// `vars[dst] += vars[src]` in place, on `vars[dst]`'s device.
    AddInPlace { dst: usize, src: usize },
    /// `vars[dst] += s` in place.
    AddScalar { dst: usize, s: i8 },
    /// Moves `vars[v]` to device `dev`.
    Move { v: usize, dev: usize },
    /// Reads `vars[v]` (a blocker).
    Read { v: usize },
}

fn engines() -> &'static Vec<(Engine, Vec<Device>)> {
    static ENGINES: OnceLock<Vec<(Engine, Vec<Device>)>> = OnceLock::new();
    ENGINES.get_or_init(|| {
        [Mode::Lazy, Mode::Async]
            .into_iter()
            .map(|mode| {
                let e = Engine::builder()
                    .mode(mode)
                    .workers(2)
                    .logical_devices(2)
                    .build()
                    .unwrap();
                let devices = e.devices();
                if devices.len() < 2
                    && std::env::var("LAZYFLOW_REQUIRE_GPU").is_ok_and(|v| v == "1")
                {
                    panic!("LAZYFLOW_REQUIRE_GPU=1 but no GPU adapter was found");
                }
                (e, devices)
            })
            .collect()
    })
}

fn run(
    engine: &Engine,
    devices: &[Device],
    n_vars: usize,
    steps: &[Step],
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let mut vars: Vec<Tensor> = (0..n_vars)
        .map(|i| {
            let init: Vec<f32> = (0..LEN).map(|j| (i * 3 + j) as f32 - 4.0).collect();
            Tensor::from_vec_in(engine, init, [LEN]).unwrap()
        })
        .collect();
    let dev = |d: usize| devices[d % devices.len()];
    let mut reads = Vec::new();
    for step in steps {
        match *step {
            Step::Assign {
                dst,
                a,
                b,
                op,
                dev: d,
            } => {
                let (x, y) = (vars[a].to(dev(d)).unwrap(), vars[b].to(dev(d)).unwrap());
                vars[dst] = op.tensor(&x, &y);
            }
            Step::AddInPlace { dst, src } => {
                let y = vars[src].to(vars[dst].device()).unwrap();
                vars[dst].add_(&y).unwrap();
            }
            Step::AddScalar { dst, s } => vars[dst].add_scalar_(f32::from(s)),
            Step::Move { v, dev: d } => vars[v] = vars[v].to(dev(d)).unwrap(),
            Step::Read { v } => reads.push(vars[v].to_vec().unwrap()),
        }
    }
    (vars.iter().map(|v| v.to_vec().unwrap()).collect(), reads)
}

fn reference(n_vars: usize, steps: &[Step]) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let mut vars: Vec<Vec<f32>> = (0..n_vars)
        .map(|i| (0..LEN).map(|j| (i * 3 + j) as f32 - 4.0).collect())
        .collect();
    let mut reads = Vec::new();
    for step in steps {
        match *step {
            Step::Assign { dst, a, b, op, .. } => {
                vars[dst] = vars[a]
                    .iter()
                    .zip(&vars[b])
                    .map(|(&x, &y)| op.apply(x, y))
                    .collect();
            }
            Step::AddInPlace { dst, src } => {
                let add = vars[src].clone();
                for (x, y) in vars[dst].iter_mut().zip(add) {
                    *x += y;
                }
            }
            Step::AddScalar { dst, s } => vars[dst].iter_mut().for_each(|x| *x += f32::from(s)),
            Step::Move { .. } => {}
            Step::Read { v } => reads.push(vars[v].clone()),
        }
    }
    (vars, reads)
}

fn program() -> impl Strategy<Value = (usize, Vec<Step>)> {
    (2usize..=4).prop_flat_map(|n| {
        let op = prop_oneof![Just(Op::Add), Just(Op::Sub), Just(Op::Max), Just(Op::Min)];
        let step = prop_oneof![
            4 => (0..n, 0..n, 0..n, op, 0..3usize)
                .prop_map(|(dst, a, b, op, dev)| Step::Assign { dst, a, b, op, dev }),
            2 => (0..n, 0..n).prop_map(|(dst, src)| Step::AddInPlace { dst, src }),
            1 => (0..n, -3i8..=3).prop_map(|(dst, s)| Step::AddScalar { dst, s }),
            2 => (0..n, 0..3usize).prop_map(|(v, dev)| Step::Move { v, dev }),
            1 => (0..n).prop_map(|v| Step::Read { v }),
        ];
        (Just(n), proptest::collection::vec(step, 1..30))
    })
}

proptest! {
    // GPU cases are slower: a quarter of PROPTEST_CASES (CI: 250), 64 by default.
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse::<u32>().ok()).map_or(64, |n| (n / 4).max(1))
    ))]

    #[test]
    fn random_programs_over_cpu_and_two_gpus_match_sequential((n, steps) in program()) {
        let expected = reference(n, &steps);
        for (engine, devices) in engines() {
            let got = run(engine, devices, n, &steps);
            prop_assert_eq!(&got, &expected, "{:?} on {:?}", engine.mode(), devices);
        }
    }
}
