use super::*;

fn meta(name: &'static str) -> NodeMeta {
    NodeMeta {
        name,
        location: Location::caller(),
        device: crate::device::Device::Cpu,
    }
}

fn collect(g: &mut Graph<u32>, roots: &[NodeId]) -> Vec<u32> {
    let mut out = Vec::new();
    g.demand(roots, &mut |r| out.push(r.job));
    out.sort();
    out
}

#[test]
fn raw_war_waw_edges() {
    let mut g = Graph::<u32>::default();
    let (x, y) = (g.new_var(), g.new_var());
    let w1 = g.record(meta("w1"), &[], &[x], 1);
    let r1 = g.record(meta("r1"), &[x], &[y], 2);
    let r2 = g.record(meta("r2"), &[x], &[], 3);
    let w2 = g.record(meta("w2"), &[], &[x], 4);
    // Demanding w2 demands everything it must wait for: w1 (WAW), r1 and r2 (WAR).
    assert_eq!(collect(&mut g, &[w2]), vec![1]);
    let mut ready = Vec::new();
    g.complete(w1, Outcome::Done, &mut |r| ready.push(r.job));
    ready.sort();
    assert_eq!(ready, vec![2, 3]);
    ready.clear();
    g.complete(r1, Outcome::Done, &mut |r| ready.push(r.job));
    assert!(ready.is_empty(), "w2 still waits for r2");
    g.complete(r2, Outcome::Done, &mut |r| ready.push(r.job));
    assert_eq!(ready, vec![4]);
    g.complete(w2, Outcome::Done, &mut |_| {});
    assert_eq!(g.live_nodes(), 0);
}

#[test]
fn targeted_demand_leaves_unrelated_nodes() {
    let mut g = Graph::<u32>::default();
    let (x, y) = (g.new_var(), g.new_var());
    let a = g.record(meta("a"), &[], &[x], 1);
    let _b = g.record(meta("b"), &[], &[y], 2);
    assert_eq!(collect(&mut g, &[a]), vec![1]);
    // Demanding again hands out nothing new.
    assert!(collect(&mut g, &[a]).is_empty());
    let mut all = Vec::new();
    g.demand_all(&mut |r| all.push(r.job));
    assert_eq!(all, vec![2]);
}

#[test]
fn failure_skips_readers_and_poisons_outputs() {
    let mut g = Graph::<u32>::default();
    let (x, y, z) = (g.new_var(), g.new_var(), g.new_var());
    let a = g.record(meta("a"), &[], &[x], 1);
    let b = g.record(meta("b"), &[x], &[y], 2);
    let c = g.record(meta("c"), &[], &[z], 3);
    g.demand_all(&mut |_| {});
    let mut ready = Vec::new();
    let (_, err) = g.complete(a, Outcome::Failed("boom".into()), &mut |r| ready.push(r));
    assert!(err.is_some());
    assert_eq!(ready.len(), 1);
    let skip = ready[0]
        .skip
        .clone()
        .expect("reader of a failed write is skipped");
    assert!(skip.to_string().contains("boom") && skip.to_string().contains('a'));
    g.complete(b, Outcome::Skipped(skip), &mut |_| {});
    g.complete(c, Outcome::Done, &mut |_| {});
    assert!(g.poison_of(x).is_some());
    assert!(g.poison_of(y).is_some());
    assert!(g.poison_of(z).is_none());
    // A later read of the poisoned Var is skipped at record time.
    let d = g.record(meta("d"), &[y], &[], 4);
    let mut ready = Vec::new();
    g.demand(&[d], &mut |r| ready.push(r));
    assert!(ready[0].skip.is_some());
    // A later plain write clears the poison once it succeeds.
    g.complete(
        d,
        Outcome::Skipped(ready.pop().unwrap().skip.unwrap()),
        &mut |_| {},
    );
    let e = g.record(meta("e"), &[], &[y], 5);
    g.demand(&[e], &mut |_| {});
    g.complete(e, Outcome::Done, &mut |_| {});
    assert!(g.poison_of(y).is_none());
}

#[test]
fn readers_are_pruned() {
    let mut g = Graph::<u32>::default();
    let x = g.new_var();
    for i in 0..1000 {
        let r = g.record(meta("r"), &[x], &[], i);
        g.demand(&[r], &mut |_| {});
        g.complete(r, Outcome::Done, &mut |_| {});
    }
    assert!(g.vars[x].readers.len() <= 2 * PRUNE_MIN);
    assert_eq!(g.live_nodes(), 0);
}

#[test]
fn dot_export_shows_nodes_and_edges() {
    let mut g = Graph::<u32>::default();
    let (x, y) = (g.new_var(), g.new_var());
    g.record(meta("first"), &[], &[x], 1);
    g.record(meta("second"), &[x], &[y], 2);
    g.record(meta("other"), &[], &[], 3);
    let dot = g.analysis().to_dot();
    assert!(dot.contains("first") && dot.contains("other"));
    assert_eq!(dot.matches("->").count(), 1);
}

#[test]
fn ancestors_walk_the_dependency_lists() {
    let mut g = Graph::<u32>::default();
    let (x, y, z) = (g.new_var(), g.new_var(), g.new_var());
    let a = g.record(meta("a"), &[], &[x], 1);
    let b = g.record(meta("b"), &[x], &[y], 2);
    let c = g.record(meta("c"), &[], &[z], 3);
    let d = g.record(meta("d"), &[y], &[], 4);
    let an = g.ancestors(&[d]);
    assert_eq!(an, [a, b, d].into_iter().collect());
    assert!(!an.contains(&c));
    assert_eq!(g.writer_among(an.iter().copied(), &[x]), Some(a));
    assert_eq!(g.writer_among(an.iter().copied(), &[z]), None);
    // Finished nodes leave the walk.
    g.demand(&[a], &mut |_| {});
    g.complete(a, Outcome::Done, &mut |_| {});
    assert_eq!(g.ancestors(&[d]), [b, d].into_iter().collect());
}
