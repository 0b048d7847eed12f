//! SGD with momentum and weight decay, and a step learning-rate schedule.

use crate::error::{Error, Location, Result};
use crate::tensor::Tensor;

/// Stochastic gradient descent with momentum and weight decay (PyTorch's
/// formulation): `g = scale * grad + weight_decay * p`, `v = momentum * v + g`,
/// `p -= lr * v`, each an in-place write recorded like any op (in a no-grad
/// scope). One optimizer per replica: each holds its own velocities.
///
/// ```
/// use lazyflow::train::Sgd;
/// use lazyflow::{Engine, Tensor};
/// let engine = Engine::builder().workers(1).build().unwrap();
/// let p = Tensor::from_vec_in(&engine, vec![1.0, -1.0], [2]).unwrap().requires_grad(true);
/// (&p * &p).sum().backward().unwrap(); // grad = 2p
/// let mut sgd = Sgd::new(0.9, 0.0);
/// sgd.step(&[p.clone()], 0.1, 1.0).unwrap();
/// assert_eq!(p.to_vec().unwrap(), vec![0.8, -0.8]);
/// ```
#[derive(Debug)]
pub struct Sgd {
    /// Momentum (0 for none).
    pub momentum: f32,
    /// L2 weight decay added to the gradient.
    pub weight_decay: f32,
    velocity: Vec<Option<Tensor>>,
}

impl Sgd {
    /// An optimizer with this momentum and weight decay.
    pub fn new(momentum: f32, weight_decay: f32) -> Sgd {
        Sgd {
            momentum,
            weight_decay,
            velocity: Vec::new(),
        }
    }

    /// Updates `params` in place from their gradients times `scale` (e.g. one
    /// over the batch size when the loss was a sum) with learning rate `lr`.
    /// Parameters without a gradient are left alone. Fails if the list of
    /// parameters changes length between steps.
    #[track_caller]
    pub fn step(&mut self, params: &[Tensor], lr: f32, scale: f32) -> Result<()> {
        let grads: Vec<Option<Tensor>> = params.iter().map(|p| p.grad()).collect();
        self.step_with(params, &grads, lr, scale)
    }

    /// [`Sgd::step`] with the gradients given (e.g. summed over replicas).
    #[track_caller]
    pub fn step_with(
        &mut self,
        params: &[Tensor],
        grads: &[Option<Tensor>],
        lr: f32,
        scale: f32,
    ) -> Result<()> {
        let location = Location::caller();
        if self.velocity.is_empty() {
            self.velocity = vec![None; params.len()];
        }
        if self.velocity.len() != params.len() || grads.len() != params.len() {
            return Err(Error::InvalidArgument {
                op: "sgd_step",
                shape: format!("{} parameters", params.len()),
                reason: format!(
                    "the optimizer was used with {} parameters and is given {} gradients",
                    self.velocity.len(),
                    grads.len()
                ),
                location,
            });
        }
        crate::no_grad(|| -> Result<()> {
            for ((p, g), v) in params.iter().zip(grads).zip(&mut self.velocity) {
                let Some(g) = g else { continue };
                let mut g = g.mul_scalar(scale);
                if self.weight_decay != 0.0 {
                    g = g.add(&p.detach().mul_scalar(self.weight_decay))?;
                }
                let update = if self.momentum != 0.0 {
                    let next = match v.take() {
                        Some(old) => old.mul_scalar(self.momentum).add(&g)?,
                        None => g,
                    };
                    *v = Some(next.clone());
                    next
                } else {
                    g
                };
                p.detach().sub_(&update.mul_scalar(lr))?;
            }
            Ok(())
        })
    }
}

/// Multiplies the learning rate by `decay` every `period` epochs.
///
/// ```
/// use lazyflow::train::StepLr;
/// let s = StepLr { base: 0.2, period: 4, decay: 0.5 };
/// assert_eq!([s.at(0), s.at(3), s.at(4), s.at(9)], [0.2, 0.2, 0.1, 0.05]);
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepLr {
    /// The learning rate of epoch 0.
    pub base: f32,
    /// Epochs between decays (0: never).
    pub period: usize,
    /// The factor applied at each period.
    pub decay: f32,
}

impl StepLr {
    /// The learning rate for `epoch` (counted from 0).
    pub fn at(&self, epoch: usize) -> f32 {
        match self.period {
            0 => self.base,
            p => self.base * self.decay.powi((epoch / p) as i32),
        }
    }
}
