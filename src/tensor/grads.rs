//! The gradient of every differentiable op: each function puts an op's output
//! on the tape (see `autograd.rs`) with the closure that records its inputs'
//! gradients. Gradients are tensor ops themselves, so they run on the op's
//! device, and elementwise ones fuse on a GPU like any other chain.

use super::autograd::Saved;
use super::kernels::{BinaryOp, ReduceOp, UnaryOp};
use super::{Shape, Tensor};
use crate::device::Device;
use crate::error::{Location, Result};

/// `Some(f())` when `need`, else `None`.
pub(super) fn when(need: bool, f: impl FnOnce() -> Result<Tensor>) -> Result<Option<Tensor>> {
    need.then(f).transpose()
}

impl Tensor {
    fn bin(&self, other: &Tensor, op: BinaryOp, location: Location) -> Result<Tensor> {
        self.binary_at(other, op, location)
    }

    fn sc(&self, s: f32, op: BinaryOp, location: Location) -> Tensor {
        self.scalar_at(s, op, false, location)
    }

    /// A tensor of `shape` on this tensor's device, every element `value`.
    pub(crate) fn full_shaped(&self, shape: Shape, value: f32, location: Location) -> Tensor {
        let out = self.output(shape);
        out.fill_at(value, location);
        out
    }

    /// `1.0` where `self > 0`, `-1.0` where `self < 0`, else `0.0`.
    fn sign(&self, location: Location) -> Result<Tensor> {
        self.sc(0.0, BinaryOp::Gt, location).bin(
            &self.sc(0.0, BinaryOp::Lt, location),
            BinaryOp::Sub,
            location,
        )
    }

    pub(super) fn binary_grad(
        &self,
        other: &Tensor,
        out: Tensor,
        op: BinaryOp,
        location: Location,
    ) -> Tensor {
        use BinaryOp::*;
        if matches!(op, Eq | Ne | Lt | Le | Gt | Ge) || !Tensor::any_taped(&[self, other]) {
            return out; // comparisons are masks, flat almost everywhere
        }
        let name = op.name();
        let (sa, sb) = (self.shape.clone(), other.shape.clone());
        let a = Saved::new(self, name, location);
        let b = Saved::new(other, name, location);
        let y = Saved::new(&out, name, location);
        let l = location;
        let taped_out = out.clone();
        taped_out.taped(name, location, &[self, other], move |g, needs| {
            let (ga, gb) = match op {
                Add => (
                    when(needs[0], || Ok(g.clone()))?,
                    when(needs[1], || Ok(g.clone()))?,
                ),
                Sub => (
                    when(needs[0], || Ok(g.clone()))?,
                    when(needs[1], || Ok(g.unary_at(UnaryOp::Neg, l)))?,
                ),
                Mul => (
                    when(needs[0], || g.bin(b.get()?, Mul, l))?,
                    when(needs[1], || g.bin(a.get()?, Mul, l))?,
                ),
                Div => (
                    when(needs[0], || g.bin(b.get()?, Div, l))?,
                    // d(a/b)/db = -(a/b)/b
                    when(needs[1], || {
                        g.bin(y.get()?, Mul, l)?
                            .bin(b.get()?, Div, l)
                            .map(|t| t.unary_at(UnaryOp::Neg, l))
                    })?,
                ),
                Pow => (
                    // b * a^(b-1)
                    when(needs[0], || {
                        let b = b.get()?;
                        let p = a.get()?.bin(&b.sc(1.0, Sub, l), Pow, l)?;
                        g.bin(b, Mul, l)?.bin(&p, Mul, l)
                    })?,
                    // a^b * ln a
                    when(needs[1], || {
                        g.bin(y.get()?, Mul, l)?
                            .bin(&a.get()?.unary_at(UnaryOp::Log, l), Mul, l)
                    })?,
                ),
                Maximum | Minimum => {
                    // The larger (smaller) side takes the gradient; ties split it.
                    let (a, b) = (a.get()?, b.get()?);
                    let (win_a, win_b) = if op == Maximum { (Gt, Lt) } else { (Lt, Gt) };
                    let half = a.bin(b, Eq, l)?.sc(0.5, Mul, l);
                    (
                        when(needs[0], || {
                            g.bin(&a.bin(b, win_a, l)?.bin(&half, Add, l)?, Mul, l)
                        })?,
                        when(needs[1], || {
                            g.bin(&a.bin(b, win_b, l)?.bin(&half, Add, l)?, Mul, l)
                        })?,
                    )
                }
                Eq | Ne | Lt | Le | Gt | Ge => unreachable!("comparisons are not taped"),
            };
            Ok(vec![
                ga.map(|t| t.sum_to(&sa, l)).transpose()?,
                gb.map(|t| t.sum_to(&sb, l)).transpose()?,
            ])
        })
    }

    pub(super) fn scalar_grad(
        &self,
        out: Tensor,
        s: f32,
        op: BinaryOp,
        scalar_left: bool,
        location: Location,
    ) -> Tensor {
        use BinaryOp::*;
        if matches!(op, Eq | Ne | Lt | Le | Gt | Ge) || !Tensor::any_taped(&[self]) {
            return out;
        }
        let name = op.name();
        let x = Saved::new(self, name, location);
        let y = Saved::new(&out, name, location);
        let l = location;
        out.taped(name, location, &[self], move |g, _| {
            let gx = match (op, scalar_left) {
                (Add, _) => g.clone(),
                (Sub, false) => g.clone(),
                (Sub, true) => g.unary_at(UnaryOp::Neg, l),
                (Mul, _) => g.sc(s, Mul, l),
                (Div, false) => g.sc(s, Div, l),
                // d(s/x)/dx = -(s/x)/x
                (Div, true) => g
                    .bin(y.get()?, Mul, l)?
                    .bin(x.get()?, Div, l)?
                    .unary_at(UnaryOp::Neg, l),
                // d(x^s)/dx = s x^(s-1)
                (Pow, false) => g.bin(&x.get()?.sc(s - 1.0, Pow, l), Mul, l)?.sc(s, Mul, l),
                // d(s^x)/dx = s^x ln s
                (Pow, true) => g.bin(y.get()?, Mul, l)?.sc(s.ln(), Mul, l),
                (Maximum | Minimum, _) => {
                    let x = x.get()?;
                    let win = if op == Maximum { Gt } else { Lt };
                    let mask = x
                        .sc(s, win, l)
                        .bin(&x.sc(s, Eq, l).sc(0.5, Mul, l), Add, l)?;
                    g.bin(&mask, Mul, l)?
                }
                (Eq | Ne | Lt | Le | Gt | Ge, _) => unreachable!("comparisons are not taped"),
            };
            Ok(vec![Some(gx)])
        })
    }

    pub(super) fn unary_grad(&self, out: Tensor, op: UnaryOp, location: Location) -> Tensor {
        use UnaryOp::*;
        if !Tensor::any_taped(&[self]) {
            return out;
        }
        let name = op.name();
        let x = Saved::new(self, name, location);
        let y = Saved::new(&out, name, location);
        let l = location;
        out.taped(name, location, &[self], move |g, _| {
            let gx = match op {
                Neg => g.unary_at(Neg, l),
                Exp => g.bin(y.get()?, BinaryOp::Mul, l)?,
                Log => g.bin(x.get()?, BinaryOp::Div, l)?,
                // 1 / (2 sqrt x)
                Sqrt => g.bin(y.get()?, BinaryOp::Div, l)?.sc(0.5, BinaryOp::Mul, l),
                Abs => g.bin(&x.get()?.sign(l)?, BinaryOp::Mul, l)?,
                Relu => g.bin(&x.get()?.sc(0.0, BinaryOp::Gt, l), BinaryOp::Mul, l)?,
                // y (1 - y)
                Sigmoid => {
                    let y = y.get()?;
                    let d = y.bin(&y.scalar_at(1.0, BinaryOp::Sub, true, l), BinaryOp::Mul, l)?;
                    g.bin(&d, BinaryOp::Mul, l)?
                }
                // 1 - y^2
                Tanh => {
                    let y = y.get()?;
                    let d = y
                        .bin(y, BinaryOp::Mul, l)?
                        .scalar_at(1.0, BinaryOp::Sub, true, l);
                    g.bin(&d, BinaryOp::Mul, l)?
                }
            };
            Ok(vec![Some(gx)])
        })
    }

    /// Reductions over everything (`axis` `None`) or one axis.
    pub(super) fn reduce_grad(
        &self,
        out: Tensor,
        op: ReduceOp,
        axis: Option<usize>,
        location: Location,
    ) -> Tensor {
        if matches!(op, ReduceOp::Argmax) || !Tensor::any_taped(&[self]) {
            return out;
        }
        let name = op.name();
        let input_shape = self.shape.clone();
        // The output with the reduced axis kept as 1, to broadcast against the input.
        let kept: Shape = match axis {
            None => Shape::scalar(),
            Some(a) => {
                let mut d = self.dims().to_vec();
                d[a] = 1;
                Shape::from(d)
            }
        };
        let count = match axis {
            None => self.numel(),
            Some(a) => self.dims()[a],
        };
        let x = Saved::new(self, name, location);
        let y = Saved::new(&out, name, location);
        let l = location;
        out.taped(name, location, &[self], move |g, _| {
            let g = g.reshape_at(kept.clone(), l)?;
            let gx = match op {
                ReduceOp::Sum => g.broadcast_to_at(input_shape.clone(), l)?,
                ReduceOp::Mean => g
                    .sc(1.0 / count as f32, BinaryOp::Mul, l)
                    .broadcast_to_at(input_shape.clone(), l)?,
                ReduceOp::Max | ReduceOp::Min => {
                    // The elements equal to the result share the gradient.
                    let mask =
                        x.get()?
                            .bin(&y.get()?.reshape_at(kept.clone(), l)?, BinaryOp::Eq, l)?;
                    let ties = match axis {
                        None => mask.reduce_all_at(ReduceOp::Sum, l),
                        Some(a) => mask
                            .reduce_axis_at(ReduceOp::Sum, a, l)?
                            .reshape_at(kept.clone(), l)?,
                    };
                    mask.bin(&g.bin(&ties, BinaryOp::Div, l)?, BinaryOp::Mul, l)?
                }
                ReduceOp::Argmax => unreachable!("argmax is not taped"),
            };
            Ok(vec![Some(gx)])
        })
    }

    pub(super) fn matmul_grad(&self, other: &Tensor, out: Tensor, location: Location) -> Tensor {
        if !Tensor::any_taped(&[self, other]) {
            return out;
        }
        let a = Saved::new(self, "matmul", location);
        let b = Saved::new(other, "matmul", location);
        let l = location;
        out.taped("matmul", location, &[self, other], move |g, needs| {
            let (a, b) = (a.get()?, b.get()?);
            let (ra, rb) = (a.shape.rank(), b.shape.rank());
            // dA = g @ B^T, for a shared or a batched B.
            let ga = when(needs[0], || {
                g.matmul_at(&b.transpose_at(rb - 2, rb - 1, l)?, l)
            })?;
            let gb = when(needs[1], || {
                let at = a.transpose_at(ra - 2, ra - 1, l)?;
                if rb > 2 {
                    at.matmul_at(g, l)
                } else {
                    // A shared B gathers every batch entry: [k, B*m] @ [B*m, n].
                    let k = a.dims()[ra - 1];
                    let rows = a.numel() / k.max(1);
                    let a2 = a.reshape_at([rows, k], l)?.transpose_at(0, 1, l)?;
                    a2.matmul_at(&g.reshape_at([rows, g.dims()[g.shape.rank() - 1]], l)?, l)
                }
            })?;
            Ok(vec![ga, gb])
        })
    }

    pub(super) fn narrow_grad(
        &self,
        out: Tensor,
        name: &'static str,
        axis: usize,
        start: usize,
        location: Location,
    ) -> Tensor {
        if !Tensor::any_taped(&[self]) {
            return out;
        }
        let shape = self.shape.clone();
        let l = location;
        out.taped(name, location, &[self], move |g, _| {
            // Zeros around the slice, joined along the axis.
            let size = shape.dims()[axis];
            let len = g.dims()[axis];
            let zeros = |n: usize| {
                let mut d = shape.dims().to_vec();
                d[axis] = n;
                g.full_shaped(Shape::from(d), 0.0, l)
            };
            let mut parts = Vec::new();
            if start > 0 {
                parts.push(zeros(start));
            }
            parts.push(g.clone());
            if start + len < size {
                parts.push(zeros(size - start - len));
            }
            if parts.len() == 1 {
                return Ok(vec![Some(g.clone())]);
            }
            let refs: Vec<&Tensor> = parts.iter().collect();
            Ok(vec![Some(Tensor::concat_at(&refs, axis, l)?)])
        })
    }

    pub(super) fn concat_grad(
        out: Tensor,
        tensors: &[&Tensor],
        axis: usize,
        location: Location,
    ) -> Tensor {
        if !Tensor::any_taped(tensors) {
            return out;
        }
        let sizes: Vec<usize> = tensors.iter().map(|t| t.dims()[axis]).collect();
        let l = location;
        out.taped("concat", location, tensors, move |g, needs| {
            let mut start = 0;
            let mut grads = Vec::with_capacity(sizes.len());
            for (&len, &need) in sizes.iter().zip(needs) {
                grads.push(need.then(|| g.narrow_at("narrow", axis, start, len, l)));
                start += len;
            }
            Ok(grads)
        })
    }

    /// The gradient of a copy to another device goes back by a transfer node.
    pub(super) fn to_grad(&self, out: Tensor, location: Location) -> Tensor {
        if out.same_data(self) || !Tensor::any_taped(&[self]) {
            return out;
        }
        let source: Device = self.device;
        out.taped("to", location, &[self], move |g, _| {
            Ok(vec![Some(g.to_at(source, location)?)])
        })
    }
}
