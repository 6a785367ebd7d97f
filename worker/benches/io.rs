//! Checkpoint and data-loading throughput, each next to a plain reader or writer of the same
//! bytes on the same directory, measured in the same run.
//!
//!     TENSORFLEET_BENCH_PYTHON=.venv-bench/bin/python cargo bench -p tensorfleet-worker --bench io
//!
//! - Checkpoints: `checkpoint::save` and `checkpoint::load` of GPT-2 124M's training state
//!   (weights and AdamW's two moments, 1.49 GB), next to the disk's own rate: a plain write of
//!   as many bytes with fsync, and a plain read of them. Loads and the disk's cold reads start
//!   with the files dropped from the page cache, so they come from the disk; a page-cache read
//!   is measured too.
//! - Token shards: the loader (`data::open`, 8×1024 batches, shuffle on) over shards of
//!   prepare-data's size written by `data::tokens::write_shard`, next to a raw read of the same
//!   bytes and a NumPy memmap sampler (benches/io_peer.py, run with $TENSORFLEET_BENCH_PYTHON;
//!   skipped without it). The shards are in the page cache, as they are once a run has read them.
//! - Sample shards: opening the ONNX sample-shard loader (reading and parsing every shard, from
//!   the disk) and its batches of 32 3×224×224 images, next to a cold raw read of the same bytes;
//!   and a step that waits for the device and then takes its batch, the batches read inline
//!   next to read ahead as training reads them.
//!
//! Files go under $TENSORFLEET_BENCH_IO_DIR (point it at the disk checkpoints will live on),
//! else under target/, and are removed afterwards. Figures go to the `io` section of
//! target/bench-summary.json. `cargo test --benches` runs every benchmark once on small files.

mod common;

use common::{round, run_peer, Samples, WorkDir, PYTHON_VAR};
use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, SamplingMode, Throughput};
use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use tensorfleet_worker::checkpoint;
use tensorfleet_worker::checkpoint::keys::OPTIMIZER_PREFIX;
use tensorfleet_worker::config::{DataFormat, DataSource, Gpt2Config, ModelSpec, TrainingConfig};
use tensorfleet_worker::data::prefetch::Prefetched;
use tensorfleet_worker::data::{self, Batching, Feeds, Loader, Partition, Position};
use tensorfleet_worker::models;
use tensorfleet_worker::rng::mix;
use tensorfleet_worker::tensor::{DType, Tensor};

const SAMPLE_SIZE: usize = 10;
const DIR_VAR: &str = "TENSORFLEET_BENCH_IO_DIR";
/// Rates are in decimal megabytes, as disks are sold and `dd` reports them.
const MB: f64 = 1e6;
/// Reads of the plain peers go through a buffer this large: big enough that the syscalls cost
/// nothing next to the copy, small enough to stay in the L2/L3 cache.
const READ_CHUNK: usize = 8 << 20;
const FEEDS: (&str, &str) = ("input_ids", "labels");
/// How long a step keeps the host waiting for the device in the sample-step bench: a quarter
/// of tensorfleet's ResNet-50 step of 128 images on the H200 (362.9 ms), for a batch of 32.
const DEVICE_WAIT: Duration = Duration::from_millis(90);

/// What the bench writes and reads: full size when measuring, small enough otherwise that
/// `cargo test --benches` takes a second.
struct Sizes {
    /// The model whose training state is checkpointed.
    gpt2: Gpt2Config,
    /// Tokens per token shard, and how many shards.
    shard_tokens: usize,
    token_shards: usize,
    /// Sequences per token batch, and their length.
    batch: usize,
    seq: usize,
    sample_shards: usize,
    samples_per_shard: usize,
    /// Images are f32 [3, image, image].
    image: usize,
    sample_batch: usize,
    /// Seconds NumPy's samplers run each.
    peer_seconds: f64,
}

fn sizes(measuring: bool) -> Sizes {
    if measuring {
        Sizes {
            // GPT-2 small, 124M weights: the model llm.c and nanoGPT reproduce.
            gpt2: Gpt2Config { layers: 12, heads: 12, embed: 768, seq_len: 1024, vocab: 50257, ..Default::default() },
            // prepare-data's shard size (prepare::SHARD_TOKENS, llm.c's too: 200 MB a shard).
            // Two shards is the least that shows what crossing shards costs.
            shard_tokens: 100_000_000,
            token_shards: 2,
            batch: 8,
            seq: 1024,
            // 512 ImageNet-sized images (308 MB) in 4 shards, as ONNX Runtime's tools split them.
            sample_shards: 4,
            samples_per_shard: 128,
            image: 224,
            sample_batch: 32,
            peer_seconds: 2.0,
        }
    } else {
        Sizes {
            gpt2: Gpt2Config { layers: 1, heads: 2, embed: 32, seq_len: 32, vocab: 512, ..Default::default() },
            shard_tokens: 20_000,
            token_shards: 2,
            batch: 2,
            seq: 64,
            sample_shards: 2,
            samples_per_shard: 4,
            image: 8,
            sample_batch: 2,
            peer_seconds: 0.1,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The directory and the page cache

/// The filesystem `dir` is on, from /proc/self/mounts: "ext4 on /dev/vda".
fn filesystem(dir: &Path) -> Option<String> {
    let dir = dir.canonicalize().ok()?;
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 3 && dir.starts_with(f[1])).then(|| (f[1].len(), format!("{} on {}", f[2], f[0])))
        })
        .max()
        .map(|(_, fs)| fs)
}

/// Drops `path`'s pages from the page cache, so that the next read comes from the disk. Per
/// file, so it needs no root (unlike /proc/sys/vm/drop_caches) and leaves the rest of the
/// machine's cache alone. Dirty pages cannot be dropped, hence the fsync first.
#[cfg(target_os = "linux")]
fn evict(path: &Path) {
    use std::os::fd::AsRawFd;
    let f = File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    f.sync_all().unwrap_or_else(|e| panic!("fsync {}: {e}", path.display()));
    // SAFETY: the descriptor is open for the whole call, which reads no memory of ours.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0, "posix_fadvise(DONTNEED) on {}: {}", path.display(), std::io::Error::from_raw_os_error(rc));
}

/// Elsewhere there is no per-file way: "cold" reads are page-cache reads there, and the
/// summary says so (`cold_reads_from_disk`).
#[cfg(not(target_os = "linux"))]
fn evict(_path: &Path) {}

const EVICTS: bool = cfg!(target_os = "linux");

fn evict_all(paths: &[PathBuf]) {
    paths.iter().for_each(|p| evict(p));
}

/// The plain reader: every byte of `paths`, in order, through one reused buffer. Returns the
/// bytes read.
fn read_plain(paths: &[PathBuf], buf: &mut [u8]) -> usize {
    let mut total = 0;
    for p in paths {
        let mut f = File::open(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        loop {
            let n = f.read(buf).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()));
            if n == 0 {
                break;
            }
            total += n;
        }
    }
    total
}

/// The plain writer: `bytes` to a new file (replacing the last one, whose blocks the
/// filesystem frees as a checkpoint's pruning frees its predecessor's), then fsync.
fn write_plain(path: &Path, bytes: &[u8]) {
    let mut f = File::create(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    f.write_all(bytes).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    f.sync_all().unwrap_or_else(|e| panic!("fsync {}: {e}", path.display()));
}

fn files_with(dir: &Path, ext: &str) -> Vec<PathBuf> {
    data::shard_files(dir, ext, "io bench").unwrap_or_else(|e| panic!("{e}"))
}

// ---------------------------------------------------------------------------------------------
// Checkpoints

/// GPT-2's training state as `Session::state` lays it out: every weight, AdamW's two moments of
/// each under `optimizer/<name>/<k>`, and the step. The moments are copies of the weights: their
/// sizes matter to I/O, their values do not.
fn training_state(cfg: &Gpt2Config) -> BTreeMap<String, Tensor> {
    let model = models::load(&ModelSpec { gpt2: Some(cfg.clone()), ..Default::default() }, 0).expect("GPT-2 builds");
    let g = &model.graph;
    let mut state = BTreeMap::new();
    for (&id, t) in g.initializers.iter().filter(|(_, t)| t.dtype() == DType::F32) {
        let name = g.name_of(id);
        for k in 0..2 {
            state.insert(format!("{OPTIMIZER_PREFIX}{name}/{k}"), t.clone());
        }
        state.insert(name.to_string(), t.clone());
    }
    state.insert(format!("{OPTIMIZER_PREFIX}step"), Tensor::from_vec(&[1], vec![1000i64]));
    state
}

/// The configuration a checkpoint's manifest carries: the one that trains this GPT-2.
fn training_config(g: &Gpt2Config, data: &Path) -> TrainingConfig {
    let yaml = format!(
        "model: {{gpt2: {{layers: {}, heads: {}, embed: {}, seqLen: {}, vocab: {}}}}}\n\
         data: {{train: {{path: '{}', format: tokens}}}}\nbatchSize: 8\nsteps: 1000\n",
        g.layers,
        g.heads,
        g.embed,
        g.seq_len,
        g.vocab,
        data.display()
    );
    TrainingConfig::parse(&yaml, "io bench", &[]).unwrap_or_else(|e| panic!("the bench's configuration: {e}"))
}

fn state_bytes(state: &BTreeMap<String, Tensor>) -> usize {
    state.values().map(Tensor::byte_len).sum()
}

/// `checkpoint::save` and `checkpoint::load` next to the disk's plain write and read.
fn bench_checkpoints(group: &mut BenchmarkGroup<WallTime>, dir: &Path, sizes: &Sizes) -> serde_json::Value {
    let ckpt_dir = dir.join("checkpoints");
    let plain = dir.join("plain.bin");
    let state = training_state(&sizes.gpt2);
    let cfg = training_config(&sizes.gpt2, &dir.join("tokens"));
    // One process: the world is this rank alone.
    let alone = tensorfleet_worker::comm::World::solo().world_group();
    // The bytes `save` writes, for the plain peer to write as many.
    let encoded = checkpoint::safetensors::encode(&state);
    let bytes = encoded.len();
    println!(
        "checkpoint: {} tensors, {:.1} MB of tensors, {:.1} MB as safetensors, in {}",
        state.len(),
        state_bytes(&state) as f64 / MB,
        bytes as f64 / MB,
        dir.display()
    );
    // One iteration per sample: each moves 1.5 GB, and 10 of them are enough for a median.
    group.warm_up_time(Duration::from_millis(1)).measurement_time(Duration::from_secs(1));
    group.throughput(Throughput::Bytes(bytes as u64));

    let mut step = 0u64;
    let mut latest: Option<PathBuf> = None;
    let mut save = Samples::default();
    group.bench_function("checkpoint_save", |b| {
        save.iter(b, || {
            step += 1;
            let path =
                checkpoint::save(&ckpt_dir, step, Position::default(), &cfg, &state, &Default::default(), 1, &alone)
                    .expect("save");
            latest = Some(path);
        })
    });
    let mut write = Samples::default();
    group.bench_function("disk_write_fsync", |b| write.iter(b, || write_plain(&plain, &encoded)));
    drop(encoded);

    // When the save benchmark was filtered out, the load benchmark still needs a checkpoint.
    let latest = latest.unwrap_or_else(|| {
        checkpoint::save(&ckpt_dir, 1, Position::default(), &cfg, &state, &Default::default(), 1, &alone)
            .expect("save for the load benchmark")
    });
    let ckpt_files: Vec<PathBuf> = ["manifest.json", "rank_0.safetensors"].iter().map(|f| latest.join(f)).collect();
    if !plain.exists() {
        write_plain(&plain, &checkpoint::safetensors::encode(&state));
    }
    let mut load = Samples::default();
    group.bench_function("checkpoint_load_cold", |b| {
        load.iter_with_setup(b, || evict_all(&ckpt_files), || checkpoint::load(&latest).expect("load"))
    });
    let mut buf = vec![0u8; READ_CHUNK];
    let plain_files = [plain.clone()];
    let mut read_cold = Samples::default();
    group.bench_function("disk_read_cold", |b| {
        read_cold.iter_with_setup(b, || evict_all(&plain_files), || read_plain(&plain_files, &mut buf))
    });
    let mut read_cached = Samples::default();
    read_plain(&plain_files, &mut buf); // into the page cache
    group.bench_function("page_cache_read", |b| {
        read_cached.iter_with_setup(b, || (), || read_plain(&plain_files, &mut buf))
    });

    if !common::measuring() {
        return serde_json::Value::Null; // `cargo test --benches`: one run each, no figures
    }
    // Where a save's and a load's time goes besides the disk: one pass of each step, outside
    // criterion (a rough split, not a figure to compare).
    let t = Instant::now();
    let encoded = checkpoint::safetensors::encode(&state);
    let encode_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    std::hint::black_box(checkpoint::checksum(&encoded));
    let checksum_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let decoded = checkpoint::safetensors::decode(&encoded).expect("decode");
    let decode_s = t.elapsed().as_secs_f64();
    drop((decoded, encoded));

    let rate = |s: &Samples| s.median_s(SAMPLE_SIZE).map(|secs| bytes as f64 / secs / MB);
    let (save_mb_s, write_mb_s, load_mb_s, cold_mb_s, cached_mb_s) =
        (rate(&save), rate(&write), rate(&load), rate(&read_cold), rate(&read_cached));
    let share = |a: Option<f64>, b: Option<f64>| Some(round(100.0 * a? / b?, 1));
    let r1 = |x: Option<f64>| x.map(|x| round(x, 1));
    println!("\nCheckpoint of GPT-2 124M's training state ({:.1} MB), median of {SAMPLE_SIZE}:", bytes as f64 / MB);
    let line = |what: &str, x: Option<f64>| {
        if let Some(x) = x {
            println!("  {what:<44} {x:>8.1} MB/s");
        }
    };
    line("checkpoint::save (encode, checksum, fsync)", save_mb_s);
    line("disk: plain write + fsync", write_mb_s);
    line("checkpoint::load (cold: from the disk)", load_mb_s);
    line("disk: plain read (cold: from the disk)", cold_mb_s);
    line("page cache: plain read", cached_mb_s);
    println!(
        "  one pass each: encode {encode_s:.2} s, checksum {checksum_s:.2} s ({:.0} MB/s), decode {decode_s:.2} s",
        bytes as f64 / checksum_s / MB
    );
    serde_json::json!({
        "state": "GPT-2 124M (12 layers, embed 768, seq 1024, vocab 50257): weights + AdamW m and v, fp32",
        "gpt2": { "layers": sizes.gpt2.layers, "embed": sizes.gpt2.embed, "vocab": sizes.gpt2.vocab },
        "tensors": state.len(),
        "bytes": bytes,
        "save_mb_s": r1(save_mb_s),
        "disk_write_fsync_mb_s": r1(write_mb_s),
        "save_percent_of_disk": share(save_mb_s, write_mb_s),
        "load_cold_mb_s": r1(load_mb_s),
        "disk_read_cold_mb_s": r1(cold_mb_s),
        "load_percent_of_disk": share(load_mb_s, cold_mb_s),
        "page_cache_read_mb_s": r1(cached_mb_s),
        "one_pass_s": {
            "encode": round(encode_s, 3), "checksum": round(checksum_s, 3), "decode": round(decode_s, 3),
        },
    })
}

// ---------------------------------------------------------------------------------------------
// Token shards

/// Pseudo-random GPT-2 token ids: a shard's content does not change how fast it reads, but a
/// constant one might compress somewhere along the way.
fn tokens(shard: usize, n: usize) -> Vec<u16> {
    (0..n).map(|i| (mix(((shard as u64) << 40) ^ i as u64) % 50257) as u16).collect()
}

fn source(path: &Path, format: DataFormat) -> DataSource {
    DataSource { path: path.to_path_buf(), format }
}

fn batching(batch: usize, seq_len: usize) -> Batching {
    Batching { batch, seq_len, shuffle: true, seed: 1, partition: Partition::WHOLE }
}

/// The NumPy peer's JSON, or why there is none.
fn numpy_peer(python: Option<&OsStr>, shards: &[PathBuf], sizes: &Sizes) -> Result<serde_json::Value, String> {
    let python = python.ok_or(format!("{PYTHON_VAR} not set"))?;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/io_peer.py");
    println!("NumPy peer: {} {script}", python.to_string_lossy());
    let mut cmd = Command::new(python);
    cmd.arg(script)
        .args(["--batch", &sizes.batch.to_string(), "--seq", &sizes.seq.to_string()])
        .args(["--seconds", &sizes.peer_seconds.to_string()])
        .args(shards);
    run_peer(cmd, script)
}

/// A token loader's run: its mean rate, and every batch's seconds.
struct TokenRun {
    name: &'static str,
    tokens_per_s: f64,
    batch_s: Vec<f64>,
}

impl TokenRun {
    /// The batches slower than 10 ms: a batch's window is 16 KB and takes microseconds, so
    /// these did more, such as reading a whole 200 MB shard (as the loader did before it read
    /// windows with positioned reads: 26 of 47 batches over two shards).
    fn slow(&self) -> Vec<f64> {
        self.batch_s.iter().copied().filter(|&s| s > 0.01).collect()
    }
}

fn median(v: &[f64]) -> Option<f64> {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    (!v.is_empty()).then(|| v[v.len() / 2])
}

/// The token loader over one shard and over all of them, next to a raw read and NumPy.
fn bench_tokens(group: &mut BenchmarkGroup<WallTime>, dir: &Path, sizes: &Sizes) -> serde_json::Value {
    let shard_dir = dir.join("tokens");
    std::fs::create_dir_all(&shard_dir).expect("token shard directory");
    for s in 0..sizes.token_shards {
        let path = shard_dir.join(format!("train_{s:06}.bin"));
        data::tokens::write_shard(&path, &tokens(s, sizes.shard_tokens)).expect("writing a token shard");
    }
    let shards = files_with(&shard_dir, "bin");
    let bytes: usize = shards.iter().map(|p| p.metadata().map_or(0, |m| m.len() as usize)).sum();
    let per_batch = sizes.batch * sizes.seq;
    let feeds = Feeds { token_input: FEEDS.0.into(), token_label: FEEDS.1.into(), vocab: None };
    // Many batches per sample, and the mean over all of them: the rate of a loader whose
    // batches differ (one that now and then reads more than a window) is its rate over many.
    group.warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(6));
    group.throughput(Throughput::Elements(per_batch as u64));

    let mut runs = Vec::new();
    for (name, path) in [("tokens_one_shard", &shards[0]), ("tokens_all_shards", &shard_dir)] {
        let mut loader: Option<Box<dyn Loader>> = None;
        let mut samples = Samples::default();
        // Every batch's time, warm-up included, to show slow batches apart.
        let mut each = Vec::new();
        group.bench_function(name, |b| {
            let l = loader.get_or_insert_with(|| {
                data::open(&source(path, DataFormat::Tokens), "io bench", batching(sizes.batch, sizes.seq), &feeds)
                    .expect("token loader opens")
            });
            samples.iter_with_setup(
                b,
                || (),
                || {
                    let t = Instant::now();
                    let batch = l.next_batch().expect("a token batch");
                    each.push(t.elapsed().as_secs_f64());
                    batch
                },
            )
        });
        if let Some(secs) = samples.mean_s(SAMPLE_SIZE) {
            runs.push(TokenRun { name, tokens_per_s: per_batch as f64 / secs, batch_s: each });
        }
    }

    group.warm_up_time(Duration::from_millis(200)).measurement_time(Duration::from_secs(2));
    group.throughput(Throughput::Bytes(bytes as u64));
    let mut buf = vec![0u8; READ_CHUNK];
    read_plain(&shards, &mut buf); // into the page cache, where the loaders found them
    let mut raw = Samples::default();
    group.bench_function("tokens_raw_read_cached", |b| raw.iter_with_setup(b, || (), || read_plain(&shards, &mut buf)));
    let raw_mb_s = raw.median_s(SAMPLE_SIZE).map(|s| bytes as f64 / s / MB);

    if !common::measuring() {
        return serde_json::Value::Null;
    }
    let peer = numpy_peer(std::env::var_os(PYTHON_VAR).as_deref(), &shards, sizes);
    println!(
        "\nToken shards: {} × {} tokens ({:.1} MB), batches of {}×{}, shuffle on, from the page cache:",
        sizes.token_shards,
        sizes.shard_tokens,
        bytes as f64 / MB,
        sizes.batch,
        sizes.seq
    );
    for r in &runs {
        println!("  {:<44} {:>14.0} tokens/s (mean)", r.name, r.tokens_per_s);
        let slow = r.slow();
        print!("    {} batches, median {:.1} µs", r.batch_s.len(), median(&r.batch_s).unwrap_or(f64::NAN) * 1e6);
        match median(&slow) {
            Some(m) => println!("; {} of them over 10 ms (median {m:.3} s)", slow.len()),
            None => println!("; none over 10 ms"),
        }
    }
    if let Some(mb_s) = raw_mb_s {
        // u16 tokens: two bytes each.
        println!("  {:<44} {:>14.0} tokens/s ({mb_s:.1} MB/s)", "raw read of the shards", mb_s * MB / 2.0);
    }
    let mut out = serde_json::json!({
        "shards": sizes.token_shards,
        "shard_tokens": sizes.shard_tokens,
        "bytes": bytes,
        "batch": sizes.batch,
        "seq": sizes.seq,
        "shuffle": true,
        "from": "page cache",
        "raw_read_mb_s": raw_mb_s.map(|x| round(x, 1)),
        "raw_read_tokens_per_s": raw_mb_s.map(|x| round(x * MB / 2.0, 0)),
    });
    for r in &runs {
        let slow = r.slow();
        out[r.name] = serde_json::json!({
            "tokens_per_s": round(r.tokens_per_s, 0),
            "batches": r.batch_s.len(),
            "batch_median_us": median(&r.batch_s).map(|x| round(x * 1e6, 2)),
            "batches_over_10ms": slow.len(),
            "batch_over_10ms_median_s": median(&slow).map(|x| round(x, 4)),
        });
    }
    match peer {
        Ok(v) => {
            for (k, what) in
                [("windows", "NumPy memmap, the same windows"), ("nanogpt", "NumPy memmap, nanoGPT's get_batch")]
            {
                if let Some(x) = v[format!("{k}_tokens_per_s")].as_f64() {
                    println!("  {what:<44} {x:>14.0} tokens/s");
                }
            }
            out["numpy"] = v;
        }
        Err(why) => {
            println!("NumPy peer: skipped ({why})");
            out["numpy"] = serde_json::json!({ "skipped": why });
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Sample shards

/// One image-classification sample: `image` f32 [3, s, s] of pseudo-random pixels, `labels` i64.
fn image_sample(i: usize, s: usize) -> Vec<(String, Tensor)> {
    let pixels: Vec<f32> =
        (0..3 * s * s).map(|j| (mix(((i as u64) << 32) ^ j as u64) >> 40) as f32 / 16_777_216.0).collect();
    vec![
        ("image".to_string(), Tensor::from_vec(&[3, s, s], pixels)),
        ("labels".to_string(), Tensor::from_vec(&[], vec![(i % 1000) as i64])),
    ]
}

/// Opening the sample loader (from the disk) and its batches, next to a cold raw read.
fn bench_samples(group: &mut BenchmarkGroup<WallTime>, dir: &Path, sizes: &Sizes) -> serde_json::Value {
    let shard_dir = dir.join("samples");
    std::fs::create_dir_all(&shard_dir).expect("sample shard directory");
    for s in 0..sizes.sample_shards {
        let samples: Vec<_> =
            (0..sizes.samples_per_shard).map(|i| image_sample(s * sizes.samples_per_shard + i, sizes.image)).collect();
        data::samples::write_shard(&shard_dir.join(format!("part_{s:04}.pb")), &samples)
            .expect("writing a sample shard");
    }
    let shards = files_with(&shard_dir, "pb");
    let bytes: usize = shards.iter().map(|p| p.metadata().map_or(0, |m| m.len() as usize)).sum();
    let count = sizes.sample_shards * sizes.samples_per_shard;
    let src = source(&shard_dir, DataFormat::OnnxSamples);
    let feeds = Feeds { token_input: FEEDS.0.into(), token_label: FEEDS.1.into(), vocab: None };
    let open = || data::open(&src, "io bench", batching(sizes.sample_batch, 0), &feeds).expect("sample loader opens");

    group.warm_up_time(Duration::from_millis(1)).measurement_time(Duration::from_secs(1));
    group.throughput(Throughput::Elements(count as u64));
    let mut opened = Samples::default();
    group.bench_function("samples_open_cold", |b| opened.iter_with_setup(b, || evict_all(&shards), open));
    group.throughput(Throughput::Bytes(bytes as u64));
    let mut buf = vec![0u8; READ_CHUNK];
    let mut raw = Samples::default();
    group.bench_function("samples_raw_read_cold", |b| {
        raw.iter_with_setup(b, || evict_all(&shards), || read_plain(&shards, &mut buf))
    });

    group.warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    group.throughput(Throughput::Elements(sizes.sample_batch as u64));
    let mut loader: Option<Box<dyn Loader>> = None;
    let mut batches = Samples::default();
    group.bench_function("samples_batch", |b| {
        let l = loader.get_or_insert_with(open);
        batches.iter_with_setup(b, || (), || l.next_batch().expect("a sample batch"))
    });
    drop(loader);
    let steps = bench_sample_steps(group, &open, sizes);

    if !common::measuring() {
        return serde_json::Value::Null;
    }
    let open_per_s = opened.median_s(SAMPLE_SIZE).map(|s| count as f64 / s);
    let raw_mb_s = raw.median_s(SAMPLE_SIZE).map(|s| bytes as f64 / s / MB);
    let batch_per_s = batches.mean_s(SAMPLE_SIZE).map(|s| sizes.sample_batch as f64 / s);
    let per_sample = bytes as f64 / count as f64;
    println!(
        "\nSample shards: {count} samples of f32 [3, {s}, {s}] + i64 label in {} shards ({:.1} MB):",
        sizes.sample_shards,
        bytes as f64 / MB,
        s = sizes.image
    );
    if let Some(x) = open_per_s {
        println!("  {:<44} {x:>10.0} samples/s ({:.1} MB/s)", "open: read + parse (cold)", x * per_sample / MB);
    }
    if let Some(x) = raw_mb_s {
        println!("  {:<44} {:>10.0} samples/s ({x:.1} MB/s)", "raw read of the shards (cold)", x * MB / per_sample);
    }
    if let Some(x) = batch_per_s {
        println!("  {:<44} {x:>10.0} samples/s (mean)", format!("batches of {} (in memory)", sizes.sample_batch));
    }
    let wait_ms = DEVICE_WAIT.as_secs_f64() * 1e3;
    for (name, secs) in &steps {
        if let Some(s) = secs {
            println!("  {:<44} {:>10.1} ms (mean)", format!("a step of {wait_ms:.0} ms + its batch, {name}"), s * 1e3);
        }
    }
    serde_json::json!({
        "samples": count,
        "shards": sizes.sample_shards,
        "image": [3, sizes.image, sizes.image],
        "bytes": bytes,
        "batch": sizes.sample_batch,
        "open_cold_samples_per_s": open_per_s.map(|x| round(x, 1)),
        "open_cold_mb_s": open_per_s.map(|x| round(x * per_sample / MB, 1)),
        "raw_read_cold_mb_s": raw_mb_s.map(|x| round(x, 1)),
        "raw_read_cold_samples_per_s": raw_mb_s.map(|x| round(x * MB / per_sample, 1)),
        "batch_samples_per_s": batch_per_s.map(|x| round(x, 1)),
        "step_device_wait_ms": wait_ms,
        "step_ms": steps.iter().map(|(name, s)| (name.to_string(), s.map(|s| round(s * 1e3, 2)))).collect::<BTreeMap<_, _>>(),
    })
}

/// What a training step sees of the loader: the host waits `DEVICE_WAIT` for the device (a
/// sleep here), then takes its next batch. Read inline, the batch's stacking adds to every
/// step; read ahead (`Prefetched`, as training reads), it happens during the wait. Mean
/// seconds a step, by how the batches are read.
fn bench_sample_steps(
    group: &mut BenchmarkGroup<WallTime>,
    open: &dyn Fn() -> Box<dyn Loader>,
    sizes: &Sizes,
) -> Vec<(&'static str, Option<f64>)> {
    group.throughput(Throughput::Elements(sizes.sample_batch as u64));
    let mut steps = Vec::new();
    for (name, ahead) in [("inline", false), ("read ahead", true)] {
        let mut loader: Option<Box<dyn Loader>> = None;
        let mut samples = Samples::default();
        group.bench_function(format!("samples_step_{}", name.replace(' ', "_")), |b| {
            let l = loader.get_or_insert_with(|| match ahead {
                true => Box::new(Prefetched::new(open(), "io bench")),
                false => open(),
            });
            samples.iter_with_setup(
                b,
                || (),
                || {
                    std::thread::sleep(DEVICE_WAIT);
                    l.next_batch().expect("a sample batch")
                },
            )
        });
        steps.push((name, samples.mean_s(SAMPLE_SIZE)));
    }
    steps
}

fn main() {
    let measuring = common::measuring();
    let load_before = common::load_avg_1m();
    let sizes = sizes(measuring);
    let dir = WorkDir::create("io", std::env::var_os(DIR_VAR).map(PathBuf::from))
        .unwrap_or_else(|e| panic!("{e} ({DIR_VAR})"));
    let mut c = Criterion::default().configure_from_args();
    let mut group = c.benchmark_group("io");
    group.sample_size(SAMPLE_SIZE).sampling_mode(SamplingMode::Flat);
    let started = Instant::now();
    let ckpt = bench_checkpoints(&mut group, &dir.0, &sizes);
    let tokens = bench_tokens(&mut group, &dir.0, &sizes);
    let samples = bench_samples(&mut group, &dir.0, &sizes);
    group.finish();
    c.final_summary();
    println!("io bench: {:.0} s", started.elapsed().as_secs_f64());
    if !measuring {
        return;
    }
    common::write_summary(
        "io",
        serde_json::json!({
            "date": common::today(),
            "command": "make bench",
            "load_avg_1m_before": load_before,
            "load_avg_1m_after": common::load_avg_1m(),
            "dir": dir.0.display().to_string(),
            "filesystem": filesystem(&dir.0),
            "cold_reads_from_disk": EVICTS,
            "page_cache_eviction": if EVICTS { "posix_fadvise(POSIX_FADV_DONTNEED) per file, after fsync" } else { "none" },
            "mb": "10^6 bytes",
            "samples": SAMPLE_SIZE,
            "checkpoint": ckpt,
            "tokens": tokens,
            "onnx_samples": samples,
        }),
    );
}
