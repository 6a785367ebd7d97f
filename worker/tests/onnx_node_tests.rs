//! The ONNX backend node tests (the `node/` data shipped in the `onnx` Python package), run
//! forward on the CPU backend, on the CUDA backend's kernels under the CPU emulator, and on a
//! GPU where there is one.
//!
//! `$TENSORFLEET_ONNX_NODE_TESTS` names the directory (`make test` sets it). Each test there is
//! a directory with `model.onnx` and `test_data_set_0/{input,output}_<i>.pb`. A model that the
//! loader or the graph converter rejects (an operator or attribute we do not run) counts as
//! unsupported; every other test must match ONNX's reference outputs, unless it is listed in
//! `node_tests_known_failures.txt` with the reason. The test fails on a failure not in that
//! list, on a listed test that no longer fails, and when an operator the engine must support
//! has no passing test.

mod cuda_emulator;

use cuda_emulator::EmulatedGpu;
use prost::Message;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use tensorfleet_worker::backend::cpu::CpuBackend;
use tensorfleet_worker::backend::cuda::CudaBackend;
use tensorfleet_worker::backend::Backend;
use tensorfleet_worker::exec::Executor;
use tensorfleet_worker::graph::infer::{self, Bindings};
use tensorfleet_worker::graph::ir::{Graph, ValueId};
use tensorfleet_worker::graph::onnx_io;
use tensorfleet_worker::onnx::{
    self, tensor_from_proto, type_proto, GraphProto, ModelProto, TensorProto, ValueInfoProto,
};
use tensorfleet_worker::op::SUPPORTED_ONNX_OPS;
use tensorfleet_worker::tensor::{DType, Tensor};

const ENV: &str = "TENSORFLEET_ONNX_NODE_TESTS";
const KNOWN_FAILURES: &str = "tests/node_tests_known_failures.txt";

/// ONNX's backend test runner compares with numpy's `assert_allclose(rtol=1e-3, atol=1e-7)`.
const RTOL: f64 = 1e-3;
const ATOL: f64 = 1e-7;

/// The operators issues 2 and 20 require; each must pass at least one node test.
const REQUIRED_OPS: &[&str] = &[
    "MatMul",
    "Gemm",
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "Sqrt",
    "Neg",
    "Exp",
    "Log",
    "Tanh",
    "Erf",
    "Relu",
    "Sigmoid",
    "Gelu",
    "Softmax",
    "LogSoftmax",
    "LayerNormalization",
    "Reshape",
    "Transpose",
    "Squeeze",
    "Unsqueeze",
    "Flatten",
    "Concat",
    "Split",
    "Slice",
    "Gather",
    "Where",
    "Cast",
    "Constant",
    "ConstantOfShape",
    "Shape",
    "Range",
    "Expand",
    "Equal",
    "Trilu",
    "ReduceMean",
    "ReduceSum",
    "Dropout",
    "Identity",
    "Conv",
    "MaxPool",
    "AveragePool",
    "GlobalAveragePool",
    "BatchNormalization",
    "SoftmaxCrossEntropyLoss",
    // Issue 20: what Hugging Face and torchvision exports use.
    "Sin",
    "Cos",
    "IsNaN",
    "IsInf",
    "Clip",
    "CastLike",
    "Min",
    "Max",
    "Reciprocal",
    "Abs",
    "Sign",
    "Floor",
    "Ceil",
    "Round",
    // (Not's three node tests are written in opset 1, which the loader does not read.)
    "And",
    "Or",
    "Xor",
    "Less",
    "Greater",
    "LessOrEqual",
    "GreaterOrEqual",
    "Mod",
    "LeakyRelu",
    "HardSigmoid",
    "HardSwish",
    "Softplus",
    "Mish",
    "Elu",
    "Selu",
    "Celu",
    "PRelu",
    "GatherElements",
    "Size",
    "ReduceMax",
    "ReduceMin",
    "ReduceProd",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceSumSquare",
    "ArgMax",
    "ArgMin",
    "Pad",
    "GatherND",
    "ScatterND",
    "NegativeLogLikelihoodLoss",
    "Tile",
    "CumSum",
    "Sum",
    "Mean",
    "OneHot",
    "ScatterElements",
    "InstanceNormalization",
    "GroupNormalization",
    "LSTM",
    "GRU",
    "RNN",
    "TopK",
    "Einsum",
    "ConvTranspose",
    "Resize",
];

enum Outcome {
    Passed,
    Failed(String),
    /// Rejected when loading or converting the model: an operator or attribute we do not run.
    Unsupported(String),
    /// A node the CUDA dispatch has no kernel for (the emulated CUDA run only).
    NoKernel(String),
}

/// What runs the tests: the CPU backend, the CUDA backend's dispatch and kernels on the CPU
/// emulator of tests/cuda_emulator, or on GPU 0.
#[derive(Clone, Copy)]
enum Engine {
    Cpu,
    EmulatedCuda,
    Gpu,
}

/// Writes to the real stderr: libtest captures `print!`, and the summary must show in `make test`.
macro_rules! report {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

/// `$TENSORFLEET_ONNX_NODE_TESTS` and its tests' directories, sorted. The tests that read
/// them are ignored in a plain `cargo test`; `make test` sets the variable and runs them.
fn node_tests() -> (PathBuf, Vec<PathBuf>) {
    let root = std::env::var_os(ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("{ENV} names the ONNX backend node tests (make test sets it)"));
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{ENV}={}: cannot list it: {e}", root.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("model.onnx").is_file())
        .collect();
    dirs.sort();
    assert!(!dirs.is_empty(), "{ENV}={}: no node tests (directories with model.onnx) there", root.display());
    (root, dirs)
}

#[test]
#[ignore = "needs TENSORFLEET_ONNX_NODE_TESTS: make test sets it"]
fn onnx_backend_node_tests() {
    let (root, dirs) = node_tests();

    let known = known_failures();
    let started = Instant::now();
    // Panics are caught per test and reported as failures; keep their default report quiet.
    let default_hook = panic::take_hook();
    panic::set_hook(Box::new(|_| {}));
    let mut results: Vec<(String, String, Outcome)> = Vec::with_capacity(dirs.len());
    for dir in &dirs {
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let outcome = match panic::catch_unwind(AssertUnwindSafe(|| run_test(dir, Engine::Cpu))) {
            Ok(outcome) => outcome,
            Err(payload) => Outcome::Failed(format!("panicked: {}", panic_message(&payload))),
        };
        results.push((name, op_of_test(dir), outcome));
    }
    panic::set_hook(default_hook);
    let elapsed = started.elapsed();

    let count = |f: fn(&Outcome) -> bool| results.iter().filter(|r| f(&r.2)).count();
    let passed = count(|o| matches!(o, Outcome::Passed));
    let failed = count(|o| matches!(o, Outcome::Failed(_)));
    let unsupported = count(|o| matches!(o, Outcome::Unsupported(_)));
    report!(
        "ONNX node tests: {passed} passed, {failed} failed, {unsupported} unsupported (of {}) in {:.1} s",
        results.len(),
        elapsed.as_secs_f64()
    );

    // Per supported op: passed / total (unsupported: rejected for an attribute or input type).
    let mut per_op: BTreeMap<&str, [usize; 3]> = SUPPORTED_ONNX_OPS.iter().map(|&op| (op, [0; 3])).collect();
    for (_, op, outcome) in &results {
        if let Some(c) = per_op.get_mut(op.as_str()) {
            c[0] += matches!(outcome, Outcome::Passed) as usize;
            c[1] += 1;
            c[2] += matches!(outcome, Outcome::Unsupported(_)) as usize;
        }
    }
    report!("per supported op (passed/total, unsupported):");
    for (op, [p, t, u]) in &per_op {
        let extra = if *u > 0 { format!(", {u} unsupported") } else { String::new() };
        report!("  {op:<24} {p}/{t}{extra}");
    }

    // Unsupported tests by op type, with one reason each.
    let mut rejected: BTreeMap<&str, (usize, String)> = BTreeMap::new();
    for (_, op, outcome) in &results {
        if let Outcome::Unsupported(why) = outcome {
            rejected.entry(op.as_str()).or_insert((0, short_reason(why))).0 += 1;
        }
    }
    report!("unsupported, by op type ({} types):", rejected.len());
    for (op, (n, why)) in &rejected {
        if SUPPORTED_ONNX_OPS.contains(op) {
            report!("  {op} ({n}): {why}");
        }
    }
    let others: Vec<String> = rejected
        .iter()
        .filter(|(op, _)| !SUPPORTED_ONNX_OPS.contains(*op))
        .map(|(op, (n, _))| format!("{op} {n}"))
        .collect();
    report!("  ops we do not run: {}", others.join(", "));

    let mut problems = Vec::new();
    let mut seen = HashSet::new();
    for (name, _, outcome) in &results {
        seen.insert(name.as_str());
        match outcome {
            Outcome::Failed(why) if known.contains_key(name) => {
                report!("known failure {name}: {why}\n    listed: {}", known[name]);
            }
            Outcome::Failed(why) => {
                report!("FAILED {name}: {why}");
                problems.push(format!("{name} failed and is not in worker/{KNOWN_FAILURES}: {why}"));
            }
            _ if known.contains_key(name) => {
                problems
                    .push(format!("{name} is listed in worker/{KNOWN_FAILURES} but did not fail this time: remove it"));
            }
            _ => {}
        }
    }
    for name in known.keys() {
        if !seen.contains(name.as_str()) {
            problems.push(format!(
                "{name} is listed in worker/{KNOWN_FAILURES} but is not a node test in {}",
                root.display()
            ));
        }
    }
    for op in REQUIRED_OPS {
        if per_op.get(op).is_none_or(|c| c[0] == 0) {
            problems.push(format!("required operator {op} passes no node test"));
        }
    }
    assert!(problems.is_empty(), "{} problem(s):\n{}", problems.len(), problems.join("\n"));
}

/// The same node tests on the CUDA backend's dispatch and kernels, run by the CPU emulator
/// (tests/cuda_emulator): every test the engine runs must have a CUDA kernel for each of its
/// nodes and match ONNX's reference outputs, except those the CPU backend is listed as failing
/// too.
#[test]
#[ignore = "needs TENSORFLEET_ONNX_NODE_TESTS: make test sets it"]
fn onnx_backend_node_tests_on_the_emulated_cuda_kernels() {
    on_the_cuda_kernels(Engine::EmulatedCuda, "the emulated CUDA kernels");
}

/// The same on GPU 0 (`make gpu-bundle` carries this test to a GPU machine).
#[test]
#[ignore = "needs a GPU"]
fn onnx_backend_node_tests_on_the_gpu() {
    if let Err(why) = tensorfleet_worker::backend::cuda::probe::gpu_count() {
        panic!("no GPU: {}", why.0);
    }
    on_the_cuda_kernels(Engine::Gpu, "the GPU");
}

fn on_the_cuda_kernels(engine: Engine, label: &str) {
    let (_, dirs) = node_tests();
    let known = known_failures();
    let started = Instant::now();
    let default_hook = panic::take_hook();
    panic::set_hook(Box::new(|_| {}));
    let (mut passed, mut unsupported, mut skipped) = (0, 0, 0);
    let mut failures = Vec::new();
    for dir in &dirs {
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if known.contains_key(&name) {
            skipped += 1;
            continue;
        }
        match panic::catch_unwind(AssertUnwindSafe(|| run_test(dir, engine))) {
            Ok(Outcome::Passed) => passed += 1,
            Ok(Outcome::Unsupported(_)) => unsupported += 1,
            Ok(Outcome::NoKernel(why)) => failures.push(format!("{name}: no CUDA kernel: {why}")),
            Ok(Outcome::Failed(why)) => failures.push(format!("{name}: {why}")),
            Err(payload) => failures.push(format!("{name}: panicked: {}", panic_message(&payload))),
        }
    }
    panic::set_hook(default_hook);
    report!(
        "ONNX node tests on {label}: {passed} passed, {} failed, {unsupported} unsupported by the engine, \
         {skipped} known CPU failures not run (of {}) in {:.1} s",
        failures.len(),
        dirs.len(),
        started.elapsed().as_secs_f64()
    );
    for f in &failures {
        report!("FAILED on {label}: {f}");
    }
    assert!(failures.is_empty(), "{} node test(s) fail on {label}:\n{}", failures.len(), failures.join("\n"));
}

/// Test name → reason, from `node_tests_known_failures.txt`: a test name per line; a block of
/// `#` lines is the reason for the names below it (or `# reason` after a name on its line).
fn known_failures() -> HashMap<String, String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(KNOWN_FAILURES);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: cannot read it: {e}", path.display()));
    let (mut reason, mut in_comment) = (String::new(), false);
    let mut out = HashMap::new();
    for line in text.lines().map(str::trim) {
        if let Some(comment) = line.strip_prefix('#') {
            if !in_comment {
                reason.clear();
            }
            reason = format!("{reason} {}", comment.trim()).trim().to_string();
            in_comment = true;
            continue;
        }
        in_comment = false;
        let (name, own) = line.split_once('#').map_or((line, None), |(n, r)| (n.trim(), Some(r.trim())));
        if !name.is_empty() {
            out.insert(name.to_string(), own.map_or_else(|| reason.clone(), str::to_string));
        }
    }
    out
}

/// A rejection without the model's path (the test's name says it) and the list of supported
/// operators that follows an unknown one.
fn short_reason(why: &str) -> String {
    let why = why.split_once("model.onnx: ").map_or(why, |(_, rest)| rest);
    why.split(" (supported: ").next().unwrap_or(why).to_string()
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(no message)".into())
}

/// The operator a test exercises: its model's node (non-expanded tests have exactly one); an
/// `_expanded` test (the op's function body) counts for the op of its twin.
fn op_of_test(dir: &Path) -> String {
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let dir = match name.find("_expanded") {
        Some(at) => dir.with_file_name(&name[..at]),
        None => dir.to_path_buf(),
    };
    let model = std::fs::read(dir.join("model.onnx")).ok().and_then(|b| ModelProto::decode(&b[..]).ok());
    let nodes = model.and_then(|m| m.graph).map(|g| g.node).unwrap_or_default();
    match nodes.as_slice() {
        [node] => node.op_type().to_string(),
        _ => format!("?{name}"),
    }
}

fn read_tensor(path: &Path) -> Result<Tensor, String> {
    let origin = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| format!("{origin}: cannot read it: {e}"))?;
    let proto = TensorProto::decode(&bytes[..]).map_err(|e| format!("{origin}: not a TensorProto: {e}"))?;
    tensor_from_proto(&proto, &origin).map_err(|e| e.to_string())
}

fn run_test(dir: &Path, on: Engine) -> Outcome {
    let path = dir.join("model.onnx");
    let origin = path.display().to_string();
    let model = match onnx::load_model(&path) {
        Ok(m) => m,
        Err(e) => return Outcome::Unsupported(e.to_string()),
    };
    let graph = match onnx_io::from_model(&model, &origin) {
        Ok(g) => g,
        Err(e) => return Outcome::Unsupported(e.to_string()),
    };
    match run_graph(dir, &model, graph, on) {
        Ok(()) => Outcome::Passed,
        Err(Rejected::Failed(e)) => Outcome::Failed(e),
        Err(Rejected::NoKernel(e)) => Outcome::NoKernel(e),
    }
}

impl From<String> for Rejected {
    fn from(e: String) -> Rejected {
        Rejected::Failed(e)
    }
}

/// Why a test did not pass on an engine.
enum Rejected {
    Failed(String),
    /// The CUDA dispatch has no kernel for a node (CUDA only).
    NoKernel(String),
}

fn run_graph(dir: &Path, model: &ModelProto, graph: Graph, on: Engine) -> Result<(), Rejected> {
    let data = dir.join("test_data_set_0");
    let gp = model.graph.as_ref().ok_or(Rejected::Failed("the model has no graph".into()))?;
    let initializers: HashSet<&str> = gp.initializer.iter().map(|t| t.name()).collect();
    // The i-th input file feeds the i-th graph input that is not an initializer.
    let mut fed: HashMap<ValueId, Tensor> = HashMap::new();
    for (i, vi) in gp.input.iter().filter(|vi| !initializers.contains(vi.name())).enumerate() {
        let file = data.join(format!("input_{i}.pb"));
        if !file.exists() {
            break;
        }
        let v = graph.find(vi.name()).ok_or_else(|| format!("graph input '{}' is not in the graph", vi.name()))?;
        fed.insert(v, as_declared(read_tensor(&file)?, declared_dtype(vi)));
    }
    // Inputs some node reads as a shape operand, and integer inputs such an operand is computed
    // from through a chain of nodes (a window's length, a crop's target shape), are bound by
    // value, as a training configuration fixes them; the rest by shape.
    let mut bindings = Bindings::default();
    let operand_inputs: HashSet<ValueId> =
        graph.nodes.iter().flat_map(|n| n.op.static_operand_inputs().filter_map(|k| n.input(k))).collect();
    let mut operand_sources = operand_inputs.clone();
    let producers = graph.producers();
    let mut stack: Vec<ValueId> = operand_sources.iter().copied().collect();
    while let Some(v) = stack.pop() {
        for &i in producers[v].map_or(&[][..], |n| &graph.nodes[n].inputs[..]).iter().flatten() {
            if operand_sources.insert(i) {
                stack.push(i);
            }
        }
    }
    for (&v, t) in &fed {
        if operand_inputs.contains(&v) || (operand_sources.contains(&v) && !t.dtype().is_float()) {
            bindings.constants.insert(v, t.clone());
        } else {
            bindings.shapes.insert(v, t.shape().to_vec());
        }
    }
    let bound = infer::bind(&graph, &bindings, false).map_err(|e| format!("bind: {e}"))?;
    match on {
        Engine::Cpu => execute(Arc::new(CpuBackend::new()), bound, &fed, gp, &data),
        Engine::EmulatedCuda | Engine::Gpu => {
            let missing = CudaBackend::unsupported_nodes(&bound);
            if !missing.is_empty() {
                return Err(Rejected::NoKernel(missing.join("; ")));
            }
            match on {
                Engine::Gpu => execute(gpu()?, bound, &fed, gp, &data),
                _ => execute(Arc::new(EmulatedGpu::new()), bound, &fed, gp, &data),
            }
        }
    }
    .map_err(Rejected::Failed)
}

/// GPU 0's backend, made once (its kernels compiled once) for every test.
fn gpu() -> Result<Arc<CudaBackend>, Rejected> {
    static GPU: std::sync::OnceLock<Result<Arc<CudaBackend>, String>> = std::sync::OnceLock::new();
    GPU.get_or_init(|| CudaBackend::new(0).map(Arc::new).map_err(|e| e.to_string())).clone().map_err(Rejected::Failed)
}

/// Runs the bound graph on `backend` with the test's inputs and compares its outputs.
fn execute<B: Backend>(
    backend: Arc<B>,
    bound: Graph,
    fed: &HashMap<ValueId, Tensor>,
    gp: &GraphProto,
    data: &Path,
) -> Result<(), String> {
    let mut ex = Executor::new(backend, bound, &[]).map_err(|e| format!("plan: {e}"))?;
    let inputs: Vec<ValueId> = ex.graph.inputs.iter().map(|d| d.value).collect();
    for v in inputs {
        let t = fed.get(&v).ok_or_else(|| format!("graph input '{}' has no test data", ex.graph.name_of(v)))?;
        ex.feed(v, t).map_err(|e| format!("feed: {e}"))?;
    }
    ex.run(0).map_err(|e| format!("run: {e}"))?;
    for (i, vi) in gp.output.iter().enumerate() {
        let want = as_declared(read_tensor(&data.join(format!("output_{i}.pb")))?, declared_dtype(vi));
        let v = ex.graph.find(vi.name()).ok_or_else(|| format!("output '{}' is not in the graph", vi.name()))?;
        let got = ex.fetch(v).map_err(|e| format!("fetch '{}': {e}", vi.name()))?;
        compare(&got, &want).map_err(|e| format!("output '{}': {e}", vi.name()))?;
    }
    Ok(())
}

/// The element type a graph input or output declares.
fn declared_dtype(vi: &ValueInfoProto) -> Option<DType> {
    match vi.r#type.as_ref()?.value.as_ref()? {
        type_proto::Value::TensorType(t) => DType::from_onnx(t.elem_type()),
        _ => None,
    }
}

/// numpy has no bfloat16, so the suite stores bfloat16 tensors as uint16 bit patterns; read
/// them as the bfloat16 the model declares.
fn as_declared(t: Tensor, declared: Option<DType>) -> Tensor {
    match (t.dtype(), declared) {
        (DType::U16, Some(DType::BF16)) => Tensor::from_bytes(DType::BF16, t.shape(), t.bytes()).unwrap_or(t),
        _ => t,
    }
}

/// Same element type and shape; values within `ATOL + RTOL·|expected|` (NaN matches NaN).
fn compare(got: &Tensor, want: &Tensor) -> Result<(), String> {
    if got.dtype() != want.dtype() || got.shape() != want.shape() {
        return Err(format!("got {}{:?}, expected {}{:?}", got.dtype(), got.shape(), want.dtype(), want.shape()));
    }
    // Integers compare exactly (through f64 they would lose the low bits of large int64s).
    if let (Some(g), Some(w)) = (got.to_i64_vec(), want.to_i64_vec()) {
        let bad: Vec<usize> = (0..g.len()).filter(|&i| g[i] != w[i]).collect();
        return match bad.first() {
            None => Ok(()),
            Some(&i) => Err(format!(
                "{} of {} values differ; first at {i}: got {}, expected {}",
                bad.len(),
                g.len(),
                g[i],
                w[i]
            )),
        };
    }
    let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
    let close = |a: f64, b: f64| a == b || (a.is_nan() && b.is_nan()) || (a - b).abs() <= ATOL + RTOL * b.abs();
    let bad: Vec<usize> = (0..g.len()).filter(|&i| !close(g[i], w[i])).collect();
    match bad.first() {
        None => Ok(()),
        Some(&i) => {
            Err(format!("{} of {} values differ; first at {i}: got {}, expected {}", bad.len(), g.len(), g[i], w[i]))
        }
    }
}
