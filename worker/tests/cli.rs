//! The command-line contract: exit codes and messages that name what is wrong.
//! 0 done; 2 bad configuration or input, or a model with operators the engine does not run;
//! 3 unreadable or corrupt data, model or checkpoint; 4 the training diverged.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn worker(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tensorfleet-worker")).args(args).current_dir(dir).output().unwrap()
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tf-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A tiny GPT-2 config over a token shard made by prepare-data.
fn setup(dir: &Path) {
    std::fs::write(dir.join("text.txt"), "The fox saw the owl. The owl saw the fox. ".repeat(200)).unwrap();
    let o = worker(&["prepare-data", "--input", "text.txt", "--output", "tokens", "--val-fraction", "0.2"], dir);
    assert!(o.status.success(), "prepare-data: {}", stderr(&o));
    std::fs::write(
        dir.join("train.yaml"),
        "model: {gpt2: {layers: 1, heads: 2, embed: 16, seqLen: 16, vocab: 50257}}\n\
         data: {train: {path: tokens/train, format: tokens}, eval: {path: tokens/val, format: tokens}}\n\
         batchSize: 2\nsteps: 4\nevaluation: {every: 2, batches: 1}\ncheckpoint: {every: 2, keep: 1}\n\
         output: {dir: out}\n",
    )
    .unwrap();
}

#[test]
fn trains_exports_and_inspects() {
    let dir = scratch("ok");
    setup(&dir);
    let o = worker(&["train", "--config", "train.yaml", "--quiet"], &dir);
    assert!(o.status.success(), "train failed: {}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("out/metrics.jsonl") && out.contains("out/model.onnx") && out.contains("checkpoints"),
        "{out}"
    );
    let metrics = std::fs::read_to_string(dir.join("out/metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let steps: Vec<u64> =
        lines.iter().filter(|v| v.get("loss").is_some()).map(|v| v["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, vec![1, 2, 3, 4]);
    assert!(lines.iter().all(|v| v.get("lr").is_some() || v.get("evalLoss").is_some()));
    assert_eq!(lines.iter().filter(|v| v.get("evalLoss").is_some()).count(), 2);
    assert!(dir.join("out/checkpoints/checkpoint_4/manifest.json").exists());
    let events: Vec<_> = std::fs::read_dir(dir.join("out/tensorboard")).unwrap().filter_map(|e| e.ok()).collect();
    assert_eq!(events.len(), 1);
    let ev = tensorfleet_worker::monitor::tensorboard::read_events(&events[0].path()).unwrap();
    // The file version record, 4 logged steps and 2 evaluations.
    assert_eq!(ev.len(), 7, "{ev:?}");
    assert!(!dir.join("out/checkpoints/checkpoint_2").exists(), "keep: 1 prunes older checkpoints");

    let o = worker(&["export", "--checkpoint", "out/checkpoints/checkpoint_4", "--output", "again.onnx"], &dir);
    assert!(o.status.success(), "export failed: {}", stderr(&o));
    let o = worker(&["inspect", "again.onnx", "--dim", "batch=2"], &dir);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && text.contains("planned peak memory"), "{text}{}", stderr(&o));
    let o = worker(&["inspect", "tokens/train/train_000000.bin"], &dir);
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("tokens"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_configuration_exits_2_and_names_the_key() {
    let dir = scratch("bad");
    setup(&dir);
    for (args, needle) in [
        (vec!["--set", "optimizer.lrr=0.1"], "lrr"),
        (vec!["--set", "batchSize=0"], "batchSize"),
        (vec!["--set", "optimizer.lr=-1"], "optimizer.lr"),
        (vec!["--set", "model.gpt2.heads=3"], "model.gpt2.embed"),
        (vec!["--set", "precision=fp64"], "precision"),
        (vec!["--set", "parallelism.data=2"], "parallelism"),
        (vec!["--set", "data.train.path=missing/dir"], "missing/dir"),
    ] {
        let mut a = vec!["train", "--config", "train.yaml"];
        a.extend(args.iter().copied());
        let o = worker(&a, &dir);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(needle), "{args:?}: the message should name '{needle}': {}", stderr(&o));
    }
    let o = worker(&["train", "--config", "nope.yaml"], &dir);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("nope.yaml"), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).ok();
}

/// A loss that stops being finite ends the run with exit 4 (diverged: the operator does not
/// retry it, as a restart from the checkpoint on the same data would diverge again), naming the
/// step and what to change.
#[test]
fn a_diverging_run_exits_4_naming_the_step() {
    let dir = scratch("diverge");
    setup(&dir);
    let o =
        worker(&["train", "--config", "train.yaml", "--set", "optimizer.lr=1e30", "--set", "checkpoint.every=0"], &dir);
    assert_eq!(o.status.code(), Some(4), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("diverged") && err.contains("step ") && err.contains("optimizer.lr"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// TENSORFLEET_DISABLED_PASSES leaves fusion passes out (the same losses: each pass is exact on
/// this model); a name that is no pass exits 2 naming the variable and the passes.
#[test]
fn disabled_fusion_passes_train_the_same_and_unknown_ones_exit_2() {
    let dir = scratch("passes");
    setup(&dir);
    let losses = |passes: &str, out: &str| {
        let o = Command::new(env!("CARGO_BIN_EXE_tensorfleet-worker"))
            .args(["train", "--config", "train.yaml", "--quiet", "--set", &format!("output.dir={out}")])
            .env("TENSORFLEET_DISABLED_PASSES", passes)
            .current_dir(&dir)
            .output()
            .unwrap();
        assert!(o.status.success(), "{passes}: {}", stderr(&o));
        let metrics = std::fs::read_to_string(dir.join(out).join("metrics.jsonl")).unwrap();
        let v: Vec<serde_json::Value> = metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        v.iter().filter_map(|v| v["loss"].as_f64()).collect::<Vec<_>>()
    };
    assert_eq!(losses("", "all"), losses("loss_lse, matmul_bias", "some"));
    let o = Command::new(env!("CARGO_BIN_EXE_tensorfleet-worker"))
        .args(["train", "--config", "train.yaml"])
        .env("TENSORFLEET_DISABLED_PASSES", "loss_lse,no_such_pass")
        .current_dir(&dir)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("TENSORFLEET_DISABLED_PASSES") && err.contains("no_such_pass") && err.contains("loss_lse"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn corrupt_inputs_exit_3_and_name_the_file() {
    let dir = scratch("corrupt");
    setup(&dir);
    // Token ids past the model's vocabulary (GPT-2's tokenizer wrote them), caught as the shard
    // is read, with where.
    let o = worker(&["train", "--config", "train.yaml", "--set", "model.gpt2.vocab=100"], &dir);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("train_000000.bin") && stderr(&o).contains("vocabulary of 100"), "{}", stderr(&o));
    // A truncated token shard.
    let shard = dir.join("tokens/train/train_000000.bin");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() - 5]).unwrap();
    let o = worker(&["train", "--config", "train.yaml"], &dir);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("train_000000.bin"), "{}", stderr(&o));
    // A model file that is not ONNX.
    std::fs::write(dir.join("bad.onnx"), b"this is not a protobuf").unwrap();
    std::fs::write(
        dir.join("onnx.yaml"),
        "model: {onnx: {path: bad.onnx, loss: {type: softmaxCrossEntropy, output: logits}}}\n\
         data: {train: {path: tokens/val, format: tokens}}\nbatchSize: 1\nsteps: 1\n",
    )
    .unwrap();
    let o = worker(&["train", "--config", "onnx.yaml"], &dir);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("bad.onnx"), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).ok();
}

/// A model the engine refuses is valid input, not corrupt: `inspect` and `train` exit 2 with one
/// message that names every operator it does not run, with its node count and first node.
#[test]
fn unsupported_operators_exit_2_and_are_listed_at_once() {
    use tensorfleet_worker::onnx::proto::{
        tensor_shape_proto, type_proto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorShapeProto,
        TypeProto, ValueInfoProto,
    };
    let dir = scratch("unsupported");
    setup(&dir);
    let node = |op: &str, domain: &str, name: &str, input: &str, output: &str| NodeProto {
        op_type: Some(op.into()),
        domain: Some(domain.into()),
        name: Some(name.into()),
        input: vec![input.into()],
        output: vec![output.into()],
        ..Default::default()
    };
    let dim = |n: i64| tensor_shape_proto::Dimension {
        value: Some(tensor_shape_proto::dimension::Value::DimValue(n)),
        ..Default::default()
    };
    let x = ValueInfoProto {
        name: Some("x".into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(1),
                shape: Some(TensorShapeProto { dim: vec![dim(1), dim(4)] }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    };
    let model = ModelProto {
        ir_version: Some(9),
        opset_import: vec![
            OperatorSetIdProto { domain: Some(String::new()), version: Some(20) },
            OperatorSetIdProto { domain: Some("com.example".into()), version: Some(1) },
        ],
        graph: Some(GraphProto {
            name: Some("unsupported".into()),
            node: vec![
                node("Foo", "", "/block/Foo", "x", "a"),
                node("Relu", "", "relu", "a", "b"),
                node("Foo", "ai.onnx", "/block/Foo_1", "b", "c"),
                node("Bar", "com.example", "bar", "c", "logits"),
            ],
            input: vec![x],
            output: vec![ValueInfoProto { name: Some("logits".into()), ..Default::default() }],
            ..Default::default()
        }),
        ..Default::default()
    };
    tensorfleet_worker::onnx::save_model(&model, &dir.join("unsupported.onnx")).unwrap();
    std::fs::write(
        dir.join("onnx.yaml"),
        "model: {onnx: {path: unsupported.onnx, loss: {type: softmaxCrossEntropy, output: logits}}}\n\
         data: {train: {path: tokens/val, format: tokens}}\nbatchSize: 1\nsteps: 1\n",
    )
    .unwrap();
    let listed = "unsupported.onnx: 2 operators are not supported: \
                  Bar of domain 'com.example' (1 node, first 'bar'), Foo (2 nodes, first '/block/Foo'); supported: ";
    for args in [&["inspect", "unsupported.onnx"][..], &["train", "--config", "onnx.yaml"]] {
        let o = worker(args, &dir);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(listed), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains("Relu"), "{args:?}: the message lists what is supported: {}", stderr(&o));
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `profiling: {fromStep, toStep}` writes a Chrome trace with a span per profiled step and the
/// ops of the training graph inside it; `logging.port` serves the progress while training.
#[test]
fn profiles_a_step_range_as_a_chrome_trace_and_serves_progress() {
    let dir = scratch("profile");
    setup(&dir);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let port_set = format!("logging.port={port}");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tensorfleet-worker"))
        .args(["train", "--config", "train.yaml", "--quiet", "--set", "profiling={fromStep: 2, toStep: 3}"])
        .args(["--set", &port_set, "--set", "steps=40", "--set", "logging.peakTflops=0.5"])
        .current_dir(&dir)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Read /progress while the run goes on.
    let mut progress = None;
    for _ in 0..600 {
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            use std::io::{Read, Write};
            // Connection: close, or read_to_string waits for the end of the kept-alive connection
            // (the worker's exit), and a first answer at step 0 leaves nothing to poll.
            s.write_all(b"GET /progress HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
            let mut text = String::new();
            let _ = s.read_to_string(&mut text);
            if let Some(body) = text.split("\r\n\r\n").nth(1) {
                let v: serde_json::Value = serde_json::from_str(body).unwrap();
                if v["step"].as_u64().unwrap_or(0) > 0 {
                    progress = Some(v);
                    break;
                }
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let status = child.wait().unwrap();
    assert!(status.success());
    let progress = progress.expect("the progress endpoint answered during training");
    assert_eq!(progress["totalSteps"], 40);
    assert!(progress["loss"].as_f64().is_some() && progress["etaSeconds"].as_f64().is_some(), "{progress}");
    // MFU: the graph's model FLOPs per second over the configured peak.
    let (flops, mfu) = (progress["flopsPerSecond"].as_f64().unwrap(), progress["mfu"].as_f64().unwrap());
    assert!(flops > 0.0 && (mfu - flops / 0.5e12).abs() <= 1e-12 * flops, "{progress}");

    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("out/profile.json")).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let spans: Vec<&serde_json::Value> = events.iter().filter(|e| e["cat"] == "step").collect();
    assert_eq!(spans.iter().map(|e| e["args"]["step"].as_u64().unwrap()).collect::<Vec<_>>(), [2, 3]);
    for span in spans {
        let (start, end) = (span["ts"].as_f64().unwrap(), span["ts"].as_f64().unwrap() + span["dur"].as_f64().unwrap());
        let step = &span["args"]["step"];
        let ops: Vec<&serde_json::Value> =
            events.iter().filter(|e| e["cat"] == "op" && e["args"]["step"] == *step).collect();
        assert!(ops.len() > 20, "step {step}: {} ops", ops.len());
        let gemm = |e: &&serde_json::Value| ["MatMul", "Gemm", "FusedMatMul"].iter().any(|n| e["name"] == *n);
        assert!(ops.iter().any(gemm), "no GEMM among the ops");
        assert!(ops.iter().any(|e| e["name"] == "Attention"), "no fused attention among the ops");
        // The MLP's GELU and its gradient run in the products' epilogues.
        for gone in ["Gelu", "UnaryGrad"] {
            assert!(!ops.iter().any(|e| e["name"] == gone), "a {gone} left unfused");
        }
        assert!(ops.iter().any(|e| e["name"] == "MatMulUnaryGrad"), "no GELU gradient fused into a product");
        for op in ops {
            let ts = op["ts"].as_f64().unwrap();
            assert!(ts >= start && ts + op["dur"].as_f64().unwrap() <= end + 1.0, "op outside its step: {op}");
        }
    }
}

/// TensorBoard's own reader sees the scalars, the weight histograms and norms, and the graph
/// scalars the configuration asks for; JSON logs carry one object per step; the model with its
/// loss and the training graph are written as ONNX; evaluation runs at its own batch size.
#[test]
#[ignore = "needs TENSORFLEET_PYTHON: make test sets it"]
fn tensorboard_reads_what_the_run_logged() {
    let python = common::venv_python();
    let dir = scratch("tb");
    setup(&dir);
    let o = worker(
        &[
            "train",
            "--config",
            "train.yaml",
            "--log-format",
            "json",
            "--set",
            "logging={histograms: [wte], norms: ['*'], scalars: [loss]}",
            "--set",
            "evaluation.batchSize=1",
            "--set",
            "output.modelWithLoss=with_loss.onnx",
            "--set",
            "output.trainingGraph=graphs/training.onnx",
        ],
        &dir,
    );
    assert!(o.status.success(), "train failed: {}", stderr(&o));
    let logs: Vec<serde_json::Value> =
        stderr(&o).lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect();
    let steps: Vec<u64> = logs
        .iter()
        .filter(|l| l["fields"]["message"] == "step")
        .map(|l| l["fields"]["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3, 4]);

    let metrics = std::fs::read_to_string(dir.join("out/metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let losses: Vec<f64> = lines.iter().filter_map(|v| v["loss"].as_f64()).collect();
    for v in lines.iter().filter(|v| v.get("loss").is_some()) {
        assert_eq!(v["scalars"]["loss"], v["loss"], "the graph's loss value is the step's loss");
    }
    assert_eq!(lines.iter().filter(|v| v.get("evalLoss").is_some()).count(), 2);

    let o = Command::new(&python)
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/oracle/read_tensorboard.py"))
        .arg(dir.join("out/tensorboard"))
        .output()
        .unwrap();
    assert!(o.status.success(), "TensorBoard's reader failed: {}", stderr(&o));
    let tb: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let series = |kind: &str, tag: &str| -> Vec<Vec<f64>> {
        let rows = tb[kind][tag].as_array().unwrap_or_else(|| panic!("no {kind} '{tag}' in {tb}"));
        rows.iter().map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()).collect()
    };
    let tb_losses: Vec<f64> = series("scalars", "train/loss").iter().map(|r| r[1]).collect();
    assert_eq!(tb_losses, losses.iter().map(|&l| l as f32 as f64).collect::<Vec<_>>());
    assert_eq!(series("scalars", "scalars/loss").len(), 4);
    assert_eq!(series("scalars", "eval/loss").len(), 2);
    // wte is [vocab, embed]: every element is counted, at every logged step.
    let hist = series("histograms", "weights/wte");
    assert_eq!(hist.iter().map(|r| r[0]).collect::<Vec<_>>(), [1.0, 2.0, 3.0, 4.0]);
    for r in &hist {
        let (num, min, max, sum_squares) = (r[1], r[2], r[3], r[5]);
        assert_eq!(num, (50257 * 16) as f64);
        assert!(min < 0.0 && max > 0.0 && r[6] > 1.0, "{r:?}");
        // The norm logged for the same step is the histogram's sqrt(Σx²).
        let norm = series("scalars", "norms/weights/wte").iter().find(|n| n[0] == r[0]).unwrap()[1];
        assert!((norm - sum_squares.sqrt()).abs() <= 1e-5 * norm, "{norm} vs {}", sum_squares.sqrt());
    }
    assert_eq!(series("histograms", "gradients/wte").len(), 4);
    assert!(tb["histograms"].get("weights/wpe").is_none(), "only the named weights get histograms");
    assert_eq!(series("scalars", "norms/gradients/wpe").len(), 4, "'*' norms every weight");

    // The model with its loss is valid ONNX; the training graph holds the gradient ops.
    let check = "import onnx, sys\n\
                 m = onnx.load(sys.argv[1]); onnx.checker.check_model(m, full_check=True)\n\
                 t = onnx.load(sys.argv[2])\n\
                 assert any(o.name == 'loss' for o in m.graph.output), 'loss is an output'\n\
                 assert any(n.domain == 'dev.tensorfleet' for n in t.graph.node), 'gradient ops'\n\
                 assert len(t.graph.node) > len(m.graph.node)\n";
    let o = Command::new(&python)
        .args(["-c", check])
        .arg(dir.join("with_loss.onnx"))
        .arg(dir.join("graphs/training.onnx"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).ok();
}

/// On a terminal the run shows a progress bar (here a pseudo-terminal from util-linux's
/// `script`); without one, plain log lines and no bar (the other tests run without one).
#[test]
fn a_terminal_gets_a_progress_bar() {
    let dir = scratch("bar");
    setup(&dir);
    let command =
        format!("{} train --config train.yaml --set checkpoint.every=0", env!("CARGO_BIN_EXE_tensorfleet-worker"));
    let o = Command::new("script").args(["-q", "-e", "-c", &command, "/dev/null"]).current_dir(&dir).output().unwrap();
    let screen = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{screen}");
    assert!(screen.contains("4/4") && screen.contains("loss ") && screen.contains("tok/s"), "{screen}");
    assert!(!screen.contains(" step="), "no per-step log lines under the bar: {screen}");
    let plain = worker(&["train", "--config", "train.yaml", "--set", "checkpoint.resume=never"], &dir);
    let log = stderr(&plain);
    assert!(log.contains("step") && log.contains("loss=") && !log.contains("4/4"), "{log}");
    std::fs::remove_dir_all(&dir).ok();
}

/// fp16 through the command line: every metrics line carries the loss scale and the steps
/// skipped so far, an overflowing step is marked `skipped`, and a resumed run continues with
/// the checkpoint's scale and count rather than the configured start.
#[test]
fn fp16_logs_its_loss_scale_and_skipped_steps_and_resumes_them() {
    let dir = scratch("fp16");
    setup(&dir);
    let fp16 = ["--set", "precision=fp16", "--set", "dynamicLossScale={initial: 2097152}", "--quiet"];
    let read = |dir: &Path| -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(dir.join("out/metrics.jsonl")).unwrap();
        text.lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|v| v["lr"].is_f64())
            .collect()
    };
    let o = worker(&[&["train", "--config", "train.yaml"][..], &fp16, &["--set", "steps=6"]].concat(), &dir);
    assert!(o.status.success(), "{}", stderr(&o));
    let first = read(&dir);
    assert_eq!(first.len(), 6);
    // 2^21 overflows fp16 at once here; each overflow halves the scale and skips the update.
    assert_eq!(first[0]["lossScale"], 2097152.0);
    assert_eq!(first[0]["skipped"], true);
    let mut skipped = 0;
    for pair in first.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        skipped += a["skipped"].as_bool().unwrap_or(false) as u64;
        assert_eq!(a["skippedSteps"], skipped, "{a}");
        let halved = a["lossScale"].as_f64().unwrap() / 2.0;
        let want = if a["skipped"] == true { halved } else { a["lossScale"].as_f64().unwrap() };
        assert_eq!(b["lossScale"].as_f64().unwrap(), want, "{a} then {b}");
    }
    assert!(first.iter().any(|v| v.get("skipped").is_none()), "some step applies: {first:?}");
    let last = &first[5];
    let after = last["lossScale"].as_f64().unwrap() / if last["skipped"] == true { 2.0 } else { 1.0 };
    let total = last["skippedSteps"].as_u64().unwrap();

    // Resume from checkpoint_6 and run two more steps.
    let o = worker(&[&["train", "--config", "train.yaml"][..], &fp16, &["--set", "steps=8"]].concat(), &dir);
    assert!(o.status.success(), "{}", stderr(&o));
    let resumed: Vec<serde_json::Value> = read(&dir).into_iter().filter(|v| v["step"].as_u64() > Some(6)).collect();
    assert_eq!(resumed[0]["lossScale"].as_f64().unwrap(), after, "{resumed:?}");
    assert!(resumed[0]["skippedSteps"].as_u64().unwrap() >= total, "{resumed:?}");
    std::fs::remove_dir_all(&dir).ok();
}
