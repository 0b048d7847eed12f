//! 4. Automatic parallelism: independent work on two devices, recorded one after
//!    the other from one thread, runs at the same time. Each device alone, both
//!    with no barrier, and both with a barrier between them.
//!
//! Which two devices: two GPU adapters if there are two; otherwise the GPU and
//! the CPU device. Two logical devices on one adapter share its execution units;
//! a GPU and the CPU are separate hardware. A software GPU (lavapipe) runs on the host's cores, so it
//! and the CPU device each get their own share of them, as a user would set it up:
//! `LP_NUM_THREADS` for lavapipe, [`lazyflow::EngineBuilder::cpu_threads`] for
//! the CPU device.

use super::{device_header, measured_devices, on_host_cores, DemoResult, Progress};
use lazyflow::{Device, Engine, Mode, Tensor};
use serde_json::{json, Value};
use std::time::Instant;

pub struct Report {
    pub devices: [Device; 2],
    pub names: [String; 2],
    /// How the devices share the machine, printed next to the figures.
    pub note: String,
    pub n: usize,
    /// Each device's share: `steps` times `y = tanh(y @ w)`, sized so that
    /// each takes about the same time alone.
    pub steps: [usize; 2],
    pub dev0_s: f64,
    pub dev1_s: f64,
    pub both_s: f64,
    pub barrier_s: f64,
    /// Inputs and results per device, for the tests.
    pub y0: [Vec<f32>; 2],
    pub w: [Vec<f32>; 2],
    pub out: [Vec<f32>; 2],
}

impl Report {
    pub fn speedup(&self) -> f64 {
        self.barrier_s / self.both_s
    }

    pub fn json(&self) -> Value {
        json!({
            "devices": [self.names[0].clone(), self.names[1].clone()],
            "device_ids": [self.devices[0].to_string(), self.devices[1].to_string()],
            "note": self.note,
            "n": self.n,
            "steps": self.steps,
            "dev0_s": self.dev0_s,
            "dev1_s": self.dev1_s,
            "both_s": self.both_s,
            "barrier_s": self.barrier_s,
            "speedup": self.speedup(),
        })
    }
}

/// Opens its own engine (Async mode, so that work starts when recorded).
/// `Ok(Err(reason))` when there is no second device.
pub fn run(sizes: &super::Sizes, p: &Progress) -> DemoResult<Result<Report, String>> {
    p.part("automatic parallelism on two devices");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let probe = Engine::builder().mode(Mode::Async).build()?;
    let adapters: Vec<Device> = measured_devices(&probe)
        .into_iter()
        .filter(|d| *d != Device::Cpu)
        .collect();
    let (engine, pair, note) = match adapters.as_slice() {
        [] => {
            return Ok(Err(
                "skipped: no GPU adapter, and automatic parallelism needs a second device"
                    .to_string(),
            ))
        }
        [g0, g1, ..] => {
            let note = if on_host_cores(&probe, *g0) || on_host_cores(&probe, *g1) {
                "two GPU adapters; at least one runs on the host's cores".to_string()
            } else {
                "two GPU adapters".to_string()
            };
            let pair = [*g0, *g1];
            (probe, pair, note)
        }
        [g] if on_host_cores(&probe, *g) => {
            drop(probe);
            let gpu_share = (cores / 2).max(1);
            let cpu_share = (cores - gpu_share).max(1);
            let engine = with_lp_threads(gpu_share, || {
                let e = Engine::builder()
                    .mode(Mode::Async)
                    .cpu_threads(cpu_share)
                    .build()?;
                e.devices(); // opens the GPU while LP_NUM_THREADS is set
                Ok::<_, lazyflow::Error>(e)
            })?;
            let gpu = measured_devices(&engine)
                .into_iter()
                .find(|d| *d != Device::Cpu)
                .ok_or("the GPU adapter disappeared")?;
            let note = format!(
                "GPU + CPU; the GPU is lavapipe on the host's {cores} cores: it gets {} (LP_NUM_THREADS), the CPU device's kernels {cpu_share} (cpu_threads)",
                std::env::var("LP_NUM_THREADS").unwrap_or_else(|_| gpu_share.to_string())
            );
            (engine, [gpu, Device::Cpu], note)
        }
        [g] => {
            let gpu = *g;
            (probe, [gpu, Device::Cpu], "GPU + CPU".to_string())
        }
    };
    let n = sizes.parallel_n;
    // Variance-preserving weights (uniform entries of variance 1/n): with a
    // smaller scale the chain decays geometrically into denormal floats, which
    // x86 computes many times slower (measured: 24x per step after 300 steps).
    let scale = (3.0 / n as f32).sqrt();
    let inputs = |seed: u64, d: Device| -> lazyflow::Result<(Tensor, Tensor)> {
        let y = Tensor::rand_uniform_in(&engine, [n, n], -1.0, 1.0, seed)?.to(d)?;
        let w = (Tensor::rand_uniform_in(&engine, [n, n], -1.0, 1.0, seed + 1)? * scale).to(d)?;
        Ok((y, w))
    };
    let (y0a, w0) = inputs(21, pair[0])?;
    let (y0b, w1) = inputs(23, pair[1])?;
    let work = |y0: &Tensor, w: &Tensor, steps: usize| -> lazyflow::Result<Tensor> {
        let mut y = y0.clone();
        for _ in 0..steps {
            y = y.matmul(w)?.tanh();
        }
        Ok(y)
    };
    let time = |f: &dyn Fn() -> lazyflow::Result<()>| -> lazyflow::Result<f64> {
        engine.wait_all()?;
        let t = Instant::now();
        f()?;
        engine.wait_all()?;
        Ok(t.elapsed().as_secs_f64())
    };

    // Size each share so that it takes about `parallel_target_s` alone: time
    // growing probes until one takes an eighth of the target.
    let calibrate = |y0: &Tensor, w: &Tensor| -> lazyflow::Result<usize> {
        work(y0, w, 2)?.wait_to_read()?; // warm-up
        let mut probe_steps = 1;
        loop {
            let t = time(&|| work(y0, w, probe_steps).map(drop))?;
            if t >= sizes.parallel_target_s / 8.0 || probe_steps >= sizes.parallel_max_steps {
                let steps = (sizes.parallel_target_s * probe_steps as f64 / t.max(1e-9)).round();
                return Ok((steps as usize).clamp(1, sizes.parallel_max_steps));
            }
            probe_steps *= 2;
        }
    };
    let mut steps = [calibrate(&y0a, &w0)?, calibrate(&y0b, &w1)?];
    let alone = |i: usize, steps: usize| {
        if i == 0 {
            time(&|| work(&y0a, &w0, steps).map(drop))
        } else {
            time(&|| work(&y0b, &w1, steps).map(drop))
        }
    };
    // Short probes overestimate the cost per step; one correction from a
    // full-length run brings each share close to the target.
    let mut alone_s = [0.0; 2];
    for i in 0..2 {
        alone_s[i] = alone(i, steps[i])?;
        let off = sizes.parallel_target_s / alone_s[i];
        if !(0.8..=1.25).contains(&off) && steps[i] < sizes.parallel_max_steps {
            steps[i] =
                ((steps[i] as f64 * off).round() as usize).clamp(1, sizes.parallel_max_steps);
            alone_s[i] = alone(i, steps[i])?;
        }
    }
    let [dev0_s, dev1_s] = alone_s;
    let outs = std::cell::RefCell::new(Vec::new());
    let both_s = time(&|| {
        let a = work(&y0a, &w0, steps[0])?;
        let b = work(&y0b, &w1, steps[1])?;
        outs.borrow_mut().extend([a, b]);
        Ok(())
    })?;
    let barrier_s = time(&|| {
        work(&y0a, &w0, steps[0])?;
        engine.wait_all()?;
        work(&y0b, &w1, steps[1]).map(drop)
    })?;
    let outs = outs.into_inner();
    let names = pair.map(|d| {
        let (name, _) = device_header(&engine, d);
        format!("{d} ({name})")
    });
    let r = Report {
        devices: pair,
        names,
        note,
        n,
        steps,
        dev0_s,
        dev1_s,
        both_s,
        barrier_s,
        y0: [y0a.to_vec()?, y0b.to_vec()?],
        w: [w0.to_vec()?, w1.to_vec()?],
        out: [outs[0].to_vec()?, outs[1].to_vec()?],
    };
    p.println(format!(
        "{}: {} steps alone {dev0_s:.4} sec; {}: {} steps alone {dev1_s:.4} sec",
        r.names[0], steps[0], r.names[1], steps[1]
    ));
    p.println(format!(
        "both, no barrier: {both_s:.4} sec; with a barrier between them: {barrier_s:.4} sec; speedup {:.2}x ({})",
        r.speedup(),
        r.note
    ));
    Ok(Ok(r))
}

/// Runs `f` with `LP_NUM_THREADS=threads` unless the user set it already.
fn with_lp_threads<T>(threads: usize, f: impl FnOnce() -> T) -> T {
    const KEY: &str = "LP_NUM_THREADS";
    if std::env::var_os(KEY).is_some() {
        return f();
    }
    // Read by Mesa when the adapter is opened; no other thread opens one now.
    std::env::set_var(KEY, threads.to_string());
    let out = f();
    std::env::remove_var(KEY);
    out
}
