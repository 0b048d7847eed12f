//! The tape's behaviour: accumulation, zeroing, no-grad scopes, laziness, and
//! the errors of misuse. Values are checked against hand-computed gradients.

mod common;

use common::device_test;
use lazyflow::{no_grad, Device, Engine, Error, Mode, NoGrad, Tensor};

fn engine() -> Engine {
    Engine::builder().workers(2).build().unwrap()
}

fn leaf(e: &Engine, device: Device, data: &[f32]) -> Tensor {
    Tensor::from_slice_in(e, data, [data.len()])
        .unwrap()
        .to(device)
        .unwrap()
        .requires_grad(true)
}

fn gradients_accumulate_until_zeroed(device: Device) {
    let e = engine();
    let x = leaf(&e, device, &[1.0, -2.0, 3.0]);
    // d/dx sum(x^2 + 3x) = 2x + 3
    let loss = || (&x * &x + &x * 3.0).sum();
    loss().backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec().unwrap(), vec![5.0, -1.0, 9.0]);
    loss().backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec().unwrap(), vec![10.0, -2.0, 18.0]);
    x.zero_grad();
    assert!(x.grad().is_none());
    (&x * 2.0).sum().backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec().unwrap(), vec![2.0, 2.0, 2.0]);
    assert_eq!(x.grad().unwrap().device(), device);
}
device_test!(gradients_accumulate_until_zeroed);

fn a_value_used_twice_gets_both_gradients(device: Device) {
    let e = engine();
    let x = leaf(&e, device, &[2.0]);
    let y = x.exp();
    // d/dx (e^x * e^x + e^x) = 2 e^2x + e^x
    let loss = (&y * &y + &y).sum();
    loss.backward().unwrap();
    let want = 2.0 * 4f32.exp() + 2f32.exp();
    let got = x.grad().unwrap().item().unwrap();
    assert!((got - want).abs() < 1e-3 * want, "{got} vs {want}");
}
device_test!(a_value_used_twice_gets_both_gradients);

fn no_grad_scopes_record_without_a_tape(device: Device) {
    let e = engine();
    let w = leaf(&e, device, &[1.0, 2.0]);
    let y = no_grad(|| &w * 2.0);
    assert!(!y.tracks_grad());
    assert_eq!(y.to_vec().unwrap(), vec![2.0, 4.0]);
    {
        let _outer = NoGrad::new();
        {
            let _inner = NoGrad::new();
        }
        // Still inside the outer scope.
        assert!(!(&w + 1.0).tracks_grad());
    }
    assert!((&w + 1.0).tracks_grad());
    // An optimizer step: in place on a parameter, inside no_grad.
    (&w * &w).sum().backward().unwrap();
    no_grad(|| w.sub_(&(w.grad().unwrap() * 0.5)).unwrap());
    assert_eq!(w.to_vec().unwrap(), vec![0.0, 0.0]);
    // Outside a no-grad scope the same update is refused.
    let err = w.sub_(&w.grad().unwrap()).unwrap_err();
    assert!(err.to_string().contains("requires a gradient"), "{err}");
    // A detached handle has no tape.
    assert!(!w.detach().tracks_grad());
    assert!(w.detach().same_data(&w));
}
device_test!(no_grad_scopes_record_without_a_tape);

fn backward_records_and_returns_at_once(device: Device) {
    let e = Engine::builder()
        .workers(2)
        .mode(Mode::Lazy)
        .build()
        .unwrap();
    let x = leaf(&e, device, &[0.5, 1.5, -0.5]);
    let loss = (x.tanh() * x.sigmoid()).sum();
    let before = e.stats();
    loss.backward().unwrap();
    let after = e.stats();
    assert!(
        after.live_nodes > before.live_nodes,
        "backward recorded gradient nodes ({} -> {})",
        before.live_nodes,
        after.live_nodes
    );
    assert_eq!(after.completed, before.completed, "nothing ran yet");
    let g = x.grad().unwrap().to_vec().unwrap();
    for (i, &v) in [0.5f32, 1.5, -0.5].iter().enumerate() {
        let s = 1.0 / (1.0 + (-v).exp());
        let want = (1.0 - v.tanh().powi(2)) * s + v.tanh() * s * (1.0 - s);
        assert!((g[i] - want).abs() < 1e-5, "{} vs {want}", g[i]);
    }
}
device_test!(backward_records_and_returns_at_once);

fn misuse_is_an_error_not_a_panic(device: Device) {
    let e = engine();
    let x = leaf(&e, device, &[1.0, 2.0, 3.0]);
    // Not on the tape.
    let plain = x.detach() * 2.0;
    let err = plain.sum().backward().unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument { op: "backward", .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("does not require a gradient"),
        "{err}"
    );
    // A non-scalar without a seed; a seed of the wrong shape.
    let y = x.exp();
    let err = y.backward().unwrap_err();
    assert!(err.to_string().contains("seed"), "{err}");
    let bad_seed = Tensor::ones_in(&e, [2]).to(device).unwrap();
    assert!(y.backward_with(Some(&bad_seed), false).is_err());
    // Twice through a freed tape; with retain_graph it works twice.
    let loss = y.sum();
    loss.backward().unwrap();
    let err = loss.backward().unwrap_err();
    assert!(err.to_string().contains("freed"), "{err}");
    x.zero_grad();
    let loss = (&x * &x).sum();
    loss.backward_with(None, true).unwrap();
    loss.backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec().unwrap(), vec![4.0, 8.0, 12.0]);
    // A saved value overwritten in place before backward.
    let h = no_grad(|| &x * 1.0).requires_grad(true);
    let loss = (&h * &h).sum();
    no_grad(|| h.detach().add_scalar_(1.0));
    let err = loss.backward().unwrap_err();
    assert!(err.to_string().contains("modified in place"), "{err}");
    // The engine goes on.
    assert_eq!((&x * 2.0).sum().item().unwrap(), 12.0);
}
device_test!(misuse_is_an_error_not_a_panic);
