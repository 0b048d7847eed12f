//! Training over several processes: the book's parameter server and
//! allreduce, on top of [`DataParallel`] inside each process and
//! [`crate::dist::Dist`] between processes.

use super::optim::Sgd;
use super::parallel::{BatchMetrics, DataParallel};
use crate::device::Device;
use crate::dist::Dist;
use crate::error::{Error, Location, Result};
use crate::nn::{Module, Sequential};
use crate::tensor::Tensor;

/// How the processes combine their gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// The book's seven steps: each process sums its devices' gradients on
    /// one device, copies the sum to host memory and sends it to rank 0 (the
    /// server), which sums all processes' gradients, updates the parameters
    /// with SGD and broadcasts them; each process copies them to its devices.
    ParameterServer,
    /// Each process's summed gradients are allreduced; every process updates
    /// its own replicas (the same update everywhere).
    AllReduce,
}

impl std::str::FromStr for Strategy {
    type Err = Error;

    /// `ps` (or `parameter-server`) and `allreduce`.
    ///
    /// ```
    /// use lazyflow::train::Strategy;
    /// assert_eq!("ps".parse::<Strategy>().unwrap(), Strategy::ParameterServer);
    /// assert!("ring".parse::<Strategy>().is_err());
    /// ```
    fn from_str(s: &str) -> Result<Strategy> {
        match s {
            "ps" | "parameter-server" => Ok(Strategy::ParameterServer),
            "allreduce" => Ok(Strategy::AllReduce),
            _ => Err(Error::Config(format!(
                "unknown strategy {s:?} (expected ps or allreduce)"
            ))),
        }
    }
}

impl std::fmt::Display for Strategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Strategy::ParameterServer => "parameter server",
            Strategy::AllReduce => "allreduce",
        })
    }
}

/// When gradients are communicated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overlap {
    /// One collective per parameter, recorded from the last layer back, so
    /// each starts as soon as that layer's backward is done and the rest of
    /// the backward pass runs meanwhile.
    PerLayer,
    /// All gradients in one bucket after the whole backward pass (one
    /// message: fewer latencies, no overlap).
    AfterBackward,
}

impl std::str::FromStr for Overlap {
    type Err = Error;

    /// `per-layer` and `after-backward`.
    fn from_str(s: &str) -> Result<Overlap> {
        match s {
            "per-layer" => Ok(Overlap::PerLayer),
            "after-backward" => Ok(Overlap::AfterBackward),
            _ => Err(Error::Config(format!(
                "unknown overlap {s:?} (expected per-layer or after-backward)"
            ))),
        }
    }
}

/// A model trained by several processes, each with replicas on its own
/// devices. Every process builds one with the same model shapes and
/// hyperparameters (checked when it is built) and feeds it the same global
/// minibatches; each takes its share of every batch.
pub struct Distributed {
    dist: Dist,
    local: DataParallel,
    strategy: Strategy,
    overlap: Overlap,
    /// The parameter server's copy of the parameters, in host memory (the
    /// up-to-date one on rank 0; the others' receive it each step).
    master: Vec<Tensor>,
    /// The server's optimizer (used on rank 0 only).
    server: Sgd,
}

/// The description every rank must agree on.
fn shapes_of(model: &Sequential) -> String {
    model
        .parameters()
        .iter()
        .map(|p| p.shape().to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

impl Distributed {
    /// Replicas of `model` on this process's `devices`, checked against the
    /// other ranks (the model's parameter shapes and `hyperparameters`, a
    /// description of everything that must match, must agree), and started
    /// from rank 0's parameters.
    #[track_caller]
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        dist: &Dist,
        model: &Sequential,
        devices: &[Device],
        momentum: f32,
        weight_decay: f32,
        strategy: Strategy,
        overlap: Overlap,
        hyperparameters: &str,
    ) -> Result<Distributed> {
        dist.agree("the model's parameter shapes", &shapes_of(model))?;
        dist.agree(
            "the hyperparameters",
            &format!(
                "{hyperparameters}; momentum {momentum}; weight decay {weight_decay}; \
                 {strategy}; {overlap:?}"
            ),
        )?;
        let local = DataParallel::new(model, devices, momentum, weight_decay)?;
        // Everyone starts from rank 0's parameters, whatever its seed.
        let mut master = Vec::new();
        crate::no_grad(|| -> Result<()> {
            for (j, p) in local.replicas()[0].parameters().iter().enumerate() {
                let host = p.detach().to(Device::Cpu)?;
                master.push(dist.broadcast(&host, 0, &format!("initial parameter {j}"))?);
            }
            Ok(())
        })?;
        local.set_parameters(&master)?;
        Ok(Distributed {
            dist: dist.clone(),
            local,
            strategy,
            overlap,
            master,
            server: Sgd::new(momentum, weight_decay),
        })
    }

    /// Sizes this process's shards in proportion to `weights` (see
    /// [`DataParallel::set_weights`]).
    #[track_caller]
    pub fn set_weights(&mut self, weights: &[f64]) -> Result<()> {
        self.local.set_weights(weights)
    }

    /// The communicator.
    pub fn dist(&self) -> &Dist {
        &self.dist
    }

    /// This process's replicas.
    pub fn local(&self) -> &DataParallel {
        &self.local
    }

    /// The part of a global minibatch of `n` examples that this rank takes:
    /// `(start, len)`, the first ranks taking one more when it does not divide.
    pub fn share(&self, n: usize) -> (usize, usize) {
        let (size, rank) = (self.dist.size(), self.dist.rank());
        let (base, extra) = (n / size, n % size);
        (
            rank * base + rank.min(extra),
            base + usize::from(rank < extra),
        )
    }

    /// The smallest global batch every device of every rank gets an example of.
    pub fn min_batch(&self) -> usize {
        self.dist.size() * self.local.devices().len()
    }

    /// One step on the global minibatch `x`, `y` (every rank passes the same
    /// one): this rank's share is split over its devices, forward and
    /// backward run, gradients are combined by the strategy, and every
    /// replica ends with the same parameters. Recorded; nothing waits.
    /// Returns this rank's loss sums and correct counts.
    #[track_caller]
    pub fn train_batch(&mut self, x: &Tensor, y: &[u32], lr: f32) -> Result<Vec<BatchMetrics>> {
        let location = Location::caller();
        let total = y.len();
        if total < self.min_batch() {
            return Err(Error::InvalidArgument {
                op: "train_batch",
                shape: x.shape().to_string(),
                reason: format!(
                    "a batch of {total} cannot be split over {} ranks of {} devices",
                    self.dist.size(),
                    self.local.devices().len()
                ),
                location,
            });
        }
        let (start, len) = self.share(total);
        let metrics = self
            .local
            .backward(&x.narrow(0, start, len)?, &y[start..start + len])?;
        let sums = self.local.local_gradient_sums()?;
        let scale = 1.0 / total as f32;
        crate::no_grad(|| match self.strategy {
            Strategy::AllReduce => {
                let reduced = self.communicate(&sums, |d, t, label| d.allreduce_sum(t, label))?;
                self.local.step_all(&reduced, lr, scale)
            }
            Strategy::ParameterServer => {
                let gathered = self.communicate(&sums, |d, t, label| d.reduce_sum(t, 0, label))?;
                if self.dist.is_root() {
                    self.server.step_with(&self.master, &gathered, lr, scale)?;
                }
                let fresh = self.communicate(
                    &self.master.iter().cloned().map(Some).collect::<Vec<_>>(),
                    |d, t, label| d.broadcast(t, 0, label),
                )?;
                self.master = fresh.into_iter().flatten().collect();
                self.local.set_parameters(&self.master)
            }
        })?;
        Ok(metrics)
    }

    /// Runs `collective` on each tensor (per layer, last first) or on all of
    /// them in one bucket, by the overlap setting. Results are in host memory.
    fn communicate(
        &self,
        tensors: &[Option<Tensor>],
        collective: impl Fn(&Dist, &Tensor, &str) -> Result<Tensor>,
    ) -> Result<Vec<Option<Tensor>>> {
        let mut out: Vec<Option<Tensor>> = vec![None; tensors.len()];
        match self.overlap {
            Overlap::PerLayer => {
                // The last layer's gradient is ready first: its collective
                // goes first in the sequence every rank follows.
                for (j, t) in tensors.iter().enumerate().rev() {
                    if let Some(t) = t {
                        let host = t.to(Device::Cpu)?;
                        out[j] = Some(collective(&self.dist, &host, &format!("parameter {j}"))?);
                    }
                }
            }
            Overlap::AfterBackward => {
                let mut present: Vec<(usize, Tensor)> = Vec::new();
                for (j, t) in tensors.iter().enumerate() {
                    if let Some(t) = t {
                        present.push((j, t.to(Device::Cpu)?));
                    }
                }
                if present.is_empty() {
                    return Ok(out);
                }
                let flat = present
                    .iter()
                    .map(|(_, t)| t.reshape([t.numel()]))
                    .collect::<Result<Vec<_>>>()?;
                let bucket = Tensor::concat(&flat.iter().collect::<Vec<_>>(), 0)?;
                let done = collective(&self.dist, &bucket, "all parameters")?;
                let sizes: Vec<usize> = flat.iter().map(Tensor::numel).collect();
                for ((j, t), part) in present.iter().zip(done.split(0, &sizes)?) {
                    out[*j] = Some(part.reshape(t.shape().clone())?);
                }
            }
        }
        Ok(out)
    }

    /// This rank's count of correct predictions on its share of `x` (no
    /// tape), as scalar tensors, one per local device.
    #[track_caller]
    pub fn correct(&self, x: &Tensor, y: &[u32]) -> Result<Vec<Tensor>> {
        let (start, len) = self.share(y.len());
        if len == 0 {
            return Ok(Vec::new());
        }
        self.local
            .correct(&x.narrow(0, start, len)?, &y[start..start + len])
    }

    /// The parameters of this rank's first replica.
    pub fn parameters(&self) -> Vec<Tensor> {
        self.local.replicas()[0].parameters()
    }
}
