//! The demonstrations of *Dive into Deep Learning* ch. 13.2 (asynchronous
//! computation) and 13.3 (automatic parallelism), shared by `examples/tour.rs`,
//! one example per demonstration, and `tests/tour.rs` (which runs each at
//! [`Sizes::quick`] and checks what it computed against a naive CPU reference).
//!
//! Every demonstration returns a report: the figures, a `json()` in the shape
//! the tour writes, and the inputs and outputs the tests check.
#![allow(dead_code)] // each example uses only some of these

pub mod async_matmul;
pub mod blockers;
pub mod bounded_queue;
pub mod overlap;
pub mod parallel;
pub mod reference;
pub mod shapes;
pub mod sync_async;

use lazyflow::{Device, Engine};
use serde_json::{json, Value};

/// What a demonstration can fail with: an engine error, or a result that does not
/// match its reference.
pub type DemoResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Problem sizes. [`Sizes::full`] are the book's (10,000-op loops, 1000x1000
/// matmuls); [`Sizes::quick`] run in seconds on lavapipe, for the tests and CI.
#[derive(Clone, Debug)]
pub struct Sizes {
    pub quick: bool,
    /// Side of the square matrices of the asynchronous benchmark.
    pub matmul: usize,
    pub matmul_reps: usize,
    /// Iterations of the sync-vs-async loops.
    pub loop_ops: usize,
    /// Side of the matrices of the unrelated work in the blockers demonstration.
    pub blockers_n: usize,
    /// Side of the matrices of the parallel demonstration.
    pub parallel_n: usize,
    /// How long each device's share of the parallel work should take alone.
    pub parallel_target_s: f64,
    /// Most steps one device's share may take (keeps the tests' reference cheap).
    pub parallel_max_steps: usize,
    /// Side and count of the products of the overlap demonstration.
    pub overlap_n: usize,
    pub overlap_k: usize,
    /// Ops recorded without waiting in the bounded-queue demonstration.
    pub backpressure_ops: usize,
}

impl Sizes {
    pub fn full() -> Sizes {
        Sizes {
            quick: false,
            matmul: 1000,
            matmul_reps: 10,
            loop_ops: 10_000,
            blockers_n: 512,
            parallel_n: 256,
            parallel_target_s: 1.0,
            parallel_max_steps: 100_000,
            overlap_n: 1024,
            overlap_k: 8,
            backpressure_ops: 1_000_000,
        }
    }

    pub fn quick() -> Sizes {
        Sizes {
            quick: true,
            matmul: 64,
            matmul_reps: 3,
            loop_ops: 200,
            blockers_n: 32,
            parallel_n: 48,
            parallel_target_s: 0.01,
            parallel_max_steps: 12,
            overlap_n: 64,
            overlap_k: 3,
            backpressure_ops: 20_000,
        }
    }
}

/// Command line of the tour and the single-demonstration examples:
/// `--quick` for small sizes, `--json PATH` for the report.
pub struct Cli {
    pub sizes: Sizes,
    pub json: Option<String>,
    /// A peer's results in its JSON (`gpu_bench --peer burn.json`), printed
    /// beside this run's.
    pub peer: Option<String>,
}

impl Cli {
    pub fn parse() -> Cli {
        Cli::parse_args(false)
    }

    /// Like [`Cli::parse`], also taking `--peer PATH` (gpu_bench).
    pub fn parse_with_peer() -> Cli {
        Cli::parse_args(true)
    }

    fn parse_args(peer: bool) -> Cli {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let mut cli = Cli {
            sizes: Sizes::full(),
            json: None,
            peer: None,
        };
        let mut it = args.iter();
        while let Some(a) = it.next() {
            match a.as_str() {
                "--quick" => cli.sizes = Sizes::quick(),
                "--json" => match it.next() {
                    Some(p) => cli.json = Some(p.clone()),
                    None => usage("--json needs a path"),
                },
                "--peer" if peer => match it.next() {
                    Some(p) => cli.peer = Some(p.clone()),
                    None => usage("--peer needs a path"),
                },
                "-h" | "--help" => usage(""),
                other => usage(&format!("unknown argument {other:?}")),
            }
        }
        cli
    }

    /// Writes `report` to the `--json` path, if one was given.
    pub fn write_json(&self, report: &Value) -> DemoResult<()> {
        if let Some(path) = &self.json {
            std::fs::write(path, serde_json::to_string_pretty(report)?)
                .map_err(|e| format!("writing {path}: {e}"))?;
            println!("wrote {path}");
        }
        Ok(())
    }
}

fn usage(problem: &str) -> ! {
    if !problem.is_empty() {
        eprintln!("{problem}");
    }
    eprintln!("usage: [--quick] [--json PATH] (gpu_bench also: [--peer PEER.json])");
    std::process::exit(if problem.is_empty() { 0 } else { 2 })
}

/// A progress line on stderr while long parts run (drawn only on a terminal),
/// with the results printed above it as they come.
pub struct Progress {
    bar: indicatif::ProgressBar,
    quiet: bool,
}

impl Progress {
    /// A progress line counting `parts` parts.
    pub fn new(parts: usize) -> Progress {
        let bar = indicatif::ProgressBar::new(parts as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] part {pos}/{len}: {msg}",
            )
            .expect("a valid progress template"),
        );
        bar.enable_steady_tick(std::time::Duration::from_millis(200));
        Progress { bar, quiet: false }
    }

    /// Nothing drawn, nothing printed: for the tests.
    pub fn quiet() -> Progress {
        Progress {
            bar: indicatif::ProgressBar::hidden(),
            quiet: true,
        }
    }

    /// Starts the next part.
    pub fn part(&self, what: impl Into<String>) {
        self.bar.inc(1);
        self.bar.set_message(what.into());
    }

    /// Prints a result line above the progress line.
    pub fn println(&self, line: impl AsRef<str>) {
        if self.quiet {
        } else if self.bar.is_hidden() {
            // Not a terminal: no progress line to keep clear of.
            println!("{}", line.as_ref());
        } else {
            self.bar.println(line.as_ref());
        }
    }

    /// Removes the progress line.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// The devices the per-device demonstrations run on: the CPU, then the first
/// logical device of every GPU adapter.
pub fn measured_devices(engine: &Engine) -> Vec<Device> {
    engine
        .devices()
        .into_iter()
        .filter(|d| *d == Device::Cpu || engine.gpu_info(*d).is_some_and(|i| i.logical == 0))
        .collect()
}

/// Whether a device runs on the host's cores (the CPU itself, or a software GPU
/// such as lavapipe), so that its figures and the CPU's compete for the same cores.
pub fn on_host_cores(engine: &Engine, device: Device) -> bool {
    match engine.gpu_info(device) {
        None => true,
        Some(i) => i.device_type == "cpu",
    }
}

/// `name` and `backend` of a device as the JSON report gives them.
pub fn device_header(engine: &Engine, device: Device) -> (String, String) {
    match engine.gpu_info(device) {
        None => (cpu_model(), "cpu".to_string()),
        Some(i) => (i.name, i.backend),
    }
}

/// The machine: cores, OS, CPU model, memory, and the GPU adapters found.
pub fn machine(engine: &Engine) -> Value {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let memory_gb = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| field_kb(&s, "MemTotal:"))
        .map(|kb| kb / 1024.0 / 1024.0);
    let gpus: Vec<Value> = measured_devices(engine)
        .into_iter()
        .filter_map(|d| engine.gpu_info(d))
        .map(|i| json!({"name": i.name, "backend": i.backend, "type": i.device_type}))
        .collect();
    json!({
        "cores": cores,
        "cpu": cpu_model(),
        "os": std::env::consts::OS,
        "arch": std::env::consts::ARCH,
        "memory_gb": memory_gb,
        "gpus": gpus,
    })
}

pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| format!("{} cpu", std::env::consts::ARCH))
}

/// A `Key: <kB> kB` field of a /proc file.
pub fn field_kb(text: &str, key: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
}

/// Kernels a device has run so far: dispatches on a GPU, ops computed on the
/// CPU (a record-time batch counts each op it computed).
pub fn kernels(engine: &Engine, device: Device) -> u64 {
    if device == Device::Cpu {
        // Ops finished, less those of record-time batches never computed.
        let s = engine.stats();
        s.completed - s.elided_ops
    } else {
        engine.kernels_dispatched(device)
    }
}

/// Everything the tour measured on one device.
pub struct DeviceReport {
    pub device: Device,
    pub name: String,
    pub backend: String,
    pub on_host_cores: bool,
    pub matmul: async_matmul::Report,
    pub loops: sync_async::Report,
    pub blockers: blockers::Report,
}

/// The whole tour.
pub struct Tour {
    pub machine: Value,
    pub devices: Vec<DeviceReport>,
    /// `Err(reason)` where the demonstration could not run.
    pub parallel: Result<parallel::Report, String>,
    pub overlap: Result<overlap::Report, String>,
    pub backpressure: bounded_queue::Report,
    /// numpy's matmul at the asynchronous benchmark's size (full sizes only, and
    /// only where python3 with numpy is installed).
    pub numpy_gflops: Option<f64>,
}

/// Runs every demonstration: 1-3 on every device, 4-6 once. The bounded queue
/// runs last: a million-node graph leaves the allocator's heap large, and faer
/// called directly afterwards measured several times slower; its memory figures come with
/// the resident size the process started from.
pub fn tour(sizes: &Sizes, p: &Progress) -> DemoResult<Tour> {
    let engine = Engine::builder().build()?; // Lazy
    let async_engine = Engine::builder().mode(lazyflow::Mode::Async).build()?;
    let devices = measured_devices(&engine);
    let mut reports = Vec::new();
    for &device in &devices {
        let (name, backend) = device_header(&engine, device);
        if device_header(&async_engine, device).0 != name {
            return Err(format!("{device} is not the same adapter in two engines").into());
        }
        let on_host = on_host_cores(&engine, device);
        let shared = if on_host && device != Device::Cpu {
            ", a software GPU on the host's cores: its figures and the CPU's compete for them"
        } else {
            ""
        };
        p.println(format!("== {device}: {name} ({backend}{shared}) =="));
        let matmul = async_matmul::run(&async_engine, device, sizes, p)?;
        let loops = sync_async::run(&engine, device, sizes, p)?;
        let blockers = blockers::run(&engine, device, sizes, p)?;
        reports.push(DeviceReport {
            device,
            name,
            backend,
            on_host_cores: on_host,
            matmul,
            loops,
            blockers,
        });
    }
    drop(async_engine);
    p.println("== computation and communication ==");
    let overlap = match devices.iter().find(|d| **d != Device::Cpu) {
        Some(&gpu) => Ok(overlap::run(&engine, gpu, sizes, p)?),
        None => {
            p.part("computation and communication");
            Err("skipped: no GPU adapter to copy from".to_string())
        }
    };
    if let Err(why) = &overlap {
        p.println(why);
    }
    let machine = machine(&engine);
    drop(engine);
    p.println("== automatic parallelism ==");
    let parallel = parallel::run(sizes, p)?;
    if let Err(why) = &parallel {
        p.println(why);
    }
    p.println("== bounded queue ==");
    let backpressure = bounded_queue::run(sizes, p)?;
    let numpy_gflops = if sizes.quick {
        None
    } else {
        async_matmul::numpy_gflops(sizes.matmul, sizes.matmul_reps)
    };
    Ok(Tour {
        numpy_gflops,
        machine,
        devices: reports,
        parallel,
        overlap,
        backpressure,
    })
}

/// How many progress parts [`tour`] has on a machine with `devices` devices.
pub fn tour_parts(devices: usize) -> usize {
    devices * 5 + 4
}

impl DeviceReport {
    /// The device for the tables: `*` marks a software GPU on the host's cores.
    fn label(&self) -> String {
        let soft = self.on_host_cores && self.device != Device::Cpu;
        format!("{}{}", self.device, if soft { "*" } else { "" })
    }
}

impl Tour {
    /// The report in the tour's JSON shape.
    pub fn json(&self) -> Value {
        let devices: Vec<Value> = self
            .devices
            .iter()
            .map(|d| {
                json!({
                    "device": d.device.to_string(),
                    "name": d.name,
                    "backend": d.backend,
                    "on_host_cores": d.on_host_cores,
                    "async_matmul": d.matmul.json(),
                    "increment": d.loops.increment.json(),
                    "increment_kept": d.loops.kept.json(),
                    "chain": d.loops.chain.json(),
                    "ops": d.loops.ops,
                    "blockers": d.blockers.json(),
                })
            })
            .collect();
        let or_skipped =
            |r: Result<Value, &String>| r.unwrap_or_else(|why| json!({"skipped": why}));
        json!({
            "machine": self.machine,
            "devices": devices,
            "parallel": or_skipped(self.parallel.as_ref().map(|r| r.json())),
            "overlap": or_skipped(self.overlap.as_ref().map(|r| r.json())),
            "backpressure": self.backpressure.json(),
            "peers": {"numpy_matmul_gflops": self.numpy_gflops},
        })
    }

    /// The results as tables.
    pub fn print(&self) {
        let m = &self.machine;
        println!(
            "\n== results: {} cores ({}), {} ==",
            m["cores"],
            m["cpu"].as_str().unwrap_or("?"),
            m["os"].as_str().unwrap_or("?")
        );
        println!(
            "{:<6} {:<30} {:>10} {:>10} {:>7} {:>9} {:>9} {:>9}",
            "device",
            format!("{} ops", self.devices.first().map_or(0, |d| d.loops.ops)),
            "sync s",
            "async s",
            "ratio",
            "us/op",
            "kernels",
            "(sync)"
        );
        for d in &self.devices {
            let ops = d.loops.ops as f64;
            for (what, l) in [
                ("y = x + 1, y discarded", &d.loops.increment),
                ("y = x + 1, every y kept", &d.loops.kept),
                ("x = x + 1, dependent chain", &d.loops.chain),
            ] {
                println!(
                    "{:<6} {:<30} {:>10.4} {:>10.4} {:>7.1} {:>9.3} {:>9} {:>9}",
                    d.label(),
                    what,
                    l.sync_s,
                    l.async_s,
                    l.ratio(),
                    l.async_s / ops * 1e6,
                    l.async_kernels,
                    l.sync_kernels
                );
            }
        }
        println!(
            "\n{:<6} {:<22} {:>16} {:>16} {:>16}",
            "device", "matmul", "no wait s", "wait_all s", "faer direct s"
        );
        for d in &self.devices {
            let r = &d.matmul;
            println!(
                "{:<6} {:<22} {:>16.5} {:>9.4} ({:>5.1}) {:>9.4} ({:>5.1})",
                d.label(),
                format!("{} x {}x{} (GFLOP/s)", r.reps, r.n, r.n),
                r.dispatch_s,
                r.synced_s,
                r.gflops(r.synced_s),
                r.cpu_gemm_s,
                r.gflops(r.cpu_gemm_s)
            );
        }
        match self.numpy_gflops {
            Some(g) => println!("numpy (same run, same size): {g:.1} GFLOP/s"),
            None => println!("numpy: not measured (quick sizes, or python3 with numpy not found)"),
        }
        println!();
        for d in &self.devices {
            let b = &d.blockers;
            println!(
                "blockers on {}: wait_to_read back in {:.6} s with {} unrelated nodes pending; wait_all {:.4} s",
                d.device, b.wait_to_read_s, b.pending_after_wait_to_read, b.wait_all_s
            );
        }
        match &self.parallel {
            Ok(r) => println!(
                "parallel: {} alone {:.4} s, {} alone {:.4} s, both {:.4} s, with a barrier {:.4} s: {:.2}x ({})",
                r.names[0], r.dev0_s, r.names[1], r.dev1_s, r.both_s, r.barrier_s, r.speedup(), r.note
            ),
            Err(why) => println!("parallel: {why}"),
        }
        match &self.overlap {
            Ok(r) => println!(
                "overlap on {}: serialized {:.4} s (compute {:.4} + copy {:.4}), overlapped {:.4} s: {:.2}x",
                r.device, r.serial_s, r.compute_s, r.copy_s, r.overlap_s, r.serial_s / r.overlap_s
            ),
            Err(why) => println!("overlap: {why}"),
        }
        let b = &self.backpressure;
        println!(
            "bounded queue, {} ops: peak {} pending nodes / {:.0} MB resident with the default bound, {} / {:.0} MB without (from {:.0} / {:.0} MB)",
            b.ops,
            b.bounded_peak_nodes,
            b.bounded_peak_rss_mb,
            b.unbounded_peak_nodes,
            b.unbounded_peak_rss_mb,
            b.bounded_base_rss_mb,
            b.unbounded_base_rss_mb
        );
        if self.devices.iter().any(|d| d.label().ends_with('*')) {
            println!("* a software GPU (lavapipe) on the host's cores, the same ones the CPU device's figures use");
        }
    }
}

/// The widest x86 vector extension the CPU reports (AVX-512, AVX2, ...), for
/// the line that names the machine beside a table.
pub fn simd_width() -> &'static str {
    let flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let has = |f: &str| {
        flags
            .lines()
            .any(|l| l.starts_with("flags") && l.split_whitespace().any(|w| w == f))
    };
    if has("avx512f") {
        "AVX-512"
    } else if has("avx2") {
        "AVX2"
    } else if has("sse4_2") {
        "SSE4.2"
    } else {
        "no x86 vector flags reported"
    }
}
