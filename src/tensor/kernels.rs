//! CPU kernels on contiguous row-major `f32` buffers.
//!
//! Every function here is a pure transformation of slices; shapes are
//! passed alongside as dimension lists. Callers validate shapes and buffer
//! lengths beforehand, so the kernels only `debug_assert!` them.
//!
//! NaN handling follows numpy: `Maximum`/`Minimum` and the `Max`/`Min`
//! reductions propagate NaN, and `Argmax` reports the first NaN if any.

use faer::linalg::matmul::matmul as faer_matmul;
use faer::{Accum, MatMut, MatRef, Par};
use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal, Uniform};
use smallvec::SmallVec;

type Dims = SmallVec<[usize; 4]>;

/// Element-wise binary operations.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum BinaryOp {
    /// `a + b`
    Add,
    /// `a - b`
    Sub,
    /// `a * b`
    Mul,
    /// `a / b`
    Div,
    /// Larger of the two; NaN if either is NaN.
    Maximum,
    /// Smaller of the two; NaN if either is NaN.
    Minimum,
    /// `a` raised to the power `b`.
    Pow,
    /// 1.0 if `a == b`, else 0.0.
    Eq,
    /// 1.0 if `a != b`, else 0.0.
    Ne,
    /// 1.0 if `a < b`, else 0.0.
    Lt,
    /// 1.0 if `a <= b`, else 0.0.
    Le,
    /// 1.0 if `a > b`, else 0.0.
    Gt,
    /// 1.0 if `a >= b`, else 0.0.
    Ge,
}

#[inline]
fn flag(b: bool) -> f32 {
    if b {
        1.0
    } else {
        0.0
    }
}

impl BinaryOp {
    /// Applies the operation to one pair of values.
    #[inline]
    pub(crate) fn apply(self, a: f32, b: f32) -> f32 {
        match self {
            BinaryOp::Add => a + b,
            BinaryOp::Sub => a - b,
            BinaryOp::Mul => a * b,
            BinaryOp::Div => a / b,
            // `f32::max` drops NaN; numpy's `maximum` keeps it. Written as
            // selects so loops over it still vectorize.
            BinaryOp::Maximum => {
                if a >= b || a.is_nan() {
                    a
                } else {
                    b
                }
            }
            BinaryOp::Minimum => {
                if a <= b || a.is_nan() {
                    a
                } else {
                    b
                }
            }
            BinaryOp::Pow => a.powf(b),
            BinaryOp::Eq => flag(a == b),
            BinaryOp::Ne => flag(a != b),
            BinaryOp::Lt => flag(a < b),
            BinaryOp::Le => flag(a <= b),
            BinaryOp::Gt => flag(a > b),
            BinaryOp::Ge => flag(a >= b),
        }
    }

    /// Lower-case name, e.g. `"add"`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Maximum => "maximum",
            BinaryOp::Minimum => "minimum",
            BinaryOp::Pow => "pow",
            BinaryOp::Eq => "eq",
            BinaryOp::Ne => "ne",
            BinaryOp::Lt => "lt",
            BinaryOp::Le => "le",
            BinaryOp::Gt => "gt",
            BinaryOp::Ge => "ge",
        }
    }
}

/// Element-wise unary operations.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum UnaryOp {
    /// `-x`
    Neg,
    /// `e^x`
    Exp,
    /// Natural logarithm.
    Log,
    /// Square root.
    Sqrt,
    /// Absolute value.
    Abs,
    /// `max(x, 0)`; NaN stays NaN.
    Relu,
    /// `1 / (1 + e^-x)`, computed without overflow for any `x`.
    Sigmoid,
    /// Hyperbolic tangent.
    Tanh,
}

impl UnaryOp {
    /// Applies the operation to one value.
    #[inline]
    pub(crate) fn apply(self, x: f32) -> f32 {
        match self {
            UnaryOp::Neg => -x,
            UnaryOp::Exp => x.exp(),
            UnaryOp::Log => x.ln(),
            UnaryOp::Sqrt => x.sqrt(),
            UnaryOp::Abs => x.abs(),
            UnaryOp::Relu => {
                if x < 0.0 {
                    0.0
                } else {
                    x
                }
            }
            UnaryOp::Sigmoid => {
                // Only ever exponentiate a non-positive number so that
                // e^|x| never overflows to inf (inf/inf would give NaN).
                if x >= 0.0 {
                    1.0 / (1.0 + (-x).exp())
                } else {
                    let e = x.exp();
                    e / (1.0 + e)
                }
            }
            UnaryOp::Tanh => x.tanh(),
        }
    }

    /// Lower-case name, e.g. `"exp"`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Abs => "abs",
            UnaryOp::Relu => "relu",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Tanh => "tanh",
        }
    }
}

/// Reductions over all elements or along one axis.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum ReduceOp {
    /// Sum (0 for no elements).
    Sum,
    /// Arithmetic mean (NaN for no elements).
    Mean,
    /// Largest element; NaN if any element is NaN.
    Max,
    /// Smallest element; NaN if any element is NaN.
    Min,
    /// Index of the first largest element as `f32` (exact up to 2^24); the
    /// index of the first NaN if there is one.
    Argmax,
}

impl ReduceOp {
    /// Lower-case name, e.g. `"sum"`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Argmax => "argmax",
        }
    }
}

/// Expands `$body` once per operation with `$f` bound to a closure for that
/// operation, so each inner loop is compiled for a single known operation
/// instead of branching on `op` per element.
macro_rules! with_binary_fn {
    ($op:expr, $f:ident => $body:expr) => {
        match $op {
            BinaryOp::Add => with_binary_fn!(@arm BinaryOp::Add, $f, $body),
            BinaryOp::Sub => with_binary_fn!(@arm BinaryOp::Sub, $f, $body),
            BinaryOp::Mul => with_binary_fn!(@arm BinaryOp::Mul, $f, $body),
            BinaryOp::Div => with_binary_fn!(@arm BinaryOp::Div, $f, $body),
            BinaryOp::Maximum => with_binary_fn!(@arm BinaryOp::Maximum, $f, $body),
            BinaryOp::Minimum => with_binary_fn!(@arm BinaryOp::Minimum, $f, $body),
            BinaryOp::Pow => with_binary_fn!(@arm BinaryOp::Pow, $f, $body),
            BinaryOp::Eq => with_binary_fn!(@arm BinaryOp::Eq, $f, $body),
            BinaryOp::Ne => with_binary_fn!(@arm BinaryOp::Ne, $f, $body),
            BinaryOp::Lt => with_binary_fn!(@arm BinaryOp::Lt, $f, $body),
            BinaryOp::Le => with_binary_fn!(@arm BinaryOp::Le, $f, $body),
            BinaryOp::Gt => with_binary_fn!(@arm BinaryOp::Gt, $f, $body),
            BinaryOp::Ge => with_binary_fn!(@arm BinaryOp::Ge, $f, $body),
        }
    };
    (@arm $variant:expr, $f:ident, $body:expr) => {{
        let $f = |x: f32, y: f32| $variant.apply(x, y);
        $body
    }};
}

/// Unary counterpart of [`with_binary_fn`].
macro_rules! with_unary_fn {
    ($op:expr, $f:ident => $body:expr) => {
        match $op {
            UnaryOp::Neg => with_unary_fn!(@arm UnaryOp::Neg, $f, $body),
            UnaryOp::Exp => with_unary_fn!(@arm UnaryOp::Exp, $f, $body),
            UnaryOp::Log => with_unary_fn!(@arm UnaryOp::Log, $f, $body),
            UnaryOp::Sqrt => with_unary_fn!(@arm UnaryOp::Sqrt, $f, $body),
            UnaryOp::Abs => with_unary_fn!(@arm UnaryOp::Abs, $f, $body),
            UnaryOp::Relu => with_unary_fn!(@arm UnaryOp::Relu, $f, $body),
            UnaryOp::Sigmoid => with_unary_fn!(@arm UnaryOp::Sigmoid, $f, $body),
            UnaryOp::Tanh => with_unary_fn!(@arm UnaryOp::Tanh, $f, $body),
        }
    };
    (@arm $variant:expr, $f:ident, $body:expr) => {{
        let $f = |x: f32| $variant.apply(x);
        $body
    }};
}

// ---------------------------------------------------------------------------
// Strided iteration helpers
// ---------------------------------------------------------------------------

/// Strides (in elements) with which a contiguous tensor of `shape` is read
/// when broadcast to `out_shape`: right-aligned, 0 on broadcast dimensions.
fn broadcast_strides(shape: &[usize], out_shape: &[usize]) -> Dims {
    debug_assert!(shape.len() <= out_shape.len());
    let offset = out_shape.len() - shape.len();
    let mut strides: Dims = SmallVec::from_elem(0, out_shape.len());
    let mut acc = 1usize;
    for i in (0..shape.len()).rev() {
        let d = shape[i];
        debug_assert!(d == out_shape[offset + i] || d == 1);
        if d != 1 {
            strides[offset + i] = acc;
        }
        acc *= d;
    }
    strides
}

/// An iteration space over a contiguous output with `K` strided inputs,
/// simplified so that the innermost run is as long as possible.
struct Layout<const K: usize> {
    dims: Dims,
    strides: [Dims; K],
}

/// Drops size-1 dimensions and merges neighbours that every input walks
/// through as one flat range, e.g. broadcasting `[4, 1, 5] -> [4, 3, 5]`
/// becomes runs of 5 over `[12, 5]` instead of `[4, 3, 5]`. The output is
/// contiguous, so it never prevents a merge. Always yields rank >= 1.
fn coalesce<const K: usize>(dims: &[usize], strides: [&[usize]; K]) -> Layout<K> {
    let mut out_dims = Dims::new();
    let mut out_strides: [Dims; K] = std::array::from_fn(|_| Dims::new());
    for i in (0..dims.len()).rev() {
        let d = dims[i];
        if d == 1 {
            continue;
        }
        if let Some(last) = out_dims.last_mut() {
            let inner = *last;
            let mergeable =
                (0..K).all(|k| strides[k][i] == out_strides[k][out_strides[k].len() - 1] * inner);
            if mergeable {
                *last *= d;
                continue;
            }
        }
        out_dims.push(d);
        for k in 0..K {
            out_strides[k].push(strides[k][i]);
        }
    }
    if out_dims.is_empty() {
        out_dims.push(1);
        for s in out_strides.iter_mut() {
            s.push(0);
        }
    }
    out_dims.reverse();
    for s in out_strides.iter_mut() {
        s.reverse();
    }
    Layout {
        dims: out_dims,
        strides: out_strides,
    }
}

/// Walks `out` in order, one innermost run at a time, calling
/// `run(chunk, input_offsets)`. Offsets are kept up to date with an odometer
/// so no per-element index arithmetic is needed. `out` must be non-empty and
/// have `layout.dims` elements.
fn for_each_run<const K: usize>(
    layout: &Layout<K>,
    out: &mut [f32],
    mut run: impl FnMut(&mut [f32], [usize; K]),
) {
    let rank = layout.dims.len();
    let inner = layout.dims[rank - 1];
    let outer = &layout.dims[..rank - 1];
    let mut idx: Dims = SmallVec::from_elem(0, outer.len());
    let mut offs = [0usize; K];
    for chunk in out.chunks_exact_mut(inner) {
        run(chunk, offs);
        for d in (0..outer.len()).rev() {
            idx[d] += 1;
            for (off, s) in offs.iter_mut().zip(layout.strides.iter()) {
                *off += s[d];
            }
            if idx[d] < outer[d] {
                break;
            }
            idx[d] = 0;
            for (off, s) in offs.iter_mut().zip(layout.strides.iter()) {
                *off -= s[d] * outer[d];
            }
        }
    }
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

// ---------------------------------------------------------------------------
// Element-wise
// ---------------------------------------------------------------------------

#[inline]
fn zip_into(f: impl Fn(f32, f32) -> f32, a: &[f32], b: &[f32], out: &mut [f32]) {
    let n = out.len();
    let (a, b) = (&a[..n], &b[..n]);
    for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
        *o = f(x, y);
    }
}

#[inline]
fn map_right_scalar(f: impl Fn(f32, f32) -> f32, a: &[f32], s: f32, out: &mut [f32]) {
    let n = out.len();
    for (o, &x) in out.iter_mut().zip(&a[..n]) {
        *o = f(x, s);
    }
}

#[inline]
fn map_left_scalar(f: impl Fn(f32, f32) -> f32, s: f32, b: &[f32], out: &mut [f32]) {
    let n = out.len();
    for (o, &y) in out.iter_mut().zip(&b[..n]) {
        *o = f(s, y);
    }
}

/// `out = op(a, b)` with numpy broadcasting; `out_shape` must be the
/// broadcast of `a_shape` and `b_shape`.
pub(crate) fn binary(
    op: BinaryOp,
    a: &[f32],
    a_shape: &[usize],
    b: &[f32],
    b_shape: &[usize],
    out_shape: &[usize],
    out: &mut [f32],
) {
    debug_assert_eq!(a.len(), numel(a_shape));
    debug_assert_eq!(b.len(), numel(b_shape));
    debug_assert_eq!(out.len(), numel(out_shape));
    if out.is_empty() {
        return;
    }
    // With a non-empty output, an operand holding as many elements as the
    // output can only differ from it by size-1 dims, so it is laid out
    // identically.
    if a.len() == out.len() && b.len() == out.len() {
        with_binary_fn!(op, f => zip_into(f, a, b, out));
        return;
    }
    if b.len() == 1 && a.len() == out.len() {
        binary_scalar(op, a, b[0], out);
        return;
    }
    if a.len() == 1 && b.len() == out.len() {
        scalar_binary(op, a[0], b, out);
        return;
    }
    let sa = broadcast_strides(a_shape, out_shape);
    let sb = broadcast_strides(b_shape, out_shape);
    let layout = coalesce(out_shape, [&sa, &sb]);
    let rank = layout.dims.len();
    let (ia, ib) = (layout.strides[0][rank - 1], layout.strides[1][rank - 1]);
    with_binary_fn!(op, f => for_each_run(&layout, out, |chunk, [oa, ob]| {
        match (ia, ib) {
            (0, 0) => chunk.fill(f(a[oa], b[ob])),
            (0, _) => map_left_scalar(f, a[oa], &b[ob..], chunk),
            (_, 0) => map_right_scalar(f, &a[oa..], b[ob], chunk),
            _ => zip_into(f, &a[oa..], &b[ob..], chunk),
        }
    }));
}

/// `out[i] = op(a[i], s)`.
pub(crate) fn binary_scalar(op: BinaryOp, a: &[f32], s: f32, out: &mut [f32]) {
    debug_assert_eq!(a.len(), out.len());
    with_binary_fn!(op, f => map_right_scalar(f, a, s, out));
}

/// `out[i] = op(s, a[i])`, the scalar on the left (e.g. `s - a[i]`).
pub(crate) fn scalar_binary(op: BinaryOp, s: f32, a: &[f32], out: &mut [f32]) {
    debug_assert_eq!(a.len(), out.len());
    with_binary_fn!(op, f => map_left_scalar(f, s, a, out));
}

/// `a = op(a, b)` where `b` broadcasts to `a_shape`.
pub(crate) fn binary_inplace(
    op: BinaryOp,
    a: &mut [f32],
    a_shape: &[usize],
    b: &[f32],
    b_shape: &[usize],
) {
    debug_assert_eq!(a.len(), numel(a_shape));
    debug_assert_eq!(b.len(), numel(b_shape));
    if a.is_empty() {
        return;
    }
    if b.len() == 1 {
        binary_scalar_inplace(op, a, b[0]);
        return;
    }
    let sb = broadcast_strides(b_shape, a_shape);
    let layout = coalesce(a_shape, [&sb]);
    let ib = layout.strides[0][layout.dims.len() - 1];
    with_binary_fn!(op, f => for_each_run(&layout, a, |chunk, [ob]| {
        if ib == 0 {
            let y = b[ob];
            for x in chunk.iter_mut() {
                *x = f(*x, y);
            }
        } else {
            let n = chunk.len();
            for (x, &y) in chunk.iter_mut().zip(&b[ob..ob + n]) {
                *x = f(*x, y);
            }
        }
    }));
}

/// `a[i] = op(a[i], s)`.
pub(crate) fn binary_scalar_inplace(op: BinaryOp, a: &mut [f32], s: f32) {
    with_binary_fn!(op, f => {
        for x in a.iter_mut() {
            *x = f(*x, s);
        }
    });
}

/// `out[i] = op(a[i])`.
pub(crate) fn unary(op: UnaryOp, a: &[f32], out: &mut [f32]) {
    debug_assert_eq!(a.len(), out.len());
    let n = out.len();
    with_unary_fn!(op, f => {
        for (o, &x) in out.iter_mut().zip(&a[..n]) {
            *o = f(x);
        }
    });
}

/// `a[i] = op(a[i])`.
pub(crate) fn unary_inplace(op: UnaryOp, a: &mut [f32]) {
    with_unary_fn!(op, f => {
        for x in a.iter_mut() {
            *x = f(*x);
        }
    });
}

// ---------------------------------------------------------------------------
// Reductions
// ---------------------------------------------------------------------------

/// Below this length a block is summed directly with independent lane
/// accumulators; above it the slice is halved recursively, so rounding
/// error grows with log(n) rather than n.
const PAIRWISE_BLOCK: usize = 256;

fn pairwise_sum(a: &[f32]) -> f32 {
    if a.len() <= PAIRWISE_BLOCK {
        // Eight independent accumulators break the add dependency chain so
        // the loop vectorizes; float addition is not reassociated otherwise.
        let mut acc = [0.0f32; 8];
        let chunks = a.chunks_exact(8);
        let tail = chunks.remainder();
        for c in chunks {
            for (s, &x) in acc.iter_mut().zip(c) {
                *s += x;
            }
        }
        let mut total =
            ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        for &x in tail {
            total += x;
        }
        total
    } else {
        let mid = a.len() / 2;
        pairwise_sum(&a[..mid]) + pairwise_sum(&a[mid..])
    }
}

/// Reduces the whole slice.
///
/// For an empty slice: `Sum` gives 0, while `Mean`, `Max`, `Min` and
/// `Argmax` give NaN (callers are expected to reject empty inputs to
/// those).
pub(crate) fn reduce_all(op: ReduceOp, a: &[f32]) -> f32 {
    match op {
        ReduceOp::Sum => pairwise_sum(a),
        ReduceOp::Mean => {
            if a.is_empty() {
                f32::NAN
            } else {
                pairwise_sum(a) / a.len() as f32
            }
        }
        ReduceOp::Max => fold_nonempty(a, BinaryOp::Maximum),
        ReduceOp::Min => fold_nonempty(a, BinaryOp::Minimum),
        ReduceOp::Argmax => match argmax(a) {
            Some(i) => i as f32,
            None => f32::NAN,
        },
    }
}

fn fold_nonempty(a: &[f32], op: BinaryOp) -> f32 {
    match a.split_first() {
        Some((&first, rest)) => with_binary_fn!(op, f => rest.iter().fold(first, |m, &x| f(m, x))),
        None => f32::NAN,
    }
}

/// Index of the first maximum, or of the first NaN if any.
fn argmax(a: &[f32]) -> Option<usize> {
    let (&first, _) = a.split_first()?;
    if first.is_nan() {
        return Some(0);
    }
    let mut best = first;
    let mut best_i = 0;
    for (i, &x) in a.iter().enumerate().skip(1) {
        if x.is_nan() {
            return Some(i);
        }
        if x > best {
            best = x;
            best_i = i;
        }
    }
    Some(best_i)
}

/// Reduces along `axis`: `out` has `shape` with that axis removed.
///
/// Reductions over the last axis reuse [`reduce_all`] per row (pairwise
/// sums). Otherwise rows along the axis are combined into `out` one at a
/// time, so the inner loop runs over contiguous memory; sums then
/// accumulate sequentially along the axis. An empty axis yields what
/// [`reduce_all`] yields for an empty slice.
pub(crate) fn reduce_axis(op: ReduceOp, a: &[f32], shape: &[usize], axis: usize, out: &mut [f32]) {
    debug_assert!(axis < shape.len());
    debug_assert_eq!(a.len(), numel(shape));
    let outer = numel(&shape[..axis]);
    let len = shape[axis];
    let inner = numel(&shape[axis + 1..]);
    debug_assert_eq!(out.len(), outer * inner);
    if out.is_empty() {
        return;
    }
    if len == 0 {
        out.fill(reduce_all(op, &[]));
        return;
    }
    if inner == 1 {
        for (o, row) in out.iter_mut().zip(a.chunks_exact(len)) {
            *o = reduce_all(op, row);
        }
        return;
    }
    let block = len * inner;
    match op {
        ReduceOp::Sum | ReduceOp::Mean => {
            for (dst, src) in out.chunks_exact_mut(inner).zip(a.chunks_exact(block)) {
                dst.copy_from_slice(&src[..inner]);
                for row in src.chunks_exact(inner).skip(1) {
                    for (d, &x) in dst.iter_mut().zip(row) {
                        *d += x;
                    }
                }
                if op == ReduceOp::Mean {
                    let n = len as f32;
                    for d in dst.iter_mut() {
                        *d /= n;
                    }
                }
            }
        }
        ReduceOp::Max | ReduceOp::Min => {
            let bop = if op == ReduceOp::Max {
                BinaryOp::Maximum
            } else {
                BinaryOp::Minimum
            };
            for (dst, src) in out.chunks_exact_mut(inner).zip(a.chunks_exact(block)) {
                dst.copy_from_slice(&src[..inner]);
                for row in src.chunks_exact(inner).skip(1) {
                    binary_inplace_flat(bop, dst, row);
                }
            }
        }
        ReduceOp::Argmax => {
            let mut best = vec![0.0f32; inner];
            for (dst, src) in out.chunks_exact_mut(inner).zip(a.chunks_exact(block)) {
                best.copy_from_slice(&src[..inner]);
                dst.fill(0.0);
                for (r, row) in src.chunks_exact(inner).enumerate().skip(1) {
                    let r = r as f32;
                    for ((d, b), &x) in dst.iter_mut().zip(best.iter_mut()).zip(row) {
                        // Once a lane has seen NaN it stays on that index.
                        if !b.is_nan() && (x > *b || x.is_nan()) {
                            *b = x;
                            *d = r;
                        }
                    }
                }
            }
        }
    }
}

fn binary_inplace_flat(op: BinaryOp, a: &mut [f32], b: &[f32]) {
    with_binary_fn!(op, f => {
        for (x, &y) in a.iter_mut().zip(b) {
            *x = f(*x, y);
        }
    });
}

// ---------------------------------------------------------------------------
// Matrix multiplication
// ---------------------------------------------------------------------------

/// Products with at least this many multiply-adds (`m * k * n`, per batch
/// entry) use faer's rayon parallelism; below it, thread start-up and
/// synchronisation cost more than they save.
const MATMUL_PAR_THRESHOLD: usize = 64 * 64 * 64;

/// Batched row-major matrix product `out[i] = a[i] @ b[i or 0]`.
///
/// `a` is `batch × m × k`; `b` is `batch × k × n` when `b_batched`, else a
/// single `k × n` matrix shared by every batch entry; `out` is
/// `batch × m × n` and is overwritten. Large products run on rayon's global
/// pool via faer, split `threads` ways.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    a: &[f32],
    b: &[f32],
    out: &mut [f32],
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
    b_batched: bool,
    threads: usize,
) {
    debug_assert_eq!(a.len(), batch * m * k);
    debug_assert_eq!(b.len(), if b_batched { batch } else { 1 } * k * n);
    debug_assert_eq!(out.len(), batch * m * n);
    if out.is_empty() {
        return;
    }
    if k == 0 {
        out.fill(0.0);
        return;
    }
    if !b_batched {
        // A shared right operand lets the batch fold into the rows: one
        // (batch*m) × k by k × n product, which faer blocks better.
        matmul_2d(a, b, out, batch * m, k, n, threads);
        return;
    }
    for ((ai, bi), oi) in a
        .chunks_exact(m * k)
        .zip(b.chunks_exact(k * n))
        .zip(out.chunks_exact_mut(m * n))
    {
        matmul_2d(ai, bi, oi, m, k, n, threads);
    }
}

fn matmul_2d(a: &[f32], b: &[f32], out: &mut [f32], m: usize, k: usize, n: usize, threads: usize) {
    let par = if threads > 1 && m.saturating_mul(k).saturating_mul(n) >= MATMUL_PAR_THRESHOLD {
        Par::rayon(threads)
    } else {
        Par::Seq
    };
    let lhs = MatRef::from_row_major_slice(a, m, k);
    let rhs = MatRef::from_row_major_slice(b, k, n);
    let dst = MatMut::from_row_major_slice_mut(out, m, n);
    faer_matmul(dst, Accum::Replace, lhs, rhs, 1.0f32, par);
}

// ---------------------------------------------------------------------------
// Layout changes
// ---------------------------------------------------------------------------

/// Side of the square tiles used when transposing, chosen so a source and a
/// destination tile (2 × 4 KiB) stay in L1.
const TILE: usize = 32;

/// Writes `a` with axes `dim0` and `dim1` swapped, contiguously, into `out`.
pub(crate) fn transpose(a: &[f32], shape: &[usize], dim0: usize, dim1: usize, out: &mut [f32]) {
    debug_assert!(dim0 < shape.len() && dim1 < shape.len());
    debug_assert_eq!(a.len(), numel(shape));
    debug_assert_eq!(out.len(), a.len());
    if out.is_empty() {
        return;
    }
    let (d0, d1) = (dim0.min(dim1), dim0.max(dim1));
    if d0 == d1 {
        out.copy_from_slice(a);
        return;
    }
    // View the input as [outer, rows, mid, cols, inner] and produce
    // [outer, cols, mid, rows, inner].
    let rows = shape[d0];
    let mid = numel(&shape[d0 + 1..d1]);
    let cols = shape[d1];
    let inner = numel(&shape[d1 + 1..]);
    let in_block = rows * mid * cols * inner;
    if inner == 1 {
        // For each (outer, mid) pair this is a plain rows × cols matrix
        // transpose with row strides mid*cols (source) and mid*rows
        // (destination).
        for (src, dst) in a.chunks_exact(in_block).zip(out.chunks_exact_mut(in_block)) {
            for j in 0..mid {
                transpose_tiled(
                    &src[j * cols..],
                    mid * cols,
                    &mut dst[j * rows..],
                    mid * rows,
                    rows,
                    cols,
                );
            }
        }
    } else {
        // Each output run of `inner` elements is contiguous in the input
        // too, so copy whole runs.
        let in_row = mid * cols * inner;
        for (src, dst) in a.chunks_exact(in_block).zip(out.chunks_exact_mut(in_block)) {
            let mut runs = dst.chunks_exact_mut(inner);
            for c in 0..cols {
                for j in 0..mid {
                    let mut off = (j * cols + c) * inner;
                    for _ in 0..rows {
                        let run = runs.next().expect("output block sized to the input block");
                        run.copy_from_slice(&src[off..off + inner]);
                        off += in_row;
                    }
                }
            }
        }
    }
}

/// `dst[c * dst_stride + r] = src[r * src_stride + c]` for a `rows × cols`
/// source, visited in `TILE × TILE` blocks so both sides stay cache-resident.
fn transpose_tiled(
    src: &[f32],
    src_stride: usize,
    dst: &mut [f32],
    dst_stride: usize,
    rows: usize,
    cols: usize,
) {
    for r0 in (0..rows).step_by(TILE) {
        let r1 = (r0 + TILE).min(rows);
        for c0 in (0..cols).step_by(TILE) {
            let c1 = (c0 + TILE).min(cols);
            for r in r0..r1 {
                let row = &src[r * src_stride + c0..r * src_stride + c1];
                for (c, &v) in (c0..c1).zip(row) {
                    dst[c * dst_stride + r] = v;
                }
            }
        }
    }
}

/// Copies `len` entries starting at `start` along `axis` into `out`.
pub(crate) fn narrow(
    a: &[f32],
    shape: &[usize],
    axis: usize,
    start: usize,
    len: usize,
    out: &mut [f32],
) {
    debug_assert!(axis < shape.len());
    debug_assert!(start + len <= shape[axis]);
    debug_assert_eq!(a.len(), numel(shape));
    let inner = numel(&shape[axis + 1..]);
    let run = len * inner;
    let src_block = shape[axis] * inner;
    debug_assert_eq!(out.len(), numel(&shape[..axis]) * run);
    if run == 0 {
        return;
    }
    let first = start * inner;
    for (dst, src) in out.chunks_exact_mut(run).zip(a.chunks_exact(src_block)) {
        dst.copy_from_slice(&src[first..first + run]);
    }
}

/// Joins `inputs` (data, shape) along `axis` into `out`. All shapes must
/// agree except along `axis`.
pub(crate) fn concat(inputs: &[(&[f32], &[usize])], axis: usize, out: &mut [f32]) {
    let Some(&(_, first_shape)) = inputs.first() else {
        debug_assert!(out.is_empty());
        return;
    };
    debug_assert!(axis < first_shape.len());
    let outer = numel(&first_shape[..axis]);
    let inner = numel(&first_shape[axis + 1..]);
    debug_assert_eq!(
        out.len(),
        inputs.iter().map(|(d, _)| d.len()).sum::<usize>()
    );
    let mut pos = 0;
    for o in 0..outer {
        for &(data, shape) in inputs {
            debug_assert_eq!(data.len(), numel(shape));
            let run = shape[axis] * inner;
            out[pos..pos + run].copy_from_slice(&data[o * run..(o + 1) * run]);
            pos += run;
        }
    }
}

/// Materializes `a` broadcast (numpy rules) to `out_shape`.
pub(crate) fn broadcast_to(a: &[f32], a_shape: &[usize], out_shape: &[usize], out: &mut [f32]) {
    debug_assert_eq!(a.len(), numel(a_shape));
    debug_assert_eq!(out.len(), numel(out_shape));
    if out.is_empty() {
        return;
    }
    if a.len() == out.len() {
        out.copy_from_slice(a);
        return;
    }
    let sa = broadcast_strides(a_shape, out_shape);
    let layout = coalesce(out_shape, [&sa]);
    let ia = layout.strides[0][layout.dims.len() - 1];
    for_each_run(&layout, out, |chunk, [oa]| {
        if ia == 0 {
            chunk.fill(a[oa]);
        } else {
            chunk.copy_from_slice(&a[oa..oa + chunk.len()]);
        }
    });
}

// ---------------------------------------------------------------------------
// Random fills
// ---------------------------------------------------------------------------

/// Fills `out` with samples from `[low, high)`, deterministically for
/// `seed`. `low == high` fills with `low`.
///
/// # Panics
/// If `low > high` or either bound is not finite.
pub(crate) fn fill_uniform(out: &mut [f32], low: f32, high: f32, seed: u64) {
    if low == high {
        out.fill(low);
        return;
    }
    let dist = Uniform::new(low, high).expect("fill_uniform needs finite low < high");
    let mut rng = StdRng::seed_from_u64(seed);
    for x in out.iter_mut() {
        *x = dist.sample(&mut rng);
    }
}

/// Fills `out` with samples from a normal distribution, deterministically
/// for `seed`.
///
/// # Panics
/// If `std` is not finite.
pub(crate) fn fill_normal(out: &mut [f32], mean: f32, std: f32, seed: u64) {
    let dist = Normal::new(mean, std).expect("fill_normal needs a finite std");
    let mut rng = StdRng::seed_from_u64(seed);
    for x in out.iter_mut() {
        *x = dist.sample(&mut rng);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BIN_OPS: [BinaryOp; 13] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Maximum,
        BinaryOp::Minimum,
        BinaryOp::Pow,
        BinaryOp::Eq,
        BinaryOp::Ne,
        BinaryOp::Lt,
        BinaryOp::Le,
        BinaryOp::Gt,
        BinaryOp::Ge,
    ];
    const UN_OPS: [UnaryOp; 8] = [
        UnaryOp::Neg,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Abs,
        UnaryOp::Relu,
        UnaryOp::Sigmoid,
        UnaryOp::Tanh,
    ];
    const RED_OPS: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Mean,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Argmax,
    ];

    /// Deterministic pseudo-random values in [-3, 3), quantized to
    /// quarters so that ties and equal values occur.
    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) % 24) as f32 / 4.0 - 3.0
            })
            .collect()
    }

    fn numel(shape: &[usize]) -> usize {
        shape.iter().product()
    }

    fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
        let mut idx = vec![0; shape.len()];
        for d in (0..shape.len()).rev() {
            idx[d] = i % shape[d];
            i /= shape[d];
        }
        idx
    }

    fn ravel(idx: &[usize], shape: &[usize]) -> usize {
        idx.iter().zip(shape).fold(0, |acc, (&i, &d)| acc * d + i)
    }

    /// Flat index into `shape` of the element that broadcasts to `out_idx`.
    fn bcast_src(out_idx: &[usize], shape: &[usize]) -> usize {
        let off = out_idx.len() - shape.len();
        let idx: Vec<usize> = shape
            .iter()
            .enumerate()
            .map(|(i, &d)| if d == 1 { 0 } else { out_idx[off + i] })
            .collect();
        ravel(&idx, shape)
    }

    fn bcast_shape(a: &[usize], b: &[usize]) -> Vec<usize> {
        let r = a.len().max(b.len());
        (0..r)
            .map(|i| {
                let da = if i + a.len() >= r {
                    a[i + a.len() - r]
                } else {
                    1
                };
                let db = if i + b.len() >= r {
                    b[i + b.len() - r]
                } else {
                    1
                };
                if da == 1 {
                    db
                } else {
                    da
                }
            })
            .collect()
    }

    fn same(x: f32, y: f32) -> bool {
        x == y || (x.is_nan() && y.is_nan())
    }

    fn assert_same(got: &[f32], want: &[f32], ctx: &str) {
        assert_eq!(got.len(), want.len(), "{ctx}: length");
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(same(g, w), "{ctx}: index {i}: got {g}, want {w}");
        }
    }

    fn assert_close(got: &[f32], want: &[f64], rel: f64, ctx: &str) {
        assert_eq!(got.len(), want.len(), "{ctx}: length");
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            let tol = rel * w.abs().max(1.0);
            assert!(
                (g as f64 - w).abs() <= tol,
                "{ctx}: index {i}: got {g}, want {w}"
            );
        }
    }

    const BCAST_CASES: &[(&[usize], &[usize])] = &[
        (&[], &[]),
        (&[], &[3]),
        (&[3], &[]),
        (&[1], &[2, 3]),
        (&[2, 3], &[2, 3]),
        (&[2, 3], &[3]),
        (&[3], &[2, 3]),
        (&[2, 1], &[1, 3]),
        (&[1, 3], &[2, 1]),
        (&[4, 1, 5], &[3, 1]),
        (&[3, 1], &[4, 1, 5]),
        (&[2, 3, 4, 5], &[3, 1, 5]),
        (&[2, 1, 4, 1], &[1, 3, 1, 5]),
        (&[1, 7], &[7, 1]),
        (&[5, 1], &[1]),
        (&[0, 3], &[1, 3]),
        (&[2, 0], &[2, 1]),
        (&[1, 1, 7], &[7]),
        (&[3, 1, 1], &[1, 1, 1]),
        (&[2, 3, 1], &[2, 1, 4]),
        (&[2, 3, 4], &[2, 3, 1]),
        (&[2, 3, 4], &[1, 3, 4]),
        (&[3, 2, 1, 3], &[3, 1, 5, 3]),
    ];

    #[test]
    fn binary_matches_reference() {
        for (case, &(sa, sb)) in BCAST_CASES.iter().enumerate() {
            let so = bcast_shape(sa, sb);
            let a = data(numel(sa), case as u64);
            let b = data(numel(sb), case as u64 + 100);
            for op in BIN_OPS {
                let want: Vec<f32> = (0..numel(&so))
                    .map(|i| {
                        let idx = unravel(i, &so);
                        op.apply(a[bcast_src(&idx, sa)], b[bcast_src(&idx, sb)])
                    })
                    .collect();
                let mut got = vec![f32::NAN; want.len()];
                binary(op, &a, sa, &b, sb, &so, &mut got);
                assert_same(&got, &want, &format!("{} {sa:?} {sb:?}", op.name()));
            }
        }
    }

    #[test]
    fn binary_inplace_matches_reference() {
        for (case, &(sa, sb)) in BCAST_CASES.iter().enumerate() {
            if bcast_shape(sa, sb) != sa {
                continue;
            }
            let a0 = data(numel(sa), case as u64);
            let b = data(numel(sb), case as u64 + 7);
            for op in BIN_OPS {
                let want: Vec<f32> = (0..a0.len())
                    .map(|i| op.apply(a0[i], b[bcast_src(&unravel(i, sa), sb)]))
                    .collect();
                let mut a = a0.clone();
                binary_inplace(op, &mut a, sa, &b, sb);
                assert_same(&a, &want, &format!("{} {sa:?} {sb:?}", op.name()));
            }
        }
    }

    #[test]
    fn scalar_variants() {
        let a = data(37, 3);
        for op in BIN_OPS {
            for s in [-2.0f32, 0.0, 0.5, 3.0] {
                let right: Vec<f32> = a.iter().map(|&x| op.apply(x, s)).collect();
                let left: Vec<f32> = a.iter().map(|&x| op.apply(s, x)).collect();
                let mut out = vec![0.0; a.len()];
                binary_scalar(op, &a, s, &mut out);
                assert_same(&out, &right, op.name());
                scalar_binary(op, s, &a, &mut out);
                assert_same(&out, &left, op.name());
                let mut inplace = a.clone();
                binary_scalar_inplace(op, &mut inplace, s);
                assert_same(&inplace, &right, op.name());
            }
        }
        let mut out = [0.0; 3];
        scalar_binary(BinaryOp::Sub, 10.0, &[1.0, 2.0, 3.0], &mut out);
        assert_eq!(out, [9.0, 8.0, 7.0]);
    }

    #[test]
    fn binary_hand_values() {
        use BinaryOp::*;
        assert_eq!(Add.apply(2.0, 3.0), 5.0);
        assert_eq!(Sub.apply(2.0, 3.0), -1.0);
        assert_eq!(Div.apply(3.0, 2.0), 1.5);
        assert_eq!(Pow.apply(2.0, 10.0), 1024.0);
        assert_eq!(Maximum.apply(-1.0, 2.0), 2.0);
        assert_eq!(Minimum.apply(-1.0, 2.0), -1.0);
        assert!(Maximum.apply(f32::NAN, 2.0).is_nan());
        assert!(Maximum.apply(2.0, f32::NAN).is_nan());
        assert!(Minimum.apply(f32::NAN, 2.0).is_nan());
        assert!(Minimum.apply(2.0, f32::NAN).is_nan());
        assert_eq!(Eq.apply(1.0, 1.0), 1.0);
        assert_eq!(Eq.apply(f32::NAN, f32::NAN), 0.0);
        assert_eq!(Ne.apply(f32::NAN, f32::NAN), 1.0);
        assert_eq!(Lt.apply(1.0, 2.0), 1.0);
        assert_eq!(Le.apply(2.0, 2.0), 1.0);
        assert_eq!(Gt.apply(1.0, 2.0), 0.0);
        assert_eq!(Ge.apply(2.0, 2.0), 1.0);
        assert_eq!(Lt.name(), "lt");
        assert_eq!(Maximum.name(), "maximum");
        assert_eq!(UnaryOp::Sigmoid.name(), "sigmoid");
        assert_eq!(ReduceOp::Argmax.name(), "argmax");
    }

    #[test]
    fn unary_matches_reference_and_hand_values() {
        let a = data(41, 9);
        for op in UN_OPS {
            let want: Vec<f32> = a.iter().map(|&x| op.apply(x)).collect();
            let mut out = vec![0.0; a.len()];
            unary(op, &a, &mut out);
            assert_same(&out, &want, op.name());
            let mut inplace = a.clone();
            unary_inplace(op, &mut inplace);
            assert_same(&inplace, &want, op.name());
        }
        use UnaryOp::*;
        assert_eq!(Sigmoid.apply(0.0), 0.5);
        assert_eq!(Sigmoid.apply(1000.0), 1.0);
        assert_eq!(Sigmoid.apply(-1000.0), 0.0);
        assert_eq!(Sigmoid.apply(f32::INFINITY), 1.0);
        assert_eq!(Sigmoid.apply(f32::NEG_INFINITY), 0.0);
        assert!((Sigmoid.apply(-100.0) - (-100.0f64).exp() as f32).abs() < 1e-45);
        assert!((Sigmoid.apply(2.0) - 0.880_797_1).abs() < 1e-6);
        assert!(Sigmoid.apply(f32::NAN).is_nan());
        assert_eq!(Relu.apply(-1.5), 0.0);
        assert_eq!(Relu.apply(2.5), 2.5);
        assert!(Relu.apply(f32::NAN).is_nan());
        assert_eq!(Neg.apply(2.0), -2.0);
        assert_eq!(Exp.apply(0.0), 1.0);
        assert_eq!(Log.apply(1.0), 0.0);
        assert_eq!(Sqrt.apply(9.0), 3.0);
        assert_eq!(Abs.apply(-4.0), 4.0);
        assert_eq!(Tanh.apply(0.0), 0.0);
    }

    fn reference_reduce(op: ReduceOp, a: &[f32]) -> f64 {
        match op {
            ReduceOp::Sum => a.iter().map(|&x| x as f64).sum(),
            ReduceOp::Mean => a.iter().map(|&x| x as f64).sum::<f64>() / a.len() as f64,
            ReduceOp::Max | ReduceOp::Min | ReduceOp::Argmax => {
                if a.is_empty() {
                    return f64::NAN;
                }
                if let Some(i) = a.iter().position(|x| x.is_nan()) {
                    return if op == ReduceOp::Argmax {
                        i as f64
                    } else {
                        f64::NAN
                    };
                }
                let mut best = 0;
                for i in 1..a.len() {
                    let better = match op {
                        ReduceOp::Min => a[i] < a[best],
                        _ => a[i] > a[best],
                    };
                    if better {
                        best = i;
                    }
                }
                if op == ReduceOp::Argmax {
                    best as f64
                } else {
                    a[best] as f64
                }
            }
        }
    }

    #[test]
    fn reduce_all_matches_reference() {
        for n in [1usize, 2, 7, 8, 9, 255, 256, 257, 1000, 4099] {
            let a = data(n, n as u64);
            for op in RED_OPS {
                let got = reduce_all(op, &a);
                let want = reference_reduce(op, &a);
                assert_close(&[got], &[want], 1e-5, &format!("{} n={n}", op.name()));
            }
        }
    }

    #[test]
    fn reduce_all_edge_cases() {
        assert_eq!(reduce_all(ReduceOp::Sum, &[]), 0.0);
        for op in [
            ReduceOp::Mean,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Argmax,
        ] {
            assert!(reduce_all(op, &[]).is_nan(), "{}", op.name());
        }
        let a = [1.0, 5.0, 2.0, 5.0, -7.0];
        assert_eq!(reduce_all(ReduceOp::Argmax, &a), 1.0);
        assert_eq!(reduce_all(ReduceOp::Max, &a), 5.0);
        assert_eq!(reduce_all(ReduceOp::Min, &a), -7.0);
        assert_eq!(reduce_all(ReduceOp::Sum, &a), 6.0);
        assert_eq!(reduce_all(ReduceOp::Mean, &a), 1.2);
        let with_nan = [1.0, f32::NAN, 9.0, f32::NAN];
        assert!(reduce_all(ReduceOp::Max, &with_nan).is_nan());
        assert!(reduce_all(ReduceOp::Min, &with_nan).is_nan());
        assert_eq!(reduce_all(ReduceOp::Argmax, &with_nan), 1.0);
        assert_eq!(reduce_all(ReduceOp::Argmax, &[f32::NAN, 1.0]), 0.0);
        assert_eq!(
            reduce_all(ReduceOp::Max, &[f32::NEG_INFINITY]),
            f32::NEG_INFINITY
        );
    }

    #[test]
    fn sum_is_accurate_on_a_million_elements() {
        // Sequential f32 accumulation of 0.1 drifts by about 1% over 1M
        // terms; pairwise summation stays within a few ulps.
        let a = vec![0.1f32; 1 << 20];
        let want = (1u64 << 20) as f64 * 0.1f32 as f64;
        let got = reduce_all(ReduceOp::Sum, &a) as f64;
        assert!((got - want).abs() / want < 1e-6, "got {got}, want {want}");
        let mean = reduce_all(ReduceOp::Mean, &a) as f64;
        assert!((mean - 0.1f32 as f64).abs() < 1e-7);
        let b = data(1_000_003, 42);
        let want: f64 = b.iter().map(|&x| x as f64).sum();
        let got = reduce_all(ReduceOp::Sum, &b) as f64;
        assert!((got - want).abs() < 1e-2, "got {got}, want {want}");
    }

    #[test]
    fn reduce_axis_matches_reference() {
        let shapes: &[&[usize]] = &[
            &[5],
            &[1],
            &[3, 4],
            &[4, 1],
            &[1, 6],
            &[2, 3, 5],
            &[3, 1, 7],
            &[2, 3, 4, 5],
            &[2, 0, 3],
            &[300, 3],
            &[3, 300],
        ];
        for (case, &shape) in shapes.iter().enumerate() {
            let mut a = data(numel(shape), case as u64 + 11);
            if case % 3 == 0 && a.len() > 4 {
                a[3] = f32::NAN;
            }
            for axis in 0..shape.len() {
                let out_shape: Vec<usize> = shape
                    .iter()
                    .enumerate()
                    .filter(|&(d, _)| d != axis)
                    .map(|(_, &n)| n)
                    .collect();
                for op in RED_OPS {
                    let want: Vec<f64> = (0..numel(&out_shape))
                        .map(|o| {
                            let oi = unravel(o, &out_shape);
                            let lane: Vec<f32> = (0..shape[axis])
                                .map(|k| {
                                    let mut idx = oi.clone();
                                    idx.insert(axis, k);
                                    a[ravel(&idx, shape)]
                                })
                                .collect();
                            reference_reduce(op, &lane)
                        })
                        .collect();
                    let mut got = vec![-123.0; want.len()];
                    reduce_axis(op, &a, shape, axis, &mut got);
                    let ctx = format!("{} {shape:?} axis {axis}", op.name());
                    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                        let ok = if w.is_nan() {
                            g.is_nan()
                        } else {
                            (g as f64 - w).abs() <= 1e-5 * w.abs().max(1.0)
                        };
                        assert!(ok, "{ctx}: index {i}: got {g}, want {w}");
                    }
                }
            }
        }
    }

    fn reference_matmul(
        a: &[f32],
        b: &[f32],
        batch: usize,
        m: usize,
        k: usize,
        n: usize,
        b_batched: bool,
    ) -> Vec<f64> {
        let mut out = vec![0.0f64; batch * m * n];
        for p in 0..batch {
            let bo = if b_batched { p * k * n } else { 0 };
            for i in 0..m {
                for j in 0..n {
                    let mut acc = 0.0f64;
                    for l in 0..k {
                        acc += a[p * m * k + i * k + l] as f64 * b[bo + l * n + j] as f64;
                    }
                    out[p * m * n + i * n + j] = acc;
                }
            }
        }
        out
    }

    #[test]
    fn matmul_matches_reference() {
        let cases: &[(usize, usize, usize, usize, bool)] = &[
            (1, 1, 1, 1, true),
            (1, 2, 3, 4, true),
            (3, 2, 3, 4, true),
            (3, 5, 7, 3, false),
            (4, 1, 9, 1, false),
            (2, 17, 1, 13, true),
            (1, 33, 65, 31, false),
            // Large enough for the parallel path.
            (1, 70, 80, 90, true),
            (2, 64, 64, 64, true),
            (3, 40, 70, 100, false),
        ];
        for (case, &(batch, m, k, n, b_batched)) in cases.iter().enumerate() {
            let a = data(batch * m * k, case as u64);
            let b = data(if b_batched { batch } else { 1 } * k * n, case as u64 + 50);
            let want = reference_matmul(&a, &b, batch, m, k, n, b_batched);
            for threads in [1, 2, 3] {
                let mut got = vec![f32::NAN; want.len()];
                matmul(&a, &b, &mut got, batch, m, k, n, b_batched, threads);
                assert_close(
                    &got,
                    &want,
                    1e-3,
                    &format!("{batch}x{m}x{k}x{n} {b_batched}, {threads} threads"),
                );
            }
        }
    }

    #[test]
    fn matmul_hand_values_and_empty() {
        let a = [1.0, 2.0, 3.0, 4.0];
        let b = [5.0, 6.0, 7.0, 8.0];
        let mut out = [0.0; 4];
        matmul(&a, &b, &mut out, 1, 2, 2, 2, true, 2);
        assert_eq!(out, [19.0, 22.0, 43.0, 50.0]);

        let mut out = vec![f32::NAN; 6];
        matmul(&[], &[], &mut out, 2, 1, 0, 3, false, 2);
        assert_eq!(out, vec![0.0; 6]);

        let mut out: Vec<f32> = vec![];
        matmul(&[], &data(24, 1), &mut out, 2, 0, 3, 4, true, 2);
        matmul(&data(6, 1), &[], &mut out, 2, 3, 1, 0, false, 2);
        matmul(&[], &[], &mut out, 0, 3, 3, 3, true, 2);
    }

    fn reference_transpose(a: &[f32], shape: &[usize], d0: usize, d1: usize) -> Vec<f32> {
        let mut out_shape = shape.to_vec();
        out_shape.swap(d0, d1);
        (0..a.len())
            .map(|o| {
                let mut idx = unravel(o, &out_shape);
                idx.swap(d0, d1);
                a[ravel(&idx, shape)]
            })
            .collect()
    }

    #[test]
    fn transpose_matches_reference() {
        let shapes: &[&[usize]] = &[
            &[5],
            &[3, 4],
            &[1, 7],
            &[70, 45],
            &[33, 32],
            &[2, 3, 5],
            &[3, 1, 7],
            &[2, 3, 4, 5],
            &[3, 33, 2, 40],
            &[2, 0, 3],
            &[1, 1, 1, 1],
        ];
        for (case, &shape) in shapes.iter().enumerate() {
            let a = data(numel(shape), case as u64);
            for d0 in 0..shape.len() {
                for d1 in 0..shape.len() {
                    let want = reference_transpose(&a, shape, d0, d1);
                    let mut got = vec![f32::NAN; a.len()];
                    transpose(&a, shape, d0, d1, &mut got);
                    assert_same(&got, &want, &format!("{shape:?} ({d0}, {d1})"));
                }
            }
        }
    }

    #[test]
    fn narrow_matches_reference() {
        let shapes: &[&[usize]] = &[&[7], &[4, 5], &[3, 1, 6], &[2, 3, 4, 5], &[2, 6, 0]];
        for (case, &shape) in shapes.iter().enumerate() {
            let a = data(numel(shape), case as u64);
            for axis in 0..shape.len() {
                for start in 0..=shape[axis] {
                    for len in 0..=shape[axis] - start {
                        let mut out_shape = shape.to_vec();
                        out_shape[axis] = len;
                        let want: Vec<f32> = (0..numel(&out_shape))
                            .map(|o| {
                                let mut idx = unravel(o, &out_shape);
                                idx[axis] += start;
                                a[ravel(&idx, shape)]
                            })
                            .collect();
                        let mut got = vec![f32::NAN; want.len()];
                        narrow(&a, shape, axis, start, len, &mut got);
                        assert_same(&got, &want, &format!("{shape:?} axis {axis} {start}+{len}"));
                    }
                }
            }
        }
    }

    #[test]
    fn concat_matches_reference() {
        let base: &[&[usize]] = &[&[3], &[2, 3], &[2, 1, 4], &[2, 3, 1, 2]];
        for (case, &shape) in base.iter().enumerate() {
            for axis in 0..shape.len() {
                let sizes = [shape[axis], 0, 1, shape[axis] + 2];
                let shapes: Vec<Vec<usize>> = sizes
                    .iter()
                    .map(|&s| {
                        let mut sh = shape.to_vec();
                        sh[axis] = s;
                        sh
                    })
                    .collect();
                let datas: Vec<Vec<f32>> = shapes
                    .iter()
                    .enumerate()
                    .map(|(i, sh)| data(numel(sh), (case * 10 + i) as u64))
                    .collect();
                let mut out_shape = shape.to_vec();
                out_shape[axis] = sizes.iter().sum();
                let want: Vec<f32> = (0..numel(&out_shape))
                    .map(|o| {
                        let mut idx = unravel(o, &out_shape);
                        let mut which = 0;
                        while idx[axis] >= shapes[which][axis] {
                            idx[axis] -= shapes[which][axis];
                            which += 1;
                        }
                        datas[which][ravel(&idx, &shapes[which])]
                    })
                    .collect();
                let inputs: Vec<(&[f32], &[usize])> = datas
                    .iter()
                    .zip(&shapes)
                    .map(|(d, s)| (d.as_slice(), s.as_slice()))
                    .collect();
                let mut got = vec![f32::NAN; want.len()];
                concat(&inputs, axis, &mut got);
                assert_same(&got, &want, &format!("{shape:?} axis {axis}"));
            }
        }
        let mut empty: [f32; 0] = [];
        concat(&[], 0, &mut empty);
    }

    #[test]
    fn broadcast_to_matches_reference() {
        for (case, &(sa, sb)) in BCAST_CASES.iter().enumerate() {
            let so = bcast_shape(sa, sb);
            for src in [sa, sb] {
                let a = data(numel(src), case as u64);
                let want: Vec<f32> = (0..numel(&so))
                    .map(|o| a[bcast_src(&unravel(o, &so), src)])
                    .collect();
                let mut got = vec![f32::NAN; want.len()];
                broadcast_to(&a, src, &so, &mut got);
                assert_same(&got, &want, &format!("{src:?} -> {so:?}"));
            }
        }
    }

    #[test]
    fn coalesce_merges_contiguous_runs() {
        let sa = broadcast_strides(&[4, 1, 5], &[4, 3, 5]);
        assert_eq!(sa.as_slice(), &[5, 0, 1]);
        let layout = coalesce(&[4, 3, 5], [&sa]);
        assert_eq!(layout.dims.as_slice(), &[4, 3, 5]);
        let sb = broadcast_strides(&[2, 3, 1], &[2, 3, 4]);
        let layout = coalesce(&[2, 3, 4], [&sb]);
        assert_eq!(layout.dims.as_slice(), &[6, 4]);
        assert_eq!(layout.strides[0].as_slice(), &[1, 0]);
        let layout = coalesce(&[1, 1], [&[0, 0]]);
        assert_eq!(layout.dims.as_slice(), &[1]);
    }

    #[test]
    fn random_fills_are_deterministic_and_plausible() {
        let n = 20_000;
        let mut u1 = vec![0.0; n];
        let mut u2 = vec![0.0; n];
        fill_uniform(&mut u1, -2.0, 3.0, 7);
        fill_uniform(&mut u2, -2.0, 3.0, 7);
        assert_eq!(u1, u2);
        fill_uniform(&mut u2, -2.0, 3.0, 8);
        assert_ne!(u1, u2);
        assert!(u1.iter().all(|&x| (-2.0..3.0).contains(&x)));
        let mean = reduce_all(ReduceOp::Mean, &u1);
        assert!((mean - 0.5).abs() < 0.05, "uniform mean {mean}");

        let mut c = vec![0.0; 4];
        fill_uniform(&mut c, 1.5, 1.5, 0);
        assert_eq!(c, vec![1.5; 4]);

        let mut g1 = vec![0.0; n];
        let mut g2 = vec![0.0; n];
        fill_normal(&mut g1, 1.0, 2.0, 3);
        fill_normal(&mut g2, 1.0, 2.0, 3);
        assert_eq!(g1, g2);
        let mean = reduce_all(ReduceOp::Mean, &g1);
        let var = g1.iter().map(|&x| (x - mean) * (x - mean)).sum::<f32>() / n as f32;
        assert!((mean - 1.0).abs() < 0.1, "normal mean {mean}");
        assert!((var.sqrt() - 2.0).abs() < 0.1, "normal std {}", var.sqrt());
    }
}
