//! Layers of small networks: each a [`Module`] with a forward pass over tensor
//! ops (so the tape differentiates it), its parameters, and a way to place a
//! copy of itself on another device (a *replica*, for data parallelism).
//!
//! ```
//! use lazyflow::nn::{self, Module};
//! use lazyflow::{Engine, Tensor};
//! let engine = Engine::builder().workers(2).build().unwrap();
//! let net = nn::lenet(&engine, 0).unwrap();
//! let x = Tensor::rand_uniform_in(&engine, [4, 1, 28, 28], 0.0, 1.0, 1).unwrap();
//! let logits = net.forward(&x).unwrap();
//! assert_eq!(logits.dims(), &[4, 10]);
//! let loss = logits.cross_entropy(&[0, 1, 2, 3], lazyflow::Reduction::Mean).unwrap();
//! loss.backward().unwrap();
//! assert!(net.parameters().iter().all(|p| p.grad().is_some()));
//! ```

mod init;

pub use init::Init;

use crate::device::Device;
use crate::error::Result;
use crate::tensor::{PoolKind, Tensor};
use crate::Engine;

/// A layer or a composition of layers.
pub trait Module: Send + Sync {
    /// The output for input `x`, recorded like any tensor ops.
    fn forward(&self, x: &Tensor) -> Result<Tensor>;

    /// The tensors an optimizer updates (leaves that require a gradient), in a
    /// fixed order. Handles: they share data with the module.
    fn parameters(&self) -> Vec<Tensor> {
        Vec::new()
    }

    /// A copy of this module whose parameters live on `device` (fresh leaves
    /// with copies of the values, recorded as transfer nodes).
    fn replica(&self, device: Device) -> Result<Box<dyn Module>>;

    /// A short description, e.g. `Linear(800 -> 128)`.
    fn describe(&self) -> String;
}

/// A copy of `p` on `device` as a new leaf (a copy even on the same device:
/// `x * 1` is exact for every value).
fn param_copy(p: &Tensor, device: Device) -> Result<Tensor> {
    let value = crate::no_grad(|| {
        if device == p.device() {
            Ok(p.detach().mul_scalar(1.0))
        } else {
            p.detach().to(device)
        }
    })?;
    Ok(value.requires_grad(true))
}

/// [`param_copy`] of an optional bias.
fn bias_copy(bias: &Option<Tensor>, device: Device) -> Result<Option<Tensor>> {
    bias.as_ref().map(|b| param_copy(b, device)).transpose()
}

/// A layer's parameters in order: its weight, then its bias if it has one.
fn weight_and_bias(weight: &Tensor, bias: &Option<Tensor>) -> Vec<Tensor> {
    std::iter::once(weight.clone())
        .chain(bias.clone())
        .collect()
}

/// `y = x @ weight + bias`, with `weight` `[inputs, outputs]`: `x` is `[..., inputs]`.
pub struct Linear {
    /// `[inputs, outputs]`.
    pub weight: Tensor,
    /// `[outputs]`, or none.
    pub bias: Option<Tensor>,
}

impl Linear {
    /// A layer with weights from `init` (fan-in `inputs`, fan-out `outputs`) and
    /// zero biases, on the CPU.
    pub fn new(
        engine: &Engine,
        inputs: usize,
        outputs: usize,
        init: Init,
        seed: u64,
    ) -> Result<Linear> {
        Ok(Linear {
            weight: init
                .tensor(engine, [inputs, outputs], inputs, outputs, seed)?
                .requires_grad(true),
            bias: Some(Tensor::zeros_in(engine, [outputs]).requires_grad(true)),
        })
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = x.matmul(&self.weight)?;
        match &self.bias {
            Some(b) => y.add(b),
            None => Ok(y),
        }
    }

    fn parameters(&self) -> Vec<Tensor> {
        weight_and_bias(&self.weight, &self.bias)
    }

    fn replica(&self, device: Device) -> Result<Box<dyn Module>> {
        Ok(Box::new(Linear {
            weight: param_copy(&self.weight, device)?,
            bias: bias_copy(&self.bias, device)?,
        }))
    }

    fn describe(&self) -> String {
        format!(
            "Linear({} -> {})",
            self.weight.dims()[0],
            self.weight.dims()[1]
        )
    }
}

/// A 2-D convolution over NCHW input with an OIHW weight (see [`Tensor::conv2d`]).
pub struct Conv2d {
    /// `[out_channels, in_channels, kh, kw]`.
    pub weight: Tensor,
    /// `[out_channels]`, or none.
    pub bias: Option<Tensor>,
    /// Stride per axis (rows, columns).
    pub stride: (usize, usize),
    /// Zero padding per axis (rows, columns).
    pub padding: (usize, usize),
}

impl Conv2d {
    /// A layer with weights from `init` (fan-in `in * kh * kw`, fan-out
    /// `out * kh * kw`), zero biases, stride 1 and no padding, on the CPU.
    pub fn new(
        engine: &Engine,
        in_channels: usize,
        out_channels: usize,
        kernel: (usize, usize),
        init: Init,
        seed: u64,
    ) -> Result<Conv2d> {
        let area = kernel.0 * kernel.1;
        let shape = [out_channels, in_channels, kernel.0, kernel.1];
        Ok(Conv2d {
            weight: init
                .tensor(engine, shape, in_channels * area, out_channels * area, seed)?
                .requires_grad(true),
            bias: Some(Tensor::zeros_in(engine, [out_channels]).requires_grad(true)),
            stride: (1, 1),
            padding: (0, 0),
        })
    }

    /// With this stride and padding.
    pub fn with(mut self, stride: (usize, usize), padding: (usize, usize)) -> Conv2d {
        self.stride = stride;
        self.padding = padding;
        self
    }
}

impl Module for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.conv2d(&self.weight, self.bias.as_ref(), self.stride, self.padding)
    }

    fn parameters(&self) -> Vec<Tensor> {
        weight_and_bias(&self.weight, &self.bias)
    }

    fn replica(&self, device: Device) -> Result<Box<dyn Module>> {
        Ok(Box::new(Conv2d {
            weight: param_copy(&self.weight, device)?,
            bias: bias_copy(&self.bias, device)?,
            stride: self.stride,
            padding: self.padding,
        }))
    }

    fn describe(&self) -> String {
        let d = self.weight.dims();
        format!("Conv2d({} -> {}, {}x{})", d[1], d[0], d[2], d[3])
    }
}

/// Max or average pooling over 2-D windows.
#[derive(Clone, Copy, Debug)]
pub struct Pool2d {
    /// Which pooling.
    pub kind: PoolKind,
    /// Window size (rows, columns).
    pub kernel: (usize, usize),
    /// Stride (rows, columns).
    pub stride: (usize, usize),
    /// Padding (rows, columns).
    pub padding: (usize, usize),
}

impl Pool2d {
    /// Non-overlapping `k × k` windows without padding.
    pub fn new(kind: PoolKind, k: usize) -> Pool2d {
        Pool2d {
            kind,
            kernel: (k, k),
            stride: (k, k),
            padding: (0, 0),
        }
    }
}

impl Module for Pool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self.kind {
            PoolKind::Max => x.max_pool2d(self.kernel, self.stride, self.padding),
            PoolKind::Avg => x.avg_pool2d(self.kernel, self.stride, self.padding),
        }
    }

    fn replica(&self, _: Device) -> Result<Box<dyn Module>> {
        Ok(Box::new(*self))
    }

    fn describe(&self) -> String {
        format!("{:?}Pool2d({}x{})", self.kind, self.kernel.0, self.kernel.1)
    }
}

/// An elementwise activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `max(x, 0)`.
    Relu,
    /// The logistic sigmoid.
    Sigmoid,
    /// The hyperbolic tangent.
    Tanh,
}

impl Module for Activation {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Activation::Relu => x.relu(),
            Activation::Sigmoid => x.sigmoid(),
            Activation::Tanh => x.tanh(),
        })
    }

    fn replica(&self, _: Device) -> Result<Box<dyn Module>> {
        Ok(Box::new(*self))
    }

    fn describe(&self) -> String {
        format!("{self:?}")
    }
}

/// Flattens every axis after the first: `[n, ...]` to `[n, rest]` (a view).
#[derive(Clone, Copy, Debug)]
pub struct Flatten;

impl Module for Flatten {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let n = x.dims().first().copied().unwrap_or(1);
        let rest = x.numel().checked_div(n).unwrap_or(0);
        x.reshape([n, rest])
    }

    fn replica(&self, _: Device) -> Result<Box<dyn Module>> {
        Ok(Box::new(*self))
    }

    fn describe(&self) -> String {
        "Flatten".to_string()
    }
}

/// Modules applied in order.
#[derive(Default)]
pub struct Sequential {
    layers: Vec<Box<dyn Module>>,
}

impl Sequential {
    /// No layers yet.
    pub fn new() -> Sequential {
        Sequential::default()
    }

    /// With `layer` appended.
    #[allow(clippy::should_implement_trait)]
    pub fn add(mut self, layer: impl Module + 'static) -> Sequential {
        self.layers.push(Box::new(layer));
        self
    }

    /// The layers.
    pub fn layers(&self) -> &[Box<dyn Module>] {
        &self.layers
    }

    /// A copy on `device` (see [`Module::replica`]), as a `Sequential`.
    pub fn replica_on(&self, device: Device) -> Result<Sequential> {
        Ok(Sequential {
            layers: self
                .layers
                .iter()
                .map(|l| l.replica(device))
                .collect::<Result<_>>()?,
        })
    }
}

impl Module for Sequential {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut y = x.clone();
        for layer in &self.layers {
            y = layer.forward(&y)?;
        }
        Ok(y)
    }

    fn parameters(&self) -> Vec<Tensor> {
        self.layers.iter().flat_map(|l| l.parameters()).collect()
    }

    fn replica(&self, device: Device) -> Result<Box<dyn Module>> {
        Ok(Box::new(self.replica_on(device)?))
    }

    fn describe(&self) -> String {
        let inner: Vec<String> = self.layers.iter().map(|l| l.describe()).collect();
        format!("Sequential[{}]", inner.join(", "))
    }
}

/// The book's LeNet variant for data-parallel training on 28×28 images: conv
/// 1→20 (3×3), ReLU, 2×2 average pool, conv 20→50 (5×5), ReLU, 2×2 average
/// pool, flatten (800), linear 800→128, ReLU, linear 128→10; weights drawn from
/// a normal × 0.01 (deterministic for `seed`), biases zero. On the CPU: place it
/// with [`Sequential::replica_on`].
pub fn lenet(engine: &Engine, seed: u64) -> Result<Sequential> {
    lenet_with(
        engine,
        Init::Normal {
            mean: 0.0,
            std: 0.01,
        },
        seed,
    )
}

/// [`lenet`] with the weights drawn by `init` (biases zero).
pub fn lenet_with(engine: &Engine, init: Init, seed: u64) -> Result<Sequential> {
    Ok(Sequential::new()
        .add(Conv2d::new(engine, 1, 20, (3, 3), init, seed)?)
        .add(Activation::Relu)
        .add(Pool2d::new(PoolKind::Avg, 2))
        .add(Conv2d::new(engine, 20, 50, (5, 5), init, seed + 1)?)
        .add(Activation::Relu)
        .add(Pool2d::new(PoolKind::Avg, 2))
        .add(Flatten)
        .add(Linear::new(engine, 800, 128, init, seed + 2)?)
        .add(Activation::Relu)
        .add(Linear::new(engine, 128, 10, init, seed + 3)?))
}
