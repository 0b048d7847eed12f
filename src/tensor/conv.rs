//! 2-D convolution and pooling over NCHW tensors.
//!
//! On a GPU a convolution is lowered to im2col (a gather of every window into
//! a row), the tiled matmul kernel and a transpose; its gradient comes from
//! the tape (col2im is the gradient of im2col). The CPU convolves one image at
//! a time with its own gradients (`conv_kernels.rs`). Pooling has its own
//! kernels both ways.

use super::conv_kernels;
use super::grads::when;
use super::kernels::BinaryOp;
use super::nn_kernels::{self, PoolKind, Window};
use super::ops::{arg_err, shape_err};
use super::shaders::Kernel;
use super::{Shape, Tensor};
use crate::device::gpu::{Gpu, Grid};
use crate::error::{Location, Result};
use std::sync::Arc;

/// Checks an NCHW input against a window geometry; returns the window.
fn window(
    op: &'static str,
    x: &Tensor,
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
    location: Location,
) -> Result<Window> {
    if x.shape.rank() != 4 {
        return Err(arg_err(
            op,
            &x.shape,
            "the input must be 4-D: [batch, channels, height, width]",
            location,
        ));
    }
    let d = x.dims();
    let err = |reason: String| arg_err(op, &x.shape, reason, location);
    if kernel.0 == 0 || kernel.1 == 0 {
        return Err(err(format!("the kernel {kernel:?} must be at least 1x1")));
    }
    if stride.0 == 0 || stride.1 == 0 {
        return Err(err(format!("the stride {stride:?} must be at least 1")));
    }
    let (ph, pw) = (d[2] + 2 * padding.0, d[3] + 2 * padding.1);
    if kernel.0 > ph || kernel.1 > pw {
        return Err(err(format!(
            "the kernel {}x{} is larger than the padded input {ph}x{pw}",
            kernel.0, kernel.1
        )));
    }
    Ok(Window {
        n: d[0],
        c: d[1],
        h: d[2],
        w: d[3],
        kh: kernel.0,
        kw: kernel.1,
        sh: stride.0,
        sw: stride.1,
        ph: padding.0,
        pw: padding.1,
    })
}

impl Tensor {
    /// 2-D convolution (cross-correlation, as in every DL library) of an NCHW
    /// input `[n, c, h, w]` with an OIHW `weight` `[o, c, kh, kw]`, an optional
    /// `bias` `[o]`, `stride` and zero `padding` per axis (rows, columns).
    /// The output is `[n, o, oh, ow]` with `oh = (h + 2 ph - kh) / sh + 1`.
    ///
    /// ```
    /// use lazyflow::{Engine, Tensor};
    /// let engine = Engine::builder().workers(1).build().unwrap();
    /// let x = Tensor::arange_in(&engine, 0.0, 9.0, 1.0).reshape([1, 1, 3, 3]).unwrap();
    /// let w = Tensor::ones_in(&engine, [1, 1, 2, 2]);
    /// let y = x.conv2d(&w, None, (1, 1), (0, 0)).unwrap();
    /// assert_eq!(y.to_vec().unwrap(), vec![8.0, 12.0, 20.0, 24.0]);
    /// ```
    #[track_caller]
    pub fn conv2d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        stride: (usize, usize),
        padding: (usize, usize),
    ) -> Result<Tensor> {
        let location = Location::caller();
        let mut all = vec![weight];
        all.extend(bias);
        self.check_device("conv2d", &all, location)?;
        let shapes = |extra: &str| {
            let mut s = vec![&self.shape, &weight.shape];
            if let Some(b) = bias {
                s.push(&b.shape);
            }
            shape_err("conv2d", &s, extra.to_string(), location)
        };
        if weight.shape.rank() != 4 {
            return Err(shapes(
                "the weight must be 4-D: [out_channels, in_channels, kh, kw]",
            ));
        }
        let wd = weight.dims();
        if self.shape.rank() == 4 && self.dims()[1] != wd[1] {
            return Err(shapes(&format!(
                "the input has {} channels, the weight expects {}",
                self.dims()[1],
                wd[1]
            )));
        }
        if let Some(b) = bias {
            if b.dims() != [wd[0]] {
                return Err(shapes(&format!("the bias must be [{}]", wd[0])));
            }
        }
        let win = window("conv2d", self, (wd[2], wd[3]), stride, padding, location)?;
        let Some(gpu) = self.gpu("conv2d", location)? else {
            return self.cpu_conv2d(weight, bias, win, location);
        };
        // A GPU: [n * p, ckk] @ [ckk, o] = [n * p, o], then to [n, o, p].
        let (o, p, ckk) = (wd[0], win.oh() * win.ow(), win.c * win.kh * win.kw);
        let cols = self.im2col_at(gpu, win, location);
        let w2 = weight
            .reshape_at([o, ckk], location)?
            .transpose_at(0, 1, location)?;
        let mut y = cols
            .matmul_at(&w2, location)?
            .reshape_at([win.n, p, o], location)?
            .transpose_at(1, 2, location)?;
        if let Some(b) = bias {
            y = y.binary_at(&b.reshape_at([o, 1], location)?, BinaryOp::Add, location)?;
        }
        y.reshape_at([win.n, o, win.oh(), win.ow()], location)
    }

    /// Records a CPU node computing a new tensor of `shape` from `inputs`.
    fn cpu_node(
        name: &'static str,
        location: Location,
        inputs: &[&Tensor],
        shape: Shape,
        f: impl FnOnce(&[&[f32]], &mut [f32]) + Send + 'static,
    ) -> Result<Tensor> {
        let first = inputs[0];
        let out = first.output(shape);
        let mut task = first.engine().task_at(name, location);
        task.device(first.device);
        let reads: Vec<_> = inputs.iter().map(|t| task.read(&t.var)).collect();
        let o = task.write(&out.var);
        let n = out.numel();
        task.push_fallible(move || {
            let guards: Vec<_> = reads.iter().map(|r| r.read()).collect();
            let mut slices: Vec<&[f32]> = Vec::with_capacity(guards.len());
            for g in &guards {
                slices.push(g.host()?.as_slice());
            }
            let mut v = super::ops::zeroed(n)?;
            f(&slices, &mut v);
            drop(slices);
            drop(guards);
            *o.write() = super::Data::Host(v);
            Ok(())
        })?;
        Ok(out)
    }

    /// The CPU's convolution (see `conv_kernels.rs`) and its gradients.
    fn cpu_conv2d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        win: Window,
        location: Location,
    ) -> Result<Tensor> {
        let o = weight.dims()[0];
        let threads = self.engine().cpu_threads();
        let shape = Shape::from([win.n, o, win.oh(), win.ow()]);
        let mut inputs = vec![self, weight];
        inputs.extend(bias);
        let with_bias = bias.is_some();
        let out = Tensor::cpu_node("conv2d", location, &inputs, shape, move |ins, out| {
            let bias = with_bias.then(|| ins[2]);
            conv_kernels::conv2d(ins[0], ins[1], bias, &win, o, out, threads)
        })?;
        if !Tensor::any_taped(&inputs) {
            return Ok(out);
        }
        let x = super::autograd::Saved::new(self, "conv2d", location);
        let w = super::autograd::Saved::new(weight, "conv2d", location);
        let l = location;
        Ok(out.taped("conv2d", location, &inputs, move |g, needs| {
            let gx = when(needs[0], || {
                let shape = x.get()?.shape.clone();
                Tensor::cpu_node(
                    "conv2d_grad_input",
                    l,
                    &[g, w.get()?],
                    shape,
                    move |ins, gx| {
                        conv_kernels::conv2d_grad_input(ins[0], ins[1], &win, o, gx, threads)
                    },
                )
            })?;
            let gw = when(needs[1], || {
                let shape = w.get()?.shape.clone();
                Tensor::cpu_node(
                    "conv2d_grad_weight",
                    l,
                    &[x.get()?, g],
                    shape,
                    move |ins, gw| {
                        conv_kernels::conv2d_grad_weight(ins[0], ins[1], &win, o, gw, threads)
                    },
                )
            })?;
            let mut grads = vec![gx, gw];
            if needs.len() > 2 {
                grads.push(when(needs[2], || {
                    g.reshape_at([win.n, o, win.oh() * win.ow()], l)?
                        .reduce_axis_at(super::kernels::ReduceOp::Sum, 2, l)?
                        .reduce_axis_at(super::kernels::ReduceOp::Sum, 0, l)
                })?);
            }
            Ok(grads)
        }))
    }

    /// Every window of `self` (NCHW, on `gpu`) as a row: `[n * oh * ow, c * kh * kw]`.
    fn im2col_at(&self, gpu: Arc<Gpu>, win: Window, location: Location) -> Tensor {
        let shape = Shape::from([win.n * win.oh() * win.ow(), win.c * win.kh * win.kw]);
        let (info, n) = (win.info(), shape.numel());
        let back = gpu.clone();
        let out = self.gpu_node1(gpu, "im2col", location, shape, move |g, x, out| {
            Kernel::Im2col.dispatch(g, "0", &[x, out], &info, Grid::Elements(n))
        });
        out.taped("im2col", location, &[self], move |g, _| {
            Ok(vec![Some(g.col2im_at(back.clone(), win, location))])
        })
    }

    /// The adjoint of im2col: sums each row entry back into its input position.
    fn col2im_at(&self, gpu: Arc<Gpu>, win: Window, location: Location) -> Tensor {
        let shape = Shape::from([win.n, win.c, win.h, win.w]);
        let (info, n) = (win.info(), shape.numel());
        self.gpu_node1(gpu, "col2im", location, shape, move |g, cols, x| {
            Kernel::Im2col.dispatch(g, "1", &[cols, x], &info, Grid::Elements(n))
        })
    }

    /// Max pooling of an NCHW tensor over `kernel` windows moved by `stride`,
    /// with `padding` that never wins (it must be smaller than the kernel). NaN
    /// propagates. The gradient goes to the first maximum of each window.
    ///
    /// ```
    /// use lazyflow::{Engine, Tensor};
    /// let engine = Engine::builder().workers(1).build().unwrap();
    /// let x = Tensor::arange_in(&engine, 0.0, 16.0, 1.0).reshape([1, 1, 4, 4]).unwrap();
    /// let y = x.max_pool2d((2, 2), (2, 2), (0, 0)).unwrap();
    /// assert_eq!(y.to_vec().unwrap(), vec![5.0, 7.0, 13.0, 15.0]);
    /// ```
    #[track_caller]
    pub fn max_pool2d(
        &self,
        kernel: (usize, usize),
        stride: (usize, usize),
        padding: (usize, usize),
    ) -> Result<Tensor> {
        self.pool_at(PoolKind::Max, kernel, stride, padding, Location::caller())
    }

    /// Average pooling of an NCHW tensor: each window's sum divided by its area
    /// (`kh * kw`, padding counted as zeros, as PyTorch's default).
    ///
    /// ```
    /// use lazyflow::{Engine, Tensor};
    /// let engine = Engine::builder().workers(1).build().unwrap();
    /// let x = Tensor::arange_in(&engine, 0.0, 16.0, 1.0).reshape([1, 1, 4, 4]).unwrap();
    /// let y = x.avg_pool2d((2, 2), (2, 2), (0, 0)).unwrap();
    /// assert_eq!(y.to_vec().unwrap(), vec![2.5, 4.5, 10.5, 12.5]);
    /// ```
    #[track_caller]
    pub fn avg_pool2d(
        &self,
        kernel: (usize, usize),
        stride: (usize, usize),
        padding: (usize, usize),
    ) -> Result<Tensor> {
        self.pool_at(PoolKind::Avg, kernel, stride, padding, Location::caller())
    }

    fn pool_at(
        &self,
        kind: PoolKind,
        kernel: (usize, usize),
        stride: (usize, usize),
        padding: (usize, usize),
        location: Location,
    ) -> Result<Tensor> {
        let name = match kind {
            PoolKind::Max => "max_pool2d",
            PoolKind::Avg => "avg_pool2d",
        };
        let win = window(name, self, kernel, stride, padding, location)?;
        if padding.0 >= kernel.0 || padding.1 >= kernel.1 {
            return Err(arg_err(
                name,
                &self.shape,
                format!("the padding {padding:?} must be smaller than the kernel {kernel:?}"),
                location,
            ));
        }
        let shape = Shape::from([win.n, win.c, win.oh(), win.ow()]);
        let out = match self.gpu(name, location)? {
            Some(gpu) => {
                let info = win.info();
                let n = shape.numel();
                let spec = match kind {
                    PoolKind::Avg => "0",
                    PoolKind::Max => "1",
                };
                self.gpu_node1(gpu, name, location, shape, move |g, x, out| {
                    Kernel::Pool.dispatch(g, spec, &[x, out], &info, Grid::Elements(n))
                })
            }
            None => self.map1(name, location, shape, move |x, out| {
                nn_kernels::pool2d(kind, x, &win, out)
            }),
        };
        if !Tensor::any_taped(&[self]) {
            return Ok(out);
        }
        let x = super::autograd::Saved::new(self, name, location);
        Ok(out.taped(name, location, &[self], move |g, _| {
            Ok(vec![Some(
                x.get()?.pool_backward_at(g, kind, win, name, location)?,
            )])
        }))
    }

    /// The gradient of a pooling of `self` given the output's gradient `g`.
    fn pool_backward_at(
        &self,
        g: &Tensor,
        kind: PoolKind,
        win: Window,
        name: &'static str,
        location: Location,
    ) -> Result<Tensor> {
        let shape = self.shape.clone();
        match self.gpu(name, location)? {
            Some(gpu) => {
                let info = win.info();
                let n = shape.numel();
                let spec = match kind {
                    PoolKind::Avg => "2",
                    PoolKind::Max => "3",
                };
                self.gpu_node2(g, gpu, name, location, shape, move |gp, x, gout, gx| {
                    Kernel::Pool.dispatch(gp, spec, &[x, gout, gx], &info, Grid::Elements(n))
                })
            }
            None => self.map2(g, name, location, shape, move |x, gout, gx| {
                nn_kernels::pool2d_backward(kind, x, gout, &win, gx)
            }),
        }
    }
}
