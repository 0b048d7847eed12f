//! Record-time batches of elementwise GPU ops: in Lazy and Async mode, an
//! elementwise op on a GPU is not recorded as a node of its own. It joins its
//! device's open batch (its output Tensor and Var exist at once, and its
//! write is counted in the Var's version), and the batch is recorded as one
//! node that pushes all its ops into the device's fusion group (`fusion.rs`)
//! when it closes:
//!
//! - when it holds [`MAX_OPS`] ops;
//! - when an op reads a value the batch does not already depend on (a value
//!   it neither computes nor reads): a reader of one value of a batch waits
//!   for all the batch reads, so a batch never takes on new inputs;
//! - when anything else records an access to a Var the batch names, or waits
//!   for one (`TaskBuilder::declare` and the blockers check the Var's `held`
//!   count, see `graph/mod.rs`);
//! - at every barrier (`wait_all`, the end of the engine, DOT export).
//!
//! So a chain of elementwise ops costs one engine node per 256 ops instead
//! of one per op, and the ops that fuse into a kernel are fixed when they are
//! recorded, not by which worker ran what first: Async mode forms the same
//! groups as Lazy mode.
//!
//! A batch holds its lock while it records its node, and lowers the `held`
//! counts of its Vars only afterwards, so whoever sees a Var held and closes
//! the batches waits until the node is in the graph.

use super::fusion::{record_order, BatchOp, ElemOp, Fuser, Input};
use super::Data;
use crate::device::gpu::Gpu;
use crate::device::Device;
use crate::engine::{Batches, Engine};
use crate::error::{Location, RunningOp};
use crate::var::{Read, Var, Write};
use std::sync::{Arc, Mutex, MutexGuard};

/// Ops per batch at most (a fusion group's size, see `fusion.rs`).
const MAX_OPS: usize = 256;

/// An operand of an op as it joins a batch.
pub(crate) enum Arg<'a> {
    /// A tensor's Var, and its shape.
    Tensor(&'a Var<Data>, Vec<usize>),
    /// A constant.
    Scalar(f32),
}

/// An operand of a batched op.
pub(crate) enum Operand {
    /// A tensor's data, and its shape.
    Tensor(Read<Data>, Vec<usize>),
    /// A constant.
    Scalar(f32),
}

struct Op {
    name: &'static str,
    location: Location,
    dims: Vec<usize>,
    op: ElemOp,
    inputs: Vec<Operand>,
    out: Write<Data>,
    /// The output's place in [`Open::vars`].
    out_var: usize,
    seq: u64,
}

/// The open batch of one device.
#[derive(Default)]
struct Open {
    ops: Vec<Op>,
    /// The Vars the ops name, each once: (Var, read, written).
    vars: Vec<(Var<Data>, bool, bool)>,
}

/// One GPU device's record-time batch.
pub(crate) struct DeviceBatch {
    /// Weak: the device holds its batch (its `frontend` slot).
    gpu: std::sync::Weak<Gpu>,
    device: Device,
    open: Mutex<Open>,
}

fn lock(m: &Mutex<Open>) -> MutexGuard<'_, Open> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl DeviceBatch {
    /// The batch of `gpu` (device `device` of `engine`), made on first use.
    pub(crate) fn of(engine: &Engine, gpu: &Arc<Gpu>, device: Device) -> Arc<DeviceBatch> {
        let slot = gpu.frontend.get_or_init(|| {
            let b = Arc::new(DeviceBatch {
                gpu: Arc::downgrade(gpu),
                device,
                open: Mutex::new(Open::default()),
            });
            engine.shared().add_batches(b.clone());
            b
        });
        match slot.clone().downcast::<DeviceBatch>() {
            Ok(b) => b,
            // Only this module fills the slot.
            Err(_) => unreachable!("the frontend slot holds a DeviceBatch"),
        }
    }

    /// Adds `out = op(inputs)` (shape `dims`) to the batch, recording the
    /// batch first when it is full.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn push(
        &self,
        engine: &Engine,
        name: &'static str,
        location: Location,
        dims: Vec<usize>,
        op: ElemOp,
        inputs: Vec<Arg<'_>>,
        out: &Var<Data>,
    ) {
        let mut open = lock(&self.open);
        // An op joins only if the batch already depends on all it reads:
        // otherwise a reader of any value in the batch would also wait for
        // the new input's producer (unrelated work, say a matmul still
        // running). Then the batch is recorded and the op starts the next.
        let known = inputs.iter().all(|arg| match arg {
            Arg::Tensor(var, _) => open.vars.iter().any(|(v, _, _)| v.same(var)),
            Arg::Scalar(_) => true,
        });
        if open.ops.len() >= MAX_OPS || !known {
            self.record(engine, &mut open);
        }
        let operands = inputs
            .into_iter()
            .map(|arg| match arg {
                Arg::Tensor(var, shape) => {
                    note(&mut open.vars, var, true, false);
                    Operand::Tensor(var.read_token(), shape)
                }
                Arg::Scalar(s) => Operand::Scalar(s),
            })
            .collect();
        let out_var = note(&mut open.vars, out, false, true);
        open.ops.push(Op {
            name,
            location,
            dims,
            op,
            inputs: operands,
            out: out.write_token(),
            out_var,
            seq: record_order(),
        });
    }

    /// Records the open batch as one node (nothing if it is empty), then
    /// lets go of its Vars.
    fn record(&self, engine: &Engine, open: &mut Open) {
        if open.ops.is_empty() {
            return;
        }
        let ops = std::mem::take(&mut open.ops);
        let vars = std::mem::take(&mut open.vars);
        // Which values the kernel writes is decided here, at a fixed point
        // of the program: those the program still holds a handle of (besides
        // this batch's). Nothing else can ever read the others. Decided when
        // the node runs instead, it would depend on how far the program had
        // got by then in Async mode, and so would the kernel.
        let keep: Vec<bool> = ops
            .iter()
            .map(|op| vars[op.out_var].0.handles() > 1)
            .collect();
        let Some(gpu) = self.gpu.upgrade() else {
            // The engine's devices are gone with it: nothing can read these.
            for (var, _, _) in &vars {
                var.queue().release();
            }
            return;
        };
        let mut t = engine.task_at(ops[0].name, ops[0].location);
        t.device(self.device);
        for (var, read, write) in &vars {
            t.declare_unchecked(var, *read, *write);
        }
        let pending = gpu.expect_node();
        // The node's failure (a lost device, say) poisons every Var it
        // writes; a failure inside names the op that met it.
        let _ = t.push_fallible(move || {
            let key = crate::error::running_ops().last().map_or(0, |o| o.key);
            let mut batch = Vec::with_capacity(ops.len());
            for (op, keep) in ops.into_iter().zip(keep) {
                let n: usize = op.dims.iter().product();
                *op.out.write() = Data::Gpu(gpu.alloc_lazy(n)?);
                batch.push(BatchOp {
                    dims: op.dims,
                    op: op.op,
                    inputs: op
                        .inputs
                        .into_iter()
                        .map(|i| match i {
                            Operand::Tensor(token, shape) => Input::Tensor(token, shape),
                            Operand::Scalar(s) => Input::Scalar(s),
                        })
                        .collect(),
                    out: op.out,
                    keep,
                    seq: op.seq,
                    running: RunningOp {
                        key,
                        name: op.name,
                        location: op.location,
                    },
                });
            }
            Fuser::fuse_batch(&gpu, batch)?;
            drop(pending);
            Ok(())
        });
        for (var, _, _) in &vars {
            var.queue().release();
        }
    }
}

/// Adds `var` to the batch's Vars (holding it) or merges the access;
/// returns its place.
fn note(
    vars: &mut Vec<(Var<Data>, bool, bool)>,
    var: &Var<Data>,
    read: bool,
    write: bool,
) -> usize {
    match vars.iter_mut().position(|(v, _, _)| v.same(var)) {
        Some(i) => {
            vars[i].1 |= read;
            vars[i].2 |= write;
            i
        }
        None => {
            var.queue().hold();
            vars.push((var.clone(), read, write));
            vars.len() - 1
        }
    }
}

impl Batches for DeviceBatch {
    fn close(&self, engine: &Engine) {
        let mut open = lock(&self.open);
        self.record(engine, &mut open);
    }
}
