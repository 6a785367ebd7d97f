//! What the bench binaries share: timing through criterion while keeping the samples, the
//! machine description, and `target/bench-summary.json`, where each binary writes its section.

#![allow(dead_code)] // each bench binary uses its own part of this module

use criterion::Bencher;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The per-iteration times criterion measured for one benchmark: every `iter_custom` call is
/// kept, and the last `sample_size` of them are criterion's samples (warm-up calls come first).
#[derive(Default)]
pub struct Samples {
    calls: Vec<(u64, Duration)>,
}

impl Samples {
    /// Runs `routine` as criterion asks and records each call.
    pub fn iter(&mut self, b: &mut Bencher, mut routine: impl FnMut()) {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                routine();
            }
            let d = t.elapsed();
            self.calls.push((iters, d));
            d
        });
    }

    /// Like `iter`, but runs `setup` before each call of `routine` and times only the routine;
    /// what the routine returns is dropped after its clock stops (freeing a large result is the
    /// caller's cost, not the routine's).
    pub fn iter_with_setup<R>(&mut self, b: &mut Bencher, mut setup: impl FnMut(), mut routine: impl FnMut() -> R) {
        b.iter_custom(|iters| {
            let mut d = Duration::ZERO;
            for _ in 0..iters {
                setup();
                let t = Instant::now();
                let out = routine();
                d += t.elapsed();
                drop(out);
            }
            self.calls.push((iters, d));
            d
        });
    }

    /// Mean seconds per iteration over the last `sample_size` calls: total time over total
    /// iterations, the rate of a stream whose iterations differ (a loader that sometimes reads
    /// a whole shard); `None` when the benchmark did not run.
    pub fn mean_s(&self, sample_size: usize) -> Option<f64> {
        let tail = &self.calls[self.calls.len().saturating_sub(sample_size)..];
        let iters: u64 = tail.iter().map(|(n, _)| n).sum();
        let secs: f64 = tail.iter().map(|(_, d)| d.as_secs_f64()).sum();
        (iters > 0).then(|| secs / iters as f64)
    }

    /// Median seconds per iteration over the last `sample_size` calls; `None` when the
    /// benchmark did not run (filtered out, or `--list`).
    pub fn median_s(&self, sample_size: usize) -> Option<f64> {
        let tail = &self.calls[self.calls.len().saturating_sub(sample_size)..];
        let mut per_iter: Vec<f64> = tail.iter().map(|(n, d)| d.as_secs_f64() / *n as f64).collect();
        if per_iter.is_empty() {
            return None;
        }
        per_iter.sort_by(f64::total_cmp);
        let mid = per_iter.len() / 2;
        Some(if per_iter.len() % 2 == 1 { per_iter[mid] } else { (per_iter[mid - 1] + per_iter[mid]) / 2.0 })
    }
}

/// Whether this run measures (`cargo bench`), rather than checking that each benchmark runs
/// once (`cargo test --benches`, `-- --test`) or listing them (`-- --list`).
pub fn measuring() -> bool {
    let args: Vec<String> = std::env::args().collect();
    let has = |flag: &str| args.iter().any(|a| a == flag);
    has("--bench") && !has("--test") && !has("--list") && !args.iter().any(|a| a.starts_with("--profile-time"))
}

/// The 1-minute load average (/proc/loadavg), so a reader can tell a busy machine's figures.
pub fn load_avg_1m() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg").ok()?.split_whitespace().next()?.parse().ok()
}

/// CPU model, core count, OS and the versions a figure depends on.
pub fn machine() -> serde_json::Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name").map(|v| v.trim_start_matches([' ', '\t', ':']).to_string()))
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    // The vector extensions a GEMM can use (virtual machines often name no CPU model).
    let flags: Vec<&str> = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("flags"))
        .map(|f| f.split_whitespace().filter(|f| ["sse4_2", "avx", "avx2", "fma", "avx512f", "amx_tile"].contains(f)))
        .into_iter()
        .flatten()
        .collect();
    let rustc = std::process::Command::new(std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into()))
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string());
    serde_json::json!({
        "cpu": cpu,
        "simd": flags,
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "os": std::env::consts::OS,
        "arch": std::env::consts::ARCH,
        "tensorfleet": env!("CARGO_PKG_VERSION"),
        "rustc": rustc,
    })
}

/// Today's date (UTC) as YYYY-MM-DD.
pub fn today() -> String {
    let days = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() / 86_400).unwrap_or(0) as i64;
    // Days since 1970-01-01 to a civil date (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + (m <= 2) as i64;
    format!("{y:04}-{m:02}-{d:02}")
}

/// `target/bench-summary.json` ($CARGO_TARGET_DIR when set).
pub fn summary_path() -> PathBuf {
    // The workspace's target/: the parent of this crate's folder.
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap_or(Path::new("."));
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| workspace.join("target"));
    target.join("bench-summary.json")
}

/// Replaces this binary's `section` of the summary (the other binary's stays) and the machine.
pub fn write_summary(section: &str, value: serde_json::Value) {
    let path = summary_path();
    let mut all = std::fs::read_to_string(&path)
        .ok()
        .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
        .filter(|v| v.is_object())
        .unwrap_or_else(|| serde_json::json!({}));
    all["machine"] = machine();
    all[section] = value;
    let text = serde_json::to_string_pretty(&all).expect("JSON values serialize");
    match std::fs::write(&path, text + "\n") {
        Ok(()) => println!("summary: {} (section '{section}')", path.display()),
        Err(e) => eprintln!("summary: could not write {}: {e}", path.display()),
    }
}

/// `x` rounded to `digits` decimals, for the summary.
pub fn round(x: f64, digits: i32) -> f64 {
    let p = 10f64.powi(digits);
    (x * p).round() / p
}

/// The interpreter of the Python peers (`make bench` points it at .venv-bench).
pub const PYTHON_VAR: &str = "TENSORFLEET_BENCH_PYTHON";

/// Runs a Python peer (`cmd`, running `script`) and returns the JSON object on the last line
/// it prints, or why there is none. The peer's stderr goes to the bench's.
pub fn run_peer(cmd: std::process::Command, script: &str) -> Result<serde_json::Value, String> {
    run_json(cmd, script).map_err(|e| format!("{e} ({PYTHON_VAR}; `make bench` creates .venv-bench)"))
}

/// Runs a peer program (`cmd`, named `what` in errors) and returns the JSON object on the last
/// line it prints, or why there is none. The peer's stderr goes to the bench's.
pub fn run_json(mut cmd: std::process::Command, what: &str) -> Result<serde_json::Value, String> {
    let out = cmd.stderr(std::process::Stdio::inherit()).output().map_err(|e| format!("could not run {what}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{what} failed ({})", out.status));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last).map_err(|e| format!("{what} printed no JSON result ({e}): {last:?}"))
}

/// A directory of a bench's own, removed when dropped (also when a benchmark panics: a failed
/// run must not leave gigabytes in target/).
pub struct WorkDir(pub PathBuf);

impl WorkDir {
    /// `bench-<name>-<pid>` under `base`, or under target/ (next to the summary) without one.
    pub fn create(name: &str, base: Option<PathBuf>) -> Result<WorkDir, String> {
        let base = base.unwrap_or_else(|| summary_path().parent().unwrap_or(Path::new(".")).to_path_buf());
        let dir = base.join(format!("bench-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        Ok(WorkDir(dir))
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            eprintln!("bench: could not remove {}: {e}", self.0.display());
        }
    }
}
