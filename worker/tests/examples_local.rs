//! The local demos (examples/local, docs/EXAMPLES.md) keep working: each configuration, copied
//! unchanged next to a tiny copy of its data made by the same scripts and commands as `make
//! demo`, `make demo-squeezenet` and `make demo-onnx`, trains for a few steps, evaluates and,
//! but for SqueezeNet (slow to start), learns.
//! The copies keep the configurations' relative paths, so a configuration that no longer
//! matches the layout its data scripts write fails here.
//!
//! The SqueezeNet and imported-ONNX demos draw their data with Python (numpy and onnx): they
//! need `TENSORFLEET_PYTHON` (`make test` sets it to the project's venv and runs them), and are
//! ignored in a plain `cargo test`.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use tensorfleet_worker::config::TrainingConfig;

/// The steps each demo runs here: enough for the evaluation loss to fall.
const STEPS: u64 = 6;

fn examples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/local")
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tf-examples-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(d.join("data")).unwrap();
    d
}

fn check(what: &str, o: Output) {
    assert!(
        o.status.success(),
        "{what} failed ({}):\n{}{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

fn worker(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tensorfleet-worker")).args(args).current_dir(dir).output().unwrap()
}

/// Runs one of examples/local/data's scripts with its default image size and class count (the
/// ones the configurations are written for), as the Makefile does.
fn script(name: &str, args: &[&str], dir: &Path) {
    let python = common::venv_python();
    let o = Command::new(&python).arg(examples().join("data").join(name)).args(args).current_dir(dir).output().unwrap();
    check(name, o);
}

/// Whether a demo's `STEPS` updates here must lower its evaluation loss.
#[derive(PartialEq)]
enum Learns {
    /// Within them.
    Quickly,
    /// Not this early: SqueezeNet predicts the uniform distribution (ln 8) for its first tens
    /// of updates on a handful of images; builtin_models.rs' `squeezenet_fits_a_batch` shows
    /// it learning.
    Later,
}

/// Copies the example configuration `name` into `dir`, trains it for `STEPS` updates from the
/// start, and checks that every update logged a finite loss, that the evaluation ran after each,
/// and, for a demo that `Learns::Quickly`, that it learned: the last evaluation's loss (on the
/// same held-out batch) is below the first's.
fn train(name: &str, dir: &Path, extra: &[&str], learns: Learns) {
    std::fs::copy(examples().join(name), dir.join(name)).unwrap();
    let steps = format!("steps={STEPS}");
    let mut args = vec!["train", "--config", name, "--quiet", "--set", &steps];
    // Warmup longer than the run is a configuration error; evaluate after every update and
    // log every one; start from scratch as `make demo*` does.
    for set in ["lrSchedule.warmupSteps=0", "evaluation.every=1", "evaluation.batches=1", "logging.every=1"] {
        args.extend(["--set", set]);
    }
    args.extend(["--set", "checkpoint.resume=never"]);
    for set in extra {
        args.extend(["--set", set]);
    }
    check(&format!("train {name}"), worker(&args, dir));

    // The configuration's own output.dir, resolved against its directory as the worker does.
    let out = TrainingConfig::load(&dir.join(name), &[]).unwrap().output.dir;
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let losses: Vec<(u64, f64)> = lines
        .iter()
        .filter_map(|v| Some((v["step"].as_u64()?, v.get("loss")?.as_f64()?)))
        .filter(|(_, loss)| loss.is_finite() && *loss > 0.0)
        .collect();
    assert_eq!(losses.iter().map(|(s, _)| *s).collect::<Vec<_>>(), (1..=STEPS).collect::<Vec<_>>(), "{metrics}");
    let evals: Vec<f64> = lines.iter().filter_map(|v| v.get("evalLoss")?.as_f64()).filter(|e| e.is_finite()).collect();
    assert_eq!(evals.len() as u64, STEPS, "one evaluation per update: {metrics}");
    if learns == Learns::Quickly {
        assert!(evals[evals.len() - 1] < evals[0], "{name} did not learn: evaluation losses {evals:?}");
    }
    assert!(out.join("model.onnx").exists(), "{name}: no model.onnx exported");
    eprintln!("{name}: {losses:?}, evaluated {evals:?}");
}

/// The GPT-2 quickstart on token shards of the committed corpus, made by prepare-data.
#[test]
fn quickstart_gpt2_trains() {
    let dir = scratch("gpt2");
    let corpus = examples().join("data/corpus.txt");
    let o = worker(
        &["prepare-data", "--input", corpus.to_str().unwrap(), "--output", "data/tokens", "--val-fraction", "0.1"],
        &dir,
    );
    check("prepare-data", o);
    train("quickstart.yaml", &dir, &["batchSize=2"], Learns::Quickly);
    std::fs::remove_dir_all(&dir).ok();
}

/// The builtin Llama on the same token shards.
#[test]
fn llama_trains() {
    let dir = scratch("llama");
    let corpus = examples().join("data/corpus.txt");
    let o = worker(
        &["prepare-data", "--input", corpus.to_str().unwrap(), "--output", "data/tokens", "--val-fraction", "0.1"],
        &dir,
    );
    check("prepare-data", o);
    train("llama.yaml", &dir, &["batchSize=2"], Learns::Quickly);
    std::fs::remove_dir_all(&dir).ok();
}

/// A scratch directory with a tiny shapes set in data/shapes, drawn as `make demo-shapes` draws
/// the full one (with `TENSORFLEET_PYTHON`'s interpreter).
fn with_shapes(name: &str) -> PathBuf {
    let dir = scratch(name);
    // Several shards per split, so the directory of shards is read, not just one file.
    script("make_shapes.py", &["--output", "data/shapes", "--train", "16", "--val", "8", "--shard-size", "6"], &dir);
    dir
}

/// Builtin SqueezeNet on the drawn shapes set (sample shards).
#[test]
#[ignore = "needs TENSORFLEET_PYTHON: make test sets it"]
fn squeezenet_on_shapes_trains() {
    let dir = with_shapes("squeezenet");
    train("squeezenet.yaml", &dir, &["batchSize=4"], Learns::Later);
    std::fs::remove_dir_all(&dir).ok();
}

/// The imported CNN (onnx.helper, no loss) with the loss the configuration attaches.
#[test]
#[ignore = "needs TENSORFLEET_PYTHON: make test sets it"]
fn imported_onnx_on_shapes_trains() {
    let dir = with_shapes("onnx");
    script("make_cnn.py", &["--output", "data/cnn.onnx"], &dir);
    train("custom-onnx.yaml", &dir, &["batchSize=4"], Learns::Quickly);
    std::fs::remove_dir_all(&dir).ok();
}

/// Every TrainingJob in examples/ carries a training block the worker accepts, with a layout
/// that covers the job's MPI world (workers × slotsPerWorker), as the operator will check.
#[test]
fn cluster_examples_are_valid_worker_configurations() {
    let dir = examples().join("..");
    let mut checked = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let job: serde_yaml::Value = serde::Deserialize::deserialize(doc).unwrap();
            if job["kind"].as_str() != Some("TrainingJob") {
                continue;
            }
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            let training = serde_yaml::to_string(&job["spec"]["training"]).unwrap();
            let cfg = TrainingConfig::parse(&training, &name, &[]).unwrap_or_else(|e| panic!("{name}: {e}"));
            let spec = &job["spec"];
            let slots = spec["slotsPerWorker"]
                .as_u64()
                .or_else(|| spec["resources"]["limits"]["nvidia.com/gpu"].as_u64().or(Some(1)));
            let world = spec["workers"].as_u64().unwrap() * slots.unwrap();
            let p = &cfg.parallelism;
            assert_eq!((p.data * p.tensor * p.pipeline) as u64, world, "{name}: the layout vs the world");
            checked.push(name);
        }
    }
    assert!(checked.iter().any(|n| n == "llama-tp.yaml") && checked.len() >= 5, "{checked:?}");
}
