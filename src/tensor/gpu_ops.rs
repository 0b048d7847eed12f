//! Tensor ops on a GPU device: recording their nodes, the WGSL expressions that
//! specialize the elementwise kernels of `shaders/` (listed in `shaders.rs`),
//! and the record-time size check. Ops without a GPU kernel yet return
//! [`Error::Unsupported`] at record time.

use super::fusion::{ElemOp, Fuser, Input};
use super::kernels::{BinaryOp, ReduceOp, UnaryOp};
use super::matmul_kernels;
use super::shaders::Kernel;
use super::{Data, Shape, Tensor};
use crate::device::gpu::{Gpu, GpuBuffer, Grid};
use crate::device::Device;

/// An operand of a fused op inside its node: a tensor's data and shape, or a
/// scalar.
type FusedToken = (
    Option<crate::var::Read<Data>>,
    Option<super::fusion::Dims>,
    f32,
);

use super::batch::Arg;
use crate::error::{Error, Location, Result};
use std::sync::Arc;

/// WGSL tests and constructions on the bits of an `f32` expression.
///
/// WGSL lets compilers assume that NaN and infinities never occur, and drivers
/// do: lavapipe folds `x - x` to 0 and `x != x` to false, and `max`, `min` and
/// `clamp` drop NaN. So every special case of an op is decided with integer
/// operations on the bits, which cannot be assumed away, and special results
/// are built from bits at run time (a NaN or infinite constant is a
/// shader-creation error in WGSL).
struct Bits<'a>(&'a str);

impl Bits<'_> {
    fn u32(&self) -> String {
        format!("bitcast<u32>({})", self.0)
    }

    /// The bits without the sign.
    fn magnitude(&self) -> String {
        format!("({} & 0x7fffffffu)", self.u32())
    }

    fn is_nan(&self) -> String {
        format!("({} > 0x7f800000u)", self.magnitude())
    }

    fn is_inf(&self) -> String {
        format!("({} == 0x7f800000u)", self.magnitude())
    }

    /// +0 or -0.
    fn is_zero(&self) -> String {
        format!("({} == 0u)", self.magnitude())
    }

    /// The sign bit is set (negative numbers, -0, -inf, some NaNs).
    fn sign(&self) -> String {
        format!("({} >= 0x80000000u)", self.u32())
    }

    /// Below zero: -0 and NaNs excluded, -inf included.
    fn is_negative(&self) -> String {
        let u = self.u32();
        format!("({u} > 0x80000000u && {u} <= 0xff800000u)")
    }

    fn abs(&self) -> String {
        format!("bitcast<f32>({})", self.magnitude())
    }

    /// A NaN (made from the value, so that it is not a constant).
    fn nan(&self) -> String {
        format!("bitcast<f32>({} | 0x7fc00000u)", self.u32())
    }
}

/// `t` where `cond` holds, else `f`.
fn select(f: &str, t: &str, cond: &str) -> String {
    format!("select({f}, {t}, {cond})")
}

/// An `f32` from the sign (`negative`) and the magnitude (`infinite`, else 0)
/// given as WGSL conditions.
fn signed_inf_or_zero(negative: &str, infinite: &str) -> String {
    format!(
        "bitcast<f32>(select(0u, 0x80000000u, {negative}) | select(0u, 0x7f800000u, {infinite}))"
    )
}

/// The WGSL expression of a binary op on the expressions `l` and `r`, with the
/// CPU's results for NaN, infinities and zeros (see [`Bits`]).
pub(crate) fn binary_wgsl(op: BinaryOp, l: &str, r: &str) -> String {
    let (a, b) = (Bits(l), Bits(r));
    let either_nan = format!("{} || {}", a.is_nan(), b.is_nan());
    // NaN where IEEE 754 says so, else the hardware's result.
    let arithmetic = |value: String, invalid: String| {
        select(&value, &a.nan(), &format!("{either_nan} || {invalid}"))
    };
    // Ordered comparisons are false, and `!=` true, when either side is NaN.
    let cmp = |c: &str| {
        let holds = if c == "!=" {
            format!("{l} != {r} || {either_nan}")
        } else {
            format!("{l} {c} {r} && !({either_nan})")
        };
        select("0.0", "1.0", &holds)
    };
    match op {
        // inf + -inf
        BinaryOp::Add => arithmetic(
            format!("{l} + {r}"),
            format!(
                "({} && ({} ^ {}) == 0x80000000u)",
                a.is_inf(),
                a.u32(),
                b.u32()
            ),
        ),
        // inf - inf
        BinaryOp::Sub => arithmetic(
            format!("{l} - {r}"),
            format!("({} && {} == {})", a.is_inf(), a.u32(), b.u32()),
        ),
        // 0 * inf
        BinaryOp::Mul => arithmetic(
            format!("{l} * {r}"),
            format!(
                "({} && {}) || ({} && {})",
                a.is_inf(),
                b.is_zero(),
                a.is_zero(),
                b.is_inf()
            ),
        ),
        // inf / inf, 0 / 0
        BinaryOp::Div => arithmetic(
            format!("{l} / {r}"),
            format!(
                "({} && {}) || ({} && {})",
                a.is_inf(),
                b.is_inf(),
                a.is_zero(),
                b.is_zero()
            ),
        ),
        BinaryOp::Maximum => select(
            &select(&format!("max({l}, {r})"), r, &b.is_nan()),
            l,
            &a.is_nan(),
        ),
        BinaryOp::Minimum => select(
            &select(&format!("min({l}, {r})"), r, &b.is_nan()),
            l,
            &a.is_nan(),
        ),
        BinaryOp::Pow => pow_wgsl(l, r),
        BinaryOp::Eq => cmp("=="),
        BinaryOp::Ne => cmp("!="),
        BinaryOp::Lt => cmp("<"),
        BinaryOp::Le => cmp("<="),
        BinaryOp::Gt => cmp(">"),
        BinaryOp::Ge => cmp(">="),
    }
}

/// `x ^ y` as C's `pow` (and `f32::powf`) defines it: WGSL's `pow` is only
/// defined for `x > 0`. In order of precedence: `y = ±0` or `x = 1` give 1,
/// `y = 1` gives `x`, then NaN propagates; `y = ±inf` gives 1 for `x = -1`, else inf or 0 by whether
/// `|x| > 1` and `y > 0` agree; `x = ±0` or `±inf` give 0 or inf, negative when
/// `x` is and `y` is an odd integer; a negative `x` gives NaN unless `y` is an
/// integer, and the sign of an odd power.
fn pow_wgsl(x: &str, y: &str) -> String {
    let (a, b) = (Bits(x), Bits(y));
    let y_integer = format!("(floor({y}) == {y})");
    let y_odd = format!("({y_integer} && floor({y} * 0.5) != {y} * 0.5)");
    let negative = format!("({} && {y_odd})", a.sign());
    let y_positive = format!("!{}", b.sign());
    let magnitude = format!("pow({}, {y})", a.abs());
    let finite = select(
        &select(&magnitude, &format!("-{magnitude}"), &negative),
        &a.nan(),
        &format!("({} && !{y_integer})", a.sign()),
    );
    let zero_or_inf_base =
        signed_inf_or_zero(&negative, &format!("{} == {y_positive}", a.is_inf()));
    let infinite_exponent = select(
        &signed_inf_or_zero(
            "false",
            &format!("({} > 0x3f800000u) == {y_positive}", a.magnitude()),
        ),
        "1.0",
        &format!("({} == 0x3f800000u)", a.magnitude()),
    );
    let mut e = select(
        &finite,
        &zero_or_inf_base,
        &format!("{} || {}", a.is_zero(), a.is_inf()),
    );
    e = select(&e, &infinite_exponent, &b.is_inf());
    e = select(&e, &a.nan(), &format!("{} || {}", a.is_nan(), b.is_nan()));
    // Exact, where exp2(log2(x)) can round f32::MAX up to inf.
    e = select(&e, x, &format!("({} == 0x3f800000u)", b.u32()));
    e = select(&e, "1.0", &format!("({} == 0x3f800000u)", a.u32()));
    select(&e, "1.0", &b.is_zero())
}

/// The WGSL expression of `op(x, s)` (in-place ops with a scalar).
pub(crate) fn binary_expr_xs(op: BinaryOp) -> String {
    binary_wgsl(op, "x", "s")
}

/// The WGSL expression of a unary op on `x`.
pub(crate) fn unary_expr(op: UnaryOp) -> String {
    unary_wgsl(op, "x")
}

/// The WGSL expression of a unary op on the expression `x`, with the CPU's
/// results for NaN, infinities and zeros (see [`Bits`]).
pub(crate) fn unary_wgsl(op: UnaryOp, x: &str) -> String {
    let a = Bits(x);
    let plus_inf = format!("({} == 0x7f800000u)", a.u32());
    // NaN in, NaN out.
    let keep_nan = |value: String| select(&value, x, &a.is_nan());
    // NaN for NaN and below zero (-0 is not).
    let domain = |value: String| {
        select(
            &value,
            &a.nan(),
            &format!("{} || {}", a.is_nan(), a.is_negative()),
        )
    };
    match op {
        UnaryOp::Neg => format!("-{x}"),
        UnaryOp::Exp => keep_nan(select(
            &format!("exp({x})"),
            &signed_inf_or_zero("false", &format!("!{}", a.sign())),
            &a.is_inf(),
        )),
        // log(±0) = -inf, log(inf) = inf.
        UnaryOp::Log => domain(select(
            &select(&format!("log({x})"), x, &plus_inf),
            &signed_inf_or_zero("true", "true"),
            &a.is_zero(),
        )),
        // sqrt(±0) = ±0, sqrt(inf) = inf.
        UnaryOp::Sqrt => domain(select(
            &format!("sqrt({x})"),
            x,
            &format!("{} || {plus_inf}", a.is_zero()),
        )),
        UnaryOp::Abs => a.abs(),
        // -0 stays -0, like `if x < 0 { 0 } else { x }` on the CPU.
        UnaryOp::Relu => select(x, "0.0", &a.is_negative()),
        // e^-|x| never overflows; ±inf give exactly 1 and 0.
        UnaryOp::Sigmoid => {
            let e = format!("exp(-{})", a.abs());
            keep_nan(select(
                &select(
                    &format!("1.0 / (1.0 + {e})"),
                    &format!("{e} / (1.0 + {e})"),
                    &a.sign(),
                ),
                &select("1.0", "0.0", &a.sign()),
                &a.is_inf(),
            ))
        }
        // tanh is exactly +-1 in f32 beyond |x| = 9; clamping avoids inf / inf.
        UnaryOp::Tanh => keep_nan(format!("tanh(clamp({x}, -10.0, 10.0))")),
    }
}

/// Every specialization the tensor layer can ask for (for the naga test).
#[cfg(test)]
pub(crate) fn all_specializations() -> Vec<(Kernel, String)> {
    use BinaryOp::*;
    use UnaryOp::*;
    let binary = [
        Add, Sub, Mul, Div, Maximum, Minimum, Pow, Eq, Ne, Lt, Le, Gt, Ge,
    ];
    let mut out = Vec::new();
    for op in binary {
        out.push((Kernel::Binary, binary_wgsl(op, "x", "y")));
        out.push((Kernel::Inplace, binary_wgsl(op, "x", "y")));
        out.push((Kernel::Map, binary_wgsl(op, "x", "s")));
        out.push((Kernel::Map, binary_wgsl(op, "s", "x")));
        out.push((Kernel::InplaceMap, binary_wgsl(op, "x", "s")));
    }
    for op in [Neg, Exp, Log, Sqrt, Abs, Relu, Sigmoid, Tanh] {
        out.push((Kernel::Map, unary_expr(op)));
        out.push((Kernel::InplaceMap, unary_expr(op)));
    }
    out.push((Kernel::InplaceMap, "s".to_string()));
    for kind in 0..5 {
        out.push((Kernel::Reduce, kind.to_string()));
    }
    out.push((Kernel::StridedCopy, String::new()));
    for name in super::matmul_kernels::matmul_kernels() {
        out.push((Kernel::Matmul, name.to_string()));
    }
    for kind in 0..=1 {
        out.push((Kernel::Im2col, kind.to_string()));
    }
    for kind in 0..=3 {
        out.push((Kernel::Pool, kind.to_string()));
    }
    out
}

/// `[n, rank, src_base, dst_base, dims, src_strides, dst_strides]` for
/// `strided_copy.wgsl`.
fn strided_info(
    dims: &Shape,
    src_base: usize,
    src_strides: &[usize],
    dst_base: usize,
    dst_strides: &[usize],
) -> Vec<u32> {
    let mut info = vec![
        dims.numel() as u32,
        dims.rank() as u32,
        src_base as u32,
        dst_base as u32,
    ];
    info.extend(dims.dims().iter().map(|&d| d as u32));
    info.extend(src_strides.iter().map(|&s| s as u32));
    info.extend(dst_strides.iter().map(|&s| s as u32));
    info
}

/// `[n, rank, out_dims, a_strides, b_strides]` with stride 0 on broadcast dims.
fn broadcast_info(a: &Shape, b: &Shape, out: &Shape) -> Vec<u32> {
    let rank = out.rank();
    let strides = |s: &Shape| super::fusion::broadcast_strides(s.dims(), out.dims());
    let mut info = vec![out.numel() as u32, rank as u32];
    info.extend(out.dims().iter().map(|&d| d as u32));
    info.extend(strides(a));
    info.extend(strides(b));
    info
}

/// Record-time check that a tensor of `shape` fits in one buffer of `gpu`.
pub(super) fn check_size(
    gpu: &Gpu,
    op: &'static str,
    shape: &Shape,
    location: Location,
) -> Result<()> {
    gpu.check_size(shape.numel())
        .map_err(|reason| Error::InvalidArgument {
            op,
            shape: shape.to_string(),
            reason,
            location,
        })
}

impl Tensor {
    /// The GPU this tensor lives on, or `None` on the CPU.
    pub(crate) fn gpu(&self, op: &'static str, location: Location) -> Result<Option<Arc<Gpu>>> {
        match self.device {
            Device::Cpu => Ok(None),
            Device::Gpu(i) => match self.engine().gpu(i) {
                Some(g) => Ok(Some(g.clone())),
                None => Err(Error::InvalidArgument {
                    op,
                    shape: self.shape.to_string(),
                    reason: format!("{} does not exist", self.device),
                    location,
                }),
            },
        }
    }

    /// The error of an op with no GPU kernel yet.
    pub(crate) fn unsupported(&self, op: &'static str, location: Location) -> Error {
        Error::Unsupported {
            op,
            device: self.device.to_string(),
            location,
        }
    }

    /// Records an elementwise op that joins its device's fusion group when it
    /// runs (see `fusion.rs`). `inputs` are `None` for `self` and `Some(t)` for
    /// another tensor, or a scalar.
    fn gpu_fused(
        &self,
        gpu: Arc<Gpu>,
        name: &'static str,
        location: Location,
        out_shape: Shape,
        op: ElemOp,
        inputs: &[Arg<'_>],
    ) -> Result<Tensor> {
        check_size(&gpu, name, &out_shape, location)?;
        let dims: super::fusion::Dims = super::fusion::Dims::from_slice(out_shape.dims());
        let n = out_shape.numel();
        let batches = match self.engine().mode() {
            crate::Mode::Sync => None,
            _ => super::batch::DeviceBatch::of(self.engine(), &gpu, self.device),
        };
        if let Some(batches) = batches {
            // One node per batch of ops, recorded when something else needs
            // them (see `batch.rs`).
            let var = batches.push(self.engine(), name, location, &dims, op, inputs)?;
            return Ok(self.output_in(out_shape, var));
        }
        let out = self.output(out_shape);
        let mut t = self.engine().task_at(name, location);
        t.device(self.device);
        let mut tokens: Vec<FusedToken> = Vec::new();
        let mut self_token: Option<crate::var::Read<Data>> = None;
        for input in inputs {
            match input {
                Arg::Tensor(x) => {
                    let token = if x.same_data(self) {
                        match &self_token {
                            Some(s) => s.duplicate(),
                            None => {
                                let r = t.read(&self.var);
                                let d = r.duplicate();
                                self_token = Some(r);
                                d
                            }
                        }
                    } else {
                        t.read(&x.var)
                    };
                    tokens.push((
                        Some(token),
                        Some(super::fusion::Dims::from_slice(x.dims())),
                        0.0,
                    ));
                }
                Arg::Scalar(s) => tokens.push((None, None, *s)),
            }
        }
        let o = t.write(&out.var);
        let pending = gpu.expect_node();
        let seq = super::fusion::record_order();
        t.push_fallible(move || {
            // Memory only if the value is written: when something outside the
            // fused kernel can still read it (see `fusion.rs`).
            let buf = gpu.alloc_lazy(n)?;
            *o.write() = Data::Gpu(buf);
            let inputs = tokens
                .into_iter()
                .map(|(token, dims, s)| match (token, dims) {
                    (Some(token), Some(dims)) => Input::Tensor(token, dims),
                    _ => Input::Scalar(s),
                })
                .collect();
            Fuser::fuse(&gpu, &dims, op, inputs, o, seq)?;
            drop(self_token);
            drop(pending);
            Ok(())
        })?;
        Ok(out)
    }

    pub(crate) fn gpu_binary(
        &self,
        gpu: Arc<Gpu>,
        other: &Tensor,
        op: BinaryOp,
        out_shape: Shape,
        location: Location,
    ) -> Result<Tensor> {
        let name = op.name();
        if gpu.fusion {
            let inputs = [Arg::Tensor(self), Arg::Tensor(other)];
            return self.gpu_fused(gpu, name, location, out_shape, ElemOp::Binary(op), &inputs);
        }
        check_size(&gpu, name, &out_shape, location)?;
        let info = broadcast_info(&self.shape, &other.shape, &out_shape);
        let expr = binary_wgsl(op, "x", "y");
        let n = out_shape.numel();
        let out = self.output(out_shape);
        let mut t = self.engine().task_at(name, location);
        t.device(self.device);
        let a = t.read(&self.var);
        let o = t.write(&out.var);
        let b = (!self.same_data(other)).then(|| t.read(&other.var));
        let pending = gpu.expect_node();
        t.push_fallible(move || {
            let buf = gpu.alloc_lazy(n)?;
            {
                let ga = a.read();
                let ab = ga.gpu()?;
                match &b {
                    Some(b) => {
                        let gb = b.read();
                        Kernel::Binary.dispatch(
                            &gpu,
                            &expr,
                            &[ab, gb.gpu()?, &buf],
                            &info,
                            Grid::Elements(n),
                        )?;
                    }
                    None => Kernel::Binary.dispatch(
                        &gpu,
                        &expr,
                        &[ab, ab, &buf],
                        &info,
                        Grid::Elements(n),
                    )?,
                }
            }
            *o.write() = Data::Gpu(buf);
            drop(pending);
            Ok(())
        })?;
        Ok(out)
    }

    /// Records a GPU node that reads `self` and writes a new buffer of
    /// `out_shape` through `encode(gpu, input, output)`.
    pub(crate) fn gpu_node1(
        &self,
        gpu: Arc<Gpu>,
        name: &'static str,
        location: Location,
        out_shape: Shape,
        encode: impl FnOnce(&Gpu, &GpuBuffer, &GpuBuffer) -> std::result::Result<(), String>
            + Send
            + 'static,
    ) -> Tensor {
        if let Err(e) = check_size(&gpu, name, &out_shape, location) {
            let mut out = self.poisoned(e);
            out.shape = out_shape;
            return out;
        }
        let n = out_shape.numel();
        let out = self.output(out_shape);
        let mut t = self.engine().task_at(name, location);
        t.device(self.device);
        let a = t.read(&self.var);
        let o = t.write(&out.var);
        let pending = gpu.expect_node();
        // Cannot fail: both Vars belong to this engine.
        let _ = t.push_fallible(move || {
            let buf = gpu.alloc_lazy(n)?;
            encode(&gpu, a.read().gpu()?, &buf)?;
            *o.write() = Data::Gpu(buf);
            drop(pending);
            Ok(())
        });
        out
    }

    /// Records a GPU node that reads `self` and `other` and writes a new buffer
    /// of `out_shape` through `encode(gpu, a, b, output)`.
    pub(crate) fn gpu_node2(
        &self,
        other: &Tensor,
        gpu: Arc<Gpu>,
        name: &'static str,
        location: Location,
        out_shape: Shape,
        encode: impl FnOnce(&Gpu, &GpuBuffer, &GpuBuffer, &GpuBuffer) -> std::result::Result<(), String>
            + Send
            + 'static,
    ) -> Result<Tensor> {
        check_size(&gpu, name, &out_shape, location)?;
        let n = out_shape.numel();
        let out = self.output(out_shape);
        let mut t = self.engine().task_at(name, location);
        t.device(self.device);
        let a = t.read(&self.var);
        let b = (!self.same_data(other)).then(|| t.read(&other.var));
        let o = t.write(&out.var);
        let pending = gpu.expect_node();
        t.push_fallible(move || {
            let buf = gpu.alloc_lazy(n)?;
            {
                let ga = a.read();
                let ab = ga.gpu()?;
                match &b {
                    Some(b) => encode(&gpu, ab, b.read().gpu()?, &buf)?,
                    None => encode(&gpu, ab, ab, &buf)?,
                }
            }
            *o.write() = Data::Gpu(buf);
            drop(pending);
            Ok(())
        })?;
        Ok(out)
    }

    /// `out = expr(x, s)` elementwise on the GPU (unary ops and scalar operands).
    pub(crate) fn gpu_map(
        &self,
        gpu: Arc<Gpu>,
        name: &'static str,
        expr: String,
        s: f32,
        location: Location,
    ) -> Tensor {
        let n = self.numel();
        let info = [n as u32, s.to_bits()];
        self.gpu_node1(gpu, name, location, self.shape.clone(), move |g, a, out| {
            Kernel::Map.dispatch(g, &expr, &[a, out], &info, Grid::Elements(n))
        })
    }

    /// A reduction on the GPU over the middle axis of `[outer, len, inner]`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gpu_reduce(
        &self,
        gpu: Arc<Gpu>,
        op: ReduceOp,
        outer: usize,
        len: usize,
        inner: usize,
        out_shape: Shape,
        location: Location,
    ) -> Tensor {
        let kind = match op {
            ReduceOp::Sum => 0,
            ReduceOp::Mean => 1,
            ReduceOp::Max => 2,
            ReduceOp::Min => 3,
            ReduceOp::Argmax => 4,
        };
        let outputs = outer * inner;
        let info = [outputs as u32, len as u32, inner.max(1) as u32];
        self.gpu_node1(gpu, op.name(), location, out_shape, move |g, a, out| {
            Kernel::Reduce.dispatch(
                g,
                &kind.to_string(),
                &[a, out],
                &info,
                Grid::Workgroups(outputs),
            )
        })
    }

    /// A layout change on the GPU: the output (contiguous, `out_shape`) takes
    /// element `src_base + sum(index * src_strides)` of `self` at each index.
    pub(crate) fn gpu_strided(
        &self,
        gpu: Arc<Gpu>,
        name: &'static str,
        out_shape: Shape,
        src_base: usize,
        src_strides: &[usize],
        location: Location,
    ) -> Tensor {
        let info = strided_info(&out_shape, src_base, src_strides, 0, &out_shape.strides());
        let n = out_shape.numel();
        self.gpu_node1(gpu, name, location, out_shape, move |g, a, out| {
            Kernel::StridedCopy.dispatch(g, "", &[a, out], &info, Grid::Elements(n))
        })
    }

    /// Matrix product on the GPU (shapes validated by the caller).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gpu_matmul(
        &self,
        gpu: Arc<Gpu>,
        other: &Tensor,
        batch: usize,
        (m, k, n): (usize, usize, usize),
        b_batched: bool,
        out_shape: Shape,
        location: Location,
    ) -> Result<Tensor> {
        check_size(&gpu, "matmul", &out_shape, location)?;
        let out = self.output(out_shape);
        let mut t = self.engine().task_at("matmul", location);
        t.device(self.device);
        let a = t.read(&self.var);
        let o = t.write(&out.var);
        let b = (!self.same_data(other)).then(|| t.read(&other.var));
        let info = [m as u32, k as u32, n as u32, u32::from(b_batched)];
        let pending = gpu.expect_node();
        t.push_fallible(move || {
            let buf = gpu.alloc(batch * m * n)?;
            {
                let ga = a.read();
                let gb = b.as_ref().map(|b| b.read());
                let ab = ga.gpu()?;
                let bb = match &gb {
                    Some(gb) => gb.gpu()?,
                    None => ab,
                };
                let operands = [ab, bb, &buf];
                let variant = matmul_kernels::choose(
                    &gpu,
                    (m, k, n),
                    &Kernel::Matmul.bindings("", &operands),
                )?;
                let grid = variant.grid(batch, m, n);
                Kernel::Matmul.dispatch(&gpu, variant.name, &operands, &info, grid)?;
            }
            *o.write() = Data::Gpu(buf);
            drop(pending);
            Ok(())
        })?;
        Ok(out)
    }

    /// Joins GPU tensors along `axis` (validated by the caller): one strided copy
    /// per input into its slice of the output.
    pub(crate) fn gpu_concat(
        gpu: Arc<Gpu>,
        tensors: &[&Tensor],
        axis: usize,
        out_shape: Shape,
        location: Location,
    ) -> Result<Tensor> {
        check_size(&gpu, "concat", &out_shape, location)?;
        let first = tensors[0];
        let out = first.output(out_shape.clone());
        let mut task = first.engine().task_at("concat", location);
        task.device(first.device);
        let out_strides = out_shape.strides();
        let mut offset = 0;
        let mut parts = Vec::with_capacity(tensors.len());
        for t in tensors {
            let info = strided_info(
                &t.shape,
                0,
                &t.shape.strides(),
                offset * out_strides[axis],
                &out_strides,
            );
            parts.push((task.read(&t.var), info, t.numel()));
            offset += t.dims()[axis];
        }
        let o = task.write(&out.var);
        let total = out_shape.numel();
        let pending = gpu.expect_node();
        task.push_fallible(move || {
            let buf = gpu.alloc(total)?;
            for (r, info, n) in &parts {
                Kernel::StridedCopy.dispatch(
                    &gpu,
                    "",
                    &[r.read().gpu()?, &buf],
                    info,
                    Grid::Elements(*n),
                )?;
            }
            *o.write() = Data::Gpu(buf);
            drop(pending);
            Ok(())
        })?;
        Ok(out)
    }

    /// `self = op(self, other)` in place on the GPU (`other` broadcasts to
    /// `self`, checked by the caller).
    pub(crate) fn gpu_inplace(
        &self,
        gpu: Arc<Gpu>,
        other: &Tensor,
        op: BinaryOp,
        name: &'static str,
        location: Location,
    ) -> Result<()> {
        let out_shape = self.shape.clone();
        let full = broadcast_info(&self.shape, &other.shape, &out_shape);
        // [n, rank, dims, b_strides]: drop the a-strides of the binary layout.
        let rank = out_shape.rank();
        let mut info = full[..2 + rank].to_vec();
        info.extend_from_slice(&full[2 + 2 * rank..]);
        let expr = binary_wgsl(op, "x", "y");
        let n = self.numel();
        let mut t = self.engine().task_at(name, location);
        t.device(self.device);
        drop(t.read(&self.var));
        let w = t.write(&self.var);
        let b = (!self.same_data(other)).then(|| t.read(&other.var));
        let pending = gpu.expect_node();
        t.push_fallible(move || {
            // Encode pending fused ops first: they may read this buffer, and
            // the fuser must not wait for the write lock taken here.
            gpu.encode_deferred()?;
            let guard = w.write();
            let ab = guard.gpu()?;
            // `a op= a` binds `a` twice: the dispatch reads a copy of it.
            let guard_b = b.as_ref().map(|b| b.read());
            let bb = match &guard_b {
                Some(g) => g.gpu()?,
                None => ab,
            };
            Kernel::Inplace.dispatch(&gpu, &expr, &[ab, bb], &info, Grid::Elements(n))?;
            drop(pending);
            Ok(())
        })
    }

    /// `self = expr(self, s)` in place on the GPU. `reads_self` is false for
    /// overwrites (`fill_`), which also heal a poisoned target.
    pub(crate) fn gpu_inplace_map(
        &self,
        gpu: Arc<Gpu>,
        name: &'static str,
        expr: String,
        s: f32,
        reads_self: bool,
        location: Location,
    ) {
        let n = self.numel();
        let info = [n as u32, s.to_bits()];
        let mut t = self.engine().task_at(name, location);
        t.device(self.device);
        if reads_self {
            drop(t.read(&self.var));
        }
        let w = t.write(&self.var);
        let pending = gpu.expect_node();
        // Cannot fail: one Var of this engine.
        let _ = t.push_fallible(move || {
            gpu.encode_deferred()?;
            let mut guard = w.write();
            if !matches!(&*guard, Data::Gpu(_)) {
                // A poisoned or never-computed target: give it a buffer.
                *guard = Data::Gpu(gpu.alloc(n)?);
            }
            Kernel::InplaceMap.dispatch(&gpu, &expr, &[guard.gpu()?], &info, Grid::Elements(n))?;
            drop(pending);
            Ok(())
        });
    }

    /// `self = src` on the GPU (same shape, checked by the caller).
    pub(crate) fn gpu_copy_from(
        &self,
        gpu: Arc<Gpu>,
        src: &Tensor,
        location: Location,
    ) -> Result<()> {
        if self.same_data(src) {
            return Ok(());
        }
        let n = self.numel();
        let mut t = self.engine().task_at("copy_from", location);
        t.device(self.device);
        let w = t.write(&self.var);
        let r = t.read(&src.var);
        let pending = gpu.expect_node();
        t.push_fallible(move || {
            let buf = gpu.alloc_lazy(n)?;
            gpu.copy(r.read().gpu()?, &buf, (n * 4) as u64)?;
            *w.write() = Data::Gpu(buf);
            drop(pending);
            Ok(())
        })
    }

    pub(crate) fn gpu_scalar(
        &self,
        gpu: Arc<Gpu>,
        s: f32,
        op: BinaryOp,
        scalar_left: bool,
        location: Location,
    ) -> Tensor {
        if gpu.fusion {
            let inputs = if scalar_left {
                [Arg::Scalar(s), Arg::Tensor(self)]
            } else {
                [Arg::Tensor(self), Arg::Scalar(s)]
            };
            let shape = self.shape.clone();
            return self
                .gpu_fused(gpu, op.name(), location, shape, ElemOp::Binary(op), &inputs)
                .unwrap_or_else(|e| self.poisoned(e));
        }
        let expr = if scalar_left {
            binary_wgsl(op, "s", "x")
        } else {
            binary_wgsl(op, "x", "s")
        };
        self.gpu_map(gpu, op.name(), expr, s, location)
    }

    pub(crate) fn gpu_unary(&self, gpu: Arc<Gpu>, op: UnaryOp, location: Location) -> Tensor {
        if gpu.fusion {
            let shape = self.shape.clone();
            return self
                .gpu_fused(
                    gpu,
                    op.name(),
                    location,
                    shape,
                    ElemOp::Unary(op),
                    &[Arg::Tensor(self)],
                )
                .unwrap_or_else(|e| self.poisoned(e));
        }
        self.gpu_map(gpu, op.name(), unary_expr(op), 0.0, location)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel in `shaders/`, in every specialization the tensor layer uses,
    /// parses and validates with naga (no GPU needed).
    #[test]
    fn every_shader_specialization_validates() {
        let specs = all_specializations();
        assert!(specs.len() >= 13 * 5 + 8 * 2 + 8);
        for kernel in Kernel::ALL {
            assert!(
                specs.iter().any(|(k, _)| *k == kernel),
                "{kernel:?} is never validated"
            );
        }
        for (kernel, expr) in specs {
            let source = kernel.specialize(&expr);
            assert!(
                !source.contains("OP;"),
                "{kernel:?} {expr}: OP not replaced"
            );
            let module = naga::front::wgsl::parse_str(&source).unwrap_or_else(|e| {
                panic!("{kernel:?} with {expr}: {}", e.emit_to_string(&source))
            });
            naga::valid::Validator::new(
                naga::valid::ValidationFlags::all(),
                naga::valid::Capabilities::all(),
            )
            .validate(&module)
            .unwrap_or_else(|e| panic!("{kernel:?} with {expr}: {e:?}"));
        }
    }

    #[test]
    fn broadcast_info_zeroes_broadcast_strides() {
        let info = broadcast_info(
            &Shape::from([3, 1]),
            &Shape::from([4]),
            &Shape::from([3, 4]),
        );
        // n, rank, dims [3, 4], a strides [1, 0], b strides [0, 1]
        assert_eq!(info, vec![12, 2, 3, 4, 1, 0, 0, 1]);
    }
}
