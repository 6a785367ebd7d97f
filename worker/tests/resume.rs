//! Resuming reproduces the uninterrupted run: a training process killed mid-way and started
//! again continues from its newest complete checkpoint (skipping a damaged newer one), and its
//! per-step losses are bit-identical to a run that never stopped.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tf-resume-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn worker() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tensorfleet-worker"))
}

/// Shuffled tokens, dropout and gradient clipping: everything that could break determinism.
fn setup(dir: &Path) {
    let text: String = (0..400).map(|i| format!("Line {i}: the {} fox jumps over {} dogs. ", i % 7, i % 11)).collect();
    std::fs::write(dir.join("text.txt"), text).unwrap();
    let o = worker()
        .args(["prepare-data", "--input", "text.txt", "--output", "tokens", "--val-fraction", "0"])
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::write(
        dir.join("train.yaml"),
        "model: {gpt2: {layers: 2, heads: 2, embed: 64, seqLen: 32, vocab: 50257, dropout: 0.1}}\n\
         data: {train: {path: tokens/train, format: tokens}, shuffle: true}\n\
         batchSize: 4\nsteps: 40\ngradClipNorm: 1.0\n\
         optimizer: {name: adamw, lr: 1.0e-3, weightDecay: 0.1}\n\
         lrSchedule: {name: cosine, warmupSteps: 5, minLr: 1.0e-4}\n\
         checkpoint: {every: 5, keep: 3}\noutput: {dir: out}\n",
    )
    .unwrap();
}

fn losses(dir: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(dir.join("out/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v.get("loss").is_some())
        .map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()))
        .collect()
}

#[test]
fn a_killed_run_resumes_bit_identically() {
    let whole = scratch("whole");
    setup(&whole);
    let o = worker().args(["train", "--config", "train.yaml", "--quiet"]).current_dir(&whole).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let reference = losses(&whole);
    assert_eq!(reference.len(), 40);

    let cut = scratch("cut");
    setup(&cut);
    let mut child = worker().args(["train", "--config", "train.yaml", "--quiet"]).current_dir(&cut).spawn().unwrap();
    let started = Instant::now();
    while !cut.join("out/checkpoints/checkpoint_15").exists() {
        assert!(started.elapsed() < Duration::from_secs(120), "no checkpoint_15 after two minutes");
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let done_before_kill = losses(&cut).len();
    assert!(done_before_kill < 40, "the run finished before it could be killed");

    // A newer checkpoint that is damaged must be skipped, not loaded.
    let ckpts = cut.join("out/checkpoints");
    let newest = std::fs::read_dir(&ckpts)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok()?.strip_prefix("checkpoint_")?.parse::<u64>().ok())
        .max()
        .unwrap();
    let fake = ckpts.join(format!("checkpoint_{}", newest + 1));
    std::fs::create_dir_all(&fake).unwrap();
    std::fs::copy(ckpts.join(format!("checkpoint_{newest}/manifest.json")), fake.join("manifest.json")).unwrap();
    std::fs::write(fake.join("rank_0.safetensors"), b"torn write").unwrap();

    let o = worker().args(["train", "--config", "train.yaml", "--quiet"]).current_dir(&cut).output().unwrap();
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{log}");
    assert!(log.contains("skipping a damaged checkpoint"), "{log}");
    assert!(log.contains(&format!("checkpoint_{newest}")), "resumed from the newest good checkpoint: {log}");
    let resumed = losses(&cut);
    assert_eq!(resumed.len(), 40);
    for ((s, a), (_, b)) in resumed.iter().zip(&reference) {
        assert_eq!(a.to_bits(), b.to_bits(), "step {s}: {a} after resuming, {b} uninterrupted");
    }
    eprintln!(
        "killed after {done_before_kill} logged steps, resumed from checkpoint_{newest}: 40 losses bit-identical"
    );
    std::fs::remove_dir_all(&whole).ok();
    std::fs::remove_dir_all(&cut).ok();
}
