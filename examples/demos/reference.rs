//! Naive host implementations the demonstrations' results are checked against:
//! plain loops, independent of faer and of the WGSL kernels.

use super::DemoResult;

/// `a (m x k) @ b (k x n)`, row-major, accumulated in f64.
pub fn matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    assert_eq!((a.len(), b.len()), (m * k, k * n));
    let mut out = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0f64;
            for p in 0..k {
                acc += a[i * k + p] as f64 * b[p * n + j] as f64;
            }
            out[i * n + j] = acc as f32;
        }
    }
    out
}

/// `y = tanh(y @ w)`, `steps` times, for square `n x n` matrices.
pub fn tanh_chain(y0: &[f32], w: &[f32], n: usize, steps: usize) -> Vec<f32> {
    let mut y = y0.to_vec();
    for _ in 0..steps {
        y = matmul(&y, w, n, n, n).into_iter().map(f32::tanh).collect();
    }
    y
}

/// Largest `|got - want|` relative to the largest `|want|` (at least 1).
pub fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    got.iter()
        .zip(want)
        .fold(0.0f32, |m, (g, w)| m.max((g - w).abs()))
        / scale
}

/// `Err` naming `what` unless `got` matches `want` to `tol` (relative, see
/// [`rel_err`]) with the same length.
pub fn check_close(what: &str, got: &[f32], want: &[f32], tol: f32) -> DemoResult<f32> {
    if got.len() != want.len() {
        return Err(format!("{what}: {} values, expected {}", got.len(), want.len()).into());
    }
    let err = rel_err(got, want);
    if err.is_nan() || err > tol || got.iter().any(|v| v.is_nan()) {
        return Err(format!("{what}: relative error {err} exceeds {tol}").into());
    }
    Ok(err)
}
