//! What a transport between processes must do, and the in-process transport:
//! ranks as threads of one process (one rank alone is a single process).

// std's primitives, not `crate::sync`: this is no engine protocol, and the
// loom models do not reach it.
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

/// Why a message exchange failed.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum CommFailure {
    /// These ranks sent nothing before the deadline.
    Missing(Vec<usize>),
}

/// A transport between `size` ranks, driven by one thread (the communication
/// thread of each rank). Every rank calls the same operations in the same
/// order; the header exchange before each collective checks that they do.
pub(crate) trait Transport {
    /// This process's rank.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn size(&self) -> usize;
    /// Sends `mine` to every other rank and receives one message from each
    /// (index = rank; this rank's entry is `mine`), waiting until `deadline`
    /// at most. Only for small messages (headers, descriptions).
    fn exchange(
        &mut self,
        mine: &[u8],
        deadline: Instant,
    ) -> std::result::Result<Vec<Vec<u8>>, CommFailure>;
    /// Sums `data` element-wise over all ranks, in place on every rank.
    fn allreduce_sum(&mut self, data: &mut [f32]) -> std::result::Result<(), CommFailure>;
    /// Sums `data` over all ranks into `root`'s `data` (the others' is left
    /// as it was).
    fn reduce_sum(&mut self, data: &mut [f32], root: usize)
        -> std::result::Result<(), CommFailure>;
    /// Copies `root`'s `data` into every rank's.
    fn broadcast(&mut self, data: &mut [f32], root: usize) -> std::result::Result<(), CommFailure>;
    /// Ends the whole job after a failure that may leave other ranks waiting
    /// (MPI: `MPI_Abort`); the in-process transport has nothing to end.
    fn abort(&mut self, _code: i32) {}
    /// The transport's name, for reports.
    fn name(&self) -> String;
}

/// Mailboxes of an in-process group: `boxes[to][from]`.
struct Board {
    boxes: Vec<Vec<VecDeque<Vec<u8>>>>,
}

/// One rank of a group of ranks living in one process (threads), or a single
/// process alone. Collectives go through the same mailboxes as headers, and
/// sum in rank order, so every rank gets bit-identical results.
pub(crate) struct Local {
    rank: usize,
    board: Arc<(Mutex<Board>, Condvar)>,
    size: usize,
}

impl Local {
    /// `size` ranks sharing one board.
    pub(crate) fn group(size: usize) -> Vec<Local> {
        let board = Arc::new((
            Mutex::new(Board {
                boxes: vec![vec![VecDeque::new(); size]; size],
            }),
            Condvar::new(),
        ));
        (0..size)
            .map(|rank| Local {
                rank,
                board: board.clone(),
                size,
            })
            .collect()
    }

    fn send(&self, to: usize, msg: Vec<u8>) {
        let (m, cv) = &*self.board;
        lock(m).boxes[to][self.rank].push_back(msg);
        cv.notify_all();
    }

    /// Receives one message from each of `from` (in that order), or names the
    /// ranks that sent nothing by `deadline`.
    fn receive(
        &self,
        from: &[usize],
        deadline: Instant,
    ) -> std::result::Result<Vec<Vec<u8>>, CommFailure> {
        let (m, cv) = &*self.board;
        let mut board = lock(m);
        loop {
            let missing: Vec<usize> = from
                .iter()
                .copied()
                .filter(|&r| board.boxes[self.rank][r].is_empty())
                .collect();
            if missing.is_empty() {
                return Ok(from
                    .iter()
                    .map(|&r| board.boxes[self.rank][r].pop_front().unwrap_or_default())
                    .collect());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommFailure::Missing(missing));
            }
            board = match cv.wait_timeout(board, deadline - now) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }

    fn others(&self) -> Vec<usize> {
        (0..self.size).filter(|&r| r != self.rank).collect()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn to_bytes(data: &[f32]) -> Vec<u8> {
    data.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn add_bytes(acc: &mut [f32], bytes: &[u8]) {
    for (a, b) in acc.iter_mut().zip(bytes.chunks_exact(4)) {
        *a += f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// How long a collective's data may take once every rank's header arrived
/// (the in-process group; MPI's collectives have no deadline of their own).
const DATA_WAIT: std::time::Duration = std::time::Duration::from_secs(600);

impl Transport for Local {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn exchange(
        &mut self,
        mine: &[u8],
        deadline: Instant,
    ) -> std::result::Result<Vec<Vec<u8>>, CommFailure> {
        let others = self.others();
        for &r in &others {
            self.send(r, mine.to_vec());
        }
        let mut got = self.receive(&others, deadline)?.into_iter();
        Ok((0..self.size)
            .map(|r| {
                if r == self.rank {
                    mine.to_vec()
                } else {
                    got.next().unwrap_or_default()
                }
            })
            .collect())
    }

    fn allreduce_sum(&mut self, data: &mut [f32]) -> std::result::Result<(), CommFailure> {
        let all = self.exchange(&to_bytes(data), Instant::now() + DATA_WAIT)?;
        // Rank order on every rank: the same sum, bit for bit.
        data.fill(0.0);
        for part in &all {
            add_bytes(data, part);
        }
        Ok(())
    }

    fn reduce_sum(
        &mut self,
        data: &mut [f32],
        root: usize,
    ) -> std::result::Result<(), CommFailure> {
        let deadline = Instant::now() + DATA_WAIT;
        if self.rank == root {
            let others = self.others();
            let got = self.receive(&others, deadline)?;
            let mine = data.to_vec();
            data.fill(0.0);
            let mut got = got.into_iter();
            for r in 0..self.size {
                if r == root {
                    for (a, b) in data.iter_mut().zip(&mine) {
                        *a += b;
                    }
                } else {
                    add_bytes(data, &got.next().unwrap_or_default());
                }
            }
        } else {
            self.send(root, to_bytes(data));
        }
        Ok(())
    }

    fn broadcast(&mut self, data: &mut [f32], root: usize) -> std::result::Result<(), CommFailure> {
        if self.rank == root {
            let bytes = to_bytes(data);
            for r in self.others() {
                self.send(r, bytes.clone());
            }
        } else {
            let got = self.receive(&[root], Instant::now() + DATA_WAIT)?;
            data.fill(0.0);
            add_bytes(data, &got[0]);
        }
        Ok(())
    }

    fn name(&self) -> String {
        if self.size == 1 {
            "single process".into()
        } else {
            format!("{} ranks in one process", self.size)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn on_threads<T: Send + 'static>(
        size: usize,
        f: impl Fn(Local) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let f = Arc::new(f);
        let handles: Vec<_> = Local::group(size)
            .into_iter()
            .map(|l| {
                let f = f.clone();
                std::thread::spawn(move || f(l))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn collectives_agree_with_a_sum_by_hand() {
        let out = on_threads(3, |mut l| {
            let r = l.rank() as f32;
            let mut a = vec![r, 10.0 * r];
            l.allreduce_sum(&mut a).unwrap();
            let mut b = vec![r + 1.0];
            l.reduce_sum(&mut b, 1).unwrap();
            let mut c = vec![r; 2];
            l.broadcast(&mut c, 2).unwrap();
            (a, b, c)
        });
        for (rank, (a, b, c)) in out.iter().enumerate() {
            assert_eq!(a, &vec![3.0, 30.0]);
            assert_eq!(b, &vec![if rank == 1 { 6.0 } else { rank as f32 + 1.0 }]);
            assert_eq!(c, &vec![2.0, 2.0]);
        }
    }

    #[test]
    fn an_exchange_names_the_ranks_that_sent_nothing() {
        let mut group = Local::group(3);
        let mut zero = group.remove(0);
        // Rank 1 takes part, rank 2 never does.
        group[0].send(0, b"one".to_vec());
        let err = zero
            .exchange(b"zero", Instant::now() + Duration::from_millis(20))
            .unwrap_err();
        assert_eq!(err, CommFailure::Missing(vec![2]));
    }
}
