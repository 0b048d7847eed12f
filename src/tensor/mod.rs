//! `f32` tensors whose ops are recorded as nodes on an engine.
//!
//! A [`Tensor`] is a handle: a shape, a device and a [`Var`] holding the data. Ops
//! validate shapes when they are recorded and return `Err` naming the op, the
//! shapes and the caller's location; the work itself runs when something demands
//! it. Data of an op's output is allocated by the op when it runs, so a value that
//! is never demanded is never allocated.
//!
//! Operators (`+`, `-`, `*`, `/`, unary `-`) cannot return `Result`: when their
//! operands do not fit, they return a tensor that is *poisoned* with the shape error,
//! which the next blocker on it (or on anything computed from it) returns. Use the
//! named methods ([`Tensor::add`], ...) to get the error at the call site.

mod autograd;
mod batch;
mod conv;
mod conv_kernels;
pub(crate) mod fusion;
mod gpu_ops;
mod grads;
pub(crate) mod kernels;
mod matmul_kernels;
pub(crate) mod nn_kernels;
mod nn_ops;
mod ops;
pub use ops::CPU_BATCH_MAX;
mod shaders;
mod shape;
mod user_kernel;

pub use autograd::{no_grad, NoGrad};
pub use matmul_kernels::{matmul_class, matmul_kernels};
pub use nn_kernels::PoolKind;
pub use nn_ops::Reduction;
pub use shape::Shape;
pub use user_kernel::KernelBuilder;

use crate::device::{
    gpu::{Gpu, GpuBuffer},
    Device,
};
use crate::engine::Engine;
use crate::error::{Error, Location, Result};
use crate::var::Var;
use std::fmt;
use std::sync::Arc;

/// A tensor's storage: host memory, or a buffer on the tensor's GPU.
#[derive(Debug)]
pub(crate) enum Data {
    Host(Vec<f32>),
    Gpu(GpuBuffer),
}

impl Default for Data {
    /// The placeholder an op's output holds until the op runs.
    fn default() -> Self {
        Data::Host(Vec::new())
    }
}

impl Data {
    /// The host data. A device mismatch is caught when an op is recorded, so the
    /// error here is a defence, reported as the node's failure.
    pub(crate) fn host(&self) -> std::result::Result<&Vec<f32>, String> {
        match self {
            Data::Host(v) => Ok(v),
            Data::Gpu(_) => Err("expected host data, found a GPU buffer".to_string()),
        }
    }

    pub(crate) fn host_mut(&mut self) -> std::result::Result<&mut Vec<f32>, String> {
        match self {
            Data::Host(v) => Ok(v),
            Data::Gpu(_) => Err("expected host data, found a GPU buffer".to_string()),
        }
    }

    pub(crate) fn gpu(&self) -> std::result::Result<&GpuBuffer, String> {
        match self {
            Data::Gpu(b) => Ok(b),
            Data::Host(_) => Err("expected a GPU buffer, found host data".to_string()),
        }
    }
}

/// An `f32` tensor on a device, computed by the engine that owns it.
///
/// Cloning a `Tensor` clones the handle; the data is shared. [`Tensor::reshape`]
/// also shares the data (a view); every other op produces new data.
///
/// ```
/// use lazyflow::{Engine, Tensor};
/// let engine = Engine::builder().workers(1).build().unwrap();
/// let a = Tensor::from_vec_in(&engine, vec![1.0, 2.0, 3.0, 4.0], [2, 2]).unwrap();
/// let b = (&a * 2.0 + 1.0).sum();
/// assert_eq!(b.item().unwrap(), 24.0);
/// ```
#[derive(Clone)]
pub struct Tensor {
    pub(crate) shape: Shape,
    pub(crate) var: Var<Data>,
    pub(crate) device: Device,
    /// Where this tensor is on the autodiff tape, if it is (see `autograd.rs`).
    pub(crate) tape: Option<autograd::Tape>,
}

impl Tensor {
    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The dimensions (`self.shape().dims()`).
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }

    /// The device the data lives on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The engine that computes this tensor.
    pub fn engine(&self) -> &Engine {
        self.var.engine()
    }

    /// Whether two tensors share their data.
    pub fn same_data(&self, other: &Tensor) -> bool {
        self.var.same(&other.var)
    }

    // ----- creation ---------------------------------------------------------

    /// A tensor holding `data` (row-major) with `shape`. Fails if the lengths
    /// differ.
    #[track_caller]
    pub fn from_vec_in(engine: &Engine, data: Vec<f32>, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if data.len() != shape.numel() {
            return Err(Error::InvalidArgument {
                op: "from_vec",
                shape: shape.to_string(),
                reason: format!("{} values given for {} elements", data.len(), shape.numel()),
                location: Location::caller(),
            });
        }
        Ok(Tensor {
            shape,
            var: engine.var(Data::Host(data)),
            device: Device::Cpu,
            tape: None,
        })
    }

    /// [`Tensor::from_vec_in`] on the global engine.
    #[track_caller]
    pub fn from_vec(data: Vec<f32>, shape: impl Into<Shape>) -> Result<Tensor> {
        Tensor::from_vec_in(Engine::global(), data, shape)
    }

    /// A tensor holding a copy of `data` with `shape`.
    #[track_caller]
    pub fn from_slice_in(engine: &Engine, data: &[f32], shape: impl Into<Shape>) -> Result<Tensor> {
        Tensor::from_vec_in(engine, data.to_vec(), shape)
    }

    /// [`Tensor::from_slice_in`] on the global engine.
    #[track_caller]
    pub fn from_slice(data: &[f32], shape: impl Into<Shape>) -> Result<Tensor> {
        Tensor::from_vec_in(Engine::global(), data.to_vec(), shape)
    }

    /// A scalar (rank 0) tensor.
    pub fn scalar_in(engine: &Engine, value: f32) -> Tensor {
        Tensor {
            shape: Shape::scalar(),
            var: engine.var(Data::Host(vec![value])),
            device: Device::Cpu,
            tape: None,
        }
    }

    /// A tensor filled with `value`. The fill is a recorded node: nothing is
    /// allocated until it is demanded.
    #[track_caller]
    pub fn full_in(engine: &Engine, shape: impl Into<Shape>, value: f32) -> Tensor {
        Tensor::generate(engine, "full", Location::caller(), shape.into(), move |n| {
            ops::filled(n, value)
        })
    }

    /// [`Tensor::full_in`] on the global engine.
    #[track_caller]
    pub fn full(shape: impl Into<Shape>, value: f32) -> Tensor {
        Tensor::full_in(Engine::global(), shape, value)
    }

    /// A tensor of zeros.
    #[track_caller]
    pub fn zeros_in(engine: &Engine, shape: impl Into<Shape>) -> Tensor {
        Tensor::generate(engine, "zeros", Location::caller(), shape.into(), |n| {
            ops::zeroed(n)
        })
    }

    /// [`Tensor::zeros_in`] on the global engine.
    #[track_caller]
    pub fn zeros(shape: impl Into<Shape>) -> Tensor {
        Tensor::zeros_in(Engine::global(), shape)
    }

    /// A tensor of ones.
    #[track_caller]
    pub fn ones_in(engine: &Engine, shape: impl Into<Shape>) -> Tensor {
        Tensor::generate(engine, "ones", Location::caller(), shape.into(), |n| {
            ops::filled(n, 1.0)
        })
    }

    /// [`Tensor::ones_in`] on the global engine.
    #[track_caller]
    pub fn ones(shape: impl Into<Shape>) -> Tensor {
        Tensor::ones_in(Engine::global(), shape)
    }

    /// The 1-D tensor `start, start + step, ...` up to but excluding `end` (numpy's
    /// `arange`). An empty or reversed range gives an empty tensor; a zero or
    /// non-finite step gives an empty tensor too.
    #[track_caller]
    pub fn arange_in(engine: &Engine, start: f32, end: f32, step: f32) -> Tensor {
        let n = if step.is_finite() && step != 0.0 && start.is_finite() && end.is_finite() {
            ((end - start) / step).ceil().max(0.0) as usize
        } else {
            0
        };
        Tensor::generate(
            engine,
            "arange",
            Location::caller(),
            Shape::from(n),
            move |n| {
                let mut v = ops::zeroed(n)?;
                for (i, x) in v.iter_mut().enumerate() {
                    *x = start + step * i as f32;
                }
                Ok(v)
            },
        )
    }

    /// [`Tensor::arange_in`] on the global engine.
    #[track_caller]
    pub fn arange(start: f32, end: f32, step: f32) -> Tensor {
        Tensor::arange_in(Engine::global(), start, end, step)
    }

    /// Samples from the uniform distribution on `[low, high)`, deterministic for
    /// `seed`. Fails unless `low <= high`, both finite.
    #[track_caller]
    pub fn rand_uniform_in(
        engine: &Engine,
        shape: impl Into<Shape>,
        low: f32,
        high: f32,
        seed: u64,
    ) -> Result<Tensor> {
        let shape = shape.into();
        let location = Location::caller();
        if !(low.is_finite() && high.is_finite() && low <= high) {
            return Err(Error::InvalidArgument {
                op: "rand_uniform",
                shape: shape.to_string(),
                reason: format!("bounds must be finite with low <= high (got {low}, {high})"),
                location,
            });
        }
        Ok(Tensor::generate(
            engine,
            "rand_uniform",
            location,
            shape,
            move |n| {
                let mut v = ops::zeroed(n)?;
                kernels::fill_uniform(&mut v, low, high, seed);
                Ok(v)
            },
        ))
    }

    /// [`Tensor::rand_uniform_in`] on the global engine.
    #[track_caller]
    pub fn rand_uniform(shape: impl Into<Shape>, low: f32, high: f32, seed: u64) -> Result<Tensor> {
        Tensor::rand_uniform_in(Engine::global(), shape, low, high, seed)
    }

    /// Samples from the normal distribution, deterministic for `seed`. Fails unless
    /// `mean` is finite and `std` is finite and non-negative.
    #[track_caller]
    pub fn rand_normal_in(
        engine: &Engine,
        shape: impl Into<Shape>,
        mean: f32,
        std: f32,
        seed: u64,
    ) -> Result<Tensor> {
        let shape = shape.into();
        let location = Location::caller();
        if !(mean.is_finite() && std.is_finite() && std >= 0.0) {
            return Err(Error::InvalidArgument {
                op: "rand_normal",
                shape: shape.to_string(),
                reason: format!("mean and std must be finite, std >= 0 (got {mean}, {std})"),
                location,
            });
        }
        Ok(Tensor::generate(
            engine,
            "rand_normal",
            location,
            shape,
            move |n| {
                let mut v = ops::zeroed(n)?;
                kernels::fill_normal(&mut v, mean, std, seed);
                Ok(v)
            },
        ))
    }

    /// [`Tensor::rand_normal_in`] on the global engine.
    #[track_caller]
    pub fn rand_normal(shape: impl Into<Shape>, mean: f32, std: f32, seed: u64) -> Result<Tensor> {
        Tensor::rand_normal_in(Engine::global(), shape, mean, std, seed)
    }

    fn generate(
        engine: &Engine,
        name: &'static str,
        location: Location,
        shape: Shape,
        f: impl FnOnce(usize) -> std::result::Result<Vec<f32>, String> + Send + 'static,
    ) -> Tensor {
        let n = shape.numel();
        let out = Tensor {
            shape,
            var: engine.var(Data::default()),
            device: Device::Cpu,
            tape: None,
        };
        let mut t = engine.task_at(name, location);
        let o = t.write(&out.var);
        // Cannot fail: the only Var belongs to `engine`.
        let _ = t.push_fallible(move || {
            *o.write() = Data::Host(f(n)?);
            Ok(())
        });
        out
    }

    // ----- reading ----------------------------------------------------------

    /// Explicit blocker: runs exactly the work this tensor needs and waits for it.
    /// Returns the failure that poisoned it, naming the failed op and its location.
    ///
    /// On a GPU this also waits until the device has executed the work (a GPU
    /// node completes in the graph when it is encoded).
    #[track_caller]
    pub fn wait_to_read(&self) -> Result<()> {
        let location = Location::caller();
        self.var.wait_to_read()?;
        if let Some(gpu) = self.gpu("wait_to_read", location)? {
            let failed = |message| Error::Failed {
                op: "wait_to_read".to_string(),
                location,
                message,
            };
            gpu.synchronize().map_err(failed)?;
            // The value itself may come from a batch that failed.
            if self.numel() > 0 {
                self.var
                    .peek(|d| d.gpu().and_then(|b| b.check()))
                    .map_err(failed)?;
            }
        }
        Ok(())
    }

    /// Implicit blocker: the data, row-major. A tensor on a GPU is copied to the
    /// host by a transfer node first.
    #[track_caller]
    pub fn to_vec(&self) -> Result<Vec<f32>> {
        let location = Location::caller();
        self.on_host(location)?.read_host(location, |v| v.to_vec())
    }

    /// Implicit blocker: the value of a one-element tensor.
    #[track_caller]
    pub fn item(&self) -> Result<f32> {
        let location = Location::caller();
        if self.numel() != 1 {
            return Err(Error::InvalidArgument {
                op: "item",
                shape: self.shape.to_string(),
                reason: format!("needs exactly one element, the tensor has {}", self.numel()),
                location,
            });
        }
        self.on_host(location)?.read_host(location, |v| v[0])
    }

    /// This tensor, or a copy of it on the host.
    fn on_host(&self, location: Location) -> Result<Tensor> {
        match self.device {
            Device::Cpu => Ok(self.clone()),
            Device::Gpu(_) => {
                // Which ops share a fused kernel is fixed when they are
                // recorded (`batch.rs`), so a readback needs no wait for the
                // workers to catch up first.
                self.to_at(Device::Cpu, location)
            }
        }
    }

    fn read_host<R>(&self, location: Location, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
        self.var
            .with(|d| d.host().map(|v| f(v)))?
            .map_err(|message| Error::Failed {
                op: "read".to_string(),
                location,
                message,
            })
    }

    /// A copy of this tensor on `device`, made by a transfer node (upload,
    /// readback, or both for GPU to GPU), so that it overlaps with other work.
    /// On the same device it returns the tensor itself (shared data).
    ///
    /// ```
    /// use lazyflow::{Device, Engine, Tensor};
    /// let engine = Engine::builder().workers(1).build().unwrap();
    /// let x = Tensor::arange_in(&engine, 0.0, 4.0, 1.0);
    /// for device in engine.devices() {
    ///     let y = (x.to(device).unwrap() * 2.0).to(Device::Cpu).unwrap();
    ///     assert_eq!(y.to_vec().unwrap(), vec![0.0, 2.0, 4.0, 6.0]);
    /// }
    /// ```
    #[track_caller]
    pub fn to(&self, device: Device) -> Result<Tensor> {
        self.to_at(device, Location::caller())
    }

    pub(crate) fn to_at(&self, device: Device, location: Location) -> Result<Tensor> {
        let out = self.to_raw(device, location)?;
        Ok(self.to_grad(out, location))
    }

    fn to_raw(&self, device: Device, location: Location) -> Result<Tensor> {
        if device == self.device {
            return Ok(self.clone());
        }
        let gpu_of = |d: Device| -> Result<Option<Arc<Gpu>>> {
            match d {
                Device::Cpu => Ok(None),
                Device::Gpu(i) => match self.engine().gpu(i) {
                    Some(g) => Ok(Some(g.clone())),
                    None => Err(Error::InvalidArgument {
                        op: "to",
                        shape: self.shape.to_string(),
                        reason: format!("{d} does not exist (see Engine::devices)"),
                        location,
                    }),
                },
            }
        };
        let (src, dst) = (gpu_of(self.device)?, gpu_of(device)?);
        let n = self.numel();
        if let Some(g) = &dst {
            gpu_ops::check_size(g, "to", &self.shape, location)?;
        }
        let out = Tensor {
            shape: self.shape.clone(),
            var: self.engine().var(Data::default()),
            device,
            tape: None,
        };
        let mut t = self.engine().task_at("to", location);
        t.device(device);
        let r = t.read(&self.var);
        let w = t.write(&out.var);
        t.push_fallible(move || {
            let host: Vec<f32> = match &src {
                None => r.read().host()?.clone(),
                Some(g) => g.read(r.read().gpu()?, n)?,
            };
            let data = match &dst {
                None => Data::Host(host),
                Some(g) => Data::Gpu(g.upload(&host)?),
            };
            *w.write() = data;
            Ok(())
        })?;
        Ok(out)
    }
}

/// Printing is an implicit blocker. A poisoned tensor prints its error.
impl fmt::Display for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let location = Location::caller();
        let body = self
            .on_host(location)
            .and_then(|h| h.read_host(location, |v| format_data(v, self.dims())));
        match body {
            Ok(body) => write!(
                f,
                "tensor({body}, shape={}, device={})",
                self.shape, self.device
            ),
            Err(e) => write!(f, "tensor(<error: {e}>, shape={})", self.shape),
        }
    }
}

/// Does not block: shows shape and device only.
impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("shape", &self.shape)
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

/// Nested brackets, eliding the middle of dimensions longer than 6.
fn format_data(data: &[f32], dims: &[usize]) -> String {
    fn go(out: &mut String, data: &[f32], dims: &[usize]) {
        let Some((&d, rest)) = dims.split_first() else {
            out.push_str(&format!("{:?}", data[0]));
            return;
        };
        let inner: usize = rest.iter().product();
        out.push('[');
        let show = |i: usize| d <= 6 || !(3..d - 3).contains(&i);
        let mut elided = false;
        for i in 0..d {
            if !show(i) {
                if !elided {
                    out.push_str(", ...");
                    elided = true;
                }
                continue;
            }
            if i > 0 {
                out.push_str(", ");
            }
            go(out, &data[i * inner..(i + 1) * inner], rest);
        }
        out.push(']');
    }
    let mut out = String::new();
    if data.len() == dims.iter().product::<usize>() {
        go(&mut out, data, dims);
    }
    out
}
