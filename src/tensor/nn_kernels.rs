//! The window geometry shared by convolution and pooling, the CPU's pooling
//! kernels, and the batch-wide im2col / col2im: the GPU's lowering, kept on
//! the CPU as the reference that `shaders/im2col.wgsl` and the CPU's
//! per-image convolution (`conv_kernels.rs`) are tested against.
//!
//! Tensors are contiguous row-major `f32` in NCHW order; a [`Window`] holds the
//! geometry (input size, kernel, stride, padding) shared by every function here.
//! `shaders/im2col.wgsl` and `shaders/pool.wgsl` compute the same values on a
//! GPU, one invocation per output element, and add contributions in the same
//! order: im2col, col2im and max pooling agree to the bit, average pooling up
//! to the GPU's rounding of division (WGSL allows 2.5 ulp).
//!
//! Like `kernels`, these are pure functions of slices: callers validate shapes
//! and buffer lengths, and the kernels only `debug_assert!` them.

/// The geometry of a sliding 2-D window over an `[n, c, h, w]` input: kernel
/// `(kh, kw)`, stride `(sh, sw)` (at least 1) and zero padding `(ph, pw)` on
/// each side. Callers guarantee `h + 2 * ph >= kh` and `w + 2 * pw >= kw`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Window {
    pub(crate) n: usize,
    pub(crate) c: usize,
    pub(crate) h: usize,
    pub(crate) w: usize,
    pub(crate) kh: usize,
    pub(crate) kw: usize,
    pub(crate) sh: usize,
    pub(crate) sw: usize,
    pub(crate) ph: usize,
    pub(crate) pw: usize,
}

impl Window {
    /// Output rows: `(h + 2 * ph - kh) / sh + 1`.
    pub(crate) fn oh(&self) -> usize {
        (self.h + 2 * self.ph - self.kh) / self.sh + 1
    }

    /// Output columns: `(w + 2 * pw - kw) / sw + 1`.
    pub(crate) fn ow(&self) -> usize {
        (self.w + 2 * self.pw - self.kw) / self.sw + 1
    }

    /// `[n, c, h, w, kh, kw, sh, sw, ph, pw, oh, ow]`, the `info` binding of
    /// `im2col.wgsl` and `pool.wgsl`.
    pub(crate) fn info(&self) -> Vec<u32> {
        [
            self.n,
            self.c,
            self.h,
            self.w,
            self.kh,
            self.kw,
            self.sh,
            self.sw,
            self.ph,
            self.pw,
            self.oh(),
            self.ow(),
        ]
        .iter()
        .map(|&v| v as u32)
        .collect()
    }

    /// The input rows `iy` a window at output row `oy` covers, as
    /// `(ky_start, ky_end, iy_start)`: kernel rows `ky_start..ky_end` are in
    /// bounds, and `ky_start` reads input row `iy_start`.
    #[inline]
    fn rows(&self, oy: usize) -> (usize, usize, usize) {
        span(oy * self.sh, self.kh, self.ph, self.h)
    }

    /// The same as [`Window::rows`] for the columns of output column `ox`.
    #[inline]
    fn cols(&self, ox: usize) -> (usize, usize, usize) {
        span(ox * self.sw, self.kw, self.pw, self.w)
    }

    fn input_len(&self) -> usize {
        self.n * self.c * self.h * self.w
    }

    fn output_len(&self) -> usize {
        self.n * self.c * self.oh() * self.ow()
    }

    #[cfg(test)]
    fn cols_len(&self) -> usize {
        self.n * self.oh() * self.ow() * self.c * self.kh * self.kw
    }
}

/// The in-bounds part of a window that starts at padded coordinate `start`
/// and spans `k`: `(k_start, k_end, i_start)` with `i = start + k - pad`.
/// A window entirely in the padding (possible when `pad >= k`) is `(0, 0, 0)`,
/// so that loops over it do nothing and slices at `i_start` stay in bounds.
#[inline]
fn span(start: usize, k: usize, pad: usize, len: usize) -> (usize, usize, usize) {
    let k_start = pad.saturating_sub(start);
    let k_end = (len + pad).saturating_sub(start).min(k);
    if k_start >= k_end {
        return (0, 0, 0);
    }
    (k_start, k_end, start + k_start - pad)
}

/// Unfolds the windows of `x` (`[n, c, h, w]`) into `cols` (`[n, oh * ow,
/// c * kh * kw]`): `cols[(b * p + oy * ow + ox) * ckk + (ci * kh + ky) * kw + kx]`
/// is `x[b, ci, oy * sh + ky - ph, ox * sw + kx - pw]`, or 0 in the padding.
/// Row `r` of `cols` seen as `[n * p, ckk]` times the weights `[o, ckk]`
/// transposed is the convolution's output at position `r`, as `[n * p, o]`.
#[cfg(test)]
pub(crate) fn im2col(x: &[f32], win: &Window, cols: &mut [f32]) {
    debug_assert_eq!(x.len(), win.input_len());
    debug_assert_eq!(cols.len(), win.cols_len());
    let (c, h, w, kh, kw) = (win.c, win.h, win.w, win.kh, win.kw);
    let (oh, ow) = (win.oh(), win.ow());
    let ckk = c * kh * kw;
    // Each row of `cols` is written front to back; each kernel row is one
    // contiguous run of an input row between its padding.
    let col_spans: Vec<_> = (0..ow).map(|ox| win.cols(ox)).collect();
    let mut rows = cols.chunks_exact_mut(ckk.max(1));
    for b in 0..win.n {
        let image = &x[b * c * h * w..(b + 1) * c * h * w];
        for oy in 0..oh {
            let (ky0, ky1, iy0) = win.rows(oy);
            for &(kx0, kx1, ix0) in &col_spans {
                let Some(row) = rows.next() else { return };
                for (ci, patch) in row.chunks_exact_mut(kh * kw).enumerate() {
                    let plane = &image[ci * h * w..(ci + 1) * h * w];
                    for (ky, out) in patch.chunks_exact_mut(kw).enumerate() {
                        if ky < ky0 || ky >= ky1 {
                            out.fill(0.0);
                            continue;
                        }
                        let start = (iy0 + ky - ky0) * w + ix0;
                        out[..kx0].fill(0.0);
                        out[kx0..kx1].copy_from_slice(&plane[start..start + kx1 - kx0]);
                        out[kx1..].fill(0.0);
                    }
                }
            }
        }
    }
}

/// The adjoint of [`im2col`]: overwrites `x` (`[n, c, h, w]`) with, at each
/// position, the sum of the `cols` entries that `im2col` copies from it
/// (entries of the padding are dropped). Contributions to one position are
/// added in the order of their output positions (row-major).
#[cfg(test)]
pub(crate) fn col2im(cols: &[f32], win: &Window, x: &mut [f32]) {
    debug_assert_eq!(x.len(), win.input_len());
    debug_assert_eq!(cols.len(), win.cols_len());
    let (c, h, w, kh, kw) = (win.c, win.h, win.w, win.kh, win.kw);
    let (oh, ow) = (win.oh(), win.ow());
    let ckk = c * kh * kw;
    x.fill(0.0);
    let col_spans: Vec<_> = (0..ow).map(|ox| win.cols(ox)).collect();
    let mut rows = cols.chunks_exact(ckk.max(1));
    for b in 0..win.n {
        let image = &mut x[b * c * h * w..(b + 1) * c * h * w];
        for oy in 0..oh {
            let (ky0, ky1, iy0) = win.rows(oy);
            for &(kx0, kx1, ix0) in &col_spans {
                let Some(row) = rows.next() else { return };
                for (ci, patch) in row.chunks_exact(kh * kw).enumerate() {
                    let plane = &mut image[ci * h * w..(ci + 1) * h * w];
                    for ky in ky0..ky1 {
                        let start = (iy0 + ky - ky0) * w + ix0;
                        let src = &patch[ky * kw + kx0..ky * kw + kx1];
                        for (d, s) in plane[start..start + kx1 - kx0].iter_mut().zip(src) {
                            *d += s;
                        }
                    }
                }
            }
        }
    }
}

/// What a pooling window computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolKind {
    /// The window's sum divided by `kh * kw`: padding counts as zeros
    /// (PyTorch's `count_include_pad=True`).
    Avg,
    /// The largest in-bounds element; NaN when one of them is NaN.
    Max,
}

/// The first in-bounds position of the window at `(oy, ox)` of `plane`
/// (`[h, w]`) that holds its maximum, as an index into `plane`: the first NaN
/// if there is one, else the first of the largest values.
#[inline]
fn argmax(plane: &[f32], win: &Window, oy: usize, ox: usize) -> usize {
    let (ky0, ky1, iy0) = win.rows(oy);
    let (kx0, kx1, ix0) = win.cols(ox);
    let mut best = iy0 * win.w + ix0;
    for iy in iy0..iy0 + ky1 - ky0 {
        for i in iy * win.w + ix0..iy * win.w + ix0 + kx1 - kx0 {
            let v = plane[i];
            if v.is_nan() {
                return i;
            }
            if v > plane[best] {
                best = i;
            }
        }
    }
    best
}

/// 2-D pooling of `x` (`[n, c, h, w]`) into `out` (`[n, c, oh, ow]`). For
/// `Max`, callers guarantee `ph < kh` and `pw < kw`, so that every window
/// holds an element of `x`.
pub(crate) fn pool2d(kind: PoolKind, x: &[f32], win: &Window, out: &mut [f32]) {
    debug_assert_eq!(x.len(), win.input_len());
    debug_assert_eq!(out.len(), win.output_len());
    let (h, w) = (win.h, win.w);
    let (oh, ow) = (win.oh(), win.ow());
    let area = (win.kh * win.kw) as f32;
    let col_spans: Vec<_> = (0..ow).map(|ox| win.cols(ox)).collect();
    for (plane, out) in x
        .chunks_exact((h * w).max(1))
        .zip(out.chunks_exact_mut((oh * ow).max(1)))
    {
        for (oy, out) in out.chunks_exact_mut(ow).enumerate() {
            let (ky0, ky1, iy0) = win.rows(oy);
            for (ox, (o, &(kx0, kx1, ix0))) in out.iter_mut().zip(&col_spans).enumerate() {
                *o = match kind {
                    PoolKind::Avg => {
                        let mut sum = 0.0;
                        for iy in iy0..iy0 + ky1 - ky0 {
                            let start = iy * w + ix0;
                            for v in &plane[start..start + kx1 - kx0] {
                                sum += v;
                            }
                        }
                        sum / area
                    }
                    PoolKind::Max => plane[argmax(plane, win, oy, ox)],
                };
            }
        }
    }
}

/// The gradient of [`pool2d`] with respect to `x`, given `gout` (`[n, c, oh,
/// ow]`), overwriting `gx` (`[n, c, h, w]`). `Avg` spreads `gout / (kh * kw)`
/// over each window's in-bounds positions; `Max` sends each window's `gout`
/// to the position [`pool2d`] took its value from (the first NaN, else the
/// first of the largest values, row-major within the window). Contributions to
/// one position are added in the order of their windows (row-major).
pub(crate) fn pool2d_backward(
    kind: PoolKind,
    x: &[f32],
    gout: &[f32],
    win: &Window,
    gx: &mut [f32],
) {
    debug_assert_eq!(x.len(), win.input_len());
    debug_assert_eq!(gx.len(), win.input_len());
    debug_assert_eq!(gout.len(), win.output_len());
    let (h, w) = (win.h, win.w);
    let (oh, ow) = (win.oh(), win.ow());
    let area = (win.kh * win.kw) as f32;
    gx.fill(0.0);
    let col_spans: Vec<_> = (0..ow).map(|ox| win.cols(ox)).collect();
    for ((plane, gplane), gout) in x
        .chunks_exact((h * w).max(1))
        .zip(gx.chunks_exact_mut((h * w).max(1)))
        .zip(gout.chunks_exact((oh * ow).max(1)))
    {
        for (oy, gout) in gout.chunks_exact(ow).enumerate() {
            let (ky0, ky1, iy0) = win.rows(oy);
            for (ox, (&g, &(kx0, kx1, ix0))) in gout.iter().zip(&col_spans).enumerate() {
                match kind {
                    PoolKind::Avg => {
                        let share = g / area;
                        for iy in iy0..iy0 + ky1 - ky0 {
                            let start = iy * w + ix0;
                            for d in &mut gplane[start..start + kx1 - kx0] {
                                *d += share;
                            }
                        }
                    }
                    PoolKind::Max => gplane[argmax(plane, win, oy, ox)] += g,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic pseudo-random values in [-1, 1), on a grid of 2^-23.
    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// Values from a few levels, so that windows hold ties.
    fn coarse(n: usize, seed: u64) -> Vec<f32> {
        data(n, seed)
            .into_iter()
            .map(|v| (v * 2.0).round())
            .collect()
    }

    fn win(
        n: usize,
        c: usize,
        h: usize,
        w: usize,
        (kh, kw): (usize, usize),
        (sh, sw): (usize, usize),
        (ph, pw): (usize, usize),
    ) -> Window {
        Window {
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
        }
    }

    /// Geometries at odd sizes: strides, padding, a 1x1 kernel, strides
    /// larger than the kernel, a kernel as large as the padded input.
    fn windows() -> Vec<Window> {
        vec![
            win(2, 3, 7, 6, (3, 2), (2, 1), (1, 0)),
            win(1, 1, 5, 5, (1, 1), (1, 1), (0, 0)),
            win(2, 2, 5, 7, (1, 1), (2, 3), (0, 0)),
            win(3, 2, 9, 8, (2, 2), (3, 4), (1, 1)),
            win(1, 4, 6, 5, (3, 3), (1, 1), (1, 1)),
            win(2, 1, 4, 3, (5, 4), (1, 2), (2, 1)),
            win(1, 2, 3, 3, (3, 3), (3, 3), (0, 0)),
            win(2, 3, 8, 8, (2, 2), (2, 2), (0, 0)),
            win(1, 1, 1, 1, (3, 3), (1, 1), (1, 1)),
            // Windows entirely in the padding (not for max pooling).
            win(1, 2, 3, 4, (1, 2), (2, 3), (2, 2)),
        ]
    }

    /// Everything a naive loop needs about one window position: the input
    /// position `(iy, ix)` read by kernel offset `(ky, kx)` at output `(oy,
    /// ox)`, or `None` in the padding.
    fn at(win: &Window, oy: usize, ox: usize, ky: usize, kx: usize) -> Option<(usize, usize)> {
        let iy = (oy * win.sh + ky) as isize - win.ph as isize;
        let ix = (ox * win.sw + kx) as isize - win.pw as isize;
        let inside = iy >= 0 && ix >= 0 && (iy as usize) < win.h && (ix as usize) < win.w;
        inside.then_some((iy as usize, ix as usize))
    }

    fn naive_im2col(x: &[f32], win: &Window) -> Vec<f32> {
        let (oh, ow) = (win.oh(), win.ow());
        let (p, ckk) = (oh * ow, win.c * win.kh * win.kw);
        let mut cols = vec![f32::NAN; win.n * p * ckk];
        for b in 0..win.n {
            for oy in 0..oh {
                for ox in 0..ow {
                    for ci in 0..win.c {
                        for ky in 0..win.kh {
                            for kx in 0..win.kw {
                                let row = b * p + oy * ow + ox;
                                let col = (ci * win.kh + ky) * win.kw + kx;
                                cols[row * ckk + col] = match at(win, oy, ox, ky, kx) {
                                    Some((iy, ix)) => {
                                        x[((b * win.c + ci) * win.h + iy) * win.w + ix]
                                    }
                                    None => 0.0,
                                };
                            }
                        }
                    }
                }
            }
        }
        cols
    }

    fn naive_col2im(cols: &[f32], win: &Window) -> Vec<f32> {
        let (oh, ow) = (win.oh(), win.ow());
        let (p, ckk) = (oh * ow, win.c * win.kh * win.kw);
        let mut x = vec![0.0; win.n * win.c * win.h * win.w];
        for b in 0..win.n {
            for oy in 0..oh {
                for ox in 0..ow {
                    for ci in 0..win.c {
                        for ky in 0..win.kh {
                            for kx in 0..win.kw {
                                if let Some((iy, ix)) = at(win, oy, ox, ky, kx) {
                                    let row = b * p + oy * ow + ox;
                                    let col = (ci * win.kh + ky) * win.kw + kx;
                                    x[((b * win.c + ci) * win.h + iy) * win.w + ix] +=
                                        cols[row * ckk + col];
                                }
                            }
                        }
                    }
                }
            }
        }
        x
    }

    fn naive_pool(kind: PoolKind, x: &[f32], win: &Window) -> Vec<f32> {
        let (oh, ow) = (win.oh(), win.ow());
        let mut out = vec![0.0; win.n * win.c * oh * ow];
        for b in 0..win.n {
            for ci in 0..win.c {
                for oy in 0..oh {
                    for ox in 0..ow {
                        let mut vals = Vec::new();
                        for ky in 0..win.kh {
                            for kx in 0..win.kw {
                                if let Some((iy, ix)) = at(win, oy, ox, ky, kx) {
                                    vals.push(x[((b * win.c + ci) * win.h + iy) * win.w + ix]);
                                }
                            }
                        }
                        out[((b * win.c + ci) * oh + oy) * ow + ox] = match kind {
                            PoolKind::Avg => vals.iter().sum::<f32>() / (win.kh * win.kw) as f32,
                            PoolKind::Max => {
                                if vals.iter().any(|v| v.is_nan()) {
                                    f32::NAN
                                } else {
                                    vals.into_iter().fold(f32::NEG_INFINITY, f32::max)
                                }
                            }
                        };
                    }
                }
            }
        }
        out
    }

    /// The max-pooling gradient by the definition: each window's gradient goes
    /// to the first in-bounds position whose value is the window's maximum.
    fn naive_max_backward(x: &[f32], gout: &[f32], win: &Window) -> Vec<f32> {
        let (oh, ow) = (win.oh(), win.ow());
        let pooled = naive_pool(PoolKind::Max, x, win);
        let mut gx = vec![0.0; x.len()];
        for b in 0..win.n {
            for ci in 0..win.c {
                for oy in 0..oh {
                    for ox in 0..ow {
                        let o = ((b * win.c + ci) * oh + oy) * ow + ox;
                        let target = (0..win.kh)
                            .flat_map(|ky| (0..win.kw).map(move |kx| (ky, kx)))
                            .filter_map(|(ky, kx)| at(win, oy, ox, ky, kx))
                            .map(|(iy, ix)| ((b * win.c + ci) * win.h + iy) * win.w + ix)
                            .find(|&i| x[i] == pooled[o] || (x[i].is_nan() && pooled[o].is_nan()))
                            .unwrap();
                        gx[target] += gout[o];
                    }
                }
            }
        }
        gx
    }

    fn dot(a: &[f32], b: &[f32]) -> f64 {
        a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
    }

    fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let same_nan = g.is_nan() && w.is_nan();
            assert!(
                same_nan || (g - w).abs() <= tol * (1.0 + w.abs()),
                "{what}: at {i}, got {g}, want {w}"
            );
        }
    }

    #[test]
    fn output_size_and_info() {
        let w = win(2, 3, 7, 6, (3, 2), (2, 1), (1, 0));
        assert_eq!((w.oh(), w.ow()), (4, 5));
        assert_eq!(w.info(), vec![2, 3, 7, 6, 3, 2, 2, 1, 1, 0, 4, 5]);
        let w = win(1, 1, 1, 1, (3, 3), (1, 1), (1, 1));
        assert_eq!((w.oh(), w.ow()), (1, 1));
    }

    #[test]
    fn im2col_matches_naive_loops() {
        for (k, win) in windows().iter().enumerate() {
            let x = data(win.input_len(), k as u64);
            let mut cols = vec![f32::NAN; win.cols_len()];
            im2col(&x, win, &mut cols);
            assert_eq!(cols, naive_im2col(&x, win), "{win:?}");
        }
    }

    #[test]
    fn col2im_is_the_adjoint_of_im2col() {
        for (k, win) in windows().iter().enumerate() {
            let x = data(win.input_len(), 2 * k as u64 + 100);
            let y = data(win.cols_len(), 2 * k as u64 + 101);
            let mut cols = vec![0.0; win.cols_len()];
            im2col(&x, win, &mut cols);
            let mut back = vec![f32::NAN; win.input_len()];
            col2im(&y, win, &mut back);
            let (lhs, rhs) = (dot(&cols, &y), dot(&x, &back));
            let scale = dot(&cols.iter().map(|v| v.abs()).collect::<Vec<_>>(), &y)
                .abs()
                .max(1.0);
            assert!(
                (lhs - rhs).abs() <= 1e-5 * scale,
                "{win:?}: <im2col(x), y> = {lhs}, <x, col2im(y)> = {rhs}"
            );
        }
    }

    #[test]
    fn col2im_matches_naive_loops() {
        for (k, win) in windows().iter().enumerate() {
            let cols = data(win.cols_len(), k as u64 + 200);
            let mut x = vec![f32::NAN; win.input_len()];
            col2im(&cols, win, &mut x);
            assert_close(&x, &naive_col2im(&cols, win), 1e-6, &format!("{win:?}"));
        }
    }

    #[test]
    fn pool2d_matches_naive_loops() {
        for (k, win) in windows().iter().enumerate() {
            for (kind, x) in [
                (PoolKind::Avg, data(win.input_len(), k as u64 + 7)),
                (PoolKind::Max, data(win.input_len(), k as u64 + 7)),
                (PoolKind::Max, coarse(win.input_len(), k as u64 + 7)),
            ] {
                if kind == PoolKind::Max && (win.ph >= win.kh || win.pw >= win.kw) {
                    continue;
                }
                let mut out = vec![f32::NAN; win.output_len()];
                pool2d(kind, &x, win, &mut out);
                assert_close(
                    &out,
                    &naive_pool(kind, &x, win),
                    1e-6,
                    &format!("{kind:?} {win:?}"),
                );
            }
        }
    }

    #[test]
    fn max_pool_propagates_nan_and_never_takes_padding() {
        let win = win(1, 1, 3, 3, (2, 2), (1, 1), (1, 1));
        let mut x = vec![-5.0; 9];
        x[4] = f32::NAN;
        let mut out = vec![0.0; win.output_len()];
        pool2d(PoolKind::Max, &x, &win, &mut out);
        // Windows (oy, ox) in 0..4: those covering the centre are NaN, the
        // corner ones see only -5 (the zero padding never wins).
        for oy in 0..4 {
            for ox in 0..4 {
                let covers = (1..=2).contains(&oy) && (1..=2).contains(&ox);
                let v = out[oy * 4 + ox];
                assert_eq!(v.is_nan(), covers, "({oy}, {ox}): {v}");
                if !covers {
                    assert_eq!(v, -5.0);
                }
            }
        }
        // The gradient of every NaN window goes to the NaN.
        let mut gx = vec![0.0; 9];
        pool2d_backward(PoolKind::Max, &x, &[1.0; 16], &win, &mut gx);
        assert_eq!(gx[4], 4.0);
        assert_eq!(gx.iter().sum::<f32>(), 16.0);
        // Two NaNs in a window: the first (row-major) takes it.
        let win2 = Window {
            ph: 0,
            pw: 0,
            ..win
        };
        let x = [1.0, f32::NAN, f32::NAN, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        let mut gx = vec![0.0; 9];
        pool2d_backward(
            PoolKind::Max,
            &x,
            &[1.0, 10.0, 100.0, 1000.0],
            &win2,
            &mut gx,
        );
        assert_eq!(gx, vec![0.0, 11.0, 0.0, 100.0, 1000.0, 0.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn max_pool_backward_sends_ties_to_the_first() {
        for (k, win) in windows().iter().enumerate() {
            if win.ph >= win.kh || win.pw >= win.kw {
                continue;
            }
            let x = coarse(win.input_len(), k as u64 + 40);
            let gout = data(win.output_len(), k as u64 + 41);
            let mut gx = vec![f32::NAN; win.input_len()];
            pool2d_backward(PoolKind::Max, &x, &gout, win, &mut gx);
            assert_close(
                &gx,
                &naive_max_backward(&x, &gout, win),
                1e-6,
                &format!("{win:?}"),
            );
        }
    }

    /// Central differences of `<pool2d(x), gout>` in each `x[i]`.
    fn finite_differences(kind: PoolKind, x: &[f32], gout: &[f32], win: &Window) -> Vec<f32> {
        let eps = 1e-3;
        let loss = |x: &[f32]| {
            let mut out = vec![0.0; win.output_len()];
            pool2d(kind, x, win, &mut out);
            dot(&out, gout)
        };
        (0..x.len())
            .map(|i| {
                let mut x = x.to_vec();
                x[i] += eps;
                let up = loss(&x);
                x[i] -= 2.0 * eps;
                let down = loss(&x);
                ((up - down) / (2.0 * eps as f64)) as f32
            })
            .collect()
    }

    #[test]
    fn pool2d_backward_matches_finite_differences() {
        for (k, win) in windows().iter().enumerate() {
            for kind in [PoolKind::Avg, PoolKind::Max] {
                if kind == PoolKind::Max && (win.ph >= win.kh || win.pw >= win.kw) {
                    continue;
                }
                // Distinct values, more than 2 * eps apart, so that no step
                // changes which element is a window's maximum.
                let x: Vec<f32> = data(win.input_len(), k as u64 + 60)
                    .iter()
                    .enumerate()
                    .map(|(i, v)| v.signum() * 0.01 * i as f32 + v * 1e-3)
                    .collect();
                let gout = data(win.output_len(), k as u64 + 61);
                let mut gx = vec![f32::NAN; win.input_len()];
                pool2d_backward(kind, &x, &gout, win, &mut gx);
                let want = finite_differences(kind, &x, &gout, win);
                assert_close(&gx, &want, 2e-2, &format!("{kind:?} {win:?}"));
            }
        }
    }
}
