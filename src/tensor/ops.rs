//! Tensor ops: record-time validation, then one node per op.

use super::batch::{Arg, DeviceBatch};
use super::fusion::ElemOp;
use super::gpu_ops::{binary_expr_xs, unary_expr};
use super::kernels::{self, BinaryOp, ReduceOp, UnaryOp};
use super::{Data, Shape, Tensor};

/// The largest elementwise CPU op, in elements, that joins a record-time
/// batch in Lazy and Async mode.
///
/// Up to this size a node's fixed cost (hundreds of nanoseconds) outweighs the op,
/// so an elementwise op on the CPU (`+`, `exp`, `relu`, ...) joins an open
/// batch of connected ops instead of taking a node: the batch runs up to 256
/// ops as one node, in record order, and computes only the values something
/// can still read when it is recorded (see [`crate::Stats::elided_ops`]).
/// Larger ops keep a node each, so that independent ones run on different
/// workers at once. Sync mode records a node per op.
///
/// ```
/// use lazyflow::{Engine, Mode, Tensor};
/// let e = Engine::builder().mode(Mode::Lazy).build().unwrap();
/// let x = Tensor::ones_in(&e, [4]);
/// let mut y = x.clone();
/// for _ in 0..1_000 {
///     y = &y + 1.0;
/// }
/// assert_eq!(y.to_vec().unwrap(), vec![1_001.0; 4]);
/// assert!(e.stats().batches <= 10);
/// ```
pub const CPU_BATCH_MAX: usize = 16_384;
use crate::device::Device;
use crate::error::{shapes_list, Error, Location, Result};
use std::ops;
use std::sync::Arc;

pub(super) fn shape_err(
    op: &'static str,
    shapes: &[&Shape],
    reason: impl Into<String>,
    location: Location,
) -> Error {
    let dims: Vec<&[usize]> = shapes.iter().map(|s| s.dims()).collect();
    Error::Shape {
        op,
        shapes: shapes_list(&dims),
        reason: reason.into(),
        location,
    }
}

pub(super) fn arg_err(
    op: &'static str,
    shape: &Shape,
    reason: impl Into<String>,
    location: Location,
) -> Error {
    Error::InvalidArgument {
        op,
        shape: shape.to_string(),
        reason: reason.into(),
        location,
    }
}

/// How an in-place op uses the old value of its target.
#[derive(Clone, Copy)]
enum Update {
    /// The result depends on the old value (`add_`, `relu_`): the node also reads
    /// the target, so a poisoned target stays poisoned (the node is skipped).
    ReadModifyWrite,
    /// The old value is replaced whole (`fill_`, `copy_from`): a poisoned target
    /// becomes a valid value again.
    Overwrite,
}

impl Update {
    fn declare<'e>(self, t: &mut crate::task::TaskBuilder<'e>, var: &'e crate::var::Var<Data>) {
        if let Update::ReadModifyWrite = self {
            // Only the dependency matters; the task reads through its write token.
            drop(t.read(var));
        }
    }
}

/// `n` zeros, or the allocation failure as a node failure (never an abort).
pub(super) fn zeroed(n: usize) -> std::result::Result<Vec<f32>, String> {
    filled(n, 0.0)
}

/// `n` copies of `value`, allocated fallibly.
pub(super) fn filled(n: usize, value: f32) -> std::result::Result<Vec<f32>, String> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        format!(
            "out of memory: cannot allocate {n} floats ({} bytes)",
            n.saturating_mul(4)
        )
    })?;
    v.resize(n, value);
    Ok(v)
}

pub(super) fn check_axis(
    op: &'static str,
    shape: &Shape,
    axis: usize,
    location: Location,
) -> Result<()> {
    if axis >= shape.rank() {
        return Err(arg_err(
            op,
            shape,
            format!("axis {axis} out of range for rank {}", shape.rank()),
            location,
        ));
    }
    Ok(())
}

impl Tensor {
    pub(super) fn check_device(
        &self,
        op: &'static str,
        others: &[&Tensor],
        location: Location,
    ) -> Result<()> {
        if others.iter().any(|o| o.device != self.device) {
            let devices: Vec<String> = std::iter::once(self)
                .chain(others.iter().copied())
                .map(|t| t.device.to_string())
                .collect();
            return Err(Error::DeviceMismatch {
                op,
                devices: devices.join(", "),
                location,
            });
        }
        Ok(())
    }

    pub(super) fn output(&self, shape: Shape) -> Tensor {
        self.output_in(shape, self.engine().var(Data::default()))
    }

    /// An output of shape `shape` on this tensor's device, in `var`.
    pub(super) fn output_in(&self, shape: Shape, var: crate::Var<Data>) -> Tensor {
        Tensor {
            shape,
            var,
            device: self.device,
            tape: None,
        }
    }

    /// A tensor whose blockers return `err` (for operators, which cannot return it).
    pub(super) fn poisoned(&self, err: Error) -> Tensor {
        Tensor {
            shape: self.shape.clone(),
            var: self.engine().poisoned_var(Data::default(), Arc::new(err)),
            device: self.device,
            tape: None,
        }
    }

    /// Records `out = f(self)`.
    pub(super) fn map1(
        &self,
        name: &'static str,
        location: Location,
        shape: Shape,
        f: impl FnOnce(&[f32], &mut [f32]) + Send + 'static,
    ) -> Tensor {
        if self.device != Device::Cpu {
            let mut out = self.poisoned(self.unsupported(name, location));
            out.shape = shape;
            return out;
        }
        let n = shape.numel();
        let out = self.output(shape);
        let mut t = self.engine().task_at(name, location);
        t.device(self.device);
        let a = t.read(&self.var);
        let o = t.write(&out.var);
        // Cannot fail: both Vars belong to this engine.
        let _ = t.push_fallible(move || {
            let mut v = zeroed(n)?;
            f(a.read().host()?, &mut v);
            *o.write() = Data::Host(v);
            Ok(())
        });
        out
    }

    /// Adds an elementwise op on the CPU to the CPU's record-time batches
    /// (`batch.rs`) and returns its output; `None` where it takes a node of
    /// its own: in Sync mode, and for outputs above [`CPU_BATCH_MAX`]
    /// elements.
    fn cpu_batched(
        &self,
        name: &'static str,
        location: Location,
        shape: &Shape,
        op: ElemOp,
        inputs: &[Arg<'_>],
    ) -> Option<Result<Tensor>> {
        if self.device != Device::Cpu
            || shape.numel() > CPU_BATCH_MAX
            || self.engine().mode() == crate::Mode::Sync
        {
            return None;
        }
        let batches = DeviceBatch::cpu(self.engine())?;
        Some(
            batches
                .push(self.engine(), name, location, shape.dims(), op, inputs)
                .map(|var| self.output_in(shape.clone(), var)),
        )
    }

    /// Records `out = f(self, other)`.
    pub(super) fn map2(
        &self,
        other: &Tensor,
        name: &'static str,
        location: Location,
        shape: Shape,
        f: impl FnOnce(&[f32], &[f32], &mut [f32]) + Send + 'static,
    ) -> Result<Tensor> {
        if self.device != Device::Cpu {
            return Err(self.unsupported(name, location));
        }
        let n = shape.numel();
        let out = self.output(shape);
        let mut t = self.engine().task_at(name, location);
        t.device(self.device);
        let a = t.read(&self.var);
        let o = t.write(&out.var);
        if self.same_data(other) {
            t.push_fallible(move || {
                let mut v = zeroed(n)?;
                {
                    let g = a.read();
                    let g = g.host()?;
                    f(g, g, &mut v);
                }
                *o.write() = Data::Host(v);
                Ok(())
            })?;
        } else {
            let b = t.read(&other.var);
            t.push_fallible(move || {
                let mut v = zeroed(n)?;
                f(a.read().host()?, b.read().host()?, &mut v);
                *o.write() = Data::Host(v);
                Ok(())
            })?;
        }
        Ok(out)
    }

    /// Records `f(&mut self, other)` in place.
    fn update2(
        &self,
        other: &Tensor,
        name: &'static str,
        location: Location,
        kind: Update,
        f: impl FnOnce(&mut Vec<f32>, &[f32]) + Send + 'static,
    ) -> Result<()> {
        if self.device != Device::Cpu {
            return Err(self.unsupported(name, location));
        }
        let mut t = self.engine().task_at(name, location);
        t.device(self.device);
        kind.declare(&mut t, &self.var);
        let w = t.write(&self.var);
        if self.same_data(other) {
            t.push_fallible(move || {
                let mut g = w.write();
                let g = g.host_mut()?;
                let b = g.clone();
                f(g, &b);
                Ok(())
            })
        } else {
            let b = t.read(&other.var);
            t.push_fallible(move || {
                f(w.write().host_mut()?, b.read().host()?);
                Ok(())
            })
        }
    }

    /// Records `f(&mut self)` in place.
    fn update1(
        &self,
        name: &'static str,
        location: Location,
        kind: Update,
        gpu_expr: (&str, f32),
        f: impl FnOnce(&mut Vec<f32>) + Send + 'static,
    ) {
        if let Err(e) = self.check_untaped(name, location) {
            return self.fail_inplace(name, location, e);
        }
        if let Ok(Some(gpu)) = self.gpu(name, location) {
            let reads_self = matches!(kind, Update::ReadModifyWrite);
            let (expr, s) = gpu_expr;
            return self.gpu_inplace_map(gpu, name, expr.to_string(), s, reads_self, location);
        }
        let mut t = self.engine().task_at(name, location);
        t.device(self.device);
        kind.declare(&mut t, &self.var);
        let w = t.write(&self.var);
        if self.device != Device::Cpu {
            // The device does not exist: the update fails at run time and
            // poisons `self`, since this method cannot return the error.
            let message = self.unsupported(name, location).to_string();
            let _ = t.push_fallible(move || {
                drop(w);
                Err(message)
            });
            return;
        }
        // Cannot fail: one Var of this engine.
        let _ = t.push_fallible(move || {
            f(w.write().host_mut()?);
            Ok(())
        });
    }

    /// An in-place op on a tensor on the tape would make its recorded history
    /// (and so its gradient) wrong: refused outside a no-grad scope.
    fn check_untaped(&self, name: &'static str, location: Location) -> Result<()> {
        if Tensor::any_taped(&[self]) {
            return Err(arg_err(
                name,
                &self.shape,
                "an in-place op on a tensor that requires a gradient; run it in a \
                 no_grad scope (as an optimizer does) or on a detached copy",
                location,
            ));
        }
        Ok(())
    }

    /// Records a node that fails with `err` and poisons `self` (for in-place
    /// ops that cannot return an error).
    fn fail_inplace(&self, name: &'static str, location: Location, err: Error) {
        let mut t = self.engine().task_at(name, location);
        t.device(self.device);
        let _w = t.write(&self.var);
        let message = err.to_string();
        let _ = t.try_run(move || Err(message));
    }

    // ----- elementwise ------------------------------------------------------

    pub(crate) fn binary_at(
        &self,
        other: &Tensor,
        op: BinaryOp,
        location: Location,
    ) -> Result<Tensor> {
        let out = self.binary_raw(other, op, location)?;
        Ok(self.binary_grad(other, out, op, location))
    }

    fn binary_raw(&self, other: &Tensor, op: BinaryOp, location: Location) -> Result<Tensor> {
        let name = op.name();
        self.check_device(name, &[other], location)?;
        let out_shape = Shape::broadcast(&self.shape, &other.shape).ok_or_else(|| {
            shape_err(
                name,
                &[&self.shape, &other.shape],
                "cannot broadcast",
                location,
            )
        })?;
        if let Some(gpu) = self.gpu(name, location)? {
            return self.gpu_binary(gpu, other, op, out_shape, location);
        }
        let inputs = [Arg::Tensor(self), Arg::Tensor(other)];
        let batched = self.cpu_batched(name, location, &out_shape, ElemOp::Binary(op), &inputs);
        if let Some(out) = batched {
            return out;
        }
        let (sa, sb, so) = (self.shape.clone(), other.shape.clone(), out_shape.clone());
        self.map2(other, name, location, out_shape, move |a, b, out| {
            kernels::binary(op, a, sa.dims(), b, sb.dims(), so.dims(), out);
        })
    }

    pub(crate) fn scalar_at(
        &self,
        s: f32,
        op: BinaryOp,
        scalar_left: bool,
        location: Location,
    ) -> Tensor {
        let out = self.scalar_raw(s, op, scalar_left, location);
        self.scalar_grad(out, s, op, scalar_left, location)
    }

    fn scalar_raw(&self, s: f32, op: BinaryOp, scalar_left: bool, location: Location) -> Tensor {
        match self.gpu(op.name(), location) {
            Ok(Some(gpu)) => return self.gpu_scalar(gpu, s, op, scalar_left, location),
            Ok(None) => {}
            Err(e) => return self.poisoned(e),
        }
        let inputs = if scalar_left {
            [Arg::Scalar(s), Arg::Tensor(self)]
        } else {
            [Arg::Tensor(self), Arg::Scalar(s)]
        };
        let batched = self.cpu_batched(
            op.name(),
            location,
            &self.shape,
            ElemOp::Binary(op),
            &inputs,
        );
        if let Some(out) = batched {
            return out.unwrap_or_else(|e| self.poisoned(e));
        }
        self.map1(op.name(), location, self.shape.clone(), move |a, out| {
            if scalar_left {
                kernels::scalar_binary(op, s, a, out);
            } else {
                kernels::binary_scalar(op, a, s, out);
            }
        })
    }

    pub(crate) fn unary_at(&self, op: UnaryOp, location: Location) -> Tensor {
        let out = self.unary_raw(op, location);
        self.unary_grad(out, op, location)
    }

    fn unary_raw(&self, op: UnaryOp, location: Location) -> Tensor {
        match self.gpu(op.name(), location) {
            Ok(Some(gpu)) => return self.gpu_unary(gpu, op, location),
            Ok(None) => {}
            Err(e) => return self.poisoned(e),
        }
        let inputs = [Arg::Tensor(self)];
        let batched =
            self.cpu_batched(op.name(), location, &self.shape, ElemOp::Unary(op), &inputs);
        if let Some(out) = batched {
            return out.unwrap_or_else(|e| self.poisoned(e));
        }
        self.map1(op.name(), location, self.shape.clone(), move |a, out| {
            kernels::unary(op, a, out);
        })
    }

    fn inplace_at(
        &self,
        other: &Tensor,
        op: BinaryOp,
        name: &'static str,
        location: Location,
    ) -> Result<()> {
        self.check_untaped(name, location)?;
        self.check_device(name, &[other], location)?;
        if !other.shape.broadcasts_to(&self.shape) {
            return Err(shape_err(
                name,
                &[&self.shape, &other.shape],
                "the right operand must broadcast to the left one",
                location,
            ));
        }
        if let Some(gpu) = self.gpu(name, location)? {
            return self.gpu_inplace(gpu, other, op, name, location);
        }
        let (sa, sb) = (self.shape.clone(), other.shape.clone());
        self.update2(
            other,
            name,
            location,
            Update::ReadModifyWrite,
            move |a, b| kernels::binary_inplace(op, a, sa.dims(), b, sb.dims()),
        )
    }
}

macro_rules! binary_methods {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {
        impl Tensor {
            $(
                $(#[$doc])*
                #[track_caller]
                pub fn $name(&self, other: &Tensor) -> Result<Tensor> {
                    self.binary_at(other, BinaryOp::$op, Location::caller())
                }
            )*
        }
    };
}

binary_methods! {
    /// Elementwise `self + other` with numpy broadcasting.
    add => Add;
    /// Elementwise `self - other` with broadcasting.
    sub => Sub;
    /// Elementwise `self * other` with broadcasting.
    mul => Mul;
    /// Elementwise `self / other` with broadcasting.
    div => Div;
    /// Elementwise `self ^ other` with broadcasting.
    pow => Pow;
    /// Elementwise maximum with broadcasting (NaN propagates).
    maximum => Maximum;
    /// Elementwise minimum with broadcasting (NaN propagates).
    minimum => Minimum;
    /// Mask (1.0 / 0.0) of `self == other`, with broadcasting.
    eq => Eq;
    /// Mask of `self != other`, with broadcasting.
    ne => Ne;
    /// Mask of `self < other`, with broadcasting.
    lt => Lt;
    /// Mask of `self <= other`, with broadcasting.
    le => Le;
    /// Mask of `self > other`, with broadcasting.
    gt => Gt;
    /// Mask of `self >= other`, with broadcasting.
    ge => Ge;
}

macro_rules! scalar_methods {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {
        impl Tensor {
            $(
                $(#[$doc])*
                #[track_caller]
                pub fn $name(&self, s: f32) -> Tensor {
                    self.scalar_at(s, BinaryOp::$op, false, Location::caller())
                }
            )*
        }
    };
}

scalar_methods! {
    /// `self + s` elementwise.
    add_scalar => Add;
    /// `self - s` elementwise.
    sub_scalar => Sub;
    /// `self * s` elementwise.
    mul_scalar => Mul;
    /// `self / s` elementwise.
    div_scalar => Div;
    /// `self ^ s` elementwise.
    powf => Pow;
    /// `max(self, s)` elementwise (a clamp from below).
    maximum_scalar => Maximum;
    /// `min(self, s)` elementwise (a clamp from above).
    minimum_scalar => Minimum;
    /// Mask of `self == s`.
    eq_scalar => Eq;
    /// Mask of `self < s`.
    lt_scalar => Lt;
    /// Mask of `self > s`.
    gt_scalar => Gt;
}

macro_rules! unary_methods {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {
        impl Tensor {
            $(
                $(#[$doc])*
                #[track_caller]
                pub fn $name(&self) -> Tensor {
                    self.unary_at(UnaryOp::$op, Location::caller())
                }
            )*
        }
    };
}

unary_methods! {
    /// `-self` elementwise.
    neg => Neg;
    /// `e^self` elementwise.
    exp => Exp;
    /// Natural logarithm elementwise.
    log => Log;
    /// Square root elementwise.
    sqrt => Sqrt;
    /// Absolute value elementwise.
    abs => Abs;
    /// `max(self, 0)` elementwise.
    relu => Relu;
    /// Logistic sigmoid elementwise.
    sigmoid => Sigmoid;
    /// Hyperbolic tangent elementwise.
    tanh => Tanh;
}

macro_rules! inplace_methods {
    ($($(#[$doc:meta])* $name:ident, $scalar:ident => $op:ident;)*) => {
        impl Tensor {
            $(
                $(#[$doc])*
                ///
                /// Recorded as a write of `self`: it is ordered after every earlier
                /// read of the old value, and every clone of `self` sees the change.
                /// `other` must broadcast to `self`'s shape.
                #[track_caller]
                pub fn $name(&self, other: &Tensor) -> Result<()> {
                    self.inplace_at(other, BinaryOp::$op, stringify!($name), Location::caller())
                }

                $(#[$doc])*
                ///
                /// With a scalar right operand.
                #[track_caller]
                pub fn $scalar(&self, s: f32) {
                    let expr = binary_expr_xs(BinaryOp::$op);
                    self.update1(stringify!($scalar), Location::caller(), Update::ReadModifyWrite, (&expr, s), move |a| {
                        kernels::binary_scalar_inplace(BinaryOp::$op, a, s)
                    })
                }
            )*
        }
    };
}

inplace_methods! {
    /// In place `self += other`.
    add_, add_scalar_ => Add;
    /// In place `self -= other`.
    sub_, sub_scalar_ => Sub;
    /// In place `self *= other`.
    mul_, mul_scalar_ => Mul;
    /// In place `self /= other`.
    div_, div_scalar_ => Div;
}

impl Tensor {
    /// In place: sets every element to `value`.
    #[track_caller]
    pub fn fill_(&self, value: f32) {
        self.fill_at(value, Location::caller())
    }

    pub(crate) fn fill_at(&self, value: f32, location: Location) {
        let n = self.numel();
        // The whole buffer is replaced, so the target need not have had a value.
        self.update1(
            "fill_",
            location,
            Update::Overwrite,
            ("s", value),
            move |a| {
                a.clear();
                a.resize(n, value);
            },
        )
    }

    /// In place: copies `src` (same shape) into `self`.
    #[track_caller]
    pub fn copy_from(&self, src: &Tensor) -> Result<()> {
        let location = Location::caller();
        self.check_untaped("copy_from", location)?;
        self.check_device("copy_from", &[src], location)?;
        if src.shape != self.shape {
            return Err(shape_err(
                "copy_from",
                &[&self.shape, &src.shape],
                "shapes must be equal",
                location,
            ));
        }
        if let Some(gpu) = self.gpu("copy_from", location)? {
            return self.gpu_copy_from(gpu, src, location);
        }
        self.update2(src, "copy_from", location, Update::Overwrite, |a, b| {
            a.clear();
            a.extend_from_slice(b);
        })
    }

    /// In place: applies a unary op (e.g. `relu_`).
    #[track_caller]
    pub fn relu_(&self) {
        self.update1(
            "relu_",
            Location::caller(),
            Update::ReadModifyWrite,
            (&unary_expr(UnaryOp::Relu), 0.0),
            |a| kernels::unary_inplace(UnaryOp::Relu, a),
        )
    }

    // ----- reductions -------------------------------------------------------

    pub(crate) fn reduce_all_at(&self, op: ReduceOp, location: Location) -> Tensor {
        let out = self.reduce_all_raw(op, location);
        self.reduce_grad(out, op, None, location)
    }

    fn reduce_all_raw(&self, op: ReduceOp, location: Location) -> Tensor {
        match self.gpu(op.name(), location) {
            Ok(Some(gpu)) => {
                let n = self.numel();
                return self.gpu_reduce(gpu, op, 1, n, 1, Shape::scalar(), location);
            }
            Ok(None) => {}
            Err(e) => return self.poisoned(e),
        }
        self.map1(op.name(), location, Shape::scalar(), move |a, out| {
            out[0] = kernels::reduce_all(op, a)
        })
    }

    /// A reduction that has no value for no elements (max, min, argmax): over
    /// nothing it is an error when recorded, as in numpy, rather than a NaN.
    pub(super) fn reduce_nonempty_at(
        &self,
        op: ReduceOp,
        axis: Option<usize>,
        location: Location,
    ) -> Result<Tensor> {
        let empty = match axis {
            None => (self.numel() == 0).then(|| "no elements".to_string()),
            Some(axis) => {
                check_axis(op.name(), &self.shape, axis, location)?;
                (self.dims()[axis] == 0).then(|| format!("axis {axis} has no elements"))
            }
        };
        if let Some(what) = empty {
            return Err(arg_err(
                op.name(),
                &self.shape,
                format!("{what} to reduce, and {} has no identity", op.name()),
                location,
            ));
        }
        match axis {
            None => Ok(self.reduce_all_at(op, location)),
            Some(axis) => self.reduce_axis_at(op, axis, location),
        }
    }

    pub(crate) fn reduce_axis_at(
        &self,
        op: ReduceOp,
        axis: usize,
        location: Location,
    ) -> Result<Tensor> {
        let out = self.reduce_axis_raw(op, axis, location)?;
        Ok(self.reduce_grad(out, op, Some(axis), location))
    }

    fn reduce_axis_raw(&self, op: ReduceOp, axis: usize, location: Location) -> Result<Tensor> {
        check_axis(op.name(), &self.shape, axis, location)?;
        let mut dims = self.dims().to_vec();
        dims.remove(axis);
        let out_shape = Shape::from(dims);
        if let Some(gpu) = self.gpu(op.name(), location)? {
            let d = self.dims();
            let outer = d[..axis].iter().product();
            let inner = d[axis + 1..].iter().product();
            return Ok(self.gpu_reduce(gpu, op, outer, d[axis], inner, out_shape, location));
        }
        let shape = self.shape.clone();
        Ok(self.map1(op.name(), location, out_shape, move |a, out| {
            kernels::reduce_axis(op, a, shape.dims(), axis, out);
        }))
    }
}

macro_rules! reduce_methods {
    ($($(#[$doc:meta])* $all:ident, $axis:ident => $op:ident;)*) => {
        impl Tensor {
            $(
                $(#[$doc])*
                /// over all elements (a scalar tensor).
                #[track_caller]
                pub fn $all(&self) -> Tensor {
                    self.reduce_all_at(ReduceOp::$op, Location::caller())
                }

                $(#[$doc])*
                /// along `axis`, which is removed from the shape.
                #[track_caller]
                pub fn $axis(&self, axis: usize) -> Result<Tensor> {
                    self.reduce_axis_at(ReduceOp::$op, axis, Location::caller())
                }
            )*
        }
    };
}

reduce_methods! {
    /// Sum
    sum, sum_axis => Sum;
    /// Mean (NaN for no elements)
    mean, mean_axis => Mean;
}

macro_rules! reduce_nonempty_methods {
    ($($(#[$doc:meta])* $all:ident, $axis:ident => $op:ident, $of_1_5_2:literal;)*) => {
        impl Tensor {
            $(
                $(#[$doc])*
                /// over all elements (a scalar tensor).
                ///
                /// A tensor without elements is an [`Error::InvalidArgument`] at
                /// the call, as in numpy: the reduction has no identity.
                ///
                /// ```
                /// use lazyflow::{Engine, Tensor};
                /// let engine = Engine::builder().workers(1).build().unwrap();
                /// let x = Tensor::from_vec_in(&engine, vec![1.0, 5.0, 2.0], [3]).unwrap();
                #[doc = concat!("assert_eq!(x.", stringify!($all), "()?.item()?, ", $of_1_5_2, ");")]
                #[doc = concat!("assert!(Tensor::zeros_in(&engine, [0]).", stringify!($all), "().is_err());")]
                /// # Ok::<(), lazyflow::Error>(())
                /// ```
                #[track_caller]
                pub fn $all(&self) -> Result<Tensor> {
                    self.reduce_nonempty_at(ReduceOp::$op, None, Location::caller())
                }

                $(#[$doc])*
                /// along `axis`, which is removed from the shape. An axis of
                /// length 0 is an [`Error::InvalidArgument`] at the call.
                #[track_caller]
                pub fn $axis(&self, axis: usize) -> Result<Tensor> {
                    self.reduce_nonempty_at(ReduceOp::$op, Some(axis), Location::caller())
                }
            )*
        }
    };
}

reduce_nonempty_methods! {
    /// Maximum (NaN propagates)
    max, max_axis => Max, "5.0";
    /// Minimum (NaN propagates)
    min, min_axis => Min, "1.0";
    /// Index of the first maximum, as `f32` (of the first NaN if there is one)
    argmax, argmax_axis => Argmax, "1.0";
}

impl Tensor {
    // ----- matmul -----------------------------------------------------------

    /// Matrix product. `self` is `[..., m, k]`, `other` is `[k, n]` (shared by every
    /// batch entry) or `[..., k, n]` with the same leading dims; the result is
    /// `[..., m, n]`. Runs on the GEMM of the `faer` crate.
    #[track_caller]
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        self.matmul_at(other, Location::caller())
    }

    pub(crate) fn matmul_at(&self, other: &Tensor, location: Location) -> Result<Tensor> {
        let out = self.matmul_raw(other, location)?;
        Ok(self.matmul_grad(other, out, location))
    }

    fn matmul_raw(&self, other: &Tensor, location: Location) -> Result<Tensor> {
        self.check_device("matmul", &[other], location)?;
        let (a, b) = (self.dims(), other.dims());
        let err =
            |reason: &str| shape_err("matmul", &[&self.shape, &other.shape], reason, location);
        if a.len() < 2 || b.len() < 2 {
            return Err(err("both operands need at least 2 dimensions"));
        }
        let (m, k) = (a[a.len() - 2], a[a.len() - 1]);
        let (k2, n) = (b[b.len() - 2], b[b.len() - 1]);
        if k != k2 {
            return Err(err(&format!("inner dimensions differ ({k} vs {k2})")));
        }
        let batch_dims = &a[..a.len() - 2];
        let b_batched = b.len() > 2;
        if b_batched && &b[..b.len() - 2] != batch_dims {
            return Err(err(
                "batch dimensions differ (the right operand may also be 2-D)",
            ));
        }
        let batch: usize = batch_dims.iter().product();
        let mut out_dims = batch_dims.to_vec();
        out_dims.extend([m, n]);
        if let Some(gpu) = self.gpu("matmul", location)? {
            return self.gpu_matmul(
                gpu,
                other,
                batch,
                (m, k, n),
                b_batched,
                Shape::from(out_dims),
                location,
            );
        }
        let threads = self.engine().cpu_threads();
        self.map2(
            other,
            "matmul",
            location,
            Shape::from(out_dims),
            move |a, b, out| {
                kernels::matmul(a, b, out, batch, m, k, n, b_batched, threads);
            },
        )
    }

    // ----- layout -----------------------------------------------------------

    /// Swaps two axes (a copy).
    #[track_caller]
    pub fn transpose(&self, dim0: usize, dim1: usize) -> Result<Tensor> {
        self.transpose_at(dim0, dim1, Location::caller())
    }

    pub(crate) fn transpose_at(
        &self,
        dim0: usize,
        dim1: usize,
        location: Location,
    ) -> Result<Tensor> {
        let out = self.transpose_raw(dim0, dim1, location)?;
        Ok(out.taped("transpose", location, &[self], move |g, _| {
            Ok(vec![Some(g.transpose_at(dim0, dim1, location)?)])
        }))
    }

    fn transpose_raw(&self, dim0: usize, dim1: usize, location: Location) -> Result<Tensor> {
        check_axis("transpose", &self.shape, dim0, location)?;
        check_axis("transpose", &self.shape, dim1, location)?;
        let mut dims = self.dims().to_vec();
        dims.swap(dim0, dim1);
        if let Some(gpu) = self.gpu("transpose", location)? {
            let mut strides = self.shape.strides().to_vec();
            strides.swap(dim0, dim1);
            return Ok(self.gpu_strided(
                gpu,
                "transpose",
                Shape::from(dims),
                0,
                &strides,
                location,
            ));
        }
        let shape = self.shape.clone();
        Ok(
            self.map1("transpose", location, Shape::from(dims), move |a, out| {
                kernels::transpose(a, shape.dims(), dim0, dim1, out);
            }),
        )
    }

    /// The transpose of a 2-D tensor.
    #[track_caller]
    pub fn t(&self) -> Result<Tensor> {
        let location = Location::caller();
        if self.shape.rank() != 2 {
            return Err(arg_err("t", &self.shape, "needs a 2-D tensor", location));
        }
        self.transpose_at(0, 1, location)
    }

    /// The same data with another shape of as many elements. This is a view: no
    /// node is recorded, and an in-place op on either tensor changes both.
    #[track_caller]
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        self.reshape_at(shape, Location::caller())
    }

    pub(crate) fn reshape_at(&self, shape: impl Into<Shape>, location: Location) -> Result<Tensor> {
        let shape = shape.into();
        let from = self.shape.clone();
        let out = self.reshape_raw(shape, location)?;
        Ok(out.taped("reshape", location, &[self], move |g, _| {
            Ok(vec![Some(g.reshape_at(from.clone(), location)?)])
        }))
    }

    fn reshape_raw(&self, shape: Shape, location: Location) -> Result<Tensor> {
        if shape.numel() != self.numel() {
            return Err(shape_err(
                "reshape",
                &[&self.shape, &shape],
                format!(
                    "{} elements cannot be viewed as {}",
                    self.numel(),
                    shape.numel()
                ),
                location,
            ));
        }
        Ok(Tensor {
            shape,
            var: self.var.clone(),
            device: self.device,
            tape: None,
        })
    }

    /// Materializes the broadcast of `self` to `shape` (numpy rules).
    #[track_caller]
    pub fn broadcast_to(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        self.broadcast_to_at(shape.into(), Location::caller())
    }

    pub(crate) fn broadcast_to_at(&self, target: Shape, location: Location) -> Result<Tensor> {
        let from = self.shape.clone();
        let out = self.broadcast_to_raw(target, location)?;
        Ok(out.taped("broadcast_to", location, &[self], move |g, _| {
            Ok(vec![Some(g.sum_to(&from, location)?)])
        }))
    }

    fn broadcast_to_raw(&self, target: Shape, location: Location) -> Result<Tensor> {
        if !self.shape.broadcasts_to(&target) {
            return Err(shape_err(
                "broadcast_to",
                &[&self.shape, &target],
                "cannot broadcast",
                location,
            ));
        }
        if let Some(gpu) = self.gpu("broadcast_to", location)? {
            let strides: Vec<usize> = super::fusion::broadcast_strides(self.dims(), target.dims())
                .into_iter()
                .map(|s| s as usize)
                .collect();
            return Ok(self.gpu_strided(gpu, "broadcast_to", target, 0, &strides, location));
        }
        let (from, to) = (self.shape.clone(), target.clone());
        Ok(self.map1("broadcast_to", location, target, move |a, out| {
            kernels::broadcast_to(a, from.dims(), to.dims(), out);
        }))
    }

    /// `len` entries from `start` along `axis` (a copy).
    #[track_caller]
    pub fn narrow(&self, axis: usize, start: usize, len: usize) -> Result<Tensor> {
        let location = Location::caller();
        check_axis("narrow", &self.shape, axis, location)?;
        let size = self.dims()[axis];
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(arg_err(
                "narrow",
                &self.shape,
                format!(
                    "range {start}..{} exceeds axis {axis} of size {size}",
                    start.saturating_add(len)
                ),
                location,
            ));
        }
        Ok(self.narrow_at("narrow", axis, start, len, location))
    }

    /// `narrow` without the checks (done by the callers).
    pub(crate) fn narrow_at(
        &self,
        name: &'static str,
        axis: usize,
        start: usize,
        len: usize,
        location: Location,
    ) -> Tensor {
        let out = self.narrow_raw(name, axis, start, len, location);
        self.narrow_grad(out, name, axis, start, location)
    }

    fn narrow_raw(
        &self,
        name: &'static str,
        axis: usize,
        start: usize,
        len: usize,
        location: Location,
    ) -> Tensor {
        let mut dims = self.dims().to_vec();
        dims[axis] = len;
        let out_shape = Shape::from(dims);
        match self.gpu(name, location) {
            Ok(Some(gpu)) => {
                let strides = self.shape.strides();
                let base = start * strides[axis];
                return self.gpu_strided(gpu, name, out_shape, base, &strides, location);
            }
            Ok(None) => {}
            Err(e) => return self.poisoned(e),
        }
        let shape = self.shape.clone();
        self.map1(name, location, out_shape, move |a, out| {
            kernels::narrow(a, shape.dims(), axis, start, len, out);
        })
    }

    /// Splits along `axis` into pieces of `sizes` (which must add up to the axis).
    #[track_caller]
    pub fn split(&self, axis: usize, sizes: &[usize]) -> Result<Vec<Tensor>> {
        let location = Location::caller();
        check_axis("split", &self.shape, axis, location)?;
        let total: usize = sizes.iter().sum();
        if total != self.dims()[axis] {
            return Err(arg_err(
                "split",
                &self.shape,
                format!(
                    "sizes {sizes:?} add up to {total}, axis {axis} has {}",
                    self.dims()[axis]
                ),
                location,
            ));
        }
        let mut start = 0;
        let mut out = Vec::with_capacity(sizes.len());
        for &len in sizes {
            out.push(self.narrow_at("split", axis, start, len, location));
            start += len;
        }
        Ok(out)
    }

    /// Joins tensors along `axis`; all other dimensions must agree.
    #[track_caller]
    pub fn concat(tensors: &[&Tensor], axis: usize) -> Result<Tensor> {
        Tensor::concat_at(tensors, axis, Location::caller())
    }

    pub(crate) fn concat_at(
        tensors: &[&Tensor],
        axis: usize,
        location: Location,
    ) -> Result<Tensor> {
        let out = Tensor::concat_raw(tensors, axis, location)?;
        Ok(Tensor::concat_grad(out, tensors, axis, location))
    }

    fn concat_raw(tensors: &[&Tensor], axis: usize, location: Location) -> Result<Tensor> {
        let Some(first) = tensors.first() else {
            return Err(arg_err(
                "concat",
                &Shape::scalar(),
                "needs at least one tensor",
                location,
            ));
        };
        first.check_device("concat", &tensors[1..], location)?;
        check_axis("concat", &first.shape, axis, location)?;
        let shapes: Vec<&Shape> = tensors.iter().map(|t| &t.shape).collect();
        let fits = |s: &Shape| {
            s.rank() == first.shape.rank()
                && s.dims()
                    .iter()
                    .zip(first.dims())
                    .enumerate()
                    .all(|(i, (a, b))| i == axis || a == b)
        };
        if !shapes.iter().all(|s| fits(s)) {
            return Err(shape_err(
                "concat",
                &shapes,
                format!("dimensions other than axis {axis} must agree"),
                location,
            ));
        }
        let mut dims = first.dims().to_vec();
        dims[axis] = tensors.iter().map(|t| t.dims()[axis]).sum();
        if let Some(gpu) = first.gpu("concat", location)? {
            return Tensor::gpu_concat(gpu, tensors, axis, Shape::from(dims), location);
        }
        let out = first.output(Shape::from(dims));
        let mut task = first.engine().task_at("concat", location);
        task.device(first.device);
        let inputs: Vec<_> = tensors
            .iter()
            .map(|t| (task.read(&t.var), t.shape.clone()))
            .collect();
        let o = task.write(&out.var);
        let n = out.numel();
        task.push_fallible(move || {
            let guards: Vec<_> = inputs.iter().map(|(r, s)| (r.read(), s)).collect();
            let mut parts: Vec<(&[f32], &[usize])> = Vec::with_capacity(guards.len());
            for (g, s) in &guards {
                parts.push((g.host()?.as_slice(), s.dims()));
            }
            let mut v = zeroed(n)?;
            kernels::concat(&parts, axis, &mut v);
            drop(parts);
            drop(guards);
            *o.write() = Data::Host(v);
            Ok(())
        })?;
        Ok(out)
    }
}

// ----- operators --------------------------------------------------------------

macro_rules! operator {
    ($trait:ident, $method:ident, $op:ident, $assign:ident, $assign_method:ident, $inplace:literal) => {
        impl ops::$trait<&Tensor> for &Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: &Tensor) -> Tensor {
                let location = Location::caller();
                self.binary_at(rhs, BinaryOp::$op, location)
                    .unwrap_or_else(|e| self.poisoned(e))
            }
        }
        impl ops::$trait<Tensor> for Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: Tensor) -> Tensor {
                ops::$trait::$method(&self, &rhs)
            }
        }
        impl ops::$trait<&Tensor> for Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: &Tensor) -> Tensor {
                ops::$trait::$method(&self, rhs)
            }
        }
        impl ops::$trait<Tensor> for &Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: Tensor) -> Tensor {
                ops::$trait::$method(self, &rhs)
            }
        }
        impl ops::$trait<f32> for &Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: f32) -> Tensor {
                self.scalar_at(rhs, BinaryOp::$op, false, Location::caller())
            }
        }
        impl ops::$trait<f32> for Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: f32) -> Tensor {
                self.scalar_at(rhs, BinaryOp::$op, false, Location::caller())
            }
        }
        impl ops::$trait<&Tensor> for f32 {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: &Tensor) -> Tensor {
                rhs.scalar_at(self, BinaryOp::$op, true, Location::caller())
            }
        }
        impl ops::$trait<Tensor> for f32 {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: Tensor) -> Tensor {
                rhs.scalar_at(self, BinaryOp::$op, true, Location::caller())
            }
        }
        /// In place. A shape error cannot be returned from an operator: it is
        /// recorded as a failing node that poisons `self`.
        impl ops::$assign<&Tensor> for Tensor {
            #[track_caller]
            fn $assign_method(&mut self, rhs: &Tensor) {
                let location = Location::caller();
                if let Err(e) = self.inplace_at(rhs, BinaryOp::$op, $inplace, location) {
                    self.fail_inplace($inplace, location, e);
                }
            }
        }
        impl ops::$assign<f32> for Tensor {
            #[track_caller]
            fn $assign_method(&mut self, rhs: f32) {
                let expr = binary_expr_xs(BinaryOp::$op);
                self.update1(
                    $inplace,
                    Location::caller(),
                    Update::ReadModifyWrite,
                    (&expr, rhs),
                    move |a| kernels::binary_scalar_inplace(BinaryOp::$op, a, rhs),
                )
            }
        }
    };
}

operator!(Add, add, Add, AddAssign, add_assign, "add_");
operator!(Sub, sub, Sub, SubAssign, sub_assign, "sub_");
operator!(Mul, mul, Mul, MulAssign, mul_assign, "mul_");
operator!(Div, div, Div, DivAssign, div_assign, "div_");

impl ops::Neg for &Tensor {
    type Output = Tensor;
    #[track_caller]
    fn neg(self) -> Tensor {
        self.unary_at(UnaryOp::Neg, Location::caller())
    }
}

impl ops::Neg for Tensor {
    type Output = Tensor;
    #[track_caller]
    fn neg(self) -> Tensor {
        self.unary_at(UnaryOp::Neg, Location::caller())
    }
}
