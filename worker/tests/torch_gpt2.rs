//! A GPT-2 exported by PyTorch (`torch.onnx.export`, see tests/data/torch_gpt2/export.py) loads,
//! runs forward like PyTorch, and trains like PyTorch: the losses of 5 SGD steps on one batch
//! equal the ones PyTorch recorded in expected.json.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use tensorfleet_worker::backend::cpu::CpuBackend;
use tensorfleet_worker::config::{LossConfig, LossKind, ModelSpec, OnnxModelConfig};
use tensorfleet_worker::exec::Executor;
use tensorfleet_worker::graph::infer::{bind, Bindings};
use tensorfleet_worker::models;
use tensorfleet_worker::op::{AttentionLayout, Op};
use tensorfleet_worker::optim::Update;
use tensorfleet_worker::session::{Session, SessionOptions};
use tensorfleet_worker::tensor::Tensor;

fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/torch_gpt2")
}

struct Expected {
    batch: BTreeMap<String, Tensor>,
    logits: Vec<f64>,
    loss: f64,
    sgd_lr: f64,
    sgd_losses: Vec<f64>,
}

fn expected() -> Expected {
    let text = std::fs::read_to_string(data_dir().join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let rows = |k: &str| -> Tensor {
        let r: Vec<Vec<i64>> = serde_json::from_value(v[k].clone()).unwrap();
        let shape = [r.len(), r[0].len()];
        Tensor::from_vec(&shape, r.into_iter().flatten().collect())
    };
    let batch =
        [("input_ids".to_string(), rows("input_ids")), ("labels".to_string(), rows("labels"))].into_iter().collect();
    Expected {
        batch,
        logits: serde_json::from_value(v["logits"].clone()).unwrap(),
        loss: v["loss"].as_f64().unwrap(),
        sgd_lr: v["sgd"]["lr"].as_f64().unwrap(),
        sgd_losses: serde_json::from_value(v["sgd"]["losses"].clone()).unwrap(),
    }
}

fn spec(file: &str, loss: LossConfig) -> ModelSpec {
    ModelSpec {
        onnx: Some(OnnxModelConfig {
            path: data_dir().join(file),
            loss,
            dims: Default::default(),
            padding_idx: Default::default(),
        }),
        ..Default::default()
    }
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs()).max(1e-6)
}

fn trains_like_pytorch(file: &str, loss: LossConfig) {
    let e = expected();
    let model = models::load(&spec(file, loss), 0).unwrap();

    // Forward in inference mode: logits and loss as PyTorch computed them.
    let g = &model.graph;
    let mut b = Bindings::default();
    for d in &g.inputs {
        b.shapes.insert(d.value, e.batch[g.name_of(d.value)].shape().to_vec());
    }
    let mut bound = bind(g, &b, false).unwrap();
    let logits = bound.find("logits").unwrap();
    bound.outputs = vec![logits, model.loss];
    let mut ex = Executor::new(Arc::new(CpuBackend::new()), bound, &[]).unwrap();
    for d in ex.graph.inputs.clone() {
        ex.feed(d.value, &e.batch[ex.graph.name_of(d.value)]).unwrap();
    }
    ex.run(0).unwrap();
    let got = ex.fetch(logits).unwrap().to_f64_vec();
    assert_eq!(got.len(), e.logits.len());
    let worst = got.iter().zip(&e.logits).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(worst < 1e-4, "{file}: logits differ from PyTorch's by up to {worst}");
    let loss = ex.fetch(model.loss).unwrap().to_f64_vec()[0];
    assert!(close(loss, e.loss, 1e-5), "{file}: loss {loss} vs PyTorch {}", e.loss);

    // Training: plain SGD on the same batch, step after step.
    let opts = SessionOptions::new(Update::Sgd { momentum: 0.0, nesterov: false, weight_decay: 0.0 });
    let mut s = Session::new(Arc::new(CpuBackend::new()), &model, &e.batch, 1, &opts).unwrap();
    // masked_fill's attention, recognized: the training runs the fused kernel and its backward,
    // on q, k and v where c_attn writes them (its Split of three gone).
    let count = |pick: fn(&Op) -> bool| s.train.graph.nodes.iter().filter(|n| pick(&n.op)).count();
    let fused = count(|op| matches!(op, Op::Attention { causal: true, .. }));
    assert!(fused >= 1, "{file}: no attention was fused");
    let packed = count(|op| matches!(op, Op::Attention { layout: AttentionLayout::Packed, .. }));
    assert_eq!(packed, fused, "{file}: attentions on a packed qkv");
    for (k, want) in e.sgd_losses.iter().enumerate() {
        let r = s.step(std::slice::from_ref(&e.batch), e.sgd_lr, 0.0, 0).unwrap();
        assert!(close(r.loss, *want, 1e-4), "{file}: SGD step {}: loss {} vs PyTorch {want}", k + 1, r.loss);
    }
}

#[test]
fn exported_gpt2_with_its_own_loss() {
    trains_like_pytorch(
        "gpt2_tiny_with_loss.onnx",
        LossConfig { kind: None, output: "loss".into(), label: "labels".into(), ignore_index: None },
    );
}

#[test]
fn exported_gpt2_with_an_attached_loss() {
    trains_like_pytorch(
        "gpt2_tiny.onnx",
        LossConfig {
            kind: Some(LossKind::SoftmaxCrossEntropy),
            output: "logits".into(),
            label: "labels".into(),
            ignore_index: Some(-100),
        },
    );
}
