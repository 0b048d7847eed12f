//! Seeded initialisers for parameters.

use crate::error::{Error, Location, Result};
use crate::tensor::{Shape, Tensor};
use crate::Engine;

/// How a parameter tensor is filled. The scaled schemes take the layer's fan-in
/// and fan-out (for a convolution, channels times the kernel's area).
///
/// ```
/// use lazyflow::{nn::Init, Engine};
/// let engine = Engine::builder().workers(1).build().unwrap();
/// let w = Init::KaimingNormal.tensor(&engine, [64, 32], 64, 32, 7).unwrap();
/// let v = w.to_vec().unwrap();
/// let var = v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32;
/// assert!((var - 2.0 / 64.0).abs() < 0.2 * 2.0 / 64.0);
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Every element `value`.
    Constant(f32),
    /// Uniform on `[low, high)`.
    Uniform {
        /// Lower bound.
        low: f32,
        /// Upper bound (exclusive).
        high: f32,
    },
    /// Normal with this mean and standard deviation.
    Normal {
        /// Mean.
        mean: f32,
        /// Standard deviation.
        std: f32,
    },
    /// Glorot and Bengio's uniform: bound `sqrt(6 / (fan_in + fan_out))`.
    XavierUniform,
    /// Glorot and Bengio's normal: std `sqrt(2 / (fan_in + fan_out))`.
    XavierNormal,
    /// He et al.'s uniform for ReLU layers: bound `sqrt(6 / fan_in)`.
    KaimingUniform,
    /// He et al.'s normal for ReLU layers: std `sqrt(2 / fan_in)`.
    KaimingNormal,
}

impl Init {
    /// A tensor of `shape` on the CPU filled by this scheme, deterministic for
    /// `seed`. Fails for invalid bounds or a zero fan that a scheme divides by.
    #[track_caller]
    pub fn tensor(
        self,
        engine: &Engine,
        shape: impl Into<Shape>,
        fan_in: usize,
        fan_out: usize,
        seed: u64,
    ) -> Result<Tensor> {
        let shape = shape.into();
        let location = Location::caller();
        let fan = |n: usize| -> Result<f32> {
            if n == 0 {
                return Err(Error::InvalidArgument {
                    op: "init",
                    shape: shape.to_string(),
                    reason: format!("{self:?} needs a non-zero fan"),
                    location,
                });
            }
            Ok(n as f32)
        };
        let uniform = |b: f32| Tensor::rand_uniform_in(engine, shape.clone(), -b, b, seed);
        let normal = |s: f32| Tensor::rand_normal_in(engine, shape.clone(), 0.0, s, seed);
        match self {
            Init::Constant(v) => Ok(Tensor::full_in(engine, shape.clone(), v)),
            Init::Uniform { low, high } => {
                Tensor::rand_uniform_in(engine, shape.clone(), low, high, seed)
            }
            Init::Normal { mean, std } => {
                Tensor::rand_normal_in(engine, shape.clone(), mean, std, seed)
            }
            Init::XavierUniform => uniform((6.0 / fan(fan_in + fan_out)?).sqrt()),
            Init::XavierNormal => normal((2.0 / fan(fan_in + fan_out)?).sqrt()),
            Init::KaimingUniform => uniform((6.0 / fan(fan_in)?).sqrt()),
            Init::KaimingNormal => normal((2.0 / fan(fan_in)?).sqrt()),
        }
    }
}
