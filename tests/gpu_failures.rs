//! GPU failures that come after a node completed (it completes when encoded)
//! must reach every value they touch: injected failures of a fusion group's
//! encoding, of an upload, of a submission, an over-limit user kernel, a lost
//! device and a hung one. No read may return stale or pooled data.
//!
//! Each test first fills the device's buffer pool with buffers holding 123.0, so
//! a value that was never written would read back as 123.0 instead of failing.

mod common;

use common::gpu_test;
use lazyflow::{Device, Engine, GpuFault, Mode, Tensor};
use std::time::Duration;

const N: usize = 256;

fn engine(fusion: bool) -> Engine {
    Engine::builder()
        .mode(Mode::Lazy)
        .workers(2)
        .fusion(fusion)
        .build()
        .unwrap()
}

/// Leaves buffers full of 123.0 in the pool of `gpu` (size class of `N`).
fn dirty_pool(e: &Engine, gpu: Device) {
    let junk: Vec<Tensor> = (0..8)
        .map(|_| Tensor::full_in(e, [N], 123.0).to(gpu).unwrap() * 1.0)
        .collect();
    for j in &junk {
        assert_eq!(j.to_vec().unwrap(), vec![123.0; N]);
    }
}

fn x_on(e: &Engine, gpu: Device) -> Tensor {
    let x = Tensor::arange_in(e, 0.0, N as f32, 1.0).to(gpu).unwrap();
    x.wait_to_read().unwrap();
    x
}

/// Every read of `t` fails (twice: a failure is not forgotten after it was
/// reported once), and the error names a GPU failure.
fn fails(t: &Tensor, what: &str) {
    for attempt in 0..2 {
        match t.to_vec() {
            Ok(v) => panic!(
                "{what}: read {attempt} returned data {:?}...",
                &v[..4.min(v.len())]
            ),
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    msg.contains("failed") || msg.contains("lost"),
                    "{what}: {msg}"
                );
            }
        }
    }
    assert!(t.wait_to_read().is_err(), "{what}: wait_to_read");
}

fn plus(x: &Tensor, s: f32) -> Vec<f32> {
    x.to_vec().unwrap().iter().map(|v| v + s).collect()
}

fn a_fusion_group_that_cannot_be_encoded_fails_every_output(gpu: Device) {
    let e = engine(true);
    dirty_pool(&e, gpu);
    let x = x_on(&e, gpu);
    assert!(e.inject_gpu_fault(gpu, GpuFault::Pipeline));
    let a = &x + 1.0;
    let b = &a * 2.0;
    let c = b.exp();
    fails(&c, "last output of the group");
    fails(&a, "first output of the group");
    fails(&b, "middle output of the group");
    // Computed from a failed value in a later kernel: failed too.
    let d = a.sum();
    assert!(d.to_vec().is_err(), "a reduction of a failed value");
    // wait_all reports the failure once, naming the ops of the group and
    // where they were recorded; the device goes on working.
    let err = e.wait_all().unwrap_err().to_string();
    assert!(
        err.contains("fused kernel") && err.contains("gpu_failures.rs"),
        "{err}"
    );
    e.wait_all().unwrap();
    let ok = &x + 3.0;
    assert_eq!(ok.to_vec().unwrap(), plus(&x, 3.0));
}
gpu_test!(a_fusion_group_that_cannot_be_encoded_fails_every_output);

fn a_failed_info_upload_fails_the_group_not_the_reader(gpu: Device) {
    let e = engine(true);
    dirty_pool(&e, gpu);
    let x = x_on(&e, gpu);
    assert!(e.inject_gpu_fault(gpu, GpuFault::Upload));
    let a = &x + 1.0;
    let b = &a + 1.0;
    fails(&b, "output of a group whose info upload failed");
    fails(&a, "other output of that group");
    let _ = e.wait_all();
    // A failed data upload fails the transfer and what reads it.
    assert!(e.inject_gpu_fault(gpu, GpuFault::Upload));
    let y = Tensor::full_in(&e, [N], 5.0).to(gpu).unwrap();
    let z = &y + 1.0;
    assert!(y.to_vec().unwrap_err().to_string().contains("injected"));
    assert!(z.to_vec().is_err());
    let ok = &x * 2.0;
    assert_eq!(ok.to_vec().unwrap()[3], 6.0);
}
gpu_test!(a_failed_info_upload_fails_the_group_not_the_reader);

fn a_failed_submit_fails_every_output_of_the_batch(gpu: Device) {
    for fusion in [false, true] {
        let e = engine(fusion);
        dirty_pool(&e, gpu);
        let x = x_on(&e, gpu);
        assert!(e.inject_gpu_fault(gpu, GpuFault::Submit));
        // With fusion off, 80 dispatches cross the 64-dispatch batch limit.
        let ys: Vec<Tensor> = (0..80).map(|i| (&x + i as f32).relu()).collect();
        // The barrier runs them all and reports the failed submission.
        let barrier = e.wait_all().unwrap_err().to_string();
        assert!(
            barrier.contains("command buffer") && barrier.contains("gpu_failures.rs"),
            "fusion {fusion}: {barrier}"
        );
        // Every value written in the failed batch fails, and none reads back
        // the pool's 123.0.
        let mut failed = 0;
        for (i, y) in ys.iter().enumerate() {
            match y.to_vec() {
                Err(_) => failed += 1,
                Ok(v) => assert!(
                    v == plus(&x, i as f32),
                    "fusion {fusion}: y{i} is wrong: {:?}",
                    &v[..4]
                ),
            }
        }
        assert!(failed >= 1);
        if !fusion {
            // The first 64 dispatches (32 values) were one batch.
            assert!(failed >= 31, "fusion off: {failed} of 80 failed");
        }
        e.wait_all().unwrap();
        let ok = &x - 1.0;
        assert_eq!(ok.to_vec().unwrap(), plus(&x, -1.0));
    }
}
gpu_test!(a_failed_submit_fails_every_output_of_the_batch);

const FILL: &str = "
    @group(0) @binding(0) var<storage, read_write> y: array<f32>;
    @compute @workgroup_size(64)
    fn main(@builtin(global_invocation_id) id: vec3<u32>) {
        if (id.x < arrayLength(&y)) {
            y[id.x] = 7.0;
        }
    }";

fn an_over_limit_user_kernel_fails_alone(gpu: Device) {
    let e = engine(true);
    dirty_pool(&e, gpu);
    let x = x_on(&e, gpu);
    let a = &x + 1.0;
    let y = Tensor::zeros_in(&e, [N]).to(gpu).unwrap();
    let mut k = e.kernel("too_many_workgroups", FILL);
    k.write(&y).workgroups(u32::MAX, 1, 1);
    k.run().unwrap();
    let b = &x + 2.0;
    // The kernel's own output fails, naming the limit...
    let err = y.to_vec().unwrap_err().to_string();
    assert!(err.contains("workgroups"), "{err}");
    // ...and the work encoded around it in the same batch is intact.
    assert_eq!(a.to_vec().unwrap(), plus(&x, 1.0));
    assert_eq!(b.to_vec().unwrap(), plus(&x, 2.0));
}
gpu_test!(an_over_limit_user_kernel_fails_alone);

fn a_lost_device_fails_its_work_and_others_go_on(gpu: Device) {
    let e = Engine::builder()
        .workers(2)
        .logical_devices(2)
        .build()
        .unwrap();
    // This adapter's two logical devices.
    let index = match gpu {
        Device::Gpu(i) => i,
        other => panic!("{other} is not a GPU"),
    };
    let (lost, other) = (Device::Gpu(2 * index), Device::Gpu(2 * index + 1));
    let x = x_on(&e, lost);
    let pending = &x + 1.0;
    let w = x_on(&e, other);
    assert!(e.inject_gpu_fault(lost, GpuFault::Lose));
    fails(&pending, "pending on the lost device");
    fails(&x, "computed before the loss");
    let later = &x * 2.0;
    fails(&later, "recorded after the loss");
    let upload = Tensor::ones_in(&e, [4]).to(lost).unwrap();
    assert!(upload.to_vec().unwrap_err().to_string().contains("lost"));
    // The other logical device and the CPU keep working.
    assert_eq!(
        (&w + 1.0).to_vec().unwrap(),
        plus(&w, 0.0).iter().map(|v| v + 1.0).collect::<Vec<_>>()
    );
    let cpu = Tensor::ones_in(&e, [3]) * 2.0;
    assert_eq!(cpu.to_vec().unwrap(), vec![2.0; 3]);
    // wait_all waits for every device and says which one is lost.
    let err = e.wait_all().unwrap_err().to_string();
    assert!(err.contains("lost"), "{err}");
}
gpu_test!(a_lost_device_fails_its_work_and_others_go_on);

fn a_hung_device_times_out_instead_of_blocking(gpu: Device) {
    let e = Engine::builder()
        .workers(2)
        .gpu_timeout(Duration::from_millis(50))
        .build()
        .unwrap();
    let m = Tensor::ones_in(&e, [64, 64]).to(gpu).unwrap();
    let p = m.matmul(&m).unwrap();
    assert!(e.inject_gpu_fault(gpu, GpuFault::Hang));
    let err = p.to_vec().unwrap_err().to_string();
    assert!(err.contains("within 50ms"), "{err}");
    // The device now counts as lost; the CPU goes on.
    assert!((&m + 1.0).to_vec().is_err());
    assert_eq!(Tensor::ones_in(&e, [2]).sum().item().unwrap(), 2.0);
}
gpu_test!(a_hung_device_times_out_instead_of_blocking);
