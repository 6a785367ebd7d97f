//! Training equals an independent implementation: the same ONNX model, initial weights, batches
//! and optimizer settings give per-step losses within 1e-4 (relative) of the numpy reference
//! in tests/oracle/reference_train.py (float64, hand-written backward) over 50 steps.
//!
//! Needs `TENSORFLEET_PYTHON` (a Python with numpy and onnx; `make test` sets it to the
//! project's venv); without it the test says it is skipped.

use std::path::{Path, PathBuf};
use std::process::Command;
use tensorfleet_worker::config::{Gpt2Config, MlpConfig, TrainingConfig};
use tensorfleet_worker::data::{samples, tokens};
use tensorfleet_worker::graph::onnx_io::to_model;
use tensorfleet_worker::models::{gpt2, mlp};
use tensorfleet_worker::rng::Rng;
use tensorfleet_worker::tensor::Tensor;

fn python() -> Option<String> {
    std::env::var("TENSORFLEET_PYTHON").ok().filter(|p| !p.is_empty())
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tf-oracle-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs our trainer and the reference on the same JSON config; returns both loss series.
fn both(dir: &Path, config: serde_json::Value, extra_args: &[&str]) -> (Vec<f64>, Vec<f64>) {
    let cfg_path = dir.join("config.json");
    std::fs::write(&cfg_path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
    let cfg = TrainingConfig::load(&cfg_path, &[]).unwrap();
    tensorfleet_worker::runner::train(&cfg, tensorfleet_worker::monitor::console::ConsoleMode::Quiet).unwrap();
    let ours: Vec<f64> = std::fs::read_to_string(dir.join("out/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|v| v.get("loss").and_then(|x| x.as_f64()))
        .collect();

    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/oracle/reference_train.py");
    let out = dir.join("reference.json");
    let status = Command::new(python().unwrap())
        .arg(&script)
        .arg("--config")
        .arg(&cfg_path)
        .arg("--output")
        .arg(&out)
        .args(["--weights", "none", "--quiet"])
        .args(extra_args)
        .status()
        .unwrap();
    assert!(status.success(), "the reference implementation failed");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let reference: Vec<f64> = serde_json::from_value(v["losses"].clone()).unwrap();
    (ours, reference)
}

fn assert_same(what: &str, ours: &[f64], reference: &[f64]) {
    assert_eq!(ours.len(), reference.len(), "{what}: step counts differ");
    for (k, (a, b)) in ours.iter().zip(reference).enumerate() {
        let rel = (a - b).abs() / b.abs().max(1e-12);
        assert!(rel <= 1e-4, "{what}: step {}: loss {a} vs reference {b} (relative difference {rel:.2e})", k + 1);
    }
    // The run must actually learn, or equal losses would prove little.
    assert!(
        ours[ours.len() - 1] < ours[0] * 0.9,
        "{what}: the loss did not fall: {} -> {}",
        ours[0],
        ours[ours.len() - 1]
    );
    eprintln!("{what}: {} steps equal the reference (loss {:.4} -> {:.4})", ours.len(), ours[0], ours[ours.len() - 1]);
}

#[test]
fn gpt2_adamw_matches_the_reference() {
    if python().is_none() {
        eprintln!("skipped: TENSORFLEET_PYTHON is not set");
        return;
    }
    let dir = scratch("gpt2");
    let c = Gpt2Config { layers: 2, heads: 2, embed: 32, seq_len: 16, vocab: 64, ..Default::default() };
    let g = gpt2::build(&c, 7).unwrap();
    tensorfleet_worker::onnx::save_model(&to_model(&g, "test"), &dir.join("init.onnx")).unwrap();
    // Tokens with structure to learn: a repeating ramp with random noise.
    let mut rng = Rng::new(3);
    let toks: Vec<u16> =
        (0..4000).map(|i| if rng.next_f64() < 0.2 { rng.below(64) as u16 } else { ((i * 7) % 64) as u16 }).collect();
    std::fs::create_dir_all(dir.join("train")).unwrap();
    tokens::write_shard(&dir.join("train/shard_0.bin"), &toks).unwrap();
    let config = serde_json::json!({
        "model": {"onnx": {"path": "init.onnx", "loss": {"type": "softmaxCrossEntropy", "output": "logits", "label": "labels", "ignoreIndex": -100}}},
        "data": {"train": {"path": "train", "format": "tokens"}, "shuffle": false},
        "batchSize": 4, "gradientAccumulationSteps": 1, "steps": 50,
        "optimizer": {"name": "adamw", "lr": 3.0e-3, "beta1": 0.9, "beta2": 0.95, "epsilon": 1.0e-8, "weightDecay": 0.1},
        "lrSchedule": {"name": "constant"},
        "gradClipNorm": 1.0,
        "output": {"dir": "out"}
    });
    let (ours, reference) = both(&dir, config, &["--heads", "2"]);
    assert_same("GPT-2 AdamW", &ours, &reference);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn mlp_sgd_nesterov_accumulation_cosine_matches_the_reference() {
    if python().is_none() {
        eprintln!("skipped: TENSORFLEET_PYTHON is not set");
        return;
    }
    let dir = scratch("mlp");
    let c = MlpConfig { inputs: 6, hidden: vec![16, 16], classes: 3 };
    let g = mlp::build(&c, 11).unwrap();
    tensorfleet_worker::onnx::save_model(&to_model(&g, "test"), &dir.join("init.onnx")).unwrap();
    // Three Gaussian blobs, one per class, as ONNX Runtime sample shards.
    let mut rng = Rng::new(5);
    let sample = |rng: &mut Rng| {
        let class = rng.below(3);
        let x: Vec<f32> =
            (0..6).map(|j| (rng.normal() * 0.7 + if j % 3 == class { 1.5 } else { 0.0 }) as f32).collect();
        vec![
            ("x".to_string(), Tensor::from_vec(&[6], x)),
            ("labels".to_string(), Tensor::from_vec(&[], vec![class as i64])),
        ]
    };
    std::fs::create_dir_all(dir.join("train")).unwrap();
    for shard in 0..2 {
        let s: Vec<_> = (0..120).map(|_| sample(&mut rng)).collect();
        samples::write_shard(&dir.join(format!("train/part_{shard}.pb")), &s).unwrap();
    }
    let config = serde_json::json!({
        "model": {"onnx": {"path": "init.onnx", "loss": {"type": "softmaxCrossEntropy", "output": "logits", "label": "labels"}}},
        "data": {"train": {"path": "train", "format": "onnxSamples"}, "shuffle": false},
        "batchSize": 8, "gradientAccumulationSteps": 2, "steps": 50,
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": true, "weightDecay": 1.0e-3},
        "lrSchedule": {"name": "cosine", "warmupSteps": 5, "minLr": 0.005},
        "gradClipNorm": 0.0,
        "output": {"dir": "out"}
    });
    let (ours, reference) = both(&dir, config, &[]);
    assert_same("MLP SGD Nesterov", &ours, &reference);
    std::fs::remove_dir_all(&dir).ok();
}
