//! Engine behaviour through the public API: targeted flush, failures, backpressure,
//! several frontends, blockers inside tasks, memory release and configuration.

use lazyflow::{Engine, Error, Mode, Tensor};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

fn engine(mode: Mode, workers: usize) -> Engine {
    Engine::builder()
        .mode(mode)
        .workers(workers)
        .build()
        .unwrap()
}

#[test]
fn wait_to_read_flushes_only_the_needed_subgraph() {
    let e = engine(Mode::Lazy, 2);
    let (x, y) = (e.var(0u32), e.var(0u32));
    let side_effect = Arc::new(AtomicUsize::new(0));
    {
        let mut t = e.task("needed");
        let w = t.write(&x);
        t.push(move || *w.write() = 7).unwrap();
    }
    {
        let mut t = e.task("unrelated");
        let w = t.write(&y);
        let s = side_effect.clone();
        t.push(move || {
            s.fetch_add(1, Ordering::SeqCst);
            *w.write() = 9;
        })
        .unwrap();
    }
    // Nothing has run yet in Lazy mode.
    assert_eq!(e.stats().completed, 0);
    x.wait_to_read().unwrap();
    assert_eq!(x.get().unwrap(), 7);
    let stats = e.stats();
    assert_eq!(stats.completed, 1, "only the needed node ran");
    assert_eq!(stats.live_nodes, 1, "the unrelated node is still pending");
    assert_eq!(side_effect.load(Ordering::SeqCst), 0);
    assert!(stats.blockers >= 1 && stats.implicit_blockers >= 1);
    e.wait_all().unwrap();
    assert_eq!(side_effect.load(Ordering::SeqCst), 1);
    assert_eq!(y.get().unwrap(), 9);
    assert_eq!(e.stats().live_nodes, 0);
}

#[test]
fn async_mode_runs_without_a_blocker() {
    let e = engine(Mode::Async, 2);
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let t = e.task("effect").run(move || {
        h.fetch_add(1, Ordering::SeqCst);
    });
    let handle = t.unwrap();
    let start = std::time::Instant::now();
    while !handle.is_finished() && start.elapsed().as_secs() < 10 {
        std::thread::yield_now();
    }
    assert_eq!(hits.load(Ordering::SeqCst), 1);
}

#[test]
fn sync_mode_completes_each_call_and_reports_failure_at_the_call() {
    let e = engine(Mode::Sync, 2);
    let x = e.var(1i64);
    let mut t = e.task("double");
    let w = t.write(&x);
    let h = t.run(move || *w.write() *= 2).unwrap();
    assert!(h.is_finished());
    let err = e.task("broken").run(|| panic!("bad input")).unwrap_err();
    assert!(err.to_string().contains("broken") && err.to_string().contains("bad input"));
    assert_eq!(x.get().unwrap(), 2);
}

#[test]
fn failure_poisons_dependents_only() {
    for mode in [Mode::Lazy, Mode::Async] {
        let e = engine(mode, 2);
        let (a, b, c) = (e.var(0u32), e.var(0u32), e.var(0u32));
        let (line, mut t) = (line!(), e.task("exploding_op"));
        let w = t.write(&a);
        t.push(move || {
            let _w = w.write();
            panic!("kaboom")
        })
        .unwrap();
        // b depends on a, c does not.
        let mut t = e.task("dependent");
        let (r, w) = (t.read(&a), t.write(&b));
        t.push(move || *w.write() = *r.read() + 1).unwrap();
        let mut t = e.task("independent");
        let w = t.write(&c);
        t.push(move || *w.write() = 5).unwrap();

        let err = b.wait_to_read().unwrap_err();
        match &err {
            Error::Failed {
                op,
                location,
                message,
            } => {
                assert_eq!(op, "exploding_op");
                assert!(message.contains("kaboom"));
                assert_eq!(location.line(), line, "{err}");
                assert!(location.file().ends_with("engine.rs"));
            }
            other => panic!("unexpected error {other:?}"),
        }
        assert!(a.get().is_err());
        assert_eq!(c.get().unwrap(), 5);
        // The engine keeps accepting work, and rewriting a poisoned Var heals it.
        a.set(10).unwrap();
        let mut t = e.task("after");
        let (r, w) = (t.read(&a), t.write(&b));
        t.push(move || *w.write() = *r.read() + 1).unwrap();
        assert_eq!(b.get().unwrap(), 11);
        let s = e.stats();
        assert_eq!((s.failed, s.skipped), (1, 1));
    }
}

#[test]
fn task_handle_reports_failure_and_try_run_errors() {
    let e = engine(Mode::Lazy, 2);
    let h = e.task("fallible").try_run(|| Err("no luck")).unwrap();
    let err = h.wait().unwrap_err();
    assert!(err.to_string().contains("fallible") && err.to_string().contains("no luck"));
    let ok = e.task("fine").run(|| {}).unwrap();
    ok.wait().unwrap();
}

#[test]
fn backpressure_bounds_pending_nodes_over_a_million_ops() {
    for mode in [Mode::Lazy, Mode::Async] {
        let (high, low) = (4096, 1024);
        let e = Engine::builder()
            .mode(mode)
            .workers(2)
            .backpressure(high, low)
            .build()
            .unwrap();
        let x = e.var(0u64);
        for _ in 0..1_000_000 {
            let mut t = e.task("inc");
            let w = t.write(&x);
            t.push(move || *w.write() += 1).unwrap();
        }
        assert_eq!(x.get().unwrap(), 1_000_000);
        let s = e.stats();
        assert!(
            s.peak_live_nodes <= high,
            "peak {} above {high}",
            s.peak_live_nodes
        );
        // (In Lazy mode the workers run each window of 512 while the
        // frontend records the next, and may keep up without a stall.)
        drop(x);
        let s = e.stats();
        assert_eq!((s.live_nodes, s.live_vars, s.tracked_vars), (0, 0, 0));
    }
}

#[test]
fn a_lazy_frontend_that_outruns_the_workers_stalls_at_the_bound() {
    let (high, tasks) = (256, 2_000);
    let e = Engine::builder()
        .mode(Mode::Lazy)
        .workers(2)
        .backpressure(high, 0)
        .build()
        .unwrap();
    let x = e.var(0u64);
    for _ in 0..tasks {
        let mut t = e.task("slow inc");
        let w = t.write(&x);
        t.push(move || {
            std::thread::sleep(std::time::Duration::from_micros(50));
            *w.write() += 1
        })
        .unwrap();
    }
    assert_eq!(x.get().unwrap(), tasks);
    let s = e.stats();
    assert!(s.backpressure_stalls > 0, "{s:?}");
    assert!(
        s.peak_live_nodes <= high,
        "peak {} above {high}",
        s.peak_live_nodes
    );
}

/// A worker counts the nodes it completes out of the live count in groups;
/// a stall must not wait for the group of a worker that then blocks inside a
/// task on something outside the engine (here, the stalled frontend itself).
#[test]
fn a_stall_ends_while_a_worker_that_ran_nodes_blocks_outside_the_engine() {
    use std::sync::mpsc::channel;
    use std::time::Duration;
    let (high, low, chain) = (40usize, 20usize, 30u64);
    let (done_tx, done_rx) = channel();
    let frontend = std::thread::spawn(move || {
        let e = Engine::builder()
            .mode(Mode::Async)
            .workers(2)
            .backpressure(high, low)
            .build()
            .unwrap();
        let (a, c) = (e.var(0u64), e.var(0u64));
        // A gate, then a chain behind it, then a task that blocks until the
        // frontend gets past its records: the chain and the blocking task
        // run back to back on the gate's worker, which never finds itself
        // without work in between.
        let (go_tx, go_rx) = channel::<()>();
        let (started_tx, started_rx) = channel::<()>();
        let (release_tx, release_rx) = channel::<()>();
        let mut t = e.task("gate");
        let w = t.write(&a);
        t.push(move || {
            go_rx.recv().unwrap();
            drop(w)
        })
        .unwrap();
        for _ in 0..chain {
            let mut t = e.task("step");
            let w = t.write(&a);
            t.push(move || *w.write() += 1).unwrap();
        }
        let mut t = e.task("blocks outside");
        let w = t.write(&a);
        t.push(move || {
            started_tx.send(()).unwrap();
            release_rx.recv().unwrap();
            *w.write() += 1
        })
        .unwrap();
        go_tx.send(()).unwrap();
        started_rx.recv().unwrap();
        // Readers of the blocked task's value, which cannot run: with the
        // blocked task, fewer unfinished nodes than the low mark, so no
        // stall waits for them; but with the chain's nodes still counted
        // live they would be over the high mark.
        let sum = Arc::new(AtomicUsize::new(0));
        for _ in 0..(low - 5) {
            let mut t = e.task("reads the blocked value");
            let (r, w) = (t.read(&a), t.write(&c));
            let sum = sum.clone();
            t.push(move || {
                sum.fetch_add(*r.read() as usize, Ordering::SeqCst);
                *w.write() += 1
            })
            .unwrap();
        }
        assert_eq!(
            e.stats().live_nodes,
            low - 4,
            "the blocked task and its readers"
        );
        release_tx.send(()).unwrap();
        e.wait_all().unwrap();
        done_tx
            .send((
                a.get().unwrap(),
                c.get().unwrap(),
                sum.load(Ordering::SeqCst),
            ))
            .unwrap();
    });
    let (a, c, sum) = done_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the frontend got past its records (no stall waited for the blocked worker)");
    frontend.join().unwrap();
    assert_eq!(a, chain + 1);
    assert_eq!(c as usize, low - 5);
    assert_eq!(
        sum as u64,
        c * (chain + 1),
        "each reader saw the blocked task's write"
    );
}

#[test]
fn tensor_loop_releases_everything() {
    let e = Engine::builder()
        .workers(2)
        .backpressure(1000, 100)
        .build()
        .unwrap();
    {
        let mut x = Tensor::zeros_in(&e, [4]);
        for _ in 0..100_000 {
            x = &x + 1.0;
        }
        assert_eq!(x.to_vec().unwrap(), vec![100_000.0; 4]);
        assert!(e.stats().peak_live_nodes <= 1000);
    }
    let s = e.stats();
    assert_eq!((s.live_nodes, s.live_vars, s.tracked_vars), (0, 0, 0));
}

#[test]
fn dropped_values_are_freed_after_pending_accesses() {
    let e = engine(Mode::Lazy, 1);
    let x = e.var(vec![1u8; 1024]);
    let out = e.var(0usize);
    let mut t = e.task("len");
    let (r, w) = (t.read(&x), t.write(&out));
    t.push(move || *w.write() = r.read().len()).unwrap();
    drop(x);
    // The pending reader keeps the data alive.
    assert_eq!(e.stats().live_vars, 2);
    assert_eq!(e.stats().tracked_vars, 1);
    assert_eq!(out.get().unwrap(), 1024);
    assert_eq!(e.stats().live_vars, 1);
}

#[test]
fn four_frontend_threads_match_the_sequential_reference() {
    for mode in [Mode::Lazy, Mode::Async, Mode::Sync] {
        let e = engine(mode, 2);
        let shared = e.var(0u64);
        let n = 2_000u64;
        let outs: Vec<u64> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4u64)
                .map(|k| {
                    let (e, shared) = (e.clone(), shared.clone());
                    s.spawn(move || {
                        let own = e.var(k);
                        for i in 0..n {
                            // Private chain: own = own * 3 + i (mod 2^64).
                            let mut t = e.task("own");
                            let w = t.write(&own);
                            t.push(move || {
                                let mut v = w.write();
                                *v = v.wrapping_mul(3).wrapping_add(i);
                            })
                            .unwrap();
                            // Shared commutative update: order between threads is
                            // free, but no update may be lost.
                            let mut t = e.task("shared");
                            let w = t.write(&shared);
                            t.push(move || *w.write() += k + 1).unwrap();
                        }
                        own.get().unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (k, got) in outs.iter().enumerate() {
            let mut want = k as u64;
            for i in 0..n {
                want = want.wrapping_mul(3).wrapping_add(i);
            }
            assert_eq!(*got, want, "thread {k} in {mode:?}");
        }
        assert_eq!(shared.get().unwrap(), n * (1 + 2 + 3 + 4));
    }
}

#[test]
fn blockers_inside_tasks_help_instead_of_deadlocking() {
    for workers in [1, 2] {
        let e = engine(Mode::Lazy, workers);
        let x = e.var(0u32);
        let y = e.var(0u32);
        let mut t = e.task("produce");
        let w = t.write(&x);
        t.push(move || *w.write() = 41).unwrap();
        // A task that itself waits for another value (not one of its declared
        // inputs), even with a single worker.
        let (x2, e2) = (x.clone(), e.clone());
        let mut t = e.task("nested");
        let w = t.write(&y);
        t.push(move || {
            let v = x2.get().unwrap();
            // Recording from inside a task works too.
            let mut inner = e2.task("inner");
            let wx = inner.write(&x2);
            inner.push(move || *wx.write() += 1).unwrap();
            *w.write() = v + 1;
        })
        .unwrap();
        assert_eq!(y.get().unwrap(), 42);
        assert_eq!(x.get().unwrap(), 42);
        drop(x);
    }
}

#[test]
fn waiting_on_own_output_inside_a_task_is_an_error() {
    let e = engine(Mode::Lazy, 1);
    let x = e.var(0u32);
    let result = e.var(String::new());
    let (x2, e2) = (x.clone(), e.clone());
    let mut t = e.task("self_waiter");
    let (w, wr) = (t.write(&x), t.write(&result));
    t.push(move || {
        let err = x2.wait_to_read().unwrap_err();
        let err2 = e2.wait_all().unwrap_err();
        *wr.write() = format!("{err} / {err2}");
        *w.write() = 1;
    })
    .unwrap();
    let msg = result.get().unwrap();
    assert!(
        msg.contains("self_waiter") && msg.contains("own output"),
        "{msg}"
    );
    assert_eq!(x.get().unwrap(), 1);
}

#[test]
fn mixing_engines_is_an_error() {
    let (a, b) = (engine(Mode::Lazy, 1), engine(Mode::Lazy, 1));
    let x = a.var(1);
    let mut t = b.task("mixed");
    let _r = t.read(&x);
    let err = t.run(|| {}).unwrap_err();
    assert!(matches!(err, Error::EngineMismatch { op: "mixed", .. }));
    let ta = Tensor::ones_in(&a, [2]);
    let tb = Tensor::ones_in(&b, [2]);
    assert!(matches!(ta.add(&tb), Err(Error::EngineMismatch { .. })));
}

/// Settings given in code (the environment is read in `builder_env.rs`, alone in
/// its process).
#[test]
fn builder_validates_its_settings() {
    assert!(matches!(
        Engine::builder().workers(0).build(),
        Err(Error::Config(_))
    ));
    assert!(matches!(
        Engine::builder().backpressure(10, 20).build(),
        Err(Error::Config(_))
    ));
    assert!(matches!(
        Engine::builder().cpu_threads(0).build(),
        Err(Error::Config(_))
    ));
    assert!("fast".parse::<Mode>().is_err());
    assert_eq!("ASYNC".parse::<Mode>().unwrap(), Mode::Async);
    let e = Engine::builder()
        .mode(Mode::Sync)
        .workers(3)
        .cpu_threads(2)
        .build()
        .unwrap();
    assert_eq!((e.mode(), e.workers(), e.cpu_threads()), (Mode::Sync, 3, 2));
}

#[test]
fn dot_export_shows_pending_nodes() {
    let e = engine(Mode::Lazy, 1);
    let x = e.var(0);
    let mut t = e.task("first");
    let w = t.write(&x);
    t.push(move || *w.write() += 1).unwrap();
    let mut t = e.task("second");
    let w = t.write(&x);
    t.push(move || *w.write() += 1).unwrap();
    let dot = e.to_dot();
    assert!(
        dot.contains("first") && dot.contains("second") && dot.contains("->"),
        "{dot}"
    );
    e.wait_all().unwrap();
    assert!(!e.to_dot().contains("first"));
}

#[test]
fn an_allocation_failure_fails_the_node_instead_of_aborting() {
    let e = engine(Mode::Lazy, 2);
    // About isize::MAX bytes (8 EiB), the most one allocation may ask for: no
    // machine has that much memory or address space, with overcommit or not, so
    // the allocator refuses it (a larger request would stop at the capacity
    // check before reaching the allocator).
    let n = isize::MAX as usize / 4;
    let huge = Tensor::zeros_in(&e, [n]);
    let line = line!() - 1;
    let err = huge.sum().item().unwrap_err();
    match &err {
        Error::Failed {
            op,
            message,
            location,
        } => {
            assert_eq!(op, "zeros", "{err}");
            assert!(message.contains("out of memory"), "{err}");
            assert!(message.contains(&n.to_string()), "{err}");
            assert_eq!((location.file(), location.line()), (file!(), line), "{err}");
        }
        other => panic!("expected the failure of `zeros`, got {other:?}"),
    }
    // Everything else goes on.
    assert_eq!(Tensor::ones_in(&e, [3]).sum().item().unwrap(), 3.0);
}

#[test]
fn a_value_read_back_has_its_writer_counted_out() {
    // The blocker returns only once the writer is finished in every respect:
    // counted out of the live nodes, and its task handle finished.
    for mode in [Mode::Async, Mode::Lazy] {
        let e = Engine::builder().mode(mode).workers(2).build().unwrap();
        let x = e.var(0u64);
        for i in 0..20_000u64 {
            let mut t = e.task("set");
            let w = t.write(&x);
            let h = t.run(move || *w.write() = i).unwrap();
            assert_eq!(x.get().unwrap(), i);
            assert!(h.is_finished());
            assert_eq!(e.stats().live_nodes, 0, "{mode:?}: after reading back {i}");
        }
    }
}

/// A task may name one Var several times (reads before and after a write):
/// the graph merges them into one access that reads and writes, so the task
/// waits for the writer before it and the readers after it wait for it, in
/// every mode.
#[test]
fn a_var_named_several_times_by_one_task_is_one_read_write_access() {
    for mode in [Mode::Lazy, Mode::Async, Mode::Sync] {
        let e = engine(mode, 2);
        let x = e.var(1u64);
        for step in 0..50u64 {
            let mut t = e.task("slow_write");
            let w = t.write(&x);
            t.push(move || {
                std::thread::sleep(std::time::Duration::from_micros(50));
                *w.write() += step;
            })
            .unwrap();
            let mut t = e.task("named_thrice");
            let r1 = t.read(&x);
            let w = t.write(&x);
            let r2 = t.read(&x);
            t.push(move || {
                drop((r1, r2));
                *w.write() *= 2;
            })
            .unwrap();
        }
        let mut expected = 1u64;
        for step in 0..50u64 {
            expected = (expected + step) * 2 % (1 << 40);
        }
        let got = x.get().unwrap() % (1 << 40);
        assert_eq!(got, expected, "{mode:?}");
    }
}
