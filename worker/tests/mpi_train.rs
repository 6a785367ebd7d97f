//! Data-parallel training under a real `mpirun`: two ranks with batch B train exactly like one
//! process with batch 2B (per-step losses within 1e-5 relative, evaluation losses too, final
//! weights within 1e-4), because each rank reads its half of every global batch and the
//! gradients are averaged before the update.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use tensorfleet_worker::checkpoint;

const WORKER: &str = env!("CARGO_BIN_EXE_tensorfleet-worker");

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tf-mpi-train-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn check(o: &Output, what: &str) {
    assert!(
        o.status.success(),
        "{what} failed ({}):\n{}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// `tensorfleet-worker train` under mpirun with `np` ranks, as the launcher pod runs it.
fn mpirun_train(dir: &Path, np: usize, sets: &[&str]) -> Output {
    let mut cmd = common::mpirun(np);
    cmd.arg(WORKER).args(["train", "--config", "train.yaml", "--quiet"]);
    for s in sets {
        cmd.args(["--set", s]);
    }
    cmd.current_dir(dir).stdin(Stdio::null()).output().unwrap()
}

fn train_alone(dir: &Path, sets: &[&str]) -> Output {
    let mut cmd = Command::new(WORKER);
    cmd.args(["train", "--config", "train.yaml", "--quiet"]);
    for s in sets {
        cmd.args(["--set", s]);
    }
    cmd.current_dir(dir).output().unwrap()
}

/// (step, value) pairs of one metric.
type Series = Vec<(u64, f64)>;

/// The (step, loss) and (step, evalLoss) lines of a run's metrics.jsonl.
fn losses(out: &Path) -> (Series, Series) {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let mut train = Vec::new();
    let mut eval = Vec::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let step = v["step"].as_u64().unwrap();
        if let Some(l) = v["loss"].as_f64() {
            train.push((step, l));
        }
        if let Some(l) = v["evalLoss"].as_f64() {
            eval.push((step, l));
        }
    }
    (train, eval)
}

fn assert_close(what: &str, a: &[(u64, f64)], b: &[(u64, f64)]) {
    assert_eq!(a.iter().map(|x| x.0).collect::<Vec<_>>(), b.iter().map(|x| x.0).collect::<Vec<_>>(), "{what}");
    for (x, y) in a.iter().zip(b) {
        assert!((x.1 - y.1).abs() <= 1e-5 * y.1.abs(), "{what} at step {}: {} vs {}", x.0, x.1, y.1);
    }
}

#[test]
fn two_data_parallel_ranks_equal_one_process_with_twice_the_batch() {
    let dir = scratch("dp");
    std::fs::write(dir.join("text.txt"), "The fox saw the owl and the owl saw the fox by the river. ".repeat(300))
        .unwrap();
    let o = Command::new(WORKER)
        .args(["prepare-data", "--input", "text.txt", "--output", "tokens", "--val-fraction", "0.2"])
        .current_dir(&dir)
        .output()
        .unwrap();
    check(&o, "prepare-data");
    std::fs::write(
        dir.join("train.yaml"),
        "model: {gpt2: {layers: 2, heads: 2, embed: 32, seqLen: 16, vocab: 50257}}\n\
         data: {train: {path: tokens/train, format: tokens}, eval: {path: tokens/val, format: tokens}}\n\
         gradientAccumulationSteps: 2\nsteps: 6\ngradClipNorm: 1.0\n\
         optimizer: {name: adamw, lr: 0.003, weightDecay: 0.1}\nlrSchedule: {name: cosine, warmupSteps: 2}\n\
         evaluation: {every: 3, batches: 2}\ncheckpoint: {every: 6}\n",
    )
    .unwrap();
    check(&train_alone(&dir, &["batchSize=4", "output.dir=single"]), "the single-process run");
    let o = mpirun_train(&dir, 2, &["batchSize=2", "parallelism.data=2", "output.dir=dp2"]);
    check(&o, "mpirun -np 2");

    let (single, single_eval) = losses(&dir.join("single"));
    let (dp, dp_eval) = losses(&dir.join("dp2"));
    assert_eq!(single.len(), 6);
    assert_close("loss", &dp, &single);
    assert_eq!(single_eval.len(), 2);
    assert_close("evalLoss", &dp_eval, &single_eval);

    let (m1, w1) = checkpoint::load(&dir.join("single/checkpoints/checkpoint_6")).unwrap();
    let (m2, w2) = checkpoint::load(&dir.join("dp2/checkpoints/checkpoint_6")).unwrap();
    assert_eq!((m1.world_size, m2.world_size), (1, 2));
    assert_eq!(m1.data, m2.data, "both stand at the same global batch");
    for (name, a) in w1.iter().filter(|(n, _)| !n.starts_with("optimizer/")) {
        let (a, b) = (a.as_slice::<f32>(), w2[name].as_slice::<f32>());
        let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs() / x.abs().max(1.0)).fold(0.0f32, f32::max);
        assert!(worst <= 1e-4, "weight '{name}' differs by {worst}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A layout that does not cover the world is refused before training, naming the keys.
#[test]
fn a_layout_that_does_not_match_the_world_exits_2() {
    let dir = scratch("layout");
    std::fs::write(
        dir.join("train.yaml"),
        "model: {mlp: {inputs: 4, hidden: [8], classes: 3}}\ndata: {train: {path: none, format: onnxSamples}}\n\
         batchSize: 2\nsteps: 1\nparallelism: {data: 3}\n",
    )
    .unwrap();
    let o = mpirun_train(&dir, 2, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "a data size of 3 on 2 ranks must fail");
    assert!(err.contains("parallelism.data (3)") && err.contains("2 rank(s)"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
