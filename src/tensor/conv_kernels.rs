//! The CPU's convolution: one image at a time, its windows unfolded into a
//! `[c * kh * kw, oh * ow]` matrix that stays in cache and one GEMM (faer) with
//! the weight straight into the NCHW output, images split over threads. This
//! never builds the whole batch's im2col matrix (41 MB at LeNet's second layer
//! for a batch of 256) nor transposes the output, which the GPU's lowering
//! (`im2col.wgsl` and the tiled matmul) does.

use super::nn_kernels::Window;
use faer::linalg::matmul::matmul as faer_matmul;
use faer::{Accum, MatMut, MatRef, Par};
use rayon::prelude::*;

impl Window {
    fn image_len(&self) -> usize {
        self.c * self.h * self.w
    }

    fn positions(&self) -> usize {
        self.oh() * self.ow()
    }

    fn patch_len(&self) -> usize {
        self.c * self.kh * self.kw
    }
}

/// The output columns `ox` whose input column `ox * sw + kx - pw` is inside
/// `0..w`, as a range, and the input column of its first.
#[inline]
fn inside(win: &Window, kx: usize) -> (std::ops::Range<usize>, usize) {
    let ow = win.ow();
    // ox * sw + kx >= pw  and  ox * sw + kx < w + pw
    let lo = win.pw.saturating_sub(kx).div_ceil(win.sw).min(ow);
    let hi = if win.w + win.pw > kx {
        (win.w + win.pw - kx).div_ceil(win.sw).min(ow)
    } else {
        0
    };
    let hi = hi.max(lo);
    (lo..hi, (lo * win.sw + kx).saturating_sub(win.pw))
}

/// The input row of output row `oy` for kernel row `ky`, if inside the image.
#[inline]
fn input_row(win: &Window, oy: usize, ky: usize) -> Option<usize> {
    (oy * win.sh + ky)
        .checked_sub(win.ph)
        .filter(|&iy| iy < win.h)
}

/// Unfolds one image (`[c, h, w]`) into `cols` (`[c * kh * kw, oh * ow]`):
/// row `(ci * kh + ky) * kw + kx`, column `oy * ow + ox` holds
/// `image[ci, oy * sh + ky - ph, ox * sw + kx - pw]`, or 0 in the padding.
fn unfold(image: &[f32], win: &Window, cols: &mut [f32]) {
    let (h, w, ow, p) = (win.h, win.w, win.ow(), win.positions());
    let mut rows = cols.chunks_exact_mut(p);
    for plane in image.chunks_exact(h * w) {
        for ky in 0..win.kh {
            for kx in 0..win.kw {
                let Some(row) = rows.next() else { return };
                let (xs, ix0) = inside(win, kx);
                for (oy, out) in row.chunks_exact_mut(ow).enumerate() {
                    let Some(iy) = input_row(win, oy, ky) else {
                        out.fill(0.0);
                        continue;
                    };
                    out[..xs.start].fill(0.0);
                    out[xs.end..].fill(0.0);
                    if xs.is_empty() {
                        continue;
                    }
                    let line = &plane[iy * w + ix0..(iy + 1) * w];
                    let dst = &mut out[xs.clone()];
                    if win.sw == 1 {
                        dst.copy_from_slice(&line[..dst.len()]);
                    } else {
                        for (d, s) in dst.iter_mut().zip(line.iter().step_by(win.sw)) {
                            *d = *s;
                        }
                    }
                }
            }
        }
    }
}

/// The adjoint of [`unfold`]: adds every entry of `cols` into the image
/// position it was read from.
fn fold(cols: &[f32], win: &Window, image: &mut [f32]) {
    let (h, w, ow, p) = (win.h, win.w, win.ow(), win.positions());
    let mut rows = cols.chunks_exact(p);
    for plane in image.chunks_exact_mut(h * w) {
        for ky in 0..win.kh {
            for kx in 0..win.kw {
                let Some(row) = rows.next() else { return };
                let (xs, ix0) = inside(win, kx);
                for (oy, src) in row.chunks_exact(ow).enumerate() {
                    let Some(iy) = input_row(win, oy, ky).filter(|_| !xs.is_empty()) else {
                        continue;
                    };
                    let line = &mut plane[iy * w + ix0..(iy + 1) * w];
                    for (d, s) in line.iter_mut().step_by(win.sw).zip(&src[xs.clone()]) {
                        *d += s;
                    }
                }
            }
        }
    }
}

/// Images per thread's chunk.
fn chunk(n: usize, threads: usize) -> usize {
    n.div_ceil(threads.max(1)).max(1)
}

/// `out` (`[n, o, oh, ow]`) is the convolution of `x` (`[n, c, h, w]`) with
/// `weight` (`[o, c, kh, kw]`) plus `bias` (`[o]`).
pub(crate) fn conv2d(
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    win: &Window,
    o: usize,
    out: &mut [f32],
    threads: usize,
) {
    let (ckk, p) = (win.patch_len(), win.positions());
    if out.is_empty() {
        return;
    }
    if ckk == 0 {
        // No input channels: only the bias.
        for plane in out.chunks_exact_mut(p) {
            plane.fill(0.0);
        }
        if let Some(bias) = bias {
            for (i, plane) in out.chunks_exact_mut(p).enumerate() {
                plane.fill(bias[i % o]);
            }
        }
        return;
    }
    let w = MatRef::from_row_major_slice(weight, o, ckk);
    out.par_chunks_mut(chunk(win.n, threads) * o * p)
        .zip(x.par_chunks(chunk(win.n, threads) * win.image_len()))
        .for_each(|(outs, images)| {
            let mut cols = vec![0.0f32; ckk * p];
            for (ob, image) in outs
                .chunks_exact_mut(o * p)
                .zip(images.chunks_exact(win.image_len()))
            {
                unfold(image, win, &mut cols);
                let dst = MatMut::from_row_major_slice_mut(ob, o, p);
                let rhs = MatRef::from_row_major_slice(&cols, ckk, p);
                faer_matmul(dst, Accum::Replace, w, rhs, 1.0f32, Par::Seq);
                if let Some(bias) = bias {
                    for (row, &b) in ob.chunks_exact_mut(p).zip(bias) {
                        row.iter_mut().for_each(|v| *v += b);
                    }
                }
            }
        });
}

/// `gx` (`[n, c, h, w]`): the gradient of the convolution's input given the
/// output's gradient `g` (`[n, o, oh, ow]`).
pub(crate) fn conv2d_grad_input(
    g: &[f32],
    weight: &[f32],
    win: &Window,
    o: usize,
    gx: &mut [f32],
    threads: usize,
) {
    let (ckk, p) = (win.patch_len(), win.positions());
    if gx.is_empty() {
        return;
    }
    if o == 0 || p == 0 {
        gx.fill(0.0);
        return;
    }
    let wt = MatRef::from_row_major_slice(weight, o, ckk).transpose();
    gx.par_chunks_mut(chunk(win.n, threads) * win.image_len())
        .zip(g.par_chunks(chunk(win.n, threads) * o * p))
        .for_each(|(images, gs)| {
            let mut cols = vec![0.0f32; ckk * p];
            for (image, gb) in images
                .chunks_exact_mut(win.image_len())
                .zip(gs.chunks_exact(o * p))
            {
                let dst = MatMut::from_row_major_slice_mut(&mut cols, ckk, p);
                let rhs = MatRef::from_row_major_slice(gb, o, p);
                faer_matmul(dst, Accum::Replace, wt, rhs, 1.0f32, Par::Seq);
                image.fill(0.0);
                fold(&cols, win, image);
            }
        });
}

/// `gw` (`[o, c, kh, kw]`): the gradient of the convolution's weight given its
/// input `x` and the output's gradient `g`.
pub(crate) fn conv2d_grad_weight(
    x: &[f32],
    g: &[f32],
    win: &Window,
    o: usize,
    gw: &mut [f32],
    threads: usize,
) {
    let (ckk, p) = (win.patch_len(), win.positions());
    gw.fill(0.0);
    if win.n == 0 || ckk == 0 || p == 0 {
        return;
    }
    let n = chunk(win.n, threads);
    let partials: Vec<Vec<f32>> = x
        .par_chunks(n * win.image_len())
        .zip(g.par_chunks(n * o * p))
        .map(|(images, gs)| {
            let mut cols = vec![0.0f32; ckk * p];
            let mut acc = vec![0.0f32; o * ckk];
            for (image, gb) in images
                .chunks_exact(win.image_len())
                .zip(gs.chunks_exact(o * p))
            {
                unfold(image, win, &mut cols);
                let dst = MatMut::from_row_major_slice_mut(&mut acc, o, ckk);
                let lhs = MatRef::from_row_major_slice(gb, o, p);
                let rhs = MatRef::from_row_major_slice(&cols, ckk, p).transpose();
                faer_matmul(dst, Accum::Add, lhs, rhs, 1.0f32, Par::Seq);
            }
            acc
        })
        .collect();
    for part in partials {
        gw.iter_mut().zip(part).for_each(|(a, b)| *a += b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::nn_kernels::{col2im, im2col};

    fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2000) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    /// The batch-wide lowering (`im2col` then one product) as the reference.
    fn reference(x: &[f32], w: &[f32], win: &Window, o: usize) -> Vec<f64> {
        let (ckk, p) = (win.patch_len(), win.positions());
        let mut cols = vec![0.0; win.n * p * ckk];
        im2col(x, win, &mut cols);
        let mut out = vec![0.0f64; win.n * o * p];
        for b in 0..win.n {
            for oc in 0..o {
                for q in 0..p {
                    out[(b * o + oc) * p + q] = (0..ckk)
                        .map(|r| w[oc * ckk + r] as f64 * cols[(b * p + q) * ckk + r] as f64)
                        .sum();
                }
            }
        }
        out
    }

    fn windows() -> Vec<(Window, usize)> {
        let win = |n, c, h, w, kh, kw, sh, sw, ph, pw| Window {
            n,
            c,
            h,
            w,
            kh,
            kw,
            sh,
            sw,
            ph,
            pw,
        };
        vec![
            (win(3, 2, 7, 6, 3, 2, 2, 1, 1, 0), 4),
            (win(5, 3, 9, 9, 5, 5, 1, 1, 2, 2), 2),
            (win(2, 1, 4, 5, 1, 1, 3, 2, 0, 1), 3),
            (win(2, 2, 5, 4, 3, 3, 2, 3, 2, 2), 2),
            (win(1, 1, 3, 3, 3, 3, 1, 1, 4, 4), 2),
            (win(1, 2, 2, 6, 1, 3, 1, 4, 0, 5), 2),
        ]
    }

    #[test]
    fn forward_matches_the_batch_lowering() {
        for (win, o) in windows() {
            let x = data(win.n * win.image_len(), 1);
            let w = data(o * win.patch_len(), 2);
            let bias = data(o, 3);
            let want = reference(&x, &w, &win, o);
            for threads in [1, 2, 4] {
                let mut out = vec![f32::NAN; win.n * o * win.positions()];
                conv2d(&x, &w, Some(&bias), &win, o, &mut out, threads);
                for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
                    let want = want + bias[(i / win.positions()) % o] as f64;
                    assert!(
                        (got as f64 - want).abs() < 1e-4,
                        "{win:?} [{i}]: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn gradients_are_the_adjoints_of_the_forward() {
        // <conv(x, w), g> = <x, grad_input(g, w)> = <w, grad_weight(x, g)>.
        for (win, o) in windows() {
            let x = data(win.n * win.image_len(), 4);
            let w = data(o * win.patch_len(), 5);
            let g = data(win.n * o * win.positions(), 6);
            let mut y = vec![0.0; g.len()];
            conv2d(&x, &w, None, &win, o, &mut y, 2);
            let dot = |a: &[f32], b: &[f32]| {
                a.iter()
                    .zip(b)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum::<f64>()
            };
            let yg = dot(&y, &g);
            let mut gx = vec![f32::NAN; x.len()];
            conv2d_grad_input(&g, &w, &win, o, &mut gx, 3);
            let mut gw = vec![f32::NAN; w.len()];
            conv2d_grad_weight(&x, &g, &win, o, &mut gw, 2);
            let tol = 1e-4 * (1.0 + yg.abs());
            assert!(
                (dot(&x, &gx) - yg).abs() < tol,
                "{win:?}: {} vs {yg}",
                dot(&x, &gx)
            );
            assert!(
                (dot(&w, &gw) - yg).abs() < tol,
                "{win:?}: {} vs {yg}",
                dot(&w, &gw)
            );
            // And the input gradient is col2im of the batch lowering's.
            let (ckk, p) = (win.patch_len(), win.positions());
            let mut dcols = vec![0.0; win.n * p * ckk];
            for b in 0..win.n {
                for q in 0..p {
                    for r in 0..ckk {
                        dcols[(b * p + q) * ckk + r] = (0..o)
                            .map(|oc| w[oc * ckk + r] * g[(b * o + oc) * p + q])
                            .sum();
                    }
                }
            }
            let mut want = vec![0.0; x.len()];
            col2im(&dcols, &win, &mut want);
            for (a, b) in gx.iter().zip(&want) {
                assert!((a - b).abs() < 1e-4, "{a} vs {b}");
            }
        }
    }
}
