//! Mutation fuzzing of every input format the worker reads, on stable Rust. Valid inputs made
//! by the worker itself (a tiny run's token shard, checkpoint, exported model and configuration,
//! and a sample shard), and what prepare-data reads (JSON Lines and Parquet documents, a Hugging
//! Face tokenizer.json, PNG and JPEG images: the committed fixtures of tests/data/), and the
//! models PyTorch's exporters wrote (tests/data/torch_hf/, torch_cnn/), which are built into
//! training graphs, are mutated: bits flipped, bytes set to edge values, integers to boundary
//! values, numbers in text to extreme ones, cuts, repeats and insertions. Each reader must give
//! a value or an error for every input: a panic, or a read that takes longer than `TIMEOUT`,
//! fails the target and saves the input under `fuzz/<target>/` in cargo's target directory (an
//! abort ends the process with the input in `fuzz/<target>/current` there). Committed inputs
//! under `tests/data/fuzz/<target>/` (what failed before) are replayed first.
//!
//! `make test` runs `ROUNDS` inputs per target from a fixed seed: the same inputs every run.
//! `make fuzz` builds with integer overflow checks (in `target/fuzz-overflow/`), runs each
//! target for `TENSORFLEET_FUZZ_SECONDS` from a seed drawn from the clock and prints the inputs
//! run per target (docs/RELIABILITY.md).

mod common;
mod torch_oracle;

use prost::Message;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use tensorfleet_worker::checkpoint;
use tensorfleet_worker::config::TrainingConfig;
use tensorfleet_worker::data::samples::{self, SampleLoader};
use tensorfleet_worker::data::tokens::{write_shard as write_token_shard, TokenLoader};
use tensorfleet_worker::data::{Batch, Batching, Feeds, Loader, Partition};
use tensorfleet_worker::models;
use tensorfleet_worker::onnx::{ModelProto, TensorProto};
use tensorfleet_worker::optim::Update;
use tensorfleet_worker::prepare::{prepare_images, prepare_text, ImageOptions, TextOptions};
use tensorfleet_worker::rng::Rng;
use tensorfleet_worker::session::{SessionOptions, TrainingGraph};
use tensorfleet_worker::tensor::Tensor;

/// Inputs per target in `make test`.
const ROUNDS: usize = 10_000;
/// Inputs per training-graph target in `make test`: each builds a whole training graph
/// (differentiated, fused), about five times a reader's work.
const GRAPH_ROUNDS: usize = 2_000;
/// The longest one read may take (a tiny input; a hang shows as this).
const TIMEOUT: Duration = Duration::from_secs(20);
const FIXED_SEED: u64 = 0x7E45_0F1E_E7F0_22ED;

/// A reader under test: given a scratch directory of its own and one input.
type Reader = fn(&Path, &[u8]);

fn tokens(dir: &Path, input: &[u8]) {
    let path = dir.join("train_000000.bin");
    std::fs::write(&path, input).unwrap();
    let feeds = Feeds { token_input: "ids".into(), token_label: "labels".into(), vocab: Some(50257) };
    let batching = Batching { batch: 2, seq_len: 8, shuffle: true, seed: 1, partition: Partition::WHOLE };
    if let Ok(loader) = TokenLoader::open(&path, "data.train", batching, &feeds) {
        read_batches(loader);
    }
}

/// Up to four batches, as training would read them, until one fails.
fn read_batches(mut loader: impl Loader) {
    for _ in 0..4 {
        if loader.next_batch().is_err() {
            break;
        }
    }
}

fn samples(dir: &Path, input: &[u8]) {
    let path = dir.join("part.pb");
    std::fs::write(&path, input).unwrap();
    let _ = samples::read_shard(&path);
    let batching = Batching { batch: 2, seq_len: 0, shuffle: true, seed: 1, partition: Partition::WHOLE };
    if let Ok(loader) = SampleLoader::open(&path, "data.train", batching) {
        read_batches(loader);
    }
}

/// The manifest of a real checkpoint replaced by the input; its rank files stay. An input with
/// a NUL byte is the manifest, the NUL, then `manifest.sum` as it is (so that the sum's reader
/// meets mutated sums); otherwise the sum is made to match, so that the manifest's parser
/// behind it meets every input.
fn manifest(dir: &Path, input: &[u8]) {
    let ckpt = dir.join("checkpoint");
    if !ckpt.exists() {
        copy_dir(&seeds().checkpoint, &ckpt);
    }
    let (json, sum) = match input.iter().position(|&b| b == 0) {
        Some(nul) => (&input[..nul], input[nul + 1..].to_vec()),
        None => (input, format!("{}  manifest.json\n", checkpoint::checksum(input)).into_bytes()),
    };
    std::fs::write(ckpt.join("manifest.json"), json).unwrap();
    std::fs::write(ckpt.join("manifest.sum"), sum).unwrap();
    let _ = checkpoint::load(&ckpt);
}

/// A rank file's bytes straight to the decoder (through `load`, the manifest's checksum would
/// refuse any change first).
fn safetensors(_: &Path, input: &[u8]) {
    let _ = checkpoint::safetensors::decode(input);
}

/// What `tensorfleet-worker inspect` does with a model: decode, convert every node, classify
/// the initializers, bind the shapes and plan the memory.
fn onnx(dir: &Path, input: &[u8]) {
    let path = dir.join("model.onnx");
    std::fs::write(&path, input).unwrap();
    let _ = tensorfleet_worker::inspect::inspect(&path, &["batch=2".into()]);
}

/// What `train` makes of a model before its first step: the model loaded as a user configures
/// an export (cross-entropy on `logits`, labels -100 ignored), bound to the first batch of
/// `data` (a file of tests/data/), differentiated, fused and given its updates
/// (`TrainingGraph::build`, which needs no backend).
fn training_graph(dir: &Path, input: &[u8], data: &str) {
    let _ = build_training_graph(dir, input, data);
}

/// The model in `bytes` loaded and built into a training graph for `data`'s first batch.
fn build_training_graph(dir: &Path, bytes: &[u8], data: &str) -> tensorfleet_worker::error::Result<()> {
    std::fs::write(dir.join("model.onnx"), bytes).unwrap();
    let model = models::load(&torch_oracle::spec(dir, "model.onnx", Some(-100), Default::default()), 0)?;
    TrainingGraph::build(&model, &first_batch(data), 1, &adamw()).map(drop)
}

/// Hugging Face's GPT-2 and Llama as both PyTorch exporters write them.
fn training_transformers(dir: &Path, input: &[u8]) {
    training_graph(dir, input, "torch_hf/gpt2.pb");
}

/// torchvision's ResNet-18 as both PyTorch exporters write it.
fn training_cnn(dir: &Path, input: &[u8]) {
    training_graph(dir, input, "torch_cnn/batches.pb");
}

fn adamw() -> SessionOptions {
    SessionOptions::new(Update::Adam { beta1: 0.9, beta2: 0.95, epsilon: 1e-8, weight_decay: 0.1, decoupled: true })
}

/// The first batch of a sample shard of tests/data/ (of the size its export.py fixed, which
/// expected.json beside it gives), read once.
fn first_batch(data: &str) -> std::sync::Arc<Batch> {
    static BATCHES: OnceLock<std::sync::Mutex<BTreeMap<String, std::sync::Arc<Batch>>>> = OnceLock::new();
    let mut batches = BATCHES.get_or_init(Default::default).lock().unwrap();
    let batch = batches.entry(data.to_string()).or_insert_with(|| {
        let path = PathBuf::from(fixture(data));
        let batch = torch_oracle::expected(path.parent().unwrap())["batch"].as_u64().unwrap() as usize;
        std::sync::Arc::new(torch_oracle::batches(&path, batch, 1).remove(0))
    });
    batch.clone()
}

fn config(_: &Path, input: &[u8]) {
    let _ = TrainingConfig::parse(&String::from_utf8_lossy(input), "fuzz.yaml", &[]);
}

/// prepare-data on one file of documents (`name` says JSON Lines or Parquet) with a small BPE
/// tokenizer.json.
fn documents(dir: &Path, name: &str, input: &[u8]) {
    let path = dir.join(name);
    std::fs::write(&path, input).unwrap();
    let opts = TextOptions {
        tokenizer: fixture("hf_tokenizers/gpt2_style.json"),
        text_field: "text".into(),
        val_fraction: 0.1,
    };
    let _ = prepare_text(&[path], &dir.join("out"), &opts);
}

fn json_lines(dir: &Path, input: &[u8]) {
    documents(dir, "docs.jsonl", input);
}

fn parquet(dir: &Path, input: &[u8]) {
    documents(dir, "docs.parquet", input);
}

/// prepare-data on a fixed document with the input as its tokenizer.json.
fn tokenizer(dir: &Path, input: &[u8]) {
    let (doc, json) = (dir.join("doc.txt"), dir.join("tokenizer.json"));
    std::fs::write(&doc, "The quick brown fox jumps over the lazy dog.\n").unwrap();
    std::fs::write(&json, input).unwrap();
    let opts = TextOptions { tokenizer: json.display().to_string(), text_field: "text".into(), val_fraction: 0.0 };
    let _ = prepare_text(&[doc], &dir.join("out"), &opts);
}

/// prepare-data on an ImageFolder of one class holding the input (its format known by its
/// content, as the decoder finds it).
fn images(dir: &Path, input: &[u8]) {
    let class = dir.join("folder/class");
    std::fs::create_dir_all(&class).unwrap();
    std::fs::write(class.join("image.png"), input).unwrap();
    let opts = ImageOptions {
        size: 8,
        input_name: "input".into(),
        label_name: "labels".into(),
        mean: [0.0; 3],
        std: [1.0; 3],
        val_fraction: 0.0,
        seed: 0,
    };
    let _ = prepare_images(&dir.join("folder"), &dir.join("out"), &opts);
}

/// The path of a committed fixture under tests/data/.
fn fixture(path: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(path).display().to_string()
}

fn read_fixture(path: &str) -> Vec<u8> {
    std::fs::read(fixture(path)).unwrap()
}

/// The valid inputs the mutations start from.
struct Seeds {
    tokens: Vec<u8>,
    samples: Vec<u8>,
    checkpoint: PathBuf,
    rank_file: Vec<u8>,
    model: Vec<u8>,
    config: Vec<u8>,
}

/// A tiny run of the worker binary, as a user would make one (train with a checkpoint, export),
/// on a token shard of a 64-token vocabulary, so that the model and the rank file are mostly
/// structure (a 50257-row embedding would be 99% weights, which the mutations would hit); and a
/// sample shard of two tensors per sample.
fn seeds() -> &'static Seeds {
    static SEEDS: OnceLock<Seeds> = OnceLock::new();
    SEEDS.get_or_init(|| {
        let dir = common::scratch("fuzz-seeds");
        std::fs::create_dir_all(dir.join("tokens")).unwrap();
        let ids: Vec<u16> = (0..400u16).map(|i| (i * 7 + i / 5) % 64).collect();
        write_token_shard(&dir.join("tokens/train_000000.bin"), &ids).unwrap();
        let config = "model: {gpt2: {layers: 1, heads: 2, embed: 16, seqLen: 8, vocab: 64}}\n\
                      data: {train: {path: tokens, format: tokens}}\n\
                      batchSize: 2\nsteps: 2\ncheckpoint: {every: 2, keep: 1}\noutput: {dir: out}\n";
        std::fs::write(dir.join("train.yaml"), config).unwrap();
        let o = Command::new(env!("CARGO_BIN_EXE_tensorfleet-worker"))
            .args(["train", "--config", "train.yaml", "--quiet"])
            .current_dir(&dir)
            .output()
            .unwrap();
        assert!(o.status.success(), "the seed run: {}", String::from_utf8_lossy(&o.stderr));
        let checkpoint = dir.join("out/checkpoints/checkpoint_2");
        let rank_file = std::fs::read_dir(&checkpoint)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .expect("a rank file");
        let sample = |i: usize| {
            vec![
                ("x".to_string(), Tensor::from_vec(&[2, 3], (0..6).map(|k| (i * 6 + k) as f32).collect())),
                ("labels".to_string(), Tensor::from_vec(&[], vec![i as i64])),
            ]
        };
        samples::write_shard(&dir.join("part.pb"), &(0..5).map(sample).collect::<Vec<_>>()).unwrap();
        Seeds {
            tokens: std::fs::read(dir.join("tokens/train_000000.bin")).unwrap(),
            samples: std::fs::read(dir.join("part.pb")).unwrap(),
            rank_file: std::fs::read(rank_file).unwrap(),
            model: std::fs::read(dir.join("out/model.onnx")).unwrap(),
            config: config.as_bytes().to_vec(),
            checkpoint,
        }
    })
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
    }
}

/// One to four mutations of `data`.
fn mutate(rng: &mut Rng, data: &mut Vec<u8>) {
    for _ in 0..1 + rng.below(4) {
        let len = data.len();
        match rng.below(8) {
            0 if len > 0 => data[rng.below(len)] ^= 1 << rng.below(8),
            1 if len > 0 => data[rng.below(len)] = [0, 1, 0x7F, 0x80, 0xFF][rng.below(5)],
            2 if len >= 4 => {
                let edge: [u32; 7] = [0, 1, 0xFFFF, 1 << 20, i32::MAX as u32, 1 << 31, u32::MAX];
                let at = rng.below(len - 3);
                data[at..at + 4].copy_from_slice(&edge[rng.below(edge.len())].to_le_bytes());
            }
            3 if len >= 8 => {
                let edge: [u64; 4] = [0, 1 << 40, i64::MAX as u64, u64::MAX];
                let at = rng.below(len - 7);
                data[at..at + 8].copy_from_slice(&edge[rng.below(edge.len())].to_le_bytes());
            }
            4 => data.truncate(rng.below(len + 1)),
            5 if len > 0 => {
                let from = rng.below(len);
                let piece: Vec<u8> = data[from..(from + 1 + rng.below(64)).min(len)].to_vec();
                let at = rng.below(len + 1);
                data.splice(at..at, piece);
            }
            6 => replace_a_number(rng, data),
            _ => {
                let at = rng.below(len + 1);
                let bytes: Vec<u8> = (0..1 + rng.below(8)).map(|_| rng.below(256) as u8).collect();
                data.splice(at..at, bytes);
            }
        }
    }
}

/// One to three changes to a model's structure, re-encoded: byte-level mutations of an ONNX
/// file nearly all stop at the protobuf decoder (the `onnx` target has those), while these
/// reach shape inference, autodiff and the fusions. A node's attribute set to an edge value or
/// dropped, its operator swapped for another node's, an input dropped, repeated or taken from
/// another node, an element of a small integer tensor (a shape, axes, indices, as exports keep
/// them in initializers and Constant nodes) set to an edge value, a weight's dims reordered.
fn mutate_model(rng: &mut Rng, data: &mut Vec<u8>) {
    let mut model = match ModelProto::decode(&data[..]) {
        Ok(m) if m.graph.as_ref().is_some_and(|g| !g.node.is_empty()) => m,
        _ => return mutate(rng, data),
    };
    let g = model.graph.as_mut().unwrap();
    for _ in 0..1 + rng.below(3) {
        let n = rng.below(g.node.len());
        match rng.below(6) {
            0 => {
                let attrs = &mut g.node[n].attribute;
                if let Some(a) = pick(rng, attrs.len()).map(|k| &mut attrs[k]) {
                    if a.i.is_some() {
                        a.i = Some(edge_int(rng));
                    }
                    if let Some(k) = pick(rng, a.ints.len()) {
                        a.ints[k] = edge_int(rng);
                    }
                    if a.f.is_some() {
                        a.f = Some([0.0, -1.0, f32::NAN, f32::INFINITY, 1e30][rng.below(5)]);
                    }
                    if let Some(t) = a.t.as_mut() {
                        set_small_int(rng, t);
                    }
                }
            }
            1 => {
                let other = g.node[rng.below(g.node.len())].op_type.clone();
                g.node[n].op_type = other;
            }
            2 => {
                let from = g.node[rng.below(g.node.len())].output.first().cloned().unwrap_or_default();
                let inputs = &mut g.node[n].input;
                match (pick(rng, inputs.len()), rng.below(3)) {
                    (Some(k), 0) => drop(inputs.remove(k)),
                    (Some(k), 1) => inputs.push(inputs[k].clone()),
                    (Some(k), _) => inputs[k] = from,
                    (None, _) => {}
                }
            }
            3 => {
                let small: Vec<usize> = (0..g.initializer.len())
                    .filter(|&k| {
                        matches!(g.initializer[k].data_type, Some(6 | 7))
                            && g.initializer[k].dims.iter().product::<i64>() <= 16
                    })
                    .collect();
                if let Some(k) = pick(rng, small.len()) {
                    set_small_int(rng, &mut g.initializer[small[k]]);
                }
            }
            4 => {
                if let Some(t) = pick(rng, g.initializer.len()).map(|k| &mut g.initializer[k]) {
                    match rng.below(2) {
                        0 => t.dims.reverse(),
                        _ => t.dims.push(1),
                    }
                }
            }
            _ => {
                let attrs = &mut g.node[n].attribute;
                if let Some(k) = pick(rng, attrs.len()) {
                    attrs.remove(k);
                }
            }
        }
    }
    *data = model.encode_to_vec();
}

fn pick(rng: &mut Rng, len: usize) -> Option<usize> {
    (len > 0).then(|| rng.below(len))
}

fn edge_int(rng: &mut Rng) -> i64 {
    [0, 1, -1, 2, -2, 3, 7, 1 << 31, -(1 << 31), i64::MAX, i64::MIN][rng.below(11)]
}

/// One element of an INT64 or INT32 tensor (raw or typed) set to an edge value.
fn set_small_int(rng: &mut Rng, t: &mut TensorProto) {
    let v = edge_int(rng);
    match (t.data_type, t.raw_data.as_mut()) {
        (Some(7), Some(raw)) if raw.len() >= 8 => {
            let k = rng.below(raw.len() / 8) * 8;
            raw[k..k + 8].copy_from_slice(&v.to_le_bytes());
        }
        (Some(6), Some(raw)) if raw.len() >= 4 => {
            let k = rng.below(raw.len() / 4) * 4;
            raw[k..k + 4].copy_from_slice(&(v as i32).to_le_bytes());
        }
        _ => {
            if let Some(k) = pick(rng, t.int64_data.len()) {
                t.int64_data[k] = v;
            } else if let Some(k) = pick(rng, t.int32_data.len()) {
                t.int32_data[k] = v as i32;
            }
        }
    }
}

/// A run of ASCII digits (in a configuration or a manifest) replaced by an extreme number.
fn replace_a_number(rng: &mut Rng, data: &mut Vec<u8>) {
    let starts: Vec<usize> =
        (0..data.len()).filter(|&i| data[i].is_ascii_digit() && (i == 0 || !data[i - 1].is_ascii_digit())).collect();
    if starts.is_empty() {
        return;
    }
    let start = starts[rng.below(starts.len())];
    let end = (start..data.len()).find(|&i| !data[i].is_ascii_digit()).unwrap_or(data.len());
    let extreme = ["0", "-1", "4294967296", "18446744073709551616", "1e400", ".nan", "-.inf", "999999999999"];
    data.splice(start..end, extreme[rng.below(extreme.len())].bytes());
}

/// Runs `read` on `input` in a thread of its own; a panic or a read past `TIMEOUT` saves the
/// input and fails with where it is.
fn check(target: &str, read: Reader, dir: &Path, input: Vec<u8>) {
    // An abort (an allocation the machine cannot make) ends the process before any report:
    // the input being read is kept here until the next one replaces it.
    let saved = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("../fuzz").join(target);
    std::fs::create_dir_all(&saved).unwrap();
    std::fs::write(saved.join("current"), &input).unwrap();
    let (done, finished) = mpsc::channel();
    let (dir_for_read, kept) = (dir.to_path_buf(), input.clone());
    let reader = std::thread::spawn(move || {
        read(&dir_for_read, &kept);
        let _ = done.send(());
    });
    let outcome = match finished.recv_timeout(TIMEOUT) {
        Ok(()) => reader.join().map_err(|_| "panicked".to_string()),
        Err(mpsc::RecvTimeoutError::Timeout) => Err(format!("took longer than {TIMEOUT:?}")),
        Err(mpsc::RecvTimeoutError::Disconnected) => Err("panicked".to_string()),
    };
    if let Err(what) = outcome {
        let file = saved.join(checkpoint::checksum(&input));
        std::fs::write(&file, &input).unwrap();
        panic!(
            "fuzz {target}: the reader {what} on the input saved as {} (commit it under \
             worker/tests/data/fuzz/{target}/ with the fix)",
            file.display()
        );
    }
}

/// Replays the committed inputs of `target`, then runs its mutated seeds: `ROUNDS` of them from
/// the fixed seed, or for TENSORFLEET_FUZZ_SECONDS from the clock's.
fn fuzz(target: &str, read: Reader, seeds: &[&[u8]]) {
    fuzz_rounds(target, read, seeds, ROUNDS, mutate);
}

/// A mutation of an input in place.
type Mutator = fn(&mut Rng, &mut Vec<u8>);

fn fuzz_rounds(target: &str, read: Reader, seeds: &[&[u8]], rounds: usize, mutator: Mutator) {
    let dir = common::scratch(&format!("fuzz-{target}"));
    let committed = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/fuzz").join(target);
    let mut replayed = 0;
    for entry in std::fs::read_dir(&committed).into_iter().flatten() {
        check(target, read, &dir, std::fs::read(entry.unwrap().path()).unwrap());
        replayed += 1;
    }
    for seed in seeds {
        check(target, read, &dir, seed.to_vec());
    }
    let seconds: Option<u64> = std::env::var("TENSORFLEET_FUZZ_SECONDS").ok().map(|s| s.parse().expect("seconds"));
    let start = Instant::now();
    let rng_seed = match seconds {
        Some(_) => std::time::UNIX_EPOCH.elapsed().unwrap().as_nanos() as u64,
        None => FIXED_SEED,
    };
    eprintln!("fuzz {target}: seed {rng_seed:#x}");
    let mut rng = Rng::new(rng_seed);
    let mut runs = 0;
    while match seconds {
        Some(s) => start.elapsed() < Duration::from_secs(s),
        None => runs < rounds,
    } {
        let mut input = seeds[rng.below(seeds.len())].to_vec();
        mutator(&mut rng, &mut input);
        check(target, read, &dir, input);
        runs += 1;
    }
    eprintln!(
        "\nfuzz {target}: {runs} mutated inputs in {:.1} s (seed {rng_seed:#x}), {replayed} committed replayed: no failure",
        start.elapsed().as_secs_f64()
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn fuzz_token_shards() {
    fuzz("tokens", tokens, &[&seeds().tokens]);
}

#[test]
fn fuzz_sample_shards() {
    fuzz("samples", samples, &[&seeds().samples]);
}

#[test]
fn fuzz_checkpoint_manifests() {
    let manifest_text = std::fs::read(seeds().checkpoint.join("manifest.json")).unwrap();
    let with_sum =
        [&manifest_text[..], b"\0", &std::fs::read(seeds().checkpoint.join("manifest.sum")).unwrap()].concat();
    fuzz("manifest", manifest, &[&manifest_text, &with_sum]);
}

#[test]
fn fuzz_safetensors() {
    fuzz("safetensors", safetensors, &[&seeds().rank_file]);
}

#[test]
fn fuzz_onnx_models() {
    fuzz("onnx", onnx, &[&seeds().model]);
}

/// The training graph's build (binding, autodiff, the fusions) from mutated exports: the seeds
/// must build whole, or the target would fuzz no more than the loader.
fn fuzz_training_graph(target: &str, read: Reader, data: &str, files: &[&str]) {
    let seeds: Vec<Vec<u8>> = files.iter().map(|f| read_fixture(f)).collect();
    let dir = common::scratch(&format!("fuzz-{target}-seeds"));
    for (file, seed) in files.iter().zip(&seeds) {
        build_training_graph(&dir, seed, data).unwrap_or_else(|e| panic!("seed {file}: {e}"));
    }
    fuzz_rounds(target, read, &seeds.iter().map(Vec::as_slice).collect::<Vec<_>>(), GRAPH_ROUNDS, mutate_model);
}

#[test]
fn fuzz_transformer_training_graphs() {
    let files =
        ["gpt2_dynamo", "gpt2_torchscript", "llama_dynamo", "llama_torchscript"].map(|m| format!("torch_hf/{m}.onnx"));
    fuzz_training_graph("training", training_transformers, "torch_hf/gpt2.pb", &files.each_ref().map(String::as_str));
}

#[test]
fn fuzz_cnn_training_graphs() {
    let files = ["resnet18_dynamo", "resnet18_torchscript"].map(|m| format!("torch_cnn/{m}.onnx"));
    fuzz_training_graph("training_cnn", training_cnn, "torch_cnn/batches.pb", &files.each_ref().map(String::as_str));
}

#[test]
fn fuzz_configurations() {
    fuzz("config", config, &[&seeds().config]);
}

#[test]
fn fuzz_json_lines_documents() {
    fuzz("jsonl", json_lines, &[&read_fixture("hf_tokenizers/docs.jsonl")]);
}

#[test]
fn fuzz_parquet_documents() {
    let seeds = ["docs_snappy.parquet", "docs_zstd.parquet", "docs_null.parquet"]
        .map(|f| read_fixture(&format!("hf_tokenizers/{f}")));
    fuzz("parquet", parquet, &seeds.each_ref().map(Vec::as_slice));
}

#[test]
fn fuzz_tokenizers() {
    let seeds = ["gpt2_style.json", "bert_style.json"].map(|f| read_fixture(&format!("hf_tokenizers/{f}")));
    fuzz("tokenizer", tokenizer, &seeds.each_ref().map(Vec::as_slice));
}

#[test]
fn fuzz_images() {
    let seeds = ["ant/a_rgb.png", "Bird/d_palette.png", "Bird/e_photo.jpg"]
        .map(|f| read_fixture(&format!("torch_images/folder/{f}")));
    fuzz("images", images, &seeds.each_ref().map(Vec::as_slice));
}
