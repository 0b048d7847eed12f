//! The public `Tensor` API against hand-computed values and against naive reference
//! implementations written here (plain loops over `Vec<f32>`, never the crate's
//! kernels): broadcasting binary ops, unary ops, comparisons, reductions, matmul,
//! layout ops, in-place ops and their ordering, operators, errors, random fills,
//! printing, and the three engine modes.

mod common;

use common::{flag, nan_max, nan_min};
use lazyflow::{Engine, Error, Mode, Tensor};

const MODES: [Mode; 3] = [Mode::Lazy, Mode::Async, Mode::Sync];

// ----- helpers ------------------------------------------------------------------

fn engine_in(mode: Mode) -> Engine {
    Engine::builder().mode(mode).workers(2).build().unwrap()
}

fn engine() -> Engine {
    engine_in(Mode::Lazy)
}

fn tensor(e: &Engine, data: Vec<f32>, dims: &[usize]) -> Tensor {
    Tensor::from_vec_in(e, data, dims).unwrap()
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Deterministic pseudo-random values in [-3, 3), quantized to quarters so that
/// ties, zeros and exactly representable products occur.
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

/// Asserts `err` is the shape error of adding a `[2, 3]` and a `[4]` tensor,
/// recorded in this file (at `line`, when given).
#[track_caller]
fn assert_add_shape_error(err: &Error, line: Option<u32>) {
    match err {
        Error::Shape {
            op,
            shapes,
            location,
            ..
        } => {
            assert_eq!(*op, "add");
            assert_eq!(shapes, "[2, 3] and [4]");
            assert_eq!(location.file(), file!());
            if let Some(line) = line {
                assert_eq!(location.line(), line);
            }
        }
        other => panic!("expected a shape error, got {other:?}"),
    }
}

/// Row-major multi-index of flat index `i` in `shape`.
fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = i % shape[d];
        i /= shape[d];
    }
    idx
}

/// Flat row-major index of multi-index `idx` in `shape`.
fn ravel(idx: &[usize], shape: &[usize]) -> usize {
    idx.iter().zip(shape).fold(0, |acc, (&i, &d)| acc * d + i)
}

/// Numpy broadcast of two shapes, written out naively.
fn bcast_shape(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for (i, o) in out.iter_mut().enumerate() {
        // Position `i` of the output, counted from the left; operands are right-aligned.
        let da = (i + a.len()).checked_sub(rank).map_or(1, |j| a[j]);
        let db = (i + b.len()).checked_sub(rank).map_or(1, |j| b[j]);
        *o = if da == db {
            da
        } else if da == 1 {
            db
        } else if db == 1 {
            da
        } else {
            return None;
        };
    }
    Some(out)
}

/// Flat index in an operand of `shape` read at output multi-index `out_idx` under
/// broadcasting.
fn bcast_src(out_idx: &[usize], shape: &[usize]) -> usize {
    let off = out_idx.len() - shape.len();
    shape.iter().enumerate().fold(0, |acc, (d, &n)| {
        acc * n + if n == 1 { 0 } else { out_idx[off + d] }
    })
}

/// `f(a, b)` with numpy broadcasting, one output element at a time.
fn ref_binary(
    f: RefBinary,
    a: &[f32],
    sa: &[usize],
    b: &[f32],
    sb: &[usize],
) -> (Vec<f32>, Vec<usize>) {
    let so = bcast_shape(sa, sb).expect("reference: shapes broadcast");
    let out = (0..numel(&so))
        .map(|i| {
            let idx = unravel(i, &so);
            f(a[bcast_src(&idx, sa)], b[bcast_src(&idx, sb)])
        })
        .collect();
    (out, so)
}

/// Element-wise closeness: equal (infinities included), both NaN, or within
/// `rel * |want| + abs`.
fn assert_close(got: &[f32], want: &[f64], rel: f64, abs: f64, ctx: &str) {
    assert_eq!(got.len(), want.len(), "{ctx}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let g64 = g as f64;
        let ok = if w.is_nan() {
            g.is_nan()
        } else if w.is_infinite() || g.is_infinite() {
            g64 == w
        } else {
            (g64 - w).abs() <= rel * w.abs() + abs
        };
        assert!(ok, "{ctx}: index {i}: got {g}, want {w}");
    }
}

fn assert_close32(got: &[f32], want: &[f32], rel: f64, ctx: &str) {
    let want: Vec<f64> = want.iter().map(|&w| w as f64).collect();
    assert_close(got, &want, rel, 0.0, ctx);
}

/// Bit-for-bit equality, except that NaN equals NaN.
fn assert_same(got: &[f32], want: &[f32], ctx: &str) {
    assert_eq!(got.len(), want.len(), "{ctx}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            g == w || (g.is_nan() && w.is_nan()),
            "{ctx}: index {i}: got {g}, want {w}"
        );
    }
}

type BinaryMethod = fn(&Tensor, &Tensor) -> lazyflow::Result<Tensor>;
/// A naive element-wise reference for a binary op.
type RefBinary = fn(f32, f32) -> f32;

fn binary_ops() -> Vec<(&'static str, BinaryMethod, RefBinary)> {
    vec![
        ("add", Tensor::add, |a, b| a + b),
        ("sub", Tensor::sub, |a, b| a - b),
        ("mul", Tensor::mul, |a, b| a * b),
        ("div", Tensor::div, |a, b| a / b),
        ("pow", Tensor::pow, f32::powf),
        ("maximum", Tensor::maximum, nan_max),
        ("minimum", Tensor::minimum, nan_min),
        ("eq", Tensor::eq, |a, b| flag(a == b)),
        ("ne", Tensor::ne, |a, b| flag(a != b)),
        ("lt", Tensor::lt, |a, b| flag(a < b)),
        ("le", Tensor::le, |a, b| flag(a <= b)),
        ("gt", Tensor::gt, |a, b| flag(a > b)),
        ("ge", Tensor::ge, |a, b| flag(a >= b)),
    ]
}

/// Shape pairs for broadcasting: equal, rank mismatch both ways, size-1 dims on
/// both sides, scalars, odd sizes and empty tensors.
const BCAST_CASES: &[(&[usize], &[usize])] = &[
    (&[2, 3], &[2, 3]),
    (&[7], &[7]),
    (&[2, 3, 4], &[4]),
    (&[4], &[2, 3, 4]),
    (&[2, 3, 4], &[3, 1]),
    (&[3, 1], &[1, 5]),
    (&[1, 5], &[3, 1]),
    (&[2, 3, 4], &[2, 1, 4]),
    (&[3, 1, 5], &[1, 4, 1]),
    (&[2, 1, 3], &[4, 1]),
    (&[1, 1], &[3, 1, 1]),
    (&[5, 7], &[1]),
    (&[1], &[5, 7]),
    (&[], &[2, 3]),
    (&[2, 3], &[]),
    (&[], &[]),
    (&[], &[1]),
    (&[0, 3], &[3]),
    (&[0, 3], &[1, 3]),
    (&[3], &[0, 3]),
    (&[1], &[0]),
    (&[0], &[]),
    (&[2, 0, 3], &[2, 1, 1]),
];

// ----- creation and reading -----------------------------------------------------

#[test]
fn creation_functions_give_the_expected_values() {
    let e = engine();
    assert_eq!(Tensor::zeros_in(&e, [2, 3]).to_vec().unwrap(), vec![0.0; 6]);
    assert_eq!(Tensor::ones_in(&e, [4]).to_vec().unwrap(), vec![1.0; 4]);
    let f = Tensor::full_in(&e, [2, 2], 2.5);
    assert_eq!(f.dims(), &[2, 2]);
    assert_eq!(f.numel(), 4);
    assert_eq!(f.to_vec().unwrap(), vec![2.5; 4]);
    assert_eq!(
        Tensor::arange_in(&e, 0.0, 5.0, 1.0).to_vec().unwrap(),
        vec![0.0, 1.0, 2.0, 3.0, 4.0]
    );
    assert_eq!(
        Tensor::arange_in(&e, 1.0, 2.0, 0.25).to_vec().unwrap(),
        vec![1.0, 1.25, 1.5, 1.75]
    );
    assert_eq!(
        Tensor::arange_in(&e, 3.0, 0.0, -1.0).to_vec().unwrap(),
        vec![3.0, 2.0, 1.0]
    );
    assert_eq!(Tensor::arange_in(&e, 3.0, 0.0, 1.0).dims(), &[0]);
    assert_eq!(Tensor::arange_in(&e, 0.0, 3.0, 0.0).dims(), &[0]);
    assert_eq!(Tensor::arange_in(&e, 0.0, 2.5, 1.0).dims(), &[3]);

    let s = Tensor::scalar_in(&e, 4.5);
    assert_eq!(s.dims(), &[] as &[usize]);
    assert_eq!(s.numel(), 1);
    assert_eq!(s.item().unwrap(), 4.5);

    let t = Tensor::from_slice_in(&e, &[1.0, 2.0, 3.0], [3, 1]).unwrap();
    assert_eq!(t.dims(), &[3, 1]);
    assert_eq!(t.to_vec().unwrap(), vec![1.0, 2.0, 3.0]);
    t.wait_to_read().unwrap();

    let empty = Tensor::zeros_in(&e, [0, 3]);
    assert_eq!(empty.numel(), 0);
    assert_eq!(empty.to_vec().unwrap(), Vec::<f32>::new());
    assert_eq!(Tensor::from_vec_in(&e, vec![], [2, 0]).unwrap().numel(), 0);
}

// ----- element-wise binary ops --------------------------------------------------

#[test]
fn binary_ops_broadcast_like_the_reference() {
    let e = engine();
    for (case, &(sa, sb)) in BCAST_CASES.iter().enumerate() {
        let va = data(numel(sa), 2 * case as u64 + 1);
        let vb = data(numel(sb), 2 * case as u64 + 2);
        let a = tensor(&e, va.clone(), sa);
        let b = tensor(&e, vb.clone(), sb);
        // Record every op first, then read them all: the engine runs them together.
        let outs: Vec<_> = binary_ops()
            .into_iter()
            .map(|(name, method, f)| (name, method(&a, &b).unwrap(), f))
            .collect();
        for (name, out, f) in outs {
            let (want, so) = ref_binary(f, &va, sa, &vb, sb);
            let ctx = format!("{name} {sa:?} with {sb:?}");
            assert_eq!(out.dims(), so.as_slice(), "{ctx}: shape");
            assert_close32(&out.to_vec().unwrap(), &want, 1e-6, &ctx);
        }
    }
}

#[test]
fn binary_ops_with_positive_bases_and_a_larger_broadcast() {
    // Non-quantized values, positive bases for pow, and a shape larger than one
    // vector register in each direction.
    let e = engine();
    let (sa, sb) = ([3usize, 1, 37], [5usize, 1]);
    let va: Vec<f32> = (0..numel(&sa)).map(|i| 0.1 + i as f32 * 0.037).collect();
    let vb: Vec<f32> = (0..numel(&sb)).map(|i| -1.3 + i as f32 * 0.71).collect();
    let a = tensor(&e, va.clone(), &sa);
    let b = tensor(&e, vb.clone(), &sb);
    for (name, method, f) in binary_ops() {
        let (want, so) = ref_binary(f, &va, &sa, &vb, &sb);
        let out = method(&a, &b).unwrap();
        assert_eq!(out.dims(), so.as_slice(), "{name}");
        assert_close32(&out.to_vec().unwrap(), &want, 1e-6, name);
        // Swapped operands broadcast the other way round.
        let (want, so) = ref_binary(f, &vb, &sb, &va, &sa);
        let out = method(&b, &a).unwrap();
        assert_eq!(out.dims(), so.as_slice(), "{name} swapped");
        assert_close32(&out.to_vec().unwrap(), &want, 1e-6, name);
    }
}

#[test]
fn binary_ops_hand_values() {
    let e = engine();
    let a = tensor(&e, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let row = tensor(&e, vec![10.0, 20.0, 30.0], &[3]);
    let col = tensor(&e, vec![1.0, 2.0], &[2, 1]);
    assert_eq!(
        a.add(&row).unwrap().to_vec().unwrap(),
        vec![11.0, 22.0, 33.0, 14.0, 25.0, 36.0]
    );
    assert_eq!(
        a.sub(&col).unwrap().to_vec().unwrap(),
        vec![0.0, 1.0, 2.0, 2.0, 3.0, 4.0]
    );
    assert_eq!(
        a.mul(&col).unwrap().to_vec().unwrap(),
        vec![1.0, 2.0, 3.0, 8.0, 10.0, 12.0]
    );
    assert_eq!(
        row.div(&a).unwrap().to_vec().unwrap(),
        vec![10.0, 10.0, 10.0, 2.5, 4.0, 5.0]
    );
    assert_eq!(
        a.pow(&col).unwrap().to_vec().unwrap(),
        vec![1.0, 2.0, 3.0, 16.0, 25.0, 36.0]
    );
    let outer = col.mul(&row).unwrap();
    assert_eq!(outer.dims(), &[2, 3]);
    assert_eq!(
        outer.to_vec().unwrap(),
        vec![10.0, 20.0, 30.0, 20.0, 40.0, 60.0]
    );
    let s = Tensor::scalar_in(&e, 2.0);
    let out = s.sub(&a).unwrap();
    assert_eq!(out.dims(), &[2, 3]);
    assert_eq!(
        out.to_vec().unwrap(),
        vec![1.0, 0.0, -1.0, -2.0, -3.0, -4.0]
    );
    let ss = s.mul(&s).unwrap();
    assert_eq!(ss.dims(), &[] as &[usize]);
    assert_eq!(ss.item().unwrap(), 4.0);
    // Division by zero follows IEEE.
    let z = tensor(&e, vec![1.0, -1.0, 0.0], &[3]);
    let d = z.div(&Tensor::zeros_in(&e, [1])).unwrap().to_vec().unwrap();
    assert_eq!(d[0], f32::INFINITY);
    assert_eq!(d[1], f32::NEG_INFINITY);
    assert!(d[2].is_nan());
}

#[test]
fn maximum_minimum_propagate_nan_and_comparisons_treat_it_as_unordered() {
    let e = engine();
    let a = tensor(&e, vec![f32::NAN, 1.0, 2.0, f32::NAN], &[4]);
    let b = tensor(&e, vec![0.0, f32::NAN, 3.0, f32::NAN], &[4]);
    let max = a.maximum(&b).unwrap().to_vec().unwrap();
    assert_same(&max, &[f32::NAN, f32::NAN, 3.0, f32::NAN], "maximum");
    let min = a.minimum(&b).unwrap().to_vec().unwrap();
    assert_same(&min, &[f32::NAN, f32::NAN, 2.0, f32::NAN], "minimum");
    assert_eq!(
        a.eq(&b).unwrap().to_vec().unwrap(),
        vec![0.0, 0.0, 0.0, 0.0]
    );
    assert_eq!(
        a.ne(&b).unwrap().to_vec().unwrap(),
        vec![1.0, 1.0, 1.0, 1.0]
    );
    for (name, method) in [
        ("lt", Tensor::lt as BinaryMethod),
        ("le", Tensor::le),
        ("gt", Tensor::gt),
        ("ge", Tensor::ge),
    ] {
        let m = method(&a, &b).unwrap().to_vec().unwrap();
        assert_eq!(m[0], 0.0, "{name}");
        assert_eq!(m[1], 0.0, "{name}");
        assert_eq!(m[3], 0.0, "{name}");
    }
}

#[test]
fn comparisons_produce_one_zero_masks() {
    let e = engine();
    let a = tensor(&e, vec![1.0, 2.0, 3.0, 4.0], &[4]);
    let b = tensor(&e, vec![4.0, 2.0, 2.0, 4.0], &[4]);
    let m = |t: lazyflow::Result<Tensor>| t.unwrap().to_vec().unwrap();
    assert_eq!(m(a.eq(&b)), vec![0.0, 1.0, 0.0, 1.0]);
    assert_eq!(m(a.ne(&b)), vec![1.0, 0.0, 1.0, 0.0]);
    assert_eq!(m(a.lt(&b)), vec![1.0, 0.0, 0.0, 0.0]);
    assert_eq!(m(a.le(&b)), vec![1.0, 1.0, 0.0, 1.0]);
    assert_eq!(m(a.gt(&b)), vec![0.0, 0.0, 1.0, 0.0]);
    assert_eq!(m(a.ge(&b)), vec![0.0, 1.0, 1.0, 1.0]);
    // Broadcast: a column against a row gives a comparison table.
    let col = tensor(&e, vec![1.0, 2.0, 3.0], &[3, 1]);
    let row = tensor(&e, vec![2.0, 1.0], &[2]);
    let table = col.gt(&row).unwrap();
    assert_eq!(table.dims(), &[3, 2]);
    assert_eq!(table.to_vec().unwrap(), vec![0.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
    // Scalar comparisons.
    assert_eq!(a.eq_scalar(2.0).to_vec().unwrap(), vec![0.0, 1.0, 0.0, 0.0]);
    assert_eq!(a.lt_scalar(3.0).to_vec().unwrap(), vec![1.0, 1.0, 0.0, 0.0]);
    assert_eq!(a.gt_scalar(3.0).to_vec().unwrap(), vec![0.0, 0.0, 0.0, 1.0]);
    // Masks are usable as numbers: count of elements above 1.5.
    assert_eq!(a.gt_scalar(1.5).sum().item().unwrap(), 3.0);
}

type ScalarMethod = fn(&Tensor, f32) -> Tensor;

#[test]
fn scalar_methods_match_the_reference() {
    let e = engine();
    let methods: Vec<(&str, ScalarMethod, RefBinary)> = vec![
        ("add_scalar", Tensor::add_scalar, |a, s| a + s),
        ("sub_scalar", Tensor::sub_scalar, |a, s| a - s),
        ("mul_scalar", Tensor::mul_scalar, |a, s| a * s),
        ("div_scalar", Tensor::div_scalar, |a, s| a / s),
        ("powf", Tensor::powf, f32::powf),
        ("maximum_scalar", Tensor::maximum_scalar, nan_max),
        ("minimum_scalar", Tensor::minimum_scalar, nan_min),
        ("eq_scalar", Tensor::eq_scalar, |a, s| flag(a == s)),
        ("lt_scalar", Tensor::lt_scalar, |a, s| flag(a < s)),
        ("gt_scalar", Tensor::gt_scalar, |a, s| flag(a > s)),
    ];
    for (dims, seed) in [(&[2usize, 3, 5][..], 3u64), (&[7][..], 4), (&[][..], 5)] {
        let v = data(numel(dims), seed);
        let a = tensor(&e, v.clone(), dims);
        for &s in &[-1.5f32, 0.0, 2.0, 0.5] {
            for (name, method, f) in &methods {
                let out = method(&a, s);
                assert_eq!(out.dims(), dims, "{name}");
                let want: Vec<f32> = v.iter().map(|&x| f(x, s)).collect();
                let ctx = format!("{name} {dims:?} s={s}");
                assert_close32(&out.to_vec().unwrap(), &want, 1e-6, &ctx);
            }
        }
    }
    // Empty input stays empty.
    let empty = Tensor::zeros_in(&e, [0, 3]);
    let out = empty.add_scalar(1.0);
    assert_eq!(out.dims(), &[0, 3]);
    assert!(out.to_vec().unwrap().is_empty());
}

// ----- unary ops ------------------------------------------------------------------

#[test]
fn unary_ops_match_std() {
    let e = engine();
    let xs: Vec<f32> = vec![
        -1000.0, -100.0, -89.0, -20.0, -3.5, -1.0, -0.25, -0.0, 0.0, 1e-3, 0.25, 0.5, 1.0, 2.5,
        9.0, 20.0, 88.0, 100.0, 1000.0,
    ];
    let x = tensor(&e, xs.clone(), &[xs.len()]);
    type Ref = fn(f32) -> f64;
    let cases: Vec<(&str, Tensor, Ref)> = vec![
        ("neg", x.neg(), |v| -(v as f64)),
        ("exp", x.exp(), |v| v.exp() as f64),
        ("log", x.log(), |v| v.ln() as f64),
        ("sqrt", x.sqrt(), |v| v.sqrt() as f64),
        ("abs", x.abs(), |v| v.abs() as f64),
        ("relu", x.relu(), |v| if v < 0.0 { 0.0 } else { v as f64 }),
        ("sigmoid", x.sigmoid(), |v| {
            1.0 / (1.0 + (-(v as f64)).exp())
        }),
        ("tanh", x.tanh(), |v| v.tanh() as f64),
    ];
    for (name, out, f) in cases {
        assert_eq!(out.dims(), x.dims(), "{name}");
        let want: Vec<f64> = xs.iter().map(|&v| f(v)).collect();
        // Relative 1e-6, with an absolute floor for subnormal results.
        assert_close(&out.to_vec().unwrap(), &want, 1e-6, 1e-40, name);
    }
}

#[test]
fn unary_edge_values() {
    let e = engine();
    let x = tensor(&e, vec![-1000.0, -100.0, 0.0, 100.0, 1000.0], &[5]);
    let s = x.sigmoid().to_vec().unwrap();
    assert!(s.iter().all(|v| (0.0..=1.0).contains(v)), "{s:?}");
    assert_eq!(s[0], 0.0);
    assert!(s[1] >= 0.0 && s[1] < 1e-40, "{}", s[1]);
    assert_eq!(s[2], 0.5);
    assert_eq!(s[3], 1.0);
    assert_eq!(s[4], 1.0);
    let t = x.tanh().to_vec().unwrap();
    assert_eq!(t, vec![-1.0, -1.0, 0.0, 1.0, 1.0]);
    let special = tensor(&e, vec![-1.0, 0.0, f32::NAN, f32::INFINITY], &[4]);
    let log = special.log().to_vec().unwrap();
    assert!(log[0].is_nan());
    assert_eq!(log[1], f32::NEG_INFINITY);
    assert!(log[2].is_nan());
    assert_eq!(log[3], f32::INFINITY);
    let sqrt = special.sqrt().to_vec().unwrap();
    assert!(sqrt[0].is_nan());
    assert_eq!(sqrt[1], 0.0);
    let relu = special.relu().to_vec().unwrap();
    assert_eq!(relu[0], 0.0);
    assert!(relu[2].is_nan(), "relu keeps NaN");
    assert_eq!(relu[3], f32::INFINITY);
    assert!(special.sigmoid().to_vec().unwrap()[2].is_nan());
    // Unary ops keep the shape, including empty and scalar ones.
    let empty = Tensor::zeros_in(&e, [0, 3]).exp();
    assert_eq!(empty.dims(), &[0, 3]);
    assert!(empty.to_vec().unwrap().is_empty());
    assert_eq!(Tensor::scalar_in(&e, 4.0).sqrt().item().unwrap(), 2.0);
}

// ----- reductions -----------------------------------------------------------------

/// (sum, mean, max, min, argmax) of a lane, naively; max/min/argmax over a lane
/// without NaN, argmax taking the first maximum.
fn ref_reduce(lane: &[f32]) -> [f64; 5] {
    let sum: f64 = lane.iter().map(|&x| x as f64).sum();
    let mut best = 0;
    let mut worst = 0;
    for i in 1..lane.len() {
        if lane[i] > lane[best] {
            best = i;
        }
        if lane[i] < lane[worst] {
            worst = i;
        }
    }
    [
        sum,
        sum / lane.len() as f64,
        lane[best] as f64,
        lane[worst] as f64,
        best as f64,
    ]
}

type ReduceAxis = fn(&Tensor, usize) -> lazyflow::Result<Tensor>;

#[test]
fn reductions_over_all_elements_and_each_axis_match_loops() {
    let e = engine();
    let shape = [2usize, 3, 4];
    for seed in [1u64, 2, 3] {
        let v = data(numel(&shape), seed);
        let x = tensor(&e, v.clone(), &shape);

        let all = [
            x.sum(),
            x.mean(),
            x.max().unwrap(),
            x.min().unwrap(),
            x.argmax().unwrap(),
        ];
        let want = ref_reduce(&v);
        for (i, t) in all.iter().enumerate() {
            assert_eq!(t.dims(), &[] as &[usize], "reduction {i} is a scalar");
            assert_close(&[t.item().unwrap()], &want[i..=i], 1e-6, 1e-6, "all");
        }

        let per_axis: [(&str, ReduceAxis); 5] = [
            ("sum_axis", Tensor::sum_axis),
            ("mean_axis", Tensor::mean_axis),
            ("max_axis", Tensor::max_axis),
            ("min_axis", Tensor::min_axis),
            ("argmax_axis", Tensor::argmax_axis),
        ];
        for axis in 0..shape.len() {
            let mut out_shape = shape.to_vec();
            out_shape.remove(axis);
            // The lane of every output element, gathered with explicit loops.
            let lanes: Vec<Vec<f32>> = (0..numel(&out_shape))
                .map(|o| {
                    let oi = unravel(o, &out_shape);
                    (0..shape[axis])
                        .map(|k| {
                            let mut idx = oi.clone();
                            idx.insert(axis, k);
                            v[ravel(&idx, &shape)]
                        })
                        .collect()
                })
                .collect();
            for (which, (name, method)) in per_axis.iter().enumerate() {
                let out = method(&x, axis).unwrap();
                assert_eq!(out.dims(), out_shape.as_slice(), "{name} axis {axis}");
                let want: Vec<f64> = lanes.iter().map(|l| ref_reduce(l)[which]).collect();
                let ctx = format!("{name} axis {axis} seed {seed}");
                assert_close(&out.to_vec().unwrap(), &want, 1e-6, 1e-6, &ctx);
            }
        }
    }
}

#[test]
fn reduction_hand_values_and_tie_rules() {
    let e = engine();
    let a = tensor(&e, vec![1.0, 5.0, 2.0, 5.0, -7.0], &[5]);
    assert_eq!(a.sum().item().unwrap(), 6.0);
    assert_eq!(a.mean().item().unwrap(), 1.2);
    assert_eq!(a.max().unwrap().item().unwrap(), 5.0);
    assert_eq!(a.min().unwrap().item().unwrap(), -7.0);
    assert_eq!(
        a.argmax().unwrap().item().unwrap(),
        1.0,
        "first of the tied maxima"
    );

    let m = tensor(&e, vec![1.0, 3.0, 3.0, 3.0, 3.0, 1.0], &[2, 3]);
    // Column 1 ties (3 vs 3): the first row wins.
    assert_eq!(
        m.argmax_axis(0).unwrap().to_vec().unwrap(),
        vec![1.0, 0.0, 0.0]
    );
    assert_eq!(m.argmax_axis(1).unwrap().to_vec().unwrap(), vec![1.0, 0.0]);
    assert_eq!(
        m.sum_axis(0).unwrap().to_vec().unwrap(),
        vec![4.0, 6.0, 4.0]
    );
    assert_eq!(m.sum_axis(1).unwrap().to_vec().unwrap(), vec![7.0, 7.0]);
    assert_eq!(
        m.mean_axis(0).unwrap().to_vec().unwrap(),
        vec![2.0, 3.0, 2.0]
    );
    assert_eq!(m.max_axis(1).unwrap().to_vec().unwrap(), vec![3.0, 3.0]);
    assert_eq!(m.min_axis(1).unwrap().to_vec().unwrap(), vec![1.0, 1.0]);

    // mean == sum / numel, and the mean of per-axis sums.
    let x = Tensor::arange_in(&e, 0.0, 24.0, 1.0)
        .reshape([2, 3, 4])
        .unwrap();
    let sum = x.sum().item().unwrap();
    assert_eq!(sum, 276.0);
    assert_eq!(x.mean().item().unwrap(), sum / 24.0);
    let mean_of_sums = x.sum_axis(2).unwrap().mean().item().unwrap();
    assert_eq!(mean_of_sums, sum / 6.0);
    // Chained axis reductions: [2, 3, 4] -> [2, 4] -> [4].
    let chained = x.sum_axis(1).unwrap().sum_axis(0).unwrap();
    assert_eq!(chained.to_vec().unwrap(), vec![60.0, 66.0, 72.0, 78.0]);
}

#[test]
fn reductions_of_empty_tensors() {
    let e = engine();
    let z = Tensor::zeros_in(&e, [0, 3]);
    assert_eq!(z.sum().item().unwrap(), 0.0);
    assert!(z.mean().item().unwrap().is_nan());
    let s0 = z.sum_axis(0).unwrap();
    assert_eq!(s0.dims(), &[3]);
    assert_eq!(s0.to_vec().unwrap(), vec![0.0; 3]);
    let s1 = z.sum_axis(1).unwrap();
    assert_eq!(s1.dims(), &[0]);
    assert!(s1.to_vec().unwrap().is_empty());
    // No identity: an error at the call, as numpy raises (not a NaN).
    for (name, all, along0) in [
        ("max", z.max(), z.max_axis(0)),
        ("min", z.min(), z.min_axis(0)),
        ("argmax", z.argmax(), z.argmax_axis(0)),
    ] {
        for r in [all, along0] {
            match r {
                Err(Error::InvalidArgument {
                    op, shape, reason, ..
                }) => {
                    assert_eq!((op, shape.as_str()), (name, "[0, 3]"));
                    assert!(reason.contains("no identity"), "{reason}");
                }
                other => panic!("{name} of [0, 3]: expected an error, got {other:?}"),
            }
        }
    }
    // Along the axis of length 3 there is nothing to reduce: an empty result.
    assert_eq!(z.max_axis(1).unwrap().dims(), &[0]);
    assert!(z.argmax_axis(1).unwrap().to_vec().unwrap().is_empty());
}

// ----- matmul ---------------------------------------------------------------------

/// `a @ b` with a triple loop in f64, batched; `b` shared when `b_batched` is false.
/// Also returns, per output, `sum |a_il * b_lj|` to scale the tolerance.
fn ref_matmul(
    a: &[f32],
    b: &[f32],
    (batch, m, k, n): (usize, usize, usize, usize),
    b_batched: bool,
) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0; batch * m * n];
    let mut mag = vec![0.0; batch * m * n];
    for p in 0..batch {
        let bo = if b_batched { p * k * n } else { 0 };
        for i in 0..m {
            for j in 0..n {
                let (mut acc, mut abs) = (0.0f64, 0.0f64);
                for l in 0..k {
                    let prod = a[p * m * k + i * k + l] as f64 * b[bo + l * n + j] as f64;
                    acc += prod;
                    abs += prod.abs();
                }
                out[p * m * n + i * n + j] = acc;
                mag[p * m * n + i * n + j] = abs;
            }
        }
    }
    (out, mag)
}

fn check_matmul(e: &Engine, a_dims: &[usize], b_dims: &[usize], seed: u64, smooth: bool) {
    let gen = |n: usize, s: u64| -> Vec<f32> {
        if smooth {
            // Values that are not exactly representable, so rounding happens.
            (0..n)
                .map(|i| ((i as f32 + s as f32) * 0.731).sin() * 1.7)
                .collect()
        } else {
            data(n, s)
        }
    };
    let va = gen(numel(a_dims), seed);
    let vb = gen(numel(b_dims), seed + 100);
    let a = tensor(e, va.clone(), a_dims);
    let b = tensor(e, vb.clone(), b_dims);
    let out = a.matmul(&b).unwrap();
    let r = a_dims.len();
    let (m, k) = (a_dims[r - 2], a_dims[r - 1]);
    let n = b_dims[b_dims.len() - 1];
    let batch = numel(&a_dims[..r - 2]);
    let mut out_dims = a_dims[..r - 2].to_vec();
    out_dims.extend([m, n]);
    let ctx = format!("{a_dims:?} @ {b_dims:?}");
    assert_eq!(out.dims(), out_dims.as_slice(), "{ctx}");
    let (want, mag) = ref_matmul(&va, &vb, (batch, m, k, n), b_dims.len() > 2);
    let got = out.to_vec().unwrap();
    assert_eq!(got.len(), want.len(), "{ctx}");
    for (i, ((&g, &w), &s)) in got.iter().zip(&want).zip(&mag).enumerate() {
        let tol = 1e-4 * w.abs().max(s).max(1e-6);
        assert!(
            (g as f64 - w).abs() <= tol,
            "{ctx}: index {i}: got {g}, want {w}"
        );
    }
}

#[test]
fn matmul_matches_a_triple_loop() {
    let e = engine();
    let cases: &[(&[usize], &[usize])] = &[
        (&[1, 1], &[1, 1]),
        (&[2, 3], &[3, 4]),
        (&[7, 5], &[5, 3]),
        (&[1, 9], &[9, 1]),
        (&[9, 1], &[1, 9]),
        (&[17, 13], &[13, 1]),
        // 65 * 70 * 66 multiply-adds: past faer's parallel threshold.
        (&[65, 70], &[70, 66]),
        // Batched, and batched with a shared 2-D right operand.
        (&[2, 3, 4], &[2, 4, 5]),
        (&[2, 3, 4], &[4, 5]),
        (&[2, 2, 3, 4], &[2, 2, 4, 5]),
        (&[3, 2, 7, 5], &[5, 3]),
        (&[2, 65, 70], &[70, 66]),
    ];
    for (case, &(sa, sb)) in cases.iter().enumerate() {
        check_matmul(&e, sa, sb, case as u64, false);
        check_matmul(&e, sa, sb, case as u64, true);
    }
}

#[test]
fn matmul_hand_values_aliasing_and_empty_inner_dim() {
    let e = engine();
    let a = tensor(&e, vec![1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let b = tensor(&e, vec![5.0, 6.0, 7.0, 8.0], &[2, 2]);
    assert_eq!(
        a.matmul(&b).unwrap().to_vec().unwrap(),
        vec![19.0, 22.0, 43.0, 50.0]
    );
    // The same tensor on both sides.
    assert_eq!(
        a.matmul(&a).unwrap().to_vec().unwrap(),
        vec![7.0, 10.0, 15.0, 22.0]
    );
    // A row times a column, and a column times a row.
    let row = tensor(&e, vec![1.0, 2.0, 3.0], &[1, 3]);
    let col = tensor(&e, vec![4.0, 5.0, 6.0], &[3, 1]);
    assert_eq!(row.matmul(&col).unwrap().to_vec().unwrap(), vec![32.0]);
    let outer = col.matmul(&row).unwrap();
    assert_eq!(outer.dims(), &[3, 3]);
    assert_eq!(
        outer.to_vec().unwrap(),
        vec![4.0, 8.0, 12.0, 5.0, 10.0, 15.0, 6.0, 12.0, 18.0]
    );
    // k = 0 gives zeros; m = 0 gives an empty result.
    let p = Tensor::zeros_in(&e, [2, 0]).matmul(&Tensor::zeros_in(&e, [0, 3]));
    let p = p.unwrap();
    assert_eq!(p.dims(), &[2, 3]);
    assert_eq!(p.to_vec().unwrap(), vec![0.0; 6]);
    let q = Tensor::zeros_in(&e, [0, 4])
        .matmul(&Tensor::ones_in(&e, [4, 3]))
        .unwrap();
    assert_eq!(q.dims(), &[0, 3]);
    assert!(q.to_vec().unwrap().is_empty());
    // Identity.
    let eye = tensor(&e, vec![1.0, 0.0, 0.0, 1.0], &[2, 2]);
    assert_eq!(
        b.matmul(&eye).unwrap().to_vec().unwrap(),
        b.to_vec().unwrap()
    );
}

// ----- layout ---------------------------------------------------------------------

#[test]
fn transpose_matches_the_reference_for_every_axis_pair() {
    let e = engine();
    for shape in [&[2usize, 3, 4][..], &[3, 1, 5], &[2, 3, 2, 3], &[5, 7]] {
        let v: Vec<f32> = (0..numel(shape)).map(|i| i as f32).collect();
        let x = tensor(&e, v.clone(), shape);
        for d0 in 0..shape.len() {
            for d1 in 0..shape.len() {
                let out = x.transpose(d0, d1).unwrap();
                let mut out_shape = shape.to_vec();
                out_shape.swap(d0, d1);
                assert_eq!(out.dims(), out_shape.as_slice());
                let want: Vec<f32> = (0..v.len())
                    .map(|o| {
                        let mut idx = unravel(o, &out_shape);
                        idx.swap(d0, d1);
                        v[ravel(&idx, shape)]
                    })
                    .collect();
                assert_same(
                    &out.to_vec().unwrap(),
                    &want,
                    &format!("{shape:?} ({d0}, {d1})"),
                );
            }
        }
    }
}

#[test]
fn t_transposes_a_matrix() {
    let e = engine();
    let x = tensor(&e, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let t = x.t().unwrap();
    assert_eq!(t.dims(), &[3, 2]);
    assert_eq!(t.to_vec().unwrap(), vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    assert_eq!(t.t().unwrap().to_vec().unwrap(), x.to_vec().unwrap());
    // A 40x33 transpose crosses tile boundaries.
    let (r, c) = (40usize, 33usize);
    let v: Vec<f32> = (0..r * c).map(|i| i as f32).collect();
    let big = tensor(&e, v.clone(), &[r, c]).t().unwrap();
    let want: Vec<f32> = (0..r * c).map(|o| v[(o % r) * c + o / r]).collect();
    assert_same(&big.to_vec().unwrap(), &want, "40x33");
    assert!(matches!(
        Tensor::zeros_in(&e, [2, 3, 4]).t(),
        Err(Error::InvalidArgument { op: "t", .. })
    ));
}

#[test]
fn reshape_is_a_view_sharing_data() {
    for mode in MODES {
        let e = engine_in(mode);
        let x = Tensor::arange_in(&e, 0.0, 6.0, 1.0);
        let y = x.reshape([2, 3]).unwrap();
        assert!(y.same_data(&x));
        assert_eq!(y.dims(), &[2, 3]);
        assert_eq!(y.to_vec().unwrap(), vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        // An in-place op on the view is visible through the original, and back.
        y.add_scalar_(10.0);
        assert_eq!(
            x.to_vec().unwrap(),
            vec![10.0, 11.0, 12.0, 13.0, 14.0, 15.0],
            "{mode:?}"
        );
        x.mul_scalar_(2.0);
        assert_eq!(y.sum_axis(1).unwrap().to_vec().unwrap(), vec![66.0, 84.0]);
        // A reshape to a scalar and to rank 3.
        let one = Tensor::ones_in(&e, [1, 1]);
        assert_eq!(one.reshape(()).unwrap().item().unwrap(), 1.0);
        assert_eq!(x.reshape([3, 1, 2]).unwrap().dims(), &[3, 1, 2]);
        // A fresh op result is not a view.
        let z = &x + 0.0;
        assert!(!z.same_data(&x));
    }
}

#[test]
fn broadcast_to_materializes_like_the_reference() {
    let e = engine();
    let cases: &[(&[usize], &[usize])] = &[
        (&[3, 1], &[2, 3, 4]),
        (&[4], &[2, 3, 4]),
        (&[], &[2, 2]),
        (&[1], &[5]),
        (&[2, 3], &[2, 3]),
        (&[1, 3], &[0, 3]),
    ];
    for &(from, to) in cases {
        let v: Vec<f32> = (0..numel(from)).map(|i| i as f32 + 1.0).collect();
        let out = tensor(&e, v.clone(), from).broadcast_to(to).unwrap();
        assert_eq!(out.dims(), to);
        let want: Vec<f32> = (0..numel(to))
            .map(|o| v[bcast_src(&unravel(o, to), from)])
            .collect();
        assert_same(
            &out.to_vec().unwrap(),
            &want,
            &format!("{from:?} -> {to:?}"),
        );
    }
    let col = tensor(&e, vec![1.0, 2.0], &[2, 1]);
    assert_eq!(
        col.broadcast_to([2, 3]).unwrap().to_vec().unwrap(),
        vec![1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    );
    assert!(matches!(
        col.broadcast_to([3, 3]),
        Err(Error::Shape {
            op: "broadcast_to",
            ..
        })
    ));
    // Not a view: changing the result leaves the source alone.
    let b = col.broadcast_to([2, 2]).unwrap();
    b.fill_(9.0);
    assert_eq!(col.to_vec().unwrap(), vec![1.0, 2.0]);
}

#[test]
fn narrow_split_and_concat_match_the_reference() {
    let e = engine();
    let shape = [2usize, 3, 4];
    let v: Vec<f32> = (0..24).map(|i| i as f32).collect();
    let x = tensor(&e, v.clone(), &shape);
    for axis in 0..3 {
        // narrow: every (start, len).
        for start in 0..=shape[axis] {
            for len in 0..=shape[axis] - start {
                let out = x.narrow(axis, start, len).unwrap();
                let mut out_shape = shape.to_vec();
                out_shape[axis] = len;
                assert_eq!(out.dims(), out_shape.as_slice());
                let want: Vec<f32> = (0..numel(&out_shape))
                    .map(|o| {
                        let mut idx = unravel(o, &out_shape);
                        idx[axis] += start;
                        v[ravel(&idx, &shape)]
                    })
                    .collect();
                let ctx = format!("narrow axis {axis} {start}+{len}");
                assert_same(&out.to_vec().unwrap(), &want, &ctx);
            }
        }
        // split into [1, rest] and concat back on the same axis.
        let sizes = [1, 0, shape[axis] - 1];
        let parts = x.split(axis, &sizes).unwrap();
        assert_eq!(parts.len(), 3);
        for (p, &s) in parts.iter().zip(&sizes) {
            assert_eq!(p.dims()[axis], s);
        }
        let first = x.narrow(axis, 0, 1).unwrap().to_vec().unwrap();
        assert_eq!(parts[0].to_vec().unwrap(), first, "split axis {axis}");
        assert!(parts[1].to_vec().unwrap().is_empty());
        let refs: Vec<&Tensor> = parts.iter().collect();
        let back = Tensor::concat(&refs, axis).unwrap();
        assert_eq!(back.dims(), &shape);
        assert_eq!(back.to_vec().unwrap(), v, "concat axis {axis}");

        // concat of x with a different tensor, against the reference.
        let mut other_shape = shape.to_vec();
        other_shape[axis] = 2;
        let w: Vec<f32> = (0..numel(&other_shape)).map(|i| -(i as f32)).collect();
        let y = tensor(&e, w.clone(), &other_shape);
        let cat = Tensor::concat(&[&x, &y, &x], axis).unwrap();
        let mut cat_shape = shape.to_vec();
        cat_shape[axis] = 2 * shape[axis] + 2;
        assert_eq!(cat.dims(), cat_shape.as_slice());
        let want: Vec<f32> = (0..numel(&cat_shape))
            .map(|o| {
                let mut idx = unravel(o, &cat_shape);
                if idx[axis] < shape[axis] {
                    v[ravel(&idx, &shape)]
                } else if idx[axis] < shape[axis] + 2 {
                    idx[axis] -= shape[axis];
                    w[ravel(&idx, &other_shape)]
                } else {
                    idx[axis] -= shape[axis] + 2;
                    v[ravel(&idx, &shape)]
                }
            })
            .collect();
        assert_same(
            &cat.to_vec().unwrap(),
            &want,
            &format!("concat axis {axis}"),
        );
    }
    // Hand values.
    let m = tensor(&e, vec![1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let n = tensor(&e, vec![5.0, 6.0], &[1, 2]);
    assert_eq!(
        Tensor::concat(&[&m, &n], 0).unwrap().to_vec().unwrap(),
        vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    );
    let n = tensor(&e, vec![5.0, 6.0], &[2, 1]);
    assert_eq!(
        Tensor::concat(&[&m, &n], 1).unwrap().to_vec().unwrap(),
        vec![1.0, 2.0, 5.0, 3.0, 4.0, 6.0]
    );
    assert_eq!(
        Tensor::concat(&[&m], 0).unwrap().to_vec().unwrap(),
        m.to_vec().unwrap()
    );
    let halves = Tensor::arange_in(&e, 0.0, 5.0, 1.0)
        .split(0, &[2, 3])
        .unwrap();
    assert_eq!(halves[0].to_vec().unwrap(), vec![0.0, 1.0]);
    assert_eq!(halves[1].to_vec().unwrap(), vec![2.0, 3.0, 4.0]);
}

// ----- in-place ops -------------------------------------------------------------------

#[test]
fn in_place_write_is_ordered_after_earlier_reads() {
    for mode in MODES {
        let e = engine_in(mode);
        let x = tensor(&e, vec![1.0, 2.0, 3.0], &[3]);
        let y = x.clone();
        let before = &x + 0.0;
        let doubled = x.mul_scalar(2.0);
        x.add_scalar_(1.0);
        let after = &x + 0.0;
        // Read the new value first: the earlier readers must still see the old one.
        assert_eq!(x.to_vec().unwrap(), vec![2.0, 3.0, 4.0], "{mode:?}");
        assert_eq!(y.to_vec().unwrap(), vec![2.0, 3.0, 4.0], "{mode:?}");
        assert_eq!(before.to_vec().unwrap(), vec![1.0, 2.0, 3.0], "{mode:?}");
        assert_eq!(doubled.to_vec().unwrap(), vec![2.0, 4.0, 6.0], "{mode:?}");
        assert_eq!(after.to_vec().unwrap(), vec![2.0, 3.0, 4.0], "{mode:?}");

        // The same, reading the old snapshot first, with a chain of writes.
        let x = tensor(&e, vec![1.0, 2.0], &[2]);
        let snap = x.exp().log();
        x.mul_scalar_(10.0);
        let mid = x.sum();
        x.sub_scalar_(5.0);
        x.div_scalar_(5.0);
        assert_close32(&snap.to_vec().unwrap(), &[1.0, 2.0], 1e-6, "snapshot");
        assert_eq!(x.to_vec().unwrap(), vec![1.0, 3.0], "{mode:?}");
        assert_eq!(mid.item().unwrap(), 30.0, "{mode:?}");
    }
}

#[test]
fn in_place_tensor_ops_broadcast_and_alias() {
    for mode in MODES {
        let e = engine_in(mode);
        let x = tensor(&e, vec![1.0, 2.0, 3.0], &[3]);
        // Aliasing: x += x.
        x.add_(&x).unwrap();
        assert_eq!(x.to_vec().unwrap(), vec![2.0, 4.0, 6.0], "{mode:?}");
        x.mul_(&x).unwrap();
        assert_eq!(x.to_vec().unwrap(), vec![4.0, 16.0, 36.0], "{mode:?}");
        // Aliasing through a view with another shape.
        let v = x.reshape([3, 1]).unwrap();
        x.sub_(&v.reshape([3]).unwrap()).unwrap();
        assert_eq!(v.to_vec().unwrap(), vec![0.0; 3], "{mode:?}");

        let m = tensor(&e, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
        let row = tensor(&e, vec![10.0, 20.0, 30.0], &[3]);
        let col = tensor(&e, vec![2.0, 4.0], &[2, 1]);
        m.add_(&row).unwrap();
        assert_eq!(
            m.to_vec().unwrap(),
            vec![11.0, 22.0, 33.0, 14.0, 25.0, 36.0]
        );
        m.div_(&col).unwrap();
        assert_eq!(m.to_vec().unwrap(), vec![5.5, 11.0, 16.5, 3.5, 6.25, 9.0]);
        m.sub_(&Tensor::scalar_in(&e, 0.5)).unwrap();
        m.mul_(&Tensor::full_in(&e, [1, 3], 2.0)).unwrap();
        assert_eq!(m.to_vec().unwrap(), vec![10.0, 21.0, 32.0, 6.0, 11.5, 17.0]);
        // fill_, relu_, copy_from.
        let r = tensor(&e, vec![-1.0, 0.5, -0.0, 2.0], &[4]);
        r.relu_();
        assert_eq!(r.to_vec().unwrap(), vec![0.0, 0.5, -0.0, 2.0]);
        let c = Tensor::zeros_in(&e, [4]);
        let c_before = c.sum();
        c.copy_from(&r).unwrap();
        r.fill_(7.0);
        assert_eq!(c.to_vec().unwrap(), vec![0.0, 0.5, 0.0, 2.0], "{mode:?}");
        assert_eq!(r.to_vec().unwrap(), vec![7.0; 4], "{mode:?}");
        assert_eq!(c_before.item().unwrap(), 0.0, "{mode:?}");
        c.copy_from(&c).unwrap();
        assert_eq!(c.to_vec().unwrap(), vec![0.0, 0.5, 0.0, 2.0]);
        // An in-place op on an empty tensor is a no-op.
        let z = Tensor::zeros_in(&e, [0, 3]);
        z.add_(&Tensor::ones_in(&e, [3])).unwrap();
        z.add_scalar_(1.0);
        assert!(z.to_vec().unwrap().is_empty());
    }
}

#[test]
fn in_place_shape_errors() {
    let e = engine();
    let x = Tensor::zeros_in(&e, [3]);
    // The right operand must broadcast to the left one, not the other way round.
    match x.add_(&Tensor::zeros_in(&e, [2, 3])) {
        Err(Error::Shape { op, shapes, .. }) => {
            assert_eq!(op, "add_");
            assert_eq!(shapes, "[3] and [2, 3]");
        }
        other => panic!("expected a shape error, got {other:?}"),
    }
    assert!(matches!(
        x.mul_(&Tensor::zeros_in(&e, [2])),
        Err(Error::Shape { op: "mul_", .. })
    ));
    assert!(matches!(
        x.copy_from(&Tensor::zeros_in(&e, [1])),
        Err(Error::Shape {
            op: "copy_from",
            ..
        })
    ));
    // x is untouched and usable.
    x.add_scalar_(1.0);
    assert_eq!(x.to_vec().unwrap(), vec![1.0; 3]);
}

// ----- operators ------------------------------------------------------------------

#[test]
fn operators_on_references_values_and_scalars() {
    let e = engine();
    let a = tensor(&e, vec![1.0, 2.0, 4.0], &[3]);
    let b = tensor(&e, vec![4.0, 5.0, 8.0], &[3]);
    let v = |t: Tensor| t.to_vec().unwrap();
    assert_eq!(v(&a + &b), vec![5.0, 7.0, 12.0]);
    assert_eq!(v(&b - &a), vec![3.0, 3.0, 4.0]);
    assert_eq!(v(&a * &b), vec![4.0, 10.0, 32.0]);
    assert_eq!(v(&b / &a), vec![4.0, 2.5, 2.0]);
    assert_eq!(v(a.clone() + b.clone()), vec![5.0, 7.0, 12.0]);
    assert_eq!(v(a.clone() - &b), vec![-3.0, -3.0, -4.0]);
    assert_eq!(v(&a * b.clone()), vec![4.0, 10.0, 32.0]);
    assert_eq!(v(a.clone() * 2.0), vec![2.0, 4.0, 8.0]);
    assert_eq!(v(&a + 1.0), vec![2.0, 3.0, 5.0]);
    assert_eq!(v(&a - 1.0), vec![0.0, 1.0, 3.0]);
    assert_eq!(v(&a / 2.0), vec![0.5, 1.0, 2.0]);
    // Scalar on the left keeps its place: 2 - a, 8 / a.
    assert_eq!(v(2.0 - &a), vec![1.0, 0.0, -2.0]);
    assert_eq!(v(2.0 - a.clone()), vec![1.0, 0.0, -2.0]);
    assert_eq!(v(8.0 / &a), vec![8.0, 4.0, 2.0]);
    assert_eq!(v(3.0 * &a), vec![3.0, 6.0, 12.0]);
    assert_eq!(v(1.0 + a.clone()), vec![2.0, 3.0, 5.0]);
    assert_eq!(v(-&a), vec![-1.0, -2.0, -4.0]);
    assert_eq!(v(-a.clone()), vec![-1.0, -2.0, -4.0]);
    // Broadcasting through operators.
    let col = tensor(&e, vec![10.0, 20.0], &[2, 1]);
    let out = &col + &a;
    assert_eq!(out.dims(), &[2, 3]);
    assert_eq!(v(out), vec![11.0, 12.0, 14.0, 21.0, 22.0, 24.0]);
    // A composite expression against hand values: ((a + b) * 2 - 1) / b.
    let expr = ((&a + &b) * 2.0 - 1.0) / &b;
    assert_close32(&v(expr), &[9.0 / 4.0, 13.0 / 5.0, 23.0 / 8.0], 1e-6, "expr");
}

#[test]
fn compound_assignment_operators_update_every_clone() {
    for mode in MODES {
        let e = engine_in(mode);
        let mut x = tensor(&e, vec![1.0, 2.0, 3.0], &[3]);
        let alias = x.clone();
        let before = x.sum();
        let d = tensor(&e, vec![1.0, 1.0, 1.0], &[3]);
        x += &d;
        x *= 2.0;
        x -= 1.0;
        x /= &Tensor::full_in(&e, [1], 0.5);
        // Aliasing through the operator: x *= x.
        let same = x.clone();
        x *= &same;
        x -= &d;
        assert_eq!(alias.to_vec().unwrap(), vec![35.0, 99.0, 195.0], "{mode:?}");
        assert_eq!(before.item().unwrap(), 6.0, "{mode:?}");
        assert!(x.same_data(&alias));
    }
}

// ----- errors ---------------------------------------------------------------------

#[test]
fn shape_error_names_op_shapes_and_the_recording_location() {
    let e = engine();
    let a = Tensor::zeros_in(&e, [2, 3]);
    let b = Tensor::zeros_in(&e, [4]);
    let line = line!();
    let err = a.add(&b).unwrap_err();
    assert_add_shape_error(&err, Some(line + 1));
    let msg = err.to_string();
    for needle in [
        "add",
        "[2, 3]",
        "[4]",
        "tensor.rs",
        &format!(":{}:", line + 1),
    ] {
        assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
    }
    // Every binary method reports its own name.
    for (name, method, _) in binary_ops() {
        match method(&a, &b) {
            Err(Error::Shape { op, .. }) => assert_eq!(op, name),
            other => panic!("{name}: expected a shape error, got {other:?}"),
        }
    }
}

#[test]
fn matmul_shape_errors() {
    let e = engine();
    let err = Tensor::zeros_in(&e, [2, 3])
        .matmul(&Tensor::zeros_in(&e, [4, 2]))
        .unwrap_err();
    assert!(matches!(err, Error::Shape { op: "matmul", .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("[2, 3]") && msg.contains("[4, 2]"), "{msg}");
    assert!(msg.contains("tensor.rs"), "{msg}");
    for (sa, sb) in [
        (&[3usize][..], &[3usize, 2][..]),
        (&[2, 3][..], &[3][..]),
        (&[2, 3, 4][..], &[3, 4, 5][..]),
        (&[3, 4][..], &[2, 4, 5][..]),
    ] {
        let r = Tensor::zeros_in(&e, sa).matmul(&Tensor::zeros_in(&e, sb));
        assert!(
            matches!(r, Err(Error::Shape { op: "matmul", .. })),
            "{sa:?} @ {sb:?}"
        );
    }
}

#[test]
fn argument_errors() {
    let e = engine();
    let x = Tensor::zeros_in(&e, [2, 3, 4]);
    let invalid = |r: lazyflow::Result<Tensor>, want_op: &str| match r {
        Err(Error::InvalidArgument { op, shape, .. }) => {
            assert_eq!(op, want_op);
            assert!(shape.starts_with('['), "{shape}");
        }
        Err(other) => panic!("{want_op}: expected InvalidArgument, got {other}"),
        Ok(t) => panic!("{want_op}: expected an error, got {t:?}"),
    };
    // narrow out of range, including an overflowing start + len.
    invalid(x.narrow(1, 2, 2), "narrow");
    invalid(x.narrow(2, 5, 0), "narrow");
    invalid(x.narrow(0, usize::MAX, 2), "narrow");
    invalid(x.narrow(3, 0, 1), "narrow");
    // Bad axes.
    invalid(x.sum_axis(3), "sum");
    invalid(x.mean_axis(7), "mean");
    invalid(x.max_axis(3), "max");
    invalid(x.min_axis(3), "min");
    invalid(x.argmax_axis(3), "argmax");
    invalid(x.transpose(0, 3), "transpose");
    invalid(Tensor::concat(&[&x, &x], 3), "concat");
    invalid(Tensor::concat(&[], 0), "concat");
    invalid(Tensor::scalar_in(&e, 1.0).sum_axis(0), "sum");
    match x.split(1, &[1, 1]) {
        Err(Error::InvalidArgument { op: "split", .. }) => {}
        other => panic!("split: {other:?}"),
    }
    match x.split(5, &[1]) {
        Err(Error::InvalidArgument { op: "split", .. }) => {}
        other => panic!("split: {other:?}"),
    }
    // item() on more than one element.
    let two = Tensor::zeros_in(&e, [2]);
    match two.item() {
        Err(Error::InvalidArgument {
            op: "item", shape, ..
        }) => assert_eq!(shape, "[2]"),
        other => panic!("item: {other:?}"),
    }
    assert!(Tensor::zeros_in(&e, [0]).item().is_err());
    assert_eq!(Tensor::ones_in(&e, [1, 1, 1]).item().unwrap(), 1.0);
    // Random bounds.
    invalid(
        Tensor::rand_uniform_in(&e, [3], 2.0, 1.0, 0),
        "rand_uniform",
    );
    invalid(
        Tensor::rand_uniform_in(&e, [3], 0.0, f32::INFINITY, 0),
        "rand_uniform",
    );
    invalid(Tensor::rand_normal_in(&e, [3], 0.0, -1.0, 0), "rand_normal");
    invalid(
        Tensor::rand_normal_in(&e, [3], f32::NAN, 1.0, 0),
        "rand_normal",
    );
    // from_vec with the wrong number of values.
    let line = line!();
    let err = Tensor::from_vec_in(&e, vec![1.0, 2.0, 3.0], [2, 2]).unwrap_err();
    match &err {
        Error::InvalidArgument {
            op,
            shape,
            location,
            ..
        } => {
            assert_eq!(*op, "from_vec");
            assert_eq!(shape, "[2, 2]");
            assert_eq!(location.file(), file!());
            assert_eq!(location.line(), line + 1);
        }
        other => panic!("from_vec: {other:?}"),
    }
    // Shape errors of the layout ops.
    let reshape = x.reshape([5, 5]).unwrap_err();
    assert!(
        matches!(reshape, Error::Shape { op: "reshape", .. }),
        "{reshape:?}"
    );
    assert!(reshape.to_string().contains("[2, 3, 4]"));
    assert!(reshape.to_string().contains("[5, 5]"));
    let y = Tensor::zeros_in(&e, [2, 5, 4]);
    assert!(matches!(
        Tensor::concat(&[&x, &y], 2),
        Err(Error::Shape { op: "concat", .. })
    ));
    assert!(matches!(
        Tensor::concat(&[&x, &Tensor::zeros_in(&e, [2, 3])], 0),
        Err(Error::Shape { op: "concat", .. })
    ));
    // The engine is fine afterwards.
    assert_eq!(Tensor::concat(&[&x, &y], 1).unwrap().dims(), &[2, 8, 4]);
}

#[test]
fn mixing_engines_is_an_error() {
    let e1 = engine();
    let e2 = engine();
    let a = Tensor::ones_in(&e1, [2]);
    let b = Tensor::ones_in(&e2, [2]);
    assert!(matches!(
        a.add(&b),
        Err(Error::EngineMismatch { op: "add", .. })
    ));
    let row = a.reshape([1, 2]).unwrap();
    let col = b.reshape([2, 1]).unwrap();
    assert!(matches!(
        row.matmul(&col),
        Err(Error::EngineMismatch { op: "matmul", .. })
    ));
    assert!(matches!(
        Tensor::concat(&[&a, &b], 0),
        Err(Error::EngineMismatch { op: "concat", .. })
    ));
    assert!(matches!(
        a.add_(&b),
        Err(Error::EngineMismatch { op: "add_", .. })
    ));
    assert_eq!(a.sum().item().unwrap(), 2.0);
    assert_eq!(b.sum().item().unwrap(), 2.0);
}

#[test]
fn operator_shape_errors_poison_the_result_and_its_dependents() {
    for mode in MODES {
        let e = engine_in(mode);
        let a = Tensor::ones_in(&e, [2, 3]);
        let b = Tensor::ones_in(&e, [4]);
        let line = line!();
        let bad = &a + &b;
        let err = bad.to_vec().unwrap_err();
        assert_add_shape_error(&err, Some(line + 1));
        assert!(bad.wait_to_read().is_err());
        assert!(format!("{bad}").contains("error"), "{bad}");
        // Everything computed from it fails with the same error.
        let derived = bad.exp();
        assert_eq!(derived.to_vec().unwrap_err().to_string(), err.to_string());
        let fresh = (&a + &b).exp();
        assert_add_shape_error(&fresh.to_vec().unwrap_err(), None);
        let deeper = (bad.sum() * 2.0).sqrt();
        assert_eq!(deeper.item().unwrap_err().to_string(), err.to_string());
        let mixed = bad.matmul(&Tensor::ones_in(&e, [3, 1])).unwrap();
        assert_eq!(mixed.to_vec().unwrap_err().to_string(), err.to_string());
        // Other operator kinds.
        assert!(matches!(
            (a.clone() * b.clone()).to_vec(),
            Err(Error::Shape { op: "mul", .. })
        ));
        assert!(matches!(
            (&b / a.clone()).to_vec(),
            Err(Error::Shape { op: "div", .. })
        ));
        // The inputs and the engine still work.
        assert_eq!((&a + 1.0).sum().item().unwrap(), 12.0, "{mode:?}");
        e.wait_all().unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        assert_eq!(b.sum().item().unwrap(), 4.0);
    }
}

#[test]
fn compound_assignment_with_bad_shapes_poisons_the_target() {
    for mode in MODES {
        let e = engine_in(mode);
        let mut x = Tensor::ones_in(&e, [3]);
        let other = Tensor::ones_in(&e, [2]);
        let before = &x + 0.0;
        x += &other;
        let err = x.to_vec().unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("add_"), "{msg}");
        assert!(msg.contains("tensor.rs"), "{msg}");
        assert!((&x * 2.0).to_vec().is_err());
        // An earlier reader is unaffected.
        assert_eq!(before.to_vec().unwrap(), vec![1.0; 3], "{mode:?}");
        assert_eq!(other.to_vec().unwrap(), vec![1.0; 2]);
    }
}

/// Regression: in-place ops used to be recorded as writes only, so an update of a
/// poisoned tensor ran on its (empty) buffer and its success cleared the poison.
/// They now also read their target, and are skipped like any reader.
#[test]
fn in_place_op_on_a_poisoned_tensor_keeps_the_error() {
    let e = engine();
    let a = Tensor::ones_in(&e, [2, 3]);
    let b = Tensor::ones_in(&e, [4]);
    let bad = &a + &b;
    bad.add_scalar_(1.0);
    match bad.to_vec() {
        Err(Error::Shape { op: "add", .. }) => {}
        Err(other) => panic!("unexpected error {other}"),
        Ok(v) => panic!("poison cleared: shape {:?} but data {v:?}", bad.dims()),
    }
    let bad2 = &a + &b;
    bad2.add_(&Tensor::ones_in(&e, [1])).unwrap();
    assert!(bad2.to_vec().is_err(), "add_ cleared the poison");
    // A tensor poisoned by a failed node, then updated in place.
    let mut x = Tensor::ones_in(&e, [3]);
    x += &Tensor::ones_in(&e, [2]);
    x.mul_scalar_(2.0);
    assert!(x.to_vec().is_err(), "mul_scalar_ cleared the poison");
}

// ----- random ---------------------------------------------------------------------

#[test]
fn rand_uniform_is_deterministic_bounded_and_centred() {
    let e = engine();
    let n = 10_000;
    let u1 = Tensor::rand_uniform_in(&e, [100, 100], -2.0, 3.0, 7).unwrap();
    let u2 = Tensor::rand_uniform_in(&e, [n], -2.0, 3.0, 7).unwrap();
    let u3 = Tensor::rand_uniform_in(&e, [n], -2.0, 3.0, 8).unwrap();
    let (v1, v2, v3) = (
        u1.to_vec().unwrap(),
        u2.to_vec().unwrap(),
        u3.to_vec().unwrap(),
    );
    assert_eq!(u1.dims(), &[100, 100]);
    assert_eq!(v1, v2, "same seed, same values");
    assert_ne!(v1, v3, "another seed, other values");
    assert!(v1.iter().all(|&x| (-2.0..3.0).contains(&x)));
    let mean = v1.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
    assert!((mean - 0.5).abs() < 0.05, "mean {mean}");
    // Variance of U(a, b) is (b - a)^2 / 12.
    let var = v1.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n as f64;
    assert!((var - 25.0 / 12.0).abs() < 0.1, "variance {var}");
    // The engine's own mean agrees with the naive one.
    let m = u1.mean().item().unwrap() as f64;
    assert!((m - mean).abs() < 1e-4, "{m} vs {mean}");
    // Degenerate range.
    let c = Tensor::rand_uniform_in(&e, [4], 1.5, 1.5, 0).unwrap();
    assert_eq!(c.to_vec().unwrap(), vec![1.5; 4]);
}

#[test]
fn rand_normal_has_the_requested_moments() {
    let e = engine();
    let n = 10_000;
    let g = Tensor::rand_normal_in(&e, [n], 1.0, 2.0, 3).unwrap();
    let v = g.to_vec().unwrap();
    assert_eq!(
        v,
        Tensor::rand_normal_in(&e, [n], 1.0, 2.0, 3)
            .unwrap()
            .to_vec()
            .unwrap()
    );
    assert!(v.iter().all(|x| x.is_finite()));
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
    let std = (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n as f64).sqrt();
    assert!((mean - 1.0).abs() < 0.1, "mean {mean}");
    assert!((std - 2.0).abs() < 0.1, "std {std}");
    // About 68% within one standard deviation.
    let within = v.iter().filter(|&&x| (x - 1.0).abs() < 2.0).count() as f64 / n as f64;
    assert!((within - 0.6827).abs() < 0.03, "within one std: {within}");
    let z = Tensor::rand_normal_in(&e, [3], 4.0, 0.0, 1).unwrap();
    assert_eq!(z.to_vec().unwrap(), vec![4.0; 3]);
}

// ----- printing -------------------------------------------------------------------

#[test]
fn display_prints_nested_data_and_shape() {
    let e = engine();
    let m = tensor(&e, vec![1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let s = format!("{m}");
    assert!(s.contains("[[1.0, 2.0], [3.0, 4.0]]"), "{s}");
    assert!(s.contains("shape=[2, 2]"), "{s}");
    assert_eq!(
        s,
        "tensor([[1.0, 2.0], [3.0, 4.0]], shape=[2, 2], device=cpu)"
    );
    // Printing blocks: a lazily recorded op is computed for the print.
    let lazy = &m * 2.0;
    assert!(format!("{lazy}").contains("[[2.0, 4.0], [6.0, 8.0]]"));
    assert_eq!(
        format!("{}", Tensor::scalar_in(&e, 0.5)),
        "tensor(0.5, shape=[], device=cpu)"
    );
    assert_eq!(
        format!("{}", Tensor::zeros_in(&e, [0, 2])),
        "tensor([], shape=[0, 2], device=cpu)"
    );
    // Long dimensions elide their middle.
    let long = Tensor::arange_in(&e, 0.0, 8.0, 1.0);
    let s = format!("{long}");
    assert!(s.contains("[0.0, 1.0, 2.0, ..., 5.0, 6.0, 7.0]"), "{s}");
    // Debug does not block and shows the shape.
    let d = format!("{:?}", &m + 1.0);
    assert!(d.contains("[2, 2]"), "{d}");
}

// ----- modes ----------------------------------------------------------------------

#[test]
fn a_small_model_gives_the_same_result_in_every_mode() {
    let mut results = Vec::new();
    for mode in MODES {
        let e = engine_in(mode);
        assert_eq!(e.mode(), mode);
        let x = Tensor::arange_in(&e, 0.0, 12.0, 1.0)
            .reshape([3, 4])
            .unwrap();
        let w = Tensor::rand_uniform_in(&e, [4, 5], -1.0, 1.0, 42).unwrap();
        let bias = Tensor::full_in(&e, [5], 0.1);
        let h = (x.matmul(&w).unwrap() + &bias).relu();
        let y = h.sum_axis(1).unwrap().sigmoid();
        let total = y.mean();
        // Reference for the same weights.
        let wv = w.to_vec().unwrap();
        let want_y: Vec<f64> = (0..3)
            .map(|i| {
                let s: f64 = (0..5)
                    .map(|j| {
                        let acc: f64 = (0..4)
                            .map(|k| (i * 4 + k) as f64 * wv[k * 5 + j] as f64)
                            .sum::<f64>()
                            + 0.1f32 as f64;
                        acc.max(0.0)
                    })
                    .sum();
                1.0 / (1.0 + (-s).exp())
            })
            .collect();
        assert_close(
            &y.to_vec().unwrap(),
            &want_y,
            1e-5,
            1e-6,
            &format!("{mode:?}"),
        );
        results.push((y.to_vec().unwrap(), total.item().unwrap()));
        e.wait_all().unwrap();
    }
    assert!(
        results.windows(2).all(|w| w[0] == w[1]),
        "modes disagree: {results:?}"
    );
}

#[test]
fn many_small_ops_in_every_mode() {
    for mode in MODES {
        let e = engine_in(mode);
        let mut acc = Tensor::zeros_in(&e, [4]);
        let one = Tensor::ones_in(&e, [4]);
        let mut snapshots = Vec::new();
        for i in 0..200 {
            acc = &acc + &one;
            if i % 50 == 49 {
                snapshots.push(acc.sum());
            }
        }
        assert_eq!(acc.to_vec().unwrap(), vec![200.0; 4], "{mode:?}");
        let got: Vec<f32> = snapshots.iter().map(|s| s.item().unwrap()).collect();
        assert_eq!(got, vec![200.0, 400.0, 600.0, 800.0], "{mode:?}");
    }
}
