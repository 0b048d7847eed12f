//! Fusion of elementwise GPU ops into generated kernels: each device's open
//! group, kept in the device's deferred-encode hook, and the kernels generated
//! from it.
//!
//! An elementwise node on a GPU (binary with broadcasting, scalar, unary) does not
//! dispatch a kernel when it runs: it appends its op to its device's open *group*
//! and completes (the device queue is in order, so nothing can observe the
//! difference). The group is turned into one generated WGSL kernel when anything
//! else is encoded on the device (another kernel, a copy, a readback, a submit),
//! when an op of another output shape arrives, or when the group reaches its size
//! or binding limit. In that kernel, values produced inside the group stay in
//! registers, and a value is written to memory only if something outside the
//! group can still read it: its Var has a handle left or a pending node holds it.
//! So a chain `x = x + 1` repeated n times becomes one kernel with one output, and
//! results nobody keeps are never written.
//!
//! The group lives in its device's deferred-encode hook ([`DeferredEncode`]),
//! so the device encodes it before anything else it encodes, submits or reads
//! back; its lock comes before the device's batch lock.
//!
//! Every output joins the group's fate when its op joins (see `device/gpu.rs`):
//! if the group cannot be encoded, that fate fails and so does every value the
//! group would have written, whichever node triggered the encoding.
//!
//! Generated kernels are cached by their source, which depends only on the
//! structure of the group (shapes, strides and scalars live in the info buffer).

use super::kernels::{BinaryOp, UnaryOp};
use super::Data;
use crate::device::gpu::{
    Access, DeferredEncode, Fate, Gpu, GpuBuffer, Grid, KernelSource, Lineage, Writers,
};
use crate::var::{Read, Write};
use std::collections::HashMap;
use std::fmt::Write as _;

/// Ops per fused kernel at most.
const MAX_OPS: usize = 64;

/// One elementwise op.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ElemOp {
    /// `f(a, b)`.
    Binary(BinaryOp),
    /// `f(x)`.
    Unary(UnaryOp),
}

/// An operand of a fused op as the tensor layer hands it over.
pub(crate) enum Input {
    /// A tensor: its data and its shape (which broadcasts to the output's).
    Tensor(Read<Data>, Vec<usize>),
    /// A constant.
    Scalar(f32),
}

enum Arg {
    /// Element `i` of a bound buffer (same shape as the output).
    Leaf(usize),
    /// A bound buffer read with broadcasting strides.
    Strided(usize, Vec<u32>),
    /// A value computed earlier in the same kernel.
    Value(usize),
    Scalar(f32),
}

struct Op {
    op: ElemOp,
    args: Vec<Arg>,
    out: Write<Data>,
}

struct Group {
    dims: Vec<usize>,
    ops: Vec<Op>,
    leaves: Vec<Read<Data>>,
    leaf_ids: HashMap<usize, usize>,
    /// Output data id -> op index.
    outputs: HashMap<usize, usize>,
    /// Fails every output if the group cannot be encoded.
    fate: std::sync::Arc<Fate>,
    /// The ops of the group, for that failure's message.
    writers: Writers,
}

/// The open group of one device.
#[derive(Default)]
pub(crate) struct Fuser {
    group: Option<Group>,
}

/// Strides (in elements) that read a tensor of `shape` at each index of `out`
/// under numpy broadcasting: 0 along broadcast dimensions.
pub(crate) fn broadcast_strides(shape: &[usize], out: &[usize]) -> Vec<u32> {
    let rank = out.len();
    let offset = rank - shape.len();
    let mut own = vec![0usize; shape.len()];
    let mut acc = 1;
    for d in (0..shape.len()).rev() {
        own[d] = acc;
        acc *= shape[d];
    }
    (0..rank)
        .map(|d| {
            if d < offset || shape[d - offset] == 1 {
                0
            } else {
                own[d - offset] as u32
            }
        })
        .collect()
}

impl Fuser {
    /// Adds `out = op(inputs)` (output shape `dims`) to the device's group,
    /// encoding the open group first when this op cannot join it.
    fn push(
        &mut self,
        gpu: &Gpu,
        dims: &[usize],
        op: ElemOp,
        inputs: Vec<Input>,
        out: Write<Data>,
    ) -> Result<(), String> {
        let fits = self.group.as_ref().is_some_and(|g| {
            g.dims == dims
                && g.ops.len() < MAX_OPS
                && g.leaves.len() + g.ops.len() + inputs.len() + 2 <= gpu.max_bindings()
        });
        if !fits {
            self.encode_group(gpu);
        }
        let group = self.group.get_or_insert_with(|| Group {
            dims: dims.to_vec(),
            ops: Vec::new(),
            leaves: Vec::new(),
            leaf_ids: HashMap::new(),
            outputs: HashMap::new(),
            fate: Fate::new(),
            writers: Writers::default(),
        });
        group.writers.note();
        // The output's value depends on the group and on its tensor inputs.
        let mut lineage = Lineage::new();
        lineage.push(group.fate.clone());
        let mut args = Vec::with_capacity(inputs.len());
        for input in inputs {
            args.push(match input {
                Input::Scalar(s) => Arg::Scalar(s),
                Input::Tensor(token, shape) => {
                    if let Ok(b) = token.read().gpu() {
                        b.lineage_into(&mut lineage);
                    }
                    let id = token.data_id();
                    if let Some(&j) = group.outputs.get(&id) {
                        Arg::Value(j)
                    } else {
                        let leaf = match group.leaf_ids.get(&id) {
                            Some(&l) => l,
                            None => {
                                group.leaves.push(token);
                                group.leaf_ids.insert(id, group.leaves.len() - 1);
                                group.leaves.len() - 1
                            }
                        };
                        if shape == dims {
                            Arg::Leaf(leaf)
                        } else {
                            Arg::Strided(leaf, broadcast_strides(&shape, dims))
                        }
                    }
                }
            });
        }
        if let Ok(b) = out.read().gpu() {
            b.stamp(lineage);
        }
        group.outputs.insert(out.data_id(), group.ops.len());
        group.ops.push(Op { op, args, out });
        Ok(())
    }

    /// Adds `out = op(inputs)` to `gpu`'s group (see [`Fuser::push`]).
    pub(crate) fn fuse(
        gpu: &Gpu,
        dims: &[usize],
        op: ElemOp,
        inputs: Vec<Input>,
        out: Write<Data>,
    ) -> Result<(), String> {
        gpu.check_lost()?;
        gpu.with_deferred(|fuser: &mut Fuser| fuser.push(gpu, dims, op, inputs, out))
    }

    /// Encodes the open group as one kernel (nothing if it is empty or writes
    /// nothing anyone can read). A failure fails the group's fate, and with it
    /// every value the group writes.
    fn encode_group(&mut self, gpu: &Gpu) {
        let Some(group) = self.group.take() else {
            return;
        };
        match encode_kernel(gpu, &group) {
            // Its outputs now depend on the batch it went into.
            Ok(()) => group.fate.settle(),
            Err(e) => {
                let message = format!("encoding the fused kernel of {} failed: {e}", group.writers);
                group.fate.fail(message.clone());
                gpu.note_failure(message);
            }
        }
    }
}

impl DeferredEncode for Fuser {
    fn encode(&mut self, gpu: &Gpu) {
        self.encode_group(gpu);
    }
}

fn encode_kernel(gpu: &Gpu, group: &Group) -> Result<(), String> {
    let n: usize = group.dims.iter().product();
    // A value is written if anything outside the group can still read it: a
    // handle or a token besides the group's own write token (readers inside
    // the group gave theirs up when they joined).
    let written: Vec<bool> = group.ops.iter().map(|op| op.out.reach() > 1).collect();
    if n == 0 || !written.iter().any(|w| *w) {
        return Ok(());
    }
    let (source, info) = generate(group, &written);
    let leaf_guards: Vec<_> = group.leaves.iter().map(|l| l.read()).collect();
    let out_guards: Vec<_> = group
        .ops
        .iter()
        .zip(&written)
        .filter(|(_, w)| **w)
        .map(|(op, _)| op.out.read())
        .collect();
    let mut bindings: Vec<(&GpuBuffer, Access)> =
        Vec::with_capacity(leaf_guards.len() + out_guards.len());
    for g in &leaf_guards {
        bindings.push((g.gpu()?, Access::Read));
    }
    for g in &out_guards {
        bindings.push((g.gpu()?, Access::Write));
    }
    // Under the hook's lock: `dispatch` would encode the group again.
    gpu.dispatch_direct(
        KernelSource::WHOLE,
        &source,
        &bindings,
        &info,
        Grid::Elements(n),
    )
}

/// The kernel source and its info buffer: `[n, rank, dims, strides..., scalars...]`.
fn generate(group: &Group, written: &[bool]) -> (String, Vec<u32>) {
    let rank = group.dims.len();
    let n: usize = group.dims.iter().product();
    let mut info: Vec<u32> = vec![n as u32, rank as u32];
    info.extend(group.dims.iter().map(|&d| d as u32));
    let mut src = String::new();
    let leaves = group.leaves.len();
    for l in 0..leaves {
        let _ = writeln!(
            src,
            "@group(0) @binding({l}) var<storage, read> l{l}: array<f32>;"
        );
    }
    let mut binding = leaves;
    let mut out_names = Vec::new();
    for (j, w) in written.iter().enumerate() {
        if *w {
            let _ = writeln!(
                src,
                "@group(0) @binding({binding}) var<storage, read_write> o{j}: array<f32>;"
            );
            out_names.push(j);
            binding += 1;
        }
    }
    let _ = writeln!(
        src,
        "@group(0) @binding({binding}) var<storage, read> info: array<u32>;"
    );
    src.push_str(
        "\n@compute @workgroup_size(256)\n\
         fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {\n    \
         let i = gid.x + gid.y * groups.x * 256u;\n    \
         if (i >= info[0]) {\n        return;\n    }\n",
    );
    let strided = group
        .ops
        .iter()
        .any(|op| op.args.iter().any(|a| matches!(a, Arg::Strided(..))));
    if strided {
        // The output index, one coordinate per dimension.
        src.push_str("    var rest = i;\n");
        for d in (0..rank).rev() {
            let _ = writeln!(src, "    let c{d} = rest % info[{}u];", 2 + d);
            let _ = writeln!(src, "    rest = rest / info[{}u];", 2 + d);
        }
    }
    let operand = |arg: &Arg, info: &mut Vec<u32>| -> String {
        match arg {
            Arg::Leaf(l) => format!("l{l}[i]"),
            Arg::Value(j) => format!("t{j}"),
            Arg::Scalar(s) => {
                info.push(s.to_bits());
                format!("bitcast<f32>(info[{}u])", info.len() - 1)
            }
            Arg::Strided(l, strides) => {
                let base = info.len();
                info.extend_from_slice(strides);
                let terms: Vec<String> = (0..rank)
                    .map(|d| format!("c{d} * info[{}u]", base + d))
                    .collect();
                format!(
                    "l{l}[{}]",
                    if terms.is_empty() {
                        "0u".to_string()
                    } else {
                        terms.join(" + ")
                    }
                )
            }
        }
    };
    for (j, op) in group.ops.iter().enumerate() {
        let expr = match op.op {
            ElemOp::Unary(u) => {
                let x = operand(&op.args[0], &mut info);
                super::gpu_ops::unary_wgsl(u, &format!("({x})"))
            }
            ElemOp::Binary(b) => {
                let x = operand(&op.args[0], &mut info);
                let y = operand(&op.args[1], &mut info);
                super::gpu_ops::binary_wgsl(b, &format!("({x})"), &format!("({y})"))
            }
        };
        let _ = writeln!(src, "    let t{j} = {expr};");
    }
    for j in out_names {
        let _ = writeln!(src, "    o{j}[i] = t{j};");
    }
    src.push_str("}\n");
    (src, info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_strides_zero_broadcast_dimensions() {
        assert_eq!(broadcast_strides(&[3, 1], &[2, 3, 4]), vec![0, 1, 0]);
        assert_eq!(broadcast_strides(&[4], &[2, 3, 4]), vec![0, 0, 1]);
        assert_eq!(broadcast_strides(&[2, 3, 4], &[2, 3, 4]), vec![12, 4, 1]);
    }
}
