//! The MPI transport (cargo feature `mpi`): one rank of `MPI_COMM_WORLD`,
//! driven by the communication thread, which initializes MPI and makes every
//! MPI call (`MPI_THREAD_FUNNELED`).
//!
//! Headers go point to point (small messages, sent eagerly), and are received
//! by polling `MPI_Iprobe` until a deadline, so a rank that never arrives is
//! named instead of waited for. The data then goes through MPI's own
//! collectives: by then every rank has announced the same step and size.

use super::backend::{CommFailure, Transport};
use crate::error::{Error, Result};
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::point_to_point::{Destination, Source};
use mpi::topology::{Communicator, Rank, SimpleCommunicator};
use mpi::traits::{CommunicatorCollectives, Root};
use mpi::Threading;
use std::time::{Duration, Instant};

/// The tag of header messages (collectives do not use tags).
const HEADER_TAG: i32 = 0x6c66;

pub(crate) struct Mpi {
    world: SimpleCommunicator,
    // Dropped last: finalizes MPI.
    _universe: Universe,
    library: String,
}

impl Mpi {
    /// Initializes MPI on the calling thread.
    pub(crate) fn init() -> Result<Mpi> {
        let (universe, _level) = mpi::initialize_with_threading(Threading::Funneled)
            .ok_or_else(|| Error::Config("MPI was initialized already".into()))?;
        let world = universe.world();
        let library = mpi::environment::library_version()
            .ok()
            .and_then(|v| v.split(',').next().map(|s| s.trim().to_string()))
            .unwrap_or_else(|| "MPI".into());
        Ok(Mpi {
            world,
            _universe: universe,
            library,
        })
    }
}

impl Transport for Mpi {
    fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    fn size(&self) -> usize {
        self.world.size() as usize
    }

    fn exchange(
        &mut self,
        mine: &[u8],
        deadline: Instant,
    ) -> std::result::Result<Vec<Vec<u8>>, CommFailure> {
        let me = self.rank();
        let n = self.size();
        for r in (0..n).filter(|&r| r != me) {
            self.world
                .process_at_rank(r as Rank)
                .send_with_tag(mine, HEADER_TAG);
        }
        let mut got: Vec<Option<Vec<u8>>> = (0..n).map(|_| None).collect();
        got[me] = Some(mine.to_vec());
        let mut nap = Duration::from_micros(5);
        loop {
            let mut missing = Vec::new();
            for (r, slot) in got.iter_mut().enumerate() {
                if slot.is_some() {
                    continue;
                }
                let source = self.world.process_at_rank(r as Rank);
                if source.immediate_probe_with_tag(HEADER_TAG).is_some() {
                    let (bytes, _status) = source.receive_vec_with_tag::<u8>(HEADER_TAG);
                    *slot = Some(bytes);
                } else {
                    missing.push(r);
                }
            }
            if missing.is_empty() {
                return Ok(got.into_iter().map(Option::unwrap_or_default).collect());
            }
            if Instant::now() >= deadline {
                return Err(CommFailure::Missing(missing));
            }
            // Poll fast at first (the others are usually there), then back
            // off so a long wait does not burn a core.
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_micros(200));
        }
    }

    fn allreduce_sum(&mut self, data: &mut [f32]) -> std::result::Result<(), CommFailure> {
        let send = data.to_vec();
        self.world
            .all_reduce_into(&send[..], data, SystemOperation::sum());
        Ok(())
    }

    fn reduce_sum(
        &mut self,
        data: &mut [f32],
        root: usize,
    ) -> std::result::Result<(), CommFailure> {
        let process = self.world.process_at_rank(root as Rank);
        let send = data.to_vec();
        if self.rank() == root {
            process.reduce_into_root(&send[..], data, SystemOperation::sum());
        } else {
            process.reduce_into(&send[..], SystemOperation::sum());
        }
        Ok(())
    }

    fn broadcast(&mut self, data: &mut [f32], root: usize) -> std::result::Result<(), CommFailure> {
        self.world
            .process_at_rank(root as Rank)
            .broadcast_into(data);
        Ok(())
    }

    fn abort(&mut self, code: i32) {
        self.world.abort(code);
    }

    fn name(&self) -> String {
        format!("MPI ({}), {} ranks", self.library, self.size())
    }
}
