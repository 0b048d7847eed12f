//! One shape of the scheduler benchmark (`benches/scheduler.rs`), run a few
//! times in one Lazy engine (Async for `dynamic_chain`, as in the benchmark)
//! with the default backpressure and 2 workers, with
//! nothing else in the process: the loop to count instructions per node with
//! callgrind, or to time one shape alone.
//!
//! ```text
//! cargo run --release --example node_cost -- <chain|wide|tree|random_dag|many_reads|tensor_op|dynamic_chain> [size] [reps]
//! valgrind --tool=callgrind target/release/examples/node_cost chain 200000 5
//! ```
//!
//! `size` is the nodes of `chain`, `wide`, `random_dag` and `dynamic_chain`, the depth of `tree` (it has
//! 2^(depth+1) nodes less 2), the tasks of `many_reads` (whose unit is a
//! declared access, about 11.5 per task) and the ops of `tensor_op` (`&x + &y`
//! on 4 elements, as `record_tensor_op` in the benchmark: the results are let
//! go of before the barrier, so the workers give their storages back for the
//! next round's outputs). Prints ns per unit and the units
//! run. Instructions per unit, leaving the setup out (the engine, the inputs):
//! callgrind's count for 6 runs less its count for 1 run, divided by the units
//! of 5 runs. `benches/locked_per_unit.py` counts the locked instructions
//! per unit the same way.
//!
//! With `split` after the reps (`node_cost many_reads 100000 3 split`), the
//! engine has no backpressure, so in Lazy mode nothing runs before the
//! barrier: it prints the recording alone and the run after it, each per
//! unit, over the rounds after the first (whose memory is new). On 2 cores
//! the two overlap in the default engine; apart, they show which side a
//! shape is bound by. Apart, no node finishes while the round records, so
//! each is recorded in memory that no worker touched since it was last
//! used, and none in a node that just finished, as with backpressure.
//! (`dynamic_chain` runs in Async mode, where each node runs as it is
//! recorded: apart means nothing there.)

mod demos;

use demos::shapes::{
    chain, dynamic_chain, many_reads, many_reads_inputs, random_dag, random_inputs, tree, wide,
};
use lazyflow::{Engine, Mode, Tensor, Var};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let shape = args.first().map_or("chain", |s| s.as_str()).to_string();
    let size: usize = args.get(1).map_or(Ok(200_000), |s| s.parse())?;
    let reps: usize = args.get(2).map_or(Ok(5), |s| s.parse())?;
    let split = match args.get(3).map(String::as_str) {
        None => false,
        Some("split") => true,
        Some(other) => return Err(format!("unknown option {other:?}: split").into()),
    };
    // `dynamic_chain` runs in Async mode, as in the benchmark.
    let mode = if shape == "dynamic_chain" {
        Mode::Async
    } else {
        Mode::Lazy
    };
    let builder = Engine::builder().mode(mode).workers(2);
    let e = if split {
        builder.unbounded().build()?
    } else {
        builder.build()?
    };
    let plan = if shape == "many_reads" {
        many_reads_inputs(size).0
    } else {
        Vec::new()
    };
    let inputs = if shape == "random_dag" {
        random_inputs(size)
    } else {
        Vec::new()
    };
    let vars: Vec<Var<u64>> = (0..100).map(|_| e.var(0u64)).collect();
    let (x, y) = (Tensor::ones_in(&e, [4]), Tensor::ones_in(&e, [4]));
    let mut outs = Vec::with_capacity(if shape == "tensor_op" { size } else { 0 });
    let start = Instant::now();
    let mut units = 0;
    // Recording and running apart (`split`), after the first round.
    let (mut recording, mut running, mut split_units) = (0.0, 0.0, 0);
    for rep in 0..reps {
        let round = Instant::now();
        let n = match shape.as_str() {
            "chain" => chain(&e, size),
            "wide" => wide(&e, size, || {}),
            "tree" => tree(&e, size as u32),
            "random_dag" => random_dag(&e, &inputs, || {}),
            "dynamic_chain" => dynamic_chain(&e, size),
            "many_reads" => many_reads(&e, &vars, &plan),
            "tensor_op" => {
                outs.extend((0..size).map(|_| &x + &y));
                size
            }
            other => {
                return Err(format!(
                "unknown shape {other:?}: chain, wide, tree, random_dag, many_reads, tensor_op or dynamic_chain"
            )
                .into())
            }
        };
        let recorded = round.elapsed();
        outs.clear();
        e.wait_all()?;
        units += n;
        if rep > 0 {
            recording += recorded.as_secs_f64();
            running += (round.elapsed() - recorded).as_secs_f64();
            split_units += n;
        }
    }
    let ns = start.elapsed().as_secs_f64() * 1e9 / units as f64;
    let unit = match shape.as_str() {
        "many_reads" => "access",
        "tensor_op" => "op",
        _ => "node",
    };
    println!("{shape}: {ns:.1} ns per {unit}, {units} in all");
    if split {
        if split_units == 0 {
            return Err("split needs 2 reps or more (the first is left out)".into());
        }
        let per = |secs: f64| secs * 1e9 / split_units as f64;
        println!(
            "{shape}, apart (rounds 2 to {reps}): recording {:.1} ns per {unit}, then running {:.1}",
            per(recording),
            per(running)
        );
    }
    Ok(())
}
