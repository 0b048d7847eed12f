//! Regression tests, one per engine bug fixed: hangs, lost wake-ups and ordering
//! mistakes found in interleavings of several frontends, tasks that record or
//! block, backpressure and batched completion. A hang is detected by running the
//! scenario on a separate thread with a deadline (a hung thread is leaked).
//! Finishing is not enough: each scenario also checks what it computed against
//! values worked out by hand, and that the barrier it ends with ran every task
//! (counted by the tasks themselves, before any blocker could run them).

mod common;

use common::within;
use lazyflow::{Engine, Error, Mode};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn spin_until(flag: &AtomicBool) {
    let t = Instant::now();
    while !flag.load(Ordering::SeqCst) {
        assert!(t.elapsed() < Duration::from_secs(30), "flag never set");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Lazy + backpressure, a task that records: the stalled frontend's batch and the
/// child used to enter the graph undemanded while the frontend waited for the low
/// mark forever. Now records from tasks go straight to the graph, and every node
/// entering it while a frontend is stalled is demanded.
#[test]
fn lazy_backpressure_with_a_task_that_records_finishes() {
    let (ran, sink, vs) = within(20, "Lazy backpressure + task that records", || {
        let e = Engine::builder()
            .mode(Mode::Lazy)
            .workers(2)
            .backpressure(4, 0)
            .build()
            .unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        let sink = e.var(0u64);
        let mut vs = Vec::new();
        for _ in 0..12 {
            let v = e.var(0u64);
            let (e2, sink2, ran2) = (e.clone(), sink.clone(), ran.clone());
            let mut t = e.task("parent");
            let w = t.write(&v);
            t.push(move || {
                *w.write() += 1;
                let mut c = e2.task("child");
                let ws = c.write(&sink2);
                c.push(move || {
                    *ws.write() += 1;
                    ran2.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap();
            })
            .unwrap();
            vs.push(v);
        }
        e.wait_all().unwrap();
        let ran = ran.load(Ordering::SeqCst);
        let vs: Vec<u64> = vs.iter().map(|v| v.get().unwrap()).collect();
        (ran, sink.get().unwrap(), vs)
    });
    assert_eq!(ran, 12, "children run by wait_all");
    assert_eq!(sink, 12, "one increment per child");
    assert_eq!(vs, vec![1; 12], "one increment per parent");
}

/// Same stall, with a task that only calls a blocker (which applies the inbox):
/// the applied batch used to stay undemanded.
#[test]
fn lazy_backpressure_with_a_task_that_blocks_finishes() {
    let (ran, vs) = within(20, "Lazy backpressure + blocker inside task", || {
        let e = Engine::builder()
            .mode(Mode::Lazy)
            .workers(2)
            .backpressure(4, 0)
            .build()
            .unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        let z = e.var(7u64);
        let mut vs = Vec::new();
        for i in 0..12u64 {
            let v = e.var(i);
            let (z2, ran2) = (z.clone(), ran.clone());
            let mut t = e.task("reader");
            let w = t.write(&v);
            t.push(move || {
                *w.write() += z2.get().unwrap();
                ran2.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
            vs.push(v);
        }
        e.wait_all().unwrap();
        let ran = ran.load(Ordering::SeqCst);
        (ran, vs.iter().map(|v| v.get().unwrap()).collect::<Vec<_>>())
    });
    assert_eq!(ran, 12, "readers run by wait_all");
    assert_eq!(vs, (7..19).collect::<Vec<u64>>(), "i + 7 in the i-th Var");
}

/// Two Lazy frontends stalled together: the second to wake used to find the
/// graph refilled, wait again, and never be notified. Every waiter that goes back
/// to sleep now re-arms the notification.
#[test]
fn lazy_backpressure_wakes_every_stalled_frontend() {
    let rounds = within(20, "two Lazy frontends under backpressure", || {
        let mut rounds = Vec::new();
        for _round in 0..20 {
            let e = Engine::builder()
                .mode(Mode::Lazy)
                .workers(2)
                .backpressure(8, 0)
                .build()
                .unwrap();
            let ran = Arc::new(AtomicUsize::new(0));
            let owns = std::thread::scope(|s| {
                let frontends: Vec<_> = (0..2)
                    .map(|_| {
                        let (e, ran) = (e.clone(), ran.clone());
                        s.spawn(move || {
                            let own = e.var(0u64);
                            for _ in 0..300 {
                                let mut t = e.task("inc");
                                let w = t.write(&own);
                                let ran = ran.clone();
                                t.push(move || {
                                    *w.write() += 1;
                                    ran.fetch_add(1, Ordering::SeqCst);
                                })
                                .unwrap();
                            }
                            own
                        })
                    })
                    .collect();
                frontends
                    .into_iter()
                    .map(|f| f.join().unwrap())
                    .collect::<Vec<_>>()
            });
            e.wait_all().unwrap();
            let ran = ran.load(Ordering::SeqCst);
            let values: Vec<u64> = owns.iter().map(|v| v.get().unwrap()).collect();
            rounds.push((ran, values));
        }
        rounds
    });
    for (round, (ran, values)) in rounds.into_iter().enumerate() {
        assert_eq!(ran, 600, "round {round}: tasks run by wait_all");
        assert_eq!(
            values,
            vec![300, 300],
            "round {round}: increments per frontend"
        );
    }
}

/// `wait_all` in Lazy mode used to return while a node recorded by a task sat in
/// the inbox, never run.
#[test]
fn lazy_wait_all_runs_nodes_recorded_by_tasks() {
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
    assert_eq!(v.get().unwrap(), 1);
}

/// Same, with a full batch (64) recorded by one task: it used to enter the graph
/// undemanded, and `wait_all` (and engine drop) hung.
#[test]
fn lazy_wait_all_with_a_task_recording_a_batch_finishes() {
    let (ran, sum, v) = within(20, "wait_all after a task recorded 64 nodes", || {
        let e = Engine::builder()
            .mode(Mode::Lazy)
            .workers(2)
            .build()
            .unwrap();
        let v = e.var(0u32);
        let sum = e.var(0u64);
        let ran = Arc::new(AtomicUsize::new(0));
        let (e2, sum2, ran2) = (e.clone(), sum.clone(), ran.clone());
        let mut t = e.task("parent");
        let w = t.write(&v);
        t.push(move || {
            *w.write() = 1;
            for i in 0..64u64 {
                let mut c = e2.task("child");
                let ws = c.write(&sum2);
                let ran = ran2.clone();
                c.push(move || {
                    *ws.write() += i;
                    ran.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap();
            }
        })
        .unwrap();
        e.wait_all().unwrap();
        let ran = ran.load(Ordering::SeqCst);
        (ran, sum.get().unwrap(), v.get().unwrap())
    });
    assert_eq!(ran, 64, "children run by wait_all");
    assert_eq!(sum, 64 * 63 / 2, "0 + 1 + ... + 63");
    assert_eq!(v, 1);
}

/// If the last handle was dropped between `t.read(&v)` and `push`, the Var used
/// to be forgotten before the record, which then ran without waiting for the
/// pending writer. The builder now borrows the Var until the record, so that
/// drop does not compile (see `TaskBuilder`'s `compile_fail` example); the
/// last handle dropped right after the record must still leave the copy
/// ordered after the write.
#[test]
fn access_declared_before_the_last_handle_is_dropped_keeps_its_dependency() {
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
    t.push(move || *wo.write() = *r.read()).unwrap();
    drop(v);
    assert_eq!(
        out.get().unwrap(),
        2,
        "copy ran before the write it must follow"
    );
}

/// Helping: T1 blocks on G's output; its helper loop used to pick up any ready
/// task, here T2, which blocks on y, whose writer T3 depends on T1 (suspended
/// under T2 on the same stack). Helpers now run only ancestors of what they wait
/// for, and the deadlock check looks at every task suspended on the thread.
#[test]
fn helping_blocker_runs_only_what_it_waits_for() {
    let values = within(20, "nested helping", || {
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
        let z = z.get().unwrap();
        (gv.get().unwrap(), a.get().unwrap(), y.get().unwrap(), z)
    });
    // G writes 1, T1 adds 1, T3 adds 1, T2 copies.
    assert_eq!(values, (1, 2, 3, 3));
}

struct Bomb;
impl Drop for Bomb {
    fn drop(&mut self) {
        panic!("drop of a captured value panicked");
    }
}

/// A skipped task's closure is dropped without running; a panicking Drop of a
/// captured value used to kill the worker thread and hang its blockers.
#[test]
fn panicking_drop_of_a_skipped_task_is_contained() {
    let (err, ran, later) = within(
        20,
        "blocker after a skipped task with a panicking Drop",
        || {
            let e = Engine::builder()
                .mode(Mode::Async)
                .workers(1)
                .build()
                .unwrap();
            let (v, out) = (e.var(0u32), e.var(0u32));
            let skipped_ran = Arc::new(AtomicBool::new(false));
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
            let ran = skipped_ran.clone();
            t.push(move || {
                let _b = &bomb;
                ran.store(true, Ordering::SeqCst);
                *wo.write() = *r.read();
            })
            .unwrap();
            let err = out.wait_to_read().unwrap_err();
            // The worker survived: unrelated work still runs on it.
            let later = e.var(0u32);
            let mut t = e.task("later");
            let w = t.write(&later);
            t.push(move || *w.write() = 5).unwrap();
            let later = later.get().unwrap();
            (err, skipped_ran.load(Ordering::SeqCst), later)
        },
    );
    match &err {
        Error::Failed { op, message, .. } => {
            assert_eq!(op, "fail", "the op that failed first: {err}");
            assert!(message.contains("boom"), "{err}");
        }
        other => panic!("expected a failure naming `fail`, got {other:?}"),
    }
    assert!(!ran, "the dependent of a failed task must not run");
    assert_eq!(later, 5);
}

/// Batched completion: A finishes, then B (independent, 2 s) used to be popped
/// and run before A was completed, so a frontend waiting for A waited for B too.
/// Completion is now deferred only while the engine lock is busy.
#[test]
fn finished_node_is_not_held_back_by_an_unrelated_long_task() {
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
    assert_eq!(b.get().unwrap(), 1, "B copies R's value");
}

/// Async, two frontends: after a drain the frontend that woke second could find
/// the other one's new records, wait again, and never be notified.
#[test]
fn async_backpressure_wakes_every_stalled_frontend() {
    let rounds = within(20, "two Async frontends under backpressure", || {
        let mut rounds = Vec::new();
        for _round in 0..200 {
            let e = Engine::builder()
                .mode(Mode::Async)
                .workers(1)
                .backpressure(4, 0)
                .build()
                .unwrap();
            let ran = Arc::new(AtomicUsize::new(0));
            let owns = std::thread::scope(|s| {
                let frontends: Vec<_> = (0..2u64)
                    .map(|k| {
                        let (e, ran) = (e.clone(), ran.clone());
                        s.spawn(move || {
                            let own = e.var(0u64);
                            for _ in 0..(20 + k * 7) {
                                let mut t = e.task("inc");
                                let w = t.write(&own);
                                let ran = ran.clone();
                                t.push(move || {
                                    std::hint::black_box(());
                                    *w.write() += 1;
                                    ran.fetch_add(1, Ordering::SeqCst);
                                })
                                .unwrap();
                            }
                            own
                        })
                    })
                    .collect();
                frontends
                    .into_iter()
                    .map(|f| f.join().unwrap())
                    .collect::<Vec<_>>()
            });
            e.wait_all().unwrap();
            let ran = ran.load(Ordering::SeqCst);
            let values: Vec<u64> = owns.iter().map(|v| v.get().unwrap()).collect();
            rounds.push((ran, values));
        }
        rounds
    });
    for (round, (ran, values)) in rounds.into_iter().enumerate() {
        assert_eq!(ran, 20 + 27, "round {round}: tasks run by wait_all");
        assert_eq!(
            values,
            vec![20, 27],
            "round {round}: increments per frontend"
        );
    }
}
