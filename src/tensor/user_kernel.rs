//! A user's own WGSL kernel, recorded as a node with declared reads and writes
//! and dispatched through the device's generic kernel path.

use super::{Data, Tensor};
use crate::device::gpu::{Access, GpuBuffer, Grid, KernelSource};
use crate::device::Device;
use crate::engine::Engine;
use crate::error::{Error, Location, Result};

/// Records a user's WGSL compute kernel as a node: bind tensors in order
/// ([`KernelBuilder::read`] for `var<storage, read>`, [`KernelBuilder::write`] for
/// `var<storage, read_write>`, at `@group(0) @binding(0..)`), choose the
/// workgroup counts, and run. The node is ordered like any other access to those
/// tensors. A kernel that does not compile or does not match its bindings fails
/// its node: the tensors it writes are poisoned with the error, other work goes
/// on.
///
/// ```
/// use lazyflow::{Device, Engine, Tensor};
/// let engine = Engine::builder().workers(1).build().unwrap();
/// let source = "
///     @group(0) @binding(0) var<storage, read> x: array<f32>;
///     @group(0) @binding(1) var<storage, read_write> y: array<f32>;
///     @compute @workgroup_size(64)
///     fn main(@builtin(global_invocation_id) id: vec3<u32>) {
///         if (id.x < arrayLength(&y)) { y[id.x] = 3.0 * x[id.x]; }
///     }";
/// for device in engine.devices().into_iter().filter(|d| *d != Device::Cpu) {
///     let x = Tensor::arange_in(&engine, 0.0, 100.0, 1.0).to(device).unwrap();
///     let y = Tensor::zeros_in(&engine, [100]).to(device).unwrap();
///     let mut k = engine.kernel("triple", source);
///     k.read(&x).write(&y).workgroups(2, 1, 1);
///     k.run().unwrap();
///     assert_eq!(y.to_vec().unwrap()[99], 297.0);
/// }
/// ```
#[must_use = "a kernel is recorded only by run"]
pub struct KernelBuilder<'e> {
    engine: &'e Engine,
    name: &'static str,
    source: String,
    location: Location,
    bindings: Vec<(Tensor, bool)>,
    workgroups: (u32, u32, u32),
}

impl Engine {
    /// Starts recording a user WGSL kernel named `name` (used in errors).
    #[track_caller]
    pub fn kernel(&self, name: &'static str, wgsl: impl Into<String>) -> KernelBuilder<'_> {
        KernelBuilder {
            engine: self,
            name,
            source: wgsl.into(),
            location: Location::caller(),
            bindings: Vec::new(),
            workgroups: (1, 1, 1),
        }
    }
}

impl KernelBuilder<'_> {
    /// Binds `tensor` read-only at the next binding index.
    pub fn read(&mut self, tensor: &Tensor) -> &mut Self {
        self.bindings.push((tensor.clone(), false));
        self
    }

    /// Binds `tensor` read-write at the next binding index; the kernel writes it
    /// in place.
    pub fn write(&mut self, tensor: &Tensor) -> &mut Self {
        self.bindings.push((tensor.clone(), true));
        self
    }

    /// Workgroup counts of the dispatch (default 1, 1, 1).
    pub fn workgroups(&mut self, x: u32, y: u32, z: u32) -> &mut Self {
        self.workgroups = (x, y, z);
        self
    }

    /// Records the kernel. Fails at once when the tensors are not all on one GPU
    /// of this engine, or when one is bound twice with write access.
    pub fn run(self) -> Result<()> {
        let (name, location) = (self.name, self.location);
        let Some((first, _)) = self.bindings.first() else {
            return Err(Error::InvalidArgument {
                op: name,
                shape: "[]".into(),
                reason: "a kernel needs at least one bound tensor".into(),
                location,
            });
        };
        let device = first.device;
        let devices: Vec<String> = self
            .bindings
            .iter()
            .map(|(t, _)| t.device.to_string())
            .collect();
        if device == Device::Cpu || self.bindings.iter().any(|(t, _)| t.device != device) {
            return Err(Error::DeviceMismatch {
                op: name,
                devices: format!("{} (all must be one GPU)", devices.join(", ")),
                location,
            });
        }
        for (i, (t, w)) in self.bindings.iter().enumerate() {
            let aliased = self.bindings[..i]
                .iter()
                .any(|(u, uw)| u.same_data(t) && (*w || *uw));
            if aliased {
                return Err(Error::InvalidArgument {
                    op: name,
                    shape: t.shape.to_string(),
                    reason: format!(
                        "binding {i} aliases an earlier one and one of them is written"
                    ),
                    location,
                });
            }
        }
        let Some(gpu) = first.gpu(name, location)? else {
            unreachable!("checked above that the device is a GPU")
        };
        let mut t = self.engine.task_at(name, location);
        t.device(device);
        let mut reads = Vec::new();
        let mut writes = Vec::new();
        for (i, (tensor, write)) in self.bindings.iter().enumerate() {
            if *write {
                // A kernel may read what it writes: keep the old value's ordering.
                drop(t.read(&tensor.var));
                writes.push((i, t.write(&tensor.var), tensor.numel()));
            } else {
                reads.push((i, t.read(&tensor.var)));
            }
        }
        let (x, y, z) = self.workgroups;
        let source = self.source;
        let pending = gpu.expect_node();
        t.push_fallible(move || {
            // An output that was never computed gets a buffer of its size.
            for (_, w, n) in &writes {
                let mut g = w.write();
                if !matches!(&*g, Data::Gpu(_)) {
                    *g = Data::Gpu(gpu.alloc(*n)?);
                }
            }
            let read_guards: Vec<_> = reads.iter().map(|(i, r)| (*i, r.read())).collect();
            let write_guards: Vec<_> = writes.iter().map(|(i, w, _)| (*i, w.read())).collect();
            let mut all: Vec<(usize, &GpuBuffer)> = Vec::new();
            for (i, g) in read_guards.iter().chain(write_guards.iter()) {
                all.push((*i, g.gpu()?));
            }
            all.sort_by_key(|(i, _)| *i);
            let bindings: Vec<(&GpuBuffer, Access)> = all
                .into_iter()
                .map(|(i, b)| {
                    let written = writes.iter().any(|(w, _, _)| *w == i);
                    (b, if written { Access::Write } else { Access::Read })
                })
                .collect();
            gpu.dispatch(
                KernelSource::WHOLE,
                &source,
                &bindings,
                &[],
                Grid::Exact(x, y, z),
            )?;
            drop(pending);
            Ok(())
        })
    }
}
