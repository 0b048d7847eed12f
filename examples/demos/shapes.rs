//! The shapes of the scheduler benchmark: empty (or busy) generic tasks that
//! name Vars the way a program does. `benches/scheduler.rs` includes this file
//! (`#[path]`), and so do `examples/scaling.rs` and `examples/node_cost.rs`, so
//! that the three measure the same graphs. Each function records its nodes and
//! returns how many; the caller waits (`Engine::wait_all`).

use lazyflow::{Engine, Var};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// `n` nodes, each writing the Var the previous one wrote.
pub fn chain(e: &Engine, n: usize) -> usize {
    let x = e.var(());
    for _ in 0..n {
        let mut t = e.task("chain");
        let w = t.write(&x);
        t.push(move || drop(w)).unwrap();
    }
    n
}

/// `n` nodes, each reading what the previous one wrote and writing a new
/// Var (`benches/scheduler.rs` runs it in Async mode: each node is handed
/// out as it is recorded).
pub fn dynamic_chain(e: &Engine, n: usize) -> usize {
    let mut prev = e.var(());
    for _ in 0..n {
        let next = e.var(());
        let mut t = e.task("dynamic");
        let (r, w) = (t.read(&prev), t.write(&next));
        t.push(move || drop((r, w))).unwrap();
        prev = next;
    }
    n
}

/// `n` independent nodes, each running `work`.
pub fn wide(e: &Engine, n: usize, work: impl Fn() + Clone + Send + 'static) -> usize {
    for _ in 0..n {
        e.task("wide").push(work.clone()).unwrap();
    }
    n
}

/// Fan-out from one root down a binary tree to 2^(depth-1) leaves, then a
/// second binary tree fanning those leaves back in to one node: 2^(depth+1) - 2
/// nodes.
pub fn tree(e: &Engine, depth: u32) -> usize {
    let mut nodes = 0;
    let root = e.var(());
    let mut t = e.task("root");
    let w = t.write(&root);
    t.push(move || drop(w)).unwrap();
    nodes += 1;
    let mut level = vec![root];
    for _ in 1..depth {
        let mut next = Vec::with_capacity(level.len() * 2);
        for parent in &level {
            for _ in 0..2 {
                let child = e.var(());
                let mut t = e.task("fan_out");
                let (r, w) = (t.read(parent), t.write(&child));
                t.push(move || drop((r, w))).unwrap();
                nodes += 1;
                next.push(child);
            }
        }
        level = next;
    }
    // Fan-in: one node per leaf, then pairwise joins up to a single sink.
    let mut level: Vec<Var<()>> = level
        .iter()
        .map(|leaf| {
            let v = e.var(());
            let mut t = e.task("gather");
            let (r, w) = (t.read(leaf), t.write(&v));
            t.push(move || drop((r, w))).unwrap();
            nodes += 1;
            v
        })
        .collect();
    while level.len() > 1 {
        level = level
            .chunks(2)
            .map(|pair| {
                let v = e.var(());
                let mut t = e.task("fan_in");
                let rs: Vec<_> = pair.iter().map(|p| t.read(p)).collect();
                let w = t.write(&v);
                t.push(move || drop((rs, w))).unwrap();
                nodes += 1;
                v
            })
            .collect();
    }
    nodes
}

/// The inputs of [`random_dag`]: node i > 0 reads 0 to 4 Vars of earlier nodes
/// (2 on average), chosen with a fixed seed.
pub fn random_inputs(n: usize) -> Vec<Vec<usize>> {
    let mut rng = StdRng::seed_from_u64(7);
    (0..n)
        .map(|i| {
            let k = if i == 0 {
                0
            } else {
                rng.random_range(0..=4usize)
            };
            (0..k).map(|_| rng.random_range(0..i)).collect()
        })
        .collect()
}

/// Each node writes a Var of its own, reads the Vars `inputs` gives it, and
/// runs `work`.
pub fn random_dag(
    e: &Engine,
    inputs: &[Vec<usize>],
    work: impl Fn() + Clone + Send + 'static,
) -> usize {
    let mut vars: Vec<Var<()>> = Vec::with_capacity(inputs.len());
    for reads in inputs {
        let v = e.var(());
        let mut t = e.task("random");
        let rs: Vec<_> = reads.iter().map(|&i| t.read(&vars[i])).collect();
        let w = t.write(&v);
        let work = work.clone();
        t.push(move || {
            work();
            drop((rs, w))
        })
        .unwrap();
        vars.push(v);
    }
    inputs.len()
}

/// The inputs of [`many_reads`] for 100 Vars: each task writes one and reads
/// 2 to 19 others, chosen with a fixed seed; with the declared accesses in all
/// (about 11.5 per task).
pub fn many_reads_inputs(tasks: usize) -> (Vec<(usize, Vec<usize>)>, usize) {
    let mut rng = StdRng::seed_from_u64(11);
    let mut accesses = 0;
    let plan = (0..tasks)
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
            accesses += 1 + k;
            (w, reads)
        })
        .collect();
    (plan, accesses)
}

/// The tasks of `plan` over `vars` (100 of them): each sums what it reads into
/// what it writes. Returns the declared accesses.
pub fn many_reads(e: &Engine, vars: &[Var<u64>], plan: &[(usize, Vec<usize>)]) -> usize {
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
