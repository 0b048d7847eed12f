//! # lazyflow
//!
//! An asynchronous dependency engine in the spirit of MXNet's (as taught in *Dive
//! into Deep Learning*, chapter 13): frontend calls record nodes into a dependency
//! DAG and return at once; a work-stealing pool runs them when something needs
//! their results.
//!
//! - Dependencies come from data access: every node declares the [`Var`]s it reads
//!   and writes, and runs after exactly the earlier accesses it conflicts with.
//! - Reading a value ([`Var::wait_to_read`], [`Tensor::to_vec`], [`Tensor::item`],
//!   printing a tensor) is a *blocker*: it runs only the subgraph that value needs.
//!   [`Engine::wait_all`] is the global barrier.
//! - [`Mode::Lazy`] (default) runs nodes only when demanded; [`Mode::Async`]
//!   demands each node as it is recorded; [`Mode::Sync`] finishes each call before
//!   it returns. `LAZYFLOW_MODE=lazy|async|sync` picks one from the environment.
//! - When the frontend runs ahead, recording stalls at a bound on unfinished nodes
//!   (backpressure), so memory stays bounded.
//! - A failing node poisons what it writes; dependents are skipped, other work goes
//!   on, and the next blocker on an affected value returns the error, naming the
//!   op and where it was recorded.
//! - Reverse-mode autodiff on a tape beside the tensors: [`Tensor::backward`]
//!   records the gradient ops and returns at once ([`no_grad`] records without a
//!   tape). [`nn`] has the layers of a small CNN (the book's LeNet included),
//!   [`data`] reads Fashion-MNIST, and [`train`] trains data-parallel over
//!   several devices with the book's training function.
//!
//! ```
//! use lazyflow::{Engine, Tensor};
//! let engine = Engine::builder().workers(2).build().unwrap();
//! let x = Tensor::arange_in(&engine, 0.0, 6.0, 1.0).reshape([2, 3]).unwrap();
//! let w = Tensor::ones_in(&engine, [3, 2]);
//! let y = (x.matmul(&w).unwrap() + 1.0).relu();
//! assert_eq!(y.to_vec().unwrap(), vec![4.0, 4.0, 13.0, 13.0]);
//! ```
#![deny(missing_docs, unsafe_op_in_unsafe_fn)]
#![deny(unsafe_code)]

mod benchmark;
pub mod data;
mod device;
pub mod dist;
mod engine;
mod error;
// The module with `unsafe`: the lock-free lists of dependents, the node's
// job reached without a lock, and the node's own count with the pool its
// memory goes back to (see `graph/mod.rs`). The only others are a node's
// small closure kept in place and a spent job's box written over by the
// next closure (`engine/job.rs`), a dead
// Var's memory kept for the next Var of its size (`var/pool.rs`), and the
// calls into mimalloc for the memory of nodes and Var storages (`mem.rs`).
// Everything else is safe code.
#[allow(unsafe_code)]
mod graph;
#[allow(unsafe_code)]
mod mem;
pub mod nn;
mod sched;
mod sync;
mod task;
pub mod tensor;
pub mod train;
mod var;

pub use benchmark::Benchmark;
pub use device::Device;
#[doc(hidden)]
pub use device::GpuFault;
pub use device::{TuneSource, TunedKernel};
pub use engine::{
    Completion, Engine, EngineBuilder, Mode, Stats, DEFAULT_GPU_TIMEOUT, DEFAULT_HIGH_WATERMARK,
    DEFAULT_LOW_WATERMARK,
};
pub use error::{Error, Location, Result};
pub use task::{TaskBuilder, TaskHandle};
pub use tensor::{
    matmul_class, matmul_kernels, no_grad, KernelBuilder, NoGrad, PoolKind, Reduction, Shape,
    Tensor, CPU_BATCH_MAX,
};
pub use var::{Read, ReadGuard, Var, Write, WriteGuard};

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
