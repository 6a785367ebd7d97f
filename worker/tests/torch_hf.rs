//! Hugging Face transformers and PyTorch recurrent nets, exported by PyTorch, train in
//! tensorfleet as PyTorch trains the module (tests/data/torch_hf/export.py wrote the models,
//! the batches and PyTorch's numbers): GPT-2, BERT, Llama, ViT and T5 at tiny sizes, and LSTM
//! and GRU classifiers, each exported by the TorchScript exporter and by the dynamo exporter,
//! loaded with an attached cross-entropy loss (labels -100 ignored) and no frozenWeights,
//! trained for 20 SGD and 20 AdamW steps on the CPU.
//!
//! Compared with PyTorch's float32 run: each step's loss within 1e-4 relative (PyTorch's own
//! float32 and float64 runs agree to 1e-6 on these nets) and the first step's gradient norm;
//! and what trains: exactly the module's parameters, buffers such as Llama's rotary
//! `inv_freq` not, tied weights as one.

mod torch_oracle;

use serde_json::Value;
use std::sync::Arc;
use tensorfleet_worker::backend::cpu::CpuBackend;
use tensorfleet_worker::config::{LlamaConfig, ModelSpec};
use tensorfleet_worker::data::Batch;
use tensorfleet_worker::error::Error;
use tensorfleet_worker::op::Op;
use tensorfleet_worker::session::{Session, SessionOptions};
use tensorfleet_worker::tensor::Tensor;
use torch_oracle::{batches, data_dir, expected, first_grad_norm, floats, load, rel, spec, update};

const TOLERANCE: f64 = 1e-4;

/// Trains `model`'s export by `exporter` with optimizer `kind` and compares with PyTorch.
fn trains_like_pytorch(model: &str, exporter: &str, kind: &str) {
    let dir = data_dir("torch_hf");
    let e = expected(&dir);
    let m = &e["models"][model];
    let export = &m["exports"][exporter];
    if let Some(err) = export["error"].as_str() {
        panic!("{model} {exporter}: the export failed in export.py: {err}");
    }
    let file = export["file"].as_str().unwrap();
    let case = format!("{file} {kind}");
    // What the module's nn.Embedding(padding_idx) layers say, which the user configures.
    let padding_idx = serde_json::from_value(export["paddingIdx"].clone()).unwrap();
    let loaded = load(&dir, file, e["ignoreIndex"].as_i64(), padding_idx);
    let data = dir.join(m["data"].as_str().unwrap());
    let batches = batches(&data, e["batch"].as_u64().unwrap() as usize, e["batches"].as_u64().unwrap() as usize);
    let torch = &m[kind]["float32"];
    let want = floats(&torch["losses"]);

    let (update, lr) = update(&e, kind);
    let opts = SessionOptions::new(update);
    let mut s = Session::new(Arc::new(CpuBackend::new()), &loaded, &batches[0], 1, &opts)
        .unwrap_or_else(|err| panic!("{case}: {err}"));
    trains_the_module_parameters(&case, &s, m, export);
    if model == "llama" {
        // Its RMSNorms (two a block and the last; with the residual add before them where the
        // graph lets `residual_layer_norm` fold it), SwiGLU MLPs and rotary embeddings (q's and
        // k's), as either exporter writes them, are fused.
        let count = |pick: fn(&Op) -> bool| s.train.graph.nodes.iter().filter(|n| pick(&n.op)).count();
        let rms = count(|op| matches!(op, Op::LayerNorm { rms: true, .. } | Op::ResidualLayerNorm { rms: true, .. }));
        let swiglu = count(|op| *op == Op::Swiglu);
        let rotary = count(|op| *op == Op::Rotary);
        assert_eq!((rms, swiglu, rotary), (5, 2, 4), "{case}: RMSNorms, SwiGLUs and rotary embeddings fused");
    }

    let mut losses = Vec::new();
    let mut grad_norm = f64::NAN;
    for step in 0..want.len() {
        let r = s.step(std::slice::from_ref(&batches[step % batches.len()]), lr, 0.0, 0).unwrap();
        if step == 0 {
            grad_norm = first_grad_norm(&case, r.grad_norm, torch, TOLERANCE);
        }
        losses.push(r.loss);
    }
    let worst = (0..want.len()).map(|k| rel(losses[k], want[k])).fold(0.0, f64::max);
    println!(
        "{case}: losses agree with PyTorch's to {worst:.1e} over {} steps; first-step gradient norm {grad_norm:.1e}",
        want.len()
    );
    for k in 0..want.len() {
        assert!(
            rel(losses[k], want[k]) <= TOLERANCE,
            "{case}: step {}: loss {} vs PyTorch's {} (losses {losses:?})",
            k + 1,
            losses[k],
            want[k]
        );
    }
}

/// The session trains exactly the initializers that are the module's parameters (a tied one
/// once), as many values as PyTorch's module has; its buffers, which the exporter may write as
/// initializers too, do not train.
fn trains_the_module_parameters(case: &str, s: &Session<CpuBackend>, m: &Value, export: &Value) {
    let names = |key: &str| -> Vec<String> { serde_json::from_value(export[key].clone()).unwrap() };
    let mut trained = s.weight_names();
    trained.sort();
    assert_eq!(trained, names("parameterInitializers"), "{case}: what trains");
    let state = s.state().unwrap();
    let values: usize = trained.iter().map(|n| state[n.as_str()].numel()).sum();
    assert_eq!(values as u64, m["parameters"].as_u64().unwrap(), "{case}: trained values vs the module's parameters");
    assert!(names("otherFloatInitializers").is_empty(), "{case}: initializers that are not the module's state");
}

/// The builtin Llama (`model.llama`) computes what Hugging Face's LlamaForCausalLM computes:
/// given the weights of the exported one (x·W layouts: the nn.Linear weights transposed), its
/// losses over 10 AdamW steps on the unpadded batch are the export's (which follow PyTorch's
/// above), from both exporters.
#[test]
fn builtin_llama_trains_as_the_exported_hf_llama() {
    let dir = data_dir("torch_hf");
    let e = expected(&dir);
    let config = LlamaConfig {
        layers: 2,
        heads: 4,
        kv_heads: 2,
        embed: 16,
        ffn: 32,
        seq_len: 8,
        vocab: 64,
        rope_theta: 10000.0,
        norm_eps: 1e-6,
    };
    let spec = ModelSpec { llama: Some(config), ..Default::default() };
    let (update, lr) = update(&e, "adamw");
    let batch = batches(&dir.join("llama.pb"), 4, 1).swap_remove(0);
    let train = |model: &tensorfleet_worker::models::Model, batch: &Batch| -> Vec<f64> {
        let mut s = Session::new(Arc::new(CpuBackend::new()), model, batch, 1, &SessionOptions::new(update)).unwrap();
        (0..10).map(|k| s.step(std::slice::from_ref(batch), lr, 0.0, k).unwrap().loss).collect()
    };
    for file in ["llama_torchscript.onnx", "llama_dynamo.onnx"] {
        let exported = load(&dir, file, Some(-100), Default::default());
        let mut builtin = tensorfleet_worker::models::load(&spec, 0).unwrap();
        let mut copied = 0;
        for (&v, t) in builtin.graph.initializers.iter_mut() {
            let name = builtin.graph.values[v].name.clone();
            let Some(w) = exported.graph.find(&format!("model.{name}")).map(|w| &exported.graph.initializers[&w])
            else {
                continue;
            };
            *t = if name.ends_with("_proj.weight") || name == "lm_head.weight" { transposed(w) } else { w.clone() };
            copied += 1;
        }
        assert_eq!(copied, 21, "{file}: the builtin's 21 weights, each found in the export");
        // The builtin reads input_ids only: the export's attention_mask is all ones here.
        let mut unmasked = batch.clone();
        assert!(unmasked.remove("attention_mask").unwrap().to_f64_vec().iter().all(|&m| m == 1.0));
        let (ours, theirs) = (train(&builtin, &unmasked), train(&exported, &batch));
        let worst = ours.iter().zip(&theirs).map(|(a, b)| rel(*a, *b)).fold(0.0, f64::max);
        println!("builtin Llama vs {file}: losses agree to {worst:.1e} over 10 steps ({ours:?})");
        assert!(worst <= 1e-5, "{file}: builtin {ours:?}, export {theirs:?}");
    }
}

/// A 2-D tensor's transpose.
fn transposed(t: &Tensor) -> Tensor {
    let (r, c) = (t.shape()[0], t.shape()[1]);
    let v = t.as_slice::<f32>();
    Tensor::from_vec(&[c, r], (0..r * c).map(|k| v[(k % r) * c + k / r]).collect::<Vec<f32>>())
}

/// A paddingIdx entry that cannot apply is a configuration error naming the entry.
#[test]
fn padding_idx_names_a_row_of_an_embedding() {
    let dir = data_dir("torch_hf");
    let embedding = "model.bert.embeddings.word_embeddings.weight";
    for (name, row, want) in [
        ("model.bert.embeddings.word_embeddings", 0, "the model has no initializer named"),
        (embedding, 64, "row 64 is outside the embedding's 64 rows"),
        ("model.bert.embeddings.LayerNorm.weight", 0, "no Gather on axis 0 looks rows up in"),
    ] {
        let spec = spec(&dir, "bert_torchscript.onnx", Some(-100), [(name.to_string(), row)].into());
        let err = tensorfleet_worker::models::load(&spec, 0).err().unwrap_or_else(|| panic!("{name}: loaded"));
        assert!(matches!(err, Error::Config(_)), "{name}: {err:?}");
        assert!(err.to_string().contains(&format!("model.onnx.paddingIdx.{name}: {want}")), "{err}");
    }
}

macro_rules! cases {
    ($($name:ident: $model:literal $exporter:literal $kind:literal;)*) => {
        $(
            #[test]
            fn $name() {
                trains_like_pytorch($model, $exporter, $kind);
            }
        )*
    };
}

cases! {
    gpt2_torchscript_sgd: "gpt2" "torchscript" "sgd";
    gpt2_torchscript_adamw: "gpt2" "torchscript" "adamw";
    gpt2_dynamo_sgd: "gpt2" "dynamo" "sgd";
    gpt2_dynamo_adamw: "gpt2" "dynamo" "adamw";
    bert_torchscript_sgd: "bert" "torchscript" "sgd";
    bert_torchscript_adamw: "bert" "torchscript" "adamw";
    bert_dynamo_sgd: "bert" "dynamo" "sgd";
    bert_dynamo_adamw: "bert" "dynamo" "adamw";
    llama_torchscript_sgd: "llama" "torchscript" "sgd";
    llama_torchscript_adamw: "llama" "torchscript" "adamw";
    llama_dynamo_sgd: "llama" "dynamo" "sgd";
    llama_dynamo_adamw: "llama" "dynamo" "adamw";
    vit_torchscript_sgd: "vit" "torchscript" "sgd";
    vit_torchscript_adamw: "vit" "torchscript" "adamw";
    vit_dynamo_sgd: "vit" "dynamo" "sgd";
    vit_dynamo_adamw: "vit" "dynamo" "adamw";
    t5_torchscript_sgd: "t5" "torchscript" "sgd";
    t5_torchscript_adamw: "t5" "torchscript" "adamw";
    t5_dynamo_sgd: "t5" "dynamo" "sgd";
    t5_dynamo_adamw: "t5" "dynamo" "adamw";
    lstm_torchscript_sgd: "lstm" "torchscript" "sgd";
    lstm_torchscript_adamw: "lstm" "torchscript" "adamw";
    lstm_dynamo_sgd: "lstm" "dynamo" "sgd";
    lstm_dynamo_adamw: "lstm" "dynamo" "adamw";
    gru_torchscript_sgd: "gru" "torchscript" "sgd";
    gru_torchscript_adamw: "gru" "torchscript" "adamw";
    gru_dynamo_sgd: "gru" "dynamo" "sgd";
    gru_dynamo_adamw: "gru" "dynamo" "adamw";
}
