//! Inputs that made the worker panic (exit 101) before (issue 22), each made again here from a
//! committed model or shard with the one fault a fuzzer found: the worker must answer with the
//! documented exit code (2 bad input, 3 corrupt) and a message naming the node or file, or, where
//! the input is valid ONNX, train it as the unmodified model trains. And the files a run meets:
//! FIFOs as inputs or outputs, a second trainer on one output directory, a torn metrics line,
//! damaged checkpoints whose checksums match.

mod common;

use common::{scratch, stderr};
use prost::Message;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use tensorfleet_worker::checkpoint::keys::OPTIMIZER_PREFIX;
use tensorfleet_worker::data::samples::write_shard;
use tensorfleet_worker::data::tokens::write_shard as write_token_shard;
use tensorfleet_worker::onnx::proto::{ModelProto, NodeProto};
use tensorfleet_worker::tensor::Tensor;

fn worker(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tensorfleet-worker")).args(args).current_dir(dir).output().unwrap()
}

fn hf(file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/torch_hf").join(file)
}

fn cnn(file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/torch_cnn").join(file)
}

/// A config training the CNN `model` one step on the torchvision batches.
fn cnn_config(dir: &Path, model: &Path) -> PathBuf {
    let path = dir.join("cnn.yaml");
    std::fs::write(
        &path,
        format!(
            "model: {{onnx: {{path: {}, loss: {{type: softmaxCrossEntropy, output: logits}}}}}}\n\
             data: {{train: {{path: {}, format: onnxSamples}}}}\nbatchSize: 2\nsteps: 1\n",
            model.display(),
            cnn("batches.pb").display()
        ),
    )
    .unwrap();
    path
}

/// The committed model `file` with `fault` applied to its graph's nodes, written to `dir/name`.
fn faulty(file: &Path, dir: &Path, name: &str, fault: impl FnOnce(&mut Vec<NodeProto>)) -> PathBuf {
    let mut model = ModelProto::decode(std::fs::read(file).unwrap().as_slice()).unwrap();
    fault(&mut model.graph.as_mut().unwrap().node);
    let path = dir.join(name);
    std::fs::write(&path, model.encode_to_vec()).unwrap();
    path
}

/// A config training `model` on the HF GPT-2's batches for `steps` steps.
fn config(dir: &Path, model: &Path, steps: u32, out: &str) -> PathBuf {
    let path = dir.join(format!("{out}.yaml"));
    std::fs::write(
        &path,
        format!(
            "model: {{onnx: {{path: {}, loss: {{type: softmaxCrossEntropy, output: logits, ignoreIndex: -100}}}}}}\n\
             data: {{train: {{path: {}, format: onnxSamples}}}}\nbatchSize: 4\nsteps: {steps}\noutput: {{dir: {out}}}\n",
            model.display(),
            hf("gpt2.pb").display()
        ),
    )
    .unwrap();
    path
}

fn losses(dir: &Path) -> Vec<f64> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["loss"].as_f64())
        .collect()
}

/// The exit code and message of a refused input: not a panic, the documented code, the name.
fn assert_refused(what: &str, o: &Output, code: i32, names: &str) {
    let err = stderr(o);
    assert!(!err.contains("panicked"), "{what}: {err}");
    assert_eq!(o.status.code(), Some(code), "{what}: {err}");
    assert!(err.contains(names), "{what}: the message names {names:?}: {err}");
}

/// ONNX Runtime takes Transpose's perm counted from the end too; the bound op now holds it from
/// the front, where constant folding's kernel and the gradient rule indexed with it as given.
#[test]
fn a_transpose_perm_counted_from_the_end_trains_as_the_model_does() {
    let dir = scratch("bad-input-perm");
    let negative = faulty(&hf("gpt2_torchscript.onnx"), &dir, "negative.onnx", |nodes| {
        let mut changed = 0;
        for n in nodes.iter_mut().filter(|n| n.op_type() == "Transpose") {
            for a in n.attribute.iter_mut().filter(|a| a.name() == "perm") {
                let rank = a.ints.len() as i64;
                a.ints.iter_mut().for_each(|p| *p -= rank);
                changed += 1;
            }
        }
        assert!(changed > 0, "the model has Transposes with a perm");
    });
    for (model, out) in [(hf("gpt2_torchscript.onnx"), "plain"), (negative, "negative")] {
        let o = worker(&["train", "--quiet", "--config", config(&dir, &model, 3, out).to_str().unwrap()], &dir);
        assert!(o.status.success(), "{out}: {}", stderr(&o));
    }
    assert_eq!(losses(&dir.join("negative")), losses(&dir.join("plain")));
    std::fs::remove_dir_all(&dir).ok();
}

/// Nodes stripped of their inputs, or of the rank their axis needs: exit 3 naming the node.
#[test]
fn a_node_without_the_inputs_it_reads_is_named() {
    let dir = scratch("bad-input-inputs");
    let shape = faulty(&hf("gpt2_dynamo.onnx"), &dir, "shape.onnx", |nodes| {
        let n = nodes.iter_mut().find(|n| n.op_type() == "Shape").expect("a Shape node");
        n.input.clear();
    });
    let o = worker(&["train", "--quiet", "--config", config(&dir, &shape, 1, "shape").to_str().unwrap()], &dir);
    assert_refused("Shape without input", &o, 3, "(Shape)");
    std::fs::remove_dir_all(&dir).ok();
}

/// A convolution padded by 2^62 asked for an output no allocation holds; its sizes wrapped and
/// the kernel indexed past them: exit 3 naming the node, before anything is allocated.
#[test]
fn a_window_too_large_to_address_is_named() {
    let dir = scratch("bad-input-pads");
    let padded = faulty(&cnn("resnet18_torchscript.onnx"), &dir, "padded.onnx", |nodes| {
        let conv = nodes.iter_mut().find(|n| n.op_type() == "Conv").expect("a Conv");
        let pads = conv.attribute.iter_mut().find(|a| a.name() == "pads").expect("pads");
        pads.ints[1] = 1 << 62;
    });
    let o = worker(&["train", "--quiet", "--config", cnn_config(&dir, &padded).to_str().unwrap()], &dir);
    assert_refused("pads of 2^62", &o, 3, "(Conv): its output");
    assert!(stderr(&o).contains("too large to address"), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).ok();
}

/// A shape constant of 2^40 expanded at bind aborted the process when folding allocated 8 TB:
/// exit 2 naming the node and the bytes it needs and the machine has. (One of 2^31, which a
/// 24 GiB machine could almost hold, had the process killed when memory ran out: the fuzz
/// target `training_cnn` replays it.)
#[test]
fn a_constant_larger_than_the_machine_is_refused_before_folding() {
    let dir = scratch("bad-input-expand");
    let huge = faulty(&cnn("mobilenet_v2_dynamo.onnx"), &dir, "huge.onnx", |nodes| {
        let shapes: Vec<String> =
            nodes.iter().filter(|n| n.op_type() == "Expand").filter_map(|n| n.input.get(1).cloned()).collect();
        let constant = nodes
            .iter_mut()
            .find(|n| n.op_type() == "Constant" && n.output.iter().any(|o| shapes.contains(o)))
            .expect("an Expand of a Constant shape");
        let ints = constant.attribute.iter_mut().find(|a| a.name() == "value_ints").expect("value_ints");
        ints.ints = vec![1 << 40];
    });
    let o = worker(&["train", "--quiet", "--config", cnn_config(&dir, &huge).to_str().unwrap()], &dir);
    assert_refused("Expand to 2^40", &o, 2, "(Expand): folding its constant output int64[1099511627776]");
    assert!(stderr(&o).contains("needs 8796093022208 bytes; a quarter of this machine's memory is"), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).ok();
}

/// An LSTM over a sequence dimension of 2^31 unrolled for minutes (the fuzzer's inspect timed
/// out); past 65,536 steps the layer is refused at once, naming it.
#[test]
fn a_recurrent_layer_too_long_to_unroll_is_refused_at_once() {
    let dir = scratch("bad-input-lstm");
    let long = dir.join("long.onnx");
    let mut model = ModelProto::decode(std::fs::read(hf("lstm_torchscript.onnx")).unwrap().as_slice()).unwrap();
    let input = &mut model.graph.as_mut().unwrap().input[0];
    let tensor_type = match input.r#type.as_mut().and_then(|t| t.value.as_mut()) {
        Some(tensorfleet_worker::onnx::proto::type_proto::Value::TensorType(t)) => t,
        other => panic!("a tensor input: {other:?}"),
    };
    let time = &mut tensor_type.shape.as_mut().unwrap().dim[1];
    time.value = Some(tensorfleet_worker::onnx::proto::tensor_shape_proto::dimension::Value::DimValue(1 << 31));
    std::fs::write(&long, model.encode_to_vec()).unwrap();
    let o = worker_within(&["inspect", long.to_str().unwrap()], &dir, 60);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("(LSTM): a sequence of 2147483648 steps"), "{out}{}", stderr(&o));
    std::fs::remove_dir_all(&dir).ok();
}

/// Samples whose tensors differ in element type cannot be stacked into a batch: exit 3 naming
/// the shard and the sample (it panicked stacking them).
#[test]
fn samples_that_differ_in_element_type_name_the_shard() {
    let dir = scratch("bad-input-samples");
    std::fs::create_dir_all(dir.join("data")).unwrap();
    let sample = |labels: Tensor| {
        vec![("input_ids".to_string(), Tensor::from_vec(&[8], vec![1i64; 8])), ("labels".to_string(), labels)]
    };
    write_shard(&dir.join("data/a.pb"), &[sample(Tensor::from_vec(&[8], vec![2i64; 8]))]).unwrap();
    write_shard(&dir.join("data/b.pb"), &[sample(Tensor::from_vec(&[8], vec![2i32; 8]))]).unwrap();
    std::fs::write(
        dir.join("t.yaml"),
        format!(
            "model: {{onnx: {{path: {}, loss: {{type: softmaxCrossEntropy, output: logits}}}}}}\n\
             data: {{train: {{path: data, format: onnxSamples}}}}\nbatchSize: 2\nsteps: 1\n",
            hf("gpt2_torchscript.onnx").display()
        ),
    )
    .unwrap();
    let o = worker(&["train", "--quiet", "--config", "t.yaml"], &dir);
    assert_refused("mixed dtypes", &o, 3, "b.pb sample 0 has tensors [input_ids: int64[8], labels: int32[8]]");
    std::fs::remove_dir_all(&dir).ok();
}

/// batchSize × seqLen past what a token count can hold wrapped to a small window, then divided
/// by zero: exit 2 naming both.
#[test]
fn a_token_window_that_overflows_is_refused() {
    let dir = scratch("bad-input-tokens");
    std::fs::create_dir_all(dir.join("tokens")).unwrap();
    write_token_shard(&dir.join("tokens/a.bin"), &(0..64u16).collect::<Vec<_>>()).unwrap();
    std::fs::write(
        dir.join("t.yaml"),
        "model: {gpt2: {layers: 1, heads: 2, embed: 16, seqLen: 4, vocab: 64}}\n\
         data: {train: {path: tokens, format: tokens}}\nbatchSize: 4611686018427387904\nsteps: 1\n",
    )
    .unwrap();
    let o = worker(&["train", "--quiet", "--config", "t.yaml"], &dir);
    assert_refused("overflowing window", &o, 2, "seqLen");
    std::fs::remove_dir_all(&dir).ok();
}

/// `inspect MODEL | head -1`: the pipe closes while the worker prints; it ends as Unix tools end
/// (SIGPIPE), without a panic.
#[test]
fn a_closed_pipe_ends_inspect_quietly() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tensorfleet-worker"))
        .args(["inspect", hf("gpt2_torchscript.onnx").to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    use std::os::unix::process::ExitStatusExt;
    assert!(o.status.success() || o.status.signal() == Some(13), "{:?}", o.status);
}

/// `worker` with a limit: a run still going after `secs` seconds is killed and fails the test
/// (an input that blocks, such as a FIFO no one writes to, must not hang the worker).
fn worker_within(args: &[&str], dir: &Path, secs: u64) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tensorfleet-worker"))
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed().as_secs() > secs {
            child.kill().ok();
            panic!("{args:?} was still running after {secs} s");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

/// A child process killed (and reaped) when the test ends, passed or not.
struct KilledOnDrop(std::process::Child);

impl Drop for KilledOnDrop {
    fn drop(&mut self) {
        self.0.kill().ok();
        self.0.wait().ok();
    }
}

/// A FIFO at `path` (mkfifo(1)).
fn fifo(path: &Path) {
    let o = Command::new("mkfifo").arg(path).output().unwrap();
    assert!(o.status.success(), "mkfifo {}: {}", path.display(), stderr(&o));
}

fn is_fifo(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_fifo())
}

/// A tiny builtin GPT-2 over a 64-token shard in `dir/tokens`, for `steps` steps, with `extra`
/// YAML lines; written to `dir/name`.
fn tiny(dir: &Path, name: &str, steps: u64, extra: &str) -> PathBuf {
    std::fs::create_dir_all(dir.join("tokens")).unwrap();
    write_token_shard(&dir.join("tokens/a.bin"), &(0..64u16).collect::<Vec<_>>()).unwrap();
    let path = dir.join(name);
    std::fs::write(
        &path,
        format!(
            "model: {{gpt2: {{layers: 1, heads: 2, embed: 16, seqLen: 4, vocab: 64}}}}\n\
             data: {{train: {{path: tokens, format: tokens}}}}\nbatchSize: 2\nsteps: {steps}\n{extra}"
        ),
    )
    .unwrap();
    path
}

/// An MLP of 4 inputs, one hidden layer of `hidden` and 3 classes, trained 2 steps of
/// `batch` samples from sample shards `data/<i>.pb`, one per entry of `shards` (each a list of
/// labels): the worker's output.
fn train_mlp(dir: &Path, hidden: usize, batch: usize, shards: &[Vec<i64>]) -> Output {
    std::fs::create_dir_all(dir.join("data")).unwrap();
    for (i, labels) in shards.iter().enumerate() {
        let samples: Vec<_> = labels
            .iter()
            .map(|&l| {
                vec![
                    ("x".to_string(), Tensor::from_vec(&[4], vec![0.5f32; 4])),
                    ("labels".to_string(), Tensor::from_vec(&[], vec![l])),
                ]
            })
            .collect();
        write_shard(&dir.join(format!("data/{i}.pb")), &samples).unwrap();
    }
    let config = format!(
        "model: {{mlp: {{inputs: 4, hidden: [{hidden}], classes: 3}}}}\n\
         data: {{train: {{path: data, format: onnxSamples}}}}\nbatchSize: {batch}\nsteps: 2\n"
    );
    std::fs::write(dir.join("mlp.yaml"), config).unwrap();
    worker_within(&["train", "--quiet", "--config", "mlp.yaml"], dir, 60)
}

/// A batch whose activations no machine holds used to fail at the arena's allocation as a
/// retryable error (exit 1), restarting the gang into the same failure. The plan's size is
/// checked against the memory before anything is allocated: exit 2 naming batchSize, with the
/// bytes needed and available.
#[test]
fn a_plan_larger_than_the_memory_is_refused_naming_the_batch_size() {
    let dir = scratch("bad-input-plan-size");
    // 100,000 samples through a hidden layer of 10^7: 4 TB per activation, more than any
    // machine has, beside 280 MB of weights.
    let o = train_mlp(&dir, 10_000_000, 100_000, &[vec![1; 100_000]]);
    assert_refused("activations of 4 TB", &o, 2, "batchSize: the run needs");
    assert!(stderr(&o).contains("are available; lower batchSize"), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).ok();
}

/// The plan was checked alone: a run whose activations and weights fit but whose optimizer
/// state (allocated after) did not failed at that allocation as a retryable error. The state is
/// counted with the plan, before anything is allocated: on a machine with room for Adam's first
/// moment but not its second the session is refused naming batchSize and the state's bytes,
/// and SGD (no state) or a machine with room for both moments runs; ZeRO's shard likewise.
#[test]
fn the_optimizer_state_is_counted_before_anything_is_allocated() {
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use tensorfleet_worker::backend::cpu::CpuBackend;
    use tensorfleet_worker::config::{LossConfig, LossKind, MlpConfig};
    use tensorfleet_worker::error::Error;
    use tensorfleet_worker::optim::Update;
    use tensorfleet_worker::session::{Session, SessionOptions};

    let (inputs, hidden, classes) = (4, 1000, 3);
    let g = tensorfleet_worker::models::mlp::build(&MlpConfig { inputs, hidden: vec![hidden], classes }, 5).unwrap();
    let loss = LossConfig {
        kind: Some(LossKind::SoftmaxCrossEntropy),
        output: "logits".into(),
        label: "labels".into(),
        ignore_index: None,
    };
    let model = tensorfleet_worker::models::with_loss(g, &loss).unwrap();
    let batch: BTreeMap<String, Tensor> = [
        ("x".to_string(), Tensor::from_vec(&[2, inputs], vec![0.5f32; 2 * inputs])),
        ("labels".to_string(), Tensor::from_vec(&[2], vec![0i64, 2])),
    ]
    .into_iter()
    .collect();
    let adam = Update::Adam { beta1: 0.9, beta2: 0.999, epsilon: 1e-8, weight_decay: 0.0, decoupled: false };
    let sgd = Update::Sgd { momentum: 0.0, nesterov: false, weight_decay: 0.0 };
    let session = |backend: CpuBackend, update: Update| {
        Session::new(Arc::new(backend), &model, &batch, 1, &SessionOptions::new(update))
    };
    let (arena, persistent) = session(CpuBackend::new(), sgd).unwrap().memory();
    let weights = 4 * (inputs * hidden + hidden + hidden * classes + classes);
    let one_moment = arena + persistent + weights;

    let refused = session(CpuBackend::with_memory_limit(one_moment), adam).map(|_| ()).unwrap_err();
    let message = refused.to_string();
    assert!(matches!(refused, Error::Config(_)), "not a configuration error (exit 2): {refused:?}");
    assert!(
        message.contains("batchSize: the run needs")
            && message.contains(&format!("{} for the optimizer's state", 2 * weights)),
        "{message}"
    );
    session(CpuBackend::with_memory_limit(one_moment), sgd).expect("SGD keeps no state");
    session(CpuBackend::with_memory_limit(one_moment + weights), adam).expect("room for both moments");

    // ZeRO-1 over 2 replicas: half of each moment, beside the flat vector of every weight and
    // the shard's gradient and part: 3 × the weights here, and the padding to whole shards,
    // counted before `join` allocates it.
    let zero = SessionOptions { zero: 1, data_replicas: 2, ..SessionOptions::new(adam) };
    let sharded = |limit| Session::new(Arc::new(CpuBackend::with_memory_limit(limit)), &model, &batch, 1, &zero);
    let refused = sharded(one_moment + weights).map(|_| ()).unwrap_err().to_string();
    let counted: usize = refused
        .split(" for the optimizer's state")
        .next()
        .and_then(|head| head.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no state bytes in: {refused}"));
    assert!((3 * weights..3 * weights + 64).contains(&counted), "{counted} bytes of state: {refused}");
    sharded(arena + persistent + counted).expect("room for the shard");
}

/// A class label past the model's classes was refused by the loss's kernel mid-run, naming the
/// node but not the data (and on a GPU found only at the next wait). The labels of every sample
/// are checked against the bound loss's classes before the first step: exit 3 naming the shard,
/// the sample and the label.
#[test]
fn a_label_past_the_classes_names_its_shard_and_sample() {
    let dir = scratch("bad-input-labels");
    let o = train_mlp(&dir, 8, 2, &[vec![0, 2], vec![1, 5]]);
    assert_refused("label 5 of 3 classes", &o, 3, "data.train: sample shard");
    assert!(stderr(&o).contains("1.pb sample 1: label 5"), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).ok();
}

/// Under tensor parallelism the loss is split over the vocabulary: a label past it fell in no
/// rank's slice and its loss term was lost without a word (exit 0). The sharded loss records the
/// whole vocabulary, and the labels are checked against it before the first step: exit 3
/// naming the shard, sample and label (the ignored -100 stays admitted).
#[test]
fn a_label_past_the_vocabulary_is_refused_under_tensor_parallelism() {
    let dir = scratch("bad-input-tp-labels");
    std::fs::create_dir_all(dir.join("data")).unwrap();
    // GPT-2 exported by PyTorch with its loss: a vocabulary of 96, 16 tokens a row.
    let sample = |salt: i64, last: i64| {
        let ids: Vec<i64> = (0..16).map(|i| (i * 7 + salt) % 96).collect();
        let mut labels: Vec<i64> = ids[1..].to_vec();
        labels.push(last);
        vec![
            ("input_ids".to_string(), Tensor::from_vec(&[16], ids)),
            ("labels".to_string(), Tensor::from_vec(&[16], labels)),
        ]
    };
    write_shard(&dir.join("data/0.pb"), &[sample(1, -100), sample(2, 100)]).unwrap();
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/torch_gpt2/gpt2_tiny_with_loss.onnx");
    let config = format!(
        "model: {{onnx: {{path: {}, loss: {{output: loss}}}}}}\n\
         data: {{train: {{path: data, format: onnxSamples}}}}\nbatchSize: 2\nsteps: 1\nparallelism: {{tensor: 2}}\n",
        model.display()
    );
    std::fs::write(dir.join("tp.yaml"), config).unwrap();
    let o = common::mpirun(2)
        .args([env!("CARGO_BIN_EXE_tensorfleet-worker"), "train", "--quiet", "--config", "tp.yaml"])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert_refused("label 100 of a vocabulary of 96, split over 2 ranks", &o, 3, "0.pb sample 1: label 100");
    assert!(stderr(&o).contains("classes 0..96 nor the ignored -100"), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).ok();
}

/// A FIFO blocks its reader until a writer comes: as the config, the model, or a shard the
/// worker hung. Only regular files are read as inputs: exit 2 naming the path.
#[test]
fn a_fifo_is_never_read_as_an_input() {
    let dir = scratch("bad-input-fifo-in");
    fifo(&dir.join("config.yaml"));
    let o = worker_within(&["train", "--quiet", "--config", "config.yaml"], &dir, 60);
    assert_refused("a FIFO as --config", &o, 2, "config.yaml");

    fifo(&dir.join("model.onnx"));
    let model = config(&dir, &dir.join("model.onnx"), 1, "model");
    let o = worker_within(&["train", "--quiet", "--config", model.to_str().unwrap()], &dir, 60);
    assert_refused("a FIFO as the model", &o, 2, "model.onnx");

    fifo(&dir.join("shard.bin"));
    let o = worker_within(&["inspect", "shard.bin"], &dir, 60);
    assert_refused("a FIFO as a shard to inspect", &o, 2, "shard.bin");

    let cfg = tiny(&dir, "tokens.yaml", 1, "");
    fifo(&dir.join("tokens/b.bin"));
    let o = worker_within(&["train", "--quiet", "--config", cfg.to_str().unwrap()], &dir, 60);
    assert_refused("a FIFO among the shards", &o, 2, "b.bin");
    std::fs::remove_dir_all(&dir).ok();
}

/// Outputs went to `<path>.tmp` and were renamed over whatever the path was: a device node or
/// FIFO became a regular file. They replace only regular files: exit 2 naming the path, the
/// FIFO left as it was.
#[test]
fn an_output_never_replaces_a_fifo() {
    let dir = scratch("bad-input-fifo-out");
    let cfg = tiny(&dir, "t.yaml", 1, "checkpoint: {every: 1}\noutput: {dir: out}\n");
    let o = worker_within(&["train", "--quiet", "--config", cfg.to_str().unwrap()], &dir, 120);
    assert!(o.status.success(), "{}", stderr(&o));

    fifo(&dir.join("exported.onnx"));
    let o = worker_within(
        &["export", "--checkpoint", "out/checkpoints/checkpoint_1", "--output", "exported.onnx"],
        &dir,
        60,
    );
    assert_refused("export onto a FIFO", &o, 2, "exported.onnx");
    assert!(is_fifo(&dir.join("exported.onnx")), "export replaced the FIFO");

    for key in ["trainingGraph", "modelWithLoss"] {
        let target = dir.join(format!("{key}.onnx"));
        fifo(&target);
        let set = format!("output.{key}={}", target.display());
        let args = ["train", "--quiet", "--config", cfg.to_str().unwrap(), "--set", &set, "--set", "output.dir=o2"];
        let o = worker_within(&args, &dir, 120);
        assert_refused(&format!("output.{key} onto a FIFO"), &o, 2, &format!("{key}.onnx"));
        assert!(is_fifo(&target), "output.{key} replaced the FIFO");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Two trainers on one output directory mixed their checkpoints and metrics. The first holds a
/// lock on `output.dir/.lock` (released by the kernel when it ends); a second exits 2 naming
/// the directory and the holder.
#[test]
fn a_second_trainer_on_one_output_directory_is_refused() {
    let dir = scratch("bad-input-lock");
    let cfg = tiny(&dir, "t.yaml", 1_000_000, "output: {dir: out}\nlogging: {tensorboard: false}\n");
    let mut first = KilledOnDrop(
        Command::new(env!("CARGO_BIN_EXE_tensorfleet-worker"))
            .args(["train", "--quiet", "--config", cfg.to_str().unwrap()])
            .current_dir(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let start = std::time::Instant::now();
    // The first is training once its metrics have a line.
    while std::fs::read_to_string(dir.join("out/metrics.jsonl")).map_or(true, |m| !m.contains('\n')) {
        if let Some(status) = first.0.try_wait().unwrap() {
            panic!("the first trainer ended: {status}");
        }
        assert!(start.elapsed().as_secs() < 120, "the first trainer logged no step in 120 s");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let o = worker_within(&["train", "--quiet", "--config", cfg.to_str().unwrap()], &dir, 120);
    let holder = first.0.id();
    drop(first);
    assert_refused("a second trainer", &o, 2, &dir.join("out").display().to_string());
    assert!(stderr(&o).contains(&format!("pid {holder}")), "names the holder: {}", stderr(&o));

    // Once the holder is gone, the directory is free again.
    let o = worker_within(&["train", "--quiet", "--config", cfg.to_str().unwrap(), "--set", "steps=1"], &dir, 120);
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).ok();
}

/// A crash leaves a torn last line in metrics.jsonl, and the lines after the checkpoint a run
/// resumes from are redone: the resumed file holds every step once, every line whole.
#[test]
fn a_resumed_run_cuts_its_metrics_back_to_the_checkpoint() {
    let dir = scratch("bad-input-metrics");
    let cfg = tiny(&dir, "t.yaml", 4, "checkpoint: {every: 2, keep: 5}\noutput: {dir: out}\n");
    let o = worker_within(&["train", "--quiet", "--config", cfg.to_str().unwrap()], &dir, 120);
    assert!(o.status.success(), "{}", stderr(&o));
    // As if the run had crashed writing step 5's line after checkpoint 4 was lost.
    let metrics = dir.join("out/metrics.jsonl");
    let mut log = std::fs::read_to_string(&metrics).unwrap();
    log.push_str("{\"step\":5,\"loss\":1.2");
    std::fs::write(&metrics, log).unwrap();
    std::fs::remove_dir_all(dir.join("out/checkpoints/checkpoint_4")).unwrap();
    let o = worker_within(&["train", "--quiet", "--config", cfg.to_str().unwrap()], &dir, 120);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("resumed at step 2"), "{}", stderr(&o));
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("a torn line {l:?}: {e}")))
        .collect();
    let steps: Vec<u64> = lines.iter().map(|v| v["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [1, 2, 3, 4]);
    std::fs::remove_dir_all(&dir).ok();
}

/// Rank 0's file of checkpoint `ckpt` taken apart: the manifest, the safetensors header's
/// entries in order, and the data after the header.
fn rank0(ckpt: &Path) -> (serde_json::Value, Vec<(String, serde_json::Value)>, Vec<u8>) {
    let bytes = std::fs::read(ckpt.join("rank_0.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let manifest = serde_json::from_slice(&std::fs::read(ckpt.join("manifest.json")).unwrap()).unwrap();
    (manifest, header.into_iter().collect(), bytes[8 + n..].to_vec())
}

/// A checkpoint at `dir/name` put together from `rank0`'s parts, its checksums (the rank file's
/// in the manifest, the manifest's in `manifest.sum`) made to match: well-formed to the
/// checksums, whatever the parts say.
fn assemble(
    dir: &Path,
    name: &str,
    mut manifest: serde_json::Value,
    entries: &[(String, serde_json::Value)],
    data: &[u8],
) -> PathBuf {
    let copy = dir.join(name);
    std::fs::create_dir_all(&copy).unwrap();
    let fields: Vec<String> = entries.iter().map(|(k, v)| format!("{}:{v}", serde_json::json!(k))).collect();
    let mut text = format!("{{{}}}", fields.join(",")).into_bytes();
    while text.len() % 8 != 0 {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(data);
    manifest["files"]["rank_0.safetensors"] = tensorfleet_worker::checkpoint::checksum(&out).into();
    std::fs::write(copy.join("rank_0.safetensors"), out).unwrap();
    let text = serde_json::to_vec_pretty(&manifest).unwrap();
    let sum = format!("{}  manifest.json\n", tensorfleet_worker::checkpoint::checksum(&text));
    std::fs::write(copy.join("manifest.json"), text).unwrap();
    std::fs::write(copy.join("manifest.sum"), sum).unwrap();
    copy
}

/// A copy of checkpoint `ckpt` at `dir/name` with `fault` applied to its manifest and to rank
/// 0's header entries (the data as it was).
fn damaged(
    ckpt: &Path,
    dir: &Path,
    name: &str,
    fault: impl FnOnce(&mut serde_json::Value, &mut Vec<(String, serde_json::Value)>),
) -> PathBuf {
    let (mut manifest, mut entries, data) = rank0(ckpt);
    fault(&mut manifest, &mut entries);
    assemble(dir, name, manifest, &entries, &data)
}

/// The tensor whose data comes last in the header's entries, and its offsets.
fn last_tensor(entries: &[(String, serde_json::Value)]) -> (usize, u64, u64) {
    let offsets =
        |v: &serde_json::Value| (v["data_offsets"][0].as_u64().unwrap(), v["data_offsets"][1].as_u64().unwrap());
    let (i, (_, v)) = entries.iter().enumerate().max_by_key(|(_, (_, v))| offsets(v).0).unwrap();
    (i, offsets(v).0, offsets(v).1)
}

/// Checkpoints whose manifest or safetensors header is damaged (checksums made to match) were
/// loaded: an offset one byte off decoded the tensor shifted, a repeated name or an overlap
/// went unseen, a foreign format or a world size its layout denies was read as ours, and an
/// element count that overflows aborted. Each is refused: exit 3 naming the file and the
/// tensor or field.
#[test]
fn a_damaged_checkpoint_is_refused_naming_the_file_and_tensor() {
    let dir = scratch("bad-input-checkpoint");
    let cfg = tiny(&dir, "t.yaml", 1, "checkpoint: {every: 1}\noutput: {dir: out}\n");
    let o = worker_within(&["train", "--quiet", "--config", cfg.to_str().unwrap()], &dir, 120);
    assert!(o.status.success(), "{}", stderr(&o));
    let ckpt = dir.join("out/checkpoints/checkpoint_1");
    let inspect = |copy: &Path| worker_within(&["inspect", copy.to_str().unwrap()], &dir, 60);

    let mut shifted = String::new();
    let copy = damaged(&ckpt, &dir, "shifted", |_, entries| {
        let (i, begin, end) = last_tensor(entries);
        entries[i].1["data_offsets"] = serde_json::json!([begin - 1, end - 1]);
        shifted = entries[i].0.clone();
    });
    let o = inspect(&copy);
    assert_refused("an offset one byte off", &o, 3, "rank_0.safetensors: tensor '");
    assert!(stderr(&o).contains(&format!("'{shifted}'")), "names {shifted}: {}", stderr(&o));

    let mut repeated = String::new();
    let copy = damaged(&ckpt, &dir, "repeated", |_, entries| {
        let (i, ..) = last_tensor(entries);
        repeated = entries[i].0.clone();
        entries.push(entries[i].clone());
    });
    assert_refused("a repeated name", &inspect(&copy), 3, &format!("tensor '{repeated}' appears twice"));

    let copy = damaged(&ckpt, &dir, "overlap", |_, entries| {
        // Another tensor of the same size moved onto the last one's bytes.
        let (i, begin, end) = last_tensor(entries);
        let size =
            |v: &serde_json::Value| v["data_offsets"][1].as_u64().unwrap() - v["data_offsets"][0].as_u64().unwrap();
        let j = (0..entries.len()).find(|&j| j != i && size(&entries[j].1) == end - begin).expect("two of a size");
        entries[j].1["data_offsets"] = serde_json::json!([begin, end]);
    });
    assert_refused("overlapping tensors", &inspect(&copy), 3, "rank_0.safetensors: tensor '");

    let copy = damaged(&ckpt, &dir, "overflow", |_, entries| {
        let (i, ..) = last_tensor(entries);
        entries[i].1["shape"] = serde_json::json!([1u64 << 40, 1u64 << 40]);
    });
    assert_refused("an element count that overflows", &inspect(&copy), 3, "more bytes than memory can address");

    let copy = damaged(&ckpt, &dir, "format", |m, _| m["format"] = "tensorfleet-checkpoint-v9".into());
    assert_refused("a foreign format", &inspect(&copy), 3, "manifest.json: format 'tensorfleet-checkpoint-v9'");

    let copy = damaged(&ckpt, &dir, "world", |m, _| m["worldSize"] = 4.into());
    assert_refused("a world size its layout denies", &inspect(&copy), 3, "manifest.json: worldSize 4");

    // The manifest's own bytes: an edit its checksum does not cover, a missing manifest.sum.
    let copy = damaged(&ckpt, &dir, "edited", |_, _| {});
    let text = std::fs::read_to_string(copy.join("manifest.json")).unwrap();
    assert!(text.contains("\"step\": 1,"), "{text}");
    std::fs::write(copy.join("manifest.json"), text.replace("\"step\": 1,", "\"step\": 7,")).unwrap();
    assert_refused("an edited manifest", &inspect(&copy), 3, "manifest.json: its checksum");
    let copy = damaged(&ckpt, &dir, "unsummed", |_, _| {});
    std::fs::remove_file(copy.join("manifest.sum")).unwrap();
    assert_refused("no manifest.sum", &inspect(&copy), 3, "manifest.sum is missing");
    // A checkpoint of the format before manifest.sum still loads.
    let copy = damaged(&ckpt, &dir, "v2", |m, _| m["format"] = "tensorfleet-checkpoint-v2".into());
    std::fs::remove_file(copy.join("manifest.sum")).unwrap();
    let o = inspect(&copy);
    assert!(o.status.success(), "a v2 checkpoint: {}", stderr(&o));
    std::fs::remove_dir_all(&dir).ok();
}

/// `loss: {output: logits}` without a `type` names the model's own loss; the logits are not one:
/// exit 2 naming the key, instead of training the sum of the logits.
#[test]
fn a_loss_output_that_is_not_one_number_is_refused() {
    let dir = scratch("bad-input-loss-output");
    std::fs::write(
        dir.join("t.yaml"),
        format!(
            "model: {{onnx: {{path: {}, loss: {{output: logits}}}}}}\n\
             data: {{train: {{path: {}, format: onnxSamples}}}}\nbatchSize: 2\nsteps: 1\n",
            cnn("resnet18_dynamo.onnx").display(),
            cnn("batches.pb").display()
        ),
    )
    .unwrap();
    let o = worker(&["train", "--quiet", "--config", "t.yaml"], &dir);
    assert_refused("logits as the loss", &o, 2, "model.onnx.loss.output: 'logits'");
    std::fs::remove_dir_all(&dir).ok();
}

/// `export` of a checkpoint that lacks a weight the run trained wrote the model's untrained
/// initial value for it, exit 0; it is refused: exit 3 naming the weight.
#[test]
fn export_refuses_a_checkpoint_missing_a_trained_weight() {
    let dir = scratch("bad-input-export-missing");
    let cfg = tiny(&dir, "t.yaml", 1, "checkpoint: {every: 1}\noutput: {dir: out}\n");
    let o = worker_within(&["train", "--quiet", "--config", cfg.to_str().unwrap()], &dir, 120);
    assert!(o.status.success(), "{}", stderr(&o));
    let ckpt = dir.join("out/checkpoints/checkpoint_1");
    // The checkpoint again without one weight: its entry and its bytes gone, the others moved up,
    // the checksum made to match (a well-formed checkpoint that is merely incomplete).
    let (manifest, entries, bytes) = rank0(&ckpt);
    let dropped = entries
        .iter()
        .map(|(k, _)| k)
        .find(|k| !k.starts_with(OPTIMIZER_PREFIX) && *k != "__metadata__")
        .expect("a weight")
        .clone();
    let (mut kept, mut data) = (Vec::new(), Vec::new());
    for (name, mut entry) in entries.into_iter().filter(|(k, _)| *k != dropped) {
        if let Some(offsets) = entry.get("data_offsets").cloned() {
            let (begin, end) = (offsets[0].as_u64().unwrap() as usize, offsets[1].as_u64().unwrap() as usize);
            let start = data.len();
            data.extend_from_slice(&bytes[begin..end]);
            entry["data_offsets"] = serde_json::json!([start, data.len()]);
        }
        kept.push((name, entry));
    }
    let copy = assemble(&dir, "incomplete", manifest, &kept, &data);

    let o = worker_within(&["export", "--checkpoint", copy.to_str().unwrap(), "--output", "m.onnx"], &dir, 60);
    assert_refused("a missing weight", &o, 3, &format!("the trained weight '{dropped}' is missing"));
    assert!(!dir.join("m.onnx").exists(), "a model was written");
    std::fs::remove_dir_all(&dir).ok();
}

/// A model whose weights hold a NaN trained NaN losses and exported them, exit 0; it is refused
/// before training: exit 3 naming the weight.
#[test]
fn a_nan_weight_is_refused_naming_it() {
    let dir = scratch("bad-input-nan-weight");
    let mut model = ModelProto::decode(std::fs::read(cnn("resnet18_dynamo.onnx")).unwrap().as_slice()).unwrap();
    let graph = model.graph.as_mut().unwrap();
    let w = graph.initializer.iter_mut().find(|t| t.dims.len() == 4 && t.data_type == Some(1)).expect("a conv weight");
    match w.raw_data.as_mut().filter(|r| !r.is_empty()) {
        Some(raw) => raw[..4].copy_from_slice(&f32::NAN.to_le_bytes()),
        None => w.float_data[0] = f32::NAN,
    }
    let name = w.name.clone().unwrap();
    let path = dir.join("nan.onnx");
    std::fs::write(&path, model.encode_to_vec()).unwrap();
    let o = worker(&["train", "--quiet", "--config", cnn_config(&dir, &path).to_str().unwrap()], &dir);
    assert_refused("a NaN weight", &o, 3, &format!("weight '{name}' holds NaN"));
    std::fs::remove_dir_all(&dir).ok();
}

/// Resuming under another model or optimizer read the checkpoint's weights as other ones (other
/// heads), dropped some (fewer layers) or lost the moments (another optimizer), exit 0; each is
/// refused: exit 2 naming the key, with both values.
#[test]
fn resuming_under_another_model_or_optimizer_is_refused() {
    let dir = scratch("bad-input-resume-mismatch");
    let cfg = tiny(&dir, "t.yaml", 2, "checkpoint: {every: 1}\noutput: {dir: out}\n");
    let o = worker_within(&["train", "--quiet", "--config", cfg.to_str().unwrap()], &dir, 120);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&cfg).unwrap().replace("steps: 2", "steps: 4");
    for (what, from, to, key) in [
        ("other heads", "heads: 2", "heads: 4", "model.gpt2.heads 2, this run has 4"),
        ("fewer layers", "layers: 1", "layers: 2", "model.gpt2.layers 1, this run has 2"),
        ("another optimizer", "output:", "optimizer: {name: sgd, lr: 0.1}\noutput:", "optimizer.name adamw"),
    ] {
        std::fs::write(dir.join("r.yaml"), text.replace(from, to)).unwrap();
        let o = worker_within(&["train", "--quiet", "--config", "r.yaml"], &dir, 120);
        assert_refused(what, &o, 2, key);
    }
    // Dropout defines no weight: a resume under another rate continues.
    std::fs::write(dir.join("r.yaml"), text.replace("vocab: 64", "vocab: 64, dropout: 0.1")).unwrap();
    let o = worker_within(&["train", "--quiet", "--config", "r.yaml"], &dir, 120);
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).ok();
}

/// A builtin model larger than any machine (10^12 positions, or 10^12 layers) aborted when an
/// allocation failed, or built for minutes first; it is refused before it is built: exit 2
/// naming the model's keys and the bytes.
#[test]
fn a_model_larger_than_the_machine_is_refused_before_it_is_built() {
    let dir = scratch("bad-input-model-size");
    for (what, from, to) in [
        ("10^12 positions", "seqLen: 4", "seqLen: 1000000000000"),
        ("10^12 layers", "layers: 1", "layers: 1000000000000"),
    ] {
        let text = std::fs::read_to_string(tiny(&dir, "t.yaml", 1, "")).unwrap();
        std::fs::write(dir.join("big.yaml"), text.replace(from, to)).unwrap();
        let o = worker_within(&["train", "--quiet", "--config", "big.yaml"], &dir, 30);
        assert_refused(what, &o, 2, "model.gpt2 (layers, embed, seqLen, vocab): the model's");
        assert!(stderr(&o).contains("this machine has"), "{what}: {}", stderr(&o));
    }
    std::fs::remove_dir_all(&dir).ok();
}
