//! torchvision CNNs exported by PyTorch train in tensorfleet as PyTorch trains the module
//! (tests/data/torch_cnn/export.py wrote the models, the batches and PyTorch's numbers):
//! resnet18's and mobilenet_v2's topologies at tiny widths, each exported by the TorchScript
//! exporter and by the dynamo exporter, loaded with an attached cross-entropy loss and no
//! frozenWeights, trained for 20 SGD and 20 AdamW steps on the CPU.
//!
//! Compared with PyTorch's float32 run: each step's loss (1e-4 relative) over the steps where
//! PyTorch's own float32 and float64 runs agree to 1e-4 (BatchNorm makes these nets sensitive
//! to rounding, so later steps of the two PyTorch runs differ as much as any two runs do), the
//! first step's gradient norm, and after those steps the running statistics and the
//! evaluation (inference-mode) loss. The inference export holds the trained running statistics
//! and runs BatchNormalization in inference mode.

mod torch_oracle;

use serde_json::Value;
use std::path::PathBuf;
use std::sync::Arc;
use tensorfleet_worker::backend::cpu::CpuBackend;
use tensorfleet_worker::data::Batch;
use tensorfleet_worker::models::Model;
use tensorfleet_worker::op::Op;
use tensorfleet_worker::session::buffers::{self, Role};
use tensorfleet_worker::session::{Session, SessionOptions};
use tensorfleet_worker::tensor::Tensor;
use torch_oracle::{first_grad_norm, floats, rel, update};

const TOLERANCE: f64 = 1e-4;

fn data_dir() -> PathBuf {
    torch_oracle::data_dir("torch_cnn")
}

fn expected() -> Value {
    torch_oracle::expected(&data_dir())
}

/// The model as a user configures it: the ONNX file, cross-entropy on `logits`, nothing frozen.
fn load(file: &str) -> Model {
    torch_oracle::load(&data_dir(), file, None, Default::default())
}

/// The batches PyTorch trained on.
fn batches(e: &Value) -> Vec<Batch> {
    let path = data_dir().join(e["data"].as_str().unwrap());
    torch_oracle::batches(&path, e["batch"].as_u64().unwrap() as usize, e["batches"].as_u64().unwrap() as usize)
}

/// The worst difference of `got` from `want`, over the elements, relative to the tensor's
/// largest magnitude, or to 1e-3 when that is smaller: a BatchNormalization after a bias-free
/// 1x1 convolution of normalized channels has batch mean 0, and its running mean is rounding
/// noise (1e-9) in PyTorch's float32 and float64 runs alike.
fn worst_difference(got: &Tensor, want: &[f64]) -> f64 {
    let got = got.to_f64_vec();
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
    got.iter().zip(want).map(|(a, b)| (a - b).abs() / scale).fold(0.0, f64::max)
}

/// Trains `model`'s export by `exporter` with optimizer `kind` and compares with PyTorch.
fn trains_like_pytorch(model: &str, exporter: &str, kind: &str) {
    let e = expected();
    let m = &e["models"][model];
    let export = &m["exports"][exporter];
    if let Some(err) = export["error"].as_str() {
        panic!("{model} {exporter}: the export failed in export.py: {err}");
    }
    let file = export["file"].as_str().unwrap();
    let case = format!("{file} {kind}");
    let model = load(file);
    let batches = batches(&e);
    let torch = &m[kind]["float32"];
    let want = floats(&torch["losses"]);
    let evals = floats(&torch["evalLosses"]);
    let agree = m[kind]["agreeSteps"].as_u64().unwrap() as usize;
    assert!(agree >= 1, "{case}: PyTorch's float32 and float64 runs disagree from the first step");

    let (update, lr) = update(&e, kind);
    let opts = SessionOptions::new(update);
    let mut s = Session::new(Arc::new(CpuBackend::new()), &model, &batches[0], 1, &opts)
        .unwrap_or_else(|err| panic!("{case}: {err}"));
    let mut losses = Vec::new();
    // What else was compared after the last agreeing step, with the measured difference.
    let mut checked: Vec<String> = Vec::new();
    let mut grad_norm = f64::NAN;
    for step in 0..want.len() {
        let r = s.step(std::slice::from_ref(&batches[step % batches.len()]), lr, 0.0, 0).unwrap();
        if step == 0 {
            grad_norm = first_grad_norm(&case, r.grad_norm, torch, TOLERANCE);
        }
        losses.push(r.loss);
        if step + 1 == agree {
            // PyTorch evaluates in eval mode: BatchNormalization over the running statistics.
            let eval = s.evaluate(&batches[..1]).unwrap();
            assert!(
                rel(eval, evals[step]) <= TOLERANCE,
                "{case}: evaluation after step {agree}: loss {eval} vs PyTorch's {}",
                evals[step]
            );
            checked.push(format!("evaluation loss {:.1e}", rel(eval, evals[step])));
            // The running statistics, as checkpointed. Each may differ from PyTorch's float32
            // by 1e-4, or by twice as much as PyTorch's float32 and float64 runs differ on it
            // (up to 2e-4 in mobilenet_v2's last blocks): rounding moves them as it moves
            // PyTorch's.
            if let Some(stats) = m[kind]["runningStatsAfterAgreeSteps"].as_object() {
                let state = s.state().unwrap();
                let (mut ours, mut theirs) = (0.0f64, 0.0f64);
                for (name, values) in stats {
                    let got = state.get(name).unwrap_or_else(|| panic!("{case}: no running statistic '{name}'"));
                    let d = worst_difference(got, &floats(values));
                    let torch = m[kind]["runningStatsFloat32VsFloat64"][name].as_f64().unwrap();
                    assert!(
                        d <= TOLERANCE.max(2.0 * torch),
                        "{case}: '{name}' after step {agree} differs from PyTorch's by {d:.2e} (its float32 from its \
                         float64 by {torch:.2e})"
                    );
                    (ours, theirs) = (ours.max(d), theirs.max(torch));
                }
                checked.push(format!("running statistics {ours:.1e} (PyTorch's fp32 vs fp64: {theirs:.1e})"));
            }
        }
    }
    let worst = (0..agree).map(|k| rel(losses[k], want[k])).fold(0.0, f64::max);
    let overall = (0..want.len()).map(|k| rel(losses[k], want[k])).fold(0.0, f64::max);
    println!(
        "{case}: losses agree with PyTorch's to {worst:.1e} over the {agree} step(s) where its fp32 and fp64 runs \
         agree ({overall:.1e} over all {} steps); first-step gradient norm {grad_norm:.1e}; after step {agree}: {}",
        want.len(),
        checked.join(", ")
    );
    for k in 0..agree {
        assert!(
            rel(losses[k], want[k]) <= TOLERANCE,
            "{case}: step {}: loss {} vs PyTorch's {} (losses {losses:?})",
            k + 1,
            losses[k],
            want[k]
        );
    }

    // The export: trained running statistics, BatchNormalization in inference mode.
    let weights = s.gather_weights().unwrap().expect("one process holds every weight");
    let stat = model.graph.nodes.iter().find(|n| matches!(n.op, Op::BatchNorm { .. })).and_then(|n| n.input(3));
    let stat = model.graph.name_of(stat.expect("a BatchNormalization with a running mean"));
    assert!(weights.contains_key(stat), "{case}: the exported weights lack running statistic '{stat}'");
    let exported = tensorfleet_worker::export::inference_graph(&model, &weights).unwrap();
    let v = exported.find(stat).unwrap();
    assert_eq!(exported.initializers[&v].to_f64_vec(), weights[stat].to_f64_vec());
    for n in exported.nodes.iter().filter(|n| matches!(n.op, Op::BatchNorm { .. })) {
        assert!(
            matches!(n.op, Op::BatchNorm { training: false, .. }) && n.outputs.iter().flatten().count() == 1,
            "{case}: exported {} is not in inference mode: {:?}",
            n.name,
            n.op
        );
    }
}

/// Both exporters write the running statistics as plain initializers: the rule finds each by
/// how the graph reads it, and every other initializer is a parameter.
fn running_statistics_are_found(file: &str) {
    let g = load(file).graph;
    let roles = buffers::roles(&g);
    for v in g.float_initializers() {
        let name = g.name_of(v);
        let want = if name.ends_with(".running_mean") || name.ends_with(".running_var") {
            Role::RunningStatistic
        } else {
            Role::Parameter
        };
        assert_eq!(roles[&v], want, "{file}: '{name}'");
    }
}

#[test]
fn resnet18_torchscript_sgd() {
    trains_like_pytorch("resnet18", "torchscript", "sgd");
}

#[test]
fn resnet18_torchscript_adamw() {
    trains_like_pytorch("resnet18", "torchscript", "adamw");
}

#[test]
fn resnet18_dynamo_sgd() {
    trains_like_pytorch("resnet18", "dynamo", "sgd");
}

#[test]
fn resnet18_dynamo_adamw() {
    trains_like_pytorch("resnet18", "dynamo", "adamw");
}

#[test]
fn mobilenet_v2_torchscript_sgd() {
    trains_like_pytorch("mobilenet_v2", "torchscript", "sgd");
}

#[test]
fn mobilenet_v2_torchscript_adamw() {
    trains_like_pytorch("mobilenet_v2", "torchscript", "adamw");
}

#[test]
fn mobilenet_v2_dynamo_sgd() {
    trains_like_pytorch("mobilenet_v2", "dynamo", "sgd");
}

#[test]
fn mobilenet_v2_dynamo_adamw() {
    trains_like_pytorch("mobilenet_v2", "dynamo", "adamw");
}

#[test]
fn buffers_need_no_frozen_weights() {
    for file in [
        "resnet18_torchscript.onnx",
        "resnet18_dynamo.onnx",
        "mobilenet_v2_torchscript.onnx",
        "mobilenet_v2_dynamo.onnx",
    ] {
        running_statistics_are_found(file);
    }
}

#[test]
fn frozen_weights_and_weights_to_train_still_decide() {
    let e = expected();
    let batch = batches(&e).swap_remove(0);
    let model = load("resnet18_torchscript.onnx");
    let initial = |name: &str| model.graph.initializers[&model.graph.find(name).unwrap()].to_f64_vec();
    let (update, lr) = update(&e, "sgd");
    let train = |opts: &SessionOptions| {
        let mut s = Session::new(Arc::new(CpuBackend::new()), &model, &batch, 1, opts).unwrap();
        s.step(std::slice::from_ref(&batch), lr, 0.0, 0).unwrap();
        s
    };

    // A running statistic in frozenWeights stays as exported; its neighbour still moves.
    let mut opts = SessionOptions::new(update);
    opts.frozen = vec!["bn1.running_mean".into()];
    let stats = train(&opts).running_statistics().unwrap();
    assert!(!stats.contains_key("bn1.running_mean"), "a frozen running statistic was updated");
    assert_ne!(stats["bn1.running_var"].to_f64_vec(), initial("bn1.running_var"));

    // weightsToTrain names exactly what trains; the running statistics still update.
    let mut opts = SessionOptions::new(update);
    opts.trainable = vec!["fc.weight".into()];
    let s = train(&opts);
    assert_eq!(s.weight_names(), ["fc.weight"]);
    assert_ne!(s.running_statistics().unwrap()["bn1.running_mean"].to_f64_vec(), initial("bn1.running_mean"));
}
