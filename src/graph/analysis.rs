//! A petgraph snapshot of the live window, for questions asked off the hot path:
//! ancestor closure (deadlock checks for blockers inside tasks) and DOT export.

use super::{NodeId, NodeMeta};
use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::visit::{Dfs, Reversed};
use std::collections::HashMap;
use std::fmt::Write;

/// A copy of the live DAG at one moment; edges point from a dependency to the
/// node that waits for it.
pub(crate) struct Analysis {
    dag: DiGraph<(NodeId, NodeMeta, bool), ()>,
    index: HashMap<NodeId, NodeIndex>,
}

impl Analysis {
    pub(crate) fn new(nodes: impl Iterator<Item = (NodeId, NodeMeta, bool, Vec<NodeId>)>) -> Self {
        let mut dag = DiGraph::new();
        let mut index = HashMap::new();
        let mut edges = Vec::new();
        for (id, meta, demanded, deps) in nodes {
            index.insert(id, dag.add_node((id, meta, demanded)));
            edges.push((id, deps));
        }
        for (id, deps) in edges {
            for d in deps {
                if let (Some(&a), Some(&b)) = (index.get(&d), index.get(&id)) {
                    dag.add_edge(a, b, ());
                }
            }
        }
        Analysis { dag, index }
    }

    /// Whether `candidate` is one of `roots` or an ancestor of one.
    pub(crate) fn is_ancestor(&self, candidate: NodeId, roots: &[NodeId]) -> bool {
        let Some(&target) = self.index.get(&candidate) else {
            return false;
        };
        let reversed = Reversed(&self.dag);
        let mut dfs = Dfs::empty(reversed);
        for r in roots {
            if let Some(&start) = self.index.get(r) {
                dfs.move_to(start);
                while let Some(n) = dfs.next(reversed) {
                    if n == target {
                        return true;
                    }
                }
            }
        }
        false
    }

    /// `roots` and all their live ancestors.
    pub(crate) fn ancestors(&self, roots: &[NodeId]) -> std::collections::HashSet<NodeId> {
        let reversed = Reversed(&self.dag);
        let mut dfs = Dfs::empty(reversed);
        let mut out = std::collections::HashSet::new();
        for r in roots {
            if let Some(&start) = self.index.get(r) {
                dfs.move_to(start);
                while let Some(n) = dfs.next(reversed) {
                    out.insert(self.dag[n].0);
                }
            }
        }
        out
    }

    /// The live DAG in Graphviz DOT; demanded nodes are drawn bold.
    pub(crate) fn to_dot(&self) -> String {
        let mut out = String::from("digraph lazyflow {\n  node [shape=box];\n");
        for i in self.dag.node_indices() {
            let (_, meta, demanded) = &self.dag[i];
            let style = if *demanded { ", style=bold" } else { "" };
            let _ = writeln!(
                out,
                "  n{} [label=\"{} ({})\\n{}\"{}];",
                i.index(),
                meta.name.escape_default(),
                meta.device,
                meta.location.to_string().escape_default(),
                style
            );
        }
        for e in self.dag.edge_indices() {
            if let Some((a, b)) = self.dag.edge_endpoints(e) {
                let _ = writeln!(out, "  n{} -> n{};", a.index(), b.index());
            }
        }
        out.push_str("}\n");
        out
    }
}
