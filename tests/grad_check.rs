//! Every gradient against central finite differences, on the CPU and on every
//! GPU adapter, at odd sizes and with broadcasting.
//!
//! For an op `f` and random weights `r`, the loss is `sum(f(inputs) * r)`; its
//! gradient from `backward` must match `(L(x + h e_j) - L(x - h e_j)) / 2h` for
//! every element `j` of every input, where each `L` is a fresh forward pass
//! without a tape. The forward ops are checked against independent references in
//! their own tests, so the differences are an independent reference for the
//! gradients.

mod common;

use common::device_test;
use lazyflow::{Device, Engine, Tensor};

/// Deterministic values in `[lo, hi)`, kept away from 0 by at least `gap` (the
/// kinks of abs and relu, the pole of division).
fn values(n: usize, seed: u64, lo: f32, hi: f32, gap: f32) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let u = (state >> 40) as f32 / (1u64 << 24) as f32;
        let v = lo + (hi - lo) * u;
        if v.abs() >= gap {
            out.push(v);
        }
    }
    out
}

/// How the inputs of a check are drawn.
#[derive(Clone, Copy)]
enum Domain {
    /// `[-2, 2]`, at least 0.1 from 0.
    Signed,
    /// `[0.5, 2]`.
    Positive,
    /// A shuffle of distinct values 0.05 apart, so that no step of the
    /// differences crosses a tie (for max pooling).
    Distinct,
}

struct Check {
    engine: Engine,
    device: Device,
}

impl Check {
    fn new(device: Device) -> Check {
        Check {
            engine: Engine::builder().workers(2).build().unwrap(),
            device,
        }
    }

    fn tensor(&self, data: &[f32], shape: &[usize]) -> Tensor {
        Tensor::from_slice_in(&self.engine, data, shape.to_vec())
            .unwrap()
            .to(self.device)
            .unwrap()
    }

    /// Checks the gradients of `f` with respect to inputs of `shapes`.
    fn grads(
        &self,
        name: &str,
        shapes: &[&[usize]],
        domain: Domain,
        f: impl Fn(&[Tensor]) -> Tensor,
    ) {
        let data: Vec<Vec<f32>> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let n = s.iter().product();
                match domain {
                    Domain::Signed => values(n, 17 + i as u64, -2.0, 2.0, 0.1),
                    Domain::Positive => values(n, 17 + i as u64, 0.5, 2.0, 0.0),
                    Domain::Distinct => {
                        let keys = values(n, 17 + i as u64, 0.0, 1.0, 0.0);
                        let mut order: Vec<usize> = (0..n).collect();
                        order.sort_by(|&a, &b| keys[a].total_cmp(&keys[b]));
                        let mut v = vec![0.0; n];
                        for (rank, &j) in order.iter().enumerate() {
                            v[j] = rank as f32 * 0.05 - n as f32 * 0.025;
                        }
                        v
                    }
                }
            })
            .collect();
        let inputs: Vec<Tensor> = data
            .iter()
            .zip(shapes)
            .map(|(d, s)| self.tensor(d, s).requires_grad(true))
            .collect();
        let y = f(&inputs);
        let r = values(y.numel(), 99, -1.0, 1.0, 0.0);
        let weights = self.tensor(&r, y.dims());
        let loss = (&y * &weights).sum();
        loss.backward().unwrap();
        let loss_at = |data: &[Vec<f32>]| -> f64 {
            let xs: Vec<Tensor> = data
                .iter()
                .zip(shapes)
                .map(|(d, s)| self.tensor(d, s))
                .collect();
            (&f(&xs) * &weights).sum().item().unwrap() as f64
        };
        let h = 1e-2f32;
        for (i, shape) in shapes.iter().enumerate() {
            let got = inputs[i]
                .grad()
                .unwrap_or_else(|| panic!("{name}: input {i} got no gradient"));
            assert_eq!(got.dims(), *shape, "{name}: gradient shape of input {i}");
            assert_eq!(got.device(), self.device, "{name}: gradient device");
            let got = got.to_vec().unwrap();
            for j in 0..got.len() {
                let mut plus = data.clone();
                plus[i][j] += h;
                let mut minus = data.clone();
                minus[i][j] -= h;
                let numeric = (loss_at(&plus) - loss_at(&minus)) / (2.0 * h as f64);
                let analytic = got[j] as f64;
                assert!(
                    (analytic - numeric).abs() <= 2e-2 * (1.0 + numeric.abs()),
                    "{name} on {}: d/d input {i}[{j}] is {analytic}, finite differences give {numeric}",
                    self.device
                );
            }
        }
    }
}

fn elementwise_with_broadcasting(device: Device) {
    let c = Check::new(device);
    let (a, b): (&[usize], &[usize]) = (&[2, 3, 4], &[3, 1]);
    c.grads("add", &[a, b], Domain::Signed, |x| &x[0] + &x[1]);
    c.grads("sub", &[a, b], Domain::Signed, |x| &x[0] - &x[1]);
    c.grads("mul", &[a, b], Domain::Signed, |x| &x[0] * &x[1]);
    c.grads("div", &[b, a], Domain::Positive, |x| &x[0] / &x[1]);
    c.grads("pow", &[a, &[4]], Domain::Positive, |x| {
        x[0].pow(&x[1]).unwrap()
    });
    c.grads("maximum", &[a, b], Domain::Signed, |x| {
        x[0].maximum(&x[1]).unwrap()
    });
    c.grads("minimum", &[&[1, 4], &[3, 1]], Domain::Signed, |x| {
        x[0].minimum(&x[1]).unwrap()
    });
    // The same tensor on both sides.
    c.grads("mul_self", &[&[5]], Domain::Signed, |x| &x[0] * &x[0]);
}
device_test!(elementwise_with_broadcasting);

fn scalar_forms(device: Device) {
    let c = Check::new(device);
    let s: &[usize] = &[3, 5];
    c.grads("add_scalar", &[s], Domain::Signed, |x| &x[0] + 1.5);
    c.grads("sub_scalar", &[s], Domain::Signed, |x| &x[0] - 1.5);
    c.grads("scalar_sub", &[s], Domain::Signed, |x| 1.5 - &x[0]);
    c.grads("mul_scalar", &[s], Domain::Signed, |x| &x[0] * -2.5);
    c.grads("div_scalar", &[s], Domain::Signed, |x| &x[0] / 4.0);
    c.grads("scalar_div", &[s], Domain::Positive, |x| 3.0 / &x[0]);
    c.grads("powf", &[s], Domain::Positive, |x| x[0].powf(2.5));
    c.grads("maximum_scalar", &[s], Domain::Signed, |x| {
        x[0].maximum_scalar(0.3)
    });
    c.grads("minimum_scalar", &[s], Domain::Signed, |x| {
        x[0].minimum_scalar(0.3)
    });
}
device_test!(scalar_forms);

fn unary(device: Device) {
    let c = Check::new(device);
    let s: &[usize] = &[2, 7];
    c.grads("neg", &[s], Domain::Signed, |x| -&x[0]);
    c.grads("exp", &[s], Domain::Signed, |x| x[0].exp());
    c.grads("log", &[s], Domain::Positive, |x| x[0].log());
    c.grads("sqrt", &[s], Domain::Positive, |x| x[0].sqrt());
    c.grads("abs", &[s], Domain::Signed, |x| x[0].abs());
    c.grads("relu", &[s], Domain::Signed, |x| x[0].relu());
    c.grads("sigmoid", &[s], Domain::Signed, |x| x[0].sigmoid());
    c.grads("tanh", &[s], Domain::Signed, |x| x[0].tanh());
    // A chain, where the gradient ops of one feed the next.
    c.grads("chain", &[s], Domain::Signed, |x| {
        ((&x[0] * 0.5).tanh() + x[0].sigmoid()).exp()
    });
}
device_test!(unary);

fn reductions(device: Device) {
    let c = Check::new(device);
    let s: &[usize] = &[3, 4, 5];
    c.grads("sum", &[s], Domain::Signed, |x| x[0].sum());
    c.grads("mean", &[s], Domain::Signed, |x| x[0].mean());
    c.grads("max", &[s], Domain::Signed, |x| x[0].max().unwrap());
    c.grads("min", &[s], Domain::Signed, |x| x[0].min().unwrap());
    for axis in 0..3 {
        c.grads("sum_axis", &[s], Domain::Signed, |x| {
            x[0].sum_axis(axis).unwrap()
        });
        c.grads("mean_axis", &[s], Domain::Signed, |x| {
            x[0].mean_axis(axis).unwrap()
        });
        c.grads("max_axis", &[s], Domain::Signed, |x| {
            x[0].max_axis(axis).unwrap()
        });
        c.grads("min_axis", &[s], Domain::Signed, |x| {
            x[0].min_axis(axis).unwrap()
        });
    }
}
device_test!(reductions);

fn matmul(device: Device) {
    let c = Check::new(device);
    c.grads("matmul", &[&[3, 4], &[4, 5]], Domain::Signed, |x| {
        x[0].matmul(&x[1]).unwrap()
    });
    c.grads(
        "matmul_batched",
        &[&[2, 3, 4], &[2, 4, 5]],
        Domain::Signed,
        |x| x[0].matmul(&x[1]).unwrap(),
    );
    c.grads(
        "matmul_shared",
        &[&[2, 3, 4], &[4, 5]],
        Domain::Signed,
        |x| x[0].matmul(&x[1]).unwrap(),
    );
}
device_test!(matmul);

fn layout(device: Device) {
    let c = Check::new(device);
    let s: &[usize] = &[2, 3, 4];
    c.grads("reshape", &[s], Domain::Signed, |x| {
        x[0].reshape([4, 6]).unwrap().exp()
    });
    c.grads("transpose", &[s], Domain::Signed, |x| {
        x[0].transpose(0, 2).unwrap()
    });
    c.grads("t", &[&[3, 5]], Domain::Signed, |x| x[0].t().unwrap());
    c.grads("broadcast_to", &[&[3, 1]], Domain::Signed, |x| {
        x[0].broadcast_to([2, 3, 4]).unwrap()
    });
    c.grads("narrow", &[s], Domain::Signed, |x| {
        x[0].narrow(1, 1, 1).unwrap()
    });
    c.grads("split", &[s], Domain::Signed, |x| {
        let parts = x[0].split(2, &[1, 2, 1]).unwrap();
        &parts[0] * 2.0 + &parts[2] - &parts[1].sum_axis(2).unwrap().reshape([2, 3, 1]).unwrap()
    });
    c.grads("concat", &[s, &[2, 1, 4]], Domain::Signed, |x| {
        Tensor::concat(&[&x[0], &x[1].exp()], 1).unwrap()
    });
    // Across devices: the gradient of the transfer goes back to the source.
    c.grads("to", &[s], Domain::Signed, |x| {
        let other = if x[0].device() == Device::Cpu {
            x[0].engine().devices().last().copied().unwrap()
        } else {
            Device::Cpu
        };
        (x[0].to(other).unwrap() * 3.0).to(x[0].device()).unwrap()
    });
}
device_test!(layout);

fn convolution_and_pooling(device: Device) {
    let c = Check::new(device);
    // Odd sizes, stride and padding per axis, with and without a bias.
    c.grads(
        "conv2d",
        &[&[2, 3, 7, 6], &[4, 3, 3, 2], &[4]],
        Domain::Signed,
        |x| x[0].conv2d(&x[1], Some(&x[2]), (2, 1), (1, 0)).unwrap(),
    );
    c.grads(
        "conv2d_no_bias",
        &[&[1, 2, 5, 5], &[3, 2, 2, 3]],
        Domain::Signed,
        |x| x[0].conv2d(&x[1], None, (1, 2), (0, 1)).unwrap(),
    );
    c.grads("avg_pool2d", &[&[2, 3, 7, 6]], Domain::Signed, |x| {
        x[0].avg_pool2d((3, 2), (2, 2), (1, 1)).unwrap()
    });
    // Distinct values keep every window's maximum away from ties.
    c.grads("max_pool2d", &[&[2, 2, 5, 7]], Domain::Distinct, |x| {
        x[0].max_pool2d((2, 3), (2, 1), (0, 1)).unwrap()
    });
}
device_test!(convolution_and_pooling);

fn softmax_and_losses(device: Device) {
    use lazyflow::Reduction;
    let c = Check::new(device);
    c.grads("softmax", &[&[3, 5]], Domain::Signed, |x| {
        x[0].softmax(1).unwrap()
    });
    c.grads("log_softmax", &[&[4, 3]], Domain::Signed, |x| {
        x[0].log_softmax(0).unwrap()
    });
    let labels = [0, 4, 2, 2];
    for reduction in [Reduction::None, Reduction::Mean, Reduction::Sum] {
        c.grads("cross_entropy", &[&[4, 5]], Domain::Signed, |x| {
            x[0].cross_entropy(&labels, reduction).unwrap()
        });
    }
}
device_test!(softmax_and_losses);
