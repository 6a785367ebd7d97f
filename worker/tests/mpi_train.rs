//! Parallel training under a real `mpirun`, each layout against the single process it must
//! equal (per-step losses within 1e-5 relative, evaluation losses too, final weights within
//! 1e-4):
//! - data parallel: two ranks with batch B train exactly like one process with batch 2B, since
//!   each rank reads its half of every global batch and the gradients are averaged;
//! - ZeRO-1 and ZeRO-2 exactly like plain data parallelism; Adasum trains;
//! - pipeline parallel (1F1B and GPipe) exactly like no pipeline, dropout included;
//! - data × pipeline over four ranks;
//! - tensor parallel (Megatron's column/row pairs, vocab-parallel embedding and loss) exactly
//!   like no tensor parallelism, for the builtin GPT-2 (dropout on) and a GPT-2 exported from
//!   PyTorch; data × tensor and pipeline × tensor over four ranks;
//! - a checkpoint written under one layout resumes under another.

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

/// Token shards of a small repeated text in `dir/tokens/{train,val}`.
fn prepare_tokens(dir: &Path) {
    std::fs::write(dir.join("text.txt"), "The fox saw the owl and the owl saw the fox by the river. ".repeat(300))
        .unwrap();
    let o = Command::new(WORKER)
        .args(["prepare-data", "--input", "text.txt", "--output", "tokens", "--val-fraction", "0.2"])
        .current_dir(dir)
        .output()
        .unwrap();
    check(&o, "prepare-data");
}

/// A small GPT-2 run of 6 updates with accumulation, clipping, a schedule, evaluation at 3 and
/// 6 and checkpoints at 3 and 6; `extra` adds YAML lines.
fn write_config(dir: &Path, micro_batches: usize, extra: &str) {
    std::fs::write(
        dir.join("train.yaml"),
        format!(
            "model: {{gpt2: {{layers: 2, heads: 2, embed: 32, seqLen: 16, vocab: 50257}}}}\n\
             data: {{train: {{path: tokens/train, format: tokens}}, eval: {{path: tokens/val, format: tokens}}}}\n\
             gradientAccumulationSteps: {micro_batches}\nsteps: 6\ngradClipNorm: 1.0\n\
             optimizer: {{name: adamw, lr: 0.003, weightDecay: 0.1}}\nlrSchedule: {{name: cosine, warmupSteps: 2}}\n\
             evaluation: {{every: 3, batches: 2}}\ncheckpoint: {{every: 3, keep: 2}}\n{extra}"
        ),
    )
    .unwrap();
}

/// Every weight of two checkpoints agrees within 1e-4 (relative to values above 1).
fn assert_same_weights(a: &Path, b: &Path) {
    let (_, w1) = checkpoint::load(a).unwrap();
    let (_, w2) = checkpoint::load(b).unwrap();
    let weights: Vec<&String> = w1.keys().filter(|n| !n.starts_with("optimizer/")).collect();
    assert_eq!(weights, w2.keys().filter(|n| !n.starts_with("optimizer/")).collect::<Vec<_>>());
    for name in weights {
        let (x, y) = (w1[name].as_slice::<f32>(), w2[name].as_slice::<f32>());
        let worst = x.iter().zip(y).map(|(p, q)| (p - q).abs() / p.abs().max(1.0)).fold(0.0f32, f32::max);
        assert!(worst <= 1e-4, "weight '{name}' differs by {worst}");
    }
}

/// Both runs logged the same losses and evaluation losses, and ended with the same weights.
fn assert_same_run(dir: &Path, got: &str, want: &str) {
    let (train, eval) = losses(&dir.join(got));
    let (want_train, want_eval) = losses(&dir.join(want));
    assert_eq!(want_train.len(), 6);
    assert_close(&format!("{got}: loss"), &train, &want_train);
    assert_eq!(want_eval.len(), 2);
    assert_close(&format!("{got}: evalLoss"), &eval, &want_eval);
    assert_same_weights(
        &dir.join(format!("{got}/checkpoints/checkpoint_6")),
        &dir.join(format!("{want}/checkpoints/checkpoint_6")),
    );
}

#[test]
fn two_data_parallel_ranks_equal_one_process_with_twice_the_batch() {
    let dir = scratch("dp");
    prepare_tokens(&dir);
    write_config(&dir, 2, "");
    check(&train_alone(&dir, &["batchSize=4", "output.dir=single"]), "the single-process run");
    // Small buckets, and step 2 profiled: the all-reduces start while the backward pass runs.
    let o = mpirun_train(
        &dir,
        2,
        &[
            "batchSize=2",
            "parallelism.data=2",
            "parallelism.bucketMb=0.01",
            "profiling.fromStep=2",
            "profiling.toStep=2",
            "output.dir=dp2",
        ],
    );
    check(&o, "mpirun -np 2");
    assert_same_run(&dir, "dp2", "single");
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("dp2/profile.json")).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let spans = |cat: &str| -> Vec<(f64, f64)> {
        events
            .iter()
            .filter(|e| e["cat"] == cat)
            .map(|e| (e["ts"].as_f64().unwrap(), e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap()))
            .collect()
    };
    let (comm, ops) = (spans("comm"), spans("op"));
    assert!(comm.len() >= 3, "several buckets: {comm:?}");
    // When the backward pass handed each bucket over (the thread starts it once it has a core).
    let queued: Vec<f64> =
        events.iter().filter(|e| e["cat"] == "comm").map(|e| e["args"]["queuedTs"].as_f64().unwrap()).collect();
    let first = queued.iter().copied().fold(f64::MAX, f64::min);
    let ops_after = ops.iter().filter(|s| s.0 > first).count();
    assert!(ops_after > 0, "the first all-reduce ({first} µs) was handed over while backward ops still ran: {ops:?}");
    let (m1, _) = checkpoint::load(&dir.join("single/checkpoints/checkpoint_6")).unwrap();
    let (m2, _) = checkpoint::load(&dir.join("dp2/checkpoints/checkpoint_6")).unwrap();
    assert_eq!((m1.world_size, m2.world_size), (1, 2));
    assert_eq!(m1.data, m2.data, "both stand at the same global batch");

    // ZeRO-1 and ZeRO-2 train like plain data parallelism, and each rank writes its own shard
    // of the optimizer state.
    for zero in [1, 2] {
        let out = format!("zero{zero}");
        let o = mpirun_train(
            &dir,
            2,
            &["batchSize=2", "parallelism.data=2", &format!("parallelism.zero={zero}"), &format!("output.dir={out}")],
        );
        check(&o, &format!("ZeRO-{zero}"));
        assert_same_run(&dir, &out, "dp2");
        let (m, state) = checkpoint::load(&dir.join(format!("{out}/checkpoints/checkpoint_6"))).unwrap();
        assert_eq!(m.files.len(), 2, "both ranks wrote a file: {:?}", m.files.keys());
        assert_eq!(m.layout.zero, zero);
        let (_, plain) = checkpoint::load(&dir.join("dp2/checkpoints/checkpoint_6")).unwrap();
        for (name, t) in plain.iter().filter(|(n, _)| n.starts_with("optimizer/") && *n != "optimizer/step") {
            let (x, y) = (t.as_slice::<f32>(), state[name].as_slice::<f32>());
            assert_eq!(x.len(), y.len(), "{name}");
            let worst = x.iter().zip(y).map(|(p, q)| (p - q).abs() / p.abs().max(1e-3)).fold(0.0f32, f32::max);
            assert!(worst <= 1e-3, "ZeRO-{zero}: optimizer state '{name}' differs by {worst}");
        }
    }

    // Adasum instead of the mean: it trains, and differently (the two halves' gradients are
    // neither equal nor orthogonal). Its combination itself is checked exactly in mpi_comm.rs.
    let o =
        mpirun_train(&dir, 2, &["batchSize=2", "parallelism.data=2", "parallelism.adasum=true", "output.dir=adasum"]);
    check(&o, "Adasum");
    let (adasum, _) = losses(&dir.join("adasum"));
    let (dp2, _) = losses(&dir.join("dp2"));
    assert_eq!(adasum.len(), 6);
    assert!(adasum.iter().all(|l| l.1.is_finite()) && adasum[5].1 < adasum[0].1, "{adasum:?}");
    assert!((adasum[0].1 - dp2[0].1).abs() <= 1e-5 * dp2[0].1, "the first loss comes before any update");
    assert!(adasum[1..].iter().zip(&dp2[1..]).any(|(a, m)| (a.1 - m.1).abs() > 1e-6), "Adasum is not the mean");
    let o = mpirun_train(&dir, 3, &["batchSize=2", "parallelism.data=3", "parallelism.adasum=true", "output.dir=ada3"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("power of two"), "{}", String::from_utf8_lossy(&o.stderr));

    // Resharding: ZeRO-1's checkpoint at step 3, written by two ranks, continues in one process
    // (same global batch) exactly as the two ranks went on.
    let resume = "checkpoint.resume=zero1/checkpoints/checkpoint_3";
    check(&train_alone(&dir, &["batchSize=4", "output.dir=resharded", resume]), "the resharded resume");
    let (resumed, _) = losses(&dir.join("resharded"));
    let (zero1, _) = losses(&dir.join("zero1"));
    assert_eq!(resumed.iter().map(|x| x.0).collect::<Vec<_>>(), [4, 5, 6]);
    assert_close("resharded loss", &resumed, &zero1[3..]);
    assert_same_weights(&dir.join("resharded/checkpoints/checkpoint_6"), &dir.join("zero1/checkpoints/checkpoint_6"));

    // A different global batch cannot continue the run: its data position would mean other data.
    let o = train_alone(&dir, &["batchSize=2", "output.dir=wrong", resume]);
    assert_eq!(o.status.code(), Some(2), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("global batch"));
    std::fs::remove_dir_all(&dir).ok();
}

/// The exported models of two runs hold the same initializers (within 1e-4).
fn assert_same_export(dir: &Path, got: &str, want: &str) {
    let read = |out: &str| {
        let proto = tensorfleet_worker::onnx::load_model(&dir.join(out).join("model.onnx")).unwrap();
        tensorfleet_worker::graph::onnx_io::from_model(&proto, out).unwrap()
    };
    let (a, b) = (read(want), read(got));
    assert_eq!(a.initializers.len(), b.initializers.len());
    for (v, t) in &a.initializers {
        let name = a.name_of(*v);
        let u = &b.initializers[&b.find(name).unwrap_or_else(|| panic!("{got}: the export lacks '{name}'"))];
        assert_eq!(t.shape(), u.shape(), "{got}: exported '{name}'");
        if t.dtype() == tensorfleet_worker::tensor::DType::F32 {
            let worst =
                t.as_slice::<f32>().iter().zip(u.as_slice::<f32>()).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
            assert!(worst <= 1e-4, "{got}: exported '{name}' differs by {worst}");
        }
    }
}

/// Two pipeline stages, with either schedule, train like one process: the same dropout masks,
/// losses, evaluation losses, final weights and exported model.
#[test]
fn two_pipeline_stages_equal_one_process() {
    let dir = scratch("pp");
    prepare_tokens(&dir);
    // Four micro-batches: 1F1B's warm-up, steady state and drain all run. Dropout on.
    write_config(&dir, 4, "");
    let dropout = "model.gpt2.dropout=0.1";
    check(&train_alone(&dir, &["batchSize=2", "output.dir=single", dropout]), "the single-process run");
    for schedule in ["1f1b", "gpipe"] {
        let out = format!("pp2-{schedule}");
        let o = mpirun_train(
            &dir,
            2,
            &[
                "batchSize=2",
                "parallelism.pipeline=2",
                &format!("parallelism.schedule={schedule}"),
                &format!("output.dir={out}"),
                dropout,
            ],
        );
        check(&o, &format!("mpirun -np 2, pipeline {schedule}"));
        assert_same_run(&dir, &out, "single");
    }
    // The exported model joins the stages: the same initializers as the single run's export.
    assert_same_export(&dir, "pp2-1f1b", "single");
    // Explicit cuts (ONNX Runtime's cut edges) give the same run.
    let o = mpirun_train(
        &dir,
        2,
        &[
            "batchSize=2",
            "parallelism.pipeline=2",
            "parallelism.pipelineCuts=[[h.0.mlp.residual]]",
            "output.dir=cut",
            dropout,
        ],
    );
    check(&o, "mpirun -np 2, explicit cut");
    assert_same_run(&dir, "cut", "single");
    // (The balanced cut above falls just before the LM head, which has most of the FLOPs at this
    // width, leaving the last stage only the tied embedding, which the first stage writes.)
    let (m, _) = checkpoint::load(&dir.join("cut/checkpoints/checkpoint_6")).unwrap();
    assert_eq!(m.files.len(), 2, "each stage wrote its own weights: {:?}", m.files.keys());
    assert_eq!(m.layout.pipeline, 2);
    std::fs::remove_dir_all(&dir).ok();
}

/// Four ranks as two data-parallel replicas of a two-stage pipeline (with ZeRO-1) train like one
/// process with the replicas' batches together.
#[test]
fn data_times_pipeline_over_four_ranks_equals_one_process() {
    let dir = scratch("dp-pp");
    prepare_tokens(&dir);
    write_config(&dir, 2, "");
    check(&train_alone(&dir, &["batchSize=4", "output.dir=single"]), "the single-process run");
    let o = mpirun_train(
        &dir,
        4,
        &["batchSize=2", "parallelism.data=2", "parallelism.pipeline=2", "parallelism.zero=1", "output.dir=dp2pp2"],
    );
    check(&o, "mpirun -np 4, data 2 × pipeline 2");
    assert_same_run(&dir, "dp2pp2", "single");
    std::fs::remove_dir_all(&dir).ok();
}

/// Two tensor-parallel ranks train the builtin GPT-2 (dropout on, so the masks of the replicated
/// region must agree) like one process: attention split by heads, the MLP by columns then rows,
/// the embedding and the loss by vocabulary (50257 rows: an uneven split). Each rank writes its
/// slices; the checkpoint resumes in one process, and the export is the whole model.
#[test]
fn two_tensor_parallel_ranks_equal_one_process() {
    let dir = scratch("tp");
    prepare_tokens(&dir);
    write_config(&dir, 2, "");
    let dropout = "model.gpt2.dropout=0.1";
    check(&train_alone(&dir, &["batchSize=2", "output.dir=single", dropout]), "the single-process run");
    let o = mpirun_train(&dir, 2, &["batchSize=2", "parallelism.tensor=2", "output.dir=tp2", dropout]);
    check(&o, "mpirun -np 2, tensor 2");
    assert_same_run(&dir, "tp2", "single");
    assert_same_export(&dir, "tp2", "single");
    let (m, _) = checkpoint::load(&dir.join("tp2/checkpoints/checkpoint_6")).unwrap();
    assert_eq!(m.files.len(), 2, "each rank wrote its slices: {:?}", m.files.keys());
    assert_eq!(m.layout.tensor, 2);
    let split = |name: &str| m.tensor_splits.get(name).unwrap_or_else(|| panic!("'{name}' is not split"));
    assert_eq!((split("h.0.attn.c_attn.weight").axis, split("h.0.attn.c_attn.weight").blocks), (1, 3));
    assert_eq!((split("h.1.attn.c_proj.weight").axis, split("h.1.mlp.c_fc.bias").axis), (0, 0));
    assert_eq!((split("wte").axis, split("wte").shape[0]), (0, 50257));
    assert!(!m.tensor_splits.contains_key("wpe") && !m.tensor_splits.contains_key("h.0.ln_1.weight"));
    // The tensor-parallel checkpoint at step 3 continues in one process, and one process's in two
    // tensor-parallel ranks, as the runs went on.
    let resume = |from: &str| format!("checkpoint.resume={from}/checkpoints/checkpoint_3");
    check(&train_alone(&dir, &["batchSize=2", "output.dir=from-tp2", dropout, &resume("tp2")]), "resume alone");
    let o = mpirun_train(
        &dir,
        2,
        &["batchSize=2", "parallelism.tensor=2", "output.dir=to-tp2", dropout, &resume("single")],
    );
    check(&o, "resume in two tensor-parallel ranks");
    let (single, _) = losses(&dir.join("single"));
    for out in ["from-tp2", "to-tp2"] {
        let (resumed, _) = losses(&dir.join(out));
        assert_eq!(resumed.iter().map(|x| x.0).collect::<Vec<_>>(), [4, 5, 6], "{out}");
        assert_close(&format!("{out}: loss"), &resumed, &single[3..]);
        assert_same_weights(
            &dir.join(format!("{out}/checkpoints/checkpoint_6")),
            &dir.join("single/checkpoints/checkpoint_6"),
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The same pass shards a GPT-2 exported by PyTorch (nn.Linear weights behind Transposes, q/k/v
/// split by a Split, GELU as a chain of Mul/Tanh, its own SoftmaxCrossEntropyLoss), which then
/// trains like one process.
#[test]
fn tensor_parallelism_splits_a_gpt2_exported_by_pytorch() {
    let dir = scratch("tp-torch");
    // Token shards within the exported model's vocabulary of 96.
    std::fs::create_dir_all(dir.join("tokens")).unwrap();
    let tokens: Vec<u16> = (0..4096u32).map(|i| ((i * 7 + i / 13) % 96) as u16).collect();
    tensorfleet_worker::data::tokens::write_shard(&dir.join("tokens/train_000.bin"), &tokens).unwrap();
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/torch_gpt2/gpt2_tiny_with_loss.onnx");
    std::fs::write(
        dir.join("train.yaml"),
        format!(
            "model: {{onnx: {{path: {}, loss: {{output: loss}}}}}}\n\
             data: {{train: {{path: tokens, format: tokens}}}}\nbatchSize: 2\ngradientAccumulationSteps: 2\n\
             steps: 6\noptimizer: {{name: adamw, lr: 0.003}}\ngradClipNorm: 1.0\ncheckpoint: {{every: 6}}\n",
            model.display()
        ),
    )
    .unwrap();
    check(&train_alone(&dir, &["output.dir=single"]), "the single-process run");
    check(&mpirun_train(&dir, 2, &["parallelism.tensor=2", "output.dir=tp2"]), "mpirun -np 2, tensor 2");
    let ((single, _), (tp2, _)) = (losses(&dir.join("single")), losses(&dir.join("tp2")));
    assert_eq!(single.len(), 6);
    assert_close("loss", &tp2, &single);
    assert_same_weights(&dir.join("tp2/checkpoints/checkpoint_6"), &dir.join("single/checkpoints/checkpoint_6"));
    let (m, _) = checkpoint::load(&dir.join("tp2/checkpoints/checkpoint_6")).unwrap();
    let split = &m.tensor_splits["transformer.h.0.attn.c_attn.weight"];
    assert_eq!((split.axis, split.blocks), (0, 3), "nn.Linear's [out, in] weight splits its rows");
    assert!(m.tensor_splits.contains_key("transformer.wte.weight"), "{:?}", m.tensor_splits.keys());
    assert!(m.tensor_splits.contains_key("transformer.h.1.mlp.c_proj.weight"));
    std::fs::remove_dir_all(&dir).ok();
}

/// Four ranks as data × tensor (also with ZeRO-1) and as pipeline × tensor train like one process.
#[test]
fn tensor_parallelism_with_data_and_pipeline_over_four_ranks_equals_one_process() {
    let dir = scratch("tp-4");
    prepare_tokens(&dir);
    write_config(&dir, 2, "");
    check(&train_alone(&dir, &["batchSize=4", "output.dir=single"]), "the single-process run");
    for (out, sets) in [
        ("dp2tp2", vec!["batchSize=2", "parallelism.data=2", "parallelism.tensor=2"]),
        ("dp2tp2zero1", vec!["batchSize=2", "parallelism.data=2", "parallelism.tensor=2", "parallelism.zero=1"]),
        ("pp2tp2", vec!["batchSize=4", "parallelism.pipeline=2", "parallelism.tensor=2"]),
    ] {
        let mut sets = sets.clone();
        let o = format!("output.dir={out}");
        sets.push(&o);
        check(&mpirun_train(&dir, 4, &sets), &format!("mpirun -np 4, {out}"));
        assert_same_run(&dir, out, "single");
    }
    assert_same_export(&dir, "pp2tp2", "single");
    let (m, _) = checkpoint::load(&dir.join("dp2tp2zero1/checkpoints/checkpoint_6")).unwrap();
    assert_eq!(m.files.len(), 4, "every rank wrote its slice of its ZeRO shard: {:?}", m.files.keys());
    std::fs::remove_dir_all(&dir).ok();
}

/// The builtin Llama splits as Megatron splits it and trains like one process: tensor
/// parallelism splits the query and the kv heads (rotary embedding and the kv-head repeat stay
/// head-local), SwiGLU's gate and up columns then the down rows, and the vocabulary of the
/// embedding and of the untied head; two pipeline stages and data × tensor too.
#[test]
fn builtin_llama_layouts_equal_one_process() {
    let dir = scratch("llama");
    prepare_tokens(&dir);
    let llama = "model: {llama: {layers: 2, heads: 4, kvHeads: 2, embed: 32, ffn: 48, seqLen: 16, vocab: 50257}}\n";
    write_config(&dir, 2, "");
    let text = std::fs::read_to_string(dir.join("train.yaml")).unwrap();
    let text = llama.to_string() + text.split_once('\n').unwrap().1;
    std::fs::write(dir.join("train.yaml"), text).unwrap();
    check(&train_alone(&dir, &["batchSize=4", "output.dir=single"]), "the single-process run");
    for (np, out, sets) in [
        (2, "tp2", vec!["batchSize=4", "parallelism.tensor=2"]),
        (2, "pp2", vec!["batchSize=4", "parallelism.pipeline=2"]),
        (4, "dp2tp2", vec!["batchSize=2", "parallelism.data=2", "parallelism.tensor=2"]),
    ] {
        let mut sets = sets.clone();
        let o = format!("output.dir={out}");
        sets.push(&o);
        check(&mpirun_train(&dir, np, &sets), &format!("mpirun -np {np}, {out}"));
        assert_same_run(&dir, out, "single");
    }
    assert_same_export(&dir, "tp2", "single");
    let (m, _) = checkpoint::load(&dir.join("tp2/checkpoints/checkpoint_6")).unwrap();
    let split = |name: &str| {
        m.tensor_splits.get(name).unwrap_or_else(|| panic!("'{name}' is not split: {:?}", m.tensor_splits.keys()))
    };
    for column in ["q_proj", "k_proj", "v_proj"] {
        assert_eq!(split(&format!("model.layers.0.self_attn.{column}.weight")).axis, 1, "{column}");
    }
    assert_eq!(split("model.layers.1.self_attn.o_proj.weight").axis, 0);
    assert_eq!(
        (split("model.layers.0.mlp.gate_proj.weight").axis, split("model.layers.0.mlp.up_proj.weight").axis),
        (1, 1)
    );
    assert_eq!(split("model.layers.0.mlp.down_proj.weight").axis, 0);
    assert_eq!((split("model.embed_tokens.weight").axis, split("lm_head.weight").axis), (0, 1));
    assert!(!m.tensor_splits.contains_key("model.layers.0.input_layernorm.weight"));
    std::fs::remove_dir_all(&dir).ok();
}

/// The same pass splits the Hugging Face Llama of tests/torch_hf.rs (its q/k/v/o and
/// gate/up/down nn.Linear weights behind Transposes, rotate_half by Slice, the kv-heads
/// repeated by Expand, the attention mask added to the scores), trained on its onnxSamples
/// batches with the padding masked out, and two tensor-parallel ranks train it like one
/// process; so do two pipeline stages, cut where the balance of its weights says. The dynamo
/// exporter's attention folds the heads into the batch for k's transpose ([B, H, T, D] →
/// [B·H, T, D] and back), which the split follows.
#[test]
fn tensor_and_pipeline_parallelism_split_an_hf_llama_exported_by_pytorch() {
    let dir = scratch("tp-hf-llama");
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/torch_hf");
    for exporter in ["torchscript", "dynamo"] {
        std::fs::write(
            dir.join("train.yaml"),
            format!(
                "model: {{onnx: {{path: {}, loss: {{type: softmaxCrossEntropy, output: logits, ignoreIndex: -100}}}}}}\n\
                 data: {{train: {{path: {}, format: onnxSamples}}}}\nbatchSize: 4\ngradientAccumulationSteps: 2\n\
                 steps: 6\noptimizer: {{name: adamw, lr: 0.003}}\ngradClipNorm: 1.0\ncheckpoint: {{every: 6}}\n",
                data.join(format!("llama_{exporter}.onnx")).display(),
                data.join("llama.pb").display()
            ),
        )
        .unwrap();
        let (single, tp2, pp2) = (format!("single-{exporter}"), format!("tp2-{exporter}"), format!("pp2-{exporter}"));
        check(&train_alone(&dir, &[&format!("output.dir={single}")]), "the single-process run");
        let at = |out: &str| dir.join(format!("{out}/checkpoints/checkpoint_6"));
        let (want, _) = losses(&dir.join(&single));
        assert_eq!(want.len(), 6);
        for (layout, out) in [("parallelism.tensor=2", &tp2), ("parallelism.pipeline=2", &pp2)] {
            let o = mpirun_train(&dir, 2, &[layout, &format!("output.dir={out}")]);
            check(&o, &format!("mpirun -np 2, {layout}, {exporter}"));
            let (got, _) = losses(&dir.join(out));
            assert_close(&format!("{exporter}, {layout}: loss"), &got, &want);
            assert_same_weights(&at(out), &at(&single));
        }
        let (m, _) = checkpoint::load(&at(&tp2)).unwrap();
        let attention = ["q_proj", "k_proj", "v_proj", "o_proj"].map(|w| format!("self_attn.{w}"));
        let mlp = ["gate_proj", "up_proj", "down_proj"].map(|w| format!("mlp.{w}"));
        for weight in mlp.iter().chain(&attention) {
            let name = format!("model.model.layers.1.{weight}.weight");
            assert!(m.tensor_splits.contains_key(&name), "{exporter}: '{name}': {:?}", m.tensor_splits.keys());
        }
        assert!(m.tensor_splits.contains_key("model.lm_head.weight"), "{exporter}");
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

/// Mixed precision under every kind of parallelism: bf16 and fp16 runs over four ranks follow
/// their one-process runs within half precision's rounding (a split product rounds its partial
/// sums, one process the whole sum), and fp16's loss scaler decides on every rank alike: a
/// scale that overflows skips the step everywhere (ZeRO's shards and the pipeline's stages
/// included) and the run goes on.
#[test]
fn mixed_precision_under_data_tensor_and_pipeline_parallelism_follows_one_process() {
    let dir = scratch("mixed");
    prepare_tokens(&dir);
    write_config(&dir, 2, "dynamicLossScale: {initial: 16384}\n");
    let scales = |out: &str| -> Vec<(f64, bool)> {
        let text = std::fs::read_to_string(dir.join(out).join("metrics.jsonl")).unwrap();
        text.lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|v| v["loss"].is_f64())
            .map(|v| (v["lossScale"].as_f64().unwrap_or(0.0), v["skipped"].as_bool().unwrap_or(false)))
            .collect()
    };
    let layouts = [
        ("dp2tp2zero1", vec!["batchSize=2", "parallelism.data=2", "parallelism.tensor=2", "parallelism.zero=1"]),
        ("pp2tp2", vec!["batchSize=4", "parallelism.pipeline=2", "parallelism.tensor=2"]),
    ];
    for (precision, rtol) in [("bf16", 1e-3), ("fp16", 2e-4)] {
        let p = format!("precision={precision}");
        let single = format!("single-{precision}");
        let o = format!("output.dir={single}");
        check(&train_alone(&dir, &["batchSize=4", &p, &o]), &format!("the single-process {precision} run"));
        for (layout, sets) in &layouts {
            let out = format!("{layout}-{precision}");
            let o = format!("output.dir={out}");
            let mut sets = sets.clone();
            sets.extend([p.as_str(), o.as_str()]);
            check(&mpirun_train(&dir, 4, &sets), &format!("mpirun -np 4, {out}"));
            // fp16 at 2^14: no overflow on any layout, so the same (scaled, unscaled) steps.
            assert_eq!(scales(&out), scales(&single), "{out}: loss scales and skipped steps");
            let ((train, eval), (want, want_eval)) = (losses(&dir.join(&out)), losses(&dir.join(&single)));
            assert_eq!(train.len(), 6);
            let mut worst = 0f64;
            for (got, want) in train.iter().chain(&eval).zip(want.iter().chain(&want_eval)) {
                assert!((got.1 - want.1).abs() <= rtol * want.1, "{out}, step {}: {} vs {}", got.0, got.1, want.1);
                worst = worst.max((got.1 - want.1).abs() / want.1);
            }
            println!("{out}: losses within {worst:.1e} of one process'");
        }
    }
    // 2^20 overflows fp16 on every layout for the first steps. (Where exactly a layout stops
    // overflowing differs: its partial sums differ.)
    for (layout, sets) in &layouts {
        let out = format!("{layout}-overflow");
        let o = format!("output.dir={out}");
        let mut sets = sets.clone();
        sets.extend(["precision=fp16", "dynamicLossScale={initial: 1048576}", o.as_str()]);
        check(&mpirun_train(&dir, 4, &sets), &format!("mpirun -np 4, {out}"));
        let s = scales(&out);
        println!("{out}: {s:?}");
        assert_eq!(s[..3], [(1048576.0, true), (524288.0, true), (262144.0, true)], "{out}");
        assert!(s.iter().any(|x| !x.1), "{out}: no step applied: {s:?}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A rank whose run fails while another waits for it in a collective ends the job at once, with
/// its error and exit code: rank 0 cannot make the checkpoint directory at step 3 while rank 1
/// waits at the checkpoint's barrier. (Before, rank 0 waited in MPI's finalize and rank 1 at
/// the barrier until parallelism.timeoutSeconds, 600 s here.)
#[test]
fn a_rank_that_fails_ends_the_job_at_once() {
    let dir = scratch("fail");
    prepare_tokens(&dir);
    write_config(&dir, 1, "");
    std::fs::write(dir.join("blocker"), "a file where the checkpoint directory's parent should be").unwrap();
    let started = std::time::Instant::now();
    let sets = ["batchSize=2", "parallelism.data=2", "parallelism.timeoutSeconds=600", "checkpoint.dir=blocker/ckpt"];
    let o = mpirun_train(&dir, 2, &sets);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "the run must fail:\n{err}");
    assert!(err.contains("error: rank 0:") && err.contains("blocker"), "rank 0's error, naming the path:\n{err}");
    let waited = started.elapsed();
    assert!(waited < std::time::Duration::from_secs(300), "the job ended after {waited:?}, at the collective timeout");
    std::fs::remove_dir_all(&dir).ok();
}
