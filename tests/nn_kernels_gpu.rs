//! The convolution and pooling shaders (`shaders/im2col.wgsl`,
//! `shaders/pool.wgsl`) on every GPU adapter, against naive CPU loops, at odd
//! sizes with strides and padding. They run through the user-kernel API, which
//! binds tensors in order; the `info` array goes in as a tensor holding the
//! bit patterns of its `u32`s.

mod common;

use common::gpu_test;
use lazyflow::{Device, Engine, Tensor};

/// An `[n, c, h, w]` input, a `(kh, kw)` window, stride `(sh, sw)`, padding
/// `(ph, pw)`.
#[derive(Clone, Copy, Debug)]
struct Window {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    kh: usize,
    kw: usize,
    sh: usize,
    sw: usize,
    ph: usize,
    pw: usize,
}

impl Window {
    fn new(
        [n, c, h, w]: [usize; 4],
        (kh, kw): (usize, usize),
        (sh, sw): (usize, usize),
        (ph, pw): (usize, usize),
    ) -> Self {
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

    fn oh(&self) -> usize {
        (self.h + 2 * self.ph - self.kh) / self.sh + 1
    }

    fn ow(&self) -> usize {
        (self.w + 2 * self.pw - self.kw) / self.sw + 1
    }

    /// The shaders' `info`: `[n, c, h, w, kh, kw, sh, sw, ph, pw, oh, ow]`.
    fn info(&self) -> Vec<u32> {
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
        .map(|v| v as u32)
        .to_vec()
    }

    fn inputs(&self) -> usize {
        self.n * self.c * self.h * self.w
    }

    fn outputs(&self) -> usize {
        self.n * self.c * self.oh() * self.ow()
    }

    /// Whether every window holds an element of the input (max pooling).
    fn max_poolable(&self) -> bool {
        self.ph < self.kh && self.pw < self.kw
    }

    /// The index in the input of `(b, ci)`'s element under kernel offset
    /// `(ky, kx)` of output `(oy, ox)`, or `None` in the padding.
    fn at(&self, [b, ci, oy, ox, ky, kx]: [usize; 6]) -> Option<usize> {
        let iy = (oy * self.sh + ky).checked_sub(self.ph)?;
        let ix = (ox * self.sw + kx).checked_sub(self.pw)?;
        (iy < self.h && ix < self.w).then(|| ((b * self.c + ci) * self.h + iy) * self.w + ix)
    }

    /// Every `[b, ci, oy, ox, ky, kx]`, in im2col's row-major order.
    fn positions(&self) -> Vec<[usize; 6]> {
        let mut out = Vec::new();
        for b in 0..self.n {
            for oy in 0..self.oh() {
                for ox in 0..self.ow() {
                    for ci in 0..self.c {
                        for ky in 0..self.kh {
                            for kx in 0..self.kw {
                                out.push([b, ci, oy, ox, ky, kx]);
                            }
                        }
                    }
                }
            }
        }
        out
    }

    /// The index of `[b, ci, oy, ox]` in a pooling output.
    fn out_index(&self, [b, ci, oy, ox, ..]: [usize; 6]) -> usize {
        ((b * self.c + ci) * self.oh() + oy) * self.ow() + ox
    }
}

/// Geometries at odd sizes: strides, padding, a 1x1 kernel, strides larger
/// than the kernel, a kernel larger than the input, windows entirely in the
/// padding (not for max pooling), and LeNet's second convolution.
fn windows() -> Vec<Window> {
    vec![
        Window::new([2, 3, 7, 6], (3, 2), (2, 1), (1, 0)),
        Window::new([1, 1, 5, 5], (1, 1), (1, 1), (0, 0)),
        Window::new([2, 2, 5, 7], (1, 1), (2, 3), (0, 0)),
        Window::new([3, 2, 9, 8], (2, 2), (3, 4), (1, 1)),
        Window::new([1, 4, 6, 5], (3, 3), (1, 1), (1, 1)),
        Window::new([2, 1, 4, 3], (5, 4), (1, 2), (2, 1)),
        Window::new([2, 3, 8, 8], (2, 2), (2, 2), (0, 0)),
        Window::new([1, 2, 3, 4], (1, 2), (2, 3), (2, 2)),
        Window::new([8, 6, 14, 14], (5, 5), (1, 1), (0, 0)),
    ]
}

/// Values in [-2, 2) on a grid of 1/8, so that windows hold ties.
fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 16) as f32 % 32.0 / 8.0
                - 2.0
        })
        .collect()
}

/// `data` with a NaN every 13 elements.
fn data_with_nans(n: usize, seed: u32) -> Vec<f32> {
    let mut v = data(n, seed);
    v.iter_mut().step_by(13).for_each(|x| *x = f32::NAN);
    v
}

fn naive_im2col(win: &Window, x: &[f32]) -> Vec<f32> {
    win.positions()
        .into_iter()
        .map(|p| win.at(p).map_or(0.0, |i| x[i]))
        .collect()
}

fn naive_col2im(win: &Window, cols: &[f32]) -> Vec<f32> {
    let mut x = vec![0.0; win.inputs()];
    for (p, v) in win.positions().into_iter().zip(cols) {
        if let Some(i) = win.at(p) {
            x[i] += v;
        }
    }
    x
}

/// For each pooling output, the input indices of its window's in-bounds
/// elements, row-major.
fn pool_windows(win: &Window) -> Vec<Vec<usize>> {
    let mut out = vec![Vec::new(); win.outputs()];
    for p in win.positions() {
        if let Some(i) = win.at(p) {
            out[win.out_index(p)].push(i);
        }
    }
    out
}

/// The first NaN of a window, else the first of its largest values.
fn first_max(x: &[f32], window: &[usize]) -> usize {
    if let Some(&i) = window.iter().find(|&&i| x[i].is_nan()) {
        return i;
    }
    let max = window
        .iter()
        .map(|&i| x[i])
        .fold(f32::NEG_INFINITY, f32::max);
    *window.iter().find(|&&i| x[i] == max).unwrap()
}

fn naive_pool(win: &Window, kind: u32, x: &[f32]) -> Vec<f32> {
    let area = (win.kh * win.kw) as f32;
    pool_windows(win)
        .iter()
        .map(|window| match kind {
            0 => window.iter().map(|&i| x[i]).sum::<f32>() / area,
            _ => x[first_max(x, window)],
        })
        .collect()
}

fn naive_pool_backward(win: &Window, kind: u32, x: &[f32], gout: &[f32]) -> Vec<f32> {
    let area = (win.kh * win.kw) as f32;
    let mut gx = vec![0.0; win.inputs()];
    for (window, g) in pool_windows(win).iter().zip(gout) {
        match kind {
            2 => window.iter().for_each(|&i| gx[i] += g / area),
            _ => gx[first_max(x, window)] += g,
        }
    }
    gx
}

/// Runs `shader` with `KIND_VALUE` set to `kind`, binding `inputs` read-only,
/// then a NaN-filled output of `len` elements, then `info`, with one
/// invocation per output element on the folded grid. Returns the output.
fn run(
    e: &Engine,
    device: Device,
    shader: &str,
    kind: u32,
    inputs: &[&[f32]],
    len: usize,
    info: &[u32],
) -> Vec<f32> {
    let source = shader.replace("KIND_VALUE", &kind.to_string());
    let upload = |v: Vec<f32>| {
        let n = v.len();
        Tensor::from_vec_in(e, v, [n]).unwrap().to(device).unwrap()
    };
    let inputs: Vec<Tensor> = inputs.iter().map(|v| upload(v.to_vec())).collect();
    let out = upload(vec![f32::NAN; len]);
    let info = upload(info.iter().map(|&u| f32::from_bits(u)).collect());
    let groups = len.div_ceil(256);
    let gx = groups.min(65_535);
    let mut k = e.kernel("nn_kernel", source);
    for t in &inputs {
        k.read(t);
    }
    k.write(&out)
        .read(&info)
        .workgroups(gx as u32, groups.div_ceil(gx) as u32, 1);
    k.run().unwrap();
    out.to_vec().unwrap()
}

/// Equal, or both NaN, or within a relative `1e-6` (the GPU may divide with
/// a different rounding).
fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g == w || (g.is_nan() && w.is_nan()) || (g - w).abs() <= 1e-6 * (1.0 + w.abs()),
            "{what}: element {i}: {g} vs {w}"
        );
    }
}

const IM2COL: &str = include_str!("../shaders/im2col.wgsl");
const POOL: &str = include_str!("../shaders/pool.wgsl");

fn im2col_and_col2im_match_naive_loops(gpu: Device) {
    let e = Engine::builder().workers(2).build().unwrap();
    for (k, win) in windows().iter().enumerate() {
        let x = data(win.inputs(), k as u32);
        let want = naive_im2col(win, &x);
        let cols = run(&e, gpu, IM2COL, 0, &[&x], want.len(), &win.info());
        assert_eq!(cols, want, "im2col {win:?}");

        let cols = data(want.len(), k as u32 + 100);
        let got = run(&e, gpu, IM2COL, 1, &[&cols], win.inputs(), &win.info());
        assert_close(&got, &naive_col2im(win, &cols), &format!("col2im {win:?}"));
    }
}
gpu_test!(im2col_and_col2im_match_naive_loops);

fn pooling_matches_naive_loops(gpu: Device) {
    let e = Engine::builder().workers(2).build().unwrap();
    for (k, win) in windows().iter().enumerate() {
        let x = data(win.inputs(), k as u32 + 200);
        let x_nan = data_with_nans(win.inputs(), k as u32 + 300);
        let gout = data(win.outputs(), k as u32 + 400);
        let mut cases = vec![(0, &x)];
        if win.max_poolable() {
            cases.extend([(1, &x), (1, &x_nan)]);
        }
        for (kind, x) in cases {
            let what = format!("kind {kind} {win:?}");
            let got = run(&e, gpu, POOL, kind, &[x], win.outputs(), &win.info());
            assert_close(&got, &naive_pool(win, kind, x), &format!("forward {what}"));

            let kind = kind + 2;
            let got = run(&e, gpu, POOL, kind, &[x, &gout], win.inputs(), &win.info());
            let want = naive_pool_backward(win, kind, x, &gout);
            assert_close(&got, &want, &format!("backward {what}"));
        }
    }
}
gpu_test!(pooling_matches_naive_loops);
