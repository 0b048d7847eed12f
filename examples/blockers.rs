//! 3. Blockers, on every device: `wait_to_read` on one value returns while
//!    unrelated work is still pending; `to_vec`, `item` and printing block until
//!    their value is there; the counts come from the engine's statistics.
//!
//! ```text
//! cargo run --release --example blockers [-- --quick] [--json PATH]
//! ```

mod demos;

use demos::{Cli, DemoResult, Progress};
use serde_json::json;

fn main() -> DemoResult<()> {
    let cli = Cli::parse();
    let engine = lazyflow::Engine::builder()
        .mode(lazyflow::Mode::Lazy)
        .build()?;
    let devices = demos::measured_devices(&engine);
    let p = Progress::new(devices.len());
    let mut out = Vec::new();
    for d in devices {
        let r = demos::blockers::run(&engine, d, &cli.sizes, &p)?;
        out.push(json!({"device": d.to_string(), "blockers": r.json()}));
    }
    p.finish();
    cli.write_json(&json!({"machine": demos::machine(&engine), "devices": out}))
}
