//! Neural-network ops and modules against references written here: naive loops
//! for convolution and pooling, host formulas for softmax and cross-entropy, the
//! CPU device for a whole LeNet on every GPU, and kernel counts for fusion of
//! gradient chains.

mod common;

use common::{device_test, gpu_test};
use lazyflow::nn::{self, Init, Module};
use lazyflow::{Device, Engine, Error, Reduction, Tensor};

fn engine() -> Engine {
    Engine::builder().workers(2).build().unwrap()
}

fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
        })
        .collect()
}

fn on(e: &Engine, device: Device, v: Vec<f32>, shape: &[usize]) -> Tensor {
    Tensor::from_vec_in(e, v, shape.to_vec())
        .unwrap()
        .to(device)
        .unwrap()
}

fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

/// Naive NCHW cross-correlation in f64.
#[allow(clippy::too_many_arguments)]
fn conv_reference(
    x: &[f32],
    [n, c, h, w]: [usize; 4],
    k: &[f32],
    [o, _, kh, kw]: [usize; 4],
    bias: Option<&[f32]>,
    (sh, sw): (usize, usize),
    (ph, pw): (usize, usize),
) -> (Vec<f64>, [usize; 4]) {
    let oh = (h + 2 * ph - kh) / sh + 1;
    let ow = (w + 2 * pw - kw) / sw + 1;
    let mut out = vec![0.0; n * o * oh * ow];
    for b in 0..n {
        for oc in 0..o {
            for y in 0..oh {
                for xx in 0..ow {
                    let mut acc = bias.map_or(0.0, |b| b[oc] as f64);
                    for ic in 0..c {
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let iy = (y * sh + ky) as isize - ph as isize;
                                let ix = (xx * sw + kx) as isize - pw as isize;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                    continue;
                                }
                                let xv = x[((b * c + ic) * h + iy as usize) * w + ix as usize];
                                let kv = k[((oc * c + ic) * kh + ky) * kw + kx];
                                acc += xv as f64 * kv as f64;
                            }
                        }
                    }
                    out[((b * o + oc) * oh + y) * ow + xx] = acc;
                }
            }
        }
    }
    (out, [n, o, oh, ow])
}

fn conv2d_matches_a_naive_loop(device: Device) {
    let e = engine();
    type Case = ([usize; 4], [usize; 4], (usize, usize), (usize, usize), bool);
    let cases: [Case; 4] = [
        ([2, 3, 7, 6], [4, 3, 3, 2], (2, 1), (1, 0), true),
        ([1, 1, 5, 5], [2, 1, 5, 5], (1, 1), (0, 0), false),
        ([3, 2, 9, 8], [5, 2, 1, 1], (3, 2), (0, 2), true),
        ([2, 4, 6, 5], [3, 4, 4, 3], (1, 1), (2, 1), true),
    ];
    for (i, (xs, ks, stride, padding, with_bias)) in cases.into_iter().enumerate() {
        let xv = data(xs.iter().product(), i as u64);
        let kv = data(ks.iter().product(), 10 + i as u64);
        let bv = data(ks[0], 20 + i as u64);
        let x = on(&e, device, xv.clone(), &xs);
        let k = on(&e, device, kv.clone(), &ks);
        let b = on(&e, device, bv.clone(), &[ks[0]]);
        let y = x
            .conv2d(&k, with_bias.then_some(&b), stride, padding)
            .unwrap();
        let (want, dims) = conv_reference(
            &xv,
            xs,
            &kv,
            ks,
            with_bias.then_some(&bv[..]),
            stride,
            padding,
        );
        assert_eq!(y.dims(), dims, "case {i}");
        assert_close(
            &y.to_vec().unwrap(),
            &want,
            1e-4,
            &format!("conv2d case {i}"),
        );
    }
}
device_test!(conv2d_matches_a_naive_loop);

fn pool_reference(
    x: &[f32],
    [n, c, h, w]: [usize; 4],
    max: bool,
    (kh, kw): (usize, usize),
    (sh, sw): (usize, usize),
    (ph, pw): (usize, usize),
) -> Vec<f64> {
    let oh = (h + 2 * ph - kh) / sh + 1;
    let ow = (w + 2 * pw - kw) / sw + 1;
    let mut out = Vec::new();
    for plane in 0..n * c {
        for y in 0..oh {
            for xx in 0..ow {
                let mut acc = if max { f64::NEG_INFINITY } else { 0.0 };
                for ky in 0..kh {
                    for kx in 0..kw {
                        let iy = (y * sh + ky) as isize - ph as isize;
                        let ix = (xx * sw + kx) as isize - pw as isize;
                        if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                            continue;
                        }
                        let v = x[(plane * h + iy as usize) * w + ix as usize] as f64;
                        acc = if max { acc.max(v) } else { acc + v };
                    }
                }
                out.push(if max { acc } else { acc / (kh * kw) as f64 });
            }
        }
    }
    out
}

fn pooling_matches_a_naive_loop(device: Device) {
    let e = engine();
    let cases = [
        ([2, 3, 7, 6], (3, 2), (2, 2), (1, 1)),
        ([1, 2, 4, 4], (2, 2), (2, 2), (0, 0)),
        ([2, 1, 9, 5], (3, 3), (1, 2), (1, 0)),
    ];
    for (i, (xs, k, s, p)) in cases.into_iter().enumerate() {
        let xv = data(xs.iter().product(), 30 + i as u64);
        let x = on(&e, device, xv.clone(), &xs);
        let got = x.max_pool2d(k, s, p).unwrap().to_vec().unwrap();
        assert_close(
            &got,
            &pool_reference(&xv, xs, true, k, s, p),
            0.0,
            "max_pool2d",
        );
        let got = x.avg_pool2d(k, s, p).unwrap().to_vec().unwrap();
        assert_close(
            &got,
            &pool_reference(&xv, xs, false, k, s, p),
            1e-5,
            "avg_pool2d",
        );
    }
    // NaN propagates through max pooling.
    let mut xv = vec![1.0; 16];
    xv[5] = f32::NAN;
    let y = on(&e, device, xv, &[1, 1, 4, 4])
        .max_pool2d((2, 2), (2, 2), (0, 0))
        .unwrap()
        .to_vec()
        .unwrap();
    assert!(y[0].is_nan() && y[1..].iter().all(|&v| v == 1.0), "{y:?}");
}
device_test!(pooling_matches_a_naive_loop);

fn softmax_cross_entropy_and_accuracy_match_host_formulas(device: Device) {
    let e = engine();
    let (n, classes) = (5, 7);
    let mut v = data(n * classes, 3);
    v[3] = 80.0; // large logits stay finite
    let logits = on(&e, device, v.clone(), &[n, classes]);
    let labels = [3u32, 0, 6, 6, 2];
    let mut lsm = vec![0.0f64; n * classes];
    let mut correct = 0;
    for i in 0..n {
        let row: Vec<f64> = v[i * classes..(i + 1) * classes]
            .iter()
            .map(|&x| x as f64)
            .collect();
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        for j in 0..classes {
            lsm[i * classes + j] = row[j] - lse;
        }
        let arg = (0..classes).fold(0, |b, j| if row[j] > row[b] { j } else { b });
        correct += usize::from(arg == labels[i] as usize);
    }
    let got = logits.log_softmax(1).unwrap().to_vec().unwrap();
    assert_close(&got, &lsm, 1e-5, "log_softmax");
    let sm: Vec<f64> = lsm.iter().map(|x| x.exp()).collect();
    assert_close(
        &logits.softmax(1).unwrap().to_vec().unwrap(),
        &sm,
        1e-5,
        "softmax",
    );
    let nll: Vec<f64> = (0..n)
        .map(|i| -lsm[i * classes + labels[i] as usize])
        .collect();
    let none = logits.cross_entropy(&labels, Reduction::None).unwrap();
    assert_close(&none.to_vec().unwrap(), &nll, 1e-5, "cross_entropy none");
    let sum: f64 = nll.iter().sum();
    let got = logits
        .cross_entropy(&labels, Reduction::Sum)
        .unwrap()
        .item()
        .unwrap();
    assert_close(&[got], &[sum], 1e-5, "cross_entropy sum");
    let got = logits
        .cross_entropy(&labels, Reduction::Mean)
        .unwrap()
        .item()
        .unwrap();
    assert_close(&[got], &[sum / n as f64], 1e-5, "cross_entropy mean");
    let acc = logits.accuracy(&labels).unwrap().item().unwrap();
    assert_eq!(acc, correct as f32 / n as f32);
    assert!(
        correct > 0 && correct < n,
        "a test that can tell ({correct})"
    );
}
device_test!(softmax_cross_entropy_and_accuracy_match_host_formulas);

fn bad_input_is_an_error_naming_op_and_shapes(device: Device) {
    let e = engine();
    let x = on(&e, device, data(2 * 3 * 5 * 5, 1), &[2, 3, 5, 5]);
    let w = on(&e, device, data(4 * 2 * 3 * 3, 2), &[4, 2, 3, 3]);
    let err = x.conv2d(&w, None, (1, 1), (0, 0)).unwrap_err();
    assert!(matches!(&err, Error::Shape { op: "conv2d", .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("3 channels") && msg.contains("[2, 3, 5, 5]"),
        "{msg}"
    );
    assert!(msg.contains("nn.rs"), "names the caller: {msg}");
    let big = on(&e, device, data(4 * 3 * 7 * 7, 2), &[4, 3, 7, 7]);
    let err = x.conv2d(&big, None, (1, 1), (0, 0)).unwrap_err();
    assert!(
        err.to_string().contains("larger than the padded input"),
        "{err}"
    );
    assert!(
        x.conv2d(&big, None, (1, 1), (1, 1)).is_ok(),
        "fits with padding"
    );
    let bias = on(&e, device, vec![0.0; 3], &[3]);
    assert!(x.conv2d(&big, Some(&bias), (1, 1), (1, 1)).is_err());
    assert!(x.conv2d(&big, None, (0, 1), (1, 1)).is_err(), "zero stride");
    let err = x.max_pool2d((6, 2), (1, 1), (0, 0)).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::InvalidArgument {
                op: "max_pool2d",
                ..
            }
        ),
        "{err}"
    );
    assert!(
        x.avg_pool2d((2, 2), (2, 2), (2, 0)).is_err(),
        "padding >= kernel"
    );
    assert!(x
        .reshape([6, 25])
        .unwrap()
        .max_pool2d((2, 2), (2, 2), (0, 0))
        .is_err());
    let logits = on(&e, device, data(12, 3), &[4, 3]);
    let err = logits
        .cross_entropy(&[0, 1, 3, 2], Reduction::Mean)
        .unwrap_err();
    assert!(err.to_string().contains("label 3 of example 2"), "{err}");
    let err = logits.cross_entropy(&[0, 1], Reduction::Mean).unwrap_err();
    assert!(err.to_string().contains("2 labels for 4 examples"), "{err}");
    assert!(logits.accuracy(&[0, 1, 2]).is_err());
    assert!(logits.reshape([12]).unwrap().accuracy(&[0]).is_err());
    // Nothing else is affected.
    assert_eq!(e.stats().failed, 0);
    assert_eq!(
        logits.sum().item().unwrap(),
        data(12, 3).iter().sum::<f32>()
    );
}
device_test!(bad_input_is_an_error_naming_op_and_shapes);

fn initialisers_are_seeded_and_scaled() {
    let e = engine();
    let draw = |init: Init, seed| {
        init.tensor(&e, [200, 100], 200, 100, seed)
            .unwrap()
            .to_vec()
            .unwrap()
    };
    let stats = |v: &[f32]| {
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        (mean, var)
    };
    let cases: [(Init, f64); 6] = [
        (Init::XavierUniform, 2.0 / 300.0),
        (Init::XavierNormal, 2.0 / 300.0),
        (Init::KaimingUniform, 2.0 / 200.0),
        (Init::KaimingNormal, 2.0 / 200.0),
        (
            Init::Normal {
                mean: 0.0,
                std: 0.01,
            },
            1e-4,
        ),
        (
            Init::Uniform {
                low: -1.0,
                high: 1.0,
            },
            1.0 / 3.0,
        ),
    ];
    for (init, var) in cases {
        let a = draw(init, 5);
        assert_eq!(a, draw(init, 5), "{init:?} is deterministic");
        assert_ne!(a, draw(init, 6), "{init:?} depends on the seed");
        let (m, v) = stats(&a);
        assert!(m.abs() < 0.05 * var.sqrt(), "{init:?} mean {m}");
        assert!(
            (v - var).abs() < 0.05 * var,
            "{init:?} variance {v} vs {var}"
        );
    }
    let bound = (6.0f32 / 300.0).sqrt();
    assert!(draw(Init::XavierUniform, 1)
        .iter()
        .all(|x| x.abs() <= bound));
    assert!(Init::KaimingNormal.tensor(&e, [3], 0, 3, 1).is_err());
}

#[test]
fn initialisers() {
    initialisers_are_seeded_and_scaled();
}

/// LeNet's forward and backward on `device`, with the weights of `net`: the
/// logits, the loss and every gradient, on the host.
fn lenet_pass(net: &nn::Sequential, device: Device, x: &[f32], labels: &[u32]) -> Vec<Vec<f32>> {
    let replica = net.replica_on(device).unwrap();
    let e = net.parameters()[0].engine().clone();
    let n = labels.len();
    let x = on(&e, device, x.to_vec(), &[n, 1, 28, 28]);
    let logits = replica.forward(&x).unwrap();
    let loss = logits.cross_entropy(labels, Reduction::Mean).unwrap();
    loss.backward().unwrap();
    let mut out = vec![logits.to_vec().unwrap(), vec![loss.item().unwrap()]];
    for p in replica.parameters() {
        let g = p.grad().unwrap();
        assert_eq!(g.device(), device);
        out.push(g.to_vec().unwrap());
    }
    out
}

fn lenet_forward_and_backward_agree_with_the_cpu(gpu: Device) {
    let e = engine();
    // Larger weights than the book's 0.01 so that every gradient is well above
    // rounding.
    let net = nn::lenet(&e, 3).unwrap();
    for p in net.parameters() {
        lazyflow::no_grad(|| p.detach().mul_scalar_(30.0));
    }
    let n = 6;
    let x: Vec<f32> = data(n * 28 * 28, 9).iter().map(|v| v.abs() / 2.0).collect();
    let labels = [1u32, 7, 3, 3, 0, 9];
    let cpu = lenet_pass(&net, Device::Cpu, &x, &labels);
    let gpu_out = lenet_pass(&net, gpu, &x, &labels);
    let names = [
        "logits", "loss", "conv1.w", "conv1.b", "conv2.w", "conv2.b", "fc1.w", "fc1.b", "fc2.w",
        "fc2.b",
    ];
    assert_eq!(cpu.len(), names.len());
    for ((c, g), name) in cpu.iter().zip(&gpu_out).zip(names) {
        let scale = c.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
        assert!(scale > 0.0, "{name} is all zeros");
        let want: Vec<f64> = c.iter().map(|&v| v as f64).collect();
        for (i, (&a, &b)) in g.iter().zip(&want).enumerate() {
            assert!(
                (a as f64 - b).abs() <= 1e-3 * scale,
                "{name}[{i}] on {gpu}: {a} vs cpu {b} (scale {scale})"
            );
        }
    }
}
gpu_test!(lenet_forward_and_backward_agree_with_the_cpu);

fn modules_compose_and_replicate(device: Device) {
    let e = engine();
    let net = nn::Sequential::new()
        .add(nn::Linear::new(&e, 4, 3, Init::XavierUniform, 1).unwrap())
        .add(nn::Activation::Tanh)
        .add(nn::Linear::new(&e, 3, 2, Init::XavierUniform, 2).unwrap());
    assert_eq!(net.parameters().len(), 4);
    assert!(
        net.describe().contains("Linear(4 -> 3)"),
        "{}",
        net.describe()
    );
    let replica = net.replica_on(device).unwrap();
    for (p, r) in net.parameters().iter().zip(replica.parameters()) {
        assert_eq!(r.device(), device);
        assert!(r.is_leaf());
        assert!(!r.same_data(p), "a replica holds copies");
        assert_eq!(r.to_vec().unwrap(), p.to_vec().unwrap());
    }
    let x = on(&e, device, data(8, 4), &[2, 4]);
    let y = replica.forward(&x).unwrap();
    // By hand: tanh(x W1 + b1) W2 + b2 with the CPU's parameters.
    let p: Vec<Vec<f32>> = net
        .parameters()
        .iter()
        .map(|t| t.to_vec().unwrap())
        .collect();
    let xv = data(8, 4);
    let mut want = vec![];
    for r in 0..2 {
        let h: Vec<f64> = (0..3)
            .map(|j| {
                let s: f64 = (0..4)
                    .map(|i| xv[r * 4 + i] as f64 * p[0][i * 3 + j] as f64)
                    .sum();
                (s + p[1][j] as f64).tanh()
            })
            .collect();
        for k in 0..2 {
            let s: f64 = (0..3).map(|j| h[j] * p[2][j * 2 + k] as f64).sum();
            want.push(s + p[3][k] as f64);
        }
    }
    assert_close(&y.to_vec().unwrap(), &want, 1e-5, "sequential forward");
    // Updating the replica leaves the original alone.
    lazyflow::no_grad(|| replica.parameters()[0].add_scalar_(1.0));
    assert_eq!(net.parameters()[0].to_vec().unwrap(), p[0]);
}
device_test!(modules_compose_and_replicate);

fn gradient_chains_fuse_like_forward_chains(gpu: Device) {
    let run = |fusion: bool| {
        let e = Engine::builder().workers(2).fusion(fusion).build().unwrap();
        let x = on(&e, gpu, data(300, 2), &[3, 100]).requires_grad(true);
        let mut y = x.clone();
        for i in 0..20 {
            y = ((&y * 0.5 + i as f32).tanh() * &x).sigmoid();
        }
        // Run the forward pass first: what is counted is the backward.
        y.wait_to_read().unwrap();
        let loss = y.sum();
        loss.wait_to_read().unwrap();
        let k0 = e.kernels_dispatched(gpu);
        loss.backward().unwrap();
        let g = x.grad().unwrap().to_vec().unwrap();
        (g, e.kernels_dispatched(gpu) - k0)
    };
    let (fused, fused_kernels) = run(true);
    let (plain, plain_kernels) = run(false);
    let want: Vec<f64> = plain.iter().map(|&v| v as f64).collect();
    assert_close(&fused, &want, 1e-4, "fused vs unfused gradient");
    assert!(plain_kernels >= 20 * 8, "{plain_kernels}");
    assert!(
        fused_kernels * 5 < plain_kernels,
        "{fused_kernels} fused vs {plain_kernels} unfused kernels"
    );
}
gpu_test!(gradient_chains_fuse_like_forward_chains);
