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

pub(crate) mod kernels;
mod ops;
mod shape;

pub use shape::Shape;

use crate::device::Device;
use crate::engine::Engine;
use crate::error::{Error, Location, Result};
use crate::var::Var;
use std::fmt;

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
    pub(crate) var: Var<Vec<f32>>,
    pub(crate) device: Device,
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

    /// The Var that holds the data, for generic tasks that read or write a tensor
    /// (the data is a row-major `Vec<f32>` of [`Tensor::numel`] elements).
    pub fn var(&self) -> &Var<Vec<f32>> {
        &self.var
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
            var: engine.var(data),
            device: Device::Cpu,
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
            var: engine.var(vec![value]),
            device: Device::Cpu,
        }
    }

    /// A tensor filled with `value`. The fill is a recorded node: nothing is
    /// allocated until it is demanded.
    #[track_caller]
    pub fn full_in(engine: &Engine, shape: impl Into<Shape>, value: f32) -> Tensor {
        Tensor::generate(engine, "full", Location::caller(), shape.into(), move |n| {
            vec![value; n]
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
            vec![0.0; n]
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
            vec![1.0; n]
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
            move |n| (0..n).map(|i| start + step * i as f32).collect(),
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
                let mut v = vec![0.0; n];
                kernels::fill_uniform(&mut v, low, high, seed);
                v
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
                let mut v = vec![0.0; n];
                kernels::fill_normal(&mut v, mean, std, seed);
                v
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
        f: impl FnOnce(usize) -> Vec<f32> + Send + 'static,
    ) -> Tensor {
        let n = shape.numel();
        let out = Tensor {
            shape,
            var: engine.var(Vec::new()),
            device: Device::Cpu,
        };
        let mut t = engine.task_at(name, location);
        let o = t.write(&out.var);
        // Cannot fail: the only Var belongs to `engine`.
        let _ = t.push(move || *o.write() = f(n));
        out
    }

    // ----- reading ----------------------------------------------------------

    /// Explicit blocker: runs exactly the work this tensor needs and waits for it.
    /// Returns the failure that poisoned it, naming the failed op and its location.
    pub fn wait_to_read(&self) -> Result<()> {
        self.var.wait_to_read()
    }

    /// Implicit blocker: the data, row-major.
    pub fn to_vec(&self) -> Result<Vec<f32>> {
        self.var.get()
    }

    /// Implicit blocker: the value of a one-element tensor.
    #[track_caller]
    pub fn item(&self) -> Result<f32> {
        if self.numel() != 1 {
            return Err(Error::InvalidArgument {
                op: "item",
                shape: self.shape.to_string(),
                reason: format!("needs exactly one element, the tensor has {}", self.numel()),
                location: Location::caller(),
            });
        }
        self.var.with(|v| v[0])
    }
}

/// Printing is an implicit blocker. A poisoned tensor prints its error.
impl fmt::Display for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.var.with(|v| format_data(v, self.dims())) {
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
