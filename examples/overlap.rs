//! 5. Computation and communication: products computed on a GPU while earlier
//!    ones are copied to the CPU, overlapped vs serialized by a barrier.
//!    Without a GPU adapter it says why it is skipped.
//!
//! ```text
//! cargo run --release --example overlap [-- --quick] [--json PATH]
//! ```

mod demos;

use demos::{Cli, DemoResult, Progress};
use serde_json::json;

fn main() -> DemoResult<()> {
    let cli = Cli::parse();
    let engine = lazyflow::Engine::builder().build()?;
    let report = match demos::measured_devices(&engine)
        .into_iter()
        .find(|d| *d != lazyflow::Device::Cpu)
    {
        Some(gpu) => {
            let p = Progress::new(1);
            let r = demos::overlap::run(&engine, gpu, &cli.sizes, &p)?;
            p.finish();
            r.json()
        }
        None => {
            let why = "skipped: no GPU adapter to copy from";
            println!("{why}");
            json!({"skipped": why})
        }
    };
    cli.write_json(&json!({"overlap": report}))
}
