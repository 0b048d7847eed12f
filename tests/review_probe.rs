//! Review probes: each test demonstrates one suspected engine bug. A hang is
//! detected by running the scenario on a separate thread with a deadline (the hung
//! thread is leaked).

use lazyflow::{Engine, Mode};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn within(secs: u64, what: &str, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(()) => {}
        Err(RecvTimeoutError::Timeout) => panic!("HANG: {what} did not finish in {secs} s"),
        Err(RecvTimeoutError::Disconnected) => panic!("{what}: scenario panicked"),
    }
}

fn spin_until(flag: &AtomicBool) {
    let t = Instant::now();
    while !flag.load(Ordering::SeqCst) {
        assert!(t.elapsed() < Duration::from_secs(30), "flag never set");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Lazy + backpressure: the frontend stalls in `commit_batch` with its full batch
/// still in the inbox. A running task records a node (inbox already full, so the
/// worker calls `commit_batch`, which skips backpressure on a worker and applies
/// the inbox): the frontend's batch and the child enter the graph undemanded, and
/// the frontend waits for `live <= low` forever.
#[test]
fn lazy_backpressure_hangs_when_a_task_records() {
    within(20, "Lazy backpressure + task that records", || {
        let e = Engine::builder()
            .mode(Mode::Lazy)
            .workers(2)
            .backpressure(4, 0)
            .build()
            .unwrap();
        let sink = e.var(0u64);
        for _ in 0..12 {
            let v = e.var(0u64);
            let (e2, sink2) = (e.clone(), sink.clone());
            let mut t = e.task("parent");
            let w = t.write(&v);
            t.push(move || {
                *w.write() += 1;
                let mut c = e2.task("child");
                let ws = c.write(&sink2);
                c.push(move || *ws.write() += 1).unwrap();
            })
            .unwrap();
        }
        e.wait_all().unwrap();
    });
}

/// Same stall, but the task only calls a blocker (`get` on an unrelated, already
/// settled Var): `wait_for` -> `lock_applied` applies the stalled frontend's batch
/// undemanded.
#[test]
fn lazy_backpressure_hangs_when_a_task_calls_a_blocker() {
    within(20, "Lazy backpressure + blocker inside task", || {
        let e = Engine::builder()
            .mode(Mode::Lazy)
            .workers(2)
            .backpressure(4, 0)
            .build()
            .unwrap();
        let z = e.var(7u64);
        for _ in 0..12 {
            let v = e.var(0u64);
            let z2 = z.clone();
            let mut t = e.task("reader");
            let w = t.write(&v);
            t.push(move || *w.write() += z2.get().unwrap()).unwrap();
        }
        e.wait_all().unwrap();
    });
}

/// Two Lazy frontends stalled together: the first to wake applies the whole inbox
/// (both threads' entries, undemanded), the second sees `live > low`, waits again,
/// and `bp_signalled` is already true, so nothing wakes it unless someone else
/// stalls later. When the other frontend stops recording it waits forever.
#[test]
fn lazy_two_frontends_backpressure_lost_wakeup() {
    within(20, "two Lazy frontends under backpressure", || {
        for _round in 0..20 {
            let e = Engine::builder()
                .mode(Mode::Lazy)
                .workers(2)
                .backpressure(8, 0)
                .build()
                .unwrap();
            std::thread::scope(|s| {
                for _ in 0..2 {
                    let e = e.clone();
                    s.spawn(move || {
                        let own = e.var(0u64);
                        for _ in 0..300 {
                            let mut t = e.task("inc");
                            let w = t.write(&own);
                            t.push(move || *w.write() += 1).unwrap();
                        }
                    });
                }
            });
            e.wait_all().unwrap();
        }
    });
}

/// `wait_all` in Lazy mode returns while a node recorded by a task is still in the
/// inbox (never demanded, never run): a side effect is missing after the barrier.
#[test]
fn lazy_wait_all_returns_before_nodes_recorded_by_tasks() {
    let e = Engine::builder()
        .mode(Mode::Lazy)
        .workers(2)
        .build()
        .unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let v = e.var(0u32);
    let (e2, h2) = (e.clone(), hits.clone());
    let mut t = e.task("parent");
    let w = t.write(&v);
    t.push(move || {
        *w.write() = 1;
        let h3 = h2.clone();
        e2.task("child")
            .push(move || {
                h3.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
    })
    .unwrap();
    e.wait_all().unwrap();
    assert_eq!(
        hits.load(Ordering::SeqCst),
        1,
        "wait_all returned but the child task never ran; live_nodes now {}",
        e.stats().live_nodes
    );
}

/// Same, with a full inbox batch (64) recorded by one task: the worker applies the
/// batch undemanded, `live_nodes` never reaches 0 and `wait_all` (and Engine drop)
/// hang.
#[test]
fn lazy_wait_all_hangs_when_a_task_records_a_batch() {
    within(20, "wait_all after a task recorded 64 nodes", || {
        let e = Engine::builder()
            .mode(Mode::Lazy)
            .workers(2)
            .build()
            .unwrap();
        let v = e.var(0u32);
        let e2 = e.clone();
        let mut t = e.task("parent");
        let w = t.write(&v);
        t.push(move || {
            *w.write() = 1;
            for _ in 0..64 {
                e2.task("child").push(|| {}).unwrap();
            }
        })
        .unwrap();
        e.wait_all().unwrap();
    });
}

/// `TaskBuilder` keeps only the VarId; if the last handle is dropped between
/// `t.read(&v)` and `push`, the DropVar is applied before the record, the read is
/// untracked and the task runs without waiting for the pending writer.
#[test]
fn read_declared_before_last_handle_drop_loses_dependency() {
    let e = Engine::builder()
        .mode(Mode::Lazy)
        .workers(1)
        .build()
        .unwrap();
    let v = e.var(1u32);
    let out = e.var(0u32);
    let mut t = e.task("write2");
    let w = t.write(&v);
    t.push(move || *w.write() = 2).unwrap();
    let mut t = e.task("copy");
    let r = t.read(&v);
    let wo = t.write(&out);
    drop(v);
    t.push(move || *wo.write() = *r.read()).unwrap();
    assert_eq!(
        out.get().unwrap(),
        2,
        "copy ran before the write it must follow"
    );
}

/// Helping deadlock: T1 blocks (helping) on G's output; its helper loop picks up an
/// independent ready task T2 that blocks on y, whose writer T3 depends on T1. T1 is
/// under T2 on the same stack, so nothing can ever finish, even after G completes.
/// The deadlock check only looks at the innermost running node.
#[test]
fn nested_helping_deadlocks() {
    within(20, "nested helping", || {
        let e = Engine::builder()
            .mode(Mode::Async)
            .workers(2)
            .build()
            .unwrap();
        let (gv, a, y, z) = (e.var(0u32), e.var(0u32), e.var(0u32), e.var(0u32));
        let go = Arc::new(AtomicBool::new(false));
        let g_started = Arc::new(AtomicBool::new(false));
        let t1_in = Arc::new(AtomicBool::new(false));

        let mut t = e.task("G");
        let w = t.write(&gv);
        let (go2, gs2) = (go.clone(), g_started.clone());
        t.push(move || {
            gs2.store(true, Ordering::SeqCst);
            spin_until(&go2);
            *w.write() = 1;
        })
        .unwrap();
        spin_until(&g_started);

        let mut t = e.task("T1");
        let wa = t.write(&a);
        let (gv2, t1_in2) = (gv.clone(), t1_in.clone());
        t.push(move || {
            t1_in2.store(true, Ordering::SeqCst);
            let v = gv2.get().unwrap();
            *wa.write() = v + 1;
        })
        .unwrap();
        spin_until(&t1_in);
        std::thread::sleep(Duration::from_millis(20));

        let mut t = e.task("T3");
        let (ra, wy) = (t.read(&a), t.write(&y));
        t.push(move || *wy.write() = *ra.read() + 1).unwrap();

        let mut t = e.task("T2");
        let wz = t.write(&z);
        let y2 = y.clone();
        t.push(move || *wz.write() = y2.get().unwrap()).unwrap();

        std::thread::sleep(Duration::from_millis(100));
        go.store(true, Ordering::SeqCst);
        assert_eq!(z.get().unwrap(), 3);
    });
}

struct Bomb;
impl Drop for Bomb {
    fn drop(&mut self) {
        panic!("drop of a captured value panicked");
    }
}

/// A skipped task's closure is dropped in `execute` outside `catch_unwind`: a
/// panicking Drop of a captured value kills the worker thread, the node is never
/// completed and its blocker hangs.
#[test]
fn skipped_task_drop_panic_kills_worker() {
    within(
        20,
        "blocker after a skipped task with a panicking Drop",
        || {
            let e = Engine::builder()
                .mode(Mode::Async)
                .workers(1)
                .build()
                .unwrap();
            let (v, out) = (e.var(0u32), e.var(0u32));
            let mut t = e.task("fail");
            let w = t.write(&v);
            t.push(move || {
                *w.write() = 1;
                panic!("boom");
            })
            .unwrap();
            let mut t = e.task("skipped");
            let (r, wo) = (t.read(&v), t.write(&out));
            let bomb = Bomb;
            t.push(move || {
                let _b = &bomb;
                *wo.write() = *r.read();
            })
            .unwrap();
            assert!(out.wait_to_read().is_err());
        },
    );
}

/// Batched completion: A finishes, B (independent, 2 s) is popped from the local
/// deque within the 20 us window and run before A is completed; a frontend waiting
/// for A waits for B too (the doc promises completion within BATCH_WINDOW).
#[test]
fn batched_completion_delays_finished_node_by_unrelated_task() {
    let e = Engine::builder()
        .mode(Mode::Async)
        .workers(1)
        .build()
        .unwrap();
    let (x, a, b) = (e.var(0u32), e.var(0u32), e.var(0u32));
    let gate = Arc::new(AtomicBool::new(false));
    let mut t = e.task("R");
    let w = t.write(&x);
    let g2 = gate.clone();
    t.push(move || {
        spin_until(&g2);
        *w.write() = 1;
    })
    .unwrap();
    let mut t = e.task("A");
    let (r, wa) = (t.read(&x), t.write(&a));
    t.push(move || *wa.write() = *r.read() + 1).unwrap();
    let mut t = e.task("B");
    let (r, wb) = (t.read(&x), t.write(&b));
    t.push(move || {
        std::thread::sleep(Duration::from_secs(2));
        *wb.write() = *r.read();
    })
    .unwrap();
    let start = Instant::now();
    gate.store(true, Ordering::SeqCst);
    assert_eq!(a.get().unwrap(), 2);
    let took = start.elapsed();
    assert!(
        took < Duration::from_millis(500),
        "A's value waited {took:?} for unrelated task B"
    );
}

/// Async (every node demanded), two frontends: after a drain `complete` notifies
/// once and sets `bp_signalled`; the frontend that wakes second can find the other
/// one's new records (`live > low`), waits again, and no later drain notifies it.
#[test]
fn async_two_frontends_backpressure_lost_wakeup() {
    within(20, "two Async frontends under backpressure", || {
        for _round in 0..200 {
            let e = Engine::builder()
                .mode(Mode::Async)
                .workers(1)
                .backpressure(4, 0)
                .build()
                .unwrap();
            std::thread::scope(|s| {
                for k in 0..2 {
                    let e = e.clone();
                    s.spawn(move || {
                        let own = e.var(0u64);
                        for _ in 0..(20 + k * 7) {
                            let mut t = e.task("inc");
                            let w = t.write(&own);
                            t.push(move || {
                                std::hint::black_box(());
                                *w.write() += 1
                            })
                            .unwrap();
                        }
                    });
                }
            });
            e.wait_all().unwrap();
        }
    });
}
