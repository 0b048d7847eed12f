//! Tensor ops on every device, against the CPU device: each test runs once per
//! device (`name::cpu`, `name::gpu0`, `name::gpu_others`, see `common/`), and
//! tests of what only GPUs do run once per GPU.
//!
//! With `LAZYFLOW_REQUIRE_GPU=1` (set by `.ci/run`, which installs Mesa's lavapipe)
//! finding no GPU adapter is a failure, not a skip.

mod common;

use common::{device_test, gpu_test};
use lazyflow::{Device, Engine, Error, Mode, Tensor};

fn engine(mode: Mode) -> Engine {
    Engine::builder().mode(mode).workers(2).build().unwrap()
}

fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 1000) as f32 / 250.0 - 2.0
        })
        .collect()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = 1e-5 + 1e-5 * w.abs();
        assert!(
            (g - w).abs() <= tol || (g.is_nan() && w.is_nan()) || g == w,
            "{what}: element {i}: {g} vs cpu {w}"
        );
    }
}

fn binary_ops_with_broadcasting_match_the_cpu(device: Device) {
    let e = engine(Mode::Lazy);
    let shapes: &[(&[usize], &[usize])] = &[
        (&[1], &[1]),
        (&[7], &[7]),
        (&[257], &[1]),
        (&[3, 1], &[1, 5]),
        (&[2, 3, 4], &[4]),
        (&[4], &[2, 3, 4]),
        (&[300, 7], &[300, 1]),
        (&[0, 3], &[3]),
    ];
    type Op = fn(&Tensor, &Tensor) -> lazyflow::Result<Tensor>;
    let ops: &[(&str, Op)] = &[
        ("add", Tensor::add),
        ("sub", Tensor::sub),
        ("mul", Tensor::mul),
        ("div", Tensor::div),
        ("maximum", Tensor::maximum),
        ("minimum", Tensor::minimum),
        ("eq", Tensor::eq),
        ("ne", Tensor::ne),
        ("lt", Tensor::lt),
        ("le", Tensor::le),
        ("gt", Tensor::gt),
        ("ge", Tensor::ge),
    ];
    for (sa, sb) in shapes {
        let na: usize = sa.iter().product();
        let nb: usize = sb.iter().product();
        let a = Tensor::from_vec_in(&e, data(na, 1), *sa).unwrap();
        // Some equal values so that comparisons see ties.
        let mut bd = data(nb, 7);
        if let (Some(first), Some(&a0)) = (bd.first_mut(), data(na, 1).first()) {
            *first = a0;
        }
        let b = Tensor::from_vec_in(&e, bd, *sb).unwrap();
        let (ga, gb) = (a.to(device).unwrap(), b.to(device).unwrap());
        for (name, op) in ops {
            let want = op(&a, &b).unwrap().to_vec().unwrap();
            let got = op(&ga, &gb).unwrap();
            assert_eq!(got.device(), device);
            assert_close(
                &got.to_vec().unwrap(),
                &want,
                &format!("{name} {sa:?} {sb:?} on {device}"),
            );
        }
    }
}
device_test!(binary_ops_with_broadcasting_match_the_cpu);

fn unary_and_scalar_ops_match_the_cpu(device: Device) {
    let e = engine(Mode::Async);
    for n in [1usize, 5, 256, 1000] {
        let x = Tensor::from_vec_in(&e, data(n, 3), [n]).unwrap();
        let pos = x.abs() + 0.5;
        let (gx, gpos) = (x.to(device).unwrap(), pos.to(device).unwrap());
        let pairs: Vec<(&str, Tensor, Tensor)> = vec![
            ("neg", x.neg(), gx.neg()),
            ("exp", x.exp(), gx.exp()),
            ("log", pos.log(), gpos.log()),
            ("sqrt", pos.sqrt(), gpos.sqrt()),
            ("abs", x.abs(), gx.abs()),
            ("relu", x.relu(), gx.relu()),
            ("sigmoid", (&x * 30.0).sigmoid(), (&gx * 30.0).sigmoid()),
            ("tanh", (&x * 30.0).tanh(), (&gx * 30.0).tanh()),
            ("x + 1", &x + 1.0, &gx + 1.0),
            ("2 - x", 2.0 - &x, 2.0 - &gx),
            ("x / 4", &x / 4.0, &gx / 4.0),
            ("pos ^ 1.5", pos.powf(1.5), gpos.powf(1.5)),
            ("x > 0", x.gt_scalar(0.0), gx.gt_scalar(0.0)),
        ];
        for (name, cpu, g) in pairs {
            let want = cpu.to_vec().unwrap();
            let got = g.to_vec().unwrap();
            // exp, log, pow and tanh are approximations on GPUs.
            let tol = 2e-4;
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= tol * (1.0 + b.abs()),
                    "{name} n={n} on {device}: element {i}: {a} vs {b}"
                );
            }
        }
    }
}
device_test!(unary_and_scalar_ops_match_the_cpu);

fn dependent_chains_and_mixed_devices_give_the_sequential_result(device: Device) {
    for mode in [Mode::Lazy, Mode::Async, Mode::Sync] {
        let e = engine(mode);
        // x = x + 1, 200 times on the GPU, one read at the end.
        let mut x = Tensor::zeros_in(&e, [33]).to(device).unwrap();
        for _ in 0..200 {
            x = &x + 1.0;
        }
        assert_eq!(x.to_vec().unwrap(), vec![200.0; 33], "{mode:?} on {device}");
        // CPU -> GPU -> CPU -> GPU, each step depending on the last.
        let a = Tensor::arange_in(&e, 0.0, 10.0, 1.0);
        let b = (a.to(device).unwrap() * 2.0).to(Device::Cpu).unwrap();
        let c = (b.exp().log() + 1.0).to(device).unwrap();
        let d = (&c * &c).to_vec().unwrap();
        let want: Vec<f32> = (0..10).map(|i| (2.0 * i as f32 + 1.0).powi(2)).collect();
        assert_close(&d, &want, &format!("mixed chain {mode:?} on {device}"));
        // Results kept alive and read in reverse order.
        let base = Tensor::ones_in(&e, [17]).to(device).unwrap();
        let ys: Vec<Tensor> = (0..50).map(|i| &base * i as f32).collect();
        for (i, y) in ys.iter().enumerate().rev() {
            assert_eq!(y.to_vec().unwrap(), vec![i as f32; 17]);
        }
        // wait_all is a barrier for the GPU too.
        e.wait_all().unwrap();
    }
}
device_test!(dependent_chains_and_mixed_devices_give_the_sequential_result);

fn two_logical_devices_and_cross_device_copies(gpu: Device) {
    let e = Engine::builder()
        .workers(2)
        .logical_devices(2)
        .build()
        .unwrap();
    // The two logical devices this engine opened on `gpu`'s adapter.
    let adapter = common::adapter(gpu).expect("a GPU of the probe engine");
    let on_adapter: Vec<Device> = e
        .devices()
        .into_iter()
        .filter(|d| {
            e.gpu_info(*d)
                .is_some_and(|i| (i.name, i.backend) == adapter)
        })
        .collect();
    assert_eq!(on_adapter.len(), 2, "logical devices on {adapter:?}");
    let (g0, g1) = (on_adapter[0], on_adapter[1]);
    let x = Tensor::from_vec_in(&e, data(100, 5), [100]).unwrap();
    let on0 = &x.to(g0).unwrap() + 3.0;
    let on1 = on0.to(g1).unwrap() * 2.0;
    let want: Vec<f32> = data(100, 5).iter().map(|v| (v + 3.0) * 2.0).collect();
    assert_close(&on1.to_vec().unwrap(), &want, "g0 -> g1");
    // Operands on different devices are rejected at record time.
    assert!(matches!(on0.add(&on1), Err(Error::DeviceMismatch { .. })));
}
gpu_test!(two_logical_devices_and_cross_device_copies);

fn bad_devices_are_clear_errors(gpu: Device) {
    let e = engine(Mode::Lazy);
    let x = Tensor::ones_in(&e, [2, 2]);
    assert!(matches!(
        x.to(Device::Gpu(999)),
        Err(Error::InvalidArgument { op: "to", .. })
    ));
    let g = x.to(gpu).unwrap();
    // Printing copies to the host.
    assert!(format!("{g}").contains("[[1.0, 1.0], [1.0, 1.0]]"));
    assert!(matches!(g.add(&x), Err(Error::DeviceMismatch { .. })));
}
gpu_test!(bad_devices_are_clear_errors);

/// Runs `f` on the CPU and on `device` and compares the results.
fn same_on(
    device: Device,
    what: &str,
    inputs: &[&Tensor],
    f: impl Fn(&[Tensor]) -> Tensor,
    tol: f32,
) {
    let cpu: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
    let dev: Vec<Tensor> = inputs.iter().map(|t| t.to(device).unwrap()).collect();
    let want = f(&cpu);
    let got = f(&dev);
    assert_eq!(got.device(), device, "{what}");
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let (got, want) = (got.to_vec().unwrap(), want.to_vec().unwrap());
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()) || (g.is_nan() && w.is_nan()),
            "{what} on {device}: element {i}: {g} vs {w}"
        );
    }
}

fn reductions_match_the_cpu(device: Device) {
    let e = engine(Mode::Lazy);
    for dims in [
        &[1usize][..],
        &[7],
        &[1000],
        &[2, 3, 4],
        &[3, 1, 257],
        &[65, 3],
    ] {
        let n: usize = dims.iter().product();
        let x = Tensor::from_vec_in(&e, data(n, 11), dims).unwrap();
        let what = |op: &str| format!("{op} {dims:?}");
        same_on(device, &what("sum"), &[&x], |t| t[0].sum(), 1e-4);
        same_on(device, &what("mean"), &[&x], |t| t[0].mean(), 1e-4);
        same_on(device, &what("max"), &[&x], |t| t[0].max().unwrap(), 0.0);
        same_on(device, &what("min"), &[&x], |t| t[0].min().unwrap(), 0.0);
        same_on(
            device,
            &what("argmax"),
            &[&x],
            |t| t[0].argmax().unwrap(),
            0.0,
        );
        for axis in 0..dims.len() {
            let w = |op: &str| format!("{op} axis {axis} of {dims:?}");
            same_on(
                device,
                &w("sum"),
                &[&x],
                |t| t[0].sum_axis(axis).unwrap(),
                1e-4,
            );
            same_on(
                device,
                &w("mean"),
                &[&x],
                |t| t[0].mean_axis(axis).unwrap(),
                1e-4,
            );
            same_on(
                device,
                &w("max"),
                &[&x],
                |t| t[0].max_axis(axis).unwrap(),
                0.0,
            );
            same_on(
                device,
                &w("min"),
                &[&x],
                |t| t[0].min_axis(axis).unwrap(),
                0.0,
            );
            same_on(
                device,
                &w("argmax"),
                &[&x],
                |t| t[0].argmax_axis(axis).unwrap(),
                0.0,
            );
        }
    }
    // Ties go to the first index; NaN propagates.
    let ties = Tensor::from_vec_in(&e, vec![1.0, 3.0, 3.0, 2.0, 3.0], [5]).unwrap();
    same_on(
        device,
        "argmax ties",
        &[&ties],
        |t| t[0].argmax().unwrap(),
        0.0,
    );
    let nan = Tensor::from_vec_in(&e, vec![1.0, f32::NAN, 3.0], [3]).unwrap();
    same_on(
        device,
        "max with NaN",
        &[&nan],
        |t| t[0].max().unwrap(),
        0.0,
    );
    same_on(
        device,
        "argmax with NaN",
        &[&nan],
        |t| t[0].argmax().unwrap(),
        0.0,
    );
}
device_test!(reductions_match_the_cpu);

/// Asserts that `result` is the record-time error of reducing `dims` with `op`,
/// recorded at `line` of this file.
#[track_caller]
fn assert_no_identity(result: lazyflow::Result<Tensor>, op: &str, dims: &[usize], line: u32) {
    let err = result.expect_err("a reduction with no identity over nothing");
    let message = err.to_string();
    match &err {
        Error::InvalidArgument {
            op: got,
            shape,
            reason,
            location,
        } => {
            assert_eq!(*got, op, "{message}");
            assert_eq!(*shape, format!("{dims:?}"), "{message}");
            assert!(reason.contains("no identity"), "{message}");
            assert_eq!(
                (location.file(), location.line()),
                (file!(), line),
                "{message}"
            );
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    assert!(
        message.contains(op) && message.contains(&format!("{dims:?}")),
        "{message}"
    );
}

/// max, min and argmax have no identity: over no elements (all of an empty
/// tensor, or an axis of length 0) they are an error at the call, as in numpy,
/// not a NaN. The sum of nothing is 0 and its mean NaN, on every device.
fn reductions_without_identity_reject_empty_tensors(device: Device) {
    let e = engine(Mode::Lazy);
    for dims in [&[0usize][..], &[0, 3], &[3, 0], &[2, 0, 4]] {
        let x = Tensor::zeros_in(&e, dims).to(device).unwrap();
        let (line, r) = (line!(), x.max());
        assert_no_identity(r, "max", dims, line);
        let (line, r) = (line!(), x.min());
        assert_no_identity(r, "min", dims, line);
        let (line, r) = (line!(), x.argmax());
        assert_no_identity(r, "argmax", dims, line);
        assert_eq!(x.sum().item().unwrap(), 0.0, "sum of {dims:?} on {device}");
        assert!(
            x.mean().item().unwrap().is_nan(),
            "mean of {dims:?} on {device}"
        );
        for axis in 0..dims.len() {
            let mut out = dims.to_vec();
            out.remove(axis);
            let n: usize = out.iter().product();
            let what = format!("axis {axis} of {dims:?} on {device}");
            if dims[axis] == 0 {
                let (line, r) = (line!(), x.max_axis(axis));
                assert_no_identity(r, "max", dims, line);
                let (line, r) = (line!(), x.min_axis(axis));
                assert_no_identity(r, "min", dims, line);
                let (line, r) = (line!(), x.argmax_axis(axis));
                assert_no_identity(r, "argmax", dims, line);
                let sum = x.sum_axis(axis).unwrap();
                assert_eq!(sum.to_vec().unwrap(), vec![0.0; n], "sum {what}");
                let mean = x.mean_axis(axis).unwrap().to_vec().unwrap();
                assert!(mean.len() == n && mean.iter().all(|m| m.is_nan()), "{what}");
            } else {
                // Elements along the axis but none in the result: fine.
                for r in [x.max_axis(axis), x.min_axis(axis), x.argmax_axis(axis)] {
                    let r = r.unwrap();
                    assert_eq!(r.dims(), out.as_slice(), "{what}");
                    assert_eq!(r.to_vec().unwrap(), Vec::<f32>::new(), "{what}");
                }
            }
        }
    }
    // Nothing was recorded for the rejected calls, and nothing failed.
    e.wait_all().unwrap();
    assert_eq!(e.stats().failed, 0);
}
device_test!(reductions_without_identity_reject_empty_tensors);

fn matmul_matches_the_cpu(device: Device) {
    let e = engine(Mode::Lazy);
    let cases: &[(&[usize], &[usize])] = &[
        (&[1, 1], &[1, 1]),
        (&[7, 5], &[5, 3]),
        (&[1, 9], &[9, 1]),
        (&[65, 70], &[70, 66]),
        (&[64, 64], &[64, 64]),
        (&[2, 3, 4], &[2, 4, 5]),
        (&[2, 65, 17], &[17, 33]),
        (&[3, 0], &[0, 4]),
    ];
    for (sa, sb) in cases {
        let a = Tensor::from_vec_in(&e, data(sa.iter().product(), 2), *sa).unwrap();
        let b = Tensor::from_vec_in(&e, data(sb.iter().product(), 9), *sb).unwrap();
        same_on(
            device,
            &format!("matmul {sa:?} @ {sb:?}"),
            &[&a, &b],
            |t| t[0].matmul(&t[1]).unwrap(),
            1e-4,
        );
    }
    let sq = Tensor::from_vec_in(&e, data(100, 4), [10, 10]).unwrap();
    same_on(
        device,
        "a @ a",
        &[&sq],
        |t| t[0].matmul(&t[0]).unwrap(),
        1e-4,
    );
}
device_test!(matmul_matches_the_cpu);

fn layout_ops_match_the_cpu(device: Device) {
    let e = engine(Mode::Async);
    let x = Tensor::from_vec_in(&e, data(2 * 3 * 5, 6), [2, 3, 5]).unwrap();
    for (d0, d1) in [(0, 1), (0, 2), (1, 2)] {
        same_on(
            device,
            &format!("transpose {d0} {d1}"),
            &[&x],
            |t| t[0].transpose(d0, d1).unwrap(),
            0.0,
        );
    }
    let m = Tensor::from_vec_in(&e, data(40 * 33, 1), [40, 33]).unwrap();
    same_on(device, "t", &[&m], |t| t[0].t().unwrap(), 0.0);
    let col = Tensor::from_vec_in(&e, data(3, 8), [3, 1]).unwrap();
    same_on(
        device,
        "broadcast_to",
        &[&col],
        |t| t[0].broadcast_to([2, 3, 4]).unwrap(),
        0.0,
    );
    for axis in 0..3 {
        let size = x.dims()[axis];
        same_on(
            device,
            &format!("narrow {axis}"),
            &[&x],
            |t| t[0].narrow(axis, 1, size - 1).unwrap(),
            0.0,
        );
        let parts = x.to(device).unwrap().split(axis, &[1, size - 1]).unwrap();
        let cpu_parts = x.split(axis, &[1, size - 1]).unwrap();
        for (g, c) in parts.iter().zip(&cpu_parts) {
            assert_eq!(
                g.to_vec().unwrap(),
                c.to_vec().unwrap(),
                "split {axis} on {device}"
            );
        }
        same_on(
            device,
            &format!("concat {axis}"),
            &[&x],
            |t| Tensor::concat(&[&t[0], &t[0].exp(), &t[0]], axis).unwrap(),
            1e-5,
        );
    }
    let r = x.to(device).unwrap().reshape([6, 5]).unwrap();
    assert_eq!(r.to_vec().unwrap(), x.to_vec().unwrap());
}
device_test!(layout_ops_match_the_cpu);

fn in_place_ops_are_ordered_and_match_the_cpu(device: Device) {
    for mode in [Mode::Lazy, Mode::Async, Mode::Sync] {
        let e = engine(mode);
        let x = Tensor::from_vec_in(&e, data(12, 3), [3, 4])
            .unwrap()
            .to(device)
            .unwrap();
        let cpu = x.to_vec().unwrap();
        // A reader recorded before the write sees the old value
        // (write-after-read), and clones see the new one.
        let before = &x + 0.0;
        let alias = x.clone();
        x.add_scalar_(1.0);
        let row = Tensor::from_vec_in(&e, vec![1.0, 2.0, 3.0, 4.0], [4])
            .unwrap()
            .to(device)
            .unwrap();
        x.mul_(&row).unwrap();
        x.add_(&x).unwrap();
        x.relu_();
        let mut y = x.clone();
        y -= 0.5;
        y /= &row;
        let want: Vec<f32> = cpu
            .iter()
            .enumerate()
            .map(|(i, v)| {
                (((v + 1.0) * (i % 4 + 1) as f32 * 2.0).max(0.0) - 0.5) / (i % 4 + 1) as f32
            })
            .collect();
        assert_close(
            &alias.to_vec().unwrap(),
            &want,
            &format!("in-place chain {mode:?} on {device}"),
        );
        assert_eq!(before.to_vec().unwrap(), cpu, "{mode:?} on {device}");
        let z = Tensor::zeros_in(&e, [3, 4]).to(device).unwrap();
        z.copy_from(&x).unwrap();
        x.fill_(7.0);
        assert_close(&z.to_vec().unwrap(), &want, "copy_from");
        assert_eq!(x.to_vec().unwrap(), vec![7.0; 12]);
    }
}
device_test!(in_place_ops_are_ordered_and_match_the_cpu);

const SCALE: &str = "
    @group(0) @binding(0) var<storage, read> x: array<f32>;
    @group(0) @binding(1) var<storage, read_write> y: array<f32>;
    @compute @workgroup_size(64)
    fn main(@builtin(global_invocation_id) id: vec3<u32>) {
        if (id.x < arrayLength(&y)) {
            y[id.x] = y[id.x] + 2.0 * x[id.x];
        }
    }";

fn user_kernels_run_in_order_with_other_nodes(gpu: Device) {
    for mode in [Mode::Lazy, Mode::Async] {
        let e = engine(mode);
        let x = Tensor::arange_in(&e, 0.0, 100.0, 1.0).to(gpu).unwrap();
        let y = Tensor::ones_in(&e, [100]).to(gpu).unwrap();
        let before = &y * 1.0; // recorded before the kernel writes y
        let mut k = e.kernel("scale_add", SCALE);
        k.read(&x).write(&y).workgroups(2, 1, 1);
        k.run().unwrap();
        let after = &y + 0.0;
        let want: Vec<f32> = (0..100).map(|i| 1.0 + 2.0 * i as f32).collect();
        assert_eq!(after.to_vec().unwrap(), want, "{mode:?} on {gpu}");
        assert_eq!(before.to_vec().unwrap(), vec![1.0; 100]);
    }
}
gpu_test!(user_kernels_run_in_order_with_other_nodes);

fn an_invalid_user_kernel_fails_only_its_dependents(gpu: Device) {
    let e = engine(Mode::Lazy);
    let x = Tensor::ones_in(&e, [8]).to(gpu).unwrap();
    let y = Tensor::zeros_in(&e, [8]).to(gpu).unwrap();
    let other = &x * 5.0;
    let mut k = e.kernel("broken_kernel", "this is not WGSL");
    k.read(&x).write(&y);
    k.run().unwrap();
    let err = (&y + 1.0).to_vec().unwrap_err();
    assert!(
        matches!(&err, Error::Failed { op, .. } if op == "broken_kernel"),
        "{err}"
    );
    // A kernel that declares more bindings than it is given fails the same way.
    let three = "
        @group(0) @binding(0) var<storage, read> a: array<f32>;
        @group(0) @binding(1) var<storage, read> b: array<f32>;
        @group(0) @binding(2) var<storage, read_write> c: array<f32>;
        @compute @workgroup_size(1)
        fn main() { c[0] = a[0] + b[0]; }";
    let w = Tensor::zeros_in(&e, [1]).to(gpu).unwrap();
    let mut k = e.kernel("missing_binding", three);
    k.read(&x).write(&w);
    k.run().unwrap();
    let err = w.to_vec().unwrap_err();
    assert!(
        matches!(&err, Error::Failed { op, .. } if op == "missing_binding"),
        "{err}"
    );
    // Independent work is unaffected and the device keeps working.
    assert_eq!(other.to_vec().unwrap(), vec![5.0; 8]);
    let z = Tensor::ones_in(&e, [3]).to(gpu).unwrap();
    assert_eq!((&z + 1.0).to_vec().unwrap(), vec![2.0; 3]);
    // Record-time errors: mixed devices, no bindings.
    let cpu = Tensor::ones_in(&e, [8]);
    let mut k = e.kernel("mixed", SCALE);
    k.read(&cpu).write(&z);
    assert!(matches!(
        k.run(),
        Err(Error::DeviceMismatch { op: "mixed", .. })
    ));
    assert!(e.kernel("empty", SCALE).run().is_err());
}
gpu_test!(an_invalid_user_kernel_fails_only_its_dependents);

/// A buffer goes back to its device's pool when the last reader of its tensor
/// has been encoded, and the next allocation of its size class takes it while
/// that reader may not have executed yet: only the in-order queue keeps the
/// reader ahead of the new writer.
///
/// Here `a`'s buffer is read by `b = a * 2` and then reused, for `c`'s upload
/// or for the output of `b * 0 - 1` (which runs after `b` is encoded: with
/// fusion off, the reuse is certain in Lazy mode, where everything up to the
/// readback is one command buffer). Were a buffer handed out too early, when
/// `a`'s handle is dropped (before `b` is encoded: Lazy mode runs nothing
/// before the readback) or written by something the device executes before `b`
/// (an upload through `Queue::write_buffer`, which lands ahead of the open
/// batch), `b` would read -1 instead of `round` and hold -2 instead of
/// `2 * round`; `c`, `d` and `f` check the new owners the other way round.
fn pooled_buffers_are_reused_only_after_their_readers(gpu: Device) {
    for fusion in [false, true] {
        for mode in [Mode::Lazy, Mode::Async, Mode::Sync] {
            let e = Engine::builder()
                .mode(mode)
                .workers(2)
                .fusion(fusion)
                .build()
                .unwrap();
            let what = format!("{mode:?}, fusion {fusion}, on {gpu}");
            let mut outs = Vec::new();
            for round in 0..20 {
                let a = Tensor::full_in(&e, [1000], round as f32).to(gpu).unwrap();
                let b = &a * 2.0;
                drop(a);
                let c = Tensor::full_in(&e, [1000], -1.0).to(gpu).unwrap();
                let d = &c + 100.0;
                let f = &b * 0.0 - 1.0;
                outs.push((round, b, c, d, f));
            }
            for (round, b, c, d, f) in outs {
                let b = b.to_vec().unwrap();
                assert_eq!(
                    b,
                    vec![2.0 * round as f32; 1000],
                    "b, round {round}, {what}"
                );
                assert_eq!(c.to_vec().unwrap(), vec![-1.0; 1000], "c, {what}");
                assert_eq!(d.to_vec().unwrap(), vec![99.0; 1000], "d, {what}");
                assert_eq!(f.to_vec().unwrap(), vec![-1.0; 1000], "f, {what}");
            }
        }
    }
}
gpu_test!(pooled_buffers_are_reused_only_after_their_readers);

fn tensors_larger_than_a_device_buffer_are_rejected_at_record_time(gpu: Device) {
    let e = engine(Mode::Lazy);
    // Never allocated: `zeros` is a lazy node and the size check comes first.
    let huge = Tensor::zeros_in(&e, [1usize << 34]);
    match huge.to(gpu) {
        Err(Error::InvalidArgument {
            op: "to", reason, ..
        }) => {
            assert!(reason.contains("exceed"), "{reason}")
        }
        other => panic!("expected a size error, got {other:?}"),
    }
    // The device keeps working.
    let x = Tensor::ones_in(&e, [4]).to(gpu).unwrap();
    assert_eq!((&x * 3.0).to_vec().unwrap(), vec![3.0; 4]);
    assert_eq!(e.stats().failed, 0);
}
gpu_test!(tensors_larger_than_a_device_buffer_are_rejected_at_record_time);

fn fusion_turns_elementwise_chains_into_few_kernels_with_the_same_results(gpu: Device) {
    let fused = Engine::builder().workers(2).fusion(true).build().unwrap();
    let plain = Engine::builder().workers(2).fusion(false).build().unwrap();
    let run = |e: &Engine, g: Device| {
        let k0 = e.kernels_dispatched(g);
        let x0 = Tensor::from_vec_in(e, data(300, 2), [3, 100])
            .unwrap()
            .to(g)
            .unwrap();
        let row = Tensor::from_vec_in(e, data(100, 5), [100])
            .unwrap()
            .to(g)
            .unwrap();
        let mut x = x0.clone();
        for i in 0..40 {
            x = ((&x + &row) * 0.5 - i as f32).tanh() + &x0;
        }
        let kept: Vec<Tensor> = (0..5).map(|i| &x * i as f32).collect();
        let out: Vec<Vec<f32>> = kept.iter().map(|t| t.to_vec().unwrap()).collect();
        (out, e.kernels_dispatched(g) - k0)
    };
    let (a, fused_kernels) = run(&fused, gpu);
    let (b, plain_kernels) = run(&plain, gpu);
    for (x, y) in a.iter().zip(&b) {
        assert_close(x, y, "fused vs unfused");
    }
    assert!(plain_kernels >= 40 * 5, "{plain_kernels}");
    assert!(
        fused_kernels * 10 < plain_kernels,
        "{fused_kernels} vs {plain_kernels}"
    );
}
gpu_test!(fusion_turns_elementwise_chains_into_few_kernels_with_the_same_results);

fn a_long_elementwise_chain_runs_in_full_groups_in_every_mode(gpu: Device) {
    // 10,000 ops of `x = x + 1`: groups of 64 ops or more make at most 157 kernels,
    // whatever the adapter's binding limit (only the last value is written),
    // and Async mode groups like Lazy mode (recording one op at a time must
    // not close the group whenever the device runs out of queued work).
    for mode in [Mode::Lazy, Mode::Async] {
        let e = engine(mode);
        let x0 = Tensor::zeros_in(&e, [256]).to(gpu).unwrap();
        x0.wait_to_read().unwrap();
        let k0 = e.kernels_dispatched(gpu);
        let mut x = x0;
        for _ in 0..10_000 {
            x = &x + 1.0;
        }
        assert_eq!(x.to_vec().unwrap(), vec![10_000.0; 256], "{mode:?}");
        let kernels = e.kernels_dispatched(gpu) - k0;
        eprintln!("{mode:?}: {kernels} kernels for 10,000 ops");
        assert!(
            kernels <= 157,
            "{mode:?} on {}: {kernels} kernels for 10,000 ops",
            common::describe(gpu)
        );
    }
}
gpu_test!(a_long_elementwise_chain_runs_in_full_groups_in_every_mode);

fn a_group_with_more_kept_values_than_bindings_is_split_and_stays_exact(gpu: Device) {
    // 60 values kept out of one group of 60 ops: more outputs than any
    // adapter binds in one kernel; every kept value must still be right.
    // Values of 300 floats share one slab binding; those of 1,100 (over
    // 4 KiB) take a binding each, and the group is split into kernels.
    for (mode, len) in [
        (Mode::Lazy, 300),
        (Mode::Async, 300),
        (Mode::Lazy, 1_100),
        (Mode::Async, 1_100),
    ] {
        let e = engine(mode);
        let base = data(len, 9);
        let x0 = Tensor::from_vec_in(&e, base.clone(), [len])
            .unwrap()
            .to(gpu)
            .unwrap();
        let mut x = x0.clone();
        let mut kept = Vec::new();
        let mut want = Vec::new();
        let mut w = base.clone();
        for _ in 0..60 {
            x = &(&x * 0.5) + &x0;
            // x * 0.5 + x0, computed as the GPU does (two roundings).
            w = w.iter().zip(&base).map(|(a, b)| a * 0.5 + b).collect();
            kept.push(x.clone());
            want.push(w.clone());
        }
        for (i, (t, w)) in kept.iter().zip(&want).enumerate() {
            assert_close(&t.to_vec().unwrap(), w, &format!("{mode:?}: value {i}"));
        }
    }
}
gpu_test!(a_group_with_more_kept_values_than_bindings_is_split_and_stays_exact);

fn a_program_run_again_compiles_no_new_kernel(gpu: Device) {
    // Independent elementwise ops run on two workers in either order; the
    // fused kernels they make must not depend on that order, or every run
    // would compile kernels anew (tens of milliseconds each on lavapipe).
    for mode in [Mode::Lazy, Mode::Async] {
        compiles_nothing_new(gpu, mode);
    }
}

fn compiles_nothing_new(gpu: Device, mode: Mode) {
    let e = engine(mode);
    let program = |e: &Engine| -> Vec<f32> {
        let xs: Vec<Tensor> = (0..6)
            .map(|i| {
                Tensor::from_vec_in(e, data(512, i), [512])
                    .unwrap()
                    .to(gpu)
                    .unwrap()
            })
            .collect();
        // Six independent chains, then one sum of them all, read back.
        let ys: Vec<Tensor> = xs
            .iter()
            .enumerate()
            .map(|(i, x)| ((x * (i as f32 + 1.0)) + 0.5).tanh() - x)
            .collect();
        let mut total = ys[0].clone();
        for y in &ys[1..] {
            total = &total + y;
        }
        total.to_vec().unwrap()
    };
    let first = program(&e);
    let compiled = e.kernels_compiled(gpu);
    assert!(compiled > 0);
    for run in 0..20 {
        assert_eq!(program(&e), first, "{mode:?}: run {run}");
        assert_eq!(
            e.kernels_compiled(gpu),
            compiled,
            "{mode:?}: run {run} compiled new kernels on {}",
            common::describe(gpu)
        );
    }
}
gpu_test!(a_program_run_again_compiles_no_new_kernel);

/// A value read back while other recorded work on the device is still being
/// run: in Async mode the read lets that work catch up before it encodes the
/// fusion group, so the group (and its cached kernel) is the same every run.
fn a_read_amid_other_work_compiles_no_new_kernel(gpu: Device) {
    let e = engine(Mode::Async);
    let program = |e: &Engine| -> (Vec<f32>, Vec<f32>) {
        let mut chains: Vec<Tensor> = (0..6)
            .map(|i| {
                Tensor::from_vec_in(e, data(512, i), [512])
                    .unwrap()
                    .to(gpu)
                    .unwrap()
            })
            .collect();
        // Six chains recorded interleaved (54 ops: one group, under the cap of
        // 64 whose boundary still depends on the order ops run in), then one
        // of them read while the others' last ops may still be waiting for a
        // worker.
        for step in 0..3 {
            for c in chains.iter_mut() {
                *c = ((&*c * 1.01) + 0.1 * step as f32).tanh();
            }
        }
        let head = chains[0].to_vec().unwrap();
        let mut total = chains[1].clone();
        for c in &chains[2..] {
            total = &total + c;
        }
        (head, total.to_vec().unwrap())
    };
    let first = program(&e);
    let compiled = e.kernels_compiled(gpu);
    for run in 0..30 {
        assert_eq!(program(&e), first, "run {run}");
        assert_eq!(
            e.kernels_compiled(gpu),
            compiled,
            "run {run} compiled new kernels on {}",
            common::describe(gpu)
        );
    }
}
gpu_test!(a_read_amid_other_work_compiles_no_new_kernel);

fn a_fused_value_nothing_reads_gets_no_gpu_memory(gpu: Device) {
    // 640 ops of `x = x + 1` in groups: only each group's last value is
    // written, so only those (and the info buffers of their kernels) are
    // given memory, not one buffer per op.
    for mode in [Mode::Lazy, Mode::Async] {
        let e = engine(mode);
        let x0 = Tensor::zeros_in(&e, [64]).to(gpu).unwrap();
        x0.wait_to_read().unwrap();
        let (b0, k0) = (e.gpu_buffers_backed(gpu), e.kernels_dispatched(gpu));
        let mut x = x0;
        for _ in 0..640 {
            x = &x + 1.0;
        }
        assert_eq!(x.to_vec().unwrap(), vec![640.0; 64], "{mode:?}");
        let buffers = e.gpu_buffers_backed(gpu) - b0;
        let kernels = e.kernels_dispatched(gpu) - k0;
        // Per kernel: its written value and its info buffer.
        assert!(
            buffers <= 2 * kernels + 2 && kernels <= 20,
            "{mode:?} on {}: {buffers} buffers given memory for 640 ops in {kernels} kernels",
            common::describe(gpu)
        );
    }
}
gpu_test!(a_fused_value_nothing_reads_gets_no_gpu_memory);

fn many_small_and_large_uploads_in_one_batch_keep_their_values(gpu: Device) {
    // Small uploads share a staging belt per batch (256 KiB); 2,000 of 400
    // bytes fill several, and large ones (over 64 KiB) go their own way in
    // between. Each value must come back as it went.
    let e = engine(Mode::Lazy);
    let sizes: Vec<usize> = (0..2_000)
        .map(|i| if i % 500 == 7 { 40_000 } else { 100 })
        .collect();
    let sources: Vec<Vec<f32>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| (0..n).map(|j| (i * 7 + j) as f32).collect())
        .collect();
    let on_gpu: Vec<Tensor> = sources
        .iter()
        .map(|v| {
            Tensor::from_vec_in(&e, v.clone(), [v.len()])
                .unwrap()
                .to(gpu)
                .unwrap()
        })
        .collect();
    // One sum over all of them makes every upload part of one flush.
    let total = on_gpu
        .iter()
        .map(|t| t.sum())
        .reduce(|a, b| &a + &b)
        .unwrap();
    let want: f64 = sources.iter().flatten().map(|&v| v as f64).sum();
    let got = total.to(Device::Cpu).unwrap().item().unwrap() as f64;
    assert!((got - want).abs() <= want * 1e-5, "{got} vs {want}");
    for (t, v) in on_gpu.iter().zip(&sources).step_by(97) {
        assert_eq!(&t.to_vec().unwrap(), v);
    }
}
gpu_test!(many_small_and_large_uploads_in_one_batch_keep_their_values);

fn elementwise_ops_are_recorded_in_batches_and_ordered_with_everything_else(gpu: Device) {
    for mode in [Mode::Lazy, Mode::Async] {
        let e = engine(mode);
        let x0 = Tensor::from_vec_in(&e, vec![1.0, 2.0], [2])
            .unwrap()
            .to(gpu)
            .unwrap();
        x0.wait_to_read().unwrap();
        // A chain records one node per batch of ops, not one per op.
        let before = e.stats();
        let mut x = x0.clone();
        for _ in 0..1_000 {
            x = &x + 1.0;
        }
        assert_eq!(x.to_vec().unwrap(), vec![1_001.0, 1_002.0], "{mode:?}");
        let after = e.stats();
        let nodes = after.batches - before.batches;
        assert!(nodes <= 10, "{mode:?}: {nodes} nodes for 1,000 ops");
        // A batch counts once per op it holds (and the read is a node).
        let ops = after.recorded - before.recorded;
        assert!((1_000..1_010).contains(&ops), "{mode:?}: {ops}");
        // An in-place write to a value an open batch reads comes after the
        // batch: `y` sees the old `x0`.
        let y = &x0 * 3.0;
        x0.add_scalar_(10.0);
        assert_eq!(y.to_vec().unwrap(), vec![3.0, 6.0], "{mode:?}");
        assert_eq!(x0.to_vec().unwrap(), vec![11.0, 12.0], "{mode:?}");
        // A non-elementwise op reading a batched value, and a CPU copy of
        // one, see it computed.
        let z = &x0 + 1.0;
        let s = z.sum();
        let on_cpu = (&z * 2.0).to(Device::Cpu).unwrap();
        assert_eq!(s.item().unwrap(), 25.0, "{mode:?}");
        assert_eq!(on_cpu.to_vec().unwrap(), vec![24.0, 26.0], "{mode:?}");
    }
}
gpu_test!(elementwise_ops_are_recorded_in_batches_and_ordered_with_everything_else);

fn async_mode_fuses_like_lazy_mode(gpu: Device) {
    // Two independent chains recorded in turns: with a node per op, which
    // ops met in a fusion group depended on which worker ran what first.
    let run = |mode: Mode| {
        let e = engine(mode);
        let a0 = Tensor::zeros_in(&e, [64]).to(gpu).unwrap();
        let b0 = Tensor::ones_in(&e, [64]).to(gpu).unwrap();
        a0.wait_to_read().unwrap();
        b0.wait_to_read().unwrap();
        let mut counts = Vec::new();
        for _ in 0..3 {
            let (k0, c0) = (e.kernels_dispatched(gpu), e.kernels_compiled(gpu));
            let (mut a, mut b) = (a0.clone(), b0.clone());
            for i in 0..300 {
                a = (&a + 1.0).relu();
                if i % 3 == 0 {
                    b = &b * 1.0 + &a;
                }
            }
            let (va, vb) = (a.to_vec().unwrap(), b.to_vec().unwrap());
            counts.push((
                e.kernels_dispatched(gpu) - k0,
                e.kernels_compiled(gpu) - c0,
                va[0],
                vb[0],
            ));
        }
        counts
    };
    let lazy = run(Mode::Lazy);
    let asynchronous = run(Mode::Async);
    // Every pass dispatches and compiles the same kernels in both modes (the
    // batches, and which of their values are written, are decided when they
    // are recorded) and computes the same values.
    assert_eq!(lazy, asynchronous, "kernels, compiles and values per pass");
    assert_eq!(lazy[1].1, 0, "a pass run again compiles nothing");
}
gpu_test!(async_mode_fuses_like_lazy_mode);

fn a_batch_with_more_inputs_than_bindings_keeps_what_its_later_kernels_read(gpu: Device) {
    // A chain adding 300 distinct computed tensors: one batch, split into
    // several kernels by the adapter's bindings; each kernel's last sum is
    // read by the next one and must be written although nothing else holds
    // it.
    for mode in [Mode::Lazy, Mode::Async] {
        let e = engine(mode);
        let parts: Vec<Tensor> = (0..300)
            .map(|i| Tensor::full_in(&e, [3], i as f32).to(gpu).unwrap())
            .collect();
        for p in &parts {
            p.wait_to_read().unwrap();
        }
        let total = parts.iter().cloned().reduce(|a, b| &a + &b).unwrap();
        assert_eq!(total.to_vec().unwrap(), vec![44_850.0; 3], "{mode:?}");
    }
}
gpu_test!(a_batch_with_more_inputs_than_bindings_keeps_what_its_later_kernels_read);

fn many_kept_small_values_share_a_kernel_and_keep_their_values(gpu: Device) {
    // 1,000 kept values of 3 floats from one input: a fused kernel writes the
    // values of up to 256 ops into one buffer, bound once, so the adapter's
    // binding limit no longer splits a batch into a kernel per few dozen
    // values. Every value is checked, after most of the others are dropped
    // and the pool has handed their memory out again.
    for mode in [Mode::Lazy, Mode::Async] {
        let e = engine(mode);
        let base = data(3, 5);
        let x = Tensor::from_vec_in(&e, base.clone(), [3])
            .unwrap()
            .to(gpu)
            .unwrap();
        x.wait_to_read().unwrap();
        let k0 = e.kernels_dispatched(gpu);
        let ys: Vec<Tensor> = (0..1_000).map(|i| &x + i as f32).collect();
        e.wait_all().unwrap();
        let kernels = e.kernels_dispatched(gpu) - k0;
        // 4 batches of at most 256 ops; one kernel each, an info upload aside.
        assert!(
            kernels <= 8,
            "{mode:?} on {}: {kernels} kernels for 1,000 kept values",
            common::describe(gpu)
        );
        let want = |i: usize| base.iter().map(|b| b + i as f32).collect::<Vec<_>>();
        for i in [0, 1, 255, 256, 999] {
            assert_close(
                &ys[i].to_vec().unwrap(),
                &want(i),
                &format!("{mode:?} y{i}"),
            );
        }
        // Keep two values of each slab (the first one's range starts where a
        // buffer handed out again would be written) and churn the pool.
        let kept: Vec<(usize, Tensor)> = ys
            .into_iter()
            .enumerate()
            .filter(|(i, _)| i % 256 == 0 || i % 256 == 100)
            .collect();
        // Uploads of the same size take buffers of the pool's smallest class.
        let churn: Vec<Tensor> = (0..1_000)
            .map(|i| {
                let v = vec![-(i as f32); 3];
                Tensor::from_vec_in(&e, v, [3]).unwrap().to(gpu).unwrap()
            })
            .collect();
        e.wait_all().unwrap();
        for (i, y) in &kept {
            assert_close(
                &y.to_vec().unwrap(),
                &want(*i),
                &format!("{mode:?} kept y{i}"),
            );
        }
        assert_close(&churn[7].to_vec().unwrap(), &[-7.0; 3], "churn");
    }
}
gpu_test!(many_kept_small_values_share_a_kernel_and_keep_their_values);

fn values_of_one_kernel_feed_other_kernels_and_in_place_updates(gpu: Device) {
    // Values a fused kernel wrote into one buffer, used by kernels that bind
    // them at their offsets: a matmul of two of them, and an in-place update
    // of one with another (the same buffer read and written by one dispatch,
    // which wgpu refuses: the read side is copied first).
    let e = engine(Mode::Lazy);
    let a = data(16, 1);
    let x = Tensor::from_vec_in(&e, a.clone(), [4, 4])
        .unwrap()
        .to(gpu)
        .unwrap();
    let ys: Vec<Tensor> = (0..8).map(|i| &x + i as f32).collect();
    let cpu = |i: usize| a.iter().map(|v| v + i as f32).collect::<Vec<_>>();
    let p = ys[2].matmul(&ys[5]).unwrap();
    let mut want = vec![0.0f32; 16];
    let (l, r) = (cpu(2), cpu(5));
    for i in 0..4 {
        for j in 0..4 {
            want[i * 4 + j] = (0..4).map(|k| l[i * 4 + k] * r[k * 4 + j]).sum();
        }
    }
    assert_close(
        &p.to_vec().unwrap(),
        &want,
        "matmul of two values of one kernel",
    );
    ys[3].add_(&ys[6]).unwrap();
    let sum: Vec<f32> = cpu(3).iter().zip(cpu(6)).map(|(u, v)| u + v).collect();
    assert_close(&ys[3].to_vec().unwrap(), &sum, "y3 += y6");
    assert_close(&ys[6].to_vec().unwrap(), &cpu(6), "y6 unchanged");
    assert_close(&ys[4].to_vec().unwrap(), &cpu(4), "y4 unchanged");
}
gpu_test!(values_of_one_kernel_feed_other_kernels_and_in_place_updates);

fn a_fused_kernel_of_one_structure_covers_small_and_large_tensors(gpu: Device) {
    // Kernels over fewer than 256 elements use smaller workgroups; the same
    // chain of ops over 2, 40 and 5,000 elements must compute every element
    // (a kernel compiled for a small workgroup and reused for a large
    // tensor would leave most of it unwritten).
    let e = engine(Mode::Lazy);
    for n in [2usize, 40, 5_000, 3] {
        let a = data(n, n as u32);
        let mut x = Tensor::from_vec_in(&e, a.clone(), [n])
            .unwrap()
            .to(gpu)
            .unwrap();
        for _ in 0..20 {
            x = &(&x * 0.5) + 1.0;
        }
        let want: Vec<f32> = a
            .iter()
            .map(|&v| (0..20).fold(v, |acc, _| acc * 0.5 + 1.0))
            .collect();
        assert_close(&x.to_vec().unwrap(), &want, &format!("n = {n}"));
    }
}
gpu_test!(a_fused_kernel_of_one_structure_covers_small_and_large_tensors);
