//! A node's list of dependents: the nodes that wait for it, by address, in
//! slots of the node's own, in the order they joined (a few in the node,
//! then chunks, the first few kept with the node for its next record).
//!
//! A recorder joins with one `fetch_add` on the count of claimed slots, then
//! fills the slot it claimed with a compare-and-swap. The completion closes
//! the list with one `fetch_or` (the count tells it how many slots were
//! claimed), then marks each claimed slot still empty as passed: the
//! recorder whose compare-and-swap then fails counts the dependency out
//! itself, as one that finds the list closed does. One of the two sees the
//! other, so each dependent's unit is removed exactly once.
//!
//! Why slots and not a stack of links kept in the dependents (a Treiber
//! stack, as before): the completion walked that stack link by link, and each
//! link was in another node that the recorder had just written, so every
//! step waited for a cache miss that the next one depended on (90% of
//! `graph::complete` in `many_reads`, about 23 dependents a node). Slots lie
//! side by side, so the completion reads them at the speed of its memory and
//! can prefetch every dependent's count before it touches the first.

use crate::sync::{AtomicPtr, AtomicU32, AtomicUsize, Ordering};
use std::ptr::null_mut;

/// Slots in the node itself: most nodes have one or two dependents.
pub(super) const INLINE: usize = 4;

/// Slots of a chunk past those (a chunk is 256 bytes).
const CHUNK: usize = 29;

/// Chunks a list keeps when its node is filled again: a node that once had
/// thousands of dependents (a Var read by every op) does not keep their room.
const KEPT_CHUNKS: usize = 2;

/// Set in [`Dependents::len`] once the list is closed.
const CLOSED: u32 = 1 << 31;

/// A slot nothing filled yet.
const EMPTY: usize = 0;

/// A slot the completion passed before its recorder filled it. No node has
/// this address, with or without the read bit (node addresses are aligned).
const PASSED: usize = 2;

/// Slots past the node's own: [`CHUNK`] of them from index `base` (counted
/// past the node's own).
struct Chunk {
    next: AtomicPtr<Chunk>,
    base: usize,
    /// In the first chunk only: the last chunk made, where a joiner looks
    /// first (joins claim slots in order). Without it, a node read by
    /// thousands of later nodes cost each joiner a walk of the whole chain.
    /// Kept here, not in the node: with it there (and four links in place
    /// instead of two), a node took 328 bytes, past the 320-byte block it
    /// fits in, and `tree` ran 13% slower.
    tail: AtomicPtr<Chunk>,
    slots: [AtomicUsize; CHUNK],
}

/// See the module's comment. `repr(C)`: the count and the node's own
/// slots first, on the line a recorder touches anyway (see `Node`).
#[repr(C)]
pub(super) struct Dependents {
    /// Slots claimed, with [`CLOSED`] set once the list is closed (claims
    /// that find it closed still raise it, but fill no slot).
    len: AtomicU32,
    inline: [AtomicUsize; INLINE],
    more: AtomicPtr<Chunk>,
}

impl Dependents {
    /// A closed list (a node not recorded yet, as if finished).
    pub(super) fn closed() -> Self {
        Dependents {
            len: AtomicU32::new(CLOSED),
            inline: std::array::from_fn(|_| AtomicUsize::new(EMPTY)),
            more: AtomicPtr::new(null_mut()),
        }
    }

    /// Whether the list is closed (Relaxed: for assertions).
    pub(super) fn is_closed(&self) -> bool {
        self.len.load(Ordering::Relaxed) & CLOSED != 0
    }

    /// Opens a closed list for a new record of its node, which nothing else
    /// reaches (no recorder is between its claim and its slot: each holds the
    /// node through the dependencies of the node it records).
    #[inline]
    pub(super) fn reopen(&mut self) {
        debug_assert!(self.is_closed());
        // At most this many slots were filled or passed (late claims, which
        // found the list closed, count too: their slots are empty already,
        // and have no chunk if none was made for them).
        let n = self.len.load(Ordering::Relaxed) & !CLOSED;
        self.for_each_slot(n, false, |s| s.store(EMPTY, Ordering::Relaxed));
        if n as usize > INLINE + KEPT_CHUNKS * CHUNK {
            free_after(&self.more, KEPT_CHUNKS);
            let first = self.more.load(Ordering::Relaxed);
            // SAFETY: a kept chunk, if any.
            if let Some(f) = unsafe { first.as_ref() } {
                f.tail.store(first, Ordering::Relaxed);
            }
        }
        self.len.store(0, Ordering::Relaxed);
    }

    /// Joins the list with `value` (a node's address, with its read bit).
    /// Returns false if the list closed first: the node finished, and the
    /// caller counts it out. `before` runs once the join may succeed,
    /// before the slot is filled (the joiner's node must be kept alive by
    /// then: the completion may release it as soon as the slot is filled).
    ///
    /// Acquire on the count and on a failed fill: a joiner that finds the
    /// list closed, or its slot passed, sees what the completion stored
    /// before it closed the list (the node's failure).
    #[inline]
    pub(super) fn join(&self, value: usize, before: impl FnOnce()) -> bool {
        debug_assert!(value != EMPTY && value != PASSED);
        // A load first: a finished node is named by many later records, and
        // a load leaves its line shared where an add would take it.
        if self.len.load(Ordering::Acquire) & CLOSED != 0 {
            return false;
        }
        let i = self.len.fetch_add(1, Ordering::Acquire);
        if i & CLOSED != 0 {
            return false;
        }
        before();
        // Release: the completion that reads the slot sees the joiner's node
        // as filled.
        self.slot(i as usize)
            .compare_exchange(EMPTY, value, Ordering::Release, Ordering::Acquire)
            .is_ok()
    }

    /// Closes the list: no node joins it after this. Returns how many slots
    /// were claimed, for [`Dependents::settle`] and [`Dependents::each`].
    /// AcqRel: whoever finds it closed sees what this thread stored before.
    #[inline]
    pub(super) fn close(&self) -> u32 {
        self.len.fetch_or(CLOSED, Ordering::AcqRel) & !CLOSED
    }

    /// After [`Dependents::close`] returned `n`: marks each of the `n` slots
    /// not filled yet as passed (its recorder counts the dependency out) and
    /// calls `f` with every other, in join order. Once only.
    #[inline]
    pub(super) fn settle(&self, n: u32, mut f: impl FnMut(usize)) {
        self.for_each_slot(n, true, |slot| {
            let mut v = slot.load(Ordering::Acquire);
            if v == EMPTY {
                match slot.compare_exchange(EMPTY, PASSED, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return,
                    Err(now) => v = now,
                }
            }
            f(v);
        });
    }

    /// After [`Dependents::settle`]: calls `f` with each filled slot of the
    /// first `n`, in join order.
    #[inline]
    pub(super) fn each(&self, n: u32, mut f: impl FnMut(usize)) {
        self.for_each_slot(n, true, |slot| {
            let v = slot.load(Ordering::Relaxed);
            if v != PASSED {
                f(v);
            }
        });
    }

    /// Calls `f` with the first `n` slots in order, making the chunks they
    /// need if `make` (else stopping at the first chunk not made: its slots
    /// were never claimed).
    #[inline(always)]
    fn for_each_slot(&self, n: u32, make: bool, mut f: impl FnMut(&AtomicUsize)) {
        let n = n as usize;
        if n <= INLINE {
            // Most lists: no chunk to look for.
            for s in &self.inline[..n] {
                f(s);
            }
            return;
        }
        for s in &self.inline {
            f(s);
        }
        let (mut link, mut base) = (&self.more, 0);
        while base + INLINE < n {
            let chunk = if make {
                self.chunk_at(link, base)
            } else {
                // SAFETY: a chunk of this list (see `chunk_at`).
                match unsafe { link.load(Ordering::Relaxed).as_ref() } {
                    Some(chunk) => chunk,
                    None => return,
                }
            };
            chunk.slots.iter().take(n - INLINE - base).for_each(&mut f);
            link = &chunk.next;
            base += CHUNK;
        }
    }

    /// Slot `i`, making the chunks it needs.
    #[inline]
    fn slot(&self, i: usize) -> &AtomicUsize {
        if i < INLINE {
            return &self.inline[i];
        }
        let i = i - INLINE;
        let first = self.chunk_at(&self.more, 0);
        let tail = first.tail.load(Ordering::Acquire);
        // SAFETY: a chunk of this list (see `chunk_at`).
        let mut chunk = match unsafe { tail.as_ref() } {
            Some(t) if t.base <= i => t,
            _ => first,
        };
        while i >= chunk.base + CHUNK {
            chunk = self.chunk_at(&chunk.next, chunk.base + CHUNK);
        }
        &chunk.slots[i - chunk.base]
    }

    /// The chunk that `link` points to (the one of slots from `base`), made
    /// if there is none yet.
    #[inline]
    fn chunk_at<'a>(&self, link: &'a AtomicPtr<Chunk>, base: usize) -> &'a Chunk {
        let p = link.load(Ordering::Acquire);
        // SAFETY: a chunk lives until its list frees it, through `&mut`
        // only (`reopen`, `drop`), and this borrow comes from a shared one.
        match unsafe { p.as_ref() } {
            Some(chunk) => chunk,
            None => self.make_chunk(link, base),
        }
    }

    /// Makes the chunk of slots from `base` and installs it at `link` with a
    /// compare-and-swap (two threads may race to make it: the loser frees
    /// its own), and notes it as the list's last.
    #[cold]
    fn make_chunk<'a>(&self, link: &'a AtomicPtr<Chunk>, base: usize) -> &'a Chunk {
        let made = crate::mem::boxed(Chunk {
            next: AtomicPtr::new(null_mut()),
            base,
            tail: AtomicPtr::new(null_mut()),
            slots: std::array::from_fn(|_| AtomicUsize::new(EMPTY)),
        })
        .as_ptr();
        let p = match link.compare_exchange(null_mut(), made, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => {
                // The first chunk exists: chunks are made in order.
                let first = self.more.load(Ordering::Acquire);
                // SAFETY: a chunk of this list (see `chunk_at`).
                unsafe { &*first }.tail.store(made, Ordering::Release);
                made
            }
            Err(won) => {
                // SAFETY: made above and never shared.
                unsafe { crate::mem::drop_and_free(made) };
                won
            }
        };
        // SAFETY: as in `chunk_at`.
        unsafe { &*p }
    }
}

impl Drop for Dependents {
    fn drop(&mut self) {
        free_after(&self.more, 0);
    }
}

/// Frees the chunks after the first `keep` of the chain that starts at
/// `link`. Only where nothing else reaches the list (`&mut` of it).
fn free_after(link: &AtomicPtr<Chunk>, keep: usize) {
    let mut link = link;
    for _ in 0..keep {
        let p = link.load(Ordering::Relaxed);
        if p.is_null() {
            return;
        }
        // SAFETY: a live chunk of the chain (see `chunk_at`).
        link = &unsafe { &*p }.next;
    }
    let mut p = link.swap(null_mut(), Ordering::Relaxed);
    while !p.is_null() {
        // SAFETY: unlinked above; nothing else reaches the list.
        let next = unsafe { &*p }.next.load(Ordering::Relaxed);
        // SAFETY: made by `make_chunk`, freed once.
        unsafe { crate::mem::drop_and_free(p) };
        p = next;
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// Joins past the node's own slots and three chunks, a close, joins after
    /// it, settling and a reopen: every value comes back once, in order, and
    /// the reopened list starts empty.
    #[test]
    fn slots_keep_join_order_across_chunks_and_reopen_empty() {
        let mut d = Dependents::closed();
        assert!(!d.join(64, || panic!("closed: nothing runs")));
        for round in 0..2 {
            d.reopen();
            let n = INLINE + 3 * CHUNK + 5;
            let mut befores = 0;
            for i in 0..n {
                assert!(d.join((i + 1) * 64 + round, || befores += 1));
            }
            assert_eq!(befores, n);
            assert_eq!(d.close() as usize, n);
            assert!(!d.join(8, || panic!("closed: nothing runs")));
            let mut seen = Vec::new();
            d.settle(n as u32, |v| seen.push(v));
            let want: Vec<usize> = (0..n).map(|i| (i + 1) * 64 + round).collect();
            assert_eq!(seen, want);
            let mut again = Vec::new();
            d.each(n as u32, |v| again.push(v));
            assert_eq!(again, want);
        }
    }

    /// A slot claimed but not filled when the list settles is passed: the
    /// late fill fails (its recorder counts the dependency out), and the
    /// walks skip it.
    #[test]
    fn a_slot_filled_after_the_settle_is_refused_and_skipped() {
        let mut d = Dependents::closed();
        d.reopen();
        assert!(d.join(64, || {}));
        // A recorder's claim without its fill yet.
        let late = d.len.fetch_add(1, Ordering::Acquire) as usize;
        assert!(d.join(192, || {}));
        let n = d.close();
        assert_eq!(n, 3);
        let mut seen = Vec::new();
        d.settle(n, |v| seen.push(v));
        assert_eq!(seen, vec![64, 192]);
        let fill = d
            .slot(late)
            .compare_exchange(EMPTY, 128, Ordering::Release, Ordering::Acquire);
        assert_eq!(fill, Err(PASSED));
        let mut again = Vec::new();
        d.each(n, |v| again.push(v));
        assert_eq!(again, vec![64, 192]);
    }

    /// Claims made after the close (recorders that raced it) raise the
    /// count past the slots and chunks that exist: the next reopen empties
    /// only what exists, and the list works as new.
    #[test]
    fn claims_after_the_close_leave_the_reopened_list_whole() {
        let mut d = Dependents::closed();
        d.reopen();
        for i in 0..INLINE {
            assert!(d.join((i + 1) * 64, || {}));
        }
        let n = d.close();
        d.settle(n, |_| {});
        for _ in 0..3 * CHUNK {
            assert!(d.len.fetch_add(1, Ordering::Acquire) & CLOSED != 0);
        }
        d.reopen();
        assert!(d.more.load(Ordering::Relaxed).is_null());
        let m = INLINE + CHUNK + 1;
        for i in 0..m {
            assert!(d.join((i + 1) * 64, || {}));
        }
        let n = d.close();
        let mut seen = Vec::new();
        d.settle(n, |v| seen.push(v));
        assert_eq!(seen, (0..m).map(|i| (i + 1) * 64).collect::<Vec<_>>());
    }

    /// Many joins from several threads at once, then a close: each joined
    /// value is in exactly one slot.
    #[test]
    fn joins_from_several_threads_each_land_once() {
        let mut d = Dependents::closed();
        d.reopen();
        let per = 500;
        std::thread::scope(|s| {
            for t in 0..4usize {
                let d = &d;
                s.spawn(move || {
                    for i in 0..per {
                        assert!(d.join(((t * per + i) + 1) * 64, || {}));
                    }
                });
            }
        });
        let n = d.close();
        let mut seen = Vec::new();
        d.settle(n, |v| seen.push(v));
        seen.sort_unstable();
        let want: Vec<usize> = (0..4 * per).map(|i| (i + 1) * 64).collect();
        assert_eq!(seen, want);
    }
}

/// Loom models of the protocol itself, past the node's own slots: joins that
/// race the close and the settle, and each other, to make the first chunk.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    /// Two recorders join a list whose own slots are full (both need the
    /// first chunk, which either of them or the settle makes) while a third
    /// thread closes and settles it: each value is joined exactly once, by
    /// its recorder's fill or by the settle, never both and never neither.
    /// Bounded to 5 preemptions (under half a minute on 2 cores);
    /// unbounded, it passed in 55 minutes (niced, on a shared machine).
    #[test]
    fn joins_past_the_inline_slots_race_the_close_once_each() {
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(5);
        model.check(|| {
            let mut d = Dependents::closed();
            d.reopen();
            for i in 0..INLINE {
                assert!(d.join((i + 1) * 64, || {}));
            }
            let d = Arc::new(d);
            let values = [1000 * 64, 2000 * 64 + 1];
            let joiners: Vec<_> = values
                .iter()
                .map(|&v| {
                    let d = d.clone();
                    loom::thread::spawn(move || d.join(v, || {}))
                })
                .collect();
            let n = d.close();
            let mut settled = Vec::new();
            d.settle(n, |v| settled.push(v));
            let joined: Vec<bool> = joiners.into_iter().map(|j| j.join().unwrap()).collect();
            for (v, joined) in values.iter().zip(joined) {
                let found = settled.iter().filter(|&&s| s == *v).count();
                assert_eq!(found, usize::from(joined), "{v}: joined {joined}");
            }
            assert_eq!(
                settled.len(),
                INLINE + settled.iter().filter(|v| values.contains(v)).count()
            );
        });
    }
}
