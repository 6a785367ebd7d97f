//! What the tests against PyTorch's training share (tests/torch_cnn.rs, tests/torch_hf.rs):
//! each reads a directory under tests/data/ that an export.py wrote — the exported models,
//! the batches in onnxSamples format and expected.json with PyTorch's losses — and loads the
//! models as a user configures them.

#![allow(dead_code)] // each test file uses its own part of it

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tensorfleet_worker::config::{DataFormat, DataSource, LossConfig, LossKind, ModelSpec, OnnxModelConfig};
use tensorfleet_worker::data::{self, Batch, Batching, Feeds, Partition};
use tensorfleet_worker::models::{self, Model};
use tensorfleet_worker::optim::Update;

/// tests/data/<name>.
pub fn data_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

/// The directory's expected.json.
pub fn expected(dir: &Path) -> Value {
    let path = dir.join("expected.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("expected.json is JSON")
}

pub fn floats(v: &Value) -> Vec<f64> {
    serde_json::from_value(v.clone()).expect("a list of numbers")
}

/// |a − b| relative to b.
pub fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-12)
}

/// The model as a user configures it: the ONNX file, cross-entropy on `logits` (labels equal
/// to `ignore_index` not counting), the embeddings' padding rows, nothing frozen.
pub fn load(dir: &Path, file: &str, ignore_index: Option<i64>, padding_idx: BTreeMap<String, i64>) -> Model {
    models::load(&spec(dir, file, ignore_index, padding_idx), 0).unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// The configuration `load` loads.
pub fn spec(dir: &Path, file: &str, ignore_index: Option<i64>, padding_idx: BTreeMap<String, i64>) -> ModelSpec {
    let loss = LossConfig {
        kind: Some(LossKind::SoftmaxCrossEntropy),
        output: "logits".into(),
        label: "labels".into(),
        ignore_index,
    };
    ModelSpec {
        onnx: Some(OnnxModelConfig { path: dir.join(file), loss, dims: Default::default(), padding_idx }),
        ..Default::default()
    }
}

/// The first `count` batches of `batch` samples of an onnxSamples file, read as training reads
/// them (in order, no shuffle).
pub fn batches(path: &Path, batch: usize, count: usize) -> Vec<Batch> {
    let src = DataSource { path: path.to_path_buf(), format: DataFormat::OnnxSamples };
    let batching = Batching { batch, seq_len: 0, shuffle: false, seed: 0, partition: Partition::WHOLE };
    let feeds = Feeds::default();
    let mut loader = data::open(&src, "data.train", batching, &feeds).unwrap();
    (0..count).map(|_| loader.next_batch().unwrap()).collect()
}

/// The first step's gradient norm `got` against PyTorch's (`torch["gradNorm"]`): within
/// `tolerance` relative, or the test fails naming `case`. Returns the relative difference.
pub fn first_grad_norm(case: &str, got: f64, torch: &Value, tolerance: f64) -> f64 {
    let norm = torch["gradNorm"].as_f64().expect("expected.json gives the first step's gradient norm");
    assert!(rel(got, norm) <= tolerance, "{case}: first step's gradient norm {got} vs PyTorch's {norm}");
    rel(got, norm)
}

/// The update and learning rate of optimizer `kind` ("sgd" or "adamw") as expected.json gives
/// its hyperparameters.
pub fn update(e: &Value, kind: &str) -> (Update, f64) {
    let o = &e[kind];
    let f = |k: &str| o[k].as_f64().unwrap();
    let update = match kind {
        "sgd" => Update::Sgd { momentum: f("momentum") as f32, nesterov: false, weight_decay: f("weightDecay") as f32 },
        _ => Update::Adam {
            beta1: f("beta1") as f32,
            beta2: f("beta2") as f32,
            epsilon: f("epsilon") as f32,
            weight_decay: f("weightDecay") as f32,
            decoupled: true,
        },
    };
    (update, f("lr"))
}
