//! The CUDA backend's kernels and dispatch checked on the CPU, where no GPU is: the kernel
//! program compiled by g++ and run by the fiber emulator of `cuda_emulator/`, behind the same
//! dispatch the GPU uses, trains GPT-2 and SqueezeNet to the CPU backend's losses and weights.
//! (cuBLASLt is replaced by a plain loop here; the GPU tests in cuda_backend.rs cover it where a
//! GPU is.)

mod cuda_emulator;

use cuda_emulator::EmulatedGpu;
use std::collections::BTreeMap;
use std::sync::Arc;
use tensorfleet_worker::backend::cpu::CpuBackend;
use tensorfleet_worker::backend::Backend;
use tensorfleet_worker::config::{Gpt2Config, ModelSpec, Recompute, SqueezeNetConfig};
use tensorfleet_worker::models;
use tensorfleet_worker::optim::Update;
use tensorfleet_worker::session::{Session, SessionOptions};
use tensorfleet_worker::tensor::Tensor;

fn batch(rows: usize, seq: usize, vocab: usize, salt: usize) -> BTreeMap<String, Tensor> {
    let ids: Vec<i64> = (0..rows * seq + 1).map(|i| ((i * 7 + 3 + salt * 11) % vocab) as i64).collect();
    [
        ("input_ids".to_string(), Tensor::from_vec(&[rows, seq], ids[..rows * seq].to_vec())),
        ("labels".to_string(), Tensor::from_vec(&[rows, seq], ids[1..].to_vec())),
    ]
    .into_iter()
    .collect()
}

/// What a run leaves to compare: each step's loss, the evaluation loss, the final weights.
struct Run {
    losses: Vec<f64>,
    eval: f64,
    initial: BTreeMap<String, Tensor>,
    weights: BTreeMap<String, Tensor>,
}

fn train<B: Backend>(backend: Arc<B>, update: Update, recompute: Recompute, micro_batches: usize, steps: u64) -> Run {
    let spec = ModelSpec {
        gpt2: Some(Gpt2Config { layers: 2, heads: 2, embed: 32, seq_len: 8, vocab: 48, dropout: 0.1 }),
        ..Default::default()
    };
    let batches: Vec<_> = (0..micro_batches).map(|k| batch(2, 8, 48, k)).collect();
    train_model(backend, &spec, &batches, update, recompute, steps)
}

fn train_model<B: Backend>(
    backend: Arc<B>,
    spec: &ModelSpec,
    batches: &[BTreeMap<String, Tensor>],
    update: Update,
    recompute: Recompute,
    steps: u64,
) -> Run {
    let micro_batches = batches.len();
    let model = models::load(spec, 11).unwrap();
    let opts = SessionOptions { recompute, ..SessionOptions::new(update) };
    let mut s = Session::new(backend, &model, &batches[0], micro_batches, &opts).unwrap();
    let initial = s.weights().unwrap();
    let losses = (0..steps).map(|k| s.step(batches, 3e-3, 1.0, k).unwrap().loss).collect();
    let eval = s.evaluate(&batches[..1]).unwrap();
    Run { losses, eval, initial, weights: s.weights().unwrap() }
}

fn assert_same(what: &str, gpu: &Run, cpu: &Run) {
    let close = |a: f64, b: f64, rtol: f64| (a - b).abs() <= rtol * b.abs().max(1e-3);
    for (k, (g, c)) in gpu.losses.iter().zip(&cpu.losses).enumerate() {
        assert!(close(*g, *c, 1e-5), "{what}, step {}: emulated GPU loss {g}, CPU {c}", k + 1);
    }
    assert!(close(gpu.eval, cpu.eval, 1e-5), "{what}: evaluation loss {} vs {}", gpu.eval, cpu.eval);
    for (name, c) in &cpu.weights {
        let g = &gpu.weights[name];
        let (gs, cs) = (g.as_slice::<f32>(), c.as_slice::<f32>());
        let worst = gs.iter().zip(cs).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst <= 1e-4, "{what}: weight {name} differs by {worst}");
    }
}

#[test]
fn gpt2_trains_on_the_emulated_kernels_to_the_cpu_losses() {
    let adamw = Update::Adam { beta1: 0.9, beta2: 0.95, epsilon: 1e-8, weight_decay: 0.1, decoupled: true };
    let cases = [
        ("AdamW, dropout 0.1", adamw, Recompute::None, 1),
        (
            "SGD with Nesterov momentum, 2 micro-batches",
            Update::Sgd { momentum: 0.9, nesterov: true, weight_decay: 1e-4 },
            Recompute::None,
            2,
        ),
        (
            "LAMB, whole layers recomputed",
            Update::Lamb { beta1: 0.9, beta2: 0.999, epsilon: 1e-6, weight_decay: 0.01 },
            Recompute::Layer,
            1,
        ),
        (
            "Adam with L2, GELU recomputed",
            Update::Adam { beta1: 0.9, beta2: 0.999, epsilon: 1e-8, weight_decay: 0.01, decoupled: false },
            Recompute::Gelu,
            1,
        ),
    ];
    for (what, update, recompute, micro) in cases {
        let gpu = train(Arc::new(EmulatedGpu::new()), update, recompute, micro, 3);
        let cpu = train(Arc::new(CpuBackend::new()), update, recompute, micro, 3);
        assert_same(what, &gpu, &cpu);
    }
}

/// SqueezeNet 1.1 on 32×32 images: convolutions (3×3 stride 2, 1×1, padded 3×3), ceil-mode max
/// pooling, dropout, global average pooling and their gradients.
#[test]
fn squeezenet_trains_on_the_emulated_kernels_to_the_cpu_losses() {
    let spec = ModelSpec { squeezenet: Some(SqueezeNetConfig { classes: 4, image_size: 32 }), ..Default::default() };
    let (images, size) = (3, 32);
    let pixels: Vec<f32> = (0..images * 3 * size * size).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
    let batch: BTreeMap<String, Tensor> = [
        ("image".to_string(), Tensor::from_vec(&[images, 3, size, size], pixels)),
        ("labels".to_string(), Tensor::from_vec(&[images], vec![0i64, 3, 1])),
    ]
    .into_iter()
    .collect();
    let batches = [batch];
    // SGD: Adam's normalisation would turn the two backends' rounding in near-zero gradients
    // into whole-step differences in the weights (GPT-2 above covers Adam's kernels).
    let sgd = Update::Sgd { momentum: 0.9, nesterov: false, weight_decay: 1e-4 };
    let gpu = train_model(Arc::new(EmulatedGpu::new()), &spec, &batches, sgd, Recompute::None, 3);
    let cpu = train_model(Arc::new(CpuBackend::new()), &spec, &batches, sgd, Recompute::None, 3);
    assert_same("SqueezeNet, SGD with momentum", &gpu, &cpu);
    // Small steps move the weights less than assert_same's tolerance: the updates themselves
    // must agree, to 0.1% of each tensor's largest, plus the rounding of the weights they are
    // read from (two ulps).
    for (name, c) in &cpu.weights {
        let (w0, g, c) =
            (cpu.initial[name].as_slice::<f32>(), gpu.weights[name].as_slice::<f32>(), c.as_slice::<f32>());
        let largest = c.iter().zip(w0).fold(0f32, |m, (c, w0)| m.max((c - w0).abs()));
        for (k, ((c, g), w0)) in c.iter().zip(g).zip(w0).enumerate() {
            let ulps = 2.0 * f32::EPSILON * w0.abs().max(c.abs());
            let diff = ((c - w0) - (g - w0)).abs();
            assert!(
                diff <= 1e-3 * largest + ulps,
                "the update of {name}[{k}] differs by {diff} (the tensor's largest update is {largest})"
            );
        }
    }
}
