//! Tensor ops on a GPU device: elementwise kernels from `shaders/`, specialized by
//! the op's WGSL expression. Ops without a GPU kernel yet return
//! [`Error::Unsupported`] at record time.

use super::kernels::{BinaryOp, UnaryOp};
use super::{Data, Shape, Tensor};
use crate::device::gpu::{Gpu, Kernel};
use crate::device::Device;
use crate::error::{Error, Location, Result};
use std::sync::Arc;

/// The WGSL expression of a binary op on `l` and `r`.
fn binary_expr(op: BinaryOp, l: &str, r: &str) -> String {
    let cmp = |c: &str| format!("select(0.0, 1.0, {l} {c} {r})");
    match op {
        BinaryOp::Add => format!("{l} + {r}"),
        BinaryOp::Sub => format!("{l} - {r}"),
        BinaryOp::Mul => format!("{l} * {r}"),
        BinaryOp::Div => format!("{l} / {r}"),
        BinaryOp::Maximum => format!("max({l}, {r})"),
        BinaryOp::Minimum => format!("min({l}, {r})"),
        BinaryOp::Pow => format!("pow({l}, {r})"),
        BinaryOp::Eq => cmp("=="),
        BinaryOp::Ne => cmp("!="),
        BinaryOp::Lt => cmp("<"),
        BinaryOp::Le => cmp("<="),
        BinaryOp::Gt => cmp(">"),
        BinaryOp::Ge => cmp(">="),
    }
}

/// The WGSL expression of a unary op on `x`.
fn unary_expr(op: UnaryOp) -> &'static str {
    match op {
        UnaryOp::Neg => "-x",
        UnaryOp::Exp => "exp(x)",
        UnaryOp::Log => "log(x)",
        UnaryOp::Sqrt => "sqrt(x)",
        UnaryOp::Abs => "abs(x)",
        UnaryOp::Relu => "max(x, 0.0)",
        UnaryOp::Sigmoid => "1.0 / (1.0 + exp(-x))",
        // tanh is exactly +-1 in f32 beyond |x| = 9; clamping avoids inf / inf.
        UnaryOp::Tanh => "tanh(clamp(x, -10.0, 10.0))",
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
        out.push((Kernel::Binary, binary_expr(op, "x", "y")));
        out.push((Kernel::Map, binary_expr(op, "x", "s")));
        out.push((Kernel::Map, binary_expr(op, "s", "x")));
    }
    for op in [Neg, Exp, Log, Sqrt, Abs, Relu, Sigmoid, Tanh] {
        out.push((Kernel::Map, unary_expr(op).to_string()));
    }
    out
}

/// `[n, rank, out_dims, a_strides, b_strides]` with stride 0 on broadcast dims.
fn broadcast_info(a: &Shape, b: &Shape, out: &Shape) -> Vec<u32> {
    let rank = out.rank();
    let strides = |s: &Shape| -> Vec<u32> {
        let own = s.strides();
        (0..rank)
            .map(|d| {
                let offset = rank - s.rank();
                if d < offset || s.dims()[d - offset] == 1 {
                    0
                } else {
                    own[d - offset] as u32
                }
            })
            .collect()
    };
    let mut info = vec![out.numel() as u32, rank as u32];
    info.extend(out.dims().iter().map(|&d| d as u32));
    info.extend(strides(a));
    info.extend(strides(b));
    info
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

    pub(crate) fn gpu_binary(
        &self,
        gpu: Arc<Gpu>,
        other: &Tensor,
        op: BinaryOp,
        out_shape: Shape,
        location: Location,
    ) -> Result<Tensor> {
        let name = op.name();
        gpu.check_size(name, &out_shape, location)?;
        let info = broadcast_info(&self.shape, &other.shape, &out_shape);
        let expr = binary_expr(op, "x", "y");
        let n = out_shape.numel();
        let out = self.output(out_shape);
        let mut t = self.engine().task_at(name, location);
        t.device(self.device);
        let a = t.read(&self.var);
        let o = t.write(&out.var);
        let b = (!self.same_data(other)).then(|| t.read(&other.var));
        let pending = gpu.expect_node();
        t.push_fallible(move || {
            let buf = gpu.alloc(n)?;
            {
                let ga = a.read();
                let ab = ga.gpu()?;
                match &b {
                    Some(b) => {
                        let gb = b.read();
                        gpu.dispatch(Kernel::Binary, &expr, &[ab, gb.gpu()?, &buf], &info, n)?;
                    }
                    None => gpu.dispatch(Kernel::Binary, &expr, &[ab, ab, &buf], &info, n)?,
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
        let out = self.output(self.shape.clone());
        let mut t = self.engine().task_at(name, location);
        t.device(self.device);
        let a = t.read(&self.var);
        let o = t.write(&out.var);
        let info = [n as u32, s.to_bits()];
        let pending = gpu.expect_node();
        // Cannot fail: both Vars belong to this engine.
        let _ = t.push_fallible(move || {
            let buf = gpu.alloc(n)?;
            gpu.dispatch(Kernel::Map, &expr, &[a.read().gpu()?, &buf], &info, n)?;
            *o.write() = Data::Gpu(buf);
            drop(pending);
            Ok(())
        });
        out
    }

    pub(crate) fn gpu_scalar(
        &self,
        gpu: Arc<Gpu>,
        s: f32,
        op: BinaryOp,
        scalar_left: bool,
        location: Location,
    ) -> Tensor {
        let expr = if scalar_left {
            binary_expr(op, "s", "x")
        } else {
            binary_expr(op, "x", "s")
        };
        self.gpu_map(gpu, op.name(), expr, s, location)
    }

    pub(crate) fn gpu_unary(&self, gpu: Arc<Gpu>, op: UnaryOp, location: Location) -> Tensor {
        self.gpu_map(gpu, op.name(), unary_expr(op).to_string(), 0.0, location)
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
        assert!(specs.len() >= 13 * 3 + 8);
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
