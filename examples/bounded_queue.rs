//! 6. Bounded queue: 1,000,000 ops recorded without waiting, with the default
//!    backpressure bound vs none: peak pending nodes and peak resident memory.
//!
//! ```text
//! cargo run --release --example bounded_queue [-- --quick] [--json PATH]
//! ```

mod demos;

use demos::{Cli, DemoResult, Progress};
use serde_json::json;

fn main() -> DemoResult<()> {
    let cli = Cli::parse();
    let p = Progress::new(2);
    let r = demos::bounded_queue::run(&cli.sizes, &p)?;
    p.finish();
    cli.write_json(&json!({"backpressure": r.json()}))
}
