//! 1. Asynchronous benchmark, on every device: ten 1000x1000 matmuls timed
//!    without waiting (the frontend is back at once), with the blocker (the real
//!    cost), and the GEMM crate (faer) called directly on the CPU. Timing without
//!    synchronization measures only how fast work was queued.
//!
//! ```text
//! cargo run --release --example async_benchmark [-- --quick] [--json PATH]
//! ```

mod demos;

use demos::{Cli, DemoResult, Progress};
use serde_json::json;

fn main() -> DemoResult<()> {
    let cli = Cli::parse();
    let engine = lazyflow::Engine::builder()
        .mode(lazyflow::Mode::Async)
        .build()?;
    let devices = demos::measured_devices(&engine);
    let p = Progress::new(devices.len());
    let mut out = Vec::new();
    for d in devices {
        let (name, backend) = demos::device_header(&engine, d);
        let r = demos::async_matmul::run(&engine, d, &cli.sizes, &p)?;
        out.push(json!({"device": d.to_string(), "name": name, "backend": backend, "async_matmul": r.json()}));
    }
    p.finish();
    cli.write_json(&json!({"machine": demos::machine(&engine), "devices": out}))
}
