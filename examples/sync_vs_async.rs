//! 2. Sync vs async, on every device: 10,000 x `y = x + 1` with `wait_to_read`
//!    after each op vs one `wait_all` (the book: 3.16 s vs 0.93 s on MXNet), the
//!    same with every `y` kept alive, and the dependent chain `x = x + 1`; with the
//!    kernels each variant ran.
//!
//! ```text
//! cargo run --release --example sync_vs_async [-- --quick] [--json PATH]
//! ```

mod demos;

use demos::{Cli, DemoResult, Progress};
use serde_json::json;

fn main() -> DemoResult<()> {
    let cli = Cli::parse();
    let engine = lazyflow::Engine::builder().build()?;
    let devices = demos::measured_devices(&engine);
    let p = Progress::new(devices.len() * 3);
    let mut out = Vec::new();
    for d in devices {
        let (name, backend) = demos::device_header(&engine, d);
        let r = demos::sync_async::run(&engine, d, &cli.sizes, &p)?;
        out.push(json!({
            "device": d.to_string(), "name": name, "backend": backend, "ops": r.ops,
            "increment": r.increment.json(), "increment_kept": r.kept.json(), "chain": r.chain.json(),
        }));
    }
    p.finish();
    cli.write_json(&json!({"machine": demos::machine(&engine), "devices": out}))
}
