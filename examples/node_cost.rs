//! One shape of the scheduler benchmark (`benches/scheduler.rs`), run a few
//! times in one Lazy engine with the default backpressure and 2 workers, with
//! nothing else in the process: the loop to count instructions per node with
//! callgrind, or to time one shape alone.
//!
//! ```text
//! cargo run --release --example node_cost -- <chain|wide|tree|many_reads> [size] [reps]
//! valgrind --tool=callgrind target/release/examples/node_cost chain 200000 5
//! ```
//!
//! `size` is the nodes of `chain` and `wide`, the depth of `tree` (it has
//! 2^(depth+1) nodes less 2) and the tasks of `many_reads` (whose unit is a
//! declared access, about 11.5 per task). Prints ns per unit and the units
//! run. Instructions per unit, leaving the setup out (the engine, the inputs):
//! callgrind's count for 6 runs less its count for 1 run, divided by the units
//! of 5 runs.

use lazyflow::{Engine, Mode, Var};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::time::Instant;

fn chain(e: &Engine, n: usize) -> usize {
    let x = e.var(());
    for _ in 0..n {
        let mut t = e.task("chain");
        let w = t.write(&x);
        t.push(move || drop(w)).unwrap();
    }
    n
}

fn wide(e: &Engine, n: usize) -> usize {
    for _ in 0..n {
        e.task("wide").push(|| {}).unwrap();
    }
    n
}

/// Fan-out from one root to 2^(depth-1) leaves, a gather node per leaf, then
/// pairwise fan-in to one node.
fn tree(e: &Engine, depth: u32) -> usize {
    let mut nodes = 0;
    let mut link = |reads: &[&Var<()>]| {
        let v = e.var(());
        let mut t = e.task("tree");
        let rs: Vec<_> = reads.iter().map(|r| t.read(r)).collect();
        let w = t.write(&v);
        t.push(move || drop((rs, w))).unwrap();
        nodes += 1;
        v
    };
    let mut level = vec![link(&[])];
    for _ in 1..depth {
        level = level
            .iter()
            .flat_map(|p| [link(&[p]), link(&[p])])
            .collect();
    }
    level = level.iter().map(|leaf| link(&[leaf])).collect();
    while level.len() > 1 {
        level = level
            .chunks(2)
            .map(|pair| link(&pair.iter().collect::<Vec<_>>()))
            .collect();
    }
    nodes
}

/// 100 Vars; each task writes one and reads 2 to 19 others.
fn many_reads_plan(tasks: usize) -> Vec<(usize, Vec<usize>)> {
    let mut rng = StdRng::seed_from_u64(11);
    (0..tasks)
        .map(|_| {
            let w = rng.random_range(0..100usize);
            let k = rng.random_range(2..=19usize);
            let mut reads = Vec::with_capacity(k);
            while reads.len() < k {
                let r = rng.random_range(0..100usize);
                if r != w && !reads.contains(&r) {
                    reads.push(r);
                }
            }
            (w, reads)
        })
        .collect()
}

fn many_reads(e: &Engine, vars: &[Var<u64>], plan: &[(usize, Vec<usize>)]) -> usize {
    let mut accesses = 0;
    for (w, reads) in plan {
        let mut t = e.task("many_reads");
        let rs: Vec<_> = reads.iter().map(|&i| t.read(&vars[i])).collect();
        let w = t.write(&vars[*w]);
        accesses += 1 + rs.len();
        t.push(move || {
            let s: u64 = rs.iter().map(|r| *r.read()).sum();
            *w.write() = s % 1_000_003 + 1;
        })
        .unwrap();
    }
    accesses
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let shape = args.first().map_or("chain", |s| s.as_str()).to_string();
    let size: usize = args.get(1).map_or(Ok(200_000), |s| s.parse())?;
    let reps: usize = args.get(2).map_or(Ok(5), |s| s.parse())?;
    let e = Engine::builder().mode(Mode::Lazy).workers(2).build()?;
    let plan = if shape == "many_reads" {
        many_reads_plan(size)
    } else {
        Vec::new()
    };
    let vars: Vec<Var<u64>> = (0..100).map(|_| e.var(0u64)).collect();
    let start = Instant::now();
    let mut units = 0;
    for _ in 0..reps {
        units += match shape.as_str() {
            "chain" => chain(&e, size),
            "wide" => wide(&e, size),
            "tree" => tree(&e, size as u32),
            "many_reads" => many_reads(&e, &vars, &plan),
            other => {
                return Err(
                    format!("unknown shape {other:?}: chain, wide, tree or many_reads").into(),
                )
            }
        };
        e.wait_all()?;
    }
    let ns = start.elapsed().as_secs_f64() * 1e9 / units as f64;
    println!(
        "{shape}: {ns:.1} ns per {}, {units} in all",
        if shape == "many_reads" {
            "access"
        } else {
            "node"
        }
    );
    Ok(())
}
