//! 4. Automatic parallelism: independent work on two devices (two GPU adapters,
//!    or a GPU and the CPU), each alone, both with no barrier, and both with a
//!    barrier between them. Without a GPU adapter it says why it is skipped.
//!
//! ```text
//! cargo run --release --example parallel [-- --quick] [--json PATH]
//! ```

mod demos;

use demos::{Cli, DemoResult, Progress};
use serde_json::json;

fn main() -> DemoResult<()> {
    let cli = Cli::parse();
    let p = Progress::new(1);
    let r = demos::parallel::run(&cli.sizes, &p)?;
    p.finish();
    let report = match r {
        Ok(r) => r.json(),
        Err(why) => {
            println!("{why}");
            json!({"skipped": why})
        }
    };
    cli.write_json(&json!({"parallel": report}))
}
