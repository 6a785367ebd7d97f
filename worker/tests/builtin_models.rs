//! The builtin builders emit graphs that train: SqueezeNet 1.1 and GPT-2 with dropout fit a
//! fixed batch, and their exported inference models load back.

use std::collections::BTreeMap;
use std::sync::Arc;
use tensorfleet_worker::backend::cpu::CpuBackend;
use tensorfleet_worker::config::{Gpt2Config, ModelSpec, ParamGroup, Recompute, SqueezeNetConfig};
use tensorfleet_worker::models;
use tensorfleet_worker::optim::Update;
use tensorfleet_worker::rng::Rng;
use tensorfleet_worker::session::{Session, SessionOptions};
use tensorfleet_worker::tensor::Tensor;

fn options(update: Update) -> SessionOptions {
    SessionOptions::new(update)
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
    let c = Gpt2Config { layers: 2, heads: 2, embed: 32, seq_len: 16, vocab: 50, dropout: 0.1, ..Default::default() };
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
    let c = Gpt2Config { layers: 1, heads: 2, embed: 16, seq_len: 8, vocab: 40, ..Default::default() };
    let model = models::load(&ModelSpec { gpt2: Some(c), ..Default::default() }, 2).unwrap();
    let ids: Vec<i64> = (0..2 * 9).map(|i| (i * 7 % 40) as i64).collect();
    let batch: BTreeMap<String, Tensor> = [
        ("input_ids".to_string(), Tensor::from_vec(&[2, 8], ids[..16].to_vec())),
        ("labels".to_string(), Tensor::from_vec(&[2, 8], ids[1..17].to_vec())),
    ]
    .into_iter()
    .collect();
    let opts = SessionOptions {
        frozen: vec!["wpe".into()],
        no_decay: vec!["bias".into(), "ln_".into()],
        ..SessionOptions::new(Update::Lamb { beta1: 0.9, beta2: 0.999, epsilon: 1e-6, weight_decay: 0.01 })
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

    let bad = SessionOptions { frozen: vec!["no_such_weight".into()], ..opts.clone() };
    let e = Session::new(Arc::new(CpuBackend::new()), &model, &batch, 1, &bad).err().unwrap();
    assert!(e.to_string().contains("frozenWeights") && e.to_string().contains("no_such_weight"), "{e}");

    // Per-weight hyperparameters: a group with lrScale 0 holds the MLP's weights still while
    // the rest trains; weightsToTrain trains exactly the weights it names.
    let held = ParamGroup { weights: vec!["mlp".into()], lr_scale: Some(0.0), ..Default::default() };
    let grouped = SessionOptions { groups: vec![held], ..opts.clone() };
    let mut s = Session::new(Arc::new(CpuBackend::new()), &model, &batch, 1, &grouped).unwrap();
    let before = s.weights().unwrap();
    s.step(std::slice::from_ref(&batch), 0.1, 1.0, 0).unwrap();
    let after = s.weights().unwrap();
    for (name, w) in &before {
        assert_eq!(name.contains("mlp"), after[name] == *w, "{name}: only the lrScale-0 group stays put");
    }
    let only = SessionOptions { trainable: vec!["wte".into()], frozen: vec![], ..opts.clone() };
    let s = Session::new(Arc::new(CpuBackend::new()), &model, &batch, 1, &only).unwrap();
    assert_eq!(s.weights().unwrap().keys().collect::<Vec<_>>(), ["wte"]);
    let stray = ParamGroup { weights: vec!["attention_typo".into()], ..Default::default() };
    let bad = SessionOptions { groups: vec![ParamGroup::default(), stray], ..opts };
    let e = Session::new(Arc::new(CpuBackend::new()), &model, &batch, 1, &bad).err().unwrap();
    assert!(e.to_string().contains("optimizer.groups[1].weights") && e.to_string().contains("attention_typo"), "{e}");
}

/// The model FLOPs MFU is measured with: for GPT-2, the counted GEMMs give nanoGPT's (PaLM's)
/// closed form, 6·(12·L·C² + C·V) + 12·L·T·C per token (the weights in products; attention
/// counted in full); dropout does not change it.
#[test]
fn gpt2_model_flops_match_the_closed_form() {
    let (layers, heads, embed, seq, vocab, batch) = (2, 2, 32, 16, 96, 3);
    let spec = ModelSpec {
        gpt2: Some(Gpt2Config { layers, heads, embed, seq_len: seq, vocab, dropout: 0.1, ..Default::default() }),
        ..Default::default()
    };
    let model = models::load(&spec, 0).unwrap();
    let ids: Vec<i64> = (0..batch * seq).map(|i| (i % vocab) as i64).collect();
    let batch_tensors: BTreeMap<String, Tensor> = [
        ("input_ids".to_string(), Tensor::from_vec(&[batch, seq], ids.clone())),
        ("labels".to_string(), Tensor::from_vec(&[batch, seq], ids)),
    ]
    .into_iter()
    .collect();
    let s = Session::new(Arc::new(CpuBackend::new()), &model, &batch_tensors, 1, &options(ADAM)).unwrap();
    let (l, c, t, v) = (layers as f64, embed as f64, seq as f64, vocab as f64);
    let per_token = 6.0 * (12.0 * l * c * c + c * v) + 12.0 * l * t * c;
    assert_eq!(s.flops_per_batch, per_token * (batch * seq) as f64);
}

/// Recomputing GELU outputs or whole transformer blocks in the backward pass changes memory,
/// not numbers: per-step losses and final weights are bit-identical (dropout on, so the
/// recomputed dropouts must draw the same masks), and the planned arena shrinks.
#[test]
fn recompute_saves_memory_and_changes_nothing_else() {
    let spec = ModelSpec {
        gpt2: Some(Gpt2Config {
            layers: 3,
            heads: 2,
            embed: 32,
            seq_len: 32,
            vocab: 64,
            dropout: 0.1,
            ..Default::default()
        }),
        ..Default::default()
    };
    let model = models::load(&spec, 5).unwrap();
    let mut rng = Rng::new(2);
    let ids: Vec<i64> = (0..4 * 33).map(|_| rng.below(64) as i64).collect();
    let rows =
        |off: usize| -> Vec<i64> { (0..4).flat_map(|b| ids[b * 33 + off..b * 33 + off + 32].to_vec()).collect() };
    let batch: BTreeMap<String, Tensor> = [
        ("input_ids".to_string(), Tensor::from_vec(&[4, 32], rows(0))),
        ("labels".to_string(), Tensor::from_vec(&[4, 32], rows(1))),
    ]
    .into_iter()
    .collect();
    let run = |mode: Recompute| {
        let opts = SessionOptions { recompute: mode, ..options(ADAM) };
        let mut s = Session::new(Arc::new(CpuBackend::new()), &model, &batch, 1, &opts).unwrap();
        let losses: Vec<f64> =
            (0..4).map(|k| s.step(std::slice::from_ref(&batch), 1e-2, 1.0, k).unwrap().loss).collect();
        (losses, s.weights().unwrap(), s.memory().0)
    };
    let (losses, weights, arena) = run(Recompute::None);
    for mode in [Recompute::Gelu, Recompute::Layer] {
        let (l, w, a) = run(mode);
        assert_eq!(l, losses, "{mode:?}: per-step losses");
        assert!(w == weights, "{mode:?}: final weights");
        assert!(a < arena, "{mode:?}: arena {a} bytes, without recompute {arena}");
    }
    let (_, _, layer) = run(Recompute::Layer);
    let (_, _, gelu) = run(Recompute::Gelu);
    assert!(layer < gelu, "a whole block saves more than its GELU: {layer} vs {gelu}");
}
