//! The engine ends when its last `Engine` handle goes, even when recorded work
//! holds Vars, Tensors or task handles: that work still runs, and the worker
//! threads exit. One test in this file, since it counts the process's threads.

use lazyflow::{Engine, Mode, Tensor};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn threads() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("a Threads: line")
}

fn eventually(secs: u64, what: &str, cond: impl Fn() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(
            t.elapsed() < Duration::from_secs(secs),
            "{what} (after {secs} s)"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn the_engine_ends_with_its_last_handle_and_recorded_work_still_runs() {
    let baseline = threads();

    // 1. A Lazy task never demanded, whose closure holds a Var, a Tensor and a
    //    task handle of its own engine: dropping the engine runs it, and its
    //    workers exit.
    let ran = Arc::new(AtomicBool::new(false));
    {
        let engine = Engine::builder()
            .mode(Mode::Lazy)
            .workers(2)
            .build()
            .unwrap();
        let x = engine.var(41u32);
        let t = Tensor::ones_in(&engine, [3]);
        let h = engine.task("other").run(|| {}).unwrap();
        let mut task = engine.task("side_effect");
        let w = task.write(&x);
        let (x2, ran2) = (x.clone(), ran.clone());
        task.run(move || {
            *w.write() += 1;
            let _keep = (&x2, &t, &h);
            ran2.store(true, Ordering::SeqCst);
        })
        .unwrap();
        assert!(!ran.load(Ordering::SeqCst), "Lazy: nothing demanded it yet");
        assert!(threads() >= baseline + 2);
        drop(engine);
        // On a plain thread the drop waited for the recorded work, and for the
        // workers to exit.
        assert!(ran.load(Ordering::SeqCst));
        assert_eq!(threads(), baseline);
        // The value is still readable without an Engine handle.
        assert_eq!(x.get().unwrap(), 42);
    }
    eventually(10, "worker threads exit", || threads() == baseline);

    // 2. A hundred engines, each with such a task: every side effect happens and
    //    the thread count returns to its baseline.
    let count = Arc::new(AtomicUsize::new(0));
    for i in 0..100usize {
        let engine = Engine::builder()
            .mode(Mode::Lazy)
            .workers(2)
            .build()
            .unwrap();
        let x = engine.var(i);
        let mut task = engine.task("count");
        let r = task.read(&x);
        let (x2, c) = (x.clone(), count.clone());
        task.run(move || {
            let _keep = &x2;
            c.fetch_add(*r.read() + 1, Ordering::SeqCst);
        })
        .unwrap();
    }
    assert_eq!(count.load(Ordering::SeqCst), (1..=100).sum::<usize>());
    assert_eq!(threads(), baseline, "threads of 100 dropped engines");

    // 3. Values outlive their engine handle: using them starts workers again,
    //    and those exit again afterwards.
    let y = {
        let engine = Engine::builder().workers(2).build().unwrap();
        Tensor::arange_in(&engine, 0.0, 4.0, 1.0)
    };
    eventually(10, "workers exit before reuse", || threads() == baseline);
    let z = (&y + 1.0).relu();
    assert_eq!(z.to_vec().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    assert_eq!(z.sum().item().unwrap(), 10.0);
    let again = y.engine().clone(); // a counted handle made from a value
    let w = &y * 2.0;
    assert_eq!(w.to_vec().unwrap(), vec![0.0, 2.0, 4.0, 6.0]);
    drop(again);
    drop((y, z, w));
    eventually(10, "restarted workers exit", || threads() == baseline);

    // 4. The last handle dropped inside a task of its own engine, and the last
    //    handle of another engine dropped inside that task: neither blocks the
    //    worker, and both engines' recorded work runs.
    let other_ran = Arc::new(AtomicBool::new(false));
    let own_ran = Arc::new(AtomicBool::new(false));
    {
        let a = Engine::builder()
            .mode(Mode::Lazy)
            .workers(1)
            .build()
            .unwrap();
        let b = Engine::builder()
            .mode(Mode::Lazy)
            .workers(1)
            .build()
            .unwrap();
        let bv = b.var(0u32);
        let mut tb = b.task("b_side_effect");
        let w = tb.write(&bv);
        let (bv2, flag) = (bv.clone(), other_ran.clone());
        tb.run(move || {
            let _keep = &bv2;
            *w.write() = 7;
            flag.store(true, Ordering::SeqCst);
        })
        .unwrap();
        // Lazy work of `a` itself, recorded inside its task and demanded by
        // nothing but the engine's retirement.
        let av = a.var(0u32);
        let go = Arc::new(AtomicBool::new(false));
        let (a2, go2, av2, flag) = (a.clone(), go.clone(), av.clone(), own_ran.clone());
        let h = a
            .task("drops_engines")
            .run(move || {
                while !go2.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                let mut t = a2.task("a_side_effect");
                let w = t.write(&av2);
                t.run(move || {
                    *w.write() = 9;
                    flag.store(true, Ordering::SeqCst);
                })
                .unwrap();
                drop(b); // another engine's last handle, on a's worker
                drop(a2); // this engine's last handle, inside its own task
            })
            .unwrap();
        drop(a);
        go.store(true, Ordering::SeqCst);
        h.wait().unwrap();
        eventually(10, "the other engine's work ran", || {
            other_ran.load(Ordering::SeqCst)
        });
        eventually(10, "this engine's work ran", || {
            own_ran.load(Ordering::SeqCst)
        });
        assert_eq!(bv.get().unwrap(), 7);
        assert_eq!(av.get().unwrap(), 9);
    }
    eventually(10, "threads exit after drops inside tasks", || {
        threads() == baseline
    });
}
