//! The machine's floor under the scheduler benchmark: what it costs to hand
//! one cache line from one core to another, next to a locked add on a line
//! the thread already holds, and a `Mutex` lock and unlock.
//!
//! ```text
//! cargo run --release --example line_cost [-- rounds]
//! ```
//!
//! `handoff`: two threads take turns adding 1 to one counter (each waits
//! for the other's add before its own), so every add finds the line in the
//! other core's cache: ns per add is one handoff. `local add`: one thread's
//! `fetch_add` on a line no other thread touches. `mutex`: an uncontended
//! `std::sync::Mutex` lock and unlock.
//!
//! Why it is here: a node of the engine is recorded on the frontend and run
//! on a worker, and a declared access touches the Var on both; each line the
//! two sides both write moves between the cores at least once per node, and
//! each atomic read-modify-write costs the local add's time at least. "On a
//! second machine class" in `docs/per-node-overhead.md` reads the scheduler
//! benchmark against these figures (with `benches/locked_per_unit.py`, which
//! counts the locked instructions per node).

mod demos;

use crossbeam_utils::CachePadded;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

fn handoff(rounds: u64) -> f64 {
    let line = CachePadded::new(AtomicU64::new(0));
    let start = Instant::now();
    std::thread::scope(|s| {
        for parity in 0..2u64 {
            let line = &line;
            s.spawn(move || {
                for i in 0..rounds {
                    let mine = 2 * i + parity;
                    while line.load(Ordering::Acquire) != mine {
                        std::hint::spin_loop();
                    }
                    line.fetch_add(1, Ordering::AcqRel);
                }
            });
        }
    });
    start.elapsed().as_secs_f64() * 1e9 / (2 * rounds) as f64
}

fn local_add(rounds: u64) -> f64 {
    let line = CachePadded::new(AtomicU64::new(0));
    let start = Instant::now();
    for _ in 0..rounds {
        std::hint::black_box(&line).fetch_add(1, Ordering::AcqRel);
    }
    std::hint::black_box(line.load(Ordering::Relaxed));
    start.elapsed().as_secs_f64() * 1e9 / rounds as f64
}

fn mutex(rounds: u64) -> f64 {
    let m = Mutex::new(0u64);
    let start = Instant::now();
    for _ in 0..rounds {
        *std::hint::black_box(&m).lock().unwrap() += 1;
    }
    std::hint::black_box(*m.lock().unwrap());
    start.elapsed().as_secs_f64() * 1e9 / rounds as f64
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rounds: u64 = std::env::args()
        .nth(1)
        .map_or(Ok(2_000_000), |s| s.parse())?;
    let cpu = demos::cpu_model();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("{cpu}, {cores} cores available, {rounds} rounds");
    if cores < 2 {
        println!("(one core: the handoff below is two threads taking turns on it)");
    }
    println!("| what | ns per op |\n|---|---|");
    for _ in 0..2 {
        println!("| handoff between two threads | {:.1} |", handoff(rounds));
        println!("| local add | {:.1} |", local_add(rounds * 10));
        println!("| mutex lock and unlock | {:.1} |", mutex(rounds * 10));
    }
    Ok(())
}
