//! One full training step (forward, loss, backward, AdamW update) through the public API, next
//! to PyTorch on the CPU running the same configurations in the same run.
//!
//!     TENSORFLEET_BENCH_PYTHON=.venv-bench/bin/python cargo bench -p tensorfleet-worker --bench train_step
//!
//! (`make bench` sets the variable.) After criterion's figures it runs benches/pytorch_peer.py
//! with that interpreter, prints both side by side with the ratio, and writes them to the
//! `train_step` section of target/bench-summary.json. Without the variable the peer is skipped.

mod common;

use common::{round, run_peer, Samples, PYTHON_VAR};
use criterion::{Criterion, SamplingMode, Throughput};
use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;
use tensorfleet_worker::backend::cpu::CpuBackend;
use tensorfleet_worker::config::{Gpt2Config, ModelSpec, SqueezeNetConfig};
use tensorfleet_worker::models;
use tensorfleet_worker::optim::Update;
use tensorfleet_worker::rng::Rng;
use tensorfleet_worker::session::{Session, SessionOptions};
use tensorfleet_worker::tensor::Tensor;

const SAMPLE_SIZE: usize = 10;
/// The peer's optimizer (pytorch_peer.py): torch.optim.AdamW(lr 1e-4, betas (0.9, 0.95),
/// weight_decay 0.1, eps 1e-8), no gradient clipping.
const LR: f64 = 1e-4;
const CLIP: f64 = 0.0;
const ADAMW: Update = Update::Adam { beta1: 0.9, beta2: 0.95, epsilon: 1e-8, weight_decay: 0.1, decoupled: true };

/// A benchmarked configuration; `name` is also the key prefix of the peer's JSON.
struct Bench {
    name: &'static str,
    /// What a step processes, for throughput: tokens or images.
    unit: &'static str,
    per_step: usize,
    measurement: Duration,
    spec: ModelSpec,
    batch: fn() -> BTreeMap<String, Tensor>,
    /// For the summary.
    config: serde_json::Value,
}

const GPT2: Gpt2Config = Gpt2Config {
    layers: 2,
    heads: 4,
    embed: 128,
    seq_len: 128,
    vocab: 50257,
    dropout: 0.0,
    make_vocab_size_divisible_by: 1,
};
const GPT2_BATCH: usize = 8;
const SQUEEZENET: SqueezeNetConfig = SqueezeNetConfig { classes: 10, image_size: 64 };
const SQUEEZENET_BATCH: usize = 8;

fn ids(rng: &mut Rng, shape: &[usize], below: usize) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(shape, (0..n).map(|_| rng.below(below) as i64).collect::<Vec<i64>>())
}

/// input_ids, labels: i64 [8, 128] of random tokens.
fn gpt2_batch() -> BTreeMap<String, Tensor> {
    let mut rng = Rng::new(1);
    let shape = [GPT2_BATCH, GPT2.seq_len];
    [("input_ids", ids(&mut rng, &shape, GPT2.vocab)), ("labels", ids(&mut rng, &shape, GPT2.vocab))]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

/// image: f32 [8, 3, 64, 64] of N(0, 1); labels: i64 [8].
fn squeezenet_batch() -> BTreeMap<String, Tensor> {
    let mut rng = Rng::new(2);
    let s = SQUEEZENET.image_size;
    let shape = [SQUEEZENET_BATCH, 3, s, s];
    let image = Tensor::from_vec(&shape, (0..shape.iter().product()).map(|_| rng.normal() as f32).collect());
    let labels = ids(&mut rng, &[SQUEEZENET_BATCH], SQUEEZENET.classes);
    [("image".to_string(), image), ("labels".to_string(), labels)].into_iter().collect()
}

fn benches() -> Vec<Bench> {
    vec![
        Bench {
            name: "gpt2",
            unit: "tokens",
            per_step: GPT2_BATCH * GPT2.seq_len,
            measurement: Duration::from_secs(10),
            spec: ModelSpec { gpt2: Some(GPT2), ..Default::default() },
            batch: gpt2_batch,
            config: serde_json::json!({
                "layers": GPT2.layers, "embed": GPT2.embed, "heads": GPT2.heads, "seq": GPT2.seq_len,
                "batch": GPT2_BATCH, "vocab": GPT2.vocab,
            }),
        },
        Bench {
            name: "squeezenet",
            unit: "images",
            per_step: SQUEEZENET_BATCH,
            measurement: Duration::from_secs(4),
            spec: ModelSpec { squeezenet: Some(SQUEEZENET), ..Default::default() },
            batch: squeezenet_batch,
            config: serde_json::json!({
                "classes": SQUEEZENET.classes, "image": SQUEEZENET.image_size, "batch": SQUEEZENET_BATCH,
            }),
        },
    ]
}

/// The model built as `make demo` builds it, differentiated and planned for `batch`.
fn session(b: &Bench, batch: &BTreeMap<String, Tensor>) -> Session<CpuBackend> {
    let model = models::load(&b.spec, 0).unwrap_or_else(|e| panic!("{}: building the model: {e}", b.name));
    let opts = SessionOptions::new(ADAMW);
    Session::new(Arc::new(CpuBackend::new()), &model, batch, 1, &opts)
        .unwrap_or_else(|e| panic!("{}: planning the training step: {e}", b.name))
}

/// One run of the PyTorch peer on the configurations in `names`, with OpenMP's wait policy set
/// to `policy` (`None`: as the environment has it); the peer's JSON, or why there is none.
fn pytorch_run(python: &OsStr, names: &[&str], policy: Option<&str>) -> Result<serde_json::Value, String> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/pytorch_peer.py");
    let mut cmd = Command::new(python);
    cmd.arg(script).args(["--steps", "10", "--warmup", "3"]);
    if let [only] = names {
        cmd.args(["--only", only]);
    }
    if let Some(p) = policy {
        cmd.env("OMP_WAIT_POLICY", p);
    }
    let label = policy_label(policy);
    println!("PyTorch peer: {} {script} (OMP_WAIT_POLICY {label})", python.to_string_lossy());
    let mut v = run_peer(cmd, script)?;
    v["omp_wait_policy"] = label.into();
    Ok(v)
}

fn policy_label(policy: Option<&str>) -> String {
    match policy {
        Some(p) => p.to_string(),
        None => std::env::var("OMP_WAIT_POLICY").unwrap_or_else(|_| "unset".to_string()),
    }
}

/// The PyTorch peer's runs. torch's OpenMP threads spin while they wait, which is fastest on an
/// idle machine and many times slower when another process wants a core; so unless the caller
/// chose OMP_WAIT_POLICY, the peer runs with it unset and with PASSIVE, and each configuration
/// is compared with the faster of the two: PyTorch at its best on this machine.
fn pytorch_peer(names: &[&str]) -> Result<Vec<serde_json::Value>, String> {
    let python = std::env::var_os(PYTHON_VAR).ok_or(format!("{PYTHON_VAR} not set"))?;
    let policies: &[Option<&str>] =
        if std::env::var_os("OMP_WAIT_POLICY").is_some() { &[None] } else { &[None, Some("PASSIVE")] };
    println!();
    policies.iter().map(|&p| pytorch_run(&python, names, p)).collect()
}

/// The fastest of the peer's runs for `name`: (step ms, the run).
fn best_run<'a>(runs: &'a [serde_json::Value], name: &str) -> Option<(f64, &'a serde_json::Value)> {
    runs.iter().filter_map(|r| Some((r[format!("{name}_step_ms")].as_f64()?, r))).min_by(|a, b| a.0.total_cmp(&b.0))
}

fn main() {
    let measuring = common::measuring();
    let load_before = common::load_avg_1m();
    let mut c = Criterion::default().configure_from_args();
    let mut group = c.benchmark_group("train_step");
    group.sample_size(SAMPLE_SIZE).sampling_mode(SamplingMode::Flat).warm_up_time(Duration::from_secs(1));

    // (bench, median seconds per step) of the ones that ran.
    let mut ran = Vec::new();
    for b in benches() {
        group.measurement_time(b.measurement).throughput(Throughput::Elements(b.per_step as u64));
        let batch = (b.batch)();
        // Built on first call only, so a filtered-out benchmark costs nothing.
        let mut sess: Option<Session<CpuBackend>> = None;
        let mut samples = Samples::default();
        let mut seed = 0u64;
        group.bench_function(b.name, |bch| {
            let s = sess.get_or_insert_with(|| session(&b, &batch));
            samples.iter(bch, || {
                seed += 1;
                let r = s.step(std::slice::from_ref(&batch), LR, CLIP, seed).expect("training step");
                assert!(r.loss.is_finite(), "{}: loss {} at step {seed}", b.name, r.loss);
            })
        });
        drop(sess);
        if let Some(secs) = samples.median_s(SAMPLE_SIZE) {
            ran.push((b, secs));
        }
    }
    group.finish();
    c.final_summary();
    if ran.is_empty() || !measuring {
        return;
    }

    let names: Vec<&str> = ran.iter().map(|(b, _)| b.name).collect();
    let peer = pytorch_peer(&names);
    let runs: &[serde_json::Value] = match &peer {
        Ok(runs) => {
            for r in runs {
                let each: Vec<String> = names
                    .iter()
                    .filter_map(|n| Some(format!("{n} {:.1} ms", r[format!("{n}_step_ms")].as_f64()?)))
                    .collect();
                println!("  OMP_WAIT_POLICY {}: {}", r["omp_wait_policy"].as_str().unwrap_or("?"), each.join(", "));
            }
            runs
        }
        Err(why) => {
            println!("PyTorch peer: skipped ({why})");
            &[]
        }
    };
    println!("\nTraining step, median of {SAMPLE_SIZE} (load average {:.2} before):", load_before.unwrap_or(f64::NAN));
    let mut results = Vec::new();
    for (b, secs) in &ran {
        let ms = secs * 1e3;
        let per_s = b.per_step as f64 / secs;
        let mut line = format!("{} train step: tensorfleet {ms:.1} ms ({per_s:.0} {}/s)", b.name, b.unit);
        let mut r = serde_json::json!({
            "model": b.name, "config": b.config, "unit": b.unit,
            "tensorfleet_ms": round(ms, 2), "tensorfleet_per_s": round(per_s, 1),
        });
        if let Some((peer_ms, run)) = best_run(runs, b.name) {
            let speedup = peer_ms / ms;
            let verdict =
                if speedup >= 1.0 { format!("{speedup:.2}x faster") } else { format!("{:.2}x slower", 1.0 / speedup) };
            let torch = run["torch_version"].as_str().unwrap_or("?");
            line += &format!(", PyTorch {torch} CPU {peer_ms:.1} ms ({verdict})");
            r["pytorch_ms"] = round(peer_ms, 2).into();
            r["pytorch_per_s"] = round(b.per_step as f64 / peer_ms * 1e3, 1).into();
            r["pytorch_omp_wait_policy"] = run["omp_wait_policy"].clone();
            r["speedup"] = round(speedup, 3).into();
        }
        println!("{line}");
        results.push(r);
    }
    let pytorch = match &peer {
        Ok(runs) => serde_json::json!({ "runs": runs }),
        Err(why) => serde_json::json!({ "skipped": why }),
    };
    common::write_summary(
        "train_step",
        serde_json::json!({
            "date": common::today(),
            "command": "make bench",
            "load_avg_1m_before": load_before,
            "load_avg_1m_after": common::load_avg_1m(),
            "threads": rayon::current_num_threads(),
            "samples": SAMPLE_SIZE,
            "optimizer": "AdamW lr 1e-4 betas (0.9, 0.95) eps 1e-8 weight_decay 0.1, no clipping",
            "pytorch": pytorch,
            "results": results,
        }),
    );
}
