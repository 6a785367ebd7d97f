//! The builtin builders emit graphs that train: SqueezeNet 1.1 and GPT-2 with dropout fit a
//! fixed batch, and their exported inference models load back.

use std::collections::BTreeMap;
use std::sync::Arc;
use tensorfleet_worker::backend::cpu::CpuBackend;
use tensorfleet_worker::config::{Gpt2Config, ModelSpec, SqueezeNetConfig};
use tensorfleet_worker::models;
use tensorfleet_worker::optim::Update;
use tensorfleet_worker::rng::Rng;
use tensorfleet_worker::session::{Session, SessionOptions};
use tensorfleet_worker::tensor::Tensor;

fn options(update: Update) -> SessionOptions {
    SessionOptions { update, disabled_passes: vec![], frozen: vec![], no_decay: vec![] }
}

const ADAM: Update = Update::Adam { beta1: 0.9, beta2: 0.999, epsilon: 1e-8, weight_decay: 0.0, decoupled: true };

/// Trains `steps` updates on one batch; returns its loss (dropout off) before and after.
fn fit(spec: &ModelSpec, update: Update, batch: BTreeMap<String, Tensor>, steps: usize, lr: f64) -> (f64, f64) {
    let model = models::load(spec, 3).unwrap();
    let mut s = Session::new(Arc::new(CpuBackend::new()), &model, &batch, 1, &options(update)).unwrap();
    let before = s.evaluate(std::slice::from_ref(&batch)).unwrap();
    for k in 0..steps {
        let r = s.step(std::slice::from_ref(&batch), lr, 1.0, k as u64).unwrap();
        assert!(r.loss.is_finite(), "step {k}: loss {}", r.loss);
    }
    // The exported forward graph round-trips through ONNX.
    let dir = std::env::temp_dir().join(format!("tf-builtin-{}-{}", model.graph.name, std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.onnx");
    tensorfleet_worker::export::write(&model, &s.weights().unwrap(), &path).unwrap();
    let proto = tensorfleet_worker::onnx::load_model(&path).unwrap();
    let g = tensorfleet_worker::graph::onnx_io::from_model(&proto, "model.onnx").unwrap();
    assert!(g.inputs.iter().all(|d| g.name_of(d.value) != "labels"), "labels are not an input of the inference model");
    std::fs::remove_dir_all(&dir).ok();
    (before, s.evaluate(std::slice::from_ref(&batch)).unwrap())
}

#[test]
fn squeezenet_fits_a_batch() {
    let spec = ModelSpec { squeezenet: Some(SqueezeNetConfig { classes: 4, image_size: 64 }), ..Default::default() };
    let mut rng = Rng::new(1);
    // Noise plus a per-class brightness of one channel: learnable in a few steps.
    let plane = 64 * 64;
    let image: Vec<f32> = (0..4 * 3 * plane)
        .map(|i| {
            let (n, c) = (i / (3 * plane), (i / plane) % 3);
            let signal = if c == n % 3 {
                if n == 3 {
                    -1.5
                } else {
                    1.5
                }
            } else {
                0.0
            };
            (rng.normal() * 0.5 + signal) as f32
        })
        .collect();
    let batch = [
        ("image".to_string(), Tensor::from_vec(&[4, 3, 64, 64], image)),
        ("labels".to_string(), Tensor::from_vec(&[4], vec![0i64, 1, 2, 3])),
    ]
    .into_iter()
    .collect();
    // SGD with momentum, as torchvision trains SqueezeNet (Adam kills its final ReLU at once).
    let sgd = Update::Sgd { momentum: 0.9, nesterov: false, weight_decay: 0.0 };
    let (first, last) = fit(&spec, sgd, batch, 30, 0.01);
    assert!(last < first * 0.8, "SqueezeNet loss {first} -> {last}");
}

#[test]
fn gpt2_with_dropout_fits_a_batch() {
    let c = Gpt2Config { layers: 2, heads: 2, embed: 32, seq_len: 16, vocab: 50, dropout: 0.1 };
    let spec = ModelSpec { gpt2: Some(c), ..Default::default() };
    let ids: Vec<i64> = (0..2 * 17).map(|i| (i * 5 % 50) as i64).collect();
    let batch = [
        ("input_ids".to_string(), Tensor::from_vec(&[2, 16], ids[..32].to_vec())),
        ("labels".to_string(), Tensor::from_vec(&[2, 16], ids[1..33].to_vec())),
    ]
    .into_iter()
    .collect();
    let (first, last) = fit(&spec, ADAM, batch, 30, 3e-3);
    assert!(last < first * 0.5, "GPT-2 loss {first} -> {last}");
}

#[test]
fn an_attached_mse_loss_trains_a_regression() {
    use tensorfleet_worker::config::{LossConfig, LossKind, MlpConfig};
    let g = tensorfleet_worker::models::mlp::build(&MlpConfig { inputs: 3, hidden: vec![16], classes: 2 }, 5).unwrap();
    let loss =
        LossConfig { kind: Some(LossKind::Mse), output: "logits".into(), label: "target".into(), ignore_index: None };
    let model = models::with_loss(g, &loss).unwrap();
    // Targets are a fixed linear map of the inputs.
    let mut rng = Rng::new(8);
    let x: Vec<f32> = (0..16 * 3).map(|_| rng.normal() as f32).collect();
    let y: Vec<f32> = x.chunks(3).flat_map(|r| [r[0] - 0.5 * r[1], 0.3 * r[2] + 0.2]).collect();
    let batch: BTreeMap<String, Tensor> =
        [("x".to_string(), Tensor::from_vec(&[16, 3], x)), ("target".to_string(), Tensor::from_vec(&[16, 2], y))]
            .into_iter()
            .collect();
    let mut s = Session::new(Arc::new(CpuBackend::new()), &model, &batch, 1, &options(ADAM)).unwrap();
    let first = s.step(std::slice::from_ref(&batch), 1e-2, 0.0, 0).unwrap().loss;
    let mut last = first;
    for k in 1..100 {
        last = s.step(std::slice::from_ref(&batch), 1e-2, 0.0, k).unwrap().loss;
    }
    assert!(last < first * 0.1, "MSE {first} -> {last}");
}

#[test]
fn lamb_trains_and_frozen_weights_stay_put() {
    let c = Gpt2Config { layers: 1, heads: 2, embed: 16, seq_len: 8, vocab: 40, dropout: 0.0 };
    let model = models::load(&ModelSpec { gpt2: Some(c), ..Default::default() }, 2).unwrap();
    let ids: Vec<i64> = (0..2 * 9).map(|i| (i * 7 % 40) as i64).collect();
    let batch: BTreeMap<String, Tensor> = [
        ("input_ids".to_string(), Tensor::from_vec(&[2, 8], ids[..16].to_vec())),
        ("labels".to_string(), Tensor::from_vec(&[2, 8], ids[1..17].to_vec())),
    ]
    .into_iter()
    .collect();
    let opts = SessionOptions {
        update: Update::Lamb { beta1: 0.9, beta2: 0.999, epsilon: 1e-6, weight_decay: 0.01 },
        disabled_passes: vec![],
        frozen: vec!["wpe".into()],
        no_decay: vec!["bias".into(), "ln_".into()],
    };
    let wpe_before = model.graph.initializers[&model.graph.find("wpe").unwrap()].clone();
    let mut s = Session::new(Arc::new(CpuBackend::new()), &model, &batch, 1, &opts).unwrap();
    // LAMB moves each tensor by lr·‖w‖: small initial weights want a larger rate than Adam.
    let first = s.step(std::slice::from_ref(&batch), 0.1, 1.0, 0).unwrap().loss;
    let mut last = first;
    for k in 1..30 {
        last = s.step(std::slice::from_ref(&batch), 0.1, 1.0, k).unwrap().loss;
    }
    assert!(last < first * 0.5, "LAMB loss {first} -> {last}");
    let w = s.weights().unwrap();
    assert!(!w.contains_key("wpe"), "a frozen weight is not a trained weight");
    assert_eq!(s.train.fetch(s.train.graph.find("wpe").unwrap()).unwrap(), wpe_before);

    let bad = SessionOptions { frozen: vec!["no_such_weight".into()], ..opts };
    let e = Session::new(Arc::new(CpuBackend::new()), &model, &batch, 1, &bad).err().unwrap();
    assert!(e.to_string().contains("frozenWeights") && e.to_string().contains("no_such_weight"), "{e}");
}
