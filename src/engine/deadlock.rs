//! Blockers that could never end, refused with `Error::WouldDeadlock` (the cold
//! path of a blocker; see `sched/README.md`, "Blockers inside tasks"):
//! - a task suspended or running on this thread is among what the wait needs;
//! - a wait cycle across threads, through blockers inside tasks elsewhere;
//! - the wait needs a write to a Var this thread is reading in `Var::with`.

use super::{NodeRef, Shared, Tracked};
use crate::error::{running_ops, Error, Location, Result, RunningOp};
use crate::sync::lock;
use std::cell::RefCell;
use std::collections::HashMap;

thread_local! {
    /// Vars this thread reads inside `Var::with`, with their engine: a wait for
    /// a write to one of them could never end.
    static BORROWED: RefCell<Vec<(u64, std::sync::Arc<dyn Tracked>)>> = const { RefCell::new(Vec::new()) };
}

/// Marks a Var as read by this thread until the guard is dropped.
pub(crate) struct Borrow(());

impl Borrow {
    pub(crate) fn new(engine: u64, var: std::sync::Arc<dyn Tracked>) -> Borrow {
        BORROWED.with(|b| b.borrow_mut().push((engine, var)));
        Borrow(())
    }
}

impl Drop for Borrow {
    fn drop(&mut self) {
        BORROWED.with(|b| b.borrow_mut().pop());
    }
}

fn borrowed(engine: u64) -> Vec<std::sync::Arc<dyn Tracked>> {
    BORROWED.with(|b| {
        b.borrow()
            .iter()
            .filter(|(e, _)| *e == engine)
            .map(|(_, v)| v.clone())
            .collect()
    })
}

/// A blocker inside a task, waiting on `roots`, on a thread where `stack` runs
/// (outermost first).
struct WaitEntry {
    id: u64,
    stack: Vec<RunningOp>,
    roots: Vec<NodeRef>,
}

#[derive(Default)]
pub(crate) struct Waits {
    entries: Vec<WaitEntry>,
    next: u64,
}

/// What a wait needs: the targets and every unfinished node they wait for.
pub(crate) type Needed = HashMap<usize, NodeRef>;

fn deadlock_error(op: Option<(&'static str, Location)>, reason: &str) -> Error {
    let (op, location) = op.unwrap_or(("<unknown>", Location::caller()));
    Error::WouldDeadlock {
        op: op.to_string(),
        location,
        reason: reason.to_string(),
    }
}

impl Shared {
    /// Checks that a wait for `targets` can end. On a worker thread the wait is
    /// entered in the table and returned with what it may help run; `None` for a
    /// plain wait.
    pub(super) fn check_wait(
        &self,
        targets: &[NodeRef],
        on_worker: bool,
    ) -> Result<Option<(u64, Needed)>> {
        let borrowed = borrowed(self.id);
        // Only waits that can deadlock need the walk (a frontend wait over a
        // long Lazy chain would otherwise pay it on every blocker).
        if !on_worker && borrowed.is_empty() {
            return Ok(None);
        }
        let needed = crate::graph::ancestors(targets);
        for var in &borrowed {
            let key = var.queue().key();
            if let Some(n) = needed.values().find(|n| n.writes(key)) {
                return Err(deadlock_error(
                    Some((n.meta.name, n.meta.location)),
                    "writes a Var that this thread is reading in Var::with",
                ));
            }
        }
        if !on_worker {
            return Ok(None);
        }
        let running = running_ops();
        // Any task suspended on this thread (not only the innermost) that the
        // targets depend on can never finish while this wait lasts.
        if let Some(op) = running.iter().rev().find(|o| needed.contains_key(&o.key)) {
            return Err(deadlock_error(
                Some((op.name, op.location)),
                "would wait on its own output: it is the task that waits, or one suspended under it on the same thread",
            ));
        }
        let mut waits = lock(&self.waits);
        // Nor can one whose finish needs, through blockers inside tasks on
        // other threads, what this wait keeps from finishing.
        if let Some(op) = waits_cycle(&waits, &needed, &running) {
            return Err(deadlock_error(
                Some((op.name, op.location)),
                "waits, through blockers inside tasks on other threads, for this wait to end",
            ));
        }
        let id = waits.next;
        waits.next += 1;
        waits.entries.push(WaitEntry {
            id,
            stack: running,
            roots: targets.to_vec(),
        });
        Ok(Some((id, needed)))
    }

    pub(super) fn end_wait(&self, id: u64) {
        lock(&self.waits).entries.retain(|w| w.id != id);
    }

    /// Checks that `wait_all` can end: not inside a task, and no unfinished
    /// write to a Var this thread is reading in `Var::with`.
    pub(super) fn check_wait_all(&self) -> Result<()> {
        if self.on_worker() {
            if let Some(op) = running_ops().last() {
                return Err(deadlock_error(
                    Some((op.name, op.location)),
                    "is the task that waits for everything",
                ));
            }
        }
        for var in borrowed(self.id) {
            if let Some(n) = var.queue().writer() {
                return Err(deadlock_error(
                    Some((n.meta.name, n.meta.location)),
                    "writes a Var that this thread is reading in Var::with",
                ));
            }
        }
        Ok(())
    }
}

/// Whether a new wait, whose targets need `needed`, closes a cycle through the
/// waits of other threads: a needed node that is running on a thread suspended
/// in such a wait finishes only after that wait's targets (and their ancestors)
/// do, so those are needed too. Returns the op of `running` (this thread's
/// stack) found needed.
fn waits_cycle(waits: &Waits, needed: &Needed, running: &[RunningOp]) -> Option<RunningOp> {
    if waits.entries.is_empty() {
        return None;
    }
    let mut needed: std::collections::HashSet<usize> = needed.keys().copied().collect();
    let mut merged = vec![false; waits.entries.len()];
    loop {
        let mut grew = false;
        for (i, w) in waits.entries.iter().enumerate() {
            if !merged[i] && w.stack.iter().any(|o| needed.contains(&o.key)) {
                merged[i] = true;
                needed.extend(crate::graph::ancestors(&w.roots).into_keys());
                grew = true;
            }
        }
        if !grew {
            break;
        }
    }
    running
        .iter()
        .rev()
        .copied()
        .find(|o| needed.contains(&o.key))
}
