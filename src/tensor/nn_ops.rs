//! Neural-network ops built from the tensor ops (so their gradients come from
//! the tape): softmax, log-softmax, cross-entropy and accuracy.

use super::kernels::{BinaryOp, ReduceOp, UnaryOp};
use super::ops::{arg_err, check_axis};
use super::{Shape, Tensor};
use crate::error::{Location, Result};

/// How a per-example loss is reduced.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Reduction {
    /// One loss per example (shape `[n]`).
    None,
    /// The mean over the examples (a scalar): the default.
    #[default]
    Mean,
    /// The sum over the examples (a scalar).
    Sum,
}

impl Tensor {
    /// The shape with `axis` kept as 1, for broadcasting a reduction back.
    fn kept(&self, axis: usize) -> Shape {
        let mut d = self.dims().to_vec();
        d[axis] = 1;
        Shape::from(d)
    }

    /// `log(softmax(self))` along `axis`, computed stably as
    /// `z - log(sum(exp(z)))` with `z = self - max(self)`.
    ///
    /// ```
    /// use lazyflow::{Engine, Tensor};
    /// let engine = Engine::builder().workers(1).build().unwrap();
    /// let x = Tensor::from_vec_in(&engine, vec![1000.0, 1000.0], [1, 2]).unwrap();
    /// let y = x.log_softmax(1).unwrap().to_vec().unwrap();
    /// assert!((y[0] + 2f32.ln()).abs() < 1e-6);
    /// ```
    #[track_caller]
    pub fn log_softmax(&self, axis: usize) -> Result<Tensor> {
        self.log_softmax_at(axis, Location::caller())
    }

    fn log_softmax_at(&self, axis: usize, location: Location) -> Result<Tensor> {
        check_axis("log_softmax", &self.shape, axis, location)?;
        let kept = self.kept(axis);
        // The shift only keeps exp in range: it does not change the result, so
        // it is off the tape.
        let max = self
            .detach()
            .reduce_nonempty_at(ReduceOp::Max, Some(axis), location)?
            .reshape_at(kept.clone(), location)?;
        let z = self.binary_at(&max, BinaryOp::Sub, location)?;
        let lse = z
            .unary_at(UnaryOp::Exp, location)
            .reduce_axis_at(ReduceOp::Sum, axis, location)?
            .unary_at(UnaryOp::Log, location)
            .reshape_at(kept, location)?;
        z.binary_at(&lse, BinaryOp::Sub, location)
    }

    /// `exp(x) / sum(exp(x))` along `axis`, stable for large inputs.
    ///
    /// ```
    /// use lazyflow::{Engine, Tensor};
    /// let engine = Engine::builder().workers(1).build().unwrap();
    /// let x = Tensor::from_vec_in(&engine, vec![0.0, 2f32.ln()], [2]).unwrap();
    /// let p = x.softmax(0).unwrap().to_vec().unwrap();
    /// assert!((p[0] - 1.0 / 3.0).abs() < 1e-6 && (p[1] - 2.0 / 3.0).abs() < 1e-6);
    /// ```
    #[track_caller]
    pub fn softmax(&self, axis: usize) -> Result<Tensor> {
        let location = Location::caller();
        Ok(self
            .log_softmax_at(axis, location)?
            .unary_at(UnaryOp::Exp, location))
    }

    /// Checks `labels` against logits of shape `[n, classes]`.
    fn check_labels(&self, op: &'static str, labels: &[u32], location: Location) -> Result<()> {
        if self.shape.rank() != 2 {
            return Err(arg_err(
                op,
                &self.shape,
                "logits must be 2-D: [examples, classes]",
                location,
            ));
        }
        let (n, classes) = (self.dims()[0], self.dims()[1]);
        if labels.len() != n {
            return Err(arg_err(
                op,
                &self.shape,
                format!("{} labels for {n} examples", labels.len()),
                location,
            ));
        }
        if let Some((i, l)) = labels
            .iter()
            .enumerate()
            .find(|(_, &l)| l as usize >= classes)
        {
            return Err(arg_err(
                op,
                &self.shape,
                format!("label {l} of example {i} is out of range for {classes} classes"),
                location,
            ));
        }
        Ok(())
    }

    /// The labels as a one-hot `[n, classes]` tensor on this tensor's device.
    fn one_hot(&self, labels: &[u32], location: Location) -> Result<Tensor> {
        let classes = self.dims()[1];
        let mut v = vec![0.0f32; labels.len() * classes];
        for (i, &l) in labels.iter().enumerate() {
            v[i * classes + l as usize] = 1.0;
        }
        Tensor::from_vec_in(self.engine(), v, self.shape.clone())?.to_at(self.device, location)
    }

    /// Cross-entropy of `logits` (`[n, classes]`, unnormalised) against integer
    /// class `labels` (one per example, each below `classes`), computed through
    /// [`Tensor::log_softmax`]: `-log_softmax(logits)[i, labels[i]]`, reduced as
    /// asked. Labels are a host slice: they are checked when the op is recorded.
    ///
    /// ```
    /// use lazyflow::{Engine, Reduction, Tensor};
    /// let engine = Engine::builder().workers(1).build().unwrap();
    /// let logits = Tensor::from_vec_in(&engine, vec![0.0, 0.0, 5.0, 5.0], [2, 2]).unwrap();
    /// let loss = logits.cross_entropy(&[0, 1], Reduction::Mean).unwrap();
    /// assert!((loss.item().unwrap() - 2f32.ln()).abs() < 1e-6);
    /// assert!(logits.cross_entropy(&[0, 2], Reduction::Mean).is_err()); // label out of range
    /// ```
    #[track_caller]
    pub fn cross_entropy(&self, labels: &[u32], reduction: Reduction) -> Result<Tensor> {
        let location = Location::caller();
        self.check_labels("cross_entropy", labels, location)?;
        let picked = self.log_softmax_at(1, location)?.binary_at(
            &self.one_hot(labels, location)?,
            BinaryOp::Mul,
            location,
        )?;
        let losses = picked
            .reduce_axis_at(ReduceOp::Sum, 1, location)?
            .unary_at(UnaryOp::Neg, location);
        Ok(match reduction {
            Reduction::None => losses,
            Reduction::Mean => losses.reduce_all_at(ReduceOp::Mean, location),
            Reduction::Sum => losses.reduce_all_at(ReduceOp::Sum, location),
        })
    }

    /// The fraction of examples whose largest logit is at their label (a scalar
    /// tensor, computed on the logits' device; ties go to the lowest class).
    /// Not differentiable.
    ///
    /// ```
    /// use lazyflow::{Engine, Tensor};
    /// let engine = Engine::builder().workers(1).build().unwrap();
    /// let logits = Tensor::from_vec_in(&engine, vec![0.9, 0.1, 0.2, 0.8, 0.7, 0.3], [3, 2]).unwrap();
    /// assert_eq!(logits.accuracy(&[0, 1, 1]).unwrap().item().unwrap(), 2.0 / 3.0);
    /// ```
    #[track_caller]
    pub fn accuracy(&self, labels: &[u32]) -> Result<Tensor> {
        let location = Location::caller();
        self.check_labels("accuracy", labels, location)?;
        let n = labels.len();
        let want: Vec<f32> = labels.iter().map(|&l| l as f32).collect();
        let want = Tensor::from_vec_in(self.engine(), want, [n])?.to_at(self.device, location)?;
        let got = self
            .detach()
            .reduce_nonempty_at(ReduceOp::Argmax, Some(1), location)?;
        Ok(got
            .binary_at(&want, BinaryOp::Eq, location)?
            .reduce_all_at(ReduceOp::Mean, location))
    }
}
