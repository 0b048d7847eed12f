//! A petgraph snapshot of the live window, for DOT export. (Deadlock checks walk
//! the graph's own dependency lists instead: see `Graph::ancestors`; copying the
//! whole live graph under the engine lock for every blocker inside a task cost
//! time proportional to everything recorded.)

use super::{NodeId, NodeMeta};
use petgraph::graph::DiGraph;
use std::collections::HashMap;
use std::fmt::Write;

/// A copy of the live DAG at one moment; edges point from a dependency to the
/// node that waits for it.
pub(crate) struct Analysis {
    dag: DiGraph<(NodeId, NodeMeta, bool), ()>,
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
        Analysis { dag }
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
