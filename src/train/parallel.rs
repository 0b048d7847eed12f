//! Data parallelism: shards of a minibatch, replicas, allreduce, and the
//! book's four-stage training step.

use super::optim::Sgd;
use crate::device::Device;
use crate::error::{Error, Location, Result};
use crate::nn::{Module, Sequential};
use crate::tensor::{Reduction, Tensor};

fn arg(op: &'static str, shape: String, reason: String, location: Location) -> Error {
    Error::InvalidArgument {
        op,
        shape,
        reason,
        location,
    }
}

/// One device's part of a minibatch.
#[derive(Clone, Debug)]
pub struct Shard {
    /// The images, on the device.
    pub x: Tensor,
    /// Their labels.
    pub y: Vec<u32>,
}

/// Splits a minibatch (`x` with one row per example along axis 0, and its
/// labels) into equal shards, one per device (the first shards take one more
/// example when it does not divide), each copied to its device by a transfer
/// node.
///
/// ```
/// use lazyflow::train::split_batch;
/// use lazyflow::{Device, Engine, Tensor};
/// let engine = Engine::builder().workers(1).build().unwrap();
/// let x = Tensor::arange_in(&engine, 0.0, 10.0, 1.0).reshape([5, 2]).unwrap();
/// let shards = split_batch(&x, &[0, 1, 2, 3, 4], &[Device::Cpu, Device::Cpu]).unwrap();
/// assert_eq!(shards[0].y, vec![0, 1, 2]);
/// assert_eq!(shards[1].x.to_vec().unwrap(), vec![6.0, 7.0, 8.0, 9.0]);
/// ```
#[track_caller]
pub fn split_batch(x: &Tensor, y: &[u32], devices: &[Device]) -> Result<Vec<Shard>> {
    split_batch_weighted(x, y, devices, &vec![1.0; devices.len()])
}

/// [`split_batch`] with shard sizes proportional to `weights` (e.g. measured
/// throughput, for a GPU next to the CPU); every device gets at least one
/// example.
#[track_caller]
pub fn split_batch_weighted(
    x: &Tensor,
    y: &[u32],
    devices: &[Device],
    weights: &[f64],
) -> Result<Vec<Shard>> {
    let location = Location::caller();
    let shape = x.shape().to_string();
    if devices.is_empty() {
        return Err(arg(
            "split_batch",
            shape,
            "no devices to split over".into(),
            location,
        ));
    }
    let n = x.dims().first().copied().unwrap_or(0);
    if y.len() != n {
        return Err(arg(
            "split_batch",
            shape,
            format!("{} labels for {n} examples", y.len()),
            location,
        ));
    }
    if n < devices.len() {
        return Err(arg(
            "split_batch",
            shape,
            format!(
                "a batch of {n} cannot be split over {} devices",
                devices.len()
            ),
            location,
        ));
    }
    if weights.len() != devices.len() || weights.iter().any(|w| !(w.is_finite() && *w > 0.0)) {
        return Err(arg(
            "split_batch",
            shape,
            format!("need one positive weight per device, got {weights:?}"),
            location,
        ));
    }
    // Proportional shares rounded down, at least one each; then the largest
    // shards give back what the minimum of one took, and the largest
    // remainders get what rounding left.
    let total: f64 = weights.iter().sum();
    let exact: Vec<f64> = weights.iter().map(|w| w / total * n as f64).collect();
    let mut sizes: Vec<usize> = exact.iter().map(|e| (e.floor() as usize).max(1)).collect();
    while sizes.iter().sum::<usize>() > n {
        let largest = (0..sizes.len())
            .max_by_key(|&i| (sizes[i], usize::MAX - i))
            .unwrap_or(0);
        sizes[largest] -= 1;
    }
    let mut order: Vec<usize> = (0..devices.len()).collect();
    order.sort_by(|&a, &b| {
        let frac = |i: usize| exact[i] - exact[i].floor();
        frac(b).total_cmp(&frac(a)).then(a.cmp(&b))
    });
    let mut left = n - sizes.iter().sum::<usize>();
    for &i in order.iter().cycle() {
        if left == 0 {
            break;
        }
        sizes[i] += 1;
        left -= 1;
    }
    let mut start = 0;
    let mut shards = Vec::with_capacity(devices.len());
    for (&device, &len) in devices.iter().zip(&sizes) {
        let part = x.narrow(0, start, len)?;
        shards.push(Shard {
            x: part.to(device)?,
            y: y[start..start + len].to_vec(),
        });
        start += len;
    }
    Ok(shards)
}

/// Sums one tensor held on several devices and leaves the sum on every one of
/// them: the parts are gathered onto the first device by transfer and add
/// nodes, and the sum is copied back by transfer nodes. Nothing waits: the
/// nodes run when demanded, overlapping with whatever else the DAG allows (the
/// backward pass of other layers).
///
/// ```
/// use lazyflow::train::allreduce;
/// use lazyflow::{Engine, Tensor};
/// let engine = Engine::builder().workers(1).build().unwrap();
/// let a = Tensor::from_vec_in(&engine, vec![1.0, 2.0], [2]).unwrap();
/// let b = Tensor::from_vec_in(&engine, vec![10.0, 20.0], [2]).unwrap();
/// let sums = allreduce(&[a, b]).unwrap();
/// assert_eq!(sums[1].to_vec().unwrap(), vec![11.0, 22.0]);
/// ```
#[track_caller]
pub fn allreduce(tensors: &[Tensor]) -> Result<Vec<Tensor>> {
    let location = Location::caller();
    let Some(first) = tensors.first() else {
        return Err(arg("allreduce", "[]".into(), "no tensors".into(), location));
    };
    if let Some(t) = tensors.iter().find(|t| t.shape() != first.shape()) {
        return Err(Error::Shape {
            op: "allreduce",
            shapes: format!("{} and {}", first.shape(), t.shape()),
            reason: "every replica's tensor must have the same shape".into(),
            location,
        });
    }
    let home = first.device();
    let mut sum = first.clone();
    for t in &tensors[1..] {
        sum = sum.add(&t.to(home)?)?;
    }
    tensors.iter().map(|t| sum.to(t.device())).collect()
}

/// What one device computed for one minibatch: scalar tensors on the device.
#[derive(Clone, Debug)]
pub struct BatchMetrics {
    /// The sum of the per-example losses.
    pub loss_sum: Tensor,
    /// The number of correctly classified examples.
    pub correct: Tensor,
    /// The number of examples.
    pub examples: usize,
}

/// A model replicated on several devices, each replica with its own optimizer.
pub struct DataParallel {
    devices: Vec<Device>,
    /// Relative shard sizes, one per device (equal by default).
    weights: Vec<f64>,
    replicas: Vec<Sequential>,
    optimizers: Vec<Sgd>,
}

impl DataParallel {
    /// Replicas of `model` on each of `devices` (copies of its parameters), and
    /// an optimizer each. Fails for an empty device list.
    #[track_caller]
    pub fn new(
        model: &Sequential,
        devices: &[Device],
        momentum: f32,
        weight_decay: f32,
    ) -> Result<DataParallel> {
        let location = Location::caller();
        if devices.is_empty() {
            return Err(arg(
                "data_parallel",
                String::new(),
                "no devices".into(),
                location,
            ));
        }
        let replicas = devices
            .iter()
            .map(|&d| model.replica_on(d))
            .collect::<Result<Vec<_>>>()?;
        let counts: Vec<usize> = replicas.iter().map(|r| r.parameters().len()).collect();
        if counts.iter().any(|&c| c != counts[0]) {
            return Err(arg(
                "data_parallel",
                String::new(),
                format!("replicas disagree on their parameters: {counts:?}"),
                location,
            ));
        }
        Ok(DataParallel {
            devices: devices.to_vec(),
            weights: vec![1.0; devices.len()],
            optimizers: devices
                .iter()
                .map(|_| Sgd::new(momentum, weight_decay))
                .collect(),
            replicas,
        })
    }

    /// The devices, in order.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// Sizes the shards in proportion to `weights` (one positive weight per
    /// device), e.g. by measured throughput when a GPU trains next to the CPU.
    #[track_caller]
    pub fn set_weights(&mut self, weights: &[f64]) -> Result<()> {
        let location = Location::caller();
        if weights.len() != self.devices.len()
            || weights.iter().any(|w| !(w.is_finite() && *w > 0.0))
        {
            return Err(arg(
                "data_parallel",
                String::new(),
                format!(
                    "need one positive weight per device ({}), got {weights:?}",
                    self.devices.len()
                ),
                location,
            ));
        }
        self.weights = weights.to_vec();
        Ok(())
    }

    /// The replicas, one per device.
    pub fn replicas(&self) -> &[Sequential] {
        &self.replicas
    }

    /// The book's training step, recorded without waiting: split the batch
    /// over the devices; on each, forward and the summed cross-entropy;
    /// backward; allreduce every gradient; each device updates its own replica
    /// with the update scaled by the whole batch size. Returns each device's
    /// loss sum and correct count as tensors on the device.
    #[track_caller]
    pub fn train_batch(&mut self, x: &Tensor, y: &[u32], lr: f32) -> Result<Vec<BatchMetrics>> {
        let metrics = self.backward(x, y)?;
        let params = self.parameter_lists();
        let count = params[0].len();
        let mut reduced: Vec<Vec<Option<Tensor>>> = vec![Vec::with_capacity(count); params.len()];
        for j in 0..count {
            let grads: Vec<Option<Tensor>> = params.iter().map(|ps| ps[j].grad()).collect();
            if grads.iter().any(Option::is_none) {
                for r in &mut reduced {
                    r.push(None);
                }
                continue;
            }
            let grads: Vec<Tensor> = grads.into_iter().flatten().collect();
            let sums = if grads.len() == 1 {
                grads
            } else {
                allreduce(&grads)?
            };
            for (r, s) in reduced.iter_mut().zip(sums) {
                r.push(Some(s));
            }
        }
        let scale = 1.0 / y.len() as f32;
        for ((opt, ps), gs) in self.optimizers.iter_mut().zip(&params).zip(&reduced) {
            opt.step_with(ps, gs, lr, scale)?;
        }
        Ok(metrics)
    }

    /// Forward and backward of one minibatch split over the devices (the
    /// gradients are left on each replica).
    #[track_caller]
    pub(super) fn backward(&mut self, x: &Tensor, y: &[u32]) -> Result<Vec<BatchMetrics>> {
        let shards = split_batch_weighted(x, y, &self.devices, &self.weights)?;
        let mut metrics = Vec::with_capacity(shards.len());
        for (replica, shard) in self.replicas.iter().zip(&shards) {
            for p in replica.parameters() {
                p.zero_grad();
            }
            let logits = replica.forward(&shard.x)?;
            let loss = logits.cross_entropy(&shard.y, Reduction::Sum)?;
            loss.backward()?;
            let correct = logits
                .detach()
                .accuracy(&shard.y)?
                .mul_scalar(shard.y.len() as f32);
            metrics.push(BatchMetrics {
                loss_sum: loss.detach(),
                correct,
                examples: shard.y.len(),
            });
        }
        Ok(metrics)
    }

    /// Each replica's parameters.
    fn parameter_lists(&self) -> Vec<Vec<Tensor>> {
        self.replicas.iter().map(|r| r.parameters()).collect()
    }

    /// Per parameter, the sum of the replicas' gradients on the first device
    /// (`None` where a replica has no gradient).
    #[track_caller]
    pub(super) fn local_gradient_sums(&self) -> Result<Vec<Option<Tensor>>> {
        let params = self.parameter_lists();
        let home = self.devices[0];
        (0..params[0].len())
            .map(|j| {
                let mut sum: Option<Tensor> = None;
                for ps in &params {
                    let Some(g) = ps[j].grad() else {
                        return Ok(None);
                    };
                    sum = Some(match sum {
                        None => g.to(home)?,
                        Some(s) => s.add(&g.to(home)?)?,
                    });
                }
                Ok(sum)
            })
            .collect()
    }

    /// Every replica's optimizer steps with the same gradients (moved to its
    /// device), scaled by `scale`.
    #[track_caller]
    pub(super) fn step_all(&mut self, grads: &[Option<Tensor>], lr: f32, scale: f32) -> Result<()> {
        let params = self.parameter_lists();
        for ((opt, ps), &device) in self.optimizers.iter_mut().zip(&params).zip(&self.devices) {
            let here = grads
                .iter()
                .map(|g| g.as_ref().map(|g| g.to(device)).transpose())
                .collect::<Result<Vec<_>>>()?;
            opt.step_with(ps, &here, lr, scale)?;
        }
        Ok(())
    }

    /// Copies `values` (one per parameter, any device) into every replica.
    #[track_caller]
    pub(super) fn set_parameters(&self, values: &[Tensor]) -> Result<()> {
        crate::no_grad(|| {
            for (replica, &device) in self.replicas.iter().zip(&self.devices) {
                for (p, v) in replica.parameters().iter().zip(values) {
                    p.detach().copy_from(&v.to(device)?)?;
                }
            }
            Ok(())
        })
    }

    /// The number of correct predictions on `x` (split over the devices, no
    /// tape), as one scalar tensor per device.
    #[track_caller]
    pub fn correct(&self, x: &Tensor, y: &[u32]) -> Result<Vec<Tensor>> {
        // A last batch smaller than the device count uses fewer devices.
        let k = self.devices.len().min(y.len()).max(1);
        let shards = split_batch(x, y, &self.devices[..k])?;
        crate::no_grad(|| {
            self.replicas
                .iter()
                .zip(&shards)
                .map(|(r, s)| {
                    Ok(r.forward(&s.x)?
                        .accuracy(&s.y)?
                        .mul_scalar(s.y.len() as f32))
                })
                .collect()
        })
    }
}
