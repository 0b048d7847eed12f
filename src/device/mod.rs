//! Where a node runs. The scheduler does not look at devices: a device only decides
//! what a node's closure does once a worker has taken it (see `gpu.rs`).

pub(crate) mod gpu;
pub(crate) mod tune;

#[doc(hidden)]
pub use gpu::GpuFault;
pub use gpu::GpuInfo;
pub use tune::{TuneSource, TunedKernel};

use std::fmt;

/// A compute device of an engine.
///
/// ```
/// use lazyflow::{Device, Engine};
/// let engine = Engine::builder().workers(1).build().unwrap();
/// let devices = engine.devices();
/// assert_eq!(devices[0], Device::Cpu);
/// for d in &devices {
///     println!("{d}: {}", engine.describe(*d));
/// }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Device {
    /// The host CPU: kernels run on the engine's worker threads. Always present.
    #[default]
    Cpu,
    /// The engine's GPU device with this index (see [`crate::Engine::devices`]).
    Gpu(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Gpu(i) => write!(f, "gpu:{i}"),
        }
    }
}
