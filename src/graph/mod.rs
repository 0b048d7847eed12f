//! The live window of the dependency DAG: nodes that are recorded but not finished,
//! and the access tracking of every Var that still has a handle.
//!
//! Dependencies come from data access alone. For each Var the graph remembers its
//! last writer and the readers since that write, so a new node depends on exactly
//! what it must: the last writer of everything it reads (read-after-write), and the
//! last writer plus the readers of everything it writes (write-after-write,
//! write-after-read). A node leaves the graph when it completes, so memory follows
//! the number of unfinished nodes, not the length of the program.
//!
//! The graph is a plain data structure; the engine keeps it behind its one lock.
//! It is generic over the job payload `J` so that its algorithms are unit-tested
//! with fake nodes and no threads.

mod analysis;

use crate::error::{Error, Location, SharedError};
use slotmap::{new_key_type, SlotMap};
use smallvec::SmallVec;
use std::sync::Arc;

pub(crate) use analysis::Analysis;

new_key_type! {
    /// Identifies a node while it is live (recorded and not yet finished).
    pub struct NodeId;
    /// Identifies the access tracking of one Var.
    pub struct VarId;
}

/// What a node is, for errors, traces and DOT export.
#[derive(Clone, Copy, Debug)]
pub(crate) struct NodeMeta {
    pub(crate) name: &'static str,
    pub(crate) location: Location,
    /// Where the node runs; the graph and the scheduler never look at it.
    pub(crate) device: crate::device::Device,
}

/// How a node ended.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// It ran and succeeded.
    Done,
    /// It ran and failed with this message (a panic, a kernel error).
    Failed(String),
    /// It did not run: an input was poisoned by this earlier failure.
    Skipped(SharedError),
}

/// A node whose dependencies are all finished and which is demanded: hand it to a
/// device. `skip` is set when one of its inputs was poisoned.
pub(crate) struct Ready<J> {
    pub(crate) node: NodeId,
    pub(crate) job: J,
    pub(crate) skip: Option<SharedError>,
}

struct Node<J> {
    meta: NodeMeta,
    reads: SmallVec<[VarId; 4]>,
    writes: SmallVec<[VarId; 2]>,
    /// Live nodes this one waits for (kept for ancestor walks).
    deps: SmallVec<[NodeId; 2]>,
    /// Live nodes waiting for this one.
    dependents: SmallVec<[NodeId; 2]>,
    /// Unfinished dependencies. Only touched under the engine lock.
    pending: u32,
    demanded: bool,
    /// `None` once handed out as ready.
    job: Option<J>,
    /// The failure of an input, found when that input's writer completed.
    skip: Option<SharedError>,
    /// A blocker waits for this node: wake it on completion.
    waited: bool,
}

#[derive(Default)]
struct VarTrack {
    /// The live node that writes this Var last; `None` once it finished.
    last_writer: Option<NodeId>,
    /// Nodes that read this Var since its last write (some may have finished).
    readers: SmallVec<[NodeId; 4]>,
    /// Length of `readers` at which finished readers are pruned (amortized O(1)).
    prune_at: usize,
    /// Outcome of the last finished write: the value is unusable when set.
    poison: Option<SharedError>,
}

const PRUNE_MIN: usize = 8;

/// The live DAG. See the module documentation.
pub(crate) struct Graph<J> {
    nodes: SlotMap<NodeId, Node<J>>,
    vars: SlotMap<VarId, VarTrack>,
}

impl<J> Default for Graph<J> {
    fn default() -> Self {
        Graph {
            nodes: SlotMap::with_key(),
            vars: SlotMap::with_key(),
        }
    }
}

impl<J> Graph<J> {
    /// Number of recorded but unfinished nodes.
    #[inline]
    pub(crate) fn live_nodes(&self) -> usize {
        self.nodes.len()
    }

    /// Number of Vars with live handles.
    pub(crate) fn tracked_vars(&self) -> usize {
        self.vars.len()
    }

    #[inline]
    pub(crate) fn is_live(&self, node: NodeId) -> bool {
        self.nodes.contains_key(node)
    }

    pub(crate) fn meta(&self, node: NodeId) -> Option<NodeMeta> {
        self.nodes.get(node).map(|n| n.meta)
    }

    /// Starts tracking a new Var (no accesses yet).
    pub(crate) fn new_var(&mut self) -> VarId {
        self.vars.insert(VarTrack {
            prune_at: PRUNE_MIN,
            ..VarTrack::default()
        })
    }

    /// Stops tracking a Var whose last handle is gone: no new node can name it.
    /// Pending accesses keep the data itself alive.
    pub(crate) fn drop_var(&mut self, var: VarId) {
        self.vars.remove(var);
    }

    /// Records a node that reads `reads` and writes `writes`, wiring it after
    /// exactly the live nodes it conflicts with. A Var may appear in both lists.
    pub(crate) fn record(
        &mut self,
        meta: NodeMeta,
        reads: &[VarId],
        writes: &[VarId],
        job: J,
    ) -> NodeId {
        let mut deps: SmallVec<[NodeId; 2]> = SmallVec::new();
        let mut skip = None;
        let add = |deps: &mut SmallVec<[NodeId; 2]>, d: NodeId| {
            if !deps.contains(&d) {
                deps.push(d);
            }
        };
        for &v in reads {
            if let Some(t) = self.vars.get(v) {
                match t.last_writer {
                    Some(w) => add(&mut deps, w),
                    None => {
                        if skip.is_none() {
                            skip.clone_from(&t.poison);
                        }
                    }
                }
            }
        }
        for &v in writes {
            if let Some(t) = self.vars.get(v) {
                if let Some(w) = t.last_writer {
                    add(&mut deps, w);
                }
                for &r in &t.readers {
                    if self.nodes.contains_key(r) {
                        add(&mut deps, r);
                    }
                }
            }
        }
        let id = self.nodes.insert(Node {
            meta,
            reads: SmallVec::from_slice(reads),
            writes: SmallVec::from_slice(writes),
            pending: deps.len() as u32,
            deps: SmallVec::new(),
            dependents: SmallVec::new(),
            demanded: false,
            job: Some(job),
            skip,
            waited: false,
        });
        for &d in &deps {
            // Every dep is live: last writers are cleared on completion and
            // readers were filtered above.
            self.nodes[d].dependents.push(id);
        }
        self.nodes[id].deps = deps;
        for &v in reads {
            if writes.contains(&v) {
                continue;
            }
            if let Some(t) = self.vars.get_mut(v) {
                if t.readers.len() >= t.prune_at {
                    let nodes = &self.nodes;
                    t.readers.retain(|r| nodes.contains_key(*r));
                    t.prune_at = (t.readers.len() * 2).max(PRUNE_MIN);
                }
                t.readers.push(id);
            }
        }
        for &v in writes {
            if let Some(t) = self.vars.get_mut(v) {
                t.last_writer = Some(id);
                t.readers.clear();
                t.prune_at = PRUNE_MIN;
            }
        }
        id
    }

    /// Marks `roots` and all their live ancestors as demanded and hands out those
    /// whose dependencies are finished. Stops at nodes already demanded: a demanded
    /// node's ancestors are always demanded too, so each node is visited once over
    /// the life of the graph.
    pub(crate) fn demand(&mut self, roots: &[NodeId], ready: &mut impl FnMut(Ready<J>)) -> usize {
        let mut stack: SmallVec<[NodeId; 16]> = SmallVec::new();
        let mut marked = 0;
        for &r in roots {
            stack.push(r);
            while let Some(n) = stack.pop() {
                let Some(node) = self.nodes.get_mut(n) else {
                    continue;
                };
                if node.demanded {
                    continue;
                }
                node.demanded = true;
                marked += 1;
                if node.pending == 0 {
                    if let Some(job) = node.job.take() {
                        ready(Ready {
                            node: n,
                            job,
                            skip: node.skip.clone(),
                        });
                    }
                }
                stack.extend(node.deps.iter().copied());
            }
        }
        marked
    }

    /// Demands every live node.
    pub(crate) fn demand_all(&mut self, ready: &mut impl FnMut(Ready<J>)) -> usize {
        let mut marked = 0;
        for (n, node) in self.nodes.iter_mut() {
            if node.demanded {
                continue;
            }
            node.demanded = true;
            marked += 1;
            if node.pending == 0 {
                if let Some(job) = node.job.take() {
                    ready(Ready {
                        node: n,
                        job,
                        skip: node.skip.clone(),
                    });
                }
            }
        }
        marked
    }

    /// Removes a finished node, records its outcome on the Vars it wrote and
    /// releases its dependents; those that become ready are handed out. Returns
    /// whether a blocker was waiting for this node, and its failure if it failed.
    pub(crate) fn complete(
        &mut self,
        id: NodeId,
        outcome: Outcome,
        ready: &mut impl FnMut(Ready<J>),
    ) -> (bool, Option<SharedError>) {
        let Some(node) = self.nodes.remove(id) else {
            return (false, None);
        };
        let err: Option<SharedError> = match outcome {
            Outcome::Done => None,
            Outcome::Failed(message) => Some(Arc::new(Error::Failed {
                op: node.meta.name.to_string(),
                location: node.meta.location,
                message,
            })),
            Outcome::Skipped(e) => Some(e),
        };
        for &v in &node.writes {
            if let Some(t) = self.vars.get_mut(v) {
                if t.last_writer == Some(id) {
                    t.last_writer = None;
                }
                t.poison.clone_from(&err);
            }
        }
        for &d in &node.dependents {
            let Some(dn) = self.nodes.get_mut(d) else {
                continue;
            };
            dn.pending -= 1;
            if let Some(e) = &err {
                if dn.skip.is_none() && dn.reads.iter().any(|r| node.writes.contains(r)) {
                    dn.skip = Some(e.clone());
                }
            }
            if dn.pending == 0 && dn.demanded {
                if let Some(job) = dn.job.take() {
                    ready(Ready {
                        node: d,
                        job,
                        skip: dn.skip.clone(),
                    });
                }
            }
        }
        (node.waited, err)
    }

    /// Marks a node so that its completion wakes blockers. Returns false if it
    /// already finished.
    pub(crate) fn set_waited(&mut self, node: NodeId) -> bool {
        match self.nodes.get_mut(node) {
            Some(n) => {
                n.waited = true;
                true
            }
            None => false,
        }
    }

    /// The live node a reader of `var` must wait for, if any.
    pub(crate) fn writer_of(&self, var: VarId) -> Option<NodeId> {
        self.vars.get(var).and_then(|t| t.last_writer)
    }

    /// Every live node a writer of `var` must wait for.
    pub(crate) fn accessors_of(&self, var: VarId) -> SmallVec<[NodeId; 4]> {
        let mut out = SmallVec::new();
        if let Some(t) = self.vars.get(var) {
            out.extend(t.last_writer);
            out.extend(
                t.readers
                    .iter()
                    .copied()
                    .filter(|r| self.nodes.contains_key(*r)),
            );
        }
        out
    }

    /// The failure that poisons `var`, once its last writer finished.
    pub(crate) fn poison_of(&self, var: VarId) -> Option<SharedError> {
        self.vars.get(var).and_then(|t| t.poison.clone())
    }

    /// Poisons a Var that no node has touched yet (a value rejected at record
    /// time by an operator that cannot return `Err`).
    pub(crate) fn poison_var(&mut self, var: VarId, err: SharedError) {
        if let Some(t) = self.vars.get_mut(var) {
            t.poison = Some(err);
        }
    }

    /// `roots` and every live node they wait for, directly or not, by walking
    /// the nodes' own dependency lists (no copy of the graph).
    pub(crate) fn ancestors(&self, roots: &[NodeId]) -> std::collections::HashSet<NodeId> {
        let mut seen = std::collections::HashSet::new();
        let mut stack: SmallVec<[NodeId; 16]> = roots.iter().copied().collect();
        while let Some(n) = stack.pop() {
            let Some(node) = self.nodes.get(n) else {
                continue;
            };
            if seen.insert(n) {
                stack.extend(node.deps.iter().copied());
            }
        }
        seen
    }

    /// Every live node.
    pub(crate) fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.nodes.keys()
    }

    /// The first of `nodes` that writes one of `vars`.
    pub(crate) fn writer_among(
        &self,
        nodes: impl IntoIterator<Item = NodeId>,
        vars: &[VarId],
    ) -> Option<NodeId> {
        nodes.into_iter().find(|&n| {
            self.nodes
                .get(n)
                .is_some_and(|node| node.writes.iter().any(|w| vars.contains(w)))
        })
    }

    pub(crate) fn analysis(&self) -> Analysis {
        Analysis::new(
            self.nodes
                .iter()
                .map(|(id, n)| (id, n.meta, n.demanded, n.deps.iter().copied().collect())),
        )
    }
}

#[cfg(test)]
mod tests;
