//! NaN, infinities and signed zeros through every elementwise op (binary with
//! broadcasting, with a scalar on either side, unary), their in-place forms,
//! fused chains of them, and the reductions, on every device, with GPU fusion
//! on and off.
//!
//! The CPU device is the reference for every other device, element by element:
//! NaN exactly where the CPU has NaN, the same infinity where it has one, and
//! finite values within a tolerance (GPUs approximate exp, log, pow, tanh). The
//! CPU device itself is checked against `f32`'s own functions (`f32::powf`,
//! `f32::ln`, ...) and numpy's rules for maximum, minimum and the reductions.

mod common;

use common::{device_test, flag, nan_max, nan_min};
use lazyflow::{Device, Engine, Tensor};

/// Inputs: NaN of both signs, both infinities, both zeros, and finite values
/// that overflow, underflow or hit the special cases of pow under the ops.
const VALUES: [f32; 21] = [
    f32::NAN,
    -f32::NAN,
    f32::INFINITY,
    f32::NEG_INFINITY,
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    -0.5,
    2.0,
    -3.0,
    10.0,
    -10.0,
    100.0,
    -100.0,
    1e30,
    -1e30,
    f32::MAX,
    -f32::MAX,
    1e-3,
];

/// Relative tolerance (plus the same absolute) of exactly rounded ops.
const EXACT: f32 = 1e-6;
/// Relative tolerance (plus the same absolute) of ops that GPUs approximate.
const APPROX: f32 = 2e-4;

fn sigmoid(x: f32) -> f32 {
    (1.0 / (1.0 + (-(x as f64)).exp())) as f32
}

fn relu(x: f32) -> f32 {
    if x < 0.0 {
        0.0
    } else {
        x
    }
}

/// Whether `got` stands for `want`: NaN for NaN, the same infinity, or a finite
/// value within `tol`.
fn agrees(got: f32, want: f32, tol: f32) -> bool {
    if want.is_nan() {
        got.is_nan()
    } else if want.is_infinite() {
        got == want
    } else {
        got.is_finite() && (got - want).abs() <= tol * (1.0 + want.abs())
    }
}

/// A value with its bits, so that NaNs and zeros of both signs show.
fn show(v: f32) -> String {
    format!("{v:?} ({:#010x})", v.to_bits())
}

/// An engine per fusion setting, and where the failures are collected.
struct Checker {
    device: Device,
    engine: Engine,
    label: String,
    /// (what, message) per mismatching element.
    failures: Vec<(String, String)>,
}

impl Checker {
    fn new(device: Device, fusion: bool) -> Checker {
        let engine = Engine::builder().workers(2).fusion(fusion).build().unwrap();
        let label = format!("{device} with fusion {}", if fusion { "on" } else { "off" });
        Checker {
            device,
            engine,
            label,
            failures: Vec::new(),
        }
    }

    /// Runs `f` on the CPU device and on the device under test. The device must
    /// agree with the CPU, and the CPU with `reference`; `operands(i)` names the
    /// inputs of element `i` in messages.
    fn check(
        &mut self,
        what: &str,
        f: impl Fn(&Engine, Device) -> Tensor,
        reference: &[f32],
        tol: f32,
        operands: impl Fn(usize) -> String,
    ) {
        let read = |device: Device| -> Result<Vec<f32>, String> {
            let t = f(&self.engine, device);
            if t.device() != device {
                return Err(format!("result on {} instead of {device}", t.device()));
            }
            t.to_vec().map_err(|e| e.to_string())
        };
        let cpu = match read(Device::Cpu) {
            Ok(v) => v,
            Err(e) => {
                self.failures
                    .push((what.into(), format!("on the cpu: {e}")));
                return;
            }
        };
        assert_eq!(cpu.len(), reference.len(), "{what}: reference length");
        for (i, (&c, &r)) in cpu.iter().zip(reference).enumerate() {
            if !agrees(c, r, tol) {
                self.failures.push((
                    what.into(),
                    format!(
                        "{what}({}): cpu {} but f32 gives {}",
                        operands(i),
                        show(c),
                        show(r)
                    ),
                ));
            }
        }
        if self.device == Device::Cpu {
            return;
        }
        let got = match read(self.device) {
            Ok(v) => v,
            Err(e) => {
                self.failures.push((what.into(), e));
                return;
            }
        };
        assert_eq!(got.len(), cpu.len(), "{what}: length on {}", self.label);
        for (i, (&g, &c)) in got.iter().zip(&cpu).enumerate() {
            if !agrees(g, c, tol) {
                self.failures.push((
                    what.into(),
                    format!(
                        "{what}({}): {} but the cpu gives {}",
                        operands(i),
                        show(g),
                        show(c)
                    ),
                ));
            }
        }
    }

    /// The failures seen, if any: how many per op, and a few of each.
    fn report(self) -> Option<String> {
        if self.failures.is_empty() {
            return None;
        }
        let mut report = String::new();
        let mut ops: Vec<&str> = Vec::new();
        for (what, _) in &self.failures {
            if !ops.contains(&what.as_str()) {
                ops.push(what);
            }
        }
        for op in ops {
            let all: Vec<&str> = self
                .failures
                .iter()
                .filter(|(what, _)| what == op)
                .map(|(_, m)| m.as_str())
                .collect();
            report += &format!("{op}: {} elements differ, e.g.\n", all.len());
            for m in all.iter().take(4) {
                report += &format!("    {m}\n");
            }
        }
        Some(format!("mismatches on {}:\n{report}", self.label))
    }
}

/// Runs `body` with fusion on and off (the CPU has no fusion: once), then fails
/// with every mismatch seen.
fn each_setting(device: Device, body: impl Fn(&mut Checker)) {
    let settings: &[bool] = if device == Device::Cpu {
        &[true]
    } else {
        &[true, false]
    };
    let mut reports = Vec::new();
    for &fusion in settings {
        let mut checker = Checker::new(device, fusion);
        body(&mut checker);
        reports.extend(checker.report());
    }
    assert!(reports.is_empty(), "{}", reports.join("\n"));
}

/// `data` with `dims`, on `device`.
fn input(e: &Engine, device: Device, data: &[f32], dims: &[usize]) -> Tensor {
    Tensor::from_slice_in(e, data, dims)
        .unwrap()
        .to(device)
        .unwrap()
}

/// `VALUES` as a vector on `device`.
fn values(e: &Engine, device: Device) -> Tensor {
    input(e, device, &VALUES, &[VALUES.len()])
}

/// A reference function on `f32`s.
type Ref1 = fn(f32) -> f32;
/// A reference function of two `f32`s.
type Ref2 = fn(f32, f32) -> f32;

type Unary = fn(&Tensor) -> Tensor;

fn unary_ops() -> Vec<(&'static str, Unary, Ref1, f32)> {
    vec![
        ("neg", Tensor::neg, |x| -x, EXACT),
        ("exp", Tensor::exp, f32::exp, APPROX),
        ("log", Tensor::log, f32::ln, APPROX),
        ("sqrt", Tensor::sqrt, f32::sqrt, APPROX),
        ("abs", Tensor::abs, f32::abs, EXACT),
        ("relu", Tensor::relu, relu, EXACT),
        ("sigmoid", Tensor::sigmoid, sigmoid, APPROX),
        ("tanh", Tensor::tanh, f32::tanh, APPROX),
    ]
}

type Binary = fn(&Tensor, &Tensor) -> lazyflow::Result<Tensor>;

fn binary_ops() -> Vec<(&'static str, Binary, Ref2, f32)> {
    vec![
        ("add", Tensor::add, |a, b| a + b, EXACT),
        ("sub", Tensor::sub, |a, b| a - b, EXACT),
        ("mul", Tensor::mul, |a, b| a * b, EXACT),
        ("div", Tensor::div, |a, b| a / b, EXACT),
        ("pow", Tensor::pow, f32::powf, APPROX),
        ("maximum", Tensor::maximum, nan_max, EXACT),
        ("minimum", Tensor::minimum, nan_min, EXACT),
        ("eq", Tensor::eq, |a, b| flag(a == b), EXACT),
        ("ne", Tensor::ne, |a, b| flag(a != b), EXACT),
        ("lt", Tensor::lt, |a, b| flag(a < b), EXACT),
        ("le", Tensor::le, |a, b| flag(a <= b), EXACT),
        ("gt", Tensor::gt, |a, b| flag(a > b), EXACT),
        ("ge", Tensor::ge, |a, b| flag(a >= b), EXACT),
    ]
}

/// Every pair of `VALUES`: element `i * n + j` is `(VALUES[i], VALUES[j])`.
fn pairs() -> (usize, impl Fn(usize) -> String) {
    let n = VALUES.len();
    (n, move |i: usize| {
        format!("{}, {}", show(VALUES[i / n]), show(VALUES[i % n]))
    })
}

fn pair_reference(f: Ref2) -> Vec<f32> {
    let n = VALUES.len();
    (0..n * n)
        .map(|i| f(VALUES[i / n], VALUES[i % n]))
        .collect()
}

fn elementwise_unary(device: Device) {
    each_setting(device, |c| {
        for (name, op, reference, tol) in unary_ops() {
            let want: Vec<f32> = VALUES.iter().map(|&x| reference(x)).collect();
            c.check(
                name,
                |e, d| op(&values(e, d)),
                &want,
                tol,
                |i| show(VALUES[i]),
            );
        }
    });
}
device_test!(elementwise_unary);

fn elementwise_binary(device: Device) {
    each_setting(device, |c| {
        let (n, operands) = pairs();
        for (name, op, reference, tol) in binary_ops() {
            let want = pair_reference(reference);
            // A column against a row: every pair, through broadcasting.
            c.check(
                name,
                |e, d| {
                    let a = input(e, d, &VALUES, &[n, 1]);
                    let b = input(e, d, &VALUES, &[1, n]);
                    op(&a, &b).unwrap()
                },
                &want,
                tol,
                &operands,
            );
            // Both operands the same tensor.
            let same: Vec<f32> = VALUES.iter().map(|&x| reference(x, x)).collect();
            c.check(
                &format!("{name} of a tensor with itself"),
                |e, d| {
                    let x = values(e, d);
                    op(&x, &x).unwrap()
                },
                &same,
                tol,
                |i| show(VALUES[i]),
            );
        }
    });
}
device_test!(elementwise_binary);

type Scalar = fn(&Tensor, f32) -> Tensor;

/// Ops with a scalar right operand, and (`true`) those with a scalar left one.
fn scalar_ops() -> Vec<(&'static str, Scalar, bool, Ref2, f32)> {
    vec![
        ("add_scalar", Tensor::add_scalar, false, |a, b| a + b, EXACT),
        ("sub_scalar", Tensor::sub_scalar, false, |a, b| a - b, EXACT),
        ("mul_scalar", Tensor::mul_scalar, false, |a, b| a * b, EXACT),
        ("div_scalar", Tensor::div_scalar, false, |a, b| a / b, EXACT),
        ("powf", Tensor::powf, false, f32::powf, APPROX),
        (
            "maximum_scalar",
            Tensor::maximum_scalar,
            false,
            nan_max,
            EXACT,
        ),
        (
            "minimum_scalar",
            Tensor::minimum_scalar,
            false,
            nan_min,
            EXACT,
        ),
        (
            "eq_scalar",
            Tensor::eq_scalar,
            false,
            |a, b| flag(a == b),
            EXACT,
        ),
        (
            "lt_scalar",
            Tensor::lt_scalar,
            false,
            |a, b| flag(a < b),
            EXACT,
        ),
        (
            "gt_scalar",
            Tensor::gt_scalar,
            false,
            |a, b| flag(a > b),
            EXACT,
        ),
        ("x + s", |x, s| x + s, false, |a, b| a + b, EXACT),
        ("s + x", |x, s| s + x, true, |a, b| a + b, EXACT),
        ("s - x", |x, s| s - x, true, |a, b| a - b, EXACT),
        ("s * x", |x, s| s * x, true, |a, b| a * b, EXACT),
        ("s / x", |x, s| s / x, true, |a, b| a / b, EXACT),
    ]
}

/// One op per scalar, stacked: row `i` is the op with scalar `VALUES[i]`.
fn stacked(e: &Engine, d: Device, f: impl Fn(&Tensor, f32) -> Tensor) -> Tensor {
    let n = VALUES.len();
    let rows: Vec<Tensor> = VALUES
        .iter()
        .map(|&s| f(&values(e, d), s).reshape([1, n]).unwrap())
        .collect();
    Tensor::concat(&rows.iter().collect::<Vec<_>>(), 0).unwrap()
}

/// The reference of a stacked op: element `(i, j)` applies it to scalar
/// `VALUES[i]` and element `VALUES[j]`.
fn stacked_reference(f: Ref2, scalar_left: bool) -> Vec<f32> {
    let n = VALUES.len();
    (0..n * n)
        .map(|i| {
            let (s, x) = (VALUES[i / n], VALUES[i % n]);
            if scalar_left {
                f(s, x)
            } else {
                f(x, s)
            }
        })
        .collect()
}

fn scalar_operands(scalar_left: bool) -> impl Fn(usize) -> String {
    let n = VALUES.len();
    move |i| {
        let (s, x) = (show(VALUES[i / n]), show(VALUES[i % n]));
        if scalar_left {
            format!("scalar {s}, {x}")
        } else {
            format!("{x}, scalar {s}")
        }
    }
}

fn elementwise_scalar(device: Device) {
    each_setting(device, |c| {
        for (name, op, scalar_left, reference, tol) in scalar_ops() {
            c.check(
                name,
                |e, d| stacked(e, d, op),
                &stacked_reference(reference, scalar_left),
                tol,
                scalar_operands(scalar_left),
            );
        }
    });
}
device_test!(elementwise_scalar);

type InPlace = fn(&Tensor, &Tensor) -> lazyflow::Result<()>;
type InPlaceScalar = fn(&mut Tensor, f32);

fn in_place(device: Device) {
    each_setting(device, |c| {
        let (n, operands) = pairs();
        let tensor_ops: [(&str, InPlace, Ref2); 8] = [
            ("add_", Tensor::add_, |a, b| a + b),
            ("sub_", Tensor::sub_, |a, b| a - b),
            ("mul_", Tensor::mul_, |a, b| a * b),
            ("div_", Tensor::div_, |a, b| a / b),
            (
                "+=",
                |x, y| {
                    let mut x = x.clone();
                    x += y;
                    Ok(())
                },
                |a, b| a + b,
            ),
            (
                "-=",
                |x, y| {
                    let mut x = x.clone();
                    x -= y;
                    Ok(())
                },
                |a, b| a - b,
            ),
            (
                "*=",
                |x, y| {
                    let mut x = x.clone();
                    x *= y;
                    Ok(())
                },
                |a, b| a * b,
            ),
            (
                "/=",
                |x, y| {
                    let mut x = x.clone();
                    x /= y;
                    Ok(())
                },
                |a, b| a / b,
            ),
        ];
        for (name, op, reference) in tensor_ops {
            // Every pair: the target holds the column, broadcast to the square;
            // the operand is the row.
            c.check(
                name,
                |e, d| {
                    let square: Vec<f32> = (0..n * n).map(|i| VALUES[i / n]).collect();
                    let x = input(e, d, &square, &[n, n]);
                    op(&x, &input(e, d, &VALUES, &[n])).unwrap();
                    x
                },
                &pair_reference(reference),
                EXACT,
                &operands,
            );
            // The operand is the target itself.
            c.check(
                &format!("{name} with itself"),
                |e, d| {
                    let x = values(e, d);
                    op(&x, &x).unwrap();
                    x
                },
                &VALUES.iter().map(|&x| reference(x, x)).collect::<Vec<_>>(),
                EXACT,
                |i| show(VALUES[i]),
            );
        }
        let scalar_ops: [(&str, InPlaceScalar, Ref2); 8] = [
            ("add_scalar_", |x, s| x.add_scalar_(s), |a, b| a + b),
            ("sub_scalar_", |x, s| x.sub_scalar_(s), |a, b| a - b),
            ("mul_scalar_", |x, s| x.mul_scalar_(s), |a, b| a * b),
            ("div_scalar_", |x, s| x.div_scalar_(s), |a, b| a / b),
            ("+= s", |x, s| *x += s, |a, b| a + b),
            ("-= s", |x, s| *x -= s, |a, b| a - b),
            ("*= s", |x, s| *x *= s, |a, b| a * b),
            ("/= s", |x, s| *x /= s, |a, b| a / b),
        ];
        for (name, op, reference) in scalar_ops {
            c.check(
                name,
                |e, d| {
                    stacked(e, d, |x, s| {
                        let mut x = x.clone();
                        op(&mut x, s);
                        x
                    })
                },
                &stacked_reference(reference, false),
                EXACT,
                scalar_operands(false),
            );
        }
        c.check(
            "relu_",
            |e, d| {
                let x = values(e, d);
                x.relu_();
                x
            },
            &VALUES.iter().map(|&x| relu(x)).collect::<Vec<_>>(),
            EXACT,
            |i| show(VALUES[i]),
        );
        for value in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0] {
            c.check(
                &format!("fill_({value})"),
                |e, d| {
                    let x = values(e, d);
                    x.fill_(value);
                    x
                },
                &[value; VALUES.len()],
                EXACT,
                |i| show(VALUES[i]),
            );
        }
    });
}
device_test!(in_place);

/// Chains of elementwise ops, which a GPU with fusion runs as one kernel with
/// the intermediate values in registers.
fn fused_chains(device: Device) {
    each_setting(device, |c| {
        let one = |i: usize| show(VALUES[i]);
        let chain = |x: f32| sigmoid(relu(x).exp().ln().sqrt().tanh()).abs();
        c.check(
            "abs(sigmoid(tanh(sqrt(log(exp(relu(x)))))))",
            |e, d| {
                values(e, d)
                    .relu()
                    .exp()
                    .log()
                    .sqrt()
                    .tanh()
                    .sigmoid()
                    .abs()
            },
            &VALUES.iter().map(|&x| chain(x)).collect::<Vec<_>>(),
            APPROX,
            one,
        );
        let mixed = |x: f32| nan_min(nan_max(-x * 2.0, x) / 3.0, 1e30).powf(x);
        c.check(
            "pow(minimum(maximum(-x * 2, x) / 3, 1e30), x)",
            |e, d| {
                let x = values(e, d);
                (x.neg() * 2.0)
                    .maximum(&x)
                    .unwrap()
                    .div_scalar(3.0)
                    .minimum_scalar(1e30)
                    .pow(&x)
                    .unwrap()
            },
            &VALUES.iter().map(|&x| mixed(x)).collect::<Vec<_>>(),
            APPROX,
            one,
        );
        let masks = |x: f32| flag(x > 0.0) + flag(!x.is_nan()) * 2.0 + flag(x < 1.0) * 4.0;
        c.check(
            "gt(x, 0) + eq(x, x) * 2 + lt(x, 1) * 4",
            |e, d| {
                let x = values(e, d);
                let gt = x.gt_scalar(0.0);
                let eq = x.eq(&x).unwrap() * 2.0;
                let lt = x.lt_scalar(1.0) * 4.0;
                gt + eq + lt
            },
            &VALUES.iter().map(|&x| masks(x)).collect::<Vec<_>>(),
            EXACT,
            one,
        );
    });
}
device_test!(fused_chains);

/// Rows for the reductions: NaN among numbers, both infinities, only -inf,
/// zeros of both signs, only NaN.
const ROWS: [[f32; 5]; 8] = [
    [1.0, 2.0, 3.0, 4.0, 5.0],
    [1.0, f32::NAN, 3.0, f32::NAN, f32::NEG_INFINITY],
    [f32::INFINITY, 1.0, f32::NEG_INFINITY, 0.0, 2.0],
    [f32::NEG_INFINITY; 5],
    [f32::INFINITY, f32::INFINITY, 1.0, f32::INFINITY, -0.0],
    [-0.0, 0.0, -0.0, 0.0, -1.0],
    [f32::NAN; 5],
    [-1.0, f32::NEG_INFINITY, -2.0, f32::NAN, f32::INFINITY],
];

/// The reductions with numpy's rules: sums in f64 (no value here overflows),
/// max / min NaN if any element is, argmax the first NaN or the first maximum.
fn reduce_reference(op: &str, lane: &[f32]) -> f32 {
    match op {
        "sum" => lane.iter().map(|&x| x as f64).sum::<f64>() as f32,
        "mean" => (lane.iter().map(|&x| x as f64).sum::<f64>() / lane.len() as f64) as f32,
        "max" => lane.iter().copied().reduce(nan_max).unwrap(),
        "min" => lane.iter().copied().reduce(nan_min).unwrap(),
        "argmax" => {
            if let Some(i) = lane.iter().position(|x| x.is_nan()) {
                return i as f32;
            }
            let mut best = 0;
            for (i, &x) in lane.iter().enumerate() {
                if x > lane[best] {
                    best = i;
                }
            }
            best as f32
        }
        _ => unreachable!("{op}"),
    }
}

type ReduceAll = fn(&Tensor) -> lazyflow::Result<Tensor>;
type ReduceAxis = fn(&Tensor, usize) -> lazyflow::Result<Tensor>;

fn reduce_ops() -> Vec<(&'static str, ReduceAll, ReduceAxis)> {
    vec![
        ("sum", |t| Ok(t.sum()), Tensor::sum_axis),
        ("mean", |t| Ok(t.mean()), Tensor::mean_axis),
        ("max", Tensor::max, Tensor::max_axis),
        ("min", Tensor::min, Tensor::min_axis),
        ("argmax", Tensor::argmax, Tensor::argmax_axis),
    ]
}

fn reductions(device: Device) {
    each_setting(device, |c| {
        let (rows, cols) = (ROWS.len(), ROWS[0].len());
        let flat: Vec<f32> = ROWS.iter().flatten().copied().collect();
        let column = |j: usize| -> Vec<f32> { ROWS.iter().map(|r| r[j]).collect() };
        for (name, all, axis) in reduce_ops() {
            // Each row on its own, over all its elements, stacked.
            c.check(
                &format!("{name} of each row"),
                |e, d| {
                    let parts: Vec<Tensor> = ROWS
                        .iter()
                        .map(|r| all(&input(e, d, r, &[cols])).unwrap().reshape([1]).unwrap())
                        .collect();
                    Tensor::concat(&parts.iter().collect::<Vec<_>>(), 0).unwrap()
                },
                &ROWS
                    .iter()
                    .map(|r| reduce_reference(name, r))
                    .collect::<Vec<_>>(),
                APPROX,
                |i| format!("{:?}", ROWS[i]),
            );
            c.check(
                &format!("{name}_axis(1)"),
                |e, d| axis(&input(e, d, &flat, &[rows, cols]), 1).unwrap(),
                &ROWS
                    .iter()
                    .map(|r| reduce_reference(name, r))
                    .collect::<Vec<_>>(),
                APPROX,
                |i| format!("{:?}", ROWS[i]),
            );
            c.check(
                &format!("{name}_axis(0)"),
                |e, d| axis(&input(e, d, &flat, &[rows, cols]), 0).unwrap(),
                &(0..cols)
                    .map(|j| reduce_reference(name, &column(j)))
                    .collect::<Vec<_>>(),
                APPROX,
                |j| format!("{:?}", column(j)),
            );
        }
    });
}
device_test!(reductions);
