//! The communication layer: all-reduce bandwidth through the collective interface next to raw
//! MPI on the same buffers, and what data parallelism adds to a training step, in one run.
//!
//!     cargo bench -p tensorfleet-worker --bench comm
//!
//! - `comm/allreduce`: the bench starts itself as 2 ranks under `mpirun` (the flag `RANKS`
//!   marks them), as the multi-process tests start mpirun. For f32 buffers of 4 KiB to 64 MiB,
//!   the ranks time `all_reduce(Sum)` on the data group of a dp=2 layout (`Collective<[f32]>` on
//!   an `MpiGroup`, the call the trainer makes for every gradient) and rsmpi's `all_reduce_into`
//!   (the MPI call underneath it, out of place) on the same receive buffer, taking turns. The
//!   peer is raw MPI: benches/allreduce_peer.c, compiled here with `mpicc -O2`, calls
//!   `MPI_Allreduce` with `MPI_IN_PLACE` under the same mpirun settings and the same protocol
//!   (check, warm-up, agreed iteration counts, barriers, the slowest rank's time). The peer and
//!   the ranks take turns, 4 launches each, so that neither side gains from going first or
//!   from a quiet moment of the machine. Criterion does not time this part: every rank must make
//!   the same number of calls, so the counts are agreed among the ranks rather than chosen by
//!   each one's clock.
//! - `comm/dp_step`: the worker binary trains GPT-2 as one process (batch 2B, 2 threads) and as
//!   2 data-parallel ranks under mpirun (batch B each, 1 thread each): the same global batch
//!   on the same two cores. A third setup runs 2 unconnected processes side by side (batch B,
//!   1 thread each): the ranks' work without the all-reduce. Each setup runs twice, in the
//!   order 1 2 3 3 2 1. The step times are from metrics.jsonl (`itemsPerSec` over the step's
//!   tokens), leaving out the first steps (warm-up) and the last two (see `Sizes`); side by
//!   side, the slower process's, since a data-parallel step waits for its slower rank:
//!   medians, time per sample and the overhead dp2/dp1 − 1. Every setup profiles its steps;
//!   rank 0's profile of a dp=2 run gives the trainer's all-reduces (their buckets, the time
//!   they take, how long after the backward pass the last one ends), next to what part 1's
//!   rates make of the same calls.
//!
//! mpirun, mpicc (OpenMPI: `make deps`) and the worker binary are needed. Figures go to the
//! `comm` section of target/bench-summary.json; files to target/bench-comm-<pid>/, removed
//! afterwards. `cargo test --benches` runs both parts on two small buffers and a 1-layer
//! model for 2 steps. A filter after `--` picks a part (`-- allreduce`).

mod common;
#[allow(dead_code)] // of the tests' helpers, the bench needs `mpirun` alone
#[path = "../tests/common/mod.rs"]
mod launch;

use common::{round, WorkDir};
use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;
use tensorfleet_worker::comm::{Collective, CommOptions, HostGroup, Layout, ProcessGroup, ReduceOp, World};
use tensorfleet_worker::config::Gpt2Config;
use tensorfleet_worker::models;
use tensorfleet_worker::rng::Rng;

const WORKER: &str = env!("CARGO_BIN_EXE_tensorfleet-worker");
const PEER_SOURCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/allreduce_peer.c");
/// The first argument of the ranks this bench starts under mpirun; then OUT SECONDS REPS BYTES...
const RANKS: &str = "--allreduce-ranks";
/// Ranks in both parts: one per core of the 2-core machine the figures come from.
const NP: usize = 2;
/// Rates are in decimal gigabytes, as nccl-tests and the OSU benchmarks report them.
const GB: f64 = 1e9;
/// The parts, as `--list` names them (`comm/<part>`) and a filter picks them.
const PARTS: [&str; 2] = ["allreduce", "dp_step"];

/// Full size when measuring; small enough otherwise that `cargo test --benches` takes seconds.
struct Sizes {
    /// All-reduce buffer sizes in bytes (f32 values).
    bytes: Vec<usize>,
    /// Seconds of timed calls per buffer size and implementation, over `launches` launches of
    /// mpirun for each side, in `reps` loops per launch.
    seconds: f64,
    launches: usize,
    reps: usize,
    gpt2: Gpt2Config,
    /// Sequences per rank when data-parallel; the single process takes `NP` times as many.
    batch_per_rank: usize,
    steps: usize,
    /// Steps left out at the start of each run, and at its end: the last step's time includes
    /// writing the profile, and side by side the faster process may finish before the other's
    /// last steps, which then run alone.
    warm_up_steps: usize,
    tail_steps: usize,
    /// The training runs, in order.
    runs: Vec<Setup>,
}

fn sizes(measuring: bool) -> Sizes {
    if measuring {
        Sizes {
            // 4 KiB to 64 MiB by powers of 4: from latency-bound to the LM head's gradient and beyond.
            bytes: (0..8).map(|k| 4096 << (2 * k)).collect(),
            seconds: 0.4,
            launches: 4,
            reps: 2,
            // The train_step bench's GPT-2: 6.85M parameters, 27.4 MB of gradients a step.
            gpt2: Gpt2Config { layers: 2, heads: 4, embed: 128, seq_len: 128, vocab: 50257, ..Default::default() },
            batch_per_rank: 4,
            steps: 14,
            warm_up_steps: 2,
            tail_steps: 2,
            // Each setup twice, mirrored: drift in the machine's speed falls on all alike.
            runs: Setup::ALL.into_iter().chain(Setup::ALL.into_iter().rev()).collect(),
        }
    } else {
        Sizes {
            bytes: vec![4096, 65536],
            seconds: 0.02,
            launches: 1,
            reps: 2,
            gpt2: Gpt2Config { layers: 1, heads: 2, embed: 32, seq_len: 16, vocab: 50257, ..Default::default() },
            batch_per_rank: 1,
            steps: 3,
            warm_up_steps: 1,
            tail_steps: 1,
            runs: Setup::ALL.to_vec(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The ranks' side of the all-reduce benchmark (allreduce_peer.c does the same in C)

/// Untimed calls before the timed ones: many for small buffers (whose first calls set up MPI's
/// paths), two for the largest (one call moves tens of megabytes).
fn warm_up_calls(bytes: usize) -> u64 {
    ((16 << 20) / bytes).clamp(2, 200) as u64
}

/// How the ranks reduce a buffer.
#[derive(Clone, Copy, Debug)]
enum Call {
    /// tensorfleet's interface, as the trainer calls it.
    Ours,
    /// rsmpi's `all_reduce_into`, the call underneath ours.
    Rsmpi,
}

struct Ranks {
    /// Declared first: dropped before `group`, which may hold the last reference to MPI.
    world: SimpleCommunicator,
    group: HostGroup,
    /// Both calls reduce into the front of this buffer.
    buf: Vec<f32>,
    /// rsmpi's send side (it offers no `MPI_IN_PLACE`); ours keeps its own scratch buffer.
    send: Vec<f32>,
}

impl Ranks {
    fn all_reduce(&mut self, call: Call, n: usize) {
        match call {
            Call::Ours => self.group.all_reduce(&mut self.buf[..n], ReduceOp::Sum).expect("all_reduce"),
            Call::Rsmpi => self.world.all_reduce_into(&self.send[..n], &mut self.buf[..n], SystemOperation::sum()),
        }
    }

    /// `secs` on the slowest rank: the time a collective takes is its last member's.
    fn slowest(&self, secs: f64) -> f64 {
        let mut all = vec![0.0f64; self.group.size()];
        self.group.all_gather(&[secs], &mut all).expect("all_gather");
        all.into_iter().fold(0.0, f64::max)
    }

    /// Seconds of `calls` all-reduces, started together after a barrier.
    fn time(&mut self, call: Call, n: usize, calls: u64) -> f64 {
        self.group.barrier().expect("barrier");
        let t = Instant::now();
        for _ in 0..calls {
            self.all_reduce(call, n);
        }
        self.slowest(t.elapsed().as_secs_f64())
    }

    /// One reduction of every rank's r + 1 must give Σ(r + 1) everywhere. Then the buffers are
    /// zeroed: sums of zeros stay finite however many calls follow.
    fn check(&mut self, call: Call, n: usize) {
        let mine = (self.group.rank() + 1) as f32;
        self.buf[..n].fill(mine);
        self.send[..n].fill(mine);
        self.all_reduce(call, n);
        let size = self.group.size();
        let expected = (size * (size + 1) / 2) as f32;
        if let Some(i) = self.buf[..n].iter().position(|&x| x != expected) {
            panic!("{call:?} all-reduce of {n} values: value {i} is {}, expected {expected}", self.buf[i]);
        }
        self.buf[..n].fill(0.0);
        self.send[..n].fill(0.0);
    }

    /// Calls per timed loop so that `reps` of them take about `seconds`, from the slowest
    /// rank's time (the same on every rank).
    fn calibrate(&mut self, call: Call, bytes: usize, seconds: f64, reps: usize) -> u64 {
        let warm = warm_up_calls(bytes);
        for _ in 0..warm {
            self.all_reduce(call, bytes / 4);
        }
        let per_call = self.time(call, bytes / 4, warm) / warm as f64;
        (seconds / reps as f64 / per_call).clamp(2.0, 1e6) as u64
    }
}

/// A rank under mpirun: `args` are OUT SECONDS REPS BYTES...; rank 0 writes the JSON to OUT.
fn ranks_main(args: &[String]) {
    let [out, seconds, reps, bytes @ ..] = args else {
        panic!("{RANKS} OUT SECONDS REPS BYTES...: got {args:?}");
    };
    let number = |s: &str| s.parse::<f64>().unwrap_or_else(|e| panic!("{RANKS}: '{s}': {e}"));
    let (seconds, reps) = (number(seconds), number(reps) as usize);
    let bytes: Vec<usize> = bytes.iter().map(|b| number(b) as usize).collect();
    let world = World::init(&CommOptions::default()).expect("joining the MPI world");
    assert!(world.size() > 1, "{RANKS}: run under mpirun with more than one rank (the bench starts it so)");
    let layout = Layout::new(world.size(), 1, 1, world.size()).expect("a data-parallel layout");
    let groups = world.parallel_groups(layout).expect("the layout's groups");
    let largest = bytes.iter().max().copied().unwrap_or(0) / 4;
    let mut r = Ranks {
        world: SimpleCommunicator::world(),
        group: groups.data,
        buf: vec![0.0; largest],
        send: vec![0.0; largest],
    };
    let both = [Call::Ours, Call::Rsmpi];
    let mut rows = Vec::new();
    for &b in &bytes {
        let n = b / 4;
        let mut calls = [0u64; 2];
        for (k, &call) in both.iter().enumerate() {
            r.check(call, n);
            calls[k] = r.calibrate(call, b, seconds, reps);
        }
        let mut secs = [0.0f64; 2];
        for rep in 0..reps {
            // Turns in the order 0 1 1 0 0 1 ...: neither goes first every time.
            for k in if rep % 2 == 0 { [0, 1] } else { [1, 0] } {
                secs[k] += r.time(both[k], n, calls[k]);
            }
        }
        let timed = |k: usize| serde_json::json!({ "iters": calls[k] * reps as u64, "seconds": secs[k] });
        rows.push(serde_json::json!({ "bytes": b, "ours": timed(0), "rsmpi": timed(1) }));
    }
    if world.rank() == 0 {
        let v = serde_json::json!({
            "threading": format!("{:?}", mpi::environment::threading_support()).to_lowercase(),
            "library": mpi::environment::library_version().unwrap_or_default().trim_end_matches('\0').trim(),
            "sizes": rows,
        });
        std::fs::write(out, v.to_string()).unwrap_or_else(|e| panic!("{out}: {e}"));
    }
}

// ---------------------------------------------------------------------------------------------
// The all-reduce benchmark, from the bench process

/// Calls of one implementation at one size in one launch, and the seconds they took.
#[derive(Clone, Copy)]
struct Timed {
    iters: u64,
    seconds: f64,
}

impl Timed {
    fn from_json(v: &serde_json::Value) -> Option<Timed> {
        Some(Timed { iters: v["iters"].as_u64()?, seconds: v["seconds"].as_f64()? })
    }

    fn mean_s(self) -> f64 {
        self.seconds / self.iters as f64
    }
}

/// One implementation's figures at one size: a `Timed` per launch.
#[derive(Clone, Default)]
struct Launches(Vec<Timed>);

impl Launches {
    /// Mean seconds per call over every launch.
    fn mean_s(&self) -> f64 {
        let secs: f64 = self.0.iter().map(|t| t.seconds).sum();
        secs / self.0.iter().map(|t| t.iters).sum::<u64>() as f64
    }

    /// Algorithm bandwidth: the buffer's bytes over a call's time.
    fn algbw(&self, bytes: usize) -> f64 {
        bytes as f64 / self.mean_s() / GB
    }

    fn json(&self, bytes: usize) -> serde_json::Value {
        let algbw = self.algbw(bytes);
        serde_json::json!({
            "iters": self.0.iter().map(|t| t.iters).sum::<u64>(),
            "mean_us": round(self.mean_s() * 1e6, 2),
            "algbw_gb_s": round(algbw, 3),
            "busbw_gb_s": round(algbw * bus_factor(NP), 3),
            "launch_mean_us": self.0.iter().map(|t| round(t.mean_s() * 1e6, 2)).collect::<Vec<_>>(),
        })
    }
}

/// Bus bandwidth over algorithm bandwidth for an all-reduce among `n` ranks: 2(n − 1)/n, the
/// share of the buffer each rank must send and receive (nccl-tests' definition).
fn bus_factor(n: usize) -> f64 {
    2.0 * (n - 1) as f64 / n as f64
}

/// One buffer size's figures.
struct Row {
    bytes: usize,
    ours: Launches,
    rsmpi: Launches,
    /// Empty when the C peer did not run.
    mpi_c: Launches,
}

fn human(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

fn args_of(seconds: f64, reps: usize, bytes: &[usize]) -> Vec<String> {
    [seconds.to_string(), reps.to_string()].into_iter().chain(bytes.iter().map(usize::to_string)).collect()
}

/// Compiles allreduce_peer.c into `dir`; the program, or why there is none.
fn compile_peer(dir: &Path) -> Result<PathBuf, String> {
    let exe = dir.join("allreduce_peer");
    let status = Command::new("mpicc")
        .args(["-O2", "-o"])
        .arg(&exe)
        .arg(PEER_SOURCE)
        .status()
        .map_err(|e| format!("could not run mpicc (OpenMPI's compiler wrapper; `make deps` installs it): {e}"))?;
    if !status.success() {
        return Err(format!("mpicc -O2 {PEER_SOURCE} failed ({status})"));
    }
    Ok(exe)
}

/// One launch of the C peer: what it says of MPI, and its calls per size.
fn run_c_peer(exe: &Path, seconds: f64, sizes: &Sizes) -> Result<(serde_json::Value, Vec<Timed>), String> {
    let mut cmd = launch::mpirun(NP);
    cmd.arg(exe).args(args_of(seconds, sizes.reps, &sizes.bytes)).stdin(Stdio::null());
    let v = common::run_json(cmd, "allreduce_peer (mpirun)")?;
    let timed: Option<Vec<Timed>> = v["sizes"].as_array().map(|a| a.iter().filter_map(Timed::from_json).collect());
    match timed {
        Some(t) if t.len() == sizes.bytes.len() => Ok((v, t)),
        _ => Err(format!("allreduce_peer printed {} sizes, expected {}: {v}", v["sizes"], sizes.bytes.len())),
    }
}

/// One launch of this binary as `NP` ranks: rank 0's JSON.
fn run_ranks(dir: &Path, index: usize, seconds: f64, sizes: &Sizes) -> serde_json::Value {
    let out = dir.join(format!("ranks-{index}.json"));
    let exe = std::env::current_exe().expect("the bench binary's path");
    let mut cmd = launch::mpirun(NP);
    cmd.arg(exe).arg(RANKS).arg(&out).args(args_of(seconds, sizes.reps, &sizes.bytes)).stdin(Stdio::null());
    let status = cmd.status().expect("starting mpirun");
    assert!(status.success(), "the all-reduce ranks failed under mpirun ({status})");
    let text = std::fs::read_to_string(&out).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", out.display()))
}

/// Both sides of the all-reduce benchmark: the figures per size, and what MPI said of itself.
/// The C peer and the ranks take turns in `launches` launches each, C R R C C R R C ..., each
/// with its share of the time: the machine's speed drifts (a VM's cores are shared), and so
/// it drifts under both alike.
fn bench_allreduce(dir: &Path, sizes: &Sizes) -> (Vec<Row>, serde_json::Value) {
    let mut peer = compile_peer(dir);
    let mut peer_said = serde_json::Value::Null;
    let mut ranks_said = serde_json::Value::Null;
    let seconds = sizes.seconds / sizes.launches as f64;
    let mut rows: Vec<Row> = sizes
        .bytes
        .iter()
        .map(|&bytes| Row { bytes, ours: Launches::default(), rsmpi: Launches::default(), mpi_c: Launches::default() })
        .collect();
    for i in 0..2 * sizes.launches {
        if matches!(i % 4, 0 | 3) {
            let Ok(exe) = &peer else { continue };
            match run_c_peer(exe, seconds, sizes) {
                Ok((v, timed)) => {
                    rows.iter_mut().zip(timed).for_each(|(r, t)| r.mpi_c.0.push(t));
                    peer_said = v;
                }
                Err(why) => peer = Err(why),
            }
        } else {
            let v = run_ranks(dir, i, seconds, sizes);
            let got = v["sizes"].as_array().map_or(0, Vec::len);
            assert_eq!(got, rows.len(), "the ranks measured {got} sizes, expected {}: {v}", rows.len());
            for (r, s) in rows.iter_mut().zip(v["sizes"].as_array().into_iter().flatten()) {
                r.ours.0.push(Timed::from_json(&s["ours"]).expect("our figures"));
                r.rsmpi.0.push(Timed::from_json(&s["rsmpi"]).expect("rsmpi's figures"));
            }
            ranks_said = v;
        }
    }
    let peer_json = match &peer {
        Ok(_) => serde_json::json!({ "threading": peer_said["threading"], "library": peer_said["library"] }),
        Err(why) => {
            println!("MPI_Allreduce peer: skipped ({why})");
            rows.iter_mut().for_each(|r| r.mpi_c.0.clear());
            serde_json::json!({ "skipped": why })
        }
    };
    let mpi = serde_json::json!({
        "library": ranks_said["library"],
        "threading": ranks_said["threading"],
        "peer": peer_json,
    });
    (rows, mpi)
}

fn print_allreduce(rows: &[Row]) {
    println!(
        "\nAll-reduce (sum) of f32 buffers, {NP} ranks, mean per call; GB/s = 10^9 bytes/s of algorithm \
         bandwidth (bus bandwidth = {:.2} × it at {NP} ranks):",
        bus_factor(NP)
    );
    println!(
        "  {:>8} | {:>24} | {:>24} | {:>24} | {:>6}",
        "size", "tensorfleet", "rsmpi all_reduce_into", "MPI_Allreduce (C)", "ours/C"
    );
    let cell = |t: &Launches, b: usize| format!("{:>10.1} µs {:>6.2} GB/s", t.mean_s() * 1e6, t.algbw(b));
    for r in rows {
        let (peer, ratio) = match r.mpi_c.0.is_empty() {
            false => (cell(&r.mpi_c, r.bytes), format!("{:.2}", r.mpi_c.mean_s() / r.ours.mean_s())),
            true => ("skipped".into(), "-".into()),
        };
        println!(
            "  {:>8} | {} | {} | {} | {:>6}",
            human(r.bytes),
            cell(&r.ours, r.bytes),
            cell(&r.rsmpi, r.bytes),
            peer,
            ratio
        );
    }
}

fn allreduce_json(rows: &[Row]) -> serde_json::Value {
    rows.iter()
        .map(|r| {
            let mut v = serde_json::json!({
                "bytes": r.bytes,
                "ours": r.ours.json(r.bytes),
                "rsmpi": r.rsmpi.json(r.bytes),
                // Bandwidth ratios: their time over ours, above 1 when ours is faster.
                "ours_vs_rsmpi": round(r.rsmpi.mean_s() / r.ours.mean_s(), 3),
            });
            if !r.mpi_c.0.is_empty() {
                v["mpi_c"] = r.mpi_c.json(r.bytes);
                v["ours_vs_mpi_c"] = round(r.mpi_c.mean_s() / r.ours.mean_s(), 3).into();
            }
            v
        })
        .collect()
}

/// Seconds of our all-reduce on `bytes`, from the measured sizes: log-log interpolation
/// between the two around it, the smallest size's time below them (latency-bound), the
/// largest size's rate above them.
fn interpolate(rows: &[Row], bytes: usize) -> f64 {
    let at = |r: &Row| (r.bytes as f64, r.ours.mean_s());
    let (first, last) = (at(&rows[0]), at(&rows[rows.len() - 1]));
    let b = bytes as f64;
    if b <= first.0 {
        return first.1;
    }
    if b >= last.0 {
        return last.1 * b / last.0;
    }
    let i = rows.iter().position(|r| r.bytes as f64 >= b).unwrap_or(rows.len() - 1);
    let ((b0, t0), (b1, t1)) = (at(&rows[i - 1]), at(&rows[i]));
    let f = (b / b0).ln() / (b1 / b0).ln();
    (t0.ln() + f * (t1 / t0).ln()).exp()
}

// ---------------------------------------------------------------------------------------------
// The data-parallel step

/// Text for `prepare-data`: seeded sentences of common words, so the BPE gives ordinary tokens.
fn text(words: usize) -> String {
    const WORDS: [&str; 32] = [
        "the", "a", "fox", "owl", "river", "saw", "crossed", "by", "and", "over", "quick", "brown", "lazy", "dog",
        "under", "bridge", "night", "morning", "sang", "slept", "near", "old", "tree", "stone", "with", "light",
        "water", "field", "ran", "flew", "home", "again",
    ];
    let mut rng = Rng::new(7);
    let mut s = String::with_capacity(words * 7);
    for i in 0..words {
        s.push_str(WORDS[rng.below(WORDS.len())]);
        s.push_str(if i % 12 == 11 { ". " } else { " " });
    }
    s
}

fn check_output(o: &std::process::Output, what: &str) {
    assert!(
        o.status.success(),
        "{what} failed ({}):\n{}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The training configuration every setup runs; batch, layout and output come as `--set`s.
/// Every step after the warm-up is profiled, in every setup alike: rank 0's profile of a
/// data-parallel run holds its all-reduces.
fn train_yaml(sizes: &Sizes) -> String {
    let g = &sizes.gpt2;
    format!(
        "model: {{gpt2: {{layers: {}, heads: {}, embed: {}, seqLen: {}, vocab: {}}}}}\n\
         data: {{train: {{path: tokens/train, format: tokens}}}}\n\
         seed: 1\nsteps: {}\n\
         optimizer: {{name: adamw, lr: 1.0e-4, weightDecay: 0.1}}\ngradClipNorm: 1.0\n\
         evaluation: {{every: 0}}\ncheckpoint: {{every: 0, resume: never}}\n\
         logging: {{every: 1}}\nprofiling: {{fromStep: {}, toStep: {}}}\n",
        g.layers,
        g.heads,
        g.embed,
        g.seq_len,
        g.vocab,
        sizes.steps,
        sizes.warm_up_steps + 1,
        sizes.steps
    )
}

/// How a training run uses the machine's `NP` cores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Setup {
    /// One process: the global batch on `NP` threads.
    Single,
    /// `NP` data-parallel ranks under mpirun, one thread and one rank's batch each.
    DataParallel,
    /// `NP` unconnected processes side by side, one thread and one rank's batch each, each
    /// training its own copy: the ranks' work on the same cores at the same time, without the
    /// all-reduce and without waiting for each other.
    SideBySide,
}

impl Setup {
    const ALL: [Setup; 3] = [Setup::Single, Setup::DataParallel, Setup::SideBySide];

    fn name(self) -> &'static str {
        match self {
            Setup::Single => "dp1",
            Setup::DataParallel => "dp2",
            Setup::SideBySide => "side_by_side",
        }
    }

    /// (launches, ranks per launch, threads per process, sequences per process)
    fn shape(self, batch_per_rank: usize) -> (usize, usize, usize, usize) {
        match self {
            Setup::Single => (1, 1, NP, batch_per_rank * NP),
            Setup::DataParallel => (1, NP, 1, batch_per_rank),
            Setup::SideBySide => (NP, 1, 1, batch_per_rank),
        }
    }
}

/// One training run (all its launches at once): per launch, the seconds of each step counted
/// (rank 0's under mpirun) and the profile.
fn train(dir: &Path, sizes: &Sizes, setup: Setup, run: usize) -> (Vec<Vec<f64>>, Vec<PathBuf>) {
    let (launches, ranks, threads, batch) = setup.shape(sizes.batch_per_rank);
    let outputs: Vec<String> = (0..launches).map(|k| format!("run{run}-{}-{k}", setup.name())).collect();
    let children: Vec<_> = outputs
        .iter()
        .map(|output| {
            let mut cmd = if ranks == 1 {
                Command::new(WORKER)
            } else {
                let mut c = launch::mpirun(ranks);
                c.args(["-x", "RAYON_NUM_THREADS"]).arg(WORKER);
                c
            };
            cmd.env("RAYON_NUM_THREADS", threads.to_string())
                .args(["train", "--config", "train.yaml", "--quiet"])
                .args(["--set", &format!("batchSize={batch}")])
                .args(["--set", &format!("parallelism.data={ranks}")])
                .args(["--set", &format!("output.dir={output}")])
                .current_dir(dir)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            cmd.spawn().expect("starting the worker")
        })
        .collect();
    for child in children {
        let o = child.wait_with_output().expect("waiting for the worker");
        check_output(&o, &format!("training run {run} ({setup:?})"));
    }
    // itemsPerSec is the step's tokens, over all ranks, over the step's time.
    let tokens = (ranks * batch * sizes.gpt2.seq_len) as f64;
    let steps = outputs
        .iter()
        .map(|output| {
            let metrics = dir.join(output).join("metrics.jsonl");
            let text = std::fs::read_to_string(&metrics).unwrap_or_else(|e| panic!("{}: {e}", metrics.display()));
            let secs: Vec<f64> = text
                .lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["itemsPerSec"].as_f64())
                .map(|per_s| tokens / per_s)
                .collect();
            assert_eq!(
                secs.len(),
                sizes.steps,
                "{}: {} steps, expected {}",
                metrics.display(),
                secs.len(),
                sizes.steps
            );
            secs[sizes.warm_up_steps..sizes.steps - sizes.tail_steps].to_vec()
        })
        .collect();
    (steps, outputs.iter().map(|o| dir.join(o).join("profile.json")).collect())
}

/// The data-parallel all-reduces of one step, from rank 0's profile.
#[derive(Clone, Default)]
struct StepComm {
    /// Each all-reduce's bytes (a bucket of gradients).
    calls: Vec<usize>,
    /// The communication thread's seconds in all-reduces (waiting for the other rank included).
    busy_s: f64,
    /// Seconds from the end of the step's last op (the backward pass) to the end of its last
    /// all-reduce: what the backward pass did not hide, handing the last bucket over included.
    exposed_s: f64,
}

/// `steps` of a Chrome trace as `monitor::profile` writes it: ops on one track, the
/// data-parallel all-reduces on another, each event naming its step.
fn step_comms(profile: &Path, steps: std::ops::Range<u64>) -> Vec<StepComm> {
    let text = std::fs::read_to_string(profile).unwrap_or_else(|e| panic!("{}: {e}", profile.display()));
    let trace: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", profile.display()));
    let mut per_step = vec![(StepComm::default(), 0.0f64, 0.0f64); (steps.end - steps.start) as usize];
    for e in trace["traceEvents"].as_array().into_iter().flatten() {
        let Some(step) = e["args"]["step"].as_u64().filter(|s| steps.contains(s)) else { continue };
        let (ts, dur) = (e["ts"].as_f64().unwrap_or(0.0) * 1e-6, e["dur"].as_f64().unwrap_or(0.0) * 1e-6);
        let (comm, ops_end, comm_end) = &mut per_step[(step - steps.start) as usize];
        match e["cat"].as_str() {
            Some("op") => *ops_end = ops_end.max(ts + dur),
            Some("comm") => {
                comm.calls.push(e["args"]["bytes"].as_u64().unwrap_or(0) as usize);
                comm.busy_s += dur;
                *comm_end = comm_end.max(ts + dur);
            }
            _ => {}
        }
    }
    per_step
        .into_iter()
        .map(|(c, ops_end, comm_end)| StepComm { exposed_s: (comm_end - ops_end).max(0.0), ..c })
        .collect()
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The data-parallel comparison; `rows` (part 1's figures, when it ran) turn the gradient
/// bytes into an all-reduce time per step.
fn bench_dp_step(dir: &Path, sizes: &Sizes, rows: &[Row]) -> serde_json::Value {
    std::fs::write(dir.join("text.txt"), text(60_000)).expect("writing the text");
    let o = Command::new(WORKER)
        .args(["prepare-data", "--input", "text.txt", "--output", "tokens", "--val-fraction", "0.2"])
        .current_dir(dir)
        .output()
        .expect("starting prepare-data");
    check_output(&o, "prepare-data");
    std::fs::write(dir.join("train.yaml"), train_yaml(sizes)).expect("writing train.yaml");

    // Step seconds per setup, warm-up steps left out, and each run's median.
    // Side by side, the slower process's steps: a data-parallel step waits for its slower
    // rank, and the two cores of a VM need not run equally fast.
    let mut steps: [Vec<f64>; 3] = Default::default();
    let mut faster_side = Vec::new();
    let mut per_run = Vec::new();
    let mut comms = Vec::new();
    for (run, &setup) in sizes.runs.iter().enumerate() {
        let (mut processes, profiles) = train(dir, sizes, setup, run + 1);
        if setup == Setup::DataParallel {
            let counted = sizes.warm_up_steps as u64 + 1..(sizes.steps - sizes.tail_steps) as u64 + 1;
            comms.extend(step_comms(&profiles[0], counted));
        }
        processes.sort_by(|a, b| median(a).total_cmp(&median(b)));
        let medians: Vec<f64> = processes.iter().map(|p| round(median(p) * 1e3, 1)).collect();
        println!("  run {} {}: median step {medians:?} ms", run + 1, setup.name());
        per_run.push(serde_json::json!({ "setup": setup.name(), "median_step_ms": medians }));
        let slower = processes.pop().expect("a process");
        steps[setup as usize].extend_from_slice(&slower);
        faster_side.extend(processes.into_iter().flatten());
    }
    let [one, dp, side] = steps.each_ref().map(|s| median(s));

    let g = &sizes.gpt2;
    let global_batch = sizes.batch_per_rank * NP;
    let grad_bytes = models::gpt2::parameter_count(g) * 4;
    // What the trainer's all-reduces took, per step: medians over the dp=2 runs' steps.
    let comm_median = |f: fn(&StepComm) -> f64| median(&comms.iter().map(f).collect::<Vec<_>>());
    let (busy, exposed) = (comm_median(|c| c.busy_s), comm_median(|c| c.exposed_s));
    // The buckets are the same every step.
    let buckets = comms.first().map(|c| c.calls.clone()).unwrap_or_default();
    let bytes: usize = buckets.iter().sum();
    // What part 1's rates make of the same calls (Sum; the trainer's Average also divides).
    let estimate_s =
        (!rows.is_empty() && !buckets.is_empty()).then(|| buckets.iter().map(|&b| interpolate(rows, b)).sum::<f64>());

    println!(
        "\nData-parallel step: GPT-2 (layers {}, embed {}, heads {}, seq {}, vocab {}), global batch {global_batch}, \
         median of {} steps (dp1), {} (dp2), {} (side by side, the slower process):",
        g.layers,
        g.embed,
        g.heads,
        g.seq_len,
        g.vocab,
        steps[0].len(),
        steps[1].len(),
        steps[2].len()
    );
    let mut setups = serde_json::Map::new();
    for (setup, secs) in Setup::ALL.into_iter().zip([one, dp, side]) {
        let (launches, ranks, threads, batch) = setup.shape(sizes.batch_per_rank);
        let processes = launches * ranks;
        let samples = processes * batch;
        println!(
            "  {:<12} {processes} process(es) × {threads} thread(s), batch {batch} each: {:>7.1} ms a step, {:>6.2} ms a sample",
            setup.name(),
            secs * 1e3,
            secs * 1e3 / samples as f64
        );
        let mut v = serde_json::json!({
            "processes": processes, "threads_each": threads, "batch_each": batch,
            "median_step_ms": round(secs * 1e3, 2),
            "ms_per_sample": round(secs * 1e3 / samples as f64, 3),
            "tokens_per_s": round((samples * g.seq_len) as f64 / secs, 0),
        });
        if setup == Setup::SideBySide {
            v["of"] = "the slower process".into();
            v["faster_process_median_step_ms"] = round(median(&faster_side) * 1e3, 2).into();
        }
        setups.insert(setup.name().into(), v);
    }
    println!("  overhead of dp={NP} over dp=1, per sample: {:+.1}%", (dp / one - 1.0) * 100.0);
    println!("  dp={NP} step less the same work side by side, unconnected: {:.1} ms", (dp - side) * 1e3);
    println!(
        "  gradients: {:.2} MB a step; rank 0's profile: {} all-reduce(s) of {:.2} MB in all, {:.1} ms busy, \
         ending {:.1} ms after the backward pass",
        grad_bytes as f64 / 1e6,
        buckets.len(),
        bytes as f64 / 1e6,
        busy * 1e3,
        exposed * 1e3
    );
    if let Some(s) = estimate_s {
        println!("  the same all-reduce(s) at part 1's rates: {:.1} ms", s * 1e3);
    }
    serde_json::json!({
        "model": "gpt2",
        "gpt2": { "layers": g.layers, "heads": g.heads, "embed": g.embed, "seq_len": g.seq_len, "vocab": g.vocab },
        "global_batch": global_batch,
        "steps_per_run": sizes.steps,
        "warm_up_steps": sizes.warm_up_steps,
        "tail_steps": sizes.tail_steps,
        "steps_counted": { "dp1": steps[0].len(), "dp2": steps[1].len(), "side_by_side": steps[2].len() },
        "runs": per_run,
        "setups": setups,
        "overhead_dp2_over_dp1": round(dp / one - 1.0, 4),
        "dp2_less_side_by_side_ms": round((dp - side) * 1e3, 2),
        "gradient_bytes": grad_bytes,
        "dp2_profile": {
            "allreduce_bytes": buckets,
            "allreduce_busy_ms": round(busy * 1e3, 2),
            "allreduce_after_backward_ms": round(exposed * 1e3, 2),
            "steps": comms.len(),
        },
        "allreduce_at_part1_rates_ms": estimate_s.map(|s| round(s * 1e3, 2)),
    })
}

// ---------------------------------------------------------------------------------------------

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some(RANKS) {
        return ranks_main(&args[2..]);
    }
    if args.iter().any(|a| a == "--list") {
        PARTS.iter().for_each(|p| println!("comm/{p}: benchmark"));
        return;
    }
    // Like criterion's: a part runs when its name contains every filter given.
    let filters: Vec<&String> = args[1..].iter().filter(|a| !a.starts_with('-')).collect();
    let runs = |part: &str| filters.iter().all(|f| format!("comm/{part}").contains(f.as_str()));
    let measuring = common::measuring();
    let load_before = common::load_avg_1m();
    let sizes = sizes(measuring);
    let dir = WorkDir::create("comm", None).unwrap_or_else(|e| panic!("{e}"));
    let started = Instant::now();

    let (rows, mpi) =
        if runs(PARTS[0]) { bench_allreduce(&dir.0, &sizes) } else { (Vec::new(), serde_json::Value::Null) };
    if !rows.is_empty() {
        print_allreduce(&rows);
    }
    let dp = runs(PARTS[1]).then(|| bench_dp_step(&dir.0, &sizes, &rows));
    println!("comm bench: {:.0} s", started.elapsed().as_secs_f64());
    if !measuring {
        return;
    }
    common::write_summary(
        "comm",
        serde_json::json!({
            "date": common::today(),
            "command": "make bench",
            "load_avg_1m_before": load_before,
            "load_avg_1m_after": common::load_avg_1m(),
            "ranks": NP,
            "mpirun": format!("mpirun --oversubscribe --bind-to none -np {NP}"),
            "mpi": mpi,
            "gb": "10^9 bytes",
            "allreduce": {
                "seconds_per_size": sizes.seconds,
                "launches": sizes.launches,
                "reps_per_launch": sizes.reps,
                "sizes": allreduce_json(&rows),
            },
            "dp_step": dp,
        }),
    );
}
