//! The exported inference model is valid ONNX (the ONNX checker, full check) and ONNX Runtime
//! computes on it what the worker computes: GPT-2 and SqueezeNet, after some training, and
//! models exported from PyTorch at opset 17 and 20 (tests/torch_hf.rs's Llama, T5 and LSTM),
//! which the worker writes back at opset 18 or later (operands as inputs).
//!
//! Needs `TENSORFLEET_PYTHON` with onnx and onnxruntime (`make test` sets it).

mod common;
mod torch_oracle;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use tensorfleet_worker::backend::cpu::CpuBackend;
use tensorfleet_worker::config::{Gpt2Config, ModelSpec, SqueezeNetConfig};
use tensorfleet_worker::exec::Executor;
use tensorfleet_worker::graph::infer::{bind, Bindings};
use tensorfleet_worker::models;
use tensorfleet_worker::optim::Update;
use tensorfleet_worker::rng::Rng;
use tensorfleet_worker::session::{Session, SessionOptions};
use tensorfleet_worker::tensor::{DType, Tensor};

fn check(name: &str, spec: ModelSpec, batch: BTreeMap<String, Tensor>) {
    let model = models::load(&spec, 9).unwrap();
    let opts = SessionOptions::new(Update::Adam {
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-8,
        weight_decay: 0.0,
        decoupled: true,
    });
    let mut s = Session::new(Arc::new(CpuBackend::new()), &model, &batch, 1, &opts).unwrap();
    for k in 0..3 {
        s.step(std::slice::from_ref(&batch), 1e-3, 1.0, k).unwrap();
    }
    let weights = s.weights().unwrap();
    let dir = std::env::temp_dir().join(format!("tf-export-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.onnx");
    tensorfleet_worker::export::write(&model, &weights, &path).unwrap();

    // Our forward on the exported file itself.
    let proto = tensorfleet_worker::onnx::load_model(&path).unwrap();
    let g = tensorfleet_worker::graph::onnx_io::from_model(&proto, "model.onnx").unwrap();
    let mut b = Bindings::default();
    let mut inputs = serde_json::Map::new();
    for d in &g.inputs {
        let t = &batch[g.name_of(d.value)];
        b.shapes.insert(d.value, t.shape().to_vec());
        let dtype = if t.dtype() == DType::I64 { "int64" } else { "float32" };
        inputs.insert(
            g.name_of(d.value).to_string(),
            serde_json::json!({"dtype": dtype, "shape": t.shape(), "data": t.to_f64_vec()}),
        );
    }
    let bound = bind(&g, &b, false).unwrap();
    let mut ex = Executor::new(Arc::new(CpuBackend::new()), bound, &[]).unwrap();
    for d in ex.graph.inputs.clone() {
        ex.feed(d.value, &batch[ex.graph.name_of(d.value)]).unwrap();
    }
    ex.run(0).unwrap();

    std::fs::write(dir.join("inputs.json"), serde_json::Value::Object(inputs).to_string()).unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/oracle/run_onnxruntime.py");
    let out = Command::new(common::venv_python())
        .arg(&script)
        .args(["--model", path.to_str().unwrap(), "--inputs"])
        .arg(dir.join("inputs.json"))
        .arg("--output")
        .arg(dir.join("ort.json"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{name}: the ONNX checker or ONNX Runtime failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ort: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("ort.json")).unwrap()).unwrap();
    for &o in &ex.graph.outputs.clone() {
        let oname = ex.graph.name_of(o).to_string();
        let ours = ex.fetch(o).unwrap();
        let theirs: Vec<f64> = serde_json::from_value(ort[&oname]["data"].clone()).unwrap();
        let shape: Vec<usize> = serde_json::from_value(ort[&oname]["shape"].clone()).unwrap();
        assert_eq!(shape, ours.shape(), "{name}: output '{oname}' shape");
        let worst =
            ours.to_f64_vec().iter().zip(&theirs).map(|(a, b)| (a - b).abs() / b.abs().max(1.0)).fold(0.0, f64::max);
        assert!(worst < 1e-4, "{name}: output '{oname}' differs from ONNX Runtime's by {worst}");
        eprintln!("{name}: '{oname}' {:?} equals ONNX Runtime's (worst difference {worst:.1e})", ours.shape());
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
#[ignore = "needs TENSORFLEET_PYTHON: make test sets it"]
fn exported_models_run_in_onnx_runtime() {
    let c = Gpt2Config { layers: 2, heads: 2, embed: 32, seq_len: 16, vocab: 100, dropout: 0.1, ..Default::default() };
    let ids: Vec<i64> = (0..2 * 17).map(|i| (i * 13 % 100) as i64).collect();
    let batch = [
        ("input_ids".to_string(), Tensor::from_vec(&[2, 16], ids[..32].to_vec())),
        ("labels".to_string(), Tensor::from_vec(&[2, 16], ids[1..33].to_vec())),
    ]
    .into_iter()
    .collect();
    check("gpt2", ModelSpec { gpt2: Some(c), ..Default::default() }, batch);

    let mut rng = Rng::new(4);
    let image: Vec<f32> = (0..2 * 3 * 48 * 48).map(|_| rng.normal() as f32).collect();
    let batch = [
        ("image".to_string(), Tensor::from_vec(&[2, 3, 48, 48], image)),
        ("labels".to_string(), Tensor::from_vec(&[2], vec![1i64, 3])),
    ]
    .into_iter()
    .collect();
    let spec = ModelSpec { squeezenet: Some(SqueezeNetConfig { classes: 5, image_size: 48 }), ..Default::default() };
    check("squeezenet", spec, batch);

    let dir = torch_oracle::data_dir("torch_hf");
    for (model, exporter) in
        [("llama", "torchscript"), ("llama", "dynamo"), ("t5", "torchscript"), ("lstm", "torchscript")]
    {
        let spec = torch_oracle::spec(&dir, &format!("{model}_{exporter}.onnx"), Some(-100), Default::default());
        let batch = torch_oracle::batches(&dir.join(format!("{model}.pb")), 4, 1).swap_remove(0);
        check(&format!("{model}-{exporter}"), spec, batch);
    }
}
