//! A petgraph snapshot of part of the graph, for DOT export. (Deadlock checks walk
//! the nodes' own dependency lists instead: see `graph::ancestors`.)

use super::{ancestors, NodeRef};
use petgraph::graph::DiGraph;
use std::collections::HashMap;
use std::fmt::Write;

/// `roots` and every unfinished node they wait for, in Graphviz DOT; edges point
/// from a dependency to the node that waits for it, and demanded nodes are bold.
/// `label` names a node's lane (the engine's device).
pub(crate) fn to_dot<J>(roots: &[NodeRef<J>], label: impl Fn(u32) -> String) -> String {
    let nodes = ancestors(roots);
    let mut dag = DiGraph::<&NodeRef<J>, ()>::new();
    let mut index = HashMap::new();
    // Record order is lost in a hash map; order by address for a stable output.
    let mut sorted: Vec<_> = nodes.iter().collect();
    sorted.sort_by_key(|(k, _)| **k);
    for (k, n) in &sorted {
        index.insert(**k, dag.add_node(n));
    }
    for (k, n) in &sorted {
        for d in n.deps() {
            if let (Some(&a), Some(&b)) = (index.get(&d.key()), index.get(*k)) {
                dag.add_edge(a, b, ());
            }
        }
    }
    let mut out = String::from("digraph lazyflow {\n  node [shape=box];\n");
    for i in dag.node_indices() {
        let n = dag[i];
        let style = if n.is_demanded() { ", style=bold" } else { "" };
        let _ = writeln!(
            out,
            "  n{} [label=\"{} ({})\\n{}\"{}];",
            i.index(),
            n.meta.name.escape_default(),
            label(n.meta.lane),
            n.meta.location.to_string().escape_default(),
            style
        );
    }
    for e in dag.edge_indices() {
        if let Some((a, b)) = dag.edge_endpoints(e) {
            let _ = writeln!(out, "  n{} -> n{};", a.index(), b.index());
        }
    }
    out.push_str("}\n");
    out
}
