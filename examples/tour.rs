//! The tour: every demonstration of *Dive into Deep Learning* ch. 13.2-13.3,
//! measured on every device found (the CPU, and each GPU adapter).
//!
//! ```text
//! cargo run --release --example tour                 # progress, then the tables
//! cargo run --release --example tour -- --json out.json
//! cargo run --release --example tour -- --quick      # small sizes
//! ```
//!
//! 1. Asynchronous benchmark: ten 1000x1000 matmuls, without waiting, with the
//!    blocker, and faer called directly (`examples/async_benchmark.rs`).
//! 2. Sync vs async: 10,000 x `y = x + 1`, kept, and `x = x + 1`
//!    (`examples/sync_vs_async.rs`).
//! 3. Blockers (`examples/blockers.rs`).
//! 4. Automatic parallelism on two devices (`examples/parallel.rs`).
//! 5. Computation and communication (`examples/overlap.rs`).
//! 6. Bounded queue (`examples/bounded_queue.rs`).

mod demos;

fn main() -> demos::DemoResult<()> {
    let cli = demos::Cli::parse();
    let devices = lazyflow::Engine::builder().build()?;
    let n = demos::measured_devices(&devices).len();
    drop(devices);
    println!(
        "lazyflow tour on {n} device(s){}\n",
        if cli.sizes.quick { ", quick sizes" } else { "" }
    );
    let progress = demos::Progress::new(demos::tour_parts(n));
    let tour = demos::tour(&cli.sizes, &progress)?;
    progress.finish();
    tour.print();
    cli.write_json(&tour.json())
}
