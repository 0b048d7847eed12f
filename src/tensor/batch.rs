//! Record-time batches of elementwise ops: in Lazy and Async mode, an
//! elementwise op on a GPU, or on the CPU up to [`super::CPU_BATCH_MAX`]
//! elements, is not recorded as a node of its own. It joins its device's
//! open batch (its output Tensor and Var exist at once, and its write is
//! counted in the Var's version), and the batch is recorded as one node when
//! it closes:
//!
//! - when it holds [`MAX_OPS`] ops;
//! - at the same points for every open batch of the device: an op joins the
//!   batch that computes one of its inputs, else one that already reads all
//!   its inputs, else starts one, so a batch holds connected ops only (a
//!   reader of one value of a batch waits for everything the batch reads,
//!   and unrelated chains stay apart); past [`MAX_OPEN`] open batches the
//!   oldest is recorded;
//! - when anything else records an access to a Var the batch names, or waits
//!   for one (`TaskBuilder::declare` and the blockers check the Var's `held`
//!   count, see `graph/mod.rs`);
//! - at every barrier (`wait_all`, the end of the engine, DOT export).
//!
//! Which values the node writes is decided when the batch is recorded: those
//! the program still holds. On a GPU the node pushes the ops into the
//! device's fusion group (`fusion.rs`); on the CPU it runs them in record
//! order with the CPU kernels ([`run_on_cpu`]), computing only the ops whose
//! value is written or read by another op it computes.
//!
//! So a chain of elementwise ops costs one engine node per 256 ops instead
//! of one per op, and the ops that fuse into a kernel are fixed when they are
//! recorded, not by which worker ran what first: Async mode forms the same
//! groups as Lazy mode. The node counts once per op in the engine's live
//! count (`TaskBuilder::weight`), so backpressure bounds ops, not nodes.
//!
//! A batch holds its lock while it records its node, and lowers the `held`
//! counts of its Vars only afterwards, so whoever sees a Var held and closes
//! the batches waits until the node is in the graph.

use super::fusion::{record_order, BatchOp, Dims, ElemOp, Fuser, Input, MAX_OPS};
use super::{Data, Tensor};
use crate::device::gpu::Gpu;
use crate::device::Device;
use crate::engine::{Access, Accesses, Batches, Engine};
use crate::error::{Location, RunningOp};
use crate::var::{Read, Spare, Spares, Var, Write};
use smallvec::SmallVec;
use std::sync::{Arc, Mutex, MutexGuard};

/// The most batches a device keeps open at once: an op looks at each of
/// them, and unrelated ops each start one.
const MAX_OPEN: usize = 16;

/// An operand of an elementwise op as it is recorded (into a batch, or as a
/// node of its own in Sync mode).
pub(crate) enum Arg<'a> {
    Tensor(&'a Tensor),
    Scalar(f32),
}

/// An operand of a batched op.
#[derive(Clone, Copy)]
enum Operand {
    /// A tensor: its shape's place in [`Open::shapes`] and its Var's place
    /// in [`Open::vars`]. No token of its own: the batch's node reads
    /// through one token per Var (see [`DeviceBatch::record_ops`]).
    Tensor(u32, u32),
    /// A constant.
    Scalar(f32),
}

/// One op of a batch. Small and flat (shapes are places in the batch's
/// list, operands a fixed pair): an op is moved into its batch and out of
/// it again, and a batch's ops are made on one thread and dropped on
/// another, so each byte and each nested collection costs on both.
struct Op {
    name: &'static str,
    location: Location,
    op: ElemOp,
    /// How many of `inputs` the op has (1 or 2).
    arity: u8,
    /// The output's shape's place in [`Open::shapes`].
    dims: u32,
    inputs: [Operand; 2],
    out: Write<Data>,
    /// The output's place in [`Open::vars`].
    out_var: u32,
    seq: u64,
}

impl Op {
    fn inputs(&self) -> &[Operand] {
        &self.inputs[..usize::from(self.arity)]
    }

    /// Lets go of the op's output token, keeping the storage of its Var in
    /// `dead` if it dies with it.
    fn let_go(self, dead: &mut Vec<Spare<Data>>) {
        dead.extend(self.out.into_spare());
    }
}

/// Whether two shapes are equal, element by element: a slice's `==` calls
/// `memcmp`, which costs more than these few words.
#[inline]
fn same_dims(a: &[usize], b: &[usize]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y)
}

/// One open batch: connected ops (each reads a value an earlier one in the
/// batch computes, or starts it).
#[derive(Default)]
struct Open {
    ops: Vec<Op>,
    /// The Vars the ops name, each once: (Var, read, written).
    vars: Vec<(Var<Data>, bool, bool)>,
    /// Each Var's place in `vars`, by its queue's key: an op looks its
    /// inputs up on the recording thread, so no scan of the batch.
    places: rustc_hash::FxHashMap<usize, usize>,
    /// The shapes the ops name (a shape may appear more than once). Vecs,
    /// not inline `Dims`: a batch has a few, and each op compares with them.
    shapes: Vec<Vec<usize>>,
}

impl Open {
    /// `var`'s place in [`Open::vars`], if the batch names it.
    fn place(&self, var: &Var<Data>) -> Option<usize> {
        self.places.get(&var.queue().key()).copied()
    }

    /// Adds `var` to the Vars (holding it) or merges the access; returns its
    /// place.
    fn note(&mut self, var: &Var<Data>, read: bool, write: bool) -> usize {
        match self.place(var) {
            Some(i) => {
                self.vars[i].1 |= read;
                self.vars[i].2 |= write;
                i
            }
            None => self.note_new(var, read, write),
        }
    }

    /// [`Open::note`] for a Var the batch does not name yet.
    fn note_new(&mut self, var: &Var<Data>, read: bool, write: bool) -> usize {
        var.queue().hold();
        self.add(var.clone(), read, write)
    }

    /// Adds the output of an op, a Var made for it that no other thread
    /// can reach yet, and returns its place and its write token.
    fn note_output(&mut self, out: &mut Var<Data>) -> (usize, Write<Data>) {
        out.queue().hold_new();
        let (var, write) = out.new_output_handles();
        (self.add(var, false, true), write)
    }

    fn add(&mut self, var: Var<Data>, read: bool, write: bool) -> usize {
        if self.places.is_empty() {
            // A batch names about one Var per op: grown once.
            self.places.reserve(MAX_OPS + 1);
            self.vars.reserve(MAX_OPS + 1);
            self.ops.reserve(MAX_OPS);
        }
        self.places.insert(var.queue().key(), self.vars.len());
        self.vars.push((var, read, write));
        self.vars.len() - 1
    }

    /// The place of `dims` in [`Open::shapes`], added unless one of the
    /// last few is the same (most ops have the shape of the one before).
    fn shape(&mut self, dims: &[usize]) -> u32 {
        let recent = self.shapes.len().saturating_sub(4);
        let found = self.shapes[recent..]
            .iter()
            .rposition(|s| same_dims(s, dims));
        let at = match found {
            Some(i) => recent + i,
            None => {
                self.shapes.push(dims.to_vec());
                self.shapes.len() - 1
            }
        };
        at as u32
    }

    /// Moves `other`'s ops and Vars into this batch, in record order.
    fn absorb(&mut self, other: Open) {
        let mut place = Vec::with_capacity(other.vars.len());
        for (var, read, write) in other.vars {
            place.push(self.note(&var, read, write) as u32);
            // Held once per batch that names it.
            var.queue().release();
        }
        let shift = self.shapes.len() as u32;
        self.shapes.extend(other.shapes);
        for mut op in other.ops {
            op.out_var = place[op.out_var as usize];
            op.dims += shift;
            for input in &mut op.inputs {
                if let Operand::Tensor(shape, p) = input {
                    *shape += shift;
                    *p = place[*p as usize];
                }
            }
            self.ops.push(op);
        }
        self.ops.sort_by_key(|op| op.seq);
    }
}

/// Where a device's batches run.
enum Backend {
    /// Weak: the device holds its batches (its `frontend` slot).
    Gpu(std::sync::Weak<Gpu>),
    /// The CPU: a batch's node runs its ops one after the other with the
    /// CPU kernels, and writes only the values kept.
    Cpu,
}

/// One device's record-time batches.
pub(crate) struct DeviceBatch {
    backend: Backend,
    device: Device,
    open: Mutex<State>,
    /// The storages of the CPU batches' dead values, given back by the
    /// workers, for the outputs of the next ops (see [`Spares`]).
    spares: Arc<Spares<Data>>,
}

/// What a device's batches keep under their lock.
#[derive(Default)]
struct State {
    batches: Vec<Open>,
    /// The CPU's record order of ops (a batch's ops are sorted by it when
    /// batches merge): counted here, under the lock. A GPU's comes from
    /// [`record_order`], shared with the fuser's other ops.
    seq: u64,
    /// Spares moved out of [`DeviceBatch::spares`] in one go, drawn from
    /// one per op: the recording thread takes the workers' lock once per
    /// few hundred outputs instead of once per output.
    spares: Vec<Spare<Data>>,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl DeviceBatch {
    /// The batches of `gpu` (device `device` of `engine`), made on first
    /// use; `None` if the device's slot holds something else (then ops are
    /// recorded one node each).
    pub(crate) fn of<'g>(
        engine: &Engine,
        gpu: &'g Arc<Gpu>,
        device: Device,
    ) -> Option<&'g DeviceBatch> {
        let backend = || Backend::Gpu(Arc::downgrade(gpu));
        DeviceBatch::in_slot(&gpu.frontend, engine, backend, device)
    }

    /// The batches of `engine`'s CPU device, made on first use.
    pub(crate) fn cpu(engine: &Engine) -> Option<&DeviceBatch> {
        let slot = &engine.shared().cpu_frontend;
        DeviceBatch::in_slot(slot, engine, || Backend::Cpu, Device::Cpu)
    }

    /// The batches a device keeps in `slot`, made (and registered with the
    /// engine's barriers) on first use.
    fn in_slot<'s>(
        slot: &'s std::sync::OnceLock<Arc<dyn std::any::Any + Send + Sync>>,
        engine: &Engine,
        backend: impl FnOnce() -> Backend,
        device: Device,
    ) -> Option<&'s DeviceBatch> {
        let slot = slot.get_or_init(|| {
            let b = Arc::new(DeviceBatch {
                backend: backend(),
                device,
                open: Mutex::default(),
                spares: Arc::default(),
            });
            engine.shared().add_batches(b.clone());
            b
        });
        slot.downcast_ref::<DeviceBatch>()
    }

    /// Adds `out = op(inputs)` (shape `dims`; one or two inputs) to the
    /// batch, recording the batch first when it is full, and returns the
    /// output's Var: new, or made in the storage of a dead one.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn push(
        &self,
        engine: &Engine,
        name: &'static str,
        location: Location,
        dims: &[usize],
        op: ElemOp,
        inputs: &[Arg<'_>],
    ) -> crate::error::Result<Var<Data>> {
        debug_assert!(matches!(inputs.len(), 1 | 2), "{name}: an elementwise op");
        // A Var of another engine: the error a task naming it gets.
        let foreign = inputs.iter().any(|arg| match arg {
            Arg::Tensor(t) => !t.var.engine().same(engine),
            Arg::Scalar(_) => false,
        });
        if foreign {
            return Err(crate::error::Error::EngineMismatch { op: name, location });
        }
        // A batch is recorded under the lock, where it must not stall (a
        // task recording ops of its own would wait for the lock, and the
        // stall for the task): the frontend waits here instead, until a full
        // batch fits under the bound.
        engine.shared().throttle(MAX_OPS);
        let mut state = lock(&self.open);
        let State {
            batches,
            spares,
            seq,
        } = &mut *state;
        if spares.is_empty() {
            self.spares.take_into(spares);
        }
        // A CPU output's storage comes back to the spares when the frontend
        // lets go of the last handle after its op ran (the workers give back
        // those whose last token they hold).
        let keep = matches!(self.backend, Backend::Cpu).then_some(&self.spares);
        let mut out = Spare::var(spares, engine, keep);
        // The op joins the batch that computes one of its inputs (merging
        // them when several do), or starts a batch of its own: a batch holds
        // connected ops only, and a reader of one of its values waits for
        // everything it reads, so unrelated chains (one waiting for a matmul
        // not yet run, say) stay apart. Decided from what was recorded, so
        // the batches, and the kernels made of them, are the same whatever
        // ran when.
        let mut hits: SmallVec<[usize; 2]> = SmallVec::new();
        // The first batch that names every tensor input, with their places
        // there: an op that reads only values computed elsewhere joins a
        // batch that reads them all already (it adds nothing that batch waits
        // for). Each input is looked up once per batch, and the places found
        // are reused below when the op joins that batch unchanged.
        let mut covering: Option<(usize, [Option<usize>; 2])> = None;
        for (b, open) in batches.iter().enumerate() {
            let (mut computes, mut covers) = (false, true);
            let mut places = [None; 2];
            for (i, arg) in inputs.iter().enumerate() {
                if let Arg::Tensor(t) = arg {
                    let place = open.place(&t.var);
                    match place {
                        Some(p) => computes |= open.vars[p].2,
                        None => covers = false,
                    }
                    if let Some(slot) = places.get_mut(i) {
                        *slot = place;
                    }
                }
            }
            if computes {
                hits.push(b);
            } else if covers && covering.is_none() {
                covering = Some((b, places));
            }
        }
        let mut known = None;
        let mut at = match hits.first() {
            None => match covering {
                Some((b, places)) => {
                    known = Some(places);
                    b
                }
                None => {
                    if batches.len() >= MAX_OPEN {
                        // Many unrelated ops: the oldest batch is recorded
                        // (each op looks at every open batch).
                        let oldest = batches.remove(0);
                        self.record(engine, oldest);
                    }
                    batches.push(Open::default());
                    batches.len() - 1
                }
            },
            Some(&first) => {
                while hits.len() > 1 {
                    if let Some(other) = hits.pop() {
                        let other = batches.remove(other);
                        batches[first].absorb(other);
                    }
                }
                first
            }
        };
        if batches[at].ops.len() >= MAX_OPS {
            let full = batches.remove(at);
            self.record(engine, full);
            batches.push(Open::default());
            at = batches.len() - 1;
            known = None;
        }
        let open = &mut batches[at];
        // Most inputs have the output's shape: its place is looked up once.
        let out_shape = open.shape(dims);
        let mut operands = [Operand::Scalar(0.0), Operand::Scalar(0.0)];
        for ((i, arg), slot) in inputs.iter().enumerate().zip(&mut operands) {
            *slot = match arg {
                Arg::Tensor(t) => {
                    let place =
                        match known.and_then(|k: [Option<usize>; 2]| k.get(i).copied().flatten()) {
                            Some(place) => {
                                open.vars[place].1 = true;
                                place
                            }
                            None => open.note(&t.var, true, false),
                        };
                    let shape = if same_dims(dims, t.dims()) {
                        out_shape
                    } else {
                        open.shape(t.dims())
                    };
                    Operand::Tensor(shape, place as u32)
                }
                Arg::Scalar(s) => Operand::Scalar(*s),
            };
        }
        // New: not in the batch, no lookup.
        let (out_var, write) = open.note_output(&mut out);
        let seq = match self.backend {
            Backend::Cpu => {
                *seq += 1;
                *seq
            }
            Backend::Gpu(_) => record_order(),
        };
        open.ops.push(Op {
            name,
            location,
            op,
            arity: inputs.len().min(2) as u8,
            dims: out_shape,
            inputs: operands,
            out: write,
            out_var: out_var as u32,
            seq,
        });
        Ok(out)
    }

    /// Records a batch as one node (nothing if it is empty), then lets go
    /// of its Vars. Never stalls at the backpressure bound (see
    /// [`DeviceBatch::push`]).
    fn record(&self, engine: &Engine, open: Open) {
        crate::engine::without_stalls(|| self.record_node(engine, open));
    }

    fn record_node(&self, engine: &Engine, open: Open) {
        let Open {
            ops, vars, shapes, ..
        } = open;
        if !ops.is_empty() {
            self.record_ops(engine, ops, &vars, shapes);
        }
        for (var, _, _) in &vars {
            var.queue().release();
        }
    }

    /// Records `ops`, which name `vars`, as one node.
    fn record_ops(
        &self,
        engine: &Engine,
        ops: Vec<Op>,
        vars: &[(Var<Data>, bool, bool)],
        shapes: Vec<Vec<usize>>,
    ) {
        let gpu = match &self.backend {
            Backend::Cpu => None,
            Backend::Gpu(gpu) => match gpu.upgrade() {
                Some(gpu) => Some(gpu),
                // The engine's devices are gone with it: nothing can read
                // these.
                None => return,
            },
        };
        engine
            .counters()
            .batches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // Which values the kernel writes is decided here, at a fixed point
        // of the program: those the program still holds a handle of (besides
        // this batch's). Nothing else can ever read the others. Decided when
        // the node runs instead, it would depend on how far the program had
        // got by then in Async mode, and so would the kernel.
        // Read once per Var: a count seen at 1 stays 1 (no handle is left to
        // clone), so the node's accesses and the values written agree.
        let held: Vec<bool> = vars.iter().map(|(var, _, _)| var.handles() > 1).collect();
        let keep: Vec<bool> = ops.iter().map(|op| held[op.out_var as usize]).collect();
        // One read token per Var the ops read, not one per operand: a value
        // many ops of the batch read (a weight, a constant tensor) has its
        // count raised once here, and lowered once by the worker, instead of
        // twice per op on a line both threads write.
        let reads: Vec<Option<Read<Data>>> = vars
            .iter()
            .map(|(var, read, _)| read.then(|| var.read_token()))
            .collect();
        let mut t = engine.task_at(ops[0].name, ops[0].location);
        t.device(self.device).weight(ops.len() as u32);
        // Distinct: `Open::note` names each Var once. A Var the batch writes
        // and nothing holds any more is left out of the node: it is the
        // output of one of its ops, made new for it (`push`), so no
        // earlier node named it, and no later one can. In a loop that keeps
        // only its last value, the node names 2 Vars instead of 257.
        // The accesses are given to the graph as they are: `vars` holds the
        // Vars until the node is recorded.
        let mut accesses = Accesses::with_capacity(vars.len());
        for ((var, read, write), held) in vars.iter().zip(held) {
            if !*write || held {
                accesses.push(Access {
                    var: var.queue(),
                    read: *read,
                    write: *write,
                });
            }
        }
        let Some(gpu) = gpu else {
            let counters = engine.counters().clone();
            let spares = self.spares.clone();
            let _ = t.push_accesses(&mut accesses, move || {
                run_on_cpu(ops, &shapes, keep, reads, &counters, &spares)
            });
            return;
        };
        let pending = gpu.expect_node();
        // The node's failure (a lost device, say) poisons every Var it
        // writes; a failure inside names the op that met it.
        let _ = t.push_accesses(&mut accesses, move || {
            let key = crate::error::running_ops().last().map_or(0, |o| o.key);
            let mut batch = Vec::with_capacity(ops.len());
            for (op, keep) in ops.into_iter().zip(keep) {
                let dims = Dims::from_slice(&shapes[op.dims as usize]);
                let n: usize = dims.iter().product();
                *op.out.write() = Data::Gpu(gpu.alloc_lazy(n)?);
                let mut inputs = SmallVec::new();
                for input in op.inputs() {
                    inputs.push(match *input {
                        Operand::Tensor(shape, place) => Input::Tensor(
                            reads_token(&reads, place, &op)?.duplicate(),
                            Dims::from_slice(&shapes[shape as usize]),
                        ),
                        Operand::Scalar(s) => Input::Scalar(s),
                    });
                }
                batch.push(BatchOp {
                    dims,
                    op: op.op,
                    inputs,
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
    }
}

/// The read token of place `place` of a batch, which `op` reads.
fn reads_token<'r>(
    reads: &'r [Option<Read<Data>>],
    place: u32,
    op: &Op,
) -> Result<&'r Read<Data>, String> {
    reads
        .get(place as usize)
        .and_then(Option::as_ref)
        .ok_or_else(|| {
            format!(
                "internal error: {} at {} reads a value its batch did not note as read",
                op.name, op.location
            )
        })
}

/// Runs a CPU batch's ops in record order. A value that is kept goes to its
/// Var (where the later ops of the batch read it too); the others live in
/// this function until their last reader ran, and are never written.
fn run_on_cpu(
    ops: Vec<Op>,
    shapes: &[Vec<usize>],
    keep: Vec<bool>,
    reads: Vec<Option<Read<Data>>>,
    counters: &crate::engine::Counters,
    spares: &Spares<Data>,
) -> Result<(), String> {
    use super::kernels;
    let places = reads.len();
    // Which ops must run: those whose value is kept, and those a needed op
    // reads (backwards, so that a value read only by unneeded ops is not
    // needed either). Then the last needed op that reads each place.
    let mut needed = keep.clone();
    let mut read_by_needed = vec![false; places];
    let mut last_read = vec![0usize; places];
    for (j, op) in ops.iter().enumerate().rev() {
        needed[j] |= read_by_needed[op.out_var as usize];
        if !needed[j] {
            continue;
        }
        for input in op.inputs() {
            if let Operand::Tensor(_, place) = input {
                let place = *place as usize;
                if !read_by_needed[place] {
                    read_by_needed[place] = true;
                    last_read[place] = j;
                }
            }
        }
    }
    let elided = needed.iter().filter(|n| !**n).count();
    if elided > 0 {
        counters
            .elided_ops
            .fetch_add(elided as u64, std::sync::atomic::Ordering::Relaxed);
    }
    let mut local: Vec<Option<Vec<f32>>> = (0..places).map(|_| None).collect();
    // The storages of the Vars that die here, as their last tokens go.
    let mut dead = Vec::new();
    for (j, ((op, keep), needed)) in ops.into_iter().zip(keep).zip(needed).enumerate() {
        if !needed {
            op.let_go(&mut dead);
            continue;
        }
        let dims = &shapes[op.dims as usize];
        let n: usize = dims.iter().product();
        let mut out =
            super::ops::zeroed(n).map_err(|e| format!("{} at {}: {e}", op.name, op.location))?;
        {
            // Each tensor operand: the batch's own value, or the Var's data.
            let mut guards: SmallVec<[Option<std::sync::RwLockReadGuard<'_, Data>>; 2]> =
                SmallVec::new();
            for input in op.inputs() {
                guards.push(match *input {
                    Operand::Tensor(_, place) if local[place as usize].is_none() => {
                        Some(reads_token(&reads, place, &op)?.read_kernel())
                    }
                    _ => None,
                });
            }
            let mut values: SmallVec<[&[f32]; 2]> = SmallVec::new();
            for (input, guard) in op.inputs().iter().zip(&guards) {
                match (input, guard) {
                    (Operand::Tensor(..), Some(g)) => values.push(g.host()?),
                    (Operand::Tensor(_, place), None) => {
                        values.push(local[*place as usize].as_deref().ok_or_else(|| {
                            format!(
                                "internal error: {} at {} reads a value its batch did not compute",
                                op.name, op.location
                            )
                        })?)
                    }
                    (Operand::Scalar(_), _) => {}
                }
            }
            match (op.op, op.inputs()) {
                (ElemOp::Unary(u), [Operand::Tensor(..)]) => kernels::unary(u, values[0], &mut out),
                (ElemOp::Binary(b), [Operand::Tensor(da, _), Operand::Tensor(db, _)]) => {
                    let (da, db) = (&shapes[*da as usize], &shapes[*db as usize]);
                    kernels::binary(b, values[0], da, values[1], db, dims, &mut out)
                }
                (ElemOp::Binary(b), [Operand::Tensor(..), Operand::Scalar(s)]) => {
                    kernels::binary_scalar(b, values[0], *s, &mut out)
                }
                (ElemOp::Binary(b), [Operand::Scalar(s), Operand::Tensor(..)]) => {
                    kernels::scalar_binary(b, *s, values[0], &mut out)
                }
                _ => {
                    return Err(
                        "internal error: an op of a CPU batch has the wrong operands".into(),
                    )
                }
            }
        }
        if keep {
            *op.out.write_kernel() = Data::Host(out);
        } else {
            local[op.out_var as usize] = Some(out);
        }
        // Values nothing reads any more are freed at once.
        for input in op.inputs() {
            if let Operand::Tensor(_, place) = input {
                let place = *place as usize;
                if last_read[place] == j {
                    local[place] = None;
                }
            }
        }
        op.let_go(&mut dead);
    }
    for token in reads.into_iter().flatten() {
        dead.extend(token.into_spare());
    }
    spares.give(dead);
    Ok(())
}

impl Batches for DeviceBatch {
    /// Records every open batch, oldest first (the lock is held meanwhile:
    /// see the module's comment).
    fn close(&self, engine: &Engine) {
        let mut state = lock(&self.open);
        for open in std::mem::take(&mut state.batches) {
            self.record(engine, open);
        }
    }

    fn retire(&self) {
        self.spares.close();
        let local = std::mem::take(&mut lock(&self.open).spares);
        drop(local);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Mode;

    /// A Lazy engine with 2 workers.
    fn lazy() -> Engine {
        Engine::builder()
            .mode(Mode::Lazy)
            .workers(2)
            .build()
            .unwrap()
    }

    /// The engine's memory is freed within 10 s of its last handle going
    /// (its workers end first).
    fn assert_freed(shared: &std::sync::Weak<crate::engine::Shared>) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while shared.strong_count() > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(shared.strong_count(), 0, "the engine's memory is freed");
    }

    fn spares(engine: &Engine) -> usize {
        let batches = DeviceBatch::cpu(engine).expect("the CPU batches");
        batches.spares.len() + lock(&batches.open).spares.len()
    }

    /// A batch's node names the values it computes that are still held, and
    /// none of those dropped before it was recorded (nothing can name them
    /// again); the held ones are right.
    #[test]
    fn a_batch_node_names_only_the_values_still_held() {
        let e = lazy();
        let x = Tensor::ones_in(&e, [2]);
        let mut y = x.clone();
        let (mut keys, mut kept) = (Vec::new(), None);
        for i in 0..10 {
            y = &y + 1.0;
            keys.push(y.var.queue().key());
            if i == 4 {
                kept = Some(y.clone());
            }
        }
        // Lazy: the node is recorded here and not run, so the dropped
        // values' storages (and the keys) stay with its ops.
        e.shared().close_batches();
        let nodes = e.shared().recorded.snapshot();
        let node = nodes
            .iter()
            .find(|n| n.writes(keys[9]))
            .expect("the batch's node writes the last value");
        let named: Vec<bool> = keys.iter().map(|k| node.writes(*k)).collect();
        let held: Vec<bool> = (0..10).map(|i| i == 4 || i == 9).collect();
        assert_eq!(named, held);
        assert_eq!(kept.expect("held").to_vec().unwrap(), vec![6.0; 2]);
        assert_eq!(y.to_vec().unwrap(), vec![11.0; 2]);
    }

    /// The storages of the values that die in a CPU batch are kept and made
    /// into the next outputs; the engine still ends with its last handle
    /// (the spares refer to it, and it to them, until it retires).
    #[test]
    fn dead_values_storages_are_reused_and_let_go_when_the_engine_ends() {
        let e = lazy();
        let x = Tensor::ones_in(&e, [4]);
        let mut y = x.clone();
        for _ in 0..300 {
            y = &y + 1.0;
        }
        assert_eq!(y.to_vec().unwrap(), vec![301.0; 4]);
        e.wait_all().unwrap();
        // Every value but the last died on a worker.
        let kept = spares(&e);
        assert!(kept >= 298, "{kept} spares");
        let z = &y + 1.0;
        assert_eq!(spares(&e), kept - 1, "the output is made in a spare");
        assert_eq!(z.to_vec().unwrap(), vec![302.0; 4]);
        let shared = Arc::downgrade(&e.shared);
        drop((x, y, z, e));
        assert_freed(&shared);
    }

    /// A value whose op ran and whose last handle goes on the frontend
    /// leaves its storage with the spares too, and the next output is made
    /// in it; a value a pending op still reads is not kept then (the op's
    /// batch holds it), and the engine still ends with its last handle.
    #[test]
    fn values_let_go_of_on_the_frontend_after_their_ops_ran_are_kept() {
        let e = lazy();
        let x = Tensor::ones_in(&e, [4]);
        let outs: Vec<Tensor> = (0..50).map(|i| &x + i as f32).collect();
        e.wait_all().unwrap();
        let before = spares(&e);
        let keys: std::collections::HashSet<usize> =
            outs.iter().map(|t| t.var.queue().key()).collect();
        drop(outs);
        assert_eq!(spares(&e), before + 50);
        let z = &x + 1.0;
        assert!(
            keys.contains(&z.var.queue().key()),
            "made in a kept storage"
        );
        // Not run yet: `w`'s batch holds `z`.
        let w = &z * 3.0;
        let kept = spares(&e);
        drop(z);
        assert_eq!(spares(&e), kept, "a storage a pending op reads is not kept");
        assert_eq!(w.to_vec().unwrap(), vec![6.0; 4]);
        let shared = Arc::downgrade(&e.shared);
        drop((x, w, e));
        assert_freed(&shared);
    }
}
