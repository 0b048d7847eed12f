//! Building an engine: mode, workers and backpressure, from code or environment.

use super::{Config, Engine};
use crate::error::{Error, Result};

/// When recorded nodes run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Nodes wait until something demands them: a blocker, `wait_all`, or the
    /// backpressure high mark. A flush sees the whole subgraph it needs.
    Lazy,
    /// Every node is demanded when it is recorded (MXNet's default engine).
    Async,
    /// Every call completes before it returns (MXNet's NaiveEngine): for
    /// debugging, errors appear at the call site.
    Sync,
}

impl std::str::FromStr for Mode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Mode> {
        match s.trim().to_ascii_lowercase().as_str() {
            "lazy" => Ok(Mode::Lazy),
            "async" => Ok(Mode::Async),
            "sync" => Ok(Mode::Sync),
            other => Err(Error::Config(format!(
                "LAZYFLOW_MODE={other:?}: expected lazy, async or sync"
            ))),
        }
    }
}

/// Default GPU timeout: ten minutes. One wait may cover a 4096 x 4096 matmul
/// (137 GFLOP) on a software GPU: at the 6.7 GFLOP/s lavapipe reached on two
/// AVX-512 cores that is about 20 s, at the 0.7 GFLOP/s (1000 x 1000 products)
/// it reached on two AVX2 cores about 200 s (estimated from those rates, not
/// timed); ten minutes leaves room for that and still ends a hung kernel.
pub const DEFAULT_GPU_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// Default backpressure high mark (recorded, unfinished nodes).
pub const DEFAULT_HIGH_WATERMARK: usize = 16_384;

/// Default backpressure low mark: a stalled frontend resumes once everything it
/// recorded has finished. When the engine had one lock, resuming earlier (at
/// half the high mark) made recording and running contend for it, and a
/// 1,000,000-node chain took 436 ns per node instead of 205 on 2 cores.
/// Recording and running overlap through Lazy mode's window instead (see
/// [`EngineBuilder::backpressure`]): the stall only happens when the workers
/// have fallen behind by the whole bound, and then the backend is the
/// bottleneck anyway.
pub const DEFAULT_LOW_WATERMARK: usize = 0;

/// Configures an [`Engine`]. Values set here win over the environment
/// (`LAZYFLOW_MODE=lazy|async|sync`, `LAZYFLOW_WORKERS=N`), which wins over the
/// defaults (Lazy, one worker per available core, backpressure at
/// [`DEFAULT_HIGH_WATERMARK`] down to [`DEFAULT_LOW_WATERMARK`]).
///
/// ```
/// use lazyflow::{Engine, Mode};
/// let engine = Engine::builder()
///     .mode(Mode::Async)
///     .workers(2)
///     .backpressure(1024, 512)
///     .build()
///     .unwrap();
/// assert_eq!(engine.mode(), Mode::Async);
/// ```
#[derive(Clone, Debug, Default)]
pub struct EngineBuilder {
    mode: Option<Mode>,
    workers: Option<usize>,
    watermarks: Option<(usize, usize)>,
    backends: Option<String>,
    logical_devices: Option<usize>,
    fusion: Option<bool>,
    cpu_threads: Option<usize>,
    gpu_timeout: Option<std::time::Duration>,
    autotune: Option<bool>,
    autotune_cache: Option<std::path::PathBuf>,
    matmul_kernel: Option<String>,
    ignore_env: bool,
}

impl EngineBuilder {
    pub(crate) fn defaults_only() -> Self {
        EngineBuilder {
            ignore_env: true,
            ..Default::default()
        }
    }

    /// Sets the execution mode.
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = Some(mode);
        self
    }

    /// Sets the number of worker threads (at least 1).
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = Some(n);
        self
    }

    /// Bounds the recorded-but-unfinished nodes: recording stalls at `high` until
    /// `low` remain (in Lazy mode it first flushes everything recorded).
    ///
    /// `high` also sets the window of Lazy mode: a thread that has recorded
    /// `high / 8` nodes (at least 64) since its last ones were demanded
    /// demands them, so that they run while it records the next.
    pub fn backpressure(mut self, high: usize, low: usize) -> Self {
        self.watermarks = Some((high, low));
        self
    }

    /// Which wgpu backends to look for GPUs on: a comma-separated list of
    /// `vulkan`, `metal`, `dx12`, `gl`, or `all` (the default) or `none`. Also
    /// `LAZYFLOW_BACKENDS`. An adapter seen through several backends is listed
    /// once (Vulkan first) unless only the others are asked for.
    pub fn backends(mut self, backends: &str) -> Self {
        self.backends = Some(backends.to_string());
        self
    }

    /// Opens `n` logical devices (each its own wgpu Device and in-order Queue) on
    /// every GPU adapter: how multi-device parallelism is shown on one GPU.
    pub fn logical_devices(mut self, n: usize) -> Self {
        self.logical_devices = Some(n);
        self
    }

    /// Fuses chains of elementwise GPU ops into generated kernels (default on;
    /// `LAZYFLOW_FUSION=0` turns it off, for comparison).
    pub fn fusion(mut self, on: bool) -> Self {
        self.fusion = Some(on);
        self
    }

    /// Times a kernel's variants the first time a shape class is seen on an
    /// adapter and keeps the fastest (default on; `LAZYFLOW_AUTOTUNE=0` turns
    /// it off). Today that is the matrix product (and so the convolution,
    /// which is lowered to it): see [`crate::matmul_kernels`] for its
    /// variants. The trials run as part of the node that first needs them, on
    /// a worker, never on the frontend; a 1024² product is tuned in well under
    /// a second of lavapipe. Off, each adapter class takes a default variant:
    /// tall direct tiles on a CPU adapter (lavapipe), shared 64 x 64 tiles
    /// elsewhere. [`crate::Engine::tuned_kernels`] lists the choices.
    ///
    /// ```
    /// let engine = lazyflow::Engine::builder().autotune(false).build().unwrap();
    /// # drop(engine);
    /// ```
    pub fn autotune(mut self, on: bool) -> Self {
        self.autotune = Some(on);
        self
    }

    /// Keeps the autotuner's choices in this file between runs (also
    /// `LAZYFLOW_AUTOTUNE_CACHE`): a line per adapter, driver, kernel and
    /// shape class, with a hash of the chosen variant's source, so that a
    /// changed kernel or driver is tuned anew. Without it, choices last as
    /// long as the process (shared by all its engines).
    ///
    /// ```
    /// let path = std::env::temp_dir().join("lazyflow-autotune.txt");
    /// let engine = lazyflow::Engine::builder().autotune_cache(path).build().unwrap();
    /// # drop(engine);
    /// ```
    pub fn autotune_cache(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.autotune_cache = Some(path.into());
        self
    }

    /// Runs every matrix product with this variant of the kernel instead of
    /// tuning (also `LAZYFLOW_MATMUL_KERNEL`); one of
    /// [`crate::matmul_kernels`], or [`Engine::build`](Self::build) fails.
    ///
    /// ```
    /// let engine = lazyflow::Engine::builder().matmul_kernel("d32x32t4x4").build().unwrap();
    /// # drop(engine);
    /// assert!(lazyflow::Engine::builder().matmul_kernel("fast").build().is_err());
    /// ```
    pub fn matmul_kernel(mut self, name: &str) -> Self {
        self.matmul_kernel = Some(name.to_string());
        self
    }

    /// Threads one CPU kernel may use (default: every core; also
    /// `LAZYFLOW_CPU_THREADS`). Today that is the matrix product, which runs on
    /// faer's rayon parallelism; elementwise kernels use one thread each. Setting
    /// it leaves cores for other devices, e.g. a software GPU such as lavapipe
    /// (`LP_NUM_THREADS`), so that work on the two can run side by side.
    ///
    /// ```
    /// use lazyflow::{Engine, Tensor};
    /// let engine = Engine::builder().cpu_threads(1).build().unwrap();
    /// assert_eq!(engine.cpu_threads(), 1);
    /// let x = Tensor::ones_in(&engine, [128, 128]);
    /// assert_eq!(x.matmul(&x).unwrap().sum().item().unwrap(), 128.0 * 128.0 * 128.0);
    /// ```
    pub fn cpu_threads(mut self, n: usize) -> Self {
        self.cpu_threads = Some(n);
        self
    }

    /// How long a wait for a GPU (a readback, `wait_all`) may take before the
    /// device counts as hung: the wait returns an error and the device is treated
    /// as lost (every later node, readback and wait on it fails at once; other
    /// devices go on). Default [`DEFAULT_GPU_TIMEOUT`]; also
    /// `LAZYFLOW_GPU_TIMEOUT_MS`.
    ///
    /// ```
    /// use lazyflow::Engine;
    /// use std::time::Duration;
    /// let engine = Engine::builder().gpu_timeout(Duration::from_secs(10)).build().unwrap();
    /// # drop(engine);
    /// ```
    pub fn gpu_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.gpu_timeout = Some(timeout);
        self
    }

    /// Turns backpressure off: the frontend may run arbitrarily far ahead.
    pub fn unbounded(mut self) -> Self {
        self.watermarks = Some((usize::MAX, usize::MAX));
        self
    }

    /// Starts the engine's worker threads.
    pub fn build(self) -> Result<Engine> {
        let env = |key: &str| {
            if self.ignore_env {
                None
            } else {
                std::env::var(key).ok().filter(|v| !v.trim().is_empty())
            }
        };
        let mode = match (self.mode, env("LAZYFLOW_MODE")) {
            (Some(m), _) => m,
            (None, Some(v)) => v.parse()?,
            (None, None) => Mode::Lazy,
        };
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let count = |set: Option<usize>, key: &str| -> Result<usize> {
            match (set, env(key)) {
                (Some(n), _) => Ok(n),
                (None, Some(v)) => v.trim().parse().map_err(|_| {
                    Error::Config(format!("{key}={v:?}: expected a positive integer"))
                }),
                (None, None) => Ok(cores),
            }
        };
        let workers = count(self.workers, "LAZYFLOW_WORKERS")?;
        if workers == 0 {
            return Err(Error::Config("an engine needs at least one worker".into()));
        }
        let cpu_threads = count(self.cpu_threads, "LAZYFLOW_CPU_THREADS")?;
        if cpu_threads == 0 {
            return Err(Error::Config(
                "CPU kernels need at least one thread (cpu_threads)".into(),
            ));
        }
        let (high, low) = self
            .watermarks
            .unwrap_or((DEFAULT_HIGH_WATERMARK, DEFAULT_LOW_WATERMARK));
        if high == 0 || low > high {
            return Err(Error::Config(format!(
                "backpressure watermarks must satisfy 0 <= low <= high, 0 < high (got high {high}, low {low})"
            )));
        }
        let backends = match (self.backends, env("LAZYFLOW_BACKENDS")) {
            (Some(b), _) | (None, Some(b)) => crate::device::gpu::parse_backends(&b)
                .map_err(|e| Error::Config(format!("backends {b:?}: {e}")))?,
            (None, None) => wgpu::Backends::all(),
        };
        let logical_devices = self.logical_devices.unwrap_or(1);
        let fusion = match (self.fusion, env("LAZYFLOW_FUSION")) {
            (Some(f), _) => f,
            (None, Some(v)) => parse_switch("LAZYFLOW_FUSION", &v)?,
            (None, None) => true,
        };
        let autotune_on = match (self.autotune, env("LAZYFLOW_AUTOTUNE")) {
            (Some(on), _) => on,
            (None, Some(v)) => parse_switch("LAZYFLOW_AUTOTUNE", &v)?,
            (None, None) => true,
        };
        let mut autotune = crate::device::tune::Autotune {
            on: autotune_on,
            cache: self
                .autotune_cache
                .or_else(|| env("LAZYFLOW_AUTOTUNE_CACHE").map(Into::into)),
            pinned: Vec::new(),
        };
        if let Some(name) = self.matmul_kernel.or_else(|| env("LAZYFLOW_MATMUL_KERNEL")) {
            let name = name.trim().to_string();
            if !crate::matmul_kernels().contains(&name.as_str()) {
                return Err(Error::Config(format!(
                    "no matmul kernel is named {name:?}; the variants are {}",
                    crate::matmul_kernels().join(", ")
                )));
            }
            autotune.pinned.push(("matmul", name));
        }
        let gpu_timeout = match (self.gpu_timeout, env("LAZYFLOW_GPU_TIMEOUT_MS")) {
            (Some(t), _) => t,
            (None, Some(v)) => match v.trim().parse::<u64>() {
                Ok(ms) => std::time::Duration::from_millis(ms),
                Err(_) => {
                    return Err(Error::Config(format!(
                        "LAZYFLOW_GPU_TIMEOUT_MS={v:?}: expected milliseconds"
                    )))
                }
            },
            (None, None) => DEFAULT_GPU_TIMEOUT,
        };
        if gpu_timeout.is_zero() {
            return Err(Error::Config("the GPU timeout must be positive".into()));
        }
        Engine::start(Config {
            mode,
            workers,
            high,
            low,
            backends,
            logical_devices,
            cpu_threads,
            gpu: crate::device::gpu::GpuOptions {
                fusion,
                timeout: gpu_timeout,
                autotune,
            },
        })
    }
}

/// An on/off environment variable.
fn parse_switch(key: &str, value: &str) -> Result<bool> {
    match value.trim() {
        "0" | "false" | "off" => Ok(false),
        "1" | "true" | "on" => Ok(true),
        other => Err(Error::Config(format!("{key}={other:?}: expected 0 or 1"))),
    }
}
