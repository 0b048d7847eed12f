use lazyflow::nn::{self, Module};
use lazyflow::{Device, Engine, Reduction, Tensor};
fn main() {
    let engine = Engine::builder().build().unwrap();
    let net = nn::lenet(&engine, 0).unwrap();
    let x = Tensor::rand_uniform_in(&engine, [256, 1, 28, 28], 0.0, 1.0, 7).unwrap();
    let labels: Vec<u32> = (0..256u32).map(|i| (i * 7 + 3) % 10).collect();
    let _ = Device::Cpu;
    for _ in 0..8 {
        for p in net.parameters() {
            p.zero_grad();
        }
        let loss = net
            .forward(&x)
            .unwrap()
            .cross_entropy(&labels, Reduction::Mean)
            .unwrap();
        loss.backward().unwrap();
        engine.wait_all().unwrap();
    }
}
