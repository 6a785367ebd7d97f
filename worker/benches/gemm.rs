//! f32 GEMM throughput of the CPU backend's MatMul kernel, next to the machine's peak measured
//! in the same run by a probe of independent FMAs on every core, once per instruction set the
//! CPU has (AVX-512, AVX2+FMA): the widest is the machine's peak.
//!
//!     cargo bench -p tensorfleet-worker --bench gemm [-- FILTER]
//!
//! Prints criterion's figures (its throughput, `elem/s`, counts FLOPs: 2·m·k·n per product),
//! then `peak: X GFLOP/s (N threads, ISA)` and each product's GFLOP/s and share of each peak;
//! writes them to the `gemm` section of target/bench-summary.json.

mod common;

use common::{round, Samples};
use criterion::{Criterion, SamplingMode, Throughput};
use std::hint::black_box;
use std::time::{Duration, Instant};
use tensorfleet_worker::kernels;
use tensorfleet_worker::op::Op;
use tensorfleet_worker::rng::Rng;
use tensorfleet_worker::tensor::{DType, Tensor};

const SAMPLE_SIZE: usize = 10;

/// One product: out[m×n] = A · B, with A stored [m×k] (or [k×m] when `trans_a`) and B stored
/// [k×n] (or [n×k] when `trans_b`), as the op the engine runs for it.
struct Shape {
    name: &'static str,
    m: usize,
    k: usize,
    n: usize,
    trans_a: bool,
    trans_b: bool,
}

impl Shape {
    fn flops(&self) -> usize {
        2 * self.m * self.k * self.n
    }
}

const fn plain(name: &'static str, m: usize, k: usize, n: usize) -> Shape {
    Shape { name, m, k, n, trans_a: false, trans_b: false }
}

/// Square products, then the products of one GPT-2 training step (2 layers, embed 128, seq 128,
/// batch 8: B·T = 1024 rows, vocab 50257); the LM head's three dominate it.
const SHAPES: &[Shape] = &[
    plain("square_256", 256, 256, 256),
    plain("square_512", 512, 512, 512),
    plain("square_1024", 1024, 1024, 1024),
    plain("gpt2_qkv", 1024, 128, 384),
    plain("gpt2_mlp_fc", 1024, 128, 512),
    plain("gpt2_mlp_proj", 1024, 512, 128),
    plain("gpt2_lm_head", 1024, 128, 50257),
    // Its backward: dW = Xᵀ·dY (k = B·T) and dX = dY·Wᵀ (k = vocab).
    Shape { name: "gpt2_lm_head_dw", m: 128, k: 1024, n: 50257, trans_a: true, trans_b: false },
    Shape { name: "gpt2_lm_head_dx", m: 1024, k: 50257, n: 128, trans_a: false, trans_b: true },
];

// ---------------------------------------------------------------------------------------------
// Peak: independent FMAs on every core

/// Independent accumulators per thread: enough to cover the FMA latency on both FMA ports
/// (4 cycles × 2 ports on recent x86), and with the two operands within 16 vector registers.
const ACCUMULATORS: usize = 12;

/// One instruction set's probe: `run(n)` issues n × ACCUMULATORS independent FMAs of `lanes` f32.
#[derive(Clone, Copy)]
struct Probe {
    isa: &'static str,
    lanes: u64,
    run: fn(u64),
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_loop_avx2(iters: u64) {
    use std::arch::x86_64::*;
    let a = _mm256_set1_ps(0.999_999);
    let b = _mm256_set1_ps(1e-7);
    let mut acc = [_mm256_set1_ps(1.0); ACCUMULATORS];
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = _mm256_fmadd_ps(*v, a, b);
        }
    }
    black_box(acc);
}

/// AVX-512 in inline assembly: std::arch's AVX-512 intrinsics, and `target_feature` naming
/// avx512f, need Rust 1.89, newer than the workspace's rust-version. zmm0-11 accumulate; zmm12
/// and zmm13 hold the operands; the clobbers name their lower halves, and `vzeroupper` clears
/// the upper ones, which no code compiled without AVX-512 uses.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn fma_loop_avx512(iters: u64) {
    if iters == 0 {
        return;
    }
    let operands = [0.999_999f32, 1e-7];
    std::arch::asm!(
        "vbroadcastss zmm12, dword ptr [{ops}]",
        "vbroadcastss zmm13, dword ptr [{ops} + 4]",
        "vmovaps zmm0, zmm12",
        "vmovaps zmm1, zmm12",
        "vmovaps zmm2, zmm12",
        "vmovaps zmm3, zmm12",
        "vmovaps zmm4, zmm12",
        "vmovaps zmm5, zmm12",
        "vmovaps zmm6, zmm12",
        "vmovaps zmm7, zmm12",
        "vmovaps zmm8, zmm12",
        "vmovaps zmm9, zmm12",
        "vmovaps zmm10, zmm12",
        "vmovaps zmm11, zmm12",
        "2:",
        "vfmadd213ps zmm0, zmm12, zmm13",
        "vfmadd213ps zmm1, zmm12, zmm13",
        "vfmadd213ps zmm2, zmm12, zmm13",
        "vfmadd213ps zmm3, zmm12, zmm13",
        "vfmadd213ps zmm4, zmm12, zmm13",
        "vfmadd213ps zmm5, zmm12, zmm13",
        "vfmadd213ps zmm6, zmm12, zmm13",
        "vfmadd213ps zmm7, zmm12, zmm13",
        "vfmadd213ps zmm8, zmm12, zmm13",
        "vfmadd213ps zmm9, zmm12, zmm13",
        "vfmadd213ps zmm10, zmm12, zmm13",
        "vfmadd213ps zmm11, zmm12, zmm13",
        "dec {n}",
        "jnz 2b",
        "vzeroupper",
        ops = in(reg) operands.as_ptr(),
        n = inout(reg) iters => _,
        out("ymm0") _,
        out("ymm1") _,
        out("ymm2") _,
        out("ymm3") _,
        out("ymm4") _,
        out("ymm5") _,
        out("ymm6") _,
        out("ymm7") _,
        out("ymm8") _,
        out("ymm9") _,
        out("ymm10") _,
        out("ymm11") _,
        out("ymm12") _,
        out("ymm13") _,
        options(nostack, readonly),
    );
}

/// Without AVX2+FMA: multiply-adds over arrays the compiler can keep in vector registers.
fn fma_loop_portable(iters: u64) {
    let mut acc = [[1.0f32; 8]; ACCUMULATORS];
    for _ in 0..iters {
        for v in acc.iter_mut() {
            for x in v.iter_mut() {
                *x = *x * 0.999_999 + 1e-7;
            }
        }
    }
    black_box(acc);
}

/// The probes this CPU runs, widest first: the first is the machine's peak.
fn probes() -> Vec<Probe> {
    let mut probes = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY (both): the CPU has the features the functions are compiled for.
        if is_x86_feature_detected!("avx512f") {
            probes.push(Probe { isa: "avx512f", lanes: 16, run: |n| unsafe { fma_loop_avx512(n) } });
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            probes.push(Probe { isa: "avx2+fma", lanes: 8, run: |n| unsafe { fma_loop_avx2(n) } });
        }
    }
    if probes.is_empty() {
        probes.push(Probe { isa: "portable", lanes: 8, run: fma_loop_portable });
    }
    probes
}

/// GFLOP/s of `threads` threads running the probe together for `secs`. Each thread times itself
/// and the rates add up: a thread that waits for a core (a busy machine) lowers only its own.
fn fma_gflops(threads: usize, secs: f64, probe: Probe) -> f64 {
    // About 0.1 ms a chunk: reading the clock between chunks costs nothing measurable.
    const CHUNK: u64 = 20_000;
    let flops_per_chunk = CHUNK * ACCUMULATORS as u64 * probe.lanes * 2;
    let start = std::sync::Barrier::new(threads);
    let rates: Vec<f64> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    start.wait();
                    let t = Instant::now();
                    let mut chunks = 0u64;
                    while t.elapsed().as_secs_f64() < secs {
                        (probe.run)(black_box(CHUNK));
                        chunks += 1;
                    }
                    (chunks * flops_per_chunk) as f64 / t.elapsed().as_secs_f64()
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().expect("the peak probe's thread panicked")).collect()
    });
    rates.iter().sum::<f64>() / 1e9
}

#[derive(Clone, Copy)]
struct Peak {
    isa: &'static str,
    threads: usize,
    gflops: f64,
    one_thread_gflops: f64,
}

/// Per probe: the best of two quarter-second runs on every core, and one run on a single core.
fn measure_peaks() -> Vec<Peak> {
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    probes()
        .into_iter()
        .map(|p| Peak {
            isa: p.isa,
            threads,
            one_thread_gflops: fma_gflops(1, 0.15, p),
            gflops: fma_gflops(threads, 0.25, p).max(fma_gflops(threads, 0.25, p)),
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------

fn operand(rng: &mut Rng, rows: usize, cols: usize) -> Tensor {
    Tensor::from_vec(&[rows, cols], (0..rows * cols).map(|_| rng.next_f64() as f32 - 0.5).collect())
}

fn main() {
    let measuring = common::measuring();
    let load_before = common::load_avg_1m();
    // Probed before and after the GEMMs, the best counting: another process on the machine can
    // only lower a probe's figure, and a peak below what a GEMM reached is no peak. Only when
    // measuring: `cargo test --benches` runs each product once, and that is all.
    let before = if measuring { measure_peaks() } else { vec![] };
    for p in &before {
        println!("peak probe before the GEMMs: {:.1} GFLOP/s ({} threads, {})", p.gflops, p.threads, p.isa);
    }

    let mut c = Criterion::default().configure_from_args();
    let mut group = c.benchmark_group("gemm");
    group
        .sample_size(SAMPLE_SIZE)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    let mut rng = Rng::new(1);
    // (shape, median seconds per product) of the ones that ran.
    let mut ran = Vec::new();
    for s in SHAPES {
        let a = if s.trans_a { operand(&mut rng, s.k, s.m) } else { operand(&mut rng, s.m, s.k) };
        let b = if s.trans_b { operand(&mut rng, s.n, s.k) } else { operand(&mut rng, s.k, s.n) };
        let mut out = [Tensor::zeros(DType::F32, &[s.m, s.n])];
        let op = if s.trans_a || s.trans_b {
            Op::FusedMatMul { trans_a: s.trans_a, trans_b: s.trans_b, activation: None }
        } else {
            Op::MatMul
        };
        group.throughput(Throughput::Elements(s.flops() as u64));
        let mut samples = Samples::default();
        group.bench_function(s.name, |bch| {
            samples.iter(bch, || kernels::run_on_tensors(&op, &[Some(&a), Some(&b)], &mut out).expect("MatMul runs"))
        });
        if let Some(secs) = samples.median_s(SAMPLE_SIZE) {
            ran.push((s, secs));
        }
    }
    group.finish();
    c.final_summary();
    if before.is_empty() || ran.is_empty() {
        return;
    }

    let after = measure_peaks();
    println!();
    // Per instruction set, the better probe; the widest set's is the machine's peak, and the
    // others say what a kernel limited to them could reach.
    let mut peaks = Vec::new();
    let mut peaks_json = Vec::new();
    for (b, a) in before.iter().zip(&after) {
        let best = Peak {
            gflops: a.gflops.max(b.gflops),
            one_thread_gflops: a.one_thread_gflops.max(b.one_thread_gflops),
            ..*b
        };
        println!(
            "peak: {:.1} GFLOP/s ({} threads, {}), the best of probes before ({:.1}) and after ({:.1}); one thread: {:.1}",
            best.gflops, best.threads, best.isa, b.gflops, a.gflops, best.one_thread_gflops
        );
        peaks_json.push(serde_json::json!({
            "isa": best.isa, "threads": best.threads, "gflops": round(best.gflops, 1),
            "probe_before_gflops": round(b.gflops, 1), "probe_after_gflops": round(a.gflops, 1),
            "one_thread_gflops": round(best.one_thread_gflops, 1),
        }));
        peaks.push(best);
    }
    println!("GEMM, f32, median of {SAMPLE_SIZE} samples:");
    let mut results = Vec::new();
    for (s, secs) in ran {
        let gflops = s.flops() as f64 / secs / 1e9;
        let mut line = format!(
            "  {:<16} {:<26} {:>9.3} ms {gflops:>7.1} GFLOP/s",
            s.name,
            format!("[{}x{}]·[{}x{}]", s.m, s.k, s.k, s.n),
            secs * 1e3
        );
        let mut shares = serde_json::Map::new();
        for p in &peaks {
            let percent = 100.0 * gflops / p.gflops;
            line += &format!(" {percent:>5.1}% of {}", p.isa);
            shares.insert(p.isa.to_string(), round(percent, 1).into());
        }
        println!("{line}");
        results.push(serde_json::json!({
            "name": s.name, "m": s.m, "k": s.k, "n": s.n, "trans_a": s.trans_a, "trans_b": s.trans_b,
            "ms": round(secs * 1e3, 3), "gflops": round(gflops, 1),
            "percent_of_peak": round(100.0 * gflops / peaks[0].gflops, 1),
            "percent_of": shares,
        }));
    }
    common::write_summary(
        "gemm",
        serde_json::json!({
            "date": common::today(),
            "command": "make bench",
            "load_avg_1m_before": load_before,
            "load_avg_1m_after": common::load_avg_1m(),
            "threads": rayon::current_num_threads(),
            "peak": peaks_json[0],
            "peaks": peaks_json,
            "results": results,
        }),
    );
}
