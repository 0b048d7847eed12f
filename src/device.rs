//! Where a node runs. The scheduler does not look at devices: a device only decides
//! how a ready node is executed once a worker has taken it.

use std::fmt;

/// A compute device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Device {
    /// The host CPU: kernels run on the engine's worker threads. Always present.
    #[default]
    Cpu,
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
        }
    }
}
