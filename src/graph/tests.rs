use super::*;

fn meta(name: &'static str) -> NodeMeta {
    NodeMeta {
        name,
        location: Location::caller(),
        lane: 0,
        weight: 1,
        group: 0,
    }
}

type Q = VarQueue<u32>;

/// Records a Lazy node reading `reads` and writing `writes`.
fn rec(name: &'static str, reads: &[&Q], writes: &[&Q], job: u32) -> NodeRef<u32> {
    rec_in(0, name, reads, writes, job)
}

/// [`rec`] of a node of `group`.
fn rec_in(group: u32, name: &'static str, reads: &[&Q], writes: &[&Q], job: u32) -> NodeRef<u32> {
    let mut acc: Accesses<'_, u32> = SmallVec::new();
    acc.extend(reads.iter().map(|v| Access {
        var: *v,
        read: true,
        write: false,
    }));
    acc.extend(writes.iter().map(|v| Access {
        var: *v,
        read: false,
        write: true,
    }));
    let meta = NodeMeta {
        group,
        ..meta(name)
    };
    let (node, ready) = record(meta, &mut acc, |_| job, false, None, None);
    assert!(
        ready.is_none(),
        "a Lazy node is not ready before it is demanded"
    );
    node
}

/// Demands `roots` and returns the jobs made ready, sorted.
fn demanded(roots: &[NodeRef<u32>]) -> Vec<u32> {
    let mut out = Vec::new();
    demand(roots, &mut |n| out.push(n.take_job().unwrap().0));
    out.sort();
    out
}

fn finish(n: &NodeRef<u32>, outcome: Outcome) -> Vec<Ready<u32>> {
    let mut ready = Vec::new();
    complete(n, outcome).wake(&mut |r| ready.push(r));
    ready
}

fn jobs(ready: Vec<Ready<u32>>) -> Vec<u32> {
    let mut v: Vec<u32> = ready.iter().map(|n| n.take_job().unwrap().0).collect();
    v.sort();
    v
}

#[test]
fn raw_war_waw_edges() {
    let (x, y) = (Q::default(), Q::default());
    let w1 = rec("w1", &[], &[&x], 1);
    let r1 = rec("r1", &[&x], &[&y], 2);
    let r2 = rec("r2", &[&x], &[], 3);
    let w2 = rec("w2", &[], &[&x], 4);
    // Demanding w2 demands everything it must wait for: w1 (WAW), r1 and r2 (WAR).
    assert_eq!(demanded(std::slice::from_ref(&w2)), vec![1]);
    assert_eq!(jobs(finish(&w1, Outcome::Done)), vec![2, 3]);
    assert!(
        finish(&r1, Outcome::Done).is_empty(),
        "w2 still waits for r2"
    );
    assert_eq!(jobs(finish(&r2, Outcome::Done)), vec![4]);
    assert!(finish(&w2, Outcome::Done).is_empty());
    assert!(x.writer().is_none() && x.accessors().is_empty());
}

#[test]
fn targeted_demand_leaves_unrelated_nodes() {
    let (x, y) = (Q::default(), Q::default());
    let a = rec("a", &[], &[&x], 1);
    let b = rec("b", &[], &[&y], 2);
    assert_eq!(demanded(std::slice::from_ref(&a)), vec![1]);
    // Demanding again hands out nothing new.
    assert!(demanded(&[a]).is_empty());
    assert!(!b.is_demanded());
    assert_eq!(demanded(&[b]), vec![2]);
}

#[test]
fn a_node_demanded_at_record_is_ready_at_once() {
    let x = Q::default();
    let mut acc: Accesses<'_, u32> = SmallVec::new();
    acc.push(Access {
        var: &x,
        read: true,
        write: true,
    });
    let (a, ready) = record(meta("a"), &mut acc, |_| 1, true, None, None);
    assert!(ready.is_some());
    let mut acc: Accesses<'_, u32> = SmallVec::new();
    acc.push(Access {
        var: &x,
        read: true,
        write: false,
    });
    let (b, ready) = record(meta("b"), &mut acc, |_| 2, true, None, None);
    assert!(ready.is_none(), "b reads what a writes");
    assert_eq!(finish(&a, Outcome::Done).len(), 1);
    assert!(finish(&b, Outcome::Done).is_empty());
}

#[test]
fn failure_skips_readers_and_poisons_outputs() {
    let (x, y, z) = (Q::default(), Q::default(), Q::default());
    let a = rec("a", &[], &[&x], 1);
    let b = rec("b", &[&x], &[&y], 2);
    let c = rec("c", &[], &[&z], 3);
    demanded(&[a.clone(), b.clone(), c.clone()]);
    let ready = finish(&a, Outcome::Failed("boom".into()));
    assert!(a.error().is_some());
    assert_eq!(ready.len(), 1);
    let (_, skip) = ready[0].take_job().unwrap();
    let skip = skip.expect("reader of a failed write is skipped");
    assert!(skip.to_string().contains("boom") && skip.to_string().contains('a'));
    finish(&b, Outcome::Skipped(skip));
    finish(&c, Outcome::Done);
    assert!(x.poison().is_some());
    assert!(y.poison().is_some());
    assert!(z.poison().is_none());
    // A later read of the poisoned Var is skipped at record time.
    let d = rec("d", &[&y], &[], 4);
    let mut ready = Vec::new();
    demand(std::slice::from_ref(&d), &mut |r| ready.push(r));
    let (_, skip) = ready[0].take_job().unwrap();
    assert!(skip.is_some());
    finish(&d, Outcome::Skipped(skip.unwrap()));
    // A later plain write clears the poison once it succeeds.
    let e = rec("e", &[], &[&y], 5);
    demanded(std::slice::from_ref(&e));
    finish(&e, Outcome::Done);
    assert!(y.poison().is_none());
}

#[test]
fn a_writer_that_fails_before_its_reader_joins_still_skips_it() {
    // The reader is recorded after the writer finished: the skip comes from the
    // Var's queue, not from the writer's dependent list.
    let x = Q::default();
    let a = rec("a", &[], &[&x], 1);
    demanded(std::slice::from_ref(&a));
    finish(&a, Outcome::Failed("early".into()));
    let b = rec("b", &[&x], &[], 2);
    let mut ready = Vec::new();
    demand(&[b], &mut |r| ready.push(r));
    assert!(ready[0].take_job().unwrap().1.is_some());
}

#[test]
fn poisoned_from_the_start() {
    let err: SharedError = std::sync::Arc::new(Error::Config("bad".into()));
    let x = Q::new(Some(err));
    assert!(x.poison().is_some());
    let r = rec("r", &[&x], &[], 1);
    let mut ready = Vec::new();
    demand(&[r], &mut |n| ready.push(n));
    assert!(ready[0].take_job().unwrap().1.is_some());
}

#[test]
fn readers_are_pruned() {
    let x = Q::default();
    for i in 0..1000 {
        let r = rec("r", &[&x], &[], i);
        demanded(std::slice::from_ref(&r));
        finish(&r, Outcome::Done);
    }
    assert!(lock(&x.inner).readers.len() <= 2 * PRUNE_MIN);
}

#[test]
fn a_var_read_and_written_is_one_access() {
    let x = Q::default();
    let a = rec("a", &[&x], &[&x], 1);
    let b = rec("b", &[&x], &[&x], 2);
    assert_eq!(demanded(std::slice::from_ref(&b)), vec![1]);
    assert_eq!(jobs(finish(&a, Outcome::Done)), vec![2]);
    finish(&b, Outcome::Done);
}

#[test]
fn dot_export_shows_nodes_and_edges() {
    let (x, y) = (Q::default(), Q::default());
    let first = rec("first", &[], &[&x], 1);
    let second = rec("second", &[&x], &[&y], 2);
    let other = rec("other", &[], &[], 3);
    let dot = to_dot(&[second, other, first], |lane| format!("lane{lane}"));
    assert!(dot.contains("first") && dot.contains("other") && dot.contains("lane0"));
    assert_eq!(dot.matches("->").count(), 1);
}

#[test]
fn ancestors_walk_the_dependency_lists() {
    let (x, y, z) = (Q::default(), Q::default(), Q::default());
    let a = rec("a", &[], &[&x], 1);
    let b = rec("b", &[&x], &[&y], 2);
    let c = rec("c", &[], &[&z], 3);
    let d = rec("d", &[&y], &[], 4);
    let an = ancestors(std::slice::from_ref(&d));
    let keys = |v: &[&NodeRef<u32>]| {
        v.iter()
            .map(|n| n.key())
            .collect::<std::collections::HashSet<_>>()
    };
    assert_eq!(
        an.keys().copied().collect::<std::collections::HashSet<_>>(),
        keys(&[&a, &b, &d])
    );
    assert!(!an.contains_key(&c.key()));
    assert!(an.values().any(|n| n.writes(x.key())));
    assert!(!an.values().any(|n| n.writes(z.key())));
    // Finished nodes leave the walk.
    demanded(std::slice::from_ref(&a));
    finish(&a, Outcome::Done);
    assert_eq!(
        ancestors(std::slice::from_ref(&d))
            .keys()
            .copied()
            .collect::<std::collections::HashSet<_>>(),
        keys(&[&b, &d])
    );
}

#[test]
fn a_waiter_is_woken_by_the_completion() {
    let x = Q::default();
    let a = rec("a", &[], &[&x], 1);
    let latch = Arc::new(Latch::default());
    assert!(a.add_waiter(&latch));
    demanded(std::slice::from_ref(&a));
    finish(&a, Outcome::Done);
    latch.wait();
    assert!(!a.add_waiter(&latch), "a finished node takes no waiters");
}

/// Records a demanded write of `var` into `spare`: the node (handed out), and
/// the spent job its job was made from (`None` if the spare was not reused or
/// gave none).
fn rec_into(var: &Q, spare: NodeRef<u32>, job: u32) -> (Ready<u32>, Option<u32>) {
    let (_, ready, seen) = write_into(var, Some(spare), None, job);
    (ready, seen)
}

/// Records a demanded write of `var` (a first write: ready at once), into
/// `spare` if it can be reused, with `home` as its pool: the node, its
/// hand-out, and the spent job its job was made from.
fn write_into(
    var: &Q,
    spare: Option<NodeRef<u32>>,
    home: Option<&'static NodePool<u32>>,
    job: u32,
) -> (NodeRef<u32>, Ready<u32>, Option<u32>) {
    let mut acc: Accesses<'_, u32> = SmallVec::new();
    acc.push(Access {
        var,
        read: false,
        write: true,
    });
    let mut seen = None;
    let (node, ready) = record(
        meta("into"),
        &mut acc,
        |spent| {
            seen = spent;
            job
        },
        true,
        spare,
        home,
    );
    (node, ready.expect("a first write, demanded: ready"), seen)
}

#[test]
fn a_finished_node_nothing_else_holds_is_recorded_into_again() {
    let (x, y, z) = (Q::default(), Q::default(), Q::default());
    let a = rec("a", &[], &[&x], 1);
    demanded(std::slice::from_ref(&a));
    finish(&a, Outcome::Done);
    let at = a.key();
    // Shared (x's last writer, and this clone): a new node is allocated.
    let (fresh, spent) = rec_into(&z, a.clone(), 4);
    assert_ne!(fresh.key(), at, "a shared spare is left alone");
    assert_eq!(spent, None);
    assert_eq!(fresh.take_job().unwrap().0, 4);
    // Once x's next writer replaces it, only `a` holds it (a finished writer
    // is not waited for).
    let b = rec("b", &[], &[&x], 2);
    assert!(!b.waits_for(&a));
    let (c, spent) = rec_into(&y, a, 3);
    assert_eq!(spent, None, "no spent job was given back");
    assert_eq!(c.key(), at, "the new node lives in the spare's memory");
    assert_eq!(c.meta.name, "into");
    assert!(!c.is_done() && c.error().is_none() && c.deps().is_empty());
    assert_eq!(c.take_job().unwrap().0, 3);
}

#[test]
fn an_unfinished_or_shared_node_is_not_recorded_into() {
    let (x, y) = (Q::default(), Q::default());
    let a = rec("a", &[], &[&x], 1);
    let b = rec("b", &[], &[&x], 2);
    // `a` is unfinished (and `b` waits for it).
    let at = a.key();
    let (n, spent) = rec_into(&y, a.clone(), 5);
    assert!(n.key() != at && spent.is_none());
    assert!(!a.is_done(), "the unfinished spare is untouched");
    demanded(std::slice::from_ref(&b));
    let released = finish(&a, Outcome::Done);
    assert_eq!(jobs(released), vec![2]);
    // `b` is the last writer of x, and unfinished.
    let bt = b.key();
    let (n, _) = rec_into(&Q::default(), b, 6);
    assert_ne!(n.key(), bt);
    // The spent job given back after the run comes with the node's memory.
    let c = rec("c", &[], &[&Q::default()], 3);
    let mut ready = Vec::new();
    demand(std::slice::from_ref(&c), &mut |r| ready.push(r));
    let handed = ready.pop().expect("c waits for nothing");
    assert_eq!(handed.take_job().unwrap().0, 3);
    handed.give_back(30);
    drop(handed);
    assert!(finish(&c, Outcome::Done).is_empty());
    let ct = c.key();
    let (d, spent) = rec_into(&Q::default(), c, 7);
    assert_eq!((d.key(), spent), (ct, Some(30)));
    assert_eq!(d.take_job().unwrap().0, 7);
}

/// A node that meets each of many dependencies twice (a reader of the Var it
/// writes and the last writer of a Var it reads) waits for each once, and
/// reads what each writes: the failure of any one skips it. With 3 the
/// dependencies are found by a search, with 12 and 40 by a table.
#[test]
fn a_dependency_met_twice_is_one_edge_that_reads() {
    for n in [3usize, 12, 40] {
        for failing in [0, n - 1] {
            let x = Q::default();
            let ys: Vec<Q> = (0..n).map(|_| Q::default()).collect();
            let w0 = rec("w0", &[], &[&x], 0);
            let mids: Vec<NodeRef<u32>> = ys
                .iter()
                .enumerate()
                .map(|(i, y)| rec("mid", &[&x], &[y], i as u32 + 1))
                .collect();
            let reads: Vec<&Q> = ys.iter().collect();
            let sink = rec("sink", &reads, &[&x], 1000);
            // x's last writer and its readers; each reader is also a y's writer.
            assert_eq!(sink.deps().len(), n + 1, "n = {n}");
            assert!(mids.iter().all(|m| sink.waits_for(m)) && sink.waits_for(&w0));
            assert_eq!(demanded(std::slice::from_ref(&sink)), vec![0]);
            assert_eq!(jobs(finish(&w0, Outcome::Done)).len(), n);
            let mut released = Vec::new();
            for (i, m) in mids.iter().enumerate() {
                let outcome = if i == failing {
                    Outcome::Failed("boom".into())
                } else {
                    Outcome::Done
                };
                released.extend(finish(m, outcome));
            }
            assert_eq!(released.len(), 1, "the sink is released once, n = {n}");
            let (job, skip) = released[0].take_job().unwrap();
            assert_eq!(job, 1000);
            assert!(
                skip.is_some(),
                "n = {n}: it read what the failed node wrote"
            );
        }
    }
}

#[test]
fn a_listed_demand_marks_only_the_nodes_listed() {
    let (x, y) = (Q::default(), Q::default());
    let w = rec("w", &[], &[&x], 1);
    let r = rec("r", &[&x], &[&y], 2);
    let other = rec("other", &[], &[&y], 3);
    // One group's list up to `r`, in record order: each node is marked by
    // itself, `w` ready, `r` waiting for it.
    let mut out = Vec::new();
    assert_eq!(demand_listed([&w, &r].into_iter(), &mut |n| out.push(n)), 2);
    assert!(r.is_demanded());
    assert_eq!(jobs(out), vec![1]);
    assert_eq!(jobs(finish(&w, Outcome::Done)), vec![2]);
    // `other` (a write after `r`'s write) waits for `r`, and was not listed.
    assert!(finish(&r, Outcome::Done).is_empty());
    assert!(!other.is_demanded());
    assert_eq!(demanded(&[other]), vec![3]);
}

#[test]
fn a_listed_node_that_waits_for_another_group_demands_what_it_waits_for() {
    let (x, y, z) = (Q::default(), Q::default(), Q::default());
    // `w` and `u` were recorded by another thread (another list), and
    // nothing demanded them; `r` waits for `w`, `u` for nothing.
    let w = rec_in(1, "w", &[], &[&x], 1);
    let u = rec_in(1, "u", &[], &[&z], 4);
    let r = rec_in(0, "r", &[&x], &[&y], 2);
    let after = rec_in(0, "after", &[&y], &[], 3);
    let mut out = Vec::new();
    // `r`'s list alone: `r` cannot be marked by itself, or a blocker's walk
    // from `after` would stop at it and `w` would never run.
    assert_eq!(
        demand_listed([&r, &after].into_iter(), &mut |n| out.push(n)),
        3
    );
    assert!(w.is_demanded() && r.is_demanded() && after.is_demanded());
    assert!(!u.is_demanded(), "only what the listed nodes wait for");
    assert_eq!(jobs(out), vec![1]);
    assert_eq!(jobs(finish(&w, Outcome::Done)), vec![2]);
    assert_eq!(jobs(finish(&r, Outcome::Done)), vec![3]);
}

#[test]
fn a_finished_node_let_go_of_last_anywhere_goes_back_to_its_pool() {
    static POOL: NodePool<u32> = NodePool::new();
    let (x, y) = (Q::default(), Q::default());
    let (a, ready, _) = write_into(&x, None, Some(&POOL), 1);
    let at = a.key();
    let (job, _) = ready.take_job().unwrap();
    ready.give_back(job);
    drop(ready);
    // Let go of unfinished: not pooled (this reference is not the last).
    drop(a.clone());
    assert!(POOL.take_all().next().is_none());
    finish(&a, Outcome::Done);
    drop(a);
    // x's queue holds the finished writer: not pooled yet.
    assert!(POOL.take_all().next().is_none());
    // The next write of x moves it to its dependencies (it finished, so
    // none); the last reference goes with them, into the pool.
    let (b, ready_b, _) = write_into(&x, None, Some(&POOL), 2);
    let mut taken = POOL.take_all();
    let back = taken.next().expect("the last reference went: pooled");
    assert_eq!(back.key(), at);
    assert!(taken.next().is_none());
    drop(taken);
    // Recorded in again, with its spent job.
    let (c, ready_c, seen) = write_into(&y, Some(back), Some(&POOL), 3);
    assert_eq!(c.key(), at);
    assert_eq!(seen, Some(1));
    // Nodes let go of unfinished (their queues hold the last references)
    // are freed, not pooled: nothing may be left in use in a pooled node.
    drop((b, ready_b, c, ready_c));
    drop((x, y));
    assert!(POOL.take_all().next().is_none());
}
