//! The communication layer under a real `mpirun`: collectives give exact results on every rank,
//! the parallel layout's groups reduce only among their members, and a rank that dies or hangs
//! ends the job promptly with a non-zero exit instead of hanging it.
//!
//! Each test runs twice over: in the test process it starts `mpirun` on this same test binary,
//! asking for just this test; in the ranks mpirun starts (marked by `RANK_MODE` in their
//! environment) the same function runs the MPI side. mpirun must be installed (`make deps`).
#![cfg(feature = "mpi")]

mod common;
#[cfg(feature = "cuda")]
mod cuda_emulator;

use std::io::Read;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tensorfleet_worker::comm::{Axis, Collective, CommOptions, Layout, ProcessGroup, ReduceOp, World};

/// Set in the environment of the ranks mpirun starts.
const RANK_MODE: &str = "TENSORFLEET_TEST_MPI_RANK";
/// The parallel layout a rank should build, as "data,tensor,pipeline".
const LAYOUT: &str = "TENSORFLEET_TEST_LAYOUT";

/// One mpirun at a time: they share two cores with each other and the timing checks below.
static MPIRUN: Mutex<()> = Mutex::new(());

fn is_rank() -> bool {
    std::env::var_os(RANK_MODE).is_some()
}

struct Run {
    status: ExitStatus,
    /// mpirun's own output with every rank's copied in, interleaved as it came.
    output: String,
    /// Each rank's stdout alone, in rank order (mpirun's `--output-filename`).
    rank_stdout: Vec<String>,
    elapsed: Duration,
}

impl Run {
    fn assert_every_rank_passed(&self, test: &str, np: usize) {
        assert!(self.status.success(), "mpirun -np {np} {test} failed ({}):\n{}", self.status, self.output);
        // A filter that matched nothing would pass too: each rank must have run the test. Read
        // from each rank's own file: in the shared stream the ranks' lines interleave mid-line.
        assert_eq!(self.rank_stdout.len(), np, "{np} ranks should each have written their output:\n{}", self.output);
        for (rank, out) in self.rank_stdout.iter().enumerate() {
            assert!(
                out.contains("test result: ok. 1 passed;"),
                "rank {rank} of {np} did not pass {test}:\n{out}\n--- all ranks:\n{}",
                self.output
            );
        }
    }
}

/// Runs `test` of this binary as `np` ranks under mpirun and waits at most `deadline`.
fn mpirun(test: &str, np: usize, env: &[(&str, &str)], deadline: Duration) -> Run {
    let _one_at_a_time = MPIRUN.lock().unwrap_or_else(|e| e.into_inner());
    let exe = std::env::current_exe().expect("the test binary's path");
    let rank_files = std::env::temp_dir().join(format!("tf-mpi-comm-{test}-{np}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&rank_files);
    let mut cmd = common::mpirun(np);
    cmd.arg("--output-filename")
        .arg(&rank_files)
        .arg(exe)
        // --include-ignored: the test asked for runs in the ranks whether ignored or not.
        .args(["--exact", test, "--include-ignored", "--nocapture", "--test-threads", "1"])
        .env(RANK_MODE, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let started = Instant::now();
    let mut child = cmd.spawn().expect("starting mpirun");
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = Vec::new();
            let _ = r.read_to_end(&mut s);
            String::from_utf8_lossy(&s).into_owned()
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let status = loop {
        if let Some(s) = child.try_wait().expect("waiting for mpirun") {
            break s;
        }
        if started.elapsed() > deadline {
            // SIGTERM lets mpirun take its ranks down with it; SIGKILL only if it will not go.
            let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
            std::thread::sleep(Duration::from_secs(5));
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "mpirun -np {np} {test} still running after {deadline:?}:\n{}\n{}",
                out.join().unwrap(),
                err.join().unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = started.elapsed();
    let output = format!("{}{}", out.join().unwrap(), err.join().unwrap());
    // OpenMPI 4 writes <dir>/<job>/rank.<r>/stdout, one job per mpirun.
    let job = std::fs::read_dir(&rank_files).ok().and_then(|mut d| d.next()).and_then(|e| e.ok()).map(|e| e.path());
    let rank_stdout = job
        .map(|job| (0..np).map_while(|r| std::fs::read_to_string(job.join(format!("rank.{r}/stdout"))).ok()).collect())
        .unwrap_or_default();
    let _ = std::fs::remove_dir_all(&rank_files);
    Run { status, output, rank_stdout, elapsed }
}

/// How long a healthy test may take, startup included, before it counts as hung.
const DEADLINE: Duration = Duration::from_secs(60);

/// In the test process: runs `test` as 2 and as 4 ranks, checks that every rank passed, and
/// returns true (the caller is done). In a rank: false, and the caller runs the MPI side.
fn launched_on_2_and_4(test: &str) -> bool {
    if is_rank() {
        return false;
    }
    for np in [2, 4] {
        mpirun(test, np, &[], DEADLINE).assert_every_rank_passed(test, np);
    }
    true
}

/// The ranks' watchdog in tests that expect no failure: only there to turn a bug into a failure.
fn world() -> World {
    World::init(&CommOptions { collective_timeout: Duration::from_secs(30) }).expect("joining the MPI world")
}

/// Rank `r`'s value at index `i`: quarters below 2^12, so sums over a few ranks are exact in
/// f32 in any order, and averages over 2 or 4 ranks are exact too.
fn value(r: usize, i: usize) -> f32 {
    ((i % 1000) as f32) * 0.25 + (r as f32 + 1.0) * ((i % 7) as f32 + 1.0)
}

fn sum_over(ranks: impl Iterator<Item = usize> + Clone, len: usize) -> Vec<f32> {
    (0..len).map(|i| ranks.clone().map(|r| value(r, i)).sum()).collect()
}

/// Exact equality, reported as the first differing index rather than a dump of both buffers.
#[track_caller]
fn assert_same(got: &[f32], expected: &[f32], what: &str) {
    assert_eq!(got.len(), expected.len(), "{what}: length");
    if let Some(i) = got.iter().zip(expected).position(|(a, b)| a != b) {
        let wrong = got.iter().zip(expected).filter(|(a, b)| a != b).count();
        panic!(
            "{what}: {wrong} of {} values differ; the first at {i}: {} instead of {}",
            got.len(),
            got[i],
            expected[i]
        );
    }
}

#[test]
fn all_reduce_sums_and_averages_exactly_on_every_rank() {
    let test = "all_reduce_sums_and_averages_exactly_on_every_rank";
    if launched_on_2_and_4(test) {
        return;
    }
    let w = world();
    let g = w.world_group();
    assert_eq!((g.rank(), g.size()), (w.rank(), w.size()));
    // Small, large (past MPI's eager limit) and small again: the in-place scratch buffer grows
    // once and is reused.
    for len in [5, 1 << 20, 3] {
        let mut x: Vec<f32> = (0..len).map(|i| value(w.rank(), i)).collect();
        g.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        let sum = sum_over(0..w.size(), len);
        assert_same(&x, &sum, &format!("sum of {len} values on rank {}", w.rank()));

        let mut y: Vec<f32> = (0..len).map(|i| value(w.rank(), i)).collect();
        g.all_reduce(&mut y, ReduceOp::Average).unwrap();
        let average: Vec<f32> = sum.iter().map(|s| s / w.size() as f32).collect();
        assert_same(&y, &average, &format!("average of {len} values on rank {}", w.rank()));
    }
    let mut z = [w.rank() as f64 + 0.5];
    g.all_reduce(&mut z, ReduceOp::Average).unwrap();
    let n = w.size() as f64;
    assert_eq!(z[0], (n * (n - 1.0) / 2.0 + 0.5 * n) / n);
    g.barrier().unwrap();
}

#[test]
fn reduce_scatter_and_all_gather_round_trip() {
    let test = "reduce_scatter_and_all_gather_round_trip";
    if launched_on_2_and_4(test) {
        return;
    }
    let w = world();
    let g = w.world_group();
    let (n, chunk) = (w.size(), 1001);
    let send: Vec<f32> = (0..n * chunk).map(|i| value(w.rank(), i)).collect();
    let sum = sum_over(0..n, n * chunk);

    let mut mine = vec![0.0f32; chunk];
    g.reduce_scatter(&send, &mut mine, ReduceOp::Sum).unwrap();
    assert_same(&mine, &sum[w.rank() * chunk..][..chunk], &format!("rank {}'s chunk of the sum", w.rank()));
    let mut whole = vec![0.0f32; n * chunk];
    g.all_gather(&mine, &mut whole).unwrap();
    assert_same(&whole, &sum, &format!("rank {} after all_gather", w.rank()));

    g.reduce_scatter(&send, &mut mine, ReduceOp::Average).unwrap();
    let expected: Vec<f32> = sum[w.rank() * chunk..][..chunk].iter().map(|s| s / n as f32).collect();
    assert_same(&mine, &expected, &format!("rank {}'s chunk of the average", w.rank()));

    // A wrong length is caught before any rank enters MPI, identically on every rank.
    let e = g.reduce_scatter(&send, &mut vec![0.0f32; chunk + 1], ReduceOp::Sum).unwrap_err().to_string();
    assert!(e.contains(&format!("reduce_scatter on group 'world' (rank {} of {n}", w.rank())), "{e}");
    g.barrier().unwrap();
}

#[test]
fn broadcast_from_a_non_zero_root() {
    let test = "broadcast_from_a_non_zero_root";
    if launched_on_2_and_4(test) {
        return;
    }
    let w = world();
    let g = w.world_group();
    let root = w.size() - 1;
    let theirs: Vec<f32> = (0..300_000).map(|i| value(root, i)).collect();
    let mut buf = if w.rank() == root { theirs.clone() } else { vec![-1.0; theirs.len()] };
    g.broadcast(&mut buf, root).unwrap();
    assert_same(&buf, &theirs, &format!("rank {} after the broadcast from rank {root}", w.rank()));
}

#[test]
fn send_and_recv_around_a_ring() {
    let test = "send_and_recv_around_a_ring";
    if launched_on_2_and_4(test) {
        return;
    }
    let w = world();
    let g = w.world_group();
    let (r, n) = (w.rank(), w.size());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    // Large enough that a blocking send waits for its receiver.
    let len = 1 << 18;
    let mine: Vec<f32> = (0..len).map(|i| value(r, i)).collect();
    let from_prev: Vec<f32> = (0..len).map(|i| value(prev, i)).collect();

    let mut got = vec![0.0f32; len];
    g.send_recv(&mine, next, &mut got, prev).unwrap();
    assert_same(&got, &from_prev, &format!("rank {r} from rank {prev} by send_recv"));

    // Plain send and recv, ordered so that blocking sends cannot deadlock (even sizes only).
    let mut got = vec![0.0f32; len];
    if r % 2 == 0 {
        g.send(&mine, next).unwrap();
        g.recv(&mut got, prev).unwrap();
    } else {
        g.recv(&mut got, prev).unwrap();
        g.send(&mine, next).unwrap();
    }
    assert_same(&got, &from_prev, &format!("rank {r} from rank {prev} by send and recv"));

    // A message shorter than the receiver expects is an error that says so.
    if r == 0 {
        g.send(&[1.0f32, 2.0, 3.0], 1).unwrap();
    } else if r == 1 {
        let e = g.recv(&mut [0.0f32; 4], 0).unwrap_err().to_string();
        assert!(e.contains("rank 0 sent 3 values, expected 4"), "{e}");
    }
    g.barrier().unwrap();
}

#[test]
fn layout_groups_reduce_only_among_their_members() {
    let test = "layout_groups_reduce_only_among_their_members";
    if !is_rank() {
        for layout in ["2,2,1", "1,2,2", "4,1,1"] {
            mpirun(test, 4, &[(LAYOUT, layout)], DEADLINE).assert_every_rank_passed(test, 4);
        }
        return;
    }
    let w = world();
    // One node: every rank is local, in world order, as mpirun numbered them.
    assert_eq!((w.local_rank(), w.local_size()), (w.rank(), w.size()));
    assert_eq!(std::env::var("OMPI_COMM_WORLD_LOCAL_RANK").unwrap(), w.rank().to_string());

    let sizes: Vec<usize> = std::env::var(LAYOUT).unwrap().split(',').map(|s| s.parse().unwrap()).collect();
    let wrong = w.parallel_groups(Layout { data: sizes[0] * 2, tensor: sizes[1], pipeline: sizes[2] });
    assert!(wrong.err().unwrap().to_string().contains("but the world has 4 rank(s)"));

    let layout = Layout::new(sizes[0], sizes[1], sizes[2], w.size()).unwrap();
    let groups = w.parallel_groups(layout).unwrap();
    assert_eq!(groups.coords, layout.coords(w.rank()));
    for axis in Axis::ALL {
        let g = groups.get(axis);
        let members = layout.group(axis, w.rank());
        assert_eq!(g.members(), members);
        assert_eq!(g.size(), layout.size(axis));
        assert_eq!(g.rank(), groups.coords.on(axis), "{axis:?} group rank of world rank {}", w.rank());

        // Each member contributes its world rank's values: the sum is over the members alone.
        let len = 10;
        let mut x: Vec<f32> = (0..len).map(|i| value(w.rank(), i)).collect();
        g.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        assert_same(&x, &sum_over(members.iter().copied(), len), &format!("{axis:?} group {members:?}"));

        // Group ranks address members: receive from the previous member of the group.
        if g.size() > 1 {
            let (r, n) = (g.rank(), g.size());
            let mut got = [0.0f32; 1];
            g.send_recv(&[w.rank() as f32], (r + 1) % n, &mut got, (r + n - 1) % n).unwrap();
            assert_eq!(got[0], members[(r + n - 1) % n] as f32);
        }
    }
    w.world_group().barrier().unwrap();
}

/// Rank 1 is killed by SIGKILL in the middle of a run of all-reduces; mpirun must notice and
/// take the others down, whatever collective they are blocked in.
#[test]
fn a_killed_rank_ends_the_job_promptly() {
    let test = "a_killed_rank_ends_the_job_promptly";
    if !is_rank() {
        for np in [2, 4] {
            let run = mpirun(test, np, &[], DEADLINE);
            assert!(!run.status.success(), "mpirun -np {np} succeeded with a killed rank:\n{}", run.output);
            assert!(run.elapsed < Duration::from_secs(30), "took {:?}:\n{}", run.elapsed, run.output);
        }
        return;
    }
    // A long timeout: what must end this job is mpirun seeing the rank die, not the watchdog.
    let w = World::init(&CommOptions { collective_timeout: Duration::from_secs(120) }).unwrap();
    let g = w.world_group();
    let mut x = vec![1.0f32; 1 << 16];
    for step in 0.. {
        if w.rank() == 1 && step == 20 {
            let pid = std::process::id().to_string();
            let _ = Command::new("kill").args(["-KILL", &pid]).status();
            std::thread::sleep(Duration::from_secs(60));
        }
        g.all_reduce(&mut x, ReduceOp::Average).unwrap();
    }
}

/// Rank 1 sleeps instead of joining an all-reduce: the others must give up after the collective
/// timeout, say which collective, group and rank they were stuck in, and exit with code 1.
#[test]
fn a_hung_rank_times_its_peers_out() {
    let test = "a_hung_rank_times_its_peers_out";
    const TIMEOUT: Duration = Duration::from_secs(2);
    if !is_rank() {
        for np in [2, 4] {
            let run = mpirun(test, np, &[], DEADLINE);
            assert_eq!(run.status.code(), Some(1), "mpirun -np {np} should exit 1 (retryable):\n{}", run.output);
            assert!(
                run.output.contains("collective timeout: all_reduce on group 'world' (rank "),
                "mpirun -np {np}: no timeout message:\n{}",
                run.output
            );
            // The timeout, plus MPI start-up and tear-down on a loaded machine.
            assert!(run.elapsed < TIMEOUT + Duration::from_secs(15), "took {:?}:\n{}", run.elapsed, run.output);
        }
        return;
    }
    let w = World::init(&CommOptions { collective_timeout: TIMEOUT }).unwrap();
    let g = w.world_group();
    assert_eq!(w.watchdog().unwrap().timeout(), TIMEOUT);
    let mut x = vec![1.0f32; 1000];
    g.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    if w.rank() == 1 {
        std::thread::sleep(Duration::from_secs(60));
    }
    g.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    panic!("rank {} got through an all-reduce that rank 1 never joined", w.rank());
}

/// Adasum over 2 and 4 ranks: every rank ends with the binary tree of pairwise combinations
/// that one process computes from all ranks' gradients (lower rank first at each level), to
/// the bit, tensor by tensor.
#[test]
fn adasum_gives_every_rank_the_pairwise_tree() {
    if launched_on_2_and_4("adasum_gives_every_rank_the_pairwise_tree") {
        return;
    }
    use tensorfleet_worker::parallel::adasum;
    let world = world();
    let group = world.world_group();
    let (np, rank) = (group.size(), group.rank());
    // Two tensors of different lengths, differing per rank (neither parallel nor orthogonal).
    let lens = [5usize, 9];
    let grads = |r: usize| -> Vec<Vec<f32>> {
        lens.iter()
            .enumerate()
            .map(|(t, &n)| (0..n).map(|i| value(r, i * (t + 2)) - 3.0 * r as f32).collect())
            .collect()
    };
    let mut mine = grads(rank);
    let mut views: Vec<&mut [f32]> = mine.iter_mut().map(|g| &mut g[..]).collect();
    adasum::all_reduce(&group, &mut views).unwrap();
    // The same tree in one process: level by level, pairs (r, r + d) combined into r.
    let mut all: Vec<Vec<Vec<f32>>> = (0..np).map(grads).collect();
    let mut d = 1;
    while d < np {
        for r in (0..np).step_by(2 * d) {
            let higher = all[r + d].clone();
            for (a, b) in all[r].iter_mut().zip(&higher) {
                tensorfleet_worker::kernels::adasum::combine(a, b);
            }
        }
        d *= 2;
    }
    for (t, expected) in all[0].iter().enumerate() {
        assert_same(&mine[t], expected, &format!("tensor {t} on rank {rank} of {np}"));
    }
}

/// NCCL's communicator id, drawn by rank 0 and broadcast over MPI, reaches every rank. NCCL's
/// library needs no GPU to draw an id, but it must be found: make test puts the one of the
/// NVIDIA wheels in its Python environment on LD_LIBRARY_PATH.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs NCCL (libnccl.so.2 on LD_LIBRARY_PATH): make test provides it"]
fn nccl_ids_reach_every_rank() {
    use tensorfleet_worker::backend::cuda::nccl;

    let test = "nccl_ids_reach_every_rank";
    if launched_on_2_and_4(test) {
        return;
    }
    let w = world();
    let g = w.world_group();
    assert!(nccl::present(), "rank {}: NCCL (libnccl.so.2) cannot be loaded", w.rank());
    let id = nccl::shared_id(&g).unwrap().expect("NCCL loads on every rank");
    let mine: Vec<f64> = bytemuck_f64(&id.bytes);
    let mut all = vec![0f64; mine.len() * w.size()];
    g.all_gather(&mine, &mut all).unwrap();
    for (r, theirs) in all.chunks(mine.len()).enumerate() {
        assert!(theirs.iter().zip(&mine).all(|(a, b)| a.to_bits() == b.to_bits()), "rank {r} holds another id");
    }
    assert!(mine.iter().any(|x| x.to_bits() != 0), "the id is all zeros");
}

/// Values on each rank's GPU are summed, averaged and broadcast through NCCL, 2 ranks with a GPU
/// each (NCCL refuses two ranks on one GPU).
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs 2 GPUs (one per rank): make test runs it where nvidia-smi lists 2"]
fn nccl_reduces_on_each_ranks_gpu_on_two_gpus() {
    use tensorfleet_worker::backend::cuda::{probe, CudaBackend};
    use tensorfleet_worker::backend::{Arg, Backend, Group};
    use tensorfleet_worker::graph::ir::Meta;
    use tensorfleet_worker::tensor::{DType, Tensor};

    let test = "nccl_reduces_on_each_ranks_gpu_on_two_gpus";
    if !is_rank() {
        return mpirun(test, 2, &[], DEADLINE).assert_every_rank_passed(test, 2);
    }
    let w = world();
    let gpus = probe::gpu_count().unwrap_or_else(|why| panic!("rank {}: no GPU ({})", w.rank(), why.0));
    assert!(gpus >= w.size(), "{gpus} GPU(s) for {} ranks: NCCL needs one per rank", w.size());
    let gpu = CudaBackend::new(w.rank()).unwrap();
    let group: Group<CudaBackend> = Group::open(&gpu, w.world_group()).unwrap();
    assert!(group.on_device(), "rank {}: NCCL loads, so the values should be reduced on the GPUs", w.rank());
    let len = 1 << 20;
    let meta = Meta::new(DType::F32, &[len]);
    let buf = gpu.alloc(meta.bytes()).unwrap();
    let x = Arg { buf: &buf, offset: 0, meta: &meta };
    let upload = |r: usize| gpu.upload(&Tensor::from_vec(&[len], (0..len).map(|i| value(r, i)).collect()), x).unwrap();
    upload(w.rank());
    group.all_reduce_values(&gpu, &[x], ReduceOp::Sum).unwrap();
    let sum = sum_over(0..w.size(), len);
    assert_same(gpu.download(x).unwrap().as_slice::<f32>(), &sum, &format!("NCCL sum on rank {}", w.rank()));
    upload(w.rank());
    group.all_reduce_values(&gpu, &[x], ReduceOp::Average).unwrap();
    let average: Vec<f32> = sum.iter().map(|s| s / w.size() as f32).collect();
    assert_same(gpu.download(x).unwrap().as_slice::<f32>(), &average, &format!("NCCL average on rank {}", w.rank()));
    upload(w.rank());
    group.broadcast_values(&gpu, &[x], w.size() - 1).unwrap();
    let last: Vec<f32> = (0..len).map(|i| value(w.size() - 1, i)).collect();
    assert_same(gpu.download(x).unwrap().as_slice::<f32>(), &last, &format!("NCCL broadcast on rank {}", w.rank()));
}

/// Emulated GPUs whose groups have collectives of their own (NCCL's stand-in: MPI straight on
/// the device memory) train like the host path (the CPU backend, values through MPI), over two
/// micro-batches with dropout, 2 ranks:
/// - data parallel: rank 0's weights broadcast on the device, each gradient bucket's all-reduce
///   started as the backward pass finishes it, the compute stream joining them once before the
///   update (the host path copies the buckets to a thread's MPI);
/// - ZeRO-1 and ZeRO-2: the gradients reduce-scattered (once per step, or per micro-batch) and
///   the updated shards all-gathered, in device memory;
/// - Adasum: each weight's gradient exchanged with the partner and combined by the backend's
///   kernels (the host path: MPI and `parallel::adasum` in host memory);
/// - tensor parallel: the all-reduces completing each split pair's partial sums, in the graph;
/// - two pipeline stages (1F1B): the activations and their gradients sent between the stages
///   from message buffers in device memory, the tied embedding's gradients summed.
#[cfg(feature = "cuda")]
#[test]
fn device_collectives_train_like_the_host_path() {
    use cuda_emulator::EmulatedGpu;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use tensorfleet_worker::backend::cpu::CpuBackend;

    let test = "device_collectives_train_like_the_host_path";
    if !is_rank() {
        return mpirun(test, 2, &[], DEADLINE).assert_every_rank_passed(test, 2);
    }
    let w = world();
    // ZeRO trains like plain data parallelism.
    let mut plain: Vec<f64> = Vec::new();
    let cases = [
        (Axis::Data, 0, false),
        (Axis::Data, 1, false),
        (Axis::Data, 2, false),
        (Axis::Data, 0, true),
        (Axis::Tensor, 0, false),
        (Axis::Pipeline, 0, false),
    ];
    for (layout, zero, adasum) in cases {
        let gpu = Arc::new(EmulatedGpu::new());
        gpu.device_collectives.store(true, Ordering::Relaxed);
        let (gpu_losses, gpu_weights) = train_in_parallel(gpu.clone(), &w, layout, zero, adasum);
        let (cpu_losses, cpu_weights) = train_in_parallel(Arc::new(CpuBackend::new()), &w, layout, zero, adasum);
        let what = format!("{layout:?} parallel, ZeRO-{zero}, Adasum {adasum}, rank {}", w.rank());
        for (k, (g, c)) in gpu_losses.iter().zip(&cpu_losses).enumerate() {
            assert!((g - c).abs() <= 1e-5 * c.abs(), "{what}, step {}: loss {g} against {c}", k + 1);
        }
        if layout == Axis::Data && zero == 0 && !adasum {
            plain = gpu_losses.clone();
        }
        for (k, (z, p)) in gpu_losses.iter().zip(&plain).enumerate().filter(|_| zero > 0) {
            assert!((z - p).abs() <= 1e-5 * p.abs(), "{what}, step {}: loss {z}, without ZeRO {p}", k + 1);
        }
        for ((name, g), c) in gpu_weights.iter().zip(cpu_weights.values()) {
            let (g, c) = (g.as_slice::<f32>(), c.as_slice::<f32>());
            let worst = g.iter().zip(c).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(worst <= 1e-4, "{what}: weight {name} differs by {worst}");
        }
        let calls = gpu.collective_calls.lock().unwrap().clone();
        let count = |call: &str| calls.get(call).copied().unwrap_or(0);
        if layout == Axis::Data {
            assert_eq!(count("broadcast"), 1, "{what}: the weights' first broadcast: {calls:?}");
            assert_eq!(count("all_reduce"), 0, "{what}: an all-reduce after the backward pass: {calls:?}");
        }
        if adasum {
            // Per step, one exchange per weight (one level for two ranks), combined by kernels.
            let weights = gpu_weights.len();
            assert_eq!(count("send_recv"), 3 * weights, "{what}: {calls:?}");
            assert_eq!(count("start_all_reduce") + count("join"), 0, "{what}: {calls:?}");
        } else if layout == Axis::Data && zero == 0 {
            assert_eq!(count("join"), 3, "{what}: one join per step: {calls:?}");
            assert!(count("start_all_reduce") >= 3 * 4, "{what}: several buckets per step: {calls:?}");
        } else if layout == Axis::Data {
            let per_step = if zero == 2 { 2 } else { 1 };
            assert_eq!(count("reduce_scatter"), 3 * per_step, "{what}: {calls:?}");
            assert_eq!(count("all_gather"), 3, "{what}: {calls:?}");
        } else if layout == Axis::Tensor {
            assert!(count("all_reduce") >= 3 * 4, "{what}: the split pairs' all-reduces: {calls:?}");
            assert_eq!(count("start_all_reduce") + count("join"), 0, "{what}: {calls:?}");
        } else {
            // Per step and stage: 2 micro-batches' activations one way and gradients back.
            let messages = count("send") + count("recv") + 2 * count("send_recv");
            assert_eq!(messages, 3 * 2 * 2, "{what}: {calls:?}");
            assert_eq!(count("all_reduce"), 3, "{what}: the tied embedding's gradient: {calls:?}");
        }
    }
}

/// Three steps of a 2-layer GPT-2 with the world as its `layout` group (ZeRO stage `zero`, or
/// Adasum in place of the mean, over a data group): data parallel, each
/// rank its own micro-batches and, until rank 0's are broadcast, its own weights; tensor
/// parallel and pipeline, the same batches and weights split. The losses and the final weights
/// (this rank's).
#[cfg(feature = "cuda")]
fn train_in_parallel<B: tensorfleet_worker::backend::Backend>(
    backend: std::sync::Arc<B>,
    w: &World,
    layout: Axis,
    zero: u8,
    adasum: bool,
) -> (Vec<f64>, std::collections::BTreeMap<String, tensorfleet_worker::tensor::Tensor>) {
    use tensorfleet_worker::comm::{HostGroup, SoloGroup};
    use tensorfleet_worker::config::PipelineSchedule;
    use tensorfleet_worker::config::{Gpt2Config, ModelSpec};
    use tensorfleet_worker::models;
    use tensorfleet_worker::optim::Update;
    use tensorfleet_worker::session::{PipelineOptions, Session, SessionOptions, TensorPlace};

    let spec = ModelSpec {
        gpt2: Some(Gpt2Config {
            layers: 2,
            heads: 2,
            embed: 32,
            seq_len: 8,
            vocab: 48,
            dropout: 0.1,
            ..Default::default()
        }),
        ..Default::default()
    };
    let own = if layout == Axis::Data { w.rank() } else { 0 };
    let batches: Vec<_> = (0..2).map(|k| common::token_batch(2, 8, 48, 2 * own + k)).collect();
    let model = models::load(&spec, 11 + own as u64).unwrap();
    let adamw = Update::Adam { beta1: 0.9, beta2: 0.95, epsilon: 1e-8, weight_decay: 0.1, decoupled: true };
    let opts = SessionOptions {
        // Buckets of 4 KiB: several per step.
        bucket_bytes: 4 << 10,
        tensor: (layout == Axis::Tensor).then_some(TensorPlace { rank: w.rank(), size: w.size() }),
        pipeline: (layout == Axis::Pipeline).then(|| PipelineOptions {
            stage: w.rank(),
            stages: w.size(),
            cuts: vec![],
            schedule: PipelineSchedule::OneFOneB,
        }),
        zero,
        adasum,
        ..SessionOptions::new(adamw)
    };
    let mut s = Session::new(backend, &model, &batches[0], batches.len(), &opts).unwrap();
    let solo = |name| HostGroup::Solo(SoloGroup::new(name, w.rank()));
    let group = |axis: Axis, name| if axis == layout { w.world_group() } else { solo(name) };
    s.join(group(Axis::Data, "data"), group(Axis::Tensor, "tensor"), group(Axis::Pipeline, "pipeline")).unwrap();
    let losses = (0..3).map(|k| s.step(&batches, 3e-3, 1.0, k).unwrap().loss).collect();
    (losses, s.weights().unwrap())
}

/// 128 id bytes as the f64 bit patterns they travel as.
#[cfg(feature = "cuda")]
fn bytemuck_f64(bytes: &[u8; 128]) -> Vec<f64> {
    bytes.chunks(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()
}
