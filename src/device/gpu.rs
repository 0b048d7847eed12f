//! GPU devices through wgpu: one wgpu Device and in-order Queue per logical device.
//!
//! This layer owns buffers (pooled, stamped with their fates), command batches,
//! the pipeline cache and a hook for deferred encoding. It knows no tensor op:
//! kernels come to it as a [`KernelSource`] with a specialization string, and
//! work a layer above keeps open (the tensor layer's fusion group) comes as a
//! [`DeferredEncode`].
//!
//! A GPU node runs like any other node: a worker takes it and runs its closure,
//! which *encodes* the node's work into the device's open command encoder. The
//! node completes when it is encoded, which is correct for every consumer:
//! - a dependent on the same device is encoded after it into the same in-order
//!   queue (wgpu inserts the barriers between conflicting dispatches);
//! - a consumer elsewhere (a readback, a copy to another device) goes through
//!   [`Gpu::read`], which submits the open batch and waits for it;
//! - `Engine::wait_all` submits every open batch and waits for the devices.
//!
//! Batches are submitted when they hold [`BATCH_LIMIT`] dispatches, when a
//! readback needs them, or when the device has no more recorded nodes to encode
//! (so that work starts while the frontend goes on; deferred work, a fusion
//! group, stays open then, until something needs it or it is full). The
//! scheduler knows nothing of this: a device only changes what a node's closure
//! does.
//!
//! Data only enters a device through a staging buffer copied inside the batch, so
//! an upload is ordered with the dispatches around it (`Queue::write_buffer` would
//! land before the whole next submission).
//!
//! ## Failures after a node completed
//! Since a node completes when it is encoded, a failure that comes later (a fusion
//! group that cannot be encoded, a command buffer that fails to finish or submit,
//! the device lost or hung) cannot fail the node in the graph any more. So every
//! GPU buffer carries a [`Stamp`]: which op wrote it, and the [`Fate`]s of the
//! batches (or the fusion group) its value was made in, its inputs' included. A
//! failed batch sets its fate, which poisons every value written in it and every
//! value computed from them; a readback, a copy to another device or
//! `wait_to_read` of such a value returns the failure naming the op that wrote
//! it, and `wait_all` returns every batch failure since the last one. A buffer that
//! no kernel wrote is never read back. Only the fates of batches that are still
//! open or that failed are kept in stamps (a submitted batch can fail only with
//! its device, which is checked separately), so stamps stay small.
//!
//! A lost device (wgpu's device-lost callback, or a wait longer than the
//! engine's GPU timeout) fails every later node, readback and wait on it; the
//! other devices go on.

use super::tune::Autotune;
use crate::error::Location;
use rustc_hash::FxHashMap as HashMap;
use smallvec::SmallVec;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// What became of one command buffer, or of one fusion group until it is
/// encoded into one.
#[derive(Default)]
pub(crate) struct Fate {
    failed: OnceLock<String>,
    /// Settled (see [`Fate::settle`]): from then on only the loss of the
    /// device can fail it.
    submitted: AtomicBool,
}

impl Fate {
    pub(crate) fn new() -> Arc<Fate> {
        Arc::new(Fate::default())
    }

    /// Fails everything written under this fate (the first reason is kept).
    pub(crate) fn fail(&self, message: String) {
        let _ = self.failed.set(message);
    }

    /// Nothing can fail this fate any more by itself: a batch submitted without
    /// error, or a fusion group encoded into a batch (whose own fate its
    /// outputs now carry). Release: pairs with the Acquire in `settled_ok`.
    pub(crate) fn settle(&self) {
        self.submitted.store(true, Ordering::Release);
    }

    fn settled_ok(&self) -> bool {
        // Acquire: pairs with the Release store after a successful submit.
        self.failed.get().is_none() && self.submitted.load(Ordering::Acquire)
    }
}

/// Who wrote a buffer, and the fates its value depends on.
struct Stamp {
    op: &'static str,
    location: Location,
    fates: SmallVec<[Arc<Fate>; 2]>,
}

/// Fates a value depends on that may still fail or have failed.
pub(crate) type Lineage = SmallVec<[Arc<Fate>; 2]>;

/// A failure injected by tests at one point of a GPU device (see
/// [`crate::Engine::inject_gpu_fault`]). Each fires once.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum GpuFault {
    /// The next upload (of data or of a kernel's info buffer) fails.
    Upload,
    /// The next pipeline lookup or creation fails.
    Pipeline,
    /// The next submission of a command buffer fails.
    Submit,
    /// The device is lost now (`wgpu::Device::destroy`).
    Lose,
    /// The next wait for the device does not end within the GPU timeout (a
    /// software GPU such as lavapipe runs a submission before `submit`
    /// returns, so a real hung kernel cannot be made there).
    Hang,
}

/// Dispatches per submitted command buffer at most.
const BATCH_LIMIT: usize = 64;
/// Invocations per workgroup of every kernel dispatched over [`Grid::Elements`].
const WORKGROUP: usize = 256;

/// What a GPU device is, for listings and reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    /// The adapter's name (e.g. `NVIDIA H200`, `llvmpipe (LLVM 15.0.6, 256 bits)`).
    pub name: String,
    /// `vulkan`, `metal`, `dx12` or `gl`.
    pub backend: String,
    /// `discrete`, `integrated`, `virtual`, `cpu` or `other`.
    pub device_type: String,
    /// Which logical device on this adapter (0 unless several were asked for).
    pub logical: usize,
}

/// A compute kernel as the device sees it. Pipelines are cached by `name` and
/// the specialization string a dispatch passes with it, and the WGSL is built
/// by `specialize(template, spec)` only when that pipeline is not cached yet.
/// So one `name` must always come with the same `template` and `specialize`.
///
/// The op kernels of `shaders/` are described by the tensor layer
/// (`tensor/shaders.rs`); kernels whose specialization is their whole source
/// (a user's, a generated one) use [`KernelSource::WHOLE`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct KernelSource {
    /// Names the kernel in the pipeline cache and in wgpu labels.
    pub(crate) name: &'static str,
    /// The WGSL the specialization is applied to.
    pub(crate) template: &'static str,
    /// Builds the WGSL of one specialization.
    pub(crate) specialize: fn(template: &'static str, spec: &str) -> String,
}

impl KernelSource {
    /// A kernel whose specialization is its complete WGSL source.
    pub(crate) const WHOLE: KernelSource = KernelSource {
        name: "wgsl",
        template: "",
        specialize: whole_source,
    };

    /// The WGSL of the specialization `spec`.
    pub(crate) fn wgsl(&self, spec: &str) -> String {
        (self.specialize)(self.template, spec)
    }
}

fn whole_source(_template: &'static str, spec: &str) -> String {
    spec.to_string()
}

/// How a kernel uses one of its bound buffers. A written buffer is stamped
/// with the lineage of the dispatch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    /// Only read.
    Read,
    /// Written, with a new value that may depend on the old one.
    Write,
    /// Written without reading it (`fill_`): the old value's failures do not
    /// carry over to the new one.
    Overwrite,
}

/// Work a layer above keeps open on a device and encodes as late as possible
/// (the tensor layer's fusion group). The device encodes it before anything
/// else it encodes, submits or reads back, so that everything after is ordered
/// after it. See [`Gpu::with_deferred`].
pub(crate) trait DeferredEncode: std::any::Any + Send {
    /// Encodes the open work, if any, through [`Gpu::dispatch_direct`] (the
    /// hook's lock is held, so [`Gpu::dispatch`] would deadlock). A failure
    /// fails the fates of the values that work writes, not the caller.
    fn encode(&mut self, gpu: &Gpu);
}

/// How many workgroups a dispatch launches.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Grid {
    /// One invocation per element, 256 per workgroup.
    Elements(usize),
    /// This many workgroups.
    Workgroups(usize),
    /// Exactly these workgroup counts.
    Exact(u32, u32, u32),
}

impl Grid {
    /// Workgroup counts, folding long 1-D grids into (x, y) under the 65,535
    /// limit of one dimension. `None` when there is nothing to do.
    fn counts(self) -> Option<(u32, u32, u32)> {
        let folded = |groups: usize| {
            let gx = groups.min(65_535);
            (gx as u32, groups.div_ceil(gx) as u32, 1)
        };
        let c = match self {
            Grid::Elements(0) | Grid::Workgroups(0) => return None,
            Grid::Elements(n) => folded(n.div_ceil(WORKGROUP)),
            Grid::Workgroups(g) => folded(g),
            Grid::Exact(x, y, z) => (x, y, z),
        };
        (c.0 > 0 && c.1 > 0 && c.2 > 0).then_some(c)
    }
}

/// Storage buffers kept for reuse, by size class (a power of two of at least
/// 256 bytes). A buffer comes back when the tensor data holding it is dropped,
/// which happens only after every node that accesses it has been encoded; since
/// the device's queue runs in order, a later node that reuses the buffer runs
/// after all of them (the write-after-read hazard of pooled buffers).
pub(crate) struct Pool {
    classes: Mutex<HashMap<u64, Vec<wgpu::Buffer>>>,
}

/// Idle buffers kept per size class: up to this many bytes' worth, and never
/// fewer than [`POOL_MIN_PER_CLASS`] nor more than [`POOL_MAX_PER_CLASS`];
/// the rest are freed. A fusion group of 64 small ops holds 64 buffers until it
/// is encoded, and a chain of such groups takes them back in turn: with 32 per
/// class, half of every group's buffers were created anew (a `vkCreateBuffer`
/// and an allocation each, about a fifth of a small op's cost on lavapipe).
const POOL_BYTES_PER_CLASS: u64 = 64 << 20;
const POOL_MIN_PER_CLASS: usize = 4;
const POOL_MAX_PER_CLASS: usize = 65_536;

impl Pool {
    fn class(bytes: u64) -> u64 {
        bytes.max(256).next_power_of_two()
    }

    /// Idle buffers kept of `class` bytes each.
    fn keep(class: u64) -> usize {
        ((POOL_BYTES_PER_CLASS / class.max(1)) as usize)
            .clamp(POOL_MIN_PER_CLASS, POOL_MAX_PER_CLASS)
    }

    fn take(&self, class: u64) -> Option<wgpu::Buffer> {
        lock(&self.classes).get_mut(&class).and_then(|v| v.pop())
    }

    fn give(&self, class: u64, buffer: wgpu::Buffer) {
        let mut classes = lock(&self.classes);
        let list = classes.entry(class).or_default();
        if list.len() < Pool::keep(class) {
            list.push(buffer);
        }
    }
}

/// A storage buffer from a device's pool, bound with its exact length; it goes
/// back to the pool when dropped. Or a range of a [`Slab`] that a fused
/// kernel writes several small values into (see [`Gpu::pack`]).
pub(crate) struct GpuBuffer {
    /// Created on first use for a buffer from [`Gpu::alloc_lazy`]: a fused
    /// op's value that nothing outside its kernel reads never gets one.
    buffer: std::sync::OnceLock<Backing>,
    /// Set when a kernel, copy or upload writes the buffer.
    stamp: Mutex<Option<Stamp>>,
    /// The bytes in use (bindings cover exactly these).
    bytes: u64,
    class: u64,
    pool: Arc<Pool>,
}

impl std::fmt::Debug for GpuBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuBuffer({} bytes)", self.bytes)
    }
}

/// Where a [`GpuBuffer`]'s bytes are: a buffer of its own from the pool, or a
/// range of a slab shared with other values.
struct Backing {
    buffer: wgpu::Buffer,
    /// Of the value's first byte in `buffer` (0 for a buffer of its own).
    offset: u64,
    /// The slab the range belongs to (`None`: the buffer is the value's own).
    slab: Option<Arc<Slab>>,
}

/// One buffer holding several small values that one fused kernel writes,
/// each at its own aligned offset, bound once: a kernel that writes many
/// values then needs one binding for them, not one each, and so fits in one
/// dispatch where it took one per few dozen values (each dispatch costs a
/// software adapter more than the work of small values). The buffer goes
/// back to the pool when the last value in it is dropped.
struct Slab {
    buffer: wgpu::Buffer,
    class: u64,
    pool: Arc<Pool>,
}

impl Drop for Slab {
    fn drop(&mut self) {
        self.pool.give(self.class, self.buffer.clone());
    }
}

/// Values of at most this many bytes are packed into one slab per kernel.
/// Bounds what one small value still in use keeps alive (its whole slab: at
/// most 256 values of this size).
pub(crate) const PACK_MAX_BYTES: u64 = 4096;

impl GpuBuffer {
    /// The wgpu buffer and the value's offset in it, created now (from the
    /// pool) if it has none yet.
    fn raw(&self, gpu: &Gpu) -> Result<&Backing, String> {
        if let Some(b) = self.buffer.get() {
            return Ok(b);
        }
        let created = gpu.pooled(self.class)?;
        // Another thread may have created one meanwhile: then ours is freed.
        Ok(self.buffer.get_or_init(|| Backing {
            buffer: created,
            offset: 0,
            slab: None,
        }))
    }

    /// The slab this value is a range of, if it is one.
    fn slab(&self) -> Option<&Arc<Slab>> {
        self.buffer.get().and_then(|b| b.slab.as_ref())
    }

    /// Adds the fates this value depends on that are open or failed.
    pub(crate) fn lineage_into(&self, out: &mut Lineage) {
        if let Some(stamp) = &*lock(&self.stamp) {
            for f in &stamp.fates {
                if !f.settled_ok() && !out.iter().any(|o| Arc::ptr_eq(o, f)) {
                    out.push(f.clone());
                }
            }
        }
    }

    /// Records that the op running on this thread wrote this buffer under
    /// `fates`.
    pub(crate) fn stamp(&self, fates: Lineage) {
        let (op, location) = crate::error::current_op().unwrap_or(("<gpu>", Location::caller()));
        *lock(&self.stamp) = Some(Stamp {
            op,
            location,
            fates,
        });
    }

    /// `Err` naming the op that wrote this value if a batch it was made in
    /// failed, or if nothing ever wrote it (its contents would be whatever the
    /// pooled buffer held).
    pub(crate) fn check(&self) -> Result<(), String> {
        match &*lock(&self.stamp) {
            None => Err("the GPU buffer was never written (its producer did not run)".into()),
            Some(stamp) => match stamp.fates.iter().find_map(|f| f.failed.get()) {
                Some(message) => Err(format!(
                    "{} (recorded at {}) wrote this value in a GPU batch that failed: {message}",
                    stamp.op, stamp.location
                )),
                None => Ok(()),
            },
        }
    }

    fn binding(&self, gpu: &Gpu) -> Result<wgpu::BindingResource<'_>, String> {
        let b = self.raw(gpu)?;
        Ok(wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: &b.buffer,
            offset: b.offset,
            size: std::num::NonZeroU64::new(self.bytes),
        }))
    }
}

impl Drop for GpuBuffer {
    fn drop(&mut self) {
        // A range of a slab: the slab goes back when its last value does.
        if let Some(Backing {
            buffer, slab: None, ..
        }) = self.buffer.take()
        {
            self.pool.give(self.class, buffer);
        }
    }
}

/// Held by a recorded GPU node until it has been encoded (or skipped); when the
/// last one goes, the device has no more work coming and its batch is submitted
/// (the deferred work, a fusion group, stays open).
pub(crate) struct Pending(Arc<Gpu>);

impl Drop for Pending {
    fn drop(&mut self) {
        // AcqRel: the submitting thread sees every encoding that preceded the
        // decrements (they were made under the batch lock anyway).
        if self
            .0
            .pending
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel)
            == 1
        {
            // A failure to submit is kept in the batch's fate, which poisons
            // every value written in it; `wait_all` reports it too. The
            // deferred work stays open: it is encoded when something needs it
            // (a readback, a copy, another kernel, `wait_all`) or when it is
            // full, not whenever the workers happen to catch up with the
            // frontend, so it takes the same shape in every mode and run.
            let _ = self.0.submit_encoded();
        }
    }
}

struct Batch {
    encoder: Option<wgpu::CommandEncoder>,
    /// Staging memory for the small uploads of this batch (kernel info
    /// buffers, mostly), mapped until the batch is submitted.
    belt: Option<Belt>,
    /// The size of the next belt (see [`BELT_MIN`]).
    belt_next: u64,
    dispatches: usize,
    /// The fate of what is encoded into `encoder`.
    fate: Arc<Fate>,
    /// Which ops wrote in this batch, for the failure message.
    writers: Writers,
}

/// One mapped staging buffer that the small uploads of a batch share: a
/// kernel's info buffer used to cost a staging buffer of its own, and with
/// thousands of tensors alive the allocator's search for its memory grew with
/// them.
struct Belt {
    buffer: wgpu::Buffer,
    size: u64,
    used: u64,
}

/// Largest upload belt; uploads over a quarter of it get a staging buffer of
/// their own.
const BELT_BYTES: u64 = 256 << 10;
/// Smallest upload belt. A belt is sized by what the previous batch used: a
/// batch per op (a read after every op) needs a few hundred bytes, not a
/// quarter megabyte of mapped memory.
const BELT_MIN: u64 = 4 << 10;

/// The first few ops that wrote in a batch or group, and how many more.
#[derive(Default)]
pub(crate) struct Writers {
    first: SmallVec<[(&'static str, Location); 3]>,
    more: usize,
}

impl Writers {
    /// Notes the op running on this thread.
    pub(crate) fn note(&mut self) {
        let Some(op) = crate::error::current_op() else {
            return;
        };
        if self.first.iter().any(|w| w.0 == op.0 && w.1 == op.1) {
            return;
        }
        if self.first.len() < self.first.inline_size() {
            self.first.push(op);
        } else {
            self.more += 1;
        }
    }
}

impl std::fmt::Display for Writers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (op, location)) in self.first.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{op} (recorded at {location})")?;
        }
        if self.more > 0 {
            write!(f, " and {} more", self.more)?;
        }
        Ok(())
    }
}

/// One logical GPU device.
pub(crate) struct Gpu {
    pub(crate) info: GpuInfo,
    /// The adapter and driver, as the autotuner keys its choices.
    pub(crate) adapter: String,
    /// How kernels with several variants pick one.
    pub(crate) autotune: Autotune,
    device: wgpu::Device,
    queue: wgpu::Queue,
    batch: Mutex<Batch>,
    /// By kernel name and specialization (see [`KernelSource`]).
    pipelines: Mutex<HashMap<&'static str, HashMap<String, wgpu::ComputePipeline>>>,
    /// Largest storage buffer binding, in bytes (the adapter's real limit).
    pub(crate) max_binding: u64,
    /// Recorded GPU nodes not yet encoded (see [`Pending`]).
    pending: std::sync::atomic::AtomicUsize,
    pool: Arc<Pool>,
    /// Kernels dispatched so far (Relaxed: a statistic).
    pub(crate) dispatched: std::sync::atomic::AtomicU64,
    /// Tensor buffers given memory so far, from the pool or new (Relaxed: a
    /// statistic).
    pub(crate) buffers_backed: std::sync::atomic::AtomicU64,
    /// Pipelines compiled so far, i.e. misses of the pipeline cache (Relaxed:
    /// a statistic).
    pub(crate) compiled: std::sync::atomic::AtomicU64,
    /// Whether the tensor layer fuses elementwise ops on this device.
    pub(crate) fusion: bool,
    /// Deferred work of a layer above (see [`DeferredEncode`]), installed on
    /// first use. Lock order: `deferred`, then `batch`.
    deferred: Mutex<Option<Box<dyn DeferredEncode>>>,
    /// A slot for the layer above's frontend state of this device (its
    /// record-time batch), set on first use.
    pub(crate) frontend: OnceLock<Arc<dyn std::any::Any + Send + Sync>>,
    max_storage_buffers: usize,
    /// Alignment of a storage binding's offset, in bytes (and of a slab's
    /// ranges).
    storage_align: u64,
    /// Largest workgroup count of one dispatch dimension.
    max_workgroups: u32,
    /// Why the device is lost, once it is (shared with wgpu's callback).
    lost: Arc<OnceLock<String>>,
    /// How long a wait for the device may take before it counts as hung.
    timeout: Duration,
    /// Batch failures not yet reported by `wait_all`.
    failures: Mutex<Vec<String>>,
    /// A failure injected by a test (`GpuFault as u8 + 1`, 0 for none): one
    /// atomic load on the paths it can fail, no lock.
    fault: AtomicU8,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn backend_name(b: wgpu::Backend) -> &'static str {
    match b {
        wgpu::Backend::Vulkan => "vulkan",
        wgpu::Backend::Metal => "metal",
        wgpu::Backend::Dx12 => "dx12",
        wgpu::Backend::Gl => "gl",
        _ => "other",
    }
}

/// Parses `vulkan,metal,dx12,gl` (any case, `all` for all of them).
pub(crate) fn parse_backends(s: &str) -> Result<wgpu::Backends, String> {
    let mut out = wgpu::Backends::empty();
    for part in s.split(',').map(|p| p.trim().to_ascii_lowercase()) {
        out |= match part.as_str() {
            "" => continue,
            "all" => wgpu::Backends::all(),
            "vulkan" => wgpu::Backends::VULKAN,
            "metal" => wgpu::Backends::METAL,
            "dx12" => wgpu::Backends::DX12,
            "gl" => wgpu::Backends::GL,
            "none" => wgpu::Backends::empty(),
            other => {
                return Err(format!(
                    "unknown backend {other:?}: expected vulkan, metal, dx12, gl, all or none"
                ))
            }
        };
    }
    Ok(out)
}

/// Opens `logical` devices on every adapter of `backends`. An adapter seen
/// through several backends (lavapipe as Vulkan and as GL) is kept once, the
/// first of Vulkan, Metal, DX12, GL. Adapters that fail to open are skipped.
/// What the engine asks of every GPU device it opens.
#[derive(Clone, Debug)]
pub(crate) struct GpuOptions {
    /// Whether the tensor layer fuses elementwise ops.
    pub(crate) fusion: bool,
    /// How long a wait for the device may take before it counts as lost.
    pub(crate) timeout: Duration,
    /// How kernels with several variants pick one.
    pub(crate) autotune: Autotune,
}

pub(crate) fn discover(
    backends: wgpu::Backends,
    logical: usize,
    options: &GpuOptions,
) -> Vec<Arc<Gpu>> {
    if backends.is_empty() || logical == 0 {
        return Vec::new();
    }
    // With every backend allowed, GL is only asked when the primary backends
    // found nothing: the adapters GL reaches are seen through Vulkan too, and
    // starting GL without a display prints warnings on headless machines.
    let enumerate = |b: wgpu::Backends| {
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = b;
        let instance = wgpu::Instance::new(desc);
        pollster::block_on(instance.enumerate_adapters(b))
    };
    let mut adapters = if backends == wgpu::Backends::all() {
        let primary = enumerate(wgpu::Backends::PRIMARY);
        if primary.is_empty() {
            enumerate(wgpu::Backends::SECONDARY)
        } else {
            primary
        }
    } else {
        enumerate(backends)
    };
    let rank = |b: wgpu::Backend| match b {
        wgpu::Backend::Vulkan => 0,
        wgpu::Backend::Metal => 1,
        wgpu::Backend::Dx12 => 2,
        wgpu::Backend::Gl => 3,
        _ => 4,
    };
    adapters.sort_by_key(|a| rank(a.get_info().backend));
    let mut seen: Vec<(String, u32, u32)> = Vec::new();
    let mut gpus = Vec::new();
    for adapter in adapters {
        let info = adapter.get_info();
        let key = (info.name.clone(), info.vendor, info.device);
        if seen.contains(&key) {
            continue;
        }
        seen.push(key);
        for l in 0..logical {
            if let Ok(gpu) = Gpu::open(&adapter, l, options) {
                gpus.push(Arc::new(gpu));
            }
        }
    }
    gpus
}

impl Gpu {
    fn open(adapter: &wgpu::Adapter, logical: usize, options: &GpuOptions) -> Result<Gpu, String> {
        let ai = adapter.get_info();
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("lazyflow"),
            required_limits: limits.clone(),
            ..Default::default()
        }))
        .map_err(|e| e.to_string())?;
        // Errors outside an error scope must never panic the process.
        device.on_uncaptured_error(Arc::new(|e: wgpu::Error| {
            eprintln!("lazyflow: uncaptured GPU error: {e}");
        }));
        let lost = Arc::new(OnceLock::new());
        let on_lost = lost.clone();
        device.set_device_lost_callback(move |reason, message| {
            let _ = on_lost.set(format!("the device was lost ({reason:?}): {message}"));
        });
        let device_type = match ai.device_type {
            wgpu::DeviceType::DiscreteGpu => "discrete",
            wgpu::DeviceType::IntegratedGpu => "integrated",
            wgpu::DeviceType::VirtualGpu => "virtual",
            wgpu::DeviceType::Cpu => "cpu",
            _ => "other",
        };
        // The autotuner's key: choices hold for one adapter and driver.
        let adapter_key = format!(
            "{} ({}, {} {})",
            ai.name,
            backend_name(ai.backend),
            ai.driver,
            ai.driver_info
        );
        Ok(Gpu {
            adapter: adapter_key,
            autotune: options.autotune.clone(),
            info: GpuInfo {
                name: ai.name.clone(),
                backend: backend_name(ai.backend).to_string(),
                device_type: device_type.to_string(),
                logical,
            },
            device,
            queue,
            batch: Mutex::new(Batch {
                encoder: None,
                belt: None,
                belt_next: BELT_MIN,
                dispatches: 0,
                fate: Fate::new(),
                writers: Writers::default(),
            }),
            pipelines: Mutex::new(HashMap::default()),
            max_binding: limits
                .max_storage_buffer_binding_size
                .min(limits.max_buffer_size),
            pending: std::sync::atomic::AtomicUsize::new(0),
            pool: Arc::new(Pool {
                classes: Mutex::new(HashMap::default()),
            }),
            dispatched: std::sync::atomic::AtomicU64::new(0),
            buffers_backed: std::sync::atomic::AtomicU64::new(0),
            compiled: std::sync::atomic::AtomicU64::new(0),
            fusion: options.fusion,
            deferred: Mutex::new(None),
            frontend: OnceLock::new(),
            max_storage_buffers: limits.max_storage_buffers_per_shader_stage as usize,
            storage_align: u64::from(limits.min_storage_buffer_offset_alignment).max(4),
            max_workgroups: limits.max_compute_workgroups_per_dimension,
            lost,
            timeout: options.timeout,
            failures: Mutex::new(Vec::new()),
            fault: AtomicU8::new(0),
        })
    }

    /// Runs `f` inside validation and out-of-memory error scopes and turns a
    /// captured error into `Err`.
    fn scoped<R>(&self, f: impl FnOnce() -> R) -> Result<R, String> {
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let r = f();
        let oom = pollster::block_on(oom.pop());
        let validation = pollster::block_on(validation.pop());
        match oom.or(validation) {
            Some(e) => Err(e.to_string()),
            None => Ok(r),
        }
    }

    /// Counts a recorded node until it is encoded or dropped.
    pub(crate) fn expect_node(self: &Arc<Self>) -> Pending {
        self.pending
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Pending(self.clone())
    }

    /// Record-time check that `n` floats fit in one buffer; `Err` says why not.
    pub(crate) fn check_size(&self, n: usize) -> Result<(), String> {
        let bytes = (n as u64).saturating_mul(4);
        if bytes > self.max_binding {
            return Err(format!(
                "{bytes} bytes exceed the largest buffer of {} ({} bytes)",
                self.info.name, self.max_binding
            ));
        }
        Ok(())
    }

    /// A storage buffer for `n` floats, from the pool when one of its size class
    /// is free (its contents are undefined until a kernel or a copy writes them).
    pub(crate) fn alloc(&self, n: usize) -> Result<GpuBuffer, String> {
        let out = self.alloc_lazy(n)?;
        out.raw(self)?;
        Ok(out)
    }

    /// A buffer for `n` floats whose memory is taken from the pool (or
    /// created) only when something first binds, copies or reads it; one that
    /// is dropped before that never costs any.
    pub(crate) fn alloc_lazy(&self, n: usize) -> Result<GpuBuffer, String> {
        self.check_lost()?;
        let bytes = (n.max(1) * 4) as u64;
        if bytes > self.max_binding {
            return Err(format!(
                "{n} floats exceed the device's largest buffer ({} bytes)",
                self.max_binding
            ));
        }
        let class = self.class(bytes);
        Ok(GpuBuffer {
            buffer: std::sync::OnceLock::new(),
            stamp: Mutex::new(None),
            bytes,
            class,
            pool: self.pool.clone(),
        })
    }

    /// Gives each of `values` (none of which has memory yet) a range of one
    /// new slab, at offsets `stride` floats apart, aligned for binding;
    /// returns `stride`. A kernel then writes them all through one binding
    /// ([`Gpu::dispatch_packed`]).
    pub(crate) fn pack(&self, values: &[&GpuBuffer]) -> Result<u32, String> {
        if values.iter().any(|v| v.buffer.get().is_some()) {
            return Err("internal error: a value to pack already has memory".into());
        }
        let largest = values.iter().map(|v| v.bytes).max().unwrap_or(4);
        let stride = largest.next_multiple_of(self.storage_align);
        let total = stride * values.len() as u64;
        if total > self.max_binding {
            return Err(format!(
                "internal error: a slab of {total} bytes exceeds the largest binding"
            ));
        }
        let class = self.class(total);
        let buffer = self.pooled(class)?;
        let slab = Arc::new(Slab {
            buffer: buffer.clone(),
            class,
            pool: self.pool.clone(),
        });
        for (k, v) in values.iter().enumerate() {
            let backing = Backing {
                buffer: buffer.clone(),
                offset: k as u64 * stride,
                slab: Some(slab.clone()),
            };
            if v.buffer.set(backing).is_err() {
                return Err("internal error: a packed value was given memory meanwhile".into());
            }
        }
        Ok((stride / 4) as u32)
    }

    /// The pool's size class of a buffer of `bytes` (at most the largest
    /// binding, where a whole class would exceed it).
    fn class(&self, bytes: u64) -> u64 {
        let class = Pool::class(bytes);
        if class <= self.max_binding {
            class
        } else {
            bytes
        }
    }

    /// A buffer of `class` bytes from the pool, or a new one.
    fn pooled(&self, class: u64) -> Result<wgpu::Buffer, String> {
        self.buffers_backed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match self.pool.take(class) {
            Some(b) => Ok(b),
            None => self.scoped(|| {
                self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("lazyflow tensor"),
                    size: class,
                    usage: wgpu::BufferUsages::STORAGE
                        | wgpu::BufferUsages::COPY_SRC
                        | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                })
            }),
        }
    }

    /// A new buffer holding `data`, copied in through the open batch.
    pub(crate) fn upload(&self, data: &[f32]) -> Result<GpuBuffer, String> {
        self.injected(GpuFault::Upload)?;
        let out = self.alloc(data.len())?;
        if data.is_empty() {
            out.stamp(Lineage::new());
            return Ok(out);
        }
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let len = bytes.len() as u64;
        if len <= BELT_BYTES / 4 {
            let to = out.raw(self)?;
            let (to, to_at) = (&to.buffer, to.offset);
            let mut batch = lock(&self.batch);
            let at = self.belt_space(&mut batch, len)?;
            let Some(belt) = &batch.belt else {
                return Err("internal error: no upload belt".into());
            };
            match belt.buffer.slice(at..at + len).get_mapped_range_mut() {
                Ok(mut view) => view.copy_from_slice(bytes),
                Err(e) => return Err(e.to_string()),
            }
            let from = belt.buffer.clone();
            self.encoder(&mut batch)
                .copy_buffer_to_buffer(&from, at, to, to_at, len);
            out.stamp(SmallVec::from_elem(batch.fate.clone(), 1));
            batch.writers.note();
            return Ok(out);
        }
        let staging = self.scoped(|| {
            let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("lazyflow upload"),
                size: len,
                usage: wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: true,
            });
            let written = match staging.slice(..).get_mapped_range_mut() {
                Ok(mut view) => {
                    view.copy_from_slice(bytes);
                    Ok(())
                }
                Err(e) => Err(e.to_string()),
            };
            staging.unmap();
            written.map(|()| staging)
        })??;
        let mut batch = lock(&self.batch);
        let encoder = self.encoder(&mut batch);
        let to = out.raw(self)?;
        encoder.copy_buffer_to_buffer(&staging, 0, &to.buffer, to.offset, len);
        out.stamp(SmallVec::from_elem(batch.fate.clone(), 1));
        batch.writers.note();
        Ok(out)
    }

    /// The offset of `len` free bytes in the open batch's upload belt (a new
    /// belt when it has none or this does not fit: the full one is submitted
    /// with the batch like any staging buffer).
    fn belt_space(&self, batch: &mut Batch, len: u64) -> Result<u64, String> {
        // Mapped ranges start at multiples of 8 (wgpu's MAP_ALIGNMENT).
        let fits = |b: &Belt| b.used.next_multiple_of(8) + len <= b.size;
        if !batch.belt.as_ref().is_some_and(fits) {
            if let Some(full) = batch.belt.take() {
                // Its copies are encoded, and the buffer lives on in them
                // until the submit that runs them; unmapped now, as a
                // submission requires. The next one is twice the size.
                full.buffer.unmap();
                batch.belt_next = (full.size * 2).min(BELT_BYTES);
            }
            let size = batch
                .belt_next
                .max(len.next_power_of_two())
                .clamp(BELT_MIN, BELT_BYTES);
            let buffer = self.scoped(|| {
                self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("lazyflow upload belt"),
                    size,
                    usage: wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: true,
                })
            })?;
            batch.belt = Some(Belt {
                buffer,
                size,
                used: 0,
            });
        }
        let Some(belt) = batch.belt.as_mut() else {
            return Err("internal error: no upload belt".into());
        };
        let at = belt.used.next_multiple_of(8);
        belt.used = at + len;
        Ok(at)
    }

    /// Copies `n` floats out of `buffer`: submits the open batch (which holds
    /// every write to it) and waits for the copy.
    pub(crate) fn read(&self, buffer: &GpuBuffer, n: usize) -> Result<Vec<f32>, String> {
        self.check_lost()?;
        if n == 0 {
            return Ok(Vec::new());
        }
        self.encode_deferred()?;
        // Before the wait too: a value known to be bad is not worth waiting for.
        buffer.check()?;
        let size = (n * 4) as u64;
        let staging = self.scoped(|| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("lazyflow readback"),
                size,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        })?;
        let index = {
            let mut batch = lock(&self.batch);
            let encoder = self.encoder(&mut batch);
            let from = buffer.raw(self)?;
            encoder.copy_buffer_to_buffer(&from.buffer, from.offset, &staging, 0, size);
            self.submit_locked(&mut batch)?
        };
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.wait(index)?;
        // The submission (and every earlier one) finished: the value's fates
        // are final.
        buffer.check()?;
        match rx.recv_timeout(self.timeout) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e.to_string()),
            Err(_) => return Err("readback was never mapped".to_string()),
        }
        let view = staging.get_mapped_range(..).map_err(|e| e.to_string())?;
        let out: Vec<f32> = bytemuck::pod_collect_to_vec(&view);
        drop(view);
        staging.unmap();
        Ok(out)
    }

    /// Encodes one kernel after the deferred work. `bindings` are bound in
    /// order and `info` is uploaded as the last binding (none when it is
    /// empty).
    pub(crate) fn dispatch(
        &self,
        kernel: KernelSource,
        spec: &str,
        bindings: &[(&GpuBuffer, Access)],
        info: &[u32],
        grid: Grid,
    ) -> Result<(), String> {
        self.encode_deferred()?;
        self.dispatch_direct(kernel, spec, bindings, info, grid)
    }

    /// Times one variant of a kernel, for the autotuner: waits until the
    /// device is idle, then runs the dispatch `reps` times, each in a
    /// submission of its own, and returns the best wall time from submit to
    /// completion (compiling the pipeline is not timed). What it writes is
    /// scratch: the caller's real dispatch overwrites it.
    pub(crate) fn time_dispatch(
        &self,
        kernel: KernelSource,
        spec: &str,
        bindings: &[(&GpuBuffer, Access)],
        info: &[u32],
        grid: Grid,
        reps: usize,
    ) -> Result<Duration, String> {
        self.synchronize()?;
        let mut best = Duration::MAX;
        for _ in 0..reps.max(1) {
            self.dispatch_direct(kernel, spec, bindings, info, grid)?;
            let started = std::time::Instant::now();
            let index = self.submit_locked(&mut lock(&self.batch))?;
            self.wait(index)?;
            best = best.min(started.elapsed());
        }
        Ok(best)
    }

    /// Storage buffers one kernel may bind.
    pub(crate) fn max_bindings(&self) -> usize {
        self.max_storage_buffers
    }

    /// Runs `f` on the deferred work of type `T`, installing `T::default()` on
    /// first use, under the hook's lock (so `f` may encode it, but must not
    /// call [`Gpu::encode_deferred`] or [`Gpu::dispatch`]). One device holds
    /// deferred work of one type only.
    pub(crate) fn with_deferred<T: DeferredEncode + Default, R>(
        &self,
        f: impl FnOnce(&mut T) -> R,
    ) -> R {
        let mut slot = lock(&self.deferred);
        let work: &mut dyn std::any::Any =
            &mut **slot.get_or_insert_with(|| Box::new(T::default()));
        f(work
            .downcast_mut::<T>()
            .expect("a device holds deferred work of one type"))
    }

    /// Encodes the deferred work, so that what follows is ordered after it.
    /// Work that fails to encode fails its own outputs (through their fates),
    /// not the node that happened to trigger the encoding; this returns `Err`
    /// only when the device is lost.
    pub(crate) fn encode_deferred(&self) -> Result<(), String> {
        if let Some(work) = &mut *lock(&self.deferred) {
            work.encode(self);
        }
        self.check_lost()
    }

    /// Encodes one kernel without encoding the deferred work first (that work
    /// calls it under the hook's lock; others call [`Gpu::encode_deferred`]
    /// before taking locks of their own, then this). The written buffers are
    /// stamped with the batch they were encoded into and the open or failed
    /// fates of every bound buffer but those it overwrites.
    pub(crate) fn dispatch_direct(
        &self,
        kernel: KernelSource,
        spec: &str,
        bindings: &[(&GpuBuffer, Access)],
        info: &[u32],
        grid: Grid,
    ) -> Result<(), String> {
        self.dispatch_packed(kernel, spec, bindings, &[], info, grid)
    }

    /// [`Gpu::dispatch_direct`] for a kernel that also writes `packed`, the
    /// values of one slab (see [`Gpu::pack`]), bound as one binding after
    /// `bindings` (and before the info buffer).
    pub(crate) fn dispatch_packed(
        &self,
        kernel: KernelSource,
        spec: &str,
        bindings: &[(&GpuBuffer, Access)],
        packed: &[&GpuBuffer],
        info: &[u32],
        grid: Grid,
    ) -> Result<(), String> {
        self.check_lost()?;
        let mut lineage = Lineage::new();
        // An overwrite does not depend on the old value.
        for (b, access) in bindings {
            if *access != Access::Overwrite {
                b.lineage_into(&mut lineage);
            }
        }
        for b in packed {
            b.lineage_into(&mut lineage);
        }
        let written = || {
            bindings
                .iter()
                .filter(|(_, access)| *access != Access::Read)
                .map(|(b, _)| b)
                .chain(packed)
        };
        let Some((gx, gy, gz)) = grid.counts() else {
            for b in written() {
                b.stamp(lineage.clone());
            }
            return Ok(());
        };
        // An over-limit dispatch would invalidate the whole command buffer at
        // `finish`, failing every node encoded with it: refuse it here.
        if gx.max(gy).max(gz) > self.max_workgroups {
            return Err(format!(
                "{gx} x {gy} x {gz} workgroups exceed the device's limit of {} per dimension",
                self.max_workgroups
            ));
        }
        let pipeline = self.pipeline(kernel, spec)?;
        // No info binding when there is no info (user kernels).
        let info = if info.is_empty() {
            None
        } else {
            Some(self.upload(bytemuck::cast_slice(info))?)
        };
        // The upload may land in a batch that is submitted (and fails) before
        // the dispatch is encoded into the next one.
        if let Some(info) = &info {
            info.lineage_into(&mut lineage);
        }
        // A value read here that the kernel also writes (`a += a`), or that
        // shares a slab with one it writes, is read from a copy: wgpu refuses
        // one buffer bound read-only and read-write in the same dispatch.
        let written_too = |b: &GpuBuffer| {
            written().any(|w| {
                std::ptr::eq(*w, b)
                    || b.slab()
                        .is_some_and(|s| w.slab().is_some_and(|t| Arc::ptr_eq(s, t)))
            })
        };
        let mut copies: SmallVec<[(usize, GpuBuffer); 2]> = SmallVec::new();
        for (i, (b, access)) in bindings.iter().enumerate() {
            if *access == Access::Read && written_too(b) {
                copies.push((i, self.alloc((b.bytes / 4) as usize)?));
            }
        }
        let slab = match packed {
            [] => None,
            [first, ..] => {
                let Some(slab) = first.slab().cloned() else {
                    return Err("internal error: a packed value is not in a slab".into());
                };
                if packed
                    .iter()
                    .any(|v| !v.slab().is_some_and(|s| Arc::ptr_eq(s, &slab)))
                {
                    return Err("internal error: packed values of several slabs".into());
                }
                let end = packed
                    .iter()
                    .filter_map(|v| v.buffer.get().map(|b| b.offset + v.bytes))
                    .max()
                    .unwrap_or(0);
                Some((slab, end))
            }
        };
        let layout = self.scoped(|| pipeline.get_bind_group_layout(0))?;
        let mut entries: Vec<wgpu::BindGroupEntry> = Vec::with_capacity(bindings.len() + 2);
        for (i, (b, _)) in bindings.iter().enumerate() {
            let b = copies
                .iter()
                .find(|(at, _)| *at == i)
                .map_or(*b, |(_, copy)| copy);
            entries.push(wgpu::BindGroupEntry {
                binding: entries.len() as u32,
                resource: b.binding(self)?,
            });
        }
        if let Some((slab, end)) = &slab {
            entries.push(wgpu::BindGroupEntry {
                binding: entries.len() as u32,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &slab.buffer,
                    offset: 0,
                    size: std::num::NonZeroU64::new(*end),
                }),
            });
        }
        if let Some(info) = &info {
            entries.push(wgpu::BindGroupEntry {
                binding: entries.len() as u32,
                resource: info.binding(self)?,
            });
        }
        let bind_group = self.scoped(|| {
            self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &layout,
                entries: &entries,
            })
        })?;
        let mut batch = lock(&self.batch);
        {
            let encoder = self.encoder(&mut batch);
            for (i, copy) in &copies {
                let (from, to) = (bindings[*i].0.raw(self)?, copy.raw(self)?);
                encoder.copy_buffer_to_buffer(
                    &from.buffer,
                    from.offset,
                    &to.buffer,
                    to.offset,
                    copy.bytes,
                );
            }
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &bind_group, &[]);
            pass.dispatch_workgroups(gx, gy, gz);
        }
        if !lineage.iter().any(|f| Arc::ptr_eq(f, &batch.fate)) {
            lineage.push(batch.fate.clone());
        }
        batch.writers.note();
        for b in written() {
            b.stamp(lineage.clone());
        }
        batch.dispatches += 1;
        self.dispatched
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if batch.dispatches >= BATCH_LIMIT {
            self.submit_locked(&mut batch)?;
        }
        Ok(())
    }

    /// Copies `size` bytes between buffers, in order with the batch.
    pub(crate) fn copy(&self, src: &GpuBuffer, dst: &GpuBuffer, size: u64) -> Result<(), String> {
        self.check_lost()?;
        let mut lineage = Lineage::new();
        src.lineage_into(&mut lineage);
        if size == 0 {
            dst.stamp(lineage);
            return Ok(());
        }
        self.encode_deferred()?;
        let (from, to) = (src.raw(self)?, dst.raw(self)?);
        let mut batch = lock(&self.batch);
        self.encoder(&mut batch).copy_buffer_to_buffer(
            &from.buffer,
            from.offset,
            &to.buffer,
            to.offset,
            size,
        );
        lineage.push(batch.fate.clone());
        batch.writers.note();
        dst.stamp(lineage);
        Ok(())
    }

    fn pipeline(&self, kernel: KernelSource, spec: &str) -> Result<wgpu::ComputePipeline, String> {
        self.injected(GpuFault::Pipeline)?;
        // Looked up by `&str`: a fused kernel's specialization is its whole
        // source, not worth copying on every hit.
        if let Some(p) = lock(&self.pipelines)
            .get(kernel.name)
            .and_then(|by_spec| by_spec.get(spec))
        {
            return Ok(p.clone());
        }
        let source = kernel.wgsl(spec);
        self.compiled
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pipeline = self.scoped(|| {
            let module = self
                .device
                .create_shader_module(wgpu::ShaderModuleDescriptor {
                    label: Some(kernel.name),
                    source: wgpu::ShaderSource::Wgsl(source.into()),
                });
            self.device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(kernel.name),
                    layout: None,
                    module: &module,
                    entry_point: Some("main"),
                    compilation_options: Default::default(),
                    cache: None,
                })
        })?;
        lock(&self.pipelines)
            .entry(kernel.name)
            .or_default()
            .insert(spec.to_string(), pipeline.clone());
        Ok(pipeline)
    }

    fn encoder<'b>(&self, batch: &'b mut Batch) -> &'b mut wgpu::CommandEncoder {
        batch.encoder.get_or_insert_with(|| {
            self.device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("lazyflow batch"),
                })
        })
    }

    fn submit_locked(&self, batch: &mut Batch) -> Result<Option<wgpu::SubmissionIndex>, String> {
        batch.dispatches = 0;
        // The belt's copies are in this batch: a mapped buffer cannot be used
        // by a submission.
        if let Some(belt) = batch.belt.take() {
            belt.buffer.unmap();
            batch.belt_next = (belt.used * 2)
                .next_power_of_two()
                .clamp(BELT_MIN, BELT_BYTES);
        }
        let Some(encoder) = batch.encoder.take() else {
            return Ok(None);
        };
        let fate = std::mem::replace(&mut batch.fate, Fate::new());
        let writers = std::mem::take(&mut batch.writers);
        let submitted = self.check_lost().and_then(|()| {
            self.injected(GpuFault::Submit)?;
            self.scoped(|| self.queue.submit([encoder.finish()]))
        });
        match submitted {
            Ok(index) => {
                fate.settle();
                Ok(Some(index))
            }
            Err(e) => {
                let message = format!(
                    "submitting the command buffer that held the work of {writers} failed: {e}"
                );
                fate.fail(message.clone());
                self.note_failure(message.clone());
                Err(message)
            }
        }
    }

    /// Submits what the open batch holds, if anything, so that its work
    /// starts (the deferred work stays open).
    pub(crate) fn submit_encoded(&self) -> Result<(), String> {
        self.submit_locked(&mut lock(&self.batch)).map(|_| ())
    }

    /// Submits the open batch and waits until the device has finished
    /// everything. A failed submission is not an error here: it is in the
    /// fates of the values written in it, and in [`Gpu::take_failures`].
    pub(crate) fn synchronize(&self) -> Result<(), String> {
        self.encode_deferred()?;
        if let Ok(index) = self.submit_locked(&mut lock(&self.batch)) {
            self.wait(index)?;
        }
        self.check_lost()
    }

    /// The batch failures since the last call (for `wait_all`).
    pub(crate) fn take_failures(&self) -> Result<(), String> {
        let failures = std::mem::take(&mut *lock(&self.failures));
        match failures.len() {
            0 => Ok(()),
            1 => Err(failures.into_iter().next().unwrap_or_default()),
            n => Err(format!("{n} GPU batches failed: {}", failures.join("; "))),
        }
    }

    /// Waits for a submission (all of them with `None`), at most the engine's
    /// GPU timeout; a device that takes longer counts as lost.
    fn wait(&self, index: Option<wgpu::SubmissionIndex>) -> Result<(), String> {
        self.check_lost()?;
        let polled = match self.injected(GpuFault::Hang) {
            Err(_) => Err(wgpu::PollError::Timeout),
            Ok(()) => self.device.poll(wgpu::PollType::Wait {
                submission_index: index,
                timeout: Some(self.timeout),
            }),
        };
        match polled {
            Ok(_) => self.check_lost(),
            Err(wgpu::PollError::Timeout) => {
                let message = format!(
                    "the device did not finish its work within {:?} (the engine's GPU timeout); it is treated as lost",
                    self.timeout
                );
                let _ = self.lost.set(message.clone());
                Err(message)
            }
            Err(e) => Err(e.to_string()),
        }
    }

    /// `Err` once the device is lost (nothing on it can be trusted or waited for).
    pub(crate) fn check_lost(&self) -> Result<(), String> {
        match self.lost.get() {
            Some(why) => Err(format!("{}: {why}", self.info.name)),
            None => Ok(()),
        }
    }

    /// Keeps a batch failure for the next `wait_all`.
    pub(crate) fn note_failure(&self, message: String) {
        lock(&self.failures).push(message);
    }

    /// Arms a failure injected by a test.
    pub(crate) fn inject(&self, fault: GpuFault) {
        if fault == GpuFault::Lose {
            let _ = self
                .lost
                .set("the device was lost (destroyed by an injected fault)".to_string());
            self.device.destroy();
            return;
        }
        self.fault.store(fault as u8 + 1, Ordering::Release);
    }

    /// `Err` if `point` is the armed injected failure (which it disarms).
    #[inline]
    fn injected(&self, point: GpuFault) -> Result<(), String> {
        if self.fault.load(Ordering::Relaxed) == 0 {
            return Ok(());
        }
        let armed = point as u8 + 1;
        match self
            .fault
            .compare_exchange(armed, 0, Ordering::AcqRel, Ordering::Relaxed)
        {
            Ok(_) => Err(format!("injected {point:?} failure")),
            Err(_) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Pool;

    #[test]
    fn the_pool_keeps_many_small_buffers_and_few_large_ones() {
        // 64 MiB of idle buffers per class, between 4 and 65,536 of them.
        assert_eq!(Pool::keep(256), 65_536);
        assert_eq!(Pool::keep(1 << 20), 64);
        assert_eq!(Pool::keep(64 << 20), 4);
        assert_eq!(Pool::keep(1 << 30), 4);
    }
}
