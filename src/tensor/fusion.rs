//! Fusion of elementwise GPU ops into generated kernels: each device's open
//! group, kept in the device's deferred-encode hook, and the kernels generated
//! from it.
//!
//! In Lazy and Async mode, elementwise ops on a GPU (binary with broadcasting,
//! scalar, unary) are recorded in batches (`batch.rs`), and each batch's node
//! makes one *group* of its ops ([`Fuser::fuse_batch`]) and encodes it, so the
//! groups are fixed at record time. In Sync mode each op is a node that
//! appends its op to its device's open group and completes (the device queue is
//! in order, so nothing can observe the difference); that group is encoded when
//! anything else is encoded on the device (another kernel, a copy, a readback,
//! a submit), when an op of another output shape arrives, or when it reaches
//! [`MAX_OPS`] ops or binds as many inputs as the adapter allows. In a group's
//! kernel, values produced inside the group stay in registers, and a value is
//! written to memory only if something outside the group can still read it:
//! its Var has a handle left or a pending node holds it. So a chain
//! `x = x + 1` repeated n times becomes n / 256 kernels with one output each,
//! and results nobody keeps are never written.
//!
//! Outputs do not limit a group while it grows (which of them are written is
//! known only when it is encoded). A kernel that writes several values of at
//! most `PACK_MAX_BYTES` (4 KiB) each writes them into one slab buffer, bound
//! once, each value a range of it at an aligned offset (`Gpu::pack`): 256 kept
//! small values are one kernel. Otherwise each written value is a binding of
//! its own, and a group that would bind more buffers than the adapter allows
//! (32 storage buffers per stage on lavapipe's Vulkan, 16 on GL) is encoded as
//! several kernels, each writing what the later ones read. A value keeps its
//! whole slab alive (at most 256 values of 4 KiB).
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
//! structure of the group and on the size class of its tensors (shapes,
//! strides and scalars live in the info buffer, and names are local to the
//! kernel). The size class sets the workgroup: 256 invocations, or for fewer
//! elements the smallest power of two from 32 that covers them: lavapipe runs
//! every invocation of a workgroup, idle ones included (the chain of
//! `gpu_bench` on 2 elements went from 1.16-1.64 to 0.93-1.16 us per op).

use super::kernels::{BinaryOp, UnaryOp};
use super::Data;
use crate::device::gpu::{
    Access, DeferredEncode, Fate, Gpu, GpuBuffer, Grid, KernelSource, Lineage, Writers,
};
use crate::var::{Read, Write};
use rustc_hash::FxHashMap as HashMap;
use smallvec::SmallVec;
use std::fmt::Write as _;

/// Ops per fused group at most (a group becomes one kernel unless the
/// adapter's bindings split it). Lavapipe's cost per dispatch is several
/// times a small op's, and a 256-op chain compiles once into one kernel.
pub(crate) const MAX_OPS: usize = 256;

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
    Tensor(Read<Data>, Dims),
    /// A constant.
    Scalar(f32),
}

/// A shape as an op carries it: inline up to rank 4 (no allocation per op).
pub(crate) type Dims = smallvec::SmallVec<[usize; 4]>;

/// The operands of one op: inline up to two.
pub(crate) type Inputs = smallvec::SmallVec<[Input; 2]>;

enum Arg {
    /// Element `i` of a bound buffer (same shape as the output).
    Leaf(usize),
    /// A bound buffer read with broadcasting strides.
    Strided(usize, Vec<u32>),
    /// A value computed earlier in the same kernel.
    Value(usize),
    Scalar(f32),
}

/// One op of a record-time batch, for [`Fuser::fuse_batch`].
pub(crate) struct BatchOp {
    pub(crate) dims: Dims,
    pub(crate) op: ElemOp,
    pub(crate) inputs: Inputs,
    pub(crate) out: Write<Data>,
    /// Whether anything outside the batch can read the value (decided when
    /// the batch was recorded).
    pub(crate) keep: bool,
    pub(crate) seq: u64,
    /// The op as errors and stamps name it.
    pub(crate) running: crate::error::RunningOp,
}

struct Op {
    op: ElemOp,
    args: SmallVec<[Arg; 2]>,
    out: Write<Data>,
    /// Whether the value is written, if decided before (a batch's op);
    /// else it is written if anything outside the group can read it.
    keep: Option<bool>,
    /// When the op was recorded (see [`record_order`]).
    seq: u64,
}

/// A number for an elementwise GPU op taken when it is recorded: ops join a
/// group in the order workers run them, which varies from run to run when
/// independent ops run at once; a group is put back in record order before it
/// is encoded, so that the same ops make the same kernel source (and hit the
/// compiled-kernel cache) whatever the timing. Record order is a valid order:
/// an op is recorded after the ops whose values it reads.
pub(crate) fn record_order() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
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
    /// Generated sources by the structure of their kernel (see [`structure`]):
    /// a group of a known structure skips generating its WGSL.
    sources: HashMap<Vec<u32>, std::sync::Arc<str>>,
    /// Ops the next group is made room for (a batch's length; else grown).
    expect_ops: usize,
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
    /// Whether an op of shape `dims` with `inputs` operands joins the open
    /// group (else the group is encoded first).
    fn fits(&self, gpu: &Gpu, dims: &[usize], inputs: usize) -> bool {
        self.group.as_ref().is_some_and(|g| {
            g.dims == dims
                && g.ops.len() < MAX_OPS
                && g.leaves.len() + inputs + 2 <= gpu.max_bindings()
        })
    }

    /// Marks the open group's values that `reads` names as written.
    fn keep_if_read(&mut self, reads: &std::collections::HashSet<usize>) {
        if let Some(g) = &mut self.group {
            for op in &mut g.ops {
                if reads.contains(&op.out.data_id()) {
                    op.keep = Some(true);
                }
            }
        }
    }

    /// Adds `out = op(inputs)` (output shape `dims`) to the device's group,
    /// encoding the open group first when this op cannot join it.
    #[allow(clippy::too_many_arguments)]
    fn push(
        &mut self,
        gpu: &Gpu,
        dims: &[usize],
        op: ElemOp,
        inputs: Inputs,
        out: Write<Data>,
        keep: Option<bool>,
        seq: u64,
    ) -> Result<(), String> {
        // Outputs are not counted here: which values a group writes is known
        // only when it is encoded, and a group that would bind too many is
        // encoded as several kernels then (see `encode_kernel`).
        if !self.fits(gpu, dims, inputs.len()) {
            self.encode_group(gpu);
        }
        let expect = self.expect_ops;
        let group = self.group.get_or_insert_with(|| Group {
            dims: dims.to_vec(),
            ops: Vec::with_capacity(expect),
            leaves: Vec::new(),
            leaf_ids: HashMap::default(),
            outputs: HashMap::default(),
            fate: Fate::new(),
            writers: Writers::default(),
        });
        group.writers.note();
        // The output's value depends on the group and on its tensor inputs.
        let mut lineage = Lineage::new();
        lineage.push(group.fate.clone());
        let mut args: SmallVec<[Arg; 2]> = SmallVec::new();
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
                        if shape.as_slice() == dims {
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
        group.ops.push(Op {
            op,
            args,
            out,
            keep,
            seq,
        });
        Ok(())
    }

    /// Adds `out = op(inputs)`, recorded as number `seq` of
    /// [`record_order`], to `gpu`'s group (see [`Fuser::push`]).
    pub(crate) fn fuse(
        gpu: &Gpu,
        dims: &[usize],
        op: ElemOp,
        inputs: Inputs,
        out: Write<Data>,
        seq: u64,
    ) -> Result<(), String> {
        gpu.check_lost()?;
        gpu.with_deferred(|fuser: &mut Fuser| fuser.push(gpu, dims, op, inputs, out, None, seq))
    }

    /// Adds the ops of one record-time batch (see `batch.rs`), in order, as
    /// a group of their own, and encodes it: which ops share a kernel then
    /// depends only on how they were recorded, not on which of several
    /// independent batches a worker ran first.
    pub(crate) fn fuse_batch(gpu: &Gpu, ops: Vec<BatchOp>) -> Result<(), String> {
        gpu.check_lost()?;
        // The data each op reads, to find the values a later part of the
        // batch needs when the group is split (see below).
        let reads: Vec<SmallVec<[usize; 2]>> = ops
            .iter()
            .map(|op| {
                op.inputs
                    .iter()
                    .filter_map(|i| match i {
                        Input::Tensor(token, _) => Some(token.data_id()),
                        Input::Scalar(_) => None,
                    })
                    .collect()
            })
            .collect();
        gpu.with_deferred(|fuser: &mut Fuser| {
            fuser.encode_group(gpu);
            fuser.expect_ops = ops.len();
            for (at, op) in ops.into_iter().enumerate() {
                // The batch decided which values are written for the whole
                // batch; when the group must be encoded before this op (the
                // bindings ran out), a value of it that a later op of the
                // batch reads is written too.
                if !fuser.fits(gpu, &op.dims, op.inputs.len()) {
                    let later: std::collections::HashSet<usize> =
                        reads[at..].iter().flatten().copied().collect();
                    fuser.keep_if_read(&later);
                }
                let _running = crate::error::Running::enter(op.running);
                fuser.push(
                    gpu,
                    &op.dims,
                    op.op,
                    op.inputs,
                    op.out,
                    Some(op.keep),
                    op.seq,
                )?;
            }
            // Encoded here, inside the batch's node (a failure of the device
            // batch it goes into names these ops), not by whatever encodes
            // next on the device.
            fuser.encode_group(gpu);
            fuser.expect_ops = 0;
            Ok(())
        })
    }

    /// Encodes the open group as one kernel (nothing if it is empty or writes
    /// nothing anyone can read). A failure fails the group's fate, and with it
    /// every value the group writes.
    fn encode_group(&mut self, gpu: &Gpu) {
        let Some(mut group) = self.group.take() else {
            return;
        };
        group.sort_by_record_order();
        match encode_kernel(gpu, &group, &mut self.sources) {
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

impl Group {
    /// Puts the ops in record order (see [`record_order`]), renumbering the
    /// values they read.
    fn sort_by_record_order(&mut self) {
        if self.ops.windows(2).all(|w| w[0].seq < w[1].seq) {
            return;
        }
        let mut order: Vec<usize> = (0..self.ops.len()).collect();
        order.sort_by_key(|&j| self.ops[j].seq);
        let mut position = vec![0; order.len()];
        for (new, &old) in order.iter().enumerate() {
            position[old] = new;
        }
        let mut ops: Vec<Option<Op>> = std::mem::take(&mut self.ops)
            .into_iter()
            .map(Some)
            .collect();
        self.ops = order
            .iter()
            .map(|&old| {
                let mut op = ops[old].take().expect("each op once");
                for a in &mut op.args {
                    if let Arg::Value(k) = a {
                        *k = position[*k];
                    }
                }
                op
            })
            .collect();
        for j in self.outputs.values_mut() {
            *j = position[*j];
        }
    }
}

impl DeferredEncode for Fuser {
    fn encode(&mut self, gpu: &Gpu) {
        self.encode_group(gpu);
    }
}

fn encode_kernel(
    gpu: &Gpu,
    group: &Group,
    sources: &mut HashMap<Vec<u32>, std::sync::Arc<str>>,
) -> Result<(), String> {
    let n: usize = group.dims.iter().product();
    // A value is written if anything outside the group can still read it: a
    // handle or a token besides the group's own write token (readers inside
    // the group gave theirs up when they joined).
    let kept: Vec<bool> = group
        .ops
        .iter()
        .map(|op| op.keep.unwrap_or_else(|| op.out.reach() > 1))
        .collect();
    if n == 0 || !kept.iter().any(|w| *w) {
        return Ok(());
    }
    // Ops after the last kept value compute nothing anyone reads.
    let end = kept.iter().rposition(|k| *k).map_or(0, |last| last + 1);
    let last_use = last_uses(group);
    let mut start = 0;
    while start < end {
        let stop = segment_end(group, &kept, &last_use, start, end, gpu.max_bindings());
        encode_segment(gpu, group, &kept, &last_use, start..stop, n, sources)?;
        start = stop;
    }
    Ok(())
}

/// For each op, the index of the last op of the group that reads its value
/// (itself if none does).
fn last_uses(group: &Group) -> Vec<usize> {
    let mut last: Vec<usize> = (0..group.ops.len()).collect();
    for (j, op) in group.ops.iter().enumerate() {
        for a in &op.args {
            if let Arg::Value(k) = a {
                last[*k] = j;
            }
        }
    }
    last
}

/// What one kernel of a group binds, in binding order: the group's leaves it
/// reads, the values of earlier kernels it reads, then the values it writes
/// (kept ones, and those a later kernel reads).
struct Plan {
    leaves: Vec<usize>,
    imports: Vec<usize>,
    outputs: Vec<usize>,
}

impl Plan {
    fn of(group: &Group, kept: &[bool], last_use: &[usize], range: std::ops::Range<usize>) -> Plan {
        let mut plan = Plan {
            leaves: Vec::new(),
            imports: Vec::new(),
            outputs: Vec::new(),
        };
        for op in &group.ops[range.clone()] {
            for a in &op.args {
                match a {
                    Arg::Leaf(l) | Arg::Strided(l, _) => {
                        if !plan.leaves.contains(l) {
                            plan.leaves.push(*l);
                        }
                    }
                    Arg::Value(k) if *k < range.start => {
                        if !plan.imports.contains(k) {
                            plan.imports.push(*k);
                        }
                    }
                    Arg::Value(_) | Arg::Scalar(_) => {}
                }
            }
        }
        let stop = range.end;
        plan.outputs = range.filter(|&j| kept[j] || last_use[j] >= stop).collect();
        plan
    }

    /// Storage buffers bound, the info buffer included; `packed`: the
    /// outputs share one binding (see [`packs`]).
    fn bindings(&self, packed: bool) -> usize {
        let outputs = if packed {
            self.outputs.len().min(1)
        } else {
            self.outputs.len()
        };
        self.leaves.len() + self.imports.len() + outputs + 1
    }
}

/// Invocations per workgroup of a kernel over `n` elements: 256, or for
/// fewer elements the smallest power of two from 32 that covers them.
fn workgroup(n: usize) -> usize {
    n.next_power_of_two().clamp(32, 256)
}

/// Whether a kernel of the group writes its outputs into one slab, bound
/// once (`Gpu::pack`): values this small, when it writes several.
fn packs(group: &Group, outputs: usize) -> bool {
    let n: usize = group.dims.iter().product();
    outputs > 1 && (n.max(1) * 4) as u64 <= crate::device::gpu::PACK_MAX_BYTES
}

/// Where the kernel that starts at op `start` ends: the longest run of ops up
/// to `end` whose kernel binds at most `max` storage buffers (at least one op:
/// an op binds at most two leaves, one output and the info buffer, and every
/// adapter binds four).
fn segment_end(
    group: &Group,
    kept: &[bool],
    last_use: &[usize],
    start: usize,
    end: usize,
    max: usize,
) -> usize {
    let fits = |plan: Plan| plan.bindings(packs(group, plan.outputs.len())) <= max;
    // Most groups fit whole: one plan instead of one per op.
    if fits(Plan::of(group, kept, last_use, start..end)) {
        return end;
    }
    let mut stop = start + 1;
    while stop < end && fits(Plan::of(group, kept, last_use, start..stop + 1)) {
        stop += 1;
    }
    stop
}

/// Encodes the ops `range` of a group as one kernel.
fn encode_segment(
    gpu: &Gpu,
    group: &Group,
    kept: &[bool],
    last_use: &[usize],
    range: std::ops::Range<usize>,
    n: usize,
    sources: &mut HashMap<Vec<u32>, std::sync::Arc<str>>,
) -> Result<(), String> {
    let plan = Plan::of(group, kept, last_use, range.clone());
    let packed = packs(group, plan.outputs.len());
    let out_guards: Vec<_> = plan
        .outputs
        .iter()
        .map(|&j| group.ops[j].out.read())
        .collect();
    let stride = if packed {
        let values = out_guards
            .iter()
            .map(|g| g.gpu())
            .collect::<Result<Vec<_>, String>>()?;
        Some(gpu.pack(&values)?)
    } else {
        None
    };
    let (key, info) = structure(group, &plan, range.clone(), stride);
    let source = match sources.get(&key) {
        Some(source) => source.clone(),
        None => {
            let (source, generated_info) = generate(group, &plan, range, stride);
            // Both lay out the same info buffer; checked on every miss.
            if info != generated_info {
                return Err(format!(
                    "internal error: the fused kernel's info buffer was laid out two ways ({info:?} vs {generated_info:?})"
                ));
            }
            let source: std::sync::Arc<str> = source.into();
            sources.insert(key, source.clone());
            source
        }
    };
    let leaf_guards: Vec<_> = plan
        .leaves
        .iter()
        .map(|&l| group.leaves[l].read())
        .collect();
    let import_guards: Vec<_> = plan
        .imports
        .iter()
        .map(|&k| group.ops[k].out.read())
        .collect();
    let mut bindings: Vec<(&GpuBuffer, Access)> = Vec::with_capacity(plan.bindings(false));
    for g in leaf_guards.iter().chain(&import_guards) {
        bindings.push((g.gpu()?, Access::Read));
    }
    let mut slab: Vec<&GpuBuffer> = Vec::new();
    for g in &out_guards {
        if packed {
            slab.push(g.gpu()?);
        } else {
            bindings.push((g.gpu()?, Access::Write));
        }
    }
    // Under the hook's lock: `dispatch` would encode the group again.
    gpu.dispatch_packed(
        KernelSource::WHOLE,
        &source,
        &bindings,
        &slab,
        &info,
        Grid::Workgroups(n.div_ceil(workgroup(n))),
    )
}

/// What the kernel of the ops `range` of a group depends on, as numbers: the
/// rank, the bindings, and each op with where its operands come from (not the
/// scalars, strides or sizes, which are in the info buffer); and that info
/// buffer, as [`generate`] lays it out. Two segments with the same key have
/// the same source.
fn structure(
    group: &Group,
    plan: &Plan,
    range: std::ops::Range<usize>,
    stride: Option<u32>,
) -> (Vec<u32>, Vec<u32>) {
    let rank = group.dims.len();
    let n: usize = group.dims.iter().product();
    let mut info: Vec<u32> = vec![n as u32, rank as u32];
    info.extend(group.dims.iter().map(|&d| d as u32));
    let ops = &group.ops[range.clone()];
    let mut key: Vec<u32> = Vec::with_capacity(8 + ops.len() * 5 + plan.outputs.len());
    let strided = ops
        .iter()
        .any(|op| op.args.iter().any(|a| matches!(a, Arg::Strided(..))));
    key.extend([
        rank as u32,
        plan.leaves.len() as u32,
        plan.imports.len() as u32,
        plan.outputs.len() as u32,
        u32::from(strided),
        u32::from(stride.is_some()),
        workgroup(n) as u32,
    ]);
    let leaf = |l: &usize| plan.leaves.iter().position(|x| x == l).expect("planned") as u32;
    for op in ops {
        key.push(match op.op {
            ElemOp::Binary(b) => 0x1000 + b as u32,
            ElemOp::Unary(u) => 0x2000 + u as u32,
        });
        for arg in &op.args {
            match arg {
                Arg::Leaf(l) => key.extend([1, leaf(l)]),
                Arg::Value(k) if *k < range.start => {
                    let import = plan.imports.iter().position(|x| x == k).expect("planned");
                    key.extend([2, import as u32]);
                }
                Arg::Value(k) => key.extend([3, (k - range.start) as u32]),
                Arg::Scalar(s) => {
                    key.push(4);
                    info.push(s.to_bits());
                }
                Arg::Strided(l, strides) => {
                    key.extend([5, leaf(l)]);
                    info.extend_from_slice(strides);
                }
            }
        }
    }
    key.extend(plan.outputs.iter().map(|j| (j - range.start) as u32));
    info.extend(stride);
    (key, info)
}

/// The kernel source of the ops `range` of a group bound as `plan` says, and
/// its info buffer: `[n, rank, dims, strides..., scalars..., stride]`. Names
/// are local to the kernel (bindings `b0..`, values `t0..` in op order), so
/// groups of the same structure share one compiled kernel wherever they sit.
/// With a `stride` the outputs are ranges of one slab binding, `stride`
/// floats apart (its value is in the info buffer, not the source).
fn generate(
    group: &Group,
    plan: &Plan,
    range: std::ops::Range<usize>,
    stride: Option<u32>,
) -> (String, Vec<u32>) {
    let rank = group.dims.len();
    let n: usize = group.dims.iter().product();
    let mut info: Vec<u32> = vec![n as u32, rank as u32];
    info.extend(group.dims.iter().map(|&d| d as u32));
    let mut src = String::new();
    let inputs = plan.leaves.len() + plan.imports.len();
    for b in 0..inputs {
        let _ = writeln!(
            src,
            "@group(0) @binding({b}) var<storage, read> b{b}: array<f32>;"
        );
    }
    let out_bindings = if stride.is_some() {
        1
    } else {
        plan.outputs.len()
    };
    for b in inputs..inputs + out_bindings {
        let _ = writeln!(
            src,
            "@group(0) @binding({b}) var<storage, read_write> b{b}: array<f32>;"
        );
    }
    let _ = writeln!(
        src,
        "@group(0) @binding({}) var<storage, read> info: array<u32>;",
        inputs + out_bindings
    );
    let wg = workgroup(n);
    let _ = write!(
        src,
        "\n@compute @workgroup_size({wg})\n\
         fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {{\n    \
         let i = gid.x + gid.y * groups.x * {wg}u;\n    \
         if (i >= info[0]) {{\n        return;\n    }}\n",
    );
    let ops = &group.ops[range.clone()];
    let strided = ops
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
    let leaf = |l: &usize| plan.leaves.iter().position(|x| x == l).expect("planned");
    let operand = |arg: &Arg, info: &mut Vec<u32>| -> String {
        match arg {
            Arg::Leaf(l) => format!("b{}[i]", leaf(l)),
            Arg::Value(k) if *k < range.start => {
                let b =
                    plan.leaves.len() + plan.imports.iter().position(|x| x == k).expect("planned");
                format!("b{b}[i]")
            }
            Arg::Value(k) => format!("t{}", k - range.start),
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
                    "b{}[{}]",
                    leaf(l),
                    if terms.is_empty() {
                        "0u".to_string()
                    } else {
                        terms.join(" + ")
                    }
                )
            }
        }
    };
    for (j, op) in ops.iter().enumerate() {
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
    match stride {
        Some(stride) => {
            info.push(stride);
            let at = info.len() - 1;
            for (o, j) in plan.outputs.iter().enumerate() {
                let _ = writeln!(
                    src,
                    "    b{inputs}[{o}u * info[{at}u] + i] = t{};",
                    j - range.start
                );
            }
        }
        None => {
            for (o, j) in plan.outputs.iter().enumerate() {
                let _ = writeln!(src, "    b{}[i] = t{};", inputs + o, j - range.start);
            }
        }
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
