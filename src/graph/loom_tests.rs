//! Loom models of the graph's protocols (`RUSTFLAGS="--cfg loom" cargo test
//! --release --lib loom`): the dependency count, the lock-free list of
//! dependents, the Var queue racing with completions, two records crossing
//! on shared Vars, and the blocker latch.

use super::*;
use crate::sync::AtomicUsize;

fn meta(name: &'static str) -> NodeMeta {
    NodeMeta {
        name,
        location: Location::caller(),
        lane: 0,
        weight: 1,
        group: 0,
    }
}

fn access(var: &VarQueue<u32>, read: bool, write: bool) -> Accesses<'_, u32> {
    let mut a = SmallVec::new();
    a.push(Access { var, read, write });
    a
}

/// Records a node named `name` with the one access `read`/`write` of `var`
/// and the job `job`, demanded at once if `demanded`, in fresh memory.
fn rec1(
    name: &'static str,
    var: &VarQueue<u32>,
    (read, write): (bool, bool),
    job: u32,
    demanded: bool,
) -> (NodeRef<u32>, Option<Ready<u32>>) {
    record(
        meta(name),
        &mut access(var, read, write),
        |_| job,
        demanded,
        None,
        None,
    )
}

/// Records a writer of `x`, the first access to it: ready at once.
fn first_writer(x: &VarQueue<u32>) -> NodeRef<u32> {
    let (w, ready) = rec1("w", x, (false, true), 1, true);
    assert!(ready.is_some());
    w
}

/// Records a reader of `x` whose job is `job`, counted in `handed` if it is
/// ready at once (and then handed out with it).
fn reader(x: &VarQueue<u32>, job: u32, handed: &AtomicUsize) -> (NodeRef<u32>, Option<Ready<u32>>) {
    let (r, ready) = rec1("r", x, (true, false), job, true);
    if ready.is_some() {
        handed.fetch_add(1, Ordering::SeqCst);
    }
    (r, ready)
}

/// Two dependencies complete on two threads at once: the node that waits for
/// both is handed out exactly once, after both.
#[test]
fn the_dependency_count_hands_a_node_out_once() {
    loom::model(|| {
        let (x, y) = (VarQueue::<u32>::default(), VarQueue::<u32>::default());
        let (a, ready_a) = rec1("a", &x, (false, true), 1, true);
        let (b, ready_b) = rec1("b", &y, (false, true), 2, true);
        assert!(ready_a.is_some() && ready_b.is_some());
        let mut both = access(&x, true, false);
        both.push(Access {
            var: &y,
            read: true,
            write: false,
        });
        let (c, ready_c) = record(meta("c"), &mut both, |_| 3, true, None, None);
        assert!(ready_c.is_none());
        let handed = Arc::new(AtomicUsize::new(0));
        let (a2, h2) = (a.clone(), handed.clone());
        let t = loom::thread::spawn(move || {
            complete(&a2, Outcome::Done).wake(&mut |_| {
                h2.fetch_add(1, Ordering::SeqCst);
            });
        });
        complete(&b, Outcome::Done).wake(&mut |_| {
            handed.fetch_add(1, Ordering::SeqCst);
        });
        t.join().unwrap();
        assert_eq!(handed.load(Ordering::SeqCst), 1);
        assert!(a.is_done() && b.is_done() && !c.is_done());
    });
}

/// A reader is recorded while the writer it reads fails on another thread:
/// the reader is handed out exactly once (at record or by the completion) and
/// is skipped with the writer's failure either way.
#[test]
fn a_record_racing_with_a_failing_writer_is_released_once_and_skipped() {
    loom::model(|| {
        let x = Arc::new(VarQueue::<u32>::default());
        let w = first_writer(&x);
        let handed = Arc::new(AtomicUsize::new(0));
        let (w2, h2) = (w.clone(), handed.clone());
        let t = loom::thread::spawn(move || {
            let mut got = None;
            complete(&w2, Outcome::Failed("boom".into())).wake(&mut |r| got = Some(r));
            if got.is_some() {
                h2.fetch_add(1, Ordering::SeqCst);
            }
            got
        });
        let (r, at_record) = reader(&x, 2, &handed);
        let released = t.join().unwrap();
        assert_eq!(handed.load(Ordering::SeqCst), 1);
        let handed_out = released.or(at_record).expect("counted once above");
        assert!(NodeRef::ptr_eq(&handed_out, &r));
        let (_, skip) = handed_out.take_job().unwrap();
        assert!(skip.is_some(), "the reader of a failed write is skipped");
    });
}

/// Two readers join a writer's list of dependents on two threads while a
/// third completes the writer: each reader is handed out exactly once (by
/// its record, or by the completion that found it in its list), and every strong
/// count a list held is given back (loom fails a model that leaks one).
///
/// Bounded to 5 preemptions: three threads that each lock, join and release
/// give more interleavings than CI can wait for. Unbounded, the model passed
/// in 13 minutes on a 2-core machine; bounded to 5 it takes under a minute
/// there, to 6 about three.
#[test]
fn joins_racing_with_the_close_are_each_released_once() {
    let mut model = loom::model::Builder::new();
    model.preemption_bound = Some(5);
    model.check(|| {
        let x = Arc::new(VarQueue::<u32>::default());
        let w = first_writer(&x);
        let handed = Arc::new(AtomicUsize::new(0));
        let (w2, h2) = (w.clone(), handed.clone());
        let completer = loom::thread::spawn(move || {
            let mut released = Vec::new();
            complete(&w2, Outcome::Done).wake(&mut |r| {
                h2.fetch_add(1, Ordering::SeqCst);
                released.push(r);
            });
            released
        });
        let (x2, h3) = (x.clone(), handed.clone());
        let other = loom::thread::spawn(move || reader(&x2, 2, &h3).1);
        let (_, r2) = reader(&x, 3, &handed);
        let mut all = completer.join().unwrap();
        all.extend(other.join().unwrap());
        all.extend(r2);
        assert_eq!(handed.load(Ordering::SeqCst), 2);
        let mut jobs: Vec<u32> = all.iter().map(|r| r.take_job().unwrap().0).collect();
        jobs.sort();
        assert_eq!(jobs, vec![2, 3], "each reader handed out once");
    });
}

/// Two threads record at once: one reads X and writes Y, the other reads Y and
/// writes X. Locking both queues in address order serializes them, so one
/// waits for the other and never both (a cycle would hang both forever).
#[test]
fn crossed_records_never_wire_a_cycle() {
    loom::model(|| {
        let (x, y) = (
            Arc::new(VarQueue::<u32>::default()),
            Arc::new(VarQueue::<u32>::default()),
        );
        let (x2, y2) = (x.clone(), y.clone());
        let t = loom::thread::spawn(move || {
            let mut a = access(&x2, true, false);
            a.push(Access {
                var: &y2,
                read: false,
                write: true,
            });
            record(meta("n1"), &mut a, |_| 1, true, None, None)
        });
        let mut a = access(&y, true, false);
        a.push(Access {
            var: &x,
            read: false,
            write: true,
        });
        let (n2, ready2) = record(meta("n2"), &mut a, |_| 2, true, None, None);
        let (n1, ready1) = t.join().unwrap();
        // Exactly one is ready; completing it releases the other.
        assert!(ready1.is_some() ^ ready2.is_some());
        let (first, second) = if ready1.is_some() { (n1, n2) } else { (n2, n1) };
        let mut released = Vec::new();
        complete(&first, Outcome::Done).wake(&mut |r| released.push(r));
        assert_eq!(released.len(), 1);
        assert!(NodeRef::ptr_eq(&released[0], &second));
    });
}

/// A blocker registers on a node while another thread completes it: either the
/// registration is refused (the node is done) or the completion sets the latch;
/// the wait never hangs.
#[test]
fn the_blocker_latch_is_never_missed() {
    loom::model(|| {
        let x = VarQueue::<u32>::default();
        let (n, _) = rec1("n", &x, (false, true), 1, true);
        let n2 = n.clone();
        let t = loom::thread::spawn(move || {
            complete(&n2, Outcome::Done).wake(&mut |_| {});
        });
        let latch = Arc::new(Latch::default());
        if n.add_waiter(&latch) {
            latch.wait();
        }
        assert!(n.is_done());
        t.join().unwrap();
    });
}

/// Lazy mode: a node is demanded on one thread while its dependency completes
/// on another; it is handed out exactly once.
#[test]
fn demand_racing_with_completion_hands_out_once() {
    loom::model(|| {
        let x = VarQueue::<u32>::default();
        let (w, ready) = rec1("w", &x, (false, true), 1, true);
        assert!(ready.is_some());
        let (r, ready) = rec1("r", &x, (true, false), 2, false);
        assert!(ready.is_none());
        let handed = Arc::new(AtomicUsize::new(0));
        let (w2, h2) = (w.clone(), handed.clone());
        let t = loom::thread::spawn(move || {
            complete(&w2, Outcome::Done).wake(&mut |_| {
                h2.fetch_add(1, Ordering::SeqCst);
            });
        });
        demand(&[r.clone()], &mut |_| {
            handed.fetch_add(1, Ordering::SeqCst);
        });
        t.join().unwrap();
        assert_eq!(handed.load(Ordering::SeqCst), 1);
    });
}

/// A node completes and its last other reference goes away on another thread
/// while the recorder records into it: its memory is reused only once nobody
/// else holds it and it finished, and its spent job comes with it.
#[test]
fn a_node_is_recorded_into_only_once_finished_and_let_go() {
    loom::model(|| {
        let x = VarQueue::<u32>::default();
        let (n, ready) = rec1("n", &x, (false, true), 1, true);
        // Dropping the Var lets go of its reference (as its last writer): the
        // worker's and the recorder's are the only ones left.
        drop(x);
        let worker = ready.expect("a first write, demanded: ready");
        let t = loom::thread::spawn(move || {
            let (job, _) = worker.take_job().unwrap();
            worker.give_back(job * 10);
            complete(&worker, Outcome::Done).wake(&mut |_| {});
            drop(worker);
        });
        let at = n.key();
        let y = VarQueue::<u32>::default();
        let mut seen = None;
        let (m, ready) = record(
            meta("m"),
            &mut access(&y, false, true),
            |spent| {
                seen = spent;
                2
            },
            true,
            Some(n),
            None,
        );
        let ready = ready.expect("a first write, demanded: ready");
        assert!(!m.is_done());
        if m.key() == at {
            assert_eq!(seen, Some(10), "reused only after its completion");
        } else {
            assert_eq!(seen, None);
        }
        assert_eq!(ready.take_job().unwrap().0, 2);
        t.join().unwrap();
    });
}
