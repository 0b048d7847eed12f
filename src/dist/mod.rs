//! Several processes: collectives on tensors (allreduce, reduce, broadcast)
//! recorded as engine nodes, carried out by one communication thread per
//! process over MPI (cargo feature `mpi`) or, for tests and single-process
//! runs, inside one process.
//!
//! A collective is a *deferred* task ([`crate::TaskBuilder::run_deferred`]):
//! a worker copies the tensor's host data into a request and is free at once;
//! the communication thread runs the collective and finishes the task. So
//! communication overlaps with whatever computation the graph allows (the
//! backward pass of earlier layers), and no MPI call ever blocks a worker.
//!
//! Every process must record the same collectives in the same order: each
//! gets a sequence number when it is recorded, and the communication thread
//! runs them strictly in that order, whatever order the workers reach them
//! in. Before each one, the ranks exchange a short header (step, operation,
//! root, length) with a deadline, so a rank that died, hangs, or sends a
//! buffer of the wrong size gives every other rank a clear error naming the
//! rank and the step instead of a hang.
//!
//! ```
//! use lazyflow::{dist::Dist, Engine, Tensor};
//! let engine = Engine::builder().workers(1).build().unwrap();
//! // Two ranks as threads of this process (under mpirun: `Dist::from_env`).
//! let ranks = Dist::in_process(2).unwrap();
//! let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
//!     let handles: Vec<_> = ranks
//!         .iter()
//!         .map(|d| {
//!             let engine = &engine;
//!             s.spawn(move || {
//!                 let x = Tensor::full_in(engine, [2], d.rank() as f32 + 1.0);
//!                 d.allreduce_sum(&x, "x").unwrap().to_vec().unwrap()
//!             })
//!         })
//!         .collect();
//!     handles.into_iter().map(|h| h.join().unwrap()).collect()
//! });
//! assert_eq!(sums, vec![vec![3.0, 3.0], vec![3.0, 3.0]]);
//! ```

mod backend;
#[cfg(feature = "mpi")]
mod mpi;

use crate::device::Device;
use crate::engine::Completion;
use crate::error::{Error, Location, Result};
use crate::tensor::{Data, Tensor};
use backend::{CommFailure, Local, Transport};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a rank waits for the others to reach a step before it reports
/// them (`LAZYFLOW_DIST_TIMEOUT` in seconds overrides it in
/// [`Dist::from_env`]).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// A collective operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    AllReduce,
    Reduce(usize),
    Broadcast(usize),
    /// Every rank checks that the others hold the same description.
    Agree,
    /// The transport's allreduce called directly: no header, no task (the
    /// peer of [`Dist::allreduce_sum`] in benchmarks).
    Raw,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "allreduce",
            Op::Reduce(_) => "reduce",
            Op::Broadcast(_) => "broadcast",
            Op::Agree => "agree",
            Op::Raw => "raw allreduce",
        }
    }

    fn code(self) -> (u64, u64) {
        match self {
            Op::AllReduce => (1, 0),
            Op::Reduce(r) => (2, r as u64),
            Op::Broadcast(r) => (3, r as u64),
            Op::Agree => (4, 0),
            Op::Raw => (5, 0),
        }
    }
}

/// What each rank says before a step; all must match.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    seq: u64,
    op: (u64, u64),
    len: u64,
    /// The rank's input to the step failed: it takes part only to say so.
    failed: bool,
    /// A hash of the description (agreement steps).
    hash: u64,
}

const MAGIC: u64 = 0x6c7a_666c_6f77_0001;

impl Header {
    fn bytes(&self) -> Vec<u8> {
        [
            MAGIC,
            self.seq,
            self.op.0,
            self.op.1,
            self.len,
            self.failed as u64,
            self.hash,
        ]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect()
    }

    fn parse(b: &[u8]) -> Option<Header> {
        if b.len() != 56 {
            return None;
        }
        let w: Vec<u64> = b
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
            .collect();
        (w[0] == MAGIC).then_some(Header {
            seq: w[1],
            op: (w[2], w[3]),
            len: w[4],
            failed: w[5] != 0,
            hash: w[6],
        })
    }
}

/// FNV-1a, for agreement hashes (the same on every platform and run).
fn hash(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The answer a step's task gets.
type Reply = Box<dyn FnOnce(std::result::Result<Vec<f32>, String>) + Send>;

/// One collective, as the communication thread gets it.
struct Step {
    seq: u64,
    label: String,
    op: Op,
    /// `None`: the rank's input failed (the step is still announced, so the
    /// other ranks learn it instead of waiting).
    data: Option<Vec<f32>>,
    /// The description an agreement step compares.
    text: String,
    reply: Option<Reply>,
}

/// Communication statistics of one process.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CommStats {
    /// Collectives carried out.
    pub collectives: u64,
    /// Bytes of tensor data this rank contributed.
    pub bytes: u64,
    /// Seconds the communication thread spent in collectives (waiting for the
    /// other ranks included).
    pub seconds: f64,
}

/// Counted by the communication thread, read by [`Dist::stats`] (Relaxed:
/// statistics only).
#[derive(Default)]
struct Counts {
    collectives: AtomicU64,
    bytes: AtomicU64,
    nanos: AtomicU64,
    /// The last raw allreduce's time inside the transport.
    raw_nanos: AtomicU64,
}

struct Inner {
    rank: usize,
    size: usize,
    transport: String,
    next: AtomicU64,
    tx: Mutex<Option<mpsc::Sender<Step>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    counts: Arc<Counts>,
}

impl Inner {
    fn send(&self, step: Step) {
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let undelivered = match tx {
            Some(tx) => tx.send(step).err().map(|e| e.0),
            None => Some(step),
        };
        if let Some(step) = undelivered {
            if let Some(reply) = step.reply {
                reply(Err("the communication thread has ended".into()));
            }
        }
    }
}

/// This process's place among the processes of a job, and its communication
/// thread. Cheap to clone; the thread ends (and MPI is finalized) when the
/// last clone is dropped.
///
/// Collectives take and return tensors on any device (data on a GPU goes to
/// host memory first, and the result comes back): see [`Dist::allreduce_sum`].
#[derive(Clone)]
pub struct Dist {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Dist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dist")
            .field("rank", &self.inner.rank)
            .field("size", &self.inner.size)
            .field("transport", &self.inner.transport)
            .finish()
    }
}

/// The rank count `mpirun` (Open MPI, MPICH, PMIx launchers) announces in the
/// environment, if any.
pub fn launched_ranks() -> Option<usize> {
    [
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
        "PMIX_SIZE",
        "MPI_LOCALNRANKS",
    ]
    .iter()
    .find_map(|k| std::env::var(k).ok()?.trim().parse().ok())
}

impl Dist {
    /// The process's place in its job: under `mpirun` with the `mpi` feature,
    /// an MPI rank; otherwise a single process (rank 0 of 1). Built without
    /// the feature but started as one of several ranks, it is an error that
    /// says how to build, rather than several processes each training alone.
    /// The timeout comes from `LAZYFLOW_DIST_TIMEOUT` (seconds) if set.
    pub fn from_env() -> Result<Dist> {
        let timeout = match std::env::var("LAZYFLOW_DIST_TIMEOUT") {
            Ok(s) => match s.trim().parse::<f64>() {
                Ok(v) if v.is_finite() && v > 0.0 => Duration::from_secs_f64(v),
                _ => {
                    return Err(Error::Config(format!(
                        "LAZYFLOW_DIST_TIMEOUT={s:?} is not a positive number of seconds"
                    )))
                }
            },
            Err(_) => DEFAULT_TIMEOUT,
        };
        Dist::from_env_with(timeout)
    }

    /// [`Dist::from_env`] with this timeout for the other ranks to reach a step.
    pub fn from_env_with(timeout: Duration) -> Result<Dist> {
        match launched_ranks() {
            Some(n) if n > 1 => Dist::mpi(n, timeout),
            _ => Ok(Dist::single_with(timeout)),
        }
    }

    #[cfg(feature = "mpi")]
    fn mpi(_ranks: usize, timeout: Duration) -> Result<Dist> {
        Dist::start(
            move || mpi::Mpi::init().map(|m| Box::new(m) as Box<dyn Transport>),
            timeout,
        )
    }

    #[cfg(not(feature = "mpi"))]
    fn mpi(ranks: usize, _timeout: Duration) -> Result<Dist> {
        Err(Error::Config(format!(
            "this process is one of {ranks} ranks started by mpirun, but lazyflow was built \
             without the `mpi` feature, so every rank would train alone; rebuild with \
             `cargo build --release --features mpi`"
        )))
    }

    /// A single process: rank 0 of 1 (collectives return their input).
    pub fn single() -> Dist {
        Dist::single_with(DEFAULT_TIMEOUT)
    }

    fn single_with(timeout: Duration) -> Dist {
        let mut group = Local::group(1);
        let local = group.pop();
        let started = Dist::start(
            move || {
                local
                    .map(|l| Box::new(l) as Box<dyn Transport>)
                    .ok_or_else(|| Error::Config("no rank".into()))
            },
            timeout,
        );
        // Without its thread (the system is out of threads) every collective
        // fails with a message instead of the process panicking here.
        started.unwrap_or_else(|e| Dist {
            inner: Arc::new(Inner {
                rank: 0,
                size: 1,
                transport: format!("single process, without a communication thread ({e})"),
                next: AtomicU64::new(0),
                tx: Mutex::new(None),
                thread: Mutex::new(None),
                counts: Arc::new(Counts::default()),
            }),
        })
    }

    /// `size` ranks living in this process (one per thread that uses it):
    /// the same protocol as MPI ranks, for tests and for trying a distributed
    /// program without `mpirun`.
    pub fn in_process(size: usize) -> Result<Vec<Dist>> {
        Dist::in_process_with(size, DEFAULT_TIMEOUT)
    }

    /// [`Dist::in_process`] with this timeout.
    pub fn in_process_with(size: usize, timeout: Duration) -> Result<Vec<Dist>> {
        if size == 0 {
            return Err(Error::Config("a job needs at least one rank".into()));
        }
        Local::group(size)
            .into_iter()
            .map(|l| Dist::start(move || Ok(Box::new(l) as Box<dyn Transport>), timeout))
            .collect()
    }

    /// Starts the communication thread; `open` runs on it (MPI is initialized
    /// and finalized on the thread that makes every MPI call).
    fn start(
        open: impl FnOnce() -> Result<Box<dyn Transport>> + Send + 'static,
        timeout: Duration,
    ) -> Result<Dist> {
        let (tx, rx) = mpsc::channel::<Step>();
        let counts = Arc::new(Counts::default());
        let served = counts.clone();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(usize, usize, String)>>();
        let thread = std::thread::Builder::new()
            .name("lazyflow-comm".into())
            .spawn(move || {
                let transport = match open() {
                    Ok(t) => t,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok((transport.rank(), transport.size(), transport.name())));
                serve(transport, rx, timeout, &served);
            })
            .map_err(|e| Error::Config(format!("could not start the communication thread: {e}")))?;
        let (rank, size, transport) = ready_rx
            .recv()
            .map_err(|_| Error::Config("the communication thread failed to start".into()))??;
        Ok(Dist {
            inner: Arc::new(Inner {
                rank,
                size,
                transport,
                next: AtomicU64::new(0),
                tx: Mutex::new(Some(tx)),
                thread: Mutex::new(Some(thread)),
                counts,
            }),
        })
    }

    /// This process's rank, from 0.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// The number of processes.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// Whether this is rank 0 (the one that prints and writes reports).
    pub fn is_root(&self) -> bool {
        self.inner.rank == 0
    }

    /// What carries the messages ("MPI (Open MPI ...)", "single process").
    pub fn transport(&self) -> &str {
        &self.inner.transport
    }

    /// Communication statistics so far.
    pub fn stats(&self) -> CommStats {
        let c = &self.inner.counts;
        CommStats {
            collectives: c.collectives.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            seconds: c.nanos.load(Ordering::Relaxed) as f64 * 1e-9,
        }
    }

    /// The element-wise sum of `t` over all ranks, on every rank, as a new
    /// tensor on `t`'s device. Recorded, nothing waits: the sum is computed
    /// when its input is ready (also in Lazy mode, since every rank must take
    /// part). `label` names the step in errors ("gradient of conv1").
    ///
    /// ```
    /// use lazyflow::{dist::Dist, Engine, Tensor};
    /// let engine = Engine::builder().workers(1).build().unwrap();
    /// let d = Dist::single();
    /// let x = Tensor::from_vec_in(&engine, vec![1.0, 2.0], [2]).unwrap();
    /// assert_eq!(d.allreduce_sum(&x, "x").unwrap().to_vec().unwrap(), vec![1.0, 2.0]);
    /// ```
    #[track_caller]
    pub fn allreduce_sum(&self, t: &Tensor, label: &str) -> Result<Tensor> {
        self.collective(t, Op::AllReduce, label, Location::caller())
    }

    /// The sum of `t` over all ranks on rank `root`; the other ranks get their
    /// own `t` back (the parameter server's gathering step).
    #[track_caller]
    pub fn reduce_sum(&self, t: &Tensor, root: usize, label: &str) -> Result<Tensor> {
        self.collective(t, Op::Reduce(root), label, Location::caller())
    }

    /// Rank `root`'s `t` on every rank (the parameter server's broadcast).
    /// Every rank passes a tensor of the same shape.
    #[track_caller]
    pub fn broadcast(&self, t: &Tensor, root: usize, label: &str) -> Result<Tensor> {
        self.collective(t, Op::Broadcast(root), label, Location::caller())
    }

    /// Checks that every rank describes `what` the same way (the model's
    /// shapes, the hyperparameters): returns an error naming the first rank
    /// that differs, with both descriptions. Waits for the other ranks.
    ///
    /// ```
    /// use lazyflow::dist::Dist;
    /// let d = Dist::single();
    /// d.agree("hyperparameters", "lr 0.1, batch 256").unwrap();
    /// ```
    #[track_caller]
    pub fn agree(&self, what: &str, description: &str) -> Result<()> {
        let (tx, rx) = mpsc::channel();
        let seq = self.inner.next.fetch_add(1, Ordering::SeqCst);
        self.inner.send(Step {
            seq,
            label: what.to_string(),
            op: Op::Agree,
            data: Some(Vec::new()),
            text: description.to_string(),
            reply: Some(Box::new(move |r| {
                let _ = tx.send(r);
            })),
        });
        match rx.recv() {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(reason)) => Err(Error::Distributed {
                step: format!("agreeing on {what}"),
                reason,
            }),
            Err(_) => Err(Error::Distributed {
                step: format!("agreeing on {what}"),
                reason: "the communication thread has ended".into(),
            }),
        }
    }

    /// The transport's own allreduce (for MPI, `MPI_Allreduce`) on `data`,
    /// called directly on the communication thread: no header exchange, no
    /// engine task, no timeout. Every rank must call it at the same point.
    /// Blocks until it is done, and returns the sums and the time the call
    /// took; for measuring what [`Dist::allreduce_sum`] adds to it.
    pub fn raw_allreduce(&self, data: Vec<f32>) -> Result<(Vec<f32>, Duration)> {
        let (tx, rx) = mpsc::channel();
        let seq = self.inner.next.fetch_add(1, Ordering::SeqCst);
        self.inner.send(Step {
            seq,
            label: "a benchmark".into(),
            op: Op::Raw,
            data: Some(data),
            text: String::new(),
            reply: Some(Box::new(move |r| {
                let _ = tx.send(r);
            })),
        });
        let failed = |reason: String| Error::Distributed {
            step: "raw allreduce".into(),
            reason,
        };
        let sums = rx
            .recv()
            .map_err(|_| failed("the communication thread has ended".into()))?
            .map_err(failed)?;
        // The reply came through the channel after the store.
        let nanos = self.inner.counts.raw_nanos.load(Ordering::Relaxed);
        Ok((sums, Duration::from_nanos(nanos)))
    }

    fn collective(&self, t: &Tensor, op: Op, label: &str, location: Location) -> Result<Tensor> {
        if let Op::Reduce(root) | Op::Broadcast(root) = op {
            if root >= self.inner.size {
                return Err(Error::InvalidArgument {
                    op: op.name(),
                    shape: t.shape().to_string(),
                    reason: format!("root {root} is not a rank of {}", self.inner.size),
                    location,
                });
            }
        }
        let home = t.device();
        let host = if home == Device::Cpu {
            t.clone()
        } else {
            t.to_at(Device::Cpu, location)?
        };
        let out = Tensor {
            shape: t.shape().clone(),
            var: t.engine().var(Data::default()),
            device: Device::Cpu,
            tape: None,
        };
        let ticket = Ticket {
            seq: self.inner.next.fetch_add(1, Ordering::SeqCst),
            label: label.to_string(),
            op,
            inner: Some(self.inner.clone()),
        };
        let engine = t.engine().clone();
        let mut task = engine.task_at(op.name(), location);
        task.eager();
        let input = task.read(&host.var);
        let output = task.write(&out.var);
        task.run_deferred(move |done: Completion| {
            let data = match input.read().host() {
                Ok(v) => v.clone(),
                Err(e) => {
                    drop(ticket);
                    return done.finish(Err(e));
                }
            };
            ticket.submit(
                data,
                Box::new(move |result| match result {
                    Ok(v) => {
                        *output.write() = Data::Host(v);
                        done.finish(Ok::<(), String>(()));
                    }
                    Err(e) => done.finish(Err(e)),
                }),
            );
        })?;
        if home == Device::Cpu {
            Ok(out)
        } else {
            out.to_at(home, location)
        }
    }
}

/// A collective's place in the sequence, held by its task. A task that never
/// runs (its input failed) drops its ticket, which announces the step as
/// failed, so the other ranks and the later steps are not left waiting.
struct Ticket {
    seq: u64,
    label: String,
    op: Op,
    inner: Option<Arc<Inner>>,
}

impl Ticket {
    fn submit(mut self, data: Vec<f32>, reply: Reply) {
        if let Some(inner) = self.inner.take() {
            inner.send(Step {
                seq: self.seq,
                label: std::mem::take(&mut self.label),
                op: self.op,
                data: Some(data),
                text: String::new(),
                reply: Some(reply),
            });
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            inner.send(Step {
                seq: self.seq,
                label: std::mem::take(&mut self.label),
                op: self.op,
                data: None,
                text: String::new(),
                reply: None,
            });
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Closing the channel ends the thread once it has served every step.
        drop(self.tx.lock().unwrap_or_else(|p| p.into_inner()).take());
        if let Some(thread) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = thread.join();
        }
    }
}

/// The communication thread: runs steps in sequence order, whatever order
/// they arrive in.
fn serve(
    mut transport: Box<dyn Transport>,
    rx: mpsc::Receiver<Step>,
    timeout: Duration,
    counts: &Counts,
) {
    let mut waiting: BTreeMap<u64, Step> = BTreeMap::new();
    let mut next = 0u64;
    // The first failure that may have left ranks out of step (a timeout):
    // later steps fail at once with it, and the job is aborted at the end
    // (MPI could otherwise wait forever in its finalization for a rank that
    // hangs).
    let mut broken: Option<String> = None;
    let mut abort = false;
    while let Ok(step) = rx.recv() {
        waiting.insert(step.seq, step);
        while let Some(mut step) = waiting.remove(&next) {
            next += 1;
            if step.op == Op::Raw {
                let mut data = step.data.take().unwrap_or_default();
                let start = Instant::now();
                let result = transport.allreduce_sum(&mut data);
                counts
                    .raw_nanos
                    .store(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
                if let Some(reply) = step.reply {
                    reply(
                        result
                            .map(|()| data)
                            .map_err(|_| "raw allreduce failed".into()),
                    );
                }
                continue;
            }
            let result = match &broken {
                Some(first) => Err(format!(
                    "an earlier step failed, so the ranks are out of step: {first}"
                )),
                None => {
                    let start = Instant::now();
                    let len = step.data.as_ref().map_or(0, Vec::len);
                    let result = run_step(transport.as_mut(), &mut step, timeout);
                    counts
                        .nanos
                        .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    counts.collectives.fetch_add(1, Ordering::Relaxed);
                    counts.bytes.fetch_add(4 * len as u64, Ordering::Relaxed);
                    // A mismatch every rank saw leaves them in step; a
                    // rank that did not arrive may still be anywhere.
                    if let Err((message, true)) = &result {
                        broken = Some(message.clone());
                        abort = true;
                    }
                    result.map_err(|(m, _)| m)
                }
            };
            if let Some(reply) = step.reply {
                reply(result);
            }
        }
    }
    if abort {
        transport.abort(1);
    }
}

/// Runs one step: the header exchange, then the collective. An `Err` carries
/// the message and whether the ranks may be left out of step (a timeout or a
/// transport failure, as against a mismatch every rank saw).
fn run_step(
    t: &mut dyn Transport,
    step: &mut Step,
    timeout: Duration,
) -> std::result::Result<Vec<f32>, (String, bool)> {
    let me = t.rank();
    let name = format!("step #{} ({} of {})", step.seq, step.op.name(), step.label);
    let mine = Header {
        seq: step.seq,
        op: step.op.code(),
        len: step.data.as_ref().map_or(0, |d| d.len() as u64),
        failed: step.data.is_none(),
        hash: hash(&step.text),
    };
    let fail = |f: CommFailure| match f {
        CommFailure::Missing(ranks) => (
            format!(
                "{name}: rank {} did not reach this step within {:.0} s (it died, hangs, \
                 or recorded different collectives)",
                join(&ranks),
                timeout.as_secs_f64()
            ),
            true,
        ),
    };
    let all = t
        .exchange(&mine.bytes(), Instant::now() + timeout)
        .map_err(fail)?;
    let headers: Vec<Option<Header>> = all.iter().map(|b| Header::parse(b)).collect();
    for (r, h) in headers.iter().enumerate() {
        let Some(h) = h else {
            return Err((
                format!("{name}: rank {r} sent a message that is not a header"),
                true,
            ));
        };
        if h.seq != mine.seq || h.op != mine.op {
            return Err((
                format!(
                    "{name}: rank {r} is at step #{} ({}) instead: the ranks recorded \
                     different collectives",
                    h.seq,
                    describe_op(h.op)
                ),
                false,
            ));
        }
        if h.failed && r != me {
            return Err((
                format!("{name}: rank {r} could not take part: its input to this step failed"),
                false,
            ));
        }
        if h.len != mine.len && !mine.failed {
            return Err((
                format!(
                    "{name}: rank {r} sent {} values, this rank ({me}) has {}",
                    h.len, mine.len
                ),
                false,
            ));
        }
    }
    let Some(mut data) = step.data.take() else {
        return Err((format!("{name}: this rank's input failed"), false));
    };
    if step.op == Op::Agree {
        if let Some(r) = headers
            .iter()
            .position(|h| h.map(|h| h.hash) != Some(mine.hash))
        {
            // Everyone saw a mismatch: trade the descriptions for the message.
            let texts = t
                .exchange(step.text.as_bytes(), Instant::now() + timeout)
                .map_err(fail)?;
            return Err((
                format!(
                    "rank {r} has {} {:?}, but this rank ({me}) has {:?}",
                    step.label,
                    String::from_utf8_lossy(&texts[r]),
                    step.text
                ),
                false,
            ));
        }
        return Ok(Vec::new());
    }
    let result = match step.op {
        Op::AllReduce => t.allreduce_sum(&mut data),
        Op::Reduce(root) => t.reduce_sum(&mut data, root),
        Op::Broadcast(root) => t.broadcast(&mut data, root),
        Op::Agree => Ok(()),
        Op::Raw => t.allreduce_sum(&mut data),
    };
    result.map_err(fail)?;
    Ok(data)
}

fn describe_op(op: (u64, u64)) -> String {
    match op {
        (1, _) => "allreduce".into(),
        (2, r) => format!("reduce to rank {r}"),
        (3, r) => format!("broadcast from rank {r}"),
        (4, _) => "agreement".into(),
        (5, _) => "raw allreduce".into(),
        (c, _) => format!("unknown operation {c}"),
    }
}

fn join(ranks: &[usize]) -> String {
    ranks
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
