//! Which kernel runs each op, with which parameters: the CUDA backend's dispatch.
//!
//! The same code answers "can this op run here?": [`check`] walks the dispatch against the
//! [`Check`] target, which launches nothing, so that every type, shape and parameter test below
//! is made, and every kernel named is looked up in the program's source with its parameter
//! types compared to the ones passed, without a GPU. What check accepts, run launches.

use super::gemm::{Epilogue, Product};
use super::{compile, elementwise, per_row, CudaBackend, CudaBuffer};
use crate::backend::{Arg, BackendError};
use crate::graph::ir::Meta;
use crate::kernels::shape::slice_plan;
use crate::op::{Binary, LossReduction, Op, Reduce, ScatterReduction, Unary};
use crate::optim::{StepHyper, Update};
use crate::refused;
use crate::tensor::{strides, DType, Tensor};
use cudarc::driver::LaunchConfig;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::OnceLock;

/// `MAX_DIMS` of kernels/common.cuh.
const MAX_DIMS: usize = 8;

/// A shape, as the kernels' `Dims` (by value).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Dims {
    rank: i64,
    size: [i64; MAX_DIMS],
}

/// One operand's strides in elements, as the kernels' `Strides`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Strides {
    at: [i64; MAX_DIMS],
}

fn dims(shape: &[usize]) -> Result<Dims, BackendError> {
    if shape.len() > MAX_DIMS {
        return refused!("rank {} is over the kernels' {MAX_DIMS}", shape.len());
    }
    let mut d = Dims { rank: shape.len() as i64, ..Default::default() };
    for (o, &s) in d.size.iter_mut().zip(shape) {
        *o = s as i64;
    }
    Ok(d)
}

fn strides_of(at: &[i64]) -> Strides {
    let mut s = Strides::default();
    s.at[..at.len()].copy_from_slice(at);
    s
}

/// The kernel parameters that locate GatherND's and ScatterND's slices: the slice length, the
/// tuples per batch and the elements per batch, and the indexed dims' sizes and strides.
struct NdSlices {
    inner: i64,
    per_batch: i64,
    batch_stride: i64,
    kd: Dims,
    ks: Strides,
}

impl NdSlices {
    fn of(batch: usize, data: &[usize], ids: &[usize]) -> Result<NdSlices, BackendError> {
        let k = *ids.last().ok_or_else(|| BackendError::refused("indices have no axes"))?;
        if data.len() < batch + k || ids.len() <= batch {
            return refused!("indices {ids:?} do not index {data:?} with {batch} batch dims");
        }
        let st = strides(data);
        Ok(NdSlices {
            inner: data[batch + k..].iter().product::<usize>() as i64,
            per_batch: ids[batch..ids.len() - 1].iter().product::<usize>().max(1) as i64,
            batch_stride: data[batch..].iter().product::<usize>() as i64,
            kd: dims(&data[batch..batch + k])?,
            ks: strides_of(&st[batch..batch + k].iter().map(|&s| s as i64).collect::<Vec<_>>()),
        })
    }
}

/// Pad's kernel parameters: the output's and the input's shapes, the input's strides and the
/// begin pads.
fn pad_layout(pads: &[i64], input: &[usize], output: &[usize]) -> Result<(Dims, Dims, Strides, Strides), BackendError> {
    Ok((dims(output)?, dims(input)?, contiguous_strides(input), strides_of(&pads[..input.len()])))
}

/// A row-major tensor's own strides, in elements.
fn contiguous_strides(shape: &[usize]) -> Strides {
    strides_of(&strides(shape).iter().map(|&s| s as i64).collect::<Vec<_>>())
}

/// The strides that read `input` (numpy-broadcast, right-aligned) at each index of `out`.
fn broadcast(input: &[usize], out: &[usize]) -> Result<Strides, BackendError> {
    if input.len() > out.len() {
        return refused!("{input:?} does not broadcast to {out:?}");
    }
    let pad = out.len() - input.len();
    let st = strides(input);
    let mut at = vec![0i64; out.len()];
    for (k, &n) in input.iter().enumerate() {
        match n {
            1 => {}
            n if n == out[pad + k] => at[pad + k] = st[k] as i64,
            _ => return refused!("{input:?} does not broadcast to {out:?}"),
        }
    }
    Ok(strides_of(&at))
}

/// How the binary kernel finds an operand of shape `input` broadcast to `out` (`reach` in
/// kernels/elementwise.cu), with its divisor: 0 the output's layout; 1 repeated along leading
/// dims, `i mod` its size (a scalar: size 1); 2 spread over trailing dims, `i /` their size;
/// 3 anything else, by the strides.
fn reach(input: &[usize], out: &[usize]) -> (i32, i64) {
    if input == out {
        return (0, 1);
    }
    let padded: Vec<usize> =
        std::iter::repeat_n(1, out.len().saturating_sub(input.len())).chain(input.iter().copied()).collect();
    let size = |dims: &[usize]| dims.iter().product::<usize>() as i64;
    // The first dim from which the operand matches the output, and the last up to which it does.
    let from = (0..=out.len()).find(|&q| padded[q..] == out[q..]).unwrap_or(out.len());
    if padded[..from].iter().all(|&n| n == 1) {
        return (1, size(&out[from..]).max(1));
    }
    let upto = (0..=out.len()).rev().find(|&q| padded[..q] == out[..q]).unwrap_or(0);
    if padded[upto..].iter().all(|&n| n == 1) {
        return (2, size(&out[upto..]).max(1));
    }
    (3, 1)
}

/// A kernel parameter, typed so that check mode can compare it with the kernel's declaration.
#[derive(Clone, Copy, Debug)]
pub enum P {
    I32(i32),
    I64(i64),
    U64(u64),
    F32(f32),
    /// A device address (any `T*` parameter); 0 is the null pointer.
    Ptr(u64),
    Dims(Dims),
    Strides(Strides),
    Geo(window::Geo),
    Pool(window::Pool),
    Taps(resize::Taps),
}

impl From<i32> for P {
    fn from(v: i32) -> P {
        P::I32(v)
    }
}
impl From<i64> for P {
    fn from(v: i64) -> P {
        P::I64(v)
    }
}
impl From<u64> for P {
    fn from(v: u64) -> P {
        P::U64(v)
    }
}
impl From<f32> for P {
    fn from(v: f32) -> P {
        P::F32(v)
    }
}
impl From<Dims> for P {
    fn from(v: Dims) -> P {
        P::Dims(v)
    }
}
impl From<Strides> for P {
    fn from(v: Strides) -> P {
        P::Strides(v)
    }
}
impl From<window::Geo> for P {
    fn from(v: window::Geo) -> P {
        P::Geo(v)
    }
}
impl From<window::Pool> for P {
    fn from(v: window::Pool) -> P {
        P::Pool(v)
    }
}
impl From<resize::Taps> for P {
    fn from(v: resize::Taps) -> P {
        P::Taps(v)
    }
}

/// A device address, kept apart from plain u64 values (seeds) for the type check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ptr(pub u64);

impl From<Ptr> for P {
    fn from(v: Ptr) -> P {
        P::Ptr(v.0)
    }
}

pub const NULL: Ptr = Ptr(0);

macro_rules! params {
    ($($arg:expr),* $(,)?) => { [$($crate::backend::cuda::launch::P::from($arg)),*] };
}

// After the macro, which they use.
mod attention;
mod channels;
mod resize;
mod shard;
mod window;

impl P {
    /// What the kernel's declaration must say for this parameter.
    fn declared(&self) -> &'static str {
        match self {
            P::I32(_) => "int",
            P::I64(_) => "i64",
            P::U64(_) => "u64",
            P::F32(_) => "float",
            P::Ptr(_) => "pointer",
            P::Dims(_) => "Dims",
            P::Strides(_) => "Strides",
            P::Geo(_) => "Geo",
            P::Pool(_) => "Pool",
            P::Taps(_) => "Taps",
        }
    }

    fn as_param(&mut self) -> *mut c_void {
        match self {
            P::I32(v) => v as *mut i32 as *mut c_void,
            P::I64(v) => v as *mut i64 as *mut c_void,
            P::U64(v) | P::Ptr(v) => v as *mut u64 as *mut c_void,
            P::F32(v) => v as *mut f32 as *mut c_void,
            P::Dims(v) => v as *mut Dims as *mut c_void,
            P::Strides(v) => v as *mut Strides as *mut c_void,
            P::Geo(v) => v as *mut window::Geo as *mut c_void,
            P::Pool(v) => v as *mut window::Pool as *mut c_void,
            P::Taps(v) => v as *mut resize::Taps as *mut c_void,
        }
    }
}

/// Each kernel's parameter kinds, from its declaration.
fn signatures() -> &'static HashMap<String, Vec<&'static str>> {
    static SIGS: OnceLock<HashMap<String, Vec<&'static str>>> = OnceLock::new();
    SIGS.get_or_init(|| {
        compile::declarations()
            .into_iter()
            .map(|(name, types)| {
                let kinds = types
                    .iter()
                    .map(|ty| match ty.as_str() {
                        t if t.ends_with('*') => "pointer",
                        "int" => "int",
                        "i64" => "i64",
                        "u64" => "u64",
                        "float" => "float",
                        "Dims" => "Dims",
                        "Strides" => "Strides",
                        "Geo" => "Geo",
                        "Pool" => "Pool",
                        "Taps" => "Taps",
                        _ => "unknown",
                    })
                    .collect();
                (name, kinds)
            })
            .collect()
    })
}

/// A device's `Target::scratch_budget` unless it says otherwise.
const SCRATCH_BUDGET: usize = 64 << 20;
/// A device's `Target::attention_grid_limit` unless it says otherwise.
const ATTENTION_GRID_LIMIT: usize = 1 << 20;

/// Where the dispatch's work goes: the GPU ([`CudaBackend`]), nowhere ([`Check`]), or a
/// stand-in that runs the same kernels elsewhere (the tests' CPU emulator). Kernel parameters
/// arrive checked against the kernel's declaration.
pub trait Target {
    fn launch(&self, name: &str, cfg: LaunchConfig, params: &mut [*mut c_void]) -> Result<(), BackendError>;
    fn copy(&self, dst: Ptr, src: Ptr, bytes: usize) -> Result<(), BackendError>;
    fn fill(&self, dst: Ptr, byte: u8, bytes: usize) -> Result<(), BackendError>;
    /// Copies host bytes to `dst`, ordered with the launches (a kernel's table).
    fn write(&self, dst: Ptr, bytes: &[u8]) -> Result<(), BackendError>;
    fn gemm(&self, p: &Product) -> Result<(), BackendError>;
    /// At least `bytes` of temporary memory, valid until the next request.
    fn scratch(&self, bytes: usize) -> Result<Ptr, BackendError>;
    /// The dispatch hands out `bytes` of a step's planned scratch at `at` (nothing to do on a
    /// device; the emulator poisons them, as it does its own scratch).
    fn lend_planned_scratch(&self, _at: Ptr, _bytes: usize) {}
    /// How much temporary memory an op that can split its work (convolution's weight gradient,
    /// in chunks of images) should keep to.
    fn scratch_budget(&self) -> usize {
        SCRATCH_BUDGET
    }
    /// The most blocks the attention kernels' launches are given (their loops stride over the
    /// rest): 2^20, below CUDA's limit; a test makes it small to run those loops.
    fn attention_grid_limit(&self) -> usize {
        ATTENTION_GRID_LIMIT
    }
    /// Whether attention may run on the tensor-core kernels: the device has sm_80's instructions
    /// (`mma.sync` m16n8k16 in f16 and bf16, `ldmatrix`, `cp.async`) and `ATTENTION_ENV` does
    /// not ask for the warp kernels.
    fn tensor_core_attention(&self) -> bool {
        true
    }
    /// The word a kernel that can meet bad data reports it in; `what` says what ran.
    fn fault(&self, what: String) -> Ptr;
    /// f64 partial sums a kernel left at `at`, for the host to add in order.
    fn partials(&self, at: Ptr, count: usize) -> Result<Vec<f64>, BackendError>;
}

/// No device: the dispatch makes every check and launches nothing, keeping the largest scratch
/// request. [`Check::as_on`] answers the dispatch's questions (its scratch budget, its attention
/// kernels) as a device would; [`Check::default`] as the trait's defaults do.
#[derive(Default)]
pub struct Check<'a> {
    device: Option<&'a dyn Target>,
    most_scratch: std::cell::Cell<usize>,
}

impl<'a> Check<'a> {
    pub fn as_on(device: &'a dyn Target) -> Check<'a> {
        Check { device: Some(device), most_scratch: Default::default() }
    }
}

impl Target for Check<'_> {
    fn launch(&self, _: &str, _: LaunchConfig, _: &mut [*mut c_void]) -> Result<(), BackendError> {
        Ok(())
    }
    fn copy(&self, _: Ptr, _: Ptr, _: usize) -> Result<(), BackendError> {
        Ok(())
    }
    fn fill(&self, _: Ptr, _: u8, _: usize) -> Result<(), BackendError> {
        Ok(())
    }
    fn write(&self, _: Ptr, _: &[u8]) -> Result<(), BackendError> {
        Ok(())
    }
    fn gemm(&self, _: &Product) -> Result<(), BackendError> {
        Ok(())
    }
    fn scratch(&self, bytes: usize) -> Result<Ptr, BackendError> {
        self.most_scratch.set(self.most_scratch.get().max(bytes));
        Ok(NULL)
    }
    fn scratch_budget(&self) -> usize {
        self.device.map_or(SCRATCH_BUDGET, |d| d.scratch_budget())
    }
    fn attention_grid_limit(&self) -> usize {
        self.device.map_or(ATTENTION_GRID_LIMIT, |d| d.attention_grid_limit())
    }
    fn tensor_core_attention(&self) -> bool {
        self.device.is_none_or(|d| d.tensor_core_attention())
    }
    fn fault(&self, _: String) -> Ptr {
        NULL
    }
    fn partials(&self, _: Ptr, count: usize) -> Result<Vec<f64>, BackendError> {
        Ok(vec![0.0; count])
    }
}

impl Target for CudaBackend {
    fn launch(&self, name: &str, cfg: LaunchConfig, params: &mut [*mut c_void]) -> Result<(), BackendError> {
        self.launch_kernel(name, cfg, params)
    }
    fn copy(&self, dst: Ptr, src: Ptr, bytes: usize) -> Result<(), BackendError> {
        self.memcpy(dst.0, src.0, bytes)
    }
    fn fill(&self, dst: Ptr, byte: u8, bytes: usize) -> Result<(), BackendError> {
        self.memset(dst.0, byte, bytes)
    }
    fn write(&self, dst: Ptr, bytes: &[u8]) -> Result<(), BackendError> {
        self.write_bytes(dst.0, bytes)
    }
    fn gemm(&self, p: &Product) -> Result<(), BackendError> {
        CudaBackend::gemm(self, p)
    }
    fn scratch(&self, bytes: usize) -> Result<Ptr, BackendError> {
        CudaBackend::scratch(self, bytes).map(Ptr)
    }
    fn tensor_core_attention(&self) -> bool {
        self.tensor_core_attention
    }
    fn fault(&self, what: String) -> Ptr {
        Ptr(self.fault_word(what))
    }
    fn partials(&self, at: Ptr, count: usize) -> Result<Vec<f64>, BackendError> {
        self.sum_partials(at.0, count)
    }
}

/// The dispatch's handle on its target: kernel launches are checked against their
/// declarations here, whatever the target. Scratch comes from the region the executor's plan
/// gave the step, where it has one that is large enough, and from the target otherwise (work
/// outside the graph's steps: the optimizer, the gradient norm).
#[derive(Clone, Copy)]
pub struct Dev<'a> {
    target: &'a dyn Target,
    planned: Option<(Ptr, usize)>,
}

impl<'a> Dev<'a> {
    pub fn new(target: &'a dyn Target) -> Dev<'a> {
        Dev { target, planned: None }
    }
}

impl Dev<'_> {
    fn kernel(&self, name: &str, cfg: LaunchConfig, params: &mut [P]) -> Result<(), BackendError> {
        let declared =
            signatures().get(name).ok_or_else(|| BackendError::refused(format!("no CUDA kernel named {name}")))?;
        let passed: Vec<&str> = params.iter().map(P::declared).collect();
        if *declared != passed {
            return refused!("kernel {name} declares ({}) but is passed ({})", declared.join(", "), passed.join(", "));
        }
        // CUDA's limits, checked here so that check mode and the emulator refuse what a GPU would.
        let ((gx, gy, gz), (bx, by, bz)) = (cfg.grid_dim, cfg.block_dim);
        if gx > i32::MAX as u32 || gy > 65535 || gz > 65535 || bx * by * bz > 1024 {
            return refused!(
                "kernel {name}: grid {:?} × block {:?} is over CUDA's limits",
                cfg.grid_dim,
                cfg.block_dim
            );
        }
        if gx == 0 || gy == 0 || gz == 0 {
            return Ok(()); // no rows: nothing to launch
        }
        let mut raw: Vec<*mut c_void> = params.iter_mut().map(P::as_param).collect();
        self.target.launch(name, cfg, &mut raw)
    }

    fn copy(&self, dst: Ptr, src: Ptr, bytes: usize) -> Result<(), BackendError> {
        self.target.copy(dst, src, bytes)
    }

    fn fill(&self, dst: Ptr, byte: u8, bytes: usize) -> Result<(), BackendError> {
        self.target.fill(dst, byte, bytes)
    }

    fn write(&self, dst: Ptr, bytes: &[u8]) -> Result<(), BackendError> {
        self.target.write(dst, bytes)
    }

    /// A product (`Target::gemm`), unless there is nothing to multiply: cuBLASLt takes no empty
    /// matrix (a leading dimension must be positive, and a batch count of 0 would run as one
    /// product). No output (batch, m or n of 0) writes nothing; no terms (k = 0) leaves β·D,
    /// which is 0 or D, with its bias and epilogue, as the CPU backend's product does.
    fn gemm(&self, p: &Product) -> Result<(), BackendError> {
        if p.batch == 0 || p.m == 0 || p.n == 0 {
            return Ok(());
        }
        if p.k > 0 {
            return self.target.gemm(p);
        }
        let size = p.d_dtype.size() as u64;
        match p.beta {
            0.0 => (0..p.batch)
                .try_for_each(|b| self.fill(Ptr(p.d + b * p.d_stride as u64 * size), 0, (p.m * p.n * size) as usize))?,
            1.0 => {}
            beta => return refused!("a product of no terms with beta {beta}: no CUDA path"),
        }
        if p.has_epilogue() {
            return apply_epilogue(self.target, p);
        }
        Ok(())
    }

    /// At least `bytes` of temporary memory, valid until the next request.
    fn scratch(&self, bytes: usize) -> Result<Ptr, BackendError> {
        match self.planned {
            Some((at, planned)) if bytes <= planned => {
                self.target.lend_planned_scratch(at, bytes);
                Ok(at)
            }
            _ => self.target.scratch(bytes),
        }
    }

    fn scratch_budget(&self) -> usize {
        self.target.scratch_budget()
    }

    fn attention_grid_limit(&self) -> usize {
        self.target.attention_grid_limit()
    }

    fn tensor_core_attention(&self) -> bool {
        self.target.tensor_core_attention()
    }

    fn fault(&self, what: impl FnOnce() -> String) -> Ptr {
        self.target.fault(what())
    }

    fn partials(&self, at: Ptr, count: usize) -> Result<Vec<f64>, BackendError> {
        self.target.partials(at, count)
    }
}

/// A value: its meta and, with a device, its address.
#[derive(Clone, Copy)]
pub struct V<'a> {
    pub meta: &'a Meta,
    pub at: Ptr,
}

impl V<'_> {
    fn n(&self) -> usize {
        self.meta.numel()
    }
    fn dtype(&self) -> DType {
        self.meta.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.meta.shape
    }
}

/// The executor's value as the dispatch sees it.
pub fn value<'a>(a: &Arg<'a, CudaBuffer>) -> V<'a> {
    V { meta: a.meta, at: Ptr(super::addr(a)) }
}

/// Runs `op` on `target`, with the scratch its step was planned (an address and its bytes).
pub fn run(
    target: &dyn Target,
    op: &Op,
    inputs: &[Option<V>],
    outputs: &[V],
    scratch: Option<(Ptr, usize)>,
) -> Result<(), BackendError> {
    dispatch(Dev { target, planned: scratch }, op, inputs, outputs)
}

/// Whether `op` with these input and output metas can run on the CUDA backend; Err says why
/// not. Needs no GPU.
pub fn check(op: &Op, inputs: &[Option<Meta>], outputs: &[Meta]) -> Result<(), BackendError> {
    let ins: Vec<Option<&Meta>> = inputs.iter().map(Option::as_ref).collect();
    let outs: Vec<&Meta> = outputs.iter().collect();
    run_on_metas(&Check::default(), op, &ins, &outs)
}

/// The dispatch of `op` against `check`, on values that have metas and no addresses.
fn run_on_metas(check: &Check, op: &Op, inputs: &[Option<&Meta>], outputs: &[&Meta]) -> Result<(), BackendError> {
    let ins: Vec<Option<V>> = inputs.iter().map(|m| m.map(|meta| V { meta, at: NULL })).collect();
    let outs: Vec<V> = outputs.iter().map(|&meta| V { meta, at: NULL }).collect();
    run(check, op, &ins, &outs, None)
}

/// The most scratch memory `op` asks for on `device` with these input and output metas (0 for
/// an op the dispatch refuses: that refusal comes when it runs). The dispatch runs against
/// [`Check::as_on`], so the sizes are the ones a launch requests, with the device's budget and
/// kernel choices.
pub fn scratch_bytes(device: &dyn Target, op: &Op, inputs: &[Option<&Meta>], outputs: &[&Meta]) -> usize {
    let check = Check::as_on(device);
    match run_on_metas(&check, op, inputs, outputs) {
        Ok(()) => check.most_scratch.get(),
        Err(_) => 0,
    }
}

/// The element type every operand shares (f32, f16 or bf16), or why not.
fn one_float_type(operands: &[(&V, &str)]) -> Result<DType, BackendError> {
    let t = operands[0].0.dtype();
    if let Some((v, what)) = operands.iter().find(|(v, _)| v.dtype() != t) {
        return refused!("{what} is {} where {} is {t}", v.dtype(), operands[0].1);
    }
    match t {
        DType::F32 | DType::F16 | DType::BF16 => Ok(t),
        _ => refused!("{} is {t}; the CUDA kernels take f32, f16 or bf16 here", operands[0].1),
    }
}

fn need_f32(x: &V, what: &str) -> Result<(), BackendError> {
    match x.dtype() {
        DType::F32 => Ok(()),
        t => refused!("{what} is {t}; the CUDA kernels take f32 here"),
    }
}

/// The kernel of a family with an entry point per numeric element type (binary, compare):
/// `{family}_f32` … `{family}_u64`; bool elements are u8's.
fn numeric(family: &str, t: DType) -> String {
    let suffix = match t {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F64 => "f64",
        DType::I8 => "i8",
        DType::U8 | DType::Bool => "u8",
        DType::I16 => "i16",
        DType::U16 => "u16",
        DType::I32 => "i32",
        DType::U32 => "u32",
        DType::I64 => "i64",
        DType::U64 => "u64",
    };
    format!("{family}_{suffix}")
}

/// The kernel of a family that moves elements without reading them (strided_copy,
/// strided_store, trilu, where) for `t`'s width: `{family}_b8` … `{family}_b64`.
fn sized(family: &str, t: DType) -> Result<String, BackendError> {
    match t.size() {
        1 | 2 | 4 | 8 => Ok(format!("{family}_b{}", 8 * t.size())),
        _ => refused!("no {family} kernel for {t} elements on the CUDA backend"),
    }
}

/// The kernel of a family that computes with float elements for `t`: `{family}_f32`,
/// `{family}_f16` or `{family}_bf16` (the half ones load to f32 and store rounded).
/// Like `typed`, and `{family}_f64` for f64 elements.
fn float_kernel(family: &str, t: DType) -> Result<String, BackendError> {
    match t {
        DType::F64 => Ok(format!("{family}_f64")),
        t => typed(family, t),
    }
}

fn typed(family: &str, t: DType) -> Result<String, BackendError> {
    let suffix = match t {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        _ => return refused!("no {family} kernel for {t} elements on the CUDA backend"),
    };
    Ok(format!("{family}_{suffix}"))
}

/// Which side of a strided move is read through strides.
#[derive(Clone, Copy)]
enum Strided {
    /// `strided_copy`: out[i] = x[offset(i)] (Expand, Transpose, Split, Slice).
    Source,
    /// `strided_store`: out[offset(i)] = x[i] (Concat, SliceGrad).
    Destination,
}

/// Moves the elements of `shape` (each `esize` bytes) between `x` and `y`, one side contiguous
/// and the other read or written through `strides` (in elements). The layout is made cheaper
/// first: dimensions of one element go, neighbours the strided side keeps contiguous are merged
/// (fewer divisions per element), and where the innermost run, every stride and both addresses
/// allow, elements are moved as words of up to 16 bytes (one load and one store per word; a
/// head's 64 bf16 values are 8 words). A move left contiguous is a plain copy.
fn strided_move(
    dev: Dev,
    side: Strided,
    shape: &[usize],
    strides: &[i64],
    esize: usize,
    x: Ptr,
    y: Ptr,
) -> Result<(), BackendError> {
    if shape.contains(&0) {
        return Ok(());
    }
    let mut merged: Vec<(usize, i64)> = Vec::new();
    for (&size, &stride) in shape.iter().zip(strides).filter(|(&size, _)| size != 1) {
        match merged.last_mut() {
            Some(outer) if outer.1 == stride * size as i64 => *outer = (outer.0 * size, stride),
            _ => merged.push((size, stride)),
        }
    }
    // A block a row pays where rows are at least a few hundred bytes; narrower ones stay with
    // the element-wise kernel below.
    let wide = |cols: usize| cols * esize >= 512;
    match (side, &merged[..]) {
        (_, &[(size, 1)]) => return dev.copy(y, x, size * esize),
        (Strided::Source, &[(rows, ld), (cols, 1)]) if wide(cols) => {
            return rows_move(dev, rows, cols, esize, (x, ld), (y, cols as i64), false)
        }
        (Strided::Destination, &[(rows, ld), (cols, 1)]) if wide(cols) => {
            return rows_move(dev, rows, cols, esize, (x, cols as i64), (y, ld), false)
        }
        _ => {}
    }
    let mut word = esize;
    if let Some((&(inner, 1), outer)) = merged.split_last() {
        let strides: Vec<i64> = outer.iter().map(|&(_, stride)| stride).collect();
        word = widest_word(esize, inner, &strides, [x, y]);
        let per = word / esize;
        if let Some(((inner, _), outer)) = merged.split_last_mut() {
            *inner /= per;
            outer.iter_mut().for_each(|(_, stride)| *stride /= per as i64);
        }
    }
    let (sizes, strides): (Vec<usize>, Vec<i64>) = merged.into_iter().unzip();
    let n = sizes.iter().product::<usize>();
    let (d, s) = (dims(&sizes)?, strides_of(&strides));
    let width = match word {
        1 | 2 | 4 | 8 | 16 => 8 * word,
        _ => return refused!("no strided move for elements of {esize} bytes on the CUDA backend"),
    };
    match side {
        Strided::Source => {
            dev.kernel(&format!("strided_copy_b{width}"), elementwise(n), &mut params![n as i64, d, x, s, y])
        }
        Strided::Destination => {
            dev.kernel(&format!("strided_store_b{width}"), elementwise(n), &mut params![n as i64, d, x, y, s])
        }
    }
}

/// The widest word (16, 8, 4 or 2 bytes, else the element's `esize`) a move can use whose runs
/// are `run` elements, whose other strides (in elements) are `strides`, between addresses `at`:
/// the run, every stride and both addresses must be multiples of it.
fn widest_word(esize: usize, run: usize, strides: &[i64], at: [Ptr; 2]) -> usize {
    let fits = |w: usize| {
        (run * esize).is_multiple_of(w)
            && strides.iter().all(|&stride| (stride * esize as i64) % w as i64 == 0)
            && at.iter().all(|p| p.0.is_multiple_of(w as u64))
    };
    [16, 8, 4, 2].into_iter().find(|&w| w > esize && fits(w)).unwrap_or(esize)
}

/// `rows` rows of `cols` elements (each `esize` bytes) from `x` to `y`, each given as (address,
/// elements from one row to the next); with `pad`, zeros fill each row of `y` after its
/// elements up to the next. One block per row, moving words of up to 16 bytes where the row,
/// both strides and both addresses allow.
fn rows_move(
    dev: Dev,
    rows: usize,
    cols: usize,
    esize: usize,
    x: (Ptr, i64),
    y: (Ptr, i64),
    pad: bool,
) -> Result<(), BackendError> {
    let ((x, x_ld), (y, y_ld)) = (x, y);
    let word = widest_word(esize, cols, &[x_ld, y_ld], [x, y]);
    let per = (word / esize) as i64;
    let cfg = super::per_row(rows.min(1 << 16));
    dev.kernel(
        &format!("rows_b{}", 8 * word),
        cfg,
        &mut params![rows as i64, (cols as i64) / per, x_ld / per, x, y_ld / per, y, pad as i32],
    )
}

/// Integer ids for gathers and labels: i64 (1) or i32 (0).
fn ids_i64(x: &V, what: &str) -> Result<i32, BackendError> {
    match x.dtype() {
        DType::I64 => Ok(1),
        DType::I32 => Ok(0),
        t => refused!("{what} are {t}; expected i64 or i32"),
    }
}

fn norm_axis(axis: i64, rank: usize) -> Result<usize, BackendError> {
    crate::shape::norm_axis(axis, rank).ok_or_else(|| BackendError::Refused(format!("axis {axis} out of range")))
}

fn dispatch(dev: Dev, op: &Op, ins: &[Option<V>], outs: &[V]) -> Result<(), BackendError> {
    let x =
        |i: usize| ins.get(i).copied().flatten().ok_or_else(|| BackendError::refused(format!("input {i} is missing")));
    let y = *outs.first().ok_or_else(|| BackendError::refused("the op has no output"))?;
    match op {
        Op::Unary(u) => unary(dev, *u, x(0)?, y),
        Op::UnaryGrad(u) => {
            let (dy, a) = (x(0)?, x(1)?);
            if dy.dtype() != a.dtype() {
                return refused!("an activation's gradient of {} for an input of {}", dy.dtype(), a.dtype());
            }
            let kernel = float_kernel("unary_grad", a.dtype())?;
            let (n, [p0, p1]) = (a.n(), u.params());
            dev.kernel(&kernel, elementwise(n), &mut params![u.code(), p0, p1, n as i64, dy.at, a.at, y.at])
        }
        Op::Binary(b) => {
            let mut acc = x(0)?;
            for i in 1..ins.len() {
                binary(dev, *b, acc, x(i)?, y)?;
                acc = y;
            }
            Ok(())
        }
        Op::Swiglu | Op::SwigluGrad => {
            let grad = matches!(op, Op::SwigluGrad);
            let k = usize::from(grad);
            let (a, b) = (x(k)?, x(k + 1)?);
            let dy = if grad { x(0)?.at } else { NULL };
            if b.dtype() != a.dtype() || (grad && x(0)?.dtype() != a.dtype()) {
                return refused!("SwiGLU of {} and {}", a.dtype(), b.dtype());
            }
            let db = if grad {
                outs.get(1).ok_or_else(|| BackendError::refused("SwiGLU's gradient has 2 outputs"))?.at
            } else {
                NULL
            };
            let n = a.n();
            dev.kernel(
                &float_kernel("swiglu", a.dtype())?,
                elementwise(n),
                &mut params![n as i64, dy, a.at, b.at, y.at, db],
            )
        }
        Op::Rotary | Op::RotaryGrad => {
            let (a, cos, sin) = (x(0)?, x(1)?, x(2)?);
            if cos.dtype() != a.dtype() || sin.dtype() != a.dtype() {
                return refused!("Rotary of {} with tables of {} and {}", a.dtype(), cos.dtype(), sin.dtype());
            }
            let half = a.shape().last().copied().unwrap_or(0) / 2;
            let pairs = a.n() / 2;
            if half == 0 || pairs == 0 {
                return Ok(());
            }
            let grad = matches!(op, Op::RotaryGrad) as i32;
            let d = dims(y.shape())?;
            let (sc, ss) = (broadcast(cos.shape(), y.shape())?, broadcast(sin.shape(), y.shape())?);
            let ((kc, pc), (ks, ps)) = (reach(cos.shape(), y.shape()), reach(sin.shape(), y.shape()));
            dev.kernel(
                &float_kernel("rotary", a.dtype())?,
                elementwise(pairs),
                &mut params![grad, pairs as i64, half as i64, d, a.at, cos.at, sc, kc, pc, sin.at, ss, ks, ps, y.at],
            )
        }
        Op::Where => {
            let (c, a, b) = (x(0)?, x(1)?, x(2)?);
            if c.dtype() != DType::Bool || a.dtype() != b.dtype() {
                return refused!("Where of {} and {} on a {} condition", a.dtype(), b.dtype(), c.dtype());
            }
            let kernel = sized("where", a.dtype())?;
            let n = y.n();
            let d = dims(y.shape())?;
            let (sc, sa, sb) =
                (broadcast(c.shape(), y.shape())?, broadcast(a.shape(), y.shape())?, broadcast(b.shape(), y.shape())?);
            dev.kernel(&kernel, elementwise(n), &mut params![n as i64, d, c.at, sc, a.at, sa, b.at, sb, y.at])
        }
        Op::Cast { to } => {
            let a = x(0)?;
            if a.dtype() == *to {
                return dev.copy(y.at, a.at, y.meta.bytes());
            }
            cast(dev, a.dtype(), *to, a.at, y.at, a.n())
        }
        Op::Identity | Op::Reshape | Op::AllReduce { .. } | Op::TensorParallelCopy => {
            // AllReduce: the executor reduces the copy in place over the tensor group.
            dev.copy(y.at, x(0)?.at, y.meta.bytes())
        }
        Op::Expand => {
            let a = x(0)?;
            let s = broadcast(a.shape(), y.shape())?;
            strided_move(dev, Strided::Source, y.shape(), &s.at[..y.shape().len()], a.dtype().size(), a.at, y.at)
        }
        Op::Transpose { perm } => {
            let a = x(0)?;
            let r = a.shape().len();
            let perm: Vec<usize> = match perm {
                Some(p) => p.iter().map(|&p| norm_axis(p, r)).collect::<Result<_, _>>()?,
                None => (0..r).rev().collect(),
            };
            let st = strides(a.shape());
            let s: Vec<i64> = perm.iter().map(|&p| st[p] as i64).collect();
            strided_move(dev, Strided::Source, y.shape(), &s, a.dtype().size(), a.at, y.at)
        }
        Op::Split { axis, .. } => {
            let a = x(0)?;
            let ax = norm_axis(*axis, a.shape().len())?;
            let st: Vec<i64> = strides(a.shape()).iter().map(|&v| v as i64).collect();
            let mut start = 0;
            for part in outs {
                let base = at(a.at, start * st[ax] as usize, a.dtype());
                strided_move(dev, Strided::Source, part.shape(), &st, a.dtype().size(), base, part.at)?;
                start += part.shape()[ax];
            }
            Ok(())
        }
        Op::Concat { axis } => {
            let ax = norm_axis(*axis, y.shape().len())?;
            let st: Vec<i64> = strides(y.shape()).iter().map(|&v| v as i64).collect();
            let mut start = 0;
            for part in ins.iter().flatten() {
                let base = at(y.at, start * st[ax] as usize, y.dtype());
                strided_move(dev, Strided::Destination, part.shape(), &st, y.dtype().size(), part.at, base)?;
                start += part.shape()[ax];
            }
            Ok(())
        }
        Op::Slice { starts, ends, axes, steps } => {
            let a = x(0)?;
            let (base, s) = slice_view(a.shape(), a.dtype(), starts, ends, axes, steps);
            let at = Ptr((a.at.0 as i64 + base) as u64);
            strided_move(dev, Strided::Source, y.shape(), &s, a.dtype().size(), at, y.at)
        }
        Op::SliceGrad { starts, ends, axes, steps, .. } => {
            let dy = x(0)?;
            let (base, s) = slice_view(y.shape(), y.dtype(), starts, ends, axes, steps);
            dev.fill(y.at, 0, y.meta.bytes())?;
            let at = Ptr((y.at.0 as i64 + base) as u64);
            strided_move(dev, Strided::Destination, dy.shape(), &s, y.dtype().size(), dy.at, at)
        }
        Op::Dropout { ratio, training, seed } => {
            let a = x(0)?;
            let mask = outs.get(1).map_or(NULL, |m| m.at);
            if !*training || *ratio <= 0.0 {
                dev.copy(y.at, a.at, y.meta.bytes())?;
                return match outs.get(1) {
                    Some(m) => dev.fill(m.at, 1, m.meta.bytes()),
                    None => Ok(()),
                };
            }
            let kernel = typed("dropout", a.dtype())?;
            let n = a.n();
            dev.kernel(&kernel, elementwise(n), &mut params![n as i64, *seed, *ratio, a.at, y.at, mask])
        }
        Op::DropoutGrad { ratio } => {
            let (dy, mask) = (x(0)?, x(1)?);
            let kernel = typed("dropout_grad", dy.dtype())?;
            let scale = if *ratio > 0.0 { 1.0 / (1.0 - ratio) } else { 1.0 };
            let n = dy.n();
            dev.kernel(&kernel, elementwise(n), &mut params![n as i64, scale, dy.at, mask.at, y.at])
        }
        Op::Trilu { upper, k } => {
            let a = x(0)?;
            let r = a.shape().len();
            if r < 2 {
                return refused!("Trilu needs at least 2 dimensions");
            }
            let kernel = sized("trilu", a.dtype())?;
            let n = a.n();
            let (rows, cols) = (a.shape()[r - 2] as i64, a.shape()[r - 1] as i64);
            dev.kernel(&kernel, elementwise(n), &mut params![n as i64, rows, cols, *upper as i32, *k, a.at, y.at])
        }
        Op::MatMul => matmul(dev, x(0)?, x(1)?, None, false, false, Epilogue::Plain, y),
        Op::FusedMatMul { trans_a, trans_b, activation } => {
            let epilogue = match activation {
                None => Epilogue::Plain,
                Some(Unary::GeluTanh) => Epilogue::Gelu { aux: outs.get(1).map_or(0, |pre| pre.at.0) },
                Some(u) => return refused!("no CUDA epilogue for a fused {u:?}"),
            };
            matmul(dev, x(0)?, x(1)?, ins.get(2).copied().flatten(), *trans_a, *trans_b, epilogue, y)
        }
        Op::MatMulUnaryGrad { trans_a, trans_b, activation: Unary::GeluTanh } => {
            let pre = x(2)?;
            if pre.meta != y.meta {
                return refused!("a GELU's input {:?} against its gradient {:?}", pre.meta, y.meta);
            }
            matmul(dev, x(0)?, x(1)?, None, *trans_a, *trans_b, Epilogue::GeluGrad { aux: pre.at.0 }, y)
        }
        Op::MatMulUnaryGrad { activation, .. } => refused!("no CUDA epilogue for the gradient of {activation:?}"),
        Op::Gemm { alpha, beta, trans_a, trans_b } => {
            let c = ins.get(2).copied().flatten().filter(|_| *beta != 0.0);
            if let Some(c) = c {
                // D starts as C broadcast to the output, and cuBLASLt adds beta·D to the product
                // (in D's type: f32, or a half type under mixed precision).
                if c.dtype() != y.dtype() {
                    return refused!("C is {} and the output {}; Gemm takes them alike", c.dtype(), y.dtype());
                }
                let s = broadcast(c.shape(), y.shape())?;
                let size = c.dtype().size();
                strided_move(dev, Strided::Source, y.shape(), &s.at[..y.shape().len()], size, c.at, y.at)?;
            }
            let (a, b) = (x(0)?, x(1)?);
            if a.shape().len() != 2 || b.shape().len() != 2 {
                return refused!("Gemm takes 2-D operands");
            }
            let beta = if c.is_some() { *beta } else { 0.0 };
            product(dev, a, b, *trans_a, *trans_b, *alpha, beta, None, Epilogue::Plain, y)
        }
        Op::Softmax { axis } | Op::LogSoftmax { axis } => {
            let a = x(0)?;
            need_f32(&a, "the input")?;
            let (outer, n, inner) = around(a.shape(), norm_axis(*axis, a.shape().len())?);
            let log = matches!(op, Op::LogSoftmax { .. }) as i32;
            if inner == 1 {
                dev.kernel("softmax_rows", per_row(outer), &mut params![log, n as i64, a.at, y.at])
            } else {
                let (outer, n, inner) = (outer as i64, n as i64, inner as i64);
                let lines = elementwise((outer * inner) as usize);
                dev.kernel("softmax_strided", lines, &mut params![log, outer, n, inner, a.at, y.at])
            }
        }
        Op::SoftmaxGrad { axis } | Op::LogSoftmaxGrad { axis } => {
            let (dy, out) = (x(0)?, x(1)?);
            need_f32(&dy, "the gradient")?;
            let (outer, n, inner) = around(out.shape(), norm_axis(*axis, out.shape().len())?);
            let log = matches!(op, Op::LogSoftmaxGrad { .. }) as i32;
            if inner == 1 {
                dev.kernel("softmax_grad_rows", per_row(outer), &mut params![log, n as i64, dy.at, out.at, y.at])
            } else {
                let (outer, n, inner) = (outer as i64, n as i64, inner as i64);
                let lines = elementwise((outer * inner) as usize);
                dev.kernel("softmax_grad_strided", lines, &mut params![log, outer, n, inner, dy.at, out.at, y.at])
            }
        }
        Op::LayerNorm { axis, epsilon, rms } | Op::ResidualLayerNorm { axis, epsilon, rms } => {
            // ResidualLayerNorm: X, B, scale (, bias) -> Y, S (, mean, inv_std); LayerNorm has
            // neither B nor S.
            let residual = matches!(op, Op::ResidualLayerNorm { .. });
            let k = residual as usize;
            let (a, scale, bias) = (x(0)?, x(1 + k)?, ins.get(2 + k).copied().flatten());
            need_f32(&a, "the input")?;
            let (rows, cols) = split_at_axis(a.shape(), *axis)?;
            if scale.n() != cols || bias.is_some_and(|b| b.n() != cols) {
                return refused!("{}'s scale and bias must cover the normalized dims", op.onnx_name().0);
            }
            let (branch, sum) = if residual {
                let (b, s) = (x(1)?, outs.get(1).ok_or_else(|| BackendError::refused("ResidualLayerNorm writes S"))?);
                if b.shape() != a.shape() || b.dtype() != y.dtype() || s.meta != a.meta {
                    return refused!("ResidualLayerNorm's branch must be shaped like the residual and typed like Y");
                }
                (b.at, s.at)
            } else {
                (NULL, NULL)
            };
            let stat = |i: usize| outs.get(i + k).map_or(NULL, |m| m.at);
            let bias = bias.map_or(NULL, |b| b.at);
            let (r, c, eps) = (*rms as i32, cols as i64, *epsilon);
            dev.kernel(
                &typed("layer_norm_rows", y.dtype())?,
                per_row(rows),
                &mut params![r, c, eps, a.at, branch, scale.at, bias, y.at, sum, stat(1), stat(2)],
            )
        }
        Op::LayerNormGrad { axis, rms } => {
            let (dy, a, scale, mean, inv) = (x(0)?, x(1)?, x(2)?, x(3)?, x(4)?);
            need_f32(&a, "the input")?;
            let (rows, cols) = split_at_axis(a.shape(), *axis)?;
            let dx_in = ins.get(5).copied().flatten();
            if dx_in.is_some_and(|d| d.n() != a.n() || d.dtype() != DType::F32) {
                return refused!("LayerNormGrad's added gradient must be f32 and shaped like the input");
            }
            let dx_half = outs.get(3);
            if dx_half.is_some_and(|h| h.dtype() != dy.dtype() || h.n() != a.n()) {
                return refused!("LayerNormGrad's half dX must be typed like dY and shaped like the input");
            }
            let (dx_in, dx_half) = (dx_in.map_or(NULL, |d| d.at), dx_half.map_or(NULL, |h| h.at));
            dev.kernel(
                &typed("layer_norm_grad_rows", dy.dtype())?,
                per_row(rows),
                &mut params![*rms as i32, cols as i64, dy.at, a.at, scale.at, mean.at, inv.at, dx_in, y.at, dx_half],
            )?;
            if let Some(dscale) = outs.get(1) {
                let x_hat = Some((a.at, mean.at, inv.at));
                column_sum(dev, [dy.dtype(), DType::F32], rows, cols, dy.at, x_hat, dscale.at)?;
            }
            if let Some(dbias) = outs.get(2) {
                column_sum(dev, [dy.dtype(), DType::F32], rows, cols, dy.at, None, dbias.at)?;
            }
            Ok(())
        }
        Op::Gather { axis, .. } => {
            let (data, ids) = (x(0)?, x(1)?);
            let wide = ids_i64(&ids, "Gather's indices")?;
            let ax = norm_axis(*axis, data.shape().len())?;
            let (outer, dim, inner) = around(data.shape(), ax);
            let count = ids.n();
            let fault = dev.fault(|| format!("Gather over an axis of {dim}"));
            dev.kernel(
                &sized("gather", data.dtype())?,
                elementwise(outer * count * inner),
                &mut params![outer as i64, dim as i64, inner as i64, count as i64, data.at, ids.at, wide, y.at, fault],
            )
        }
        Op::CumSum { axis, exclusive, reverse } => {
            let a = x(0)?;
            let kernel = match a.dtype() {
                DType::F32 | DType::F16 | DType::BF16 | DType::F64 | DType::I32 | DType::I64 => {
                    numeric("cumsum", a.dtype())
                }
                t => return refused!("CumSum of {t} on the CUDA backend"),
            };
            let (outer, len, inner) = around(a.shape(), norm_axis(*axis, a.shape().len())?);
            let lines = outer * inner;
            dev.kernel(
                &kernel,
                elementwise(lines),
                &mut params![*exclusive as i32, *reverse as i32, lines as i64, len as i64, inner as i64, a.at, y.at],
            )
        }
        Op::ArgExtreme { max, axis, select_last_index, .. } => {
            let a = x(0)?;
            let kernel = match a.dtype() {
                DType::F32 | DType::F16 | DType::BF16 | DType::F64 | DType::I32 | DType::I64 => {
                    numeric("arg_extreme", a.dtype())
                }
                t => return refused!("ArgMax/ArgMin of {t} on the CUDA backend"),
            };
            let ax = norm_axis(*axis, a.shape().len())?;
            let st = strides(a.shape());
            let (kept, kept_strides): (Vec<usize>, Vec<i64>) = a
                .shape()
                .iter()
                .zip(&st)
                .enumerate()
                .filter(|&(k, _)| k != ax)
                .map(|(_, (&n, &s))| (n, s as i64))
                .unzip();
            let (n, len, stride) = (y.n(), a.shape()[ax], st[ax]);
            dev.kernel(
                &kernel,
                elementwise(n),
                &mut params![
                    *max as i32,
                    *select_last_index as i32,
                    n as i64,
                    dims(&kept)?,
                    strides_of(&kept_strides),
                    len as i64,
                    stride as i64,
                    a.at,
                    y.at
                ],
            )
        }
        Op::TopKIndices { axis, k, largest } => {
            let a = x(0)?;
            let kernel = match a.dtype() {
                DType::F32 | DType::F16 | DType::BF16 | DType::F64 | DType::I32 | DType::I64 => {
                    numeric("top_k_indices", a.dtype())
                }
                t => return refused!("TopK of {t} on the CUDA backend"),
            };
            let (_, len, inner) = around(a.shape(), norm_axis(*axis, a.shape().len())?);
            let n = a.n();
            dev.kernel(
                &kernel,
                elementwise(n),
                &mut params![*largest as i32, n as i64, len as i64, inner as i64, *k as i64, a.at, y.at],
            )
        }
        Op::Pad { mode, pads, value } => {
            let a = x(0)?;
            let mut fill = [0u8; 8];
            let bits = Tensor::scalar(*value).cast(a.dtype());
            fill[..bits.bytes().len()].copy_from_slice(bits.bytes());
            let (od, id, is, begin) = pad_layout(pads, a.shape(), y.shape())?;
            dev.kernel(
                &sized("pad", a.dtype())?,
                elementwise(y.n()),
                &mut params![*mode as i32, y.n() as i64, od, id, is, begin, a.at, u64::from_le_bytes(fill), y.at],
            )
        }
        Op::PadGrad { mode, pads, .. } => scatter_in_f32(dev, x(0)?, y, |dy, y| {
            let (od, id, is, begin) = pad_layout(pads, y.shape(), dy.shape())?;
            dev.fill(y.at, 0, y.meta.bytes())?;
            dev.kernel(
                "pad_grad_f32",
                elementwise(dy.n()),
                &mut params![*mode as i32, dy.n() as i64, od, id, is, begin, dy.at, y.at],
            )
        }),
        Op::GatherND { batch_dims } => {
            let (data, ids) = (x(0)?, x(1)?);
            let wide = ids_i64(&ids, "GatherND's indices")?;
            let nd = NdSlices::of(*batch_dims, data.shape(), ids.shape())?;
            let fault = dev.fault(|| format!("GatherND into {:?}", data.shape()));
            let n = y.n();
            dev.kernel(
                &sized("gather_nd", data.dtype())?,
                elementwise(n),
                &mut params![
                    n as i64,
                    nd.inner,
                    nd.per_batch,
                    nd.batch_stride,
                    nd.kd,
                    nd.ks,
                    data.at,
                    ids.at,
                    wide,
                    y.at,
                    fault
                ],
            )
        }
        Op::GatherNDGrad { batch_dims, .. } => {
            let ids = x(1)?;
            let wide = ids_i64(&ids, "GatherNDGrad's indices")?;
            let nd = NdSlices::of(*batch_dims, y.shape(), ids.shape())?;
            scatter_in_f32(dev, x(0)?, y, |dy, y| {
                dev.fill(y.at, 0, y.meta.bytes())?;
                let n = dy.n() as i64;
                let (inner, per_batch, batch_stride) = (nd.inner, nd.per_batch, nd.batch_stride);
                dev.kernel(
                    "gather_nd_grad_f32",
                    elementwise(dy.n()),
                    &mut params![n, inner, per_batch, batch_stride, nd.kd, nd.ks, dy.at, ids.at, wide, y.at],
                )
            })
        }
        Op::ScatterElements { axis, reduction } => {
            let (data, ids, updates) = (x(0)?, x(1)?, x(2)?);
            let wide = ids_i64(&ids, "ScatterElements' indices")?;
            let ax = norm_axis(*axis, data.shape().len())?;
            let (n, m, d, sd) = (y.n() as i64, ids.n() as i64, dims(ids.shape())?, contiguous_strides(data.shape()));
            let dim = data.shape()[ax] as i64;
            dev.copy(y.at, data.at, data.meta.bytes())?;
            match reduction {
                ScatterReduction::None => dev.kernel(
                    &sized("scatter_elements", data.dtype())?,
                    elementwise(y.n()),
                    &mut params![n, m, d, ax as i32, dim, sd, updates.at, ids.at, wide, y.at],
                ),
                r => dev.kernel(
                    &float_kernel("scatter_elements_reduce", data.dtype())?,
                    elementwise(y.n()),
                    &mut params![*r as i32, n, m, d, ax as i32, dim, sd, updates.at, ids.at, wide, y.at],
                ),
            }
        }
        Op::ScatterND { reduction } => {
            let (data, ids, updates) = (x(0)?, x(1)?, x(2)?);
            let wide = ids_i64(&ids, "ScatterND's indices")?;
            let nd = NdSlices::of(0, data.shape(), ids.shape())?;
            let tuples = (ids.n() / ids.shape().last().copied().unwrap_or(1).max(1)) as i64;
            dev.copy(y.at, data.at, data.meta.bytes())?;
            let n = y.n() as i64;
            match reduction {
                ScatterReduction::None => dev.kernel(
                    &sized("scatter_nd", data.dtype())?,
                    elementwise(y.n()),
                    &mut params![n, tuples, nd.inner, nd.kd, nd.ks, updates.at, ids.at, wide, y.at],
                ),
                r => dev.kernel(
                    &float_kernel("scatter_nd_reduce", data.dtype())?,
                    elementwise(y.n()),
                    &mut params![*r as i32, n, tuples, nd.inner, nd.kd, nd.ks, updates.at, ids.at, wide, y.at],
                ),
            }
        }
        Op::GatherElements { axis } => {
            let (data, ids) = (x(0)?, x(1)?);
            let wide = ids_i64(&ids, "GatherElements' indices")?;
            let ax = norm_axis(*axis, data.shape().len())?;
            let dim = data.shape()[ax];
            let (n, d, sd) = (ids.n(), dims(ids.shape())?, contiguous_strides(data.shape()));
            let fault = dev.fault(|| format!("GatherElements over an axis of {dim}"));
            dev.kernel(
                &sized("gather_elements", data.dtype())?,
                elementwise(n),
                &mut params![n as i64, d, ax as i32, dim as i64, sd, data.at, ids.at, wide, y.at, fault],
            )
        }
        Op::GatherElementsGrad { axis, .. } => {
            let ids = x(1)?;
            let wide = ids_i64(&ids, "GatherElementsGrad's indices")?;
            let ax = norm_axis(*axis, y.shape().len())?;
            let dim = y.shape()[ax];
            let (n, d, sd) = (ids.n(), dims(ids.shape())?, contiguous_strides(y.shape()));
            scatter_in_f32(dev, x(0)?, y, |dy, y| {
                dev.fill(y.at, 0, y.meta.bytes())?;
                dev.kernel(
                    "gather_elements_grad_f32",
                    elementwise(n),
                    &mut params![n as i64, d, ax as i32, dim as i64, sd, dy.at, ids.at, wide, y.at],
                )
            })
        }
        Op::GatherGrad { axis, .. } => {
            let ids = x(1)?;
            let wide = ids_i64(&ids, "GatherGrad's indices")?;
            let ax = norm_axis(*axis, y.shape().len())?;
            let (outer, dim, inner) = around(y.shape(), ax);
            let count = ids.n();
            scatter_in_f32(dev, x(0)?, y, |dy, y| {
                dev.fill(y.at, 0, y.meta.bytes())?;
                dev.kernel(
                    "gather_grad_f32",
                    elementwise(outer * count * inner),
                    &mut params![outer as i64, dim as i64, inner as i64, count as i64, dy.at, ids.at, wide, y.at],
                )
            })
        }
        Op::ReduceSumTo { .. } => reduce_sum_to(dev, x(0)?, y),
        Op::NegativeLogLikelihoodLoss { reduction, ignore_index } => {
            let (input, labels, w) = (x(0)?, x(1)?, ins.get(2).copied().flatten());
            let (n, c, d) = channels(input.shape())?;
            let positions = (n * d) as usize;
            let wide = ids_i64(&labels, "NegativeLogLikelihoodLoss' labels")?;
            let (has_ignore, ignore) = (ignore_index.is_some() as i32, ignore_index.unwrap_or(0));
            let w_at = w.map_or(NULL, |w| w.at);
            let fault = dev.fault(|| format!("NegativeLogLikelihoodLoss over {c} classes"));
            let t = input.dtype();
            let per_meta = Meta::new(t, &[positions]);
            let scratch = scratch_parts(dev, &[positions * t.size(); 2])?;
            let per = if *reduction == LossReduction::None { y } else { V { meta: &per_meta, at: scratch[0] } };
            dev.kernel(
                &float_kernel("nll", t)?,
                elementwise(positions),
                &mut params![
                    positions as i64,
                    c as i64,
                    d,
                    input.at,
                    labels.at,
                    wide,
                    has_ignore,
                    ignore,
                    w_at,
                    per.at,
                    fault
                ],
            )?;
            if *reduction == LossReduction::None {
                return Ok(());
            }
            reduce_strided(dev, Reduce::Sum, per, &[true], y)?;
            if *reduction == LossReduction::Mean {
                let counted = V { meta: &per_meta, at: scratch[1] };
                let den = nll_denominator(dev, &labels, w, c, *ignore_index, counted, y.meta)?;
                binary(dev, Binary::Div, y, den, y)?;
            }
            Ok(())
        }
        Op::NegativeLogLikelihoodLossGrad { reduction, ignore_index, .. } => {
            let (dloss, labels, w) = (x(0)?, x(1)?, ins.get(2).copied().flatten());
            let (n, c, d) = channels(y.shape())?;
            let positions = (n * d) as usize;
            let wide = ids_i64(&labels, "NegativeLogLikelihoodLoss' labels")?;
            let (has_ignore, ignore) = (ignore_index.is_some() as i32, ignore_index.unwrap_or(0));
            let t = y.dtype();
            let counted_meta = Meta::new(t, &[positions]);
            let den = match reduction {
                LossReduction::Mean => {
                    let at = scratch_parts(dev, &[positions * t.size()])?[0];
                    let counted = V { meta: &counted_meta, at };
                    nll_denominator(dev, &labels, w, c, *ignore_index, counted, dloss.meta)?.at
                }
                _ => NULL,
            };
            dev.fill(y.at, 0, y.meta.bytes())?;
            let per_position = (*reduction == LossReduction::None) as i32;
            dev.kernel(
                &float_kernel("nll_grad", t)?,
                elementwise(positions),
                &mut params![
                    positions as i64,
                    c as i64,
                    d,
                    per_position,
                    dloss.at,
                    den,
                    labels.at,
                    wide,
                    has_ignore,
                    ignore,
                    w.map_or(NULL, |w| w.at),
                    y.at
                ],
            )
        }
        Op::SoftmaxCrossEntropyLoss { reduction, ignore_index } => {
            let (scores, labels) = (x(0)?, x(1)?);
            // Scores of a half type are read as they are (mixed precision's logits: the
            // loss_casts fusion); the loss and the log-probabilities are f32.
            let kernel = typed("cross_entropy_rows", scores.dtype())?;
            need_f32(&y, "the loss")?;
            if let Some(o) = outs.get(1) {
                need_f32(o, "the log-probabilities")?;
            }
            let l = LossRows::of(scores.shape());
            let weights = ins.get(2).copied().flatten().map_or(NULL, |w| w.at);
            // Scratch: the scores and log-probabilities as [rows, C] (spatial scores only),
            // then each row's weight and loss, the total and the denominator.
            let scratch = dev.scratch(4 * (2 * l.moved() + 2 * l.rows + 2))?;
            let (rows_x, rows_logp) = (scratch, at_f32(scratch, l.moved()));
            let (w, nll) = (at_f32(scratch, 2 * l.moved()), at_f32(scratch, 2 * l.moved() + l.rows));
            let x_rows = l.gather_rows(dev, scores.at, rows_x, scores.dtype().size())?;
            let wide = label_weights(dev, l.rows, l.cols, labels, *ignore_index, weights, w)?;
            let logp = outs.get(1).map_or(NULL, |o| if l.spatial() { rows_logp } else { o.at });
            let mut p = params![l.cols as i64, x_rows, labels.at, wide, w, logp, NULL, nll];
            dev.kernel(&kernel, per_row(l.rows), &mut p)?;
            if let Some(o) = outs.get(1).filter(|_| l.spatial()) {
                l.scatter_rows(dev, rows_logp, o.at, 4)?;
            }
            finish_loss(dev, *reduction, l.rows, nll, w, at_f32(nll, l.rows), y.at)
        }
        Op::SoftmaxCrossEntropyLse { reduction, ignore_index } => {
            // Rows [N, C] only (fuse::loss_lse): no log-probabilities, each row's log-sum-exp.
            let (scores, labels) = (x(0)?, x(1)?);
            let kernel = typed("cross_entropy_rows", scores.dtype())?;
            let [loss, lse] = outs else { return refused!("SoftmaxCrossEntropyLse has 2 outputs (loss, lse)") };
            need_f32(loss, "the loss")?;
            need_f32(lse, "the log-sum-exp")?;
            let (rows, cols) = scores_rows(&scores)?;
            let weights = ins.get(2).copied().flatten().map_or(NULL, |w| w.at);
            // Scratch: each row's weight and loss, then the total and the denominator.
            let w = dev.scratch(4 * (2 * rows + 2))?;
            let nll = at_f32(w, rows);
            let wide = label_weights(dev, rows, cols, labels, *ignore_index, weights, w)?;
            let mut p = params![cols as i64, scores.at, labels.at, wide, w, NULL, lse.at, nll];
            dev.kernel(&kernel, per_row(rows), &mut p)?;
            finish_loss(dev, *reduction, rows, nll, w, at_f32(nll, rows), loss.at)
        }
        Op::SoftmaxCrossEntropyLossGrad { reduction, ignore_index } => {
            let (dloss, logp, labels) = (x(0)?, x(1)?, x(2)?);
            need_f32(&logp, "the log-probabilities")?;
            // The gradient in the scores' type (f32, or half after the loss_casts fusion).
            let kernel = typed("cross_entropy_grad_rows", y.dtype())?;
            let l = LossRows::of(logp.shape());
            let weights = ins.get(3).copied().flatten().map_or(NULL, |w| w.at);
            // Scratch: the log-probabilities and the gradient as [rows, C] (spatial only), then
            // each row's weight and the denominator.
            let scratch = dev.scratch(4 * (2 * l.moved() + l.rows + 1))?;
            let (rows_logp, rows_dx) = (scratch, at_f32(scratch, l.moved()));
            let (w, den) = (at_f32(scratch, 2 * l.moved()), at_f32(scratch, 2 * l.moved() + l.rows));
            let logp_rows = l.gather_rows(dev, logp.at, rows_logp, 4)?;
            let wide = label_weights(dev, l.rows, l.cols, labels, *ignore_index, weights, w)?;
            dev.kernel("sum_one_block", per_row(1), &mut params![l.rows as i64, w, den])?;
            let code = reduction_code(*reduction);
            let dx = if l.spatial() { rows_dx } else { y.at };
            dev.kernel(
                &kernel,
                per_row(l.rows),
                &mut params![l.cols as i64, code, dloss.at, logp_rows, labels.at, wide, w, den, dx],
            )?;
            if l.spatial() {
                l.scatter_rows(dev, rows_dx, y.at, y.dtype().size())?;
            }
            Ok(())
        }
        Op::SoftmaxCrossEntropyLseGrad { reduction, ignore_index } => {
            let (dloss, scores, lse, labels) = (x(0)?, x(1)?, x(2)?, x(3)?);
            need_f32(&lse, "the log-sum-exp")?;
            if y.dtype() != scores.dtype() {
                return refused!("the gradient ({}) is not of the scores' type ({})", y.dtype(), scores.dtype());
            }
            let kernel = typed("cross_entropy_lse_grad_rows", y.dtype())?;
            let (rows, cols) = scores_rows(&scores)?;
            let weights = ins.get(4).copied().flatten().map_or(NULL, |w| w.at);
            // Scratch: each row's weight, then the denominator.
            let w = dev.scratch(4 * (rows + 1))?;
            let den = at_f32(w, rows);
            let wide = label_weights(dev, rows, cols, labels, *ignore_index, weights, w)?;
            dev.kernel("sum_one_block", per_row(1), &mut params![rows as i64, w, den])?;
            let code = reduction_code(*reduction);
            let mut p = params![cols as i64, code, dloss.at, scores.at, lse.at, labels.at, wide, w, den, y.at];
            dev.kernel(&kernel, per_row(rows), &mut p)
        }
        Op::Conv { window, group } => window::conv(dev, window, *group, x(0)?, x(1)?, ins.get(2).copied().flatten(), y),
        Op::ConvGrad { window, group } => {
            let [dx, dw, db] = outs else { return refused!("ConvGrad has 3 outputs (dX, dW, dB)") };
            window::conv_grad(dev, window, *group, x(0)?, x(1)?, x(2)?, [*dx, *dw, *db])
        }
        Op::ConvTranspose { window, group, .. } => {
            window::conv_transpose(dev, window, *group, x(0)?, x(1)?, ins.get(2).copied().flatten(), y)
        }
        Op::ConvTransposeGrad { window, group } => {
            let [dx, dw, db] = outs else { return refused!("ConvTransposeGrad has 3 outputs (dX, dW, dB)") };
            window::conv_transpose_grad(dev, window, *group, x(0)?, x(1)?, x(2)?, [*dx, *dw, *db])
        }
        Op::Resize(r) => resize::resize(dev, r, x(0)?, y),
        Op::ResizeGrad { resize: r, .. } => resize::resize_grad(dev, r, x(0)?, y),
        Op::Attention { scale, causal, layout } => {
            let spec = attention::Spec { scale: *scale, causal: *causal, layout: *layout };
            let operands = (0..layout.operands()).map(x).collect::<Result<Vec<_>, _>>()?;
            attention::forward(dev, spec, &operands, y, outs.get(1).copied())
        }
        Op::AttentionGrad { scale, causal, layout } => {
            let spec = attention::Spec { scale: *scale, causal: *causal, layout: *layout };
            let ins = (0..layout.operands() + 3).map(x).collect::<Result<Vec<_>, _>>()?;
            attention::backward(dev, spec, &ins, outs)
        }
        Op::Pool { kind, window } => window::pool(dev, *kind, window, x(0)?, y, outs.get(1).copied()),
        Op::PoolGrad { kind, window } => window::pool_grad(dev, *kind, window, x(0)?, x(1)?, y),
        Op::GlobalAveragePool => window::global_average_pool(dev, x(0)?, y),
        Op::ReduceOp { kind, axes, .. } => {
            let a = x(0)?;
            let rank = a.shape().len();
            let mut reduced = vec![false; rank];
            for &ax in axes.as_deref().unwrap_or(&[]) {
                reduced[norm_axis(ax, rank)?] = true;
            }
            // Binding resolves the default (every axis) into the list; none left is ONNX's
            // noop_with_empty_axes, each element its own row (SumSquare still squares).
            let trailing = reduced.iter().skip_while(|&&r| !r).all(|&r| r);
            match a.dtype() {
                // reduce_rows takes the kinds up to SumSquare.
                DType::F32 if trailing && (*kind as i32) <= Reduce::SumSquare as i32 => {
                    let cols: usize = a.shape().iter().zip(&reduced).filter(|(_, &r)| r).map(|(&n, _)| n).product();
                    let rows = a.n() / cols.max(1);
                    dev.kernel("reduce_rows", per_row(rows), &mut params![*kind as i32, cols as i64, a.at, y.at])
                }
                DType::F32 | DType::F16 | DType::BF16 | DType::F64 => reduce_strided(dev, *kind, a, &reduced, y),
                // Other element types reduce in f64, as the CPU backend's reduce does.
                _ => through_f64(dev, &[a], y, |wide, y| reduce_strided(dev, *kind, wide[0], &reduced, y)),
            }
        }
        Op::ShardGather { start } => shard::gather(dev, *start, x(0)?, x(1)?, y),
        Op::ShardGatherGrad { start, .. } => shard::gather_grad(dev, *start, x(0)?, x(1)?, y),
        Op::VocabShardCrossEntropy { start, ignore_index, .. } => {
            let [sums, targets] = outs else { return refused!("VocabShardCrossEntropy has 2 outputs") };
            shard::cross_entropy(dev, *start, *ignore_index, [x(0)?, x(1)?, x(2)?], [*sums, *targets])
        }
        Op::VocabShardCrossEntropyGrad { start, ignore_index } => {
            let ins = [x(0)?, x(1)?, x(2)?, x(3)?, x(4)?];
            shard::cross_entropy_grad(dev, *start, *ignore_index, ins, y)
        }
        Op::VocabParallelLoss { reduction, ignore_index } => {
            shard::loss(dev, *reduction, *ignore_index, [x(0)?, x(1)?, x(2)?], y)
        }
        Op::VocabParallelLossGrad { reduction, ignore_index } => {
            let [dsums, dtargets] = outs else { return refused!("VocabParallelLossGrad has 2 outputs") };
            shard::loss_grad(dev, *reduction, *ignore_index, [x(0)?, x(1)?, x(2)?], [*dsums, *dtargets])
        }
        Op::BatchNorm { epsilon, momentum, training } => {
            let ins = [x(0)?, x(1)?, x(2)?, x(3)?, x(4)?];
            channels::batch_norm(dev, (*epsilon, *momentum, *training, false), ins, outs)
        }
        Op::BatchNormRelu { epsilon, momentum } => {
            channels::batch_norm(dev, (*epsilon, *momentum, true, true), [x(0)?, x(1)?, x(2)?, x(3)?, x(4)?], outs)
        }
        Op::BatchNormGrad { epsilon } => channels::batch_norm_grad(dev, *epsilon, [x(0)?, x(1)?, x(2)?], None, outs),
        Op::BatchNormReluGrad { epsilon } => {
            channels::batch_norm_grad(dev, *epsilon, [x(0)?, x(1)?, x(2)?], Some(x(3)?), outs)
        }
        other => refused!("{} has no CUDA kernel yet", other.onnx_name().0),
    }
}

/// An N × C × … tensor as (N, C, the product of the rest), for the per-channel kernels.
fn channels(shape: &[usize]) -> Result<(i64, usize, i64), BackendError> {
    if shape.len() < 2 {
        return refused!("a rank-{} input where N × C × … is expected", shape.len());
    }
    Ok((shape[0] as i64, shape[1], shape[2..].iter().product::<usize>() as i64))
}

/// y = u(a), elementwise; y may be a. Floats run in their own type (halves in f32), integers
/// through f64 (exact up to 32-bit elements); predicates write bools.
fn unary(dev: Dev, u: Unary, a: V, y: V) -> Result<(), BackendError> {
    let (n, [p0, p1], code) = (a.n(), u.params(), u.code());
    match (u, a.dtype()) {
        (Unary::Not, DType::Bool) => dev.kernel("not_u8", elementwise(n), &mut params![n as i64, a.at, y.at]),
        (Unary::Not, t) => refused!("Not of {t} (a bool operand expected)"),
        (_, t) if u.is_predicate() => {
            let kernel = float_kernel("unary_predicate", t)?;
            dev.kernel(&kernel, elementwise(n), &mut params![code, p0, p1, n as i64, a.at, y.at])
        }
        (_, DType::Bool) => refused!("{u:?} of bool has no CUDA kernel (nor an ONNX meaning)"),
        (_, t) if t.is_float() => {
            dev.kernel(&float_kernel("unary", t)?, elementwise(n), &mut params![code, p0, p1, n as i64, a.at, y.at])
        }
        _ => through_f64(dev, &[a], y, |wide, y| unary(dev, u, wide[0], y)),
    }
}

/// out = a op b, broadcasting; out may be a (the n-ary fold accumulates in place).
fn binary(dev: Dev, op: Binary, a: V, b: V, y: V) -> Result<(), BackendError> {
    let t = a.dtype();
    if b.dtype() != t {
        return match op {
            Binary::Pow => pow_through_f64(dev, a, b, y),
            _ => refused!("{op:?} of {t} and {} (the operands' types must agree)", b.dtype()),
        };
    }
    let n = y.n();
    let d = dims(y.shape())?;
    let (sa, sb) = (broadcast(a.shape(), y.shape())?, broadcast(b.shape(), y.shape())?);
    let code = op as i32;
    match op {
        _ if op.is_logic() && t == DType::Bool => {
            dev.kernel("logic_u8", elementwise(n), &mut params![code, n as i64, d, a.at, sa, b.at, sb, y.at])
        }
        _ if op.is_logic() => refused!("{op:?} of {t} (bool operands expected)"),
        _ if op.is_predicate() => dev.kernel(
            &numeric("compare", t),
            elementwise(n),
            &mut params![code, n as i64, d, a.at, sa, b.at, sb, y.at],
        ),
        _ if t == DType::Bool => refused!("{op:?} of bool has no CUDA kernel (nor an ONNX meaning)"),
        _ => {
            let (ka, pa) = reach(a.shape(), y.shape());
            let (kb, pb) = reach(b.shape(), y.shape());
            dev.kernel(
                &numeric("binary", t),
                elementwise(n),
                &mut params![code, n as i64, d, a.at, sa, ka, pa, b.at, sb, kb, pb, y.at],
            )
        }
    }
}

/// The divisor of NegativeLogLikelihoodLoss's mean: each position's weight (w[label], 1 without
/// weights, 0 where ignored) into `counted`, summed into its first element, returned as a value
/// of the scalar meta `scalar` (the loss's, or its gradient's).
fn nll_denominator<'a>(
    dev: Dev,
    labels: &V,
    w: Option<V>,
    classes: usize,
    ignore_index: Option<i64>,
    counted: V,
    scalar: &'a Meta,
) -> Result<V<'a>, BackendError> {
    let positions = counted.n();
    let wide = ids_i64(labels, "NegativeLogLikelihoodLoss' labels")?;
    let (has_ignore, ignore) = (ignore_index.is_some() as i32, ignore_index.unwrap_or(0));
    let w = w.map_or(NULL, |w| w.at);
    dev.kernel(
        &float_kernel("nll_weights", counted.dtype())?,
        elementwise(positions),
        &mut params![positions as i64, classes as i64, labels.at, wide, has_ignore, ignore, w, counted.at, NULL],
    )?;
    let den = V { meta: scalar, at: counted.at };
    reduce_strided(dev, Reduce::Sum, counted, &[true], den)?;
    Ok(den)
}

/// Pow with an exponent of another type than the base (ONNX's T1): both widened to f64, the
/// power taken there and converted to the output's type, as the CPU backend computes it.
fn pow_through_f64(dev: Dev, a: V, b: V, y: V) -> Result<(), BackendError> {
    through_f64(dev, &[a, b], y, |wide, y| binary(dev, Binary::Pow, wide[0], wide[1], y))
}

/// Runs `f` on f64 copies of `ins` into an f64 value of `y`'s shape, then converts that to `y`'s
/// type: how element types without kernels of their own are computed, as the CPU backend
/// computes them (through f64).
fn through_f64(
    dev: Dev,
    ins: &[V],
    y: V,
    f: impl FnOnce(&[V], V) -> Result<(), BackendError>,
) -> Result<(), BackendError> {
    widened(dev, DType::F64, ins, y, f)
}

/// Runs `f` on `wide` copies of `ins` into a `wide` value of `y`'s shape, then converts that to
/// `y`'s type.
fn widened(
    dev: Dev,
    wide: DType,
    ins: &[V],
    y: V,
    f: impl FnOnce(&[V], V) -> Result<(), BackendError>,
) -> Result<(), BackendError> {
    let values: Vec<V> = ins.iter().chain([&y]).copied().collect();
    let at = scratch_parts(dev, &values.iter().map(|v| wide.size() * v.n()).collect::<Vec<_>>())?;
    let metas: Vec<Meta> = values.iter().map(|v| Meta::new(wide, v.shape())).collect();
    let copies: Vec<V> = metas.iter().zip(at).map(|(meta, at)| V { meta, at }).collect();
    for (v, w) in ins.iter().zip(&copies) {
        cast(dev, v.dtype(), wide, v.at, w.at, v.n())?;
    }
    let (wide_ins, wide_y) = copies.split_at(ins.len());
    f(wide_ins, wide_y[0])?;
    cast(dev, wide, y.dtype(), wide_y[0].at, y.at, y.n())
}

/// Runs `f`, a gradient that scatters f32 additions, on `dy` and `y`: as they are in f32, or
/// on f32 copies of half ones (accumulated in f32 and rounded once, as the CPU backend does).
fn scatter_in_f32(dev: Dev, dy: V, y: V, f: impl FnOnce(V, V) -> Result<(), BackendError>) -> Result<(), BackendError> {
    match (dy.dtype(), y.dtype()) {
        (DType::F32, DType::F32) => f(dy, y),
        (DType::F16 | DType::BF16, t) if t == dy.dtype() => widened(dev, DType::F32, &[dy], y, |w, y| f(w[0], y)),
        (t, _) => refused!("the gradient is {t}; the CUDA kernels take f32, f16 or bf16 here"),
    }
}

/// One scratch request cut into parts of `bytes` each, every part 256-byte aligned.
fn scratch_parts(dev: Dev, bytes: &[usize]) -> Result<Vec<Ptr>, BackendError> {
    let sizes: Vec<u64> = bytes.iter().map(|&b| b.next_multiple_of(256) as u64).collect();
    let base = dev.scratch(sizes.iter().sum::<u64>() as usize)?.0;
    Ok(sizes.iter().scan(base, |at, size| Some(Ptr(std::mem::replace(at, *at + size)))).collect())
}

/// (Π shape[..axis], Π shape[axis..]).
fn split_at_axis(shape: &[usize], axis: i64) -> Result<(usize, usize), BackendError> {
    let a = norm_axis(axis, shape.len())?;
    Ok((shape[..a].iter().product(), shape[a..].iter().product()))
}

/// (outer, dim, inner) around axis `a`.
fn around(shape: &[usize], a: usize) -> (usize, usize, usize) {
    (shape[..a].iter().product(), shape[a], shape[a + 1..].iter().product())
}

/// The byte address `elements` of `t` past `at`.
fn at(at: Ptr, elements: usize, t: DType) -> Ptr {
    Ptr(at.0 + (elements * t.size()) as u64)
}

/// The byte address `elements` f32 past `at` (the loss kernels' f32 scratch).
fn at_f32(ptr: Ptr, elements: usize) -> Ptr {
    at(ptr, elements, DType::F32)
}

/// SoftmaxCrossEntropyLoss's scores [N, C] or [N, C, d…] as the kernels' rows of C classes:
/// one per (n, d…), in the labels' order. Spatial scores are moved to [N, d…, C] first, and
/// per-class outputs moved back.
struct LossRows {
    n: usize,
    cols: usize,
    /// The product of the spatial dims (1 for [N, C]).
    d: usize,
    rows: usize,
}

impl LossRows {
    fn of(shape: &[usize]) -> LossRows {
        let (n, cols) = (shape.first().copied().unwrap_or(1), shape.get(1).copied().unwrap_or(1));
        let d = shape.iter().skip(2).product();
        LossRows { n, cols, d, rows: n * d }
    }

    fn spatial(&self) -> bool {
        self.d > 1
    }

    /// Elements moved to and from rows (0 when there is nothing to move).
    fn moved(&self) -> usize {
        if self.spatial() {
            self.rows * self.cols
        } else {
            0
        }
    }

    /// [N, C, D] at `from` as [N, D, C] at `to` (elements of `esize` bytes); returns where the
    /// rows are.
    fn gather_rows(&self, dev: Dev, from: Ptr, to: Ptr, esize: usize) -> Result<Ptr, BackendError> {
        if !self.spatial() {
            return Ok(from);
        }
        let (n, c, d) = (self.n, self.cols as i64, self.d as i64);
        strided_move(dev, Strided::Source, &[n, self.d, self.cols], &[c * d, 1, d], esize, from, to)?;
        Ok(to)
    }

    /// [N, D, C] at `from` back to [N, C, D] at `to` (elements of `esize` bytes).
    fn scatter_rows(&self, dev: Dev, from: Ptr, to: Ptr, esize: usize) -> Result<(), BackendError> {
        let (n, c, d) = (self.n, self.cols as i64, self.d as i64);
        strided_move(dev, Strided::Source, &[n, self.cols, self.d], &[d * c, 1, c], esize, from, to)
    }
}

/// The loss from each row's `nll` and weight `w` (both f32 [rows], on the device) into `loss`:
/// copied as they are, or summed (and divided by the summed weights for a mean) in one block,
/// in a fixed order, the sums kept in the two f32 at `sums` (the caller's scratch).
fn finish_loss(
    dev: Dev,
    reduction: LossReduction,
    rows: usize,
    nll: Ptr,
    w: Ptr,
    sums: Ptr,
    loss: Ptr,
) -> Result<(), BackendError> {
    if reduction == LossReduction::None {
        return dev.copy(loss, nll, rows * 4);
    }
    let (total, den) = (sums, at_f32(sums, 1));
    let one = per_row(1);
    dev.kernel("sum_one_block", one, &mut params![rows as i64, nll, total])?;
    dev.kernel("sum_one_block", one, &mut params![rows as i64, w, den])?;
    let mean = (reduction == LossReduction::Mean) as i32;
    dev.kernel("loss_finish", one, &mut params![mean, total, den, loss])
}

/// A loss reduction as the cross-entropy gradient kernels take it.
fn reduction_code(r: LossReduction) -> i32 {
    match r {
        LossReduction::None => 0,
        LossReduction::Mean => 1,
        LossReduction::Sum => 2,
    }
}

/// Scores [N, C] as N rows of C classes (the fused loss' only layout).
fn scores_rows(scores: &V) -> Result<(usize, usize), BackendError> {
    match scores.shape() {
        &[rows, cols] => Ok((rows, cols)),
        s => refused!("the fused loss takes scores [N, C], not {s:?}"),
    }
}

/// Writes each row's loss weight to `w`; returns whether the labels are i64.
fn label_weights(
    dev: Dev,
    rows: usize,
    cols: usize,
    labels: V,
    ignore: Option<i64>,
    weights: Ptr,
    w: Ptr,
) -> Result<i32, BackendError> {
    let wide = ids_i64(&labels, "the labels")?;
    let fault =
        dev.fault(|| format!("SoftmaxCrossEntropyLoss: a label out of range for {cols} classes (position = row)"));
    dev.kernel(
        "label_weights",
        elementwise(rows),
        &mut params![
            rows as i64,
            cols as i64,
            labels.at,
            wide,
            ignore.is_some() as i32,
            ignore.unwrap_or(0),
            weights,
            w,
            fault
        ],
    )?;
    Ok(wide)
}

/// Column sums of [rows, cols] at `v` into `out`, optionally of v·x̂ (LayerNorm's dScale):
/// chunks of rows first, then the chunks in a fixed order, so the bits never depend on
/// scheduling.
/// `v` and `out` of the types `[from, to]`; the sums are f32.
fn column_sum(
    dev: Dev,
    [from, to]: [DType; 2],
    rows: usize,
    cols: usize,
    v: Ptr,
    x_hat: Option<(Ptr, Ptr, Ptr)>,
    out: Ptr,
) -> Result<(), BackendError> {
    const ROWS_PER_CHUNK: usize = 64;
    let chunks = rows.div_ceil(ROWS_PER_CHUNK).max(1);
    let partial = dev.scratch(chunks * cols * 4)?;
    let (xp, mean, inv) = x_hat.unwrap_or((NULL, NULL, NULL));
    let cfg = LaunchConfig {
        grid_dim: (cols.div_ceil(super::BLOCK as usize).max(1) as u32, chunks as u32, 1),
        block_dim: (super::BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    dev.kernel(
        &typed("column_sum_partial", from)?,
        cfg,
        &mut params![rows as i64, cols as i64, ROWS_PER_CHUNK as i64, v, xp, mean, inv, partial],
    )?;
    column_sum_finish(dev, to, chunks, cols, partial, out)
}

/// The chunks' partial column sums ([chunks, cols], f32) added into `out`, of type `to`: a
/// block of 1024 threads per 32 columns (rows.cu's column_sum_finish).
fn column_sum_finish(
    dev: Dev,
    to: DType,
    chunks: usize,
    cols: usize,
    partial: Ptr,
    out: Ptr,
) -> Result<(), BackendError> {
    let cfg = LaunchConfig {
        grid_dim: (cols.div_ceil(32).max(1) as u32, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    dev.kernel(&typed("column_sum_finish", to)?, cfg, &mut params![chunks as i64, cols as i64, partial, out])
}

/// ReduceSumTo: the gradient of a broadcast, summed back to the operand's shape.
fn reduce_sum_to(dev: Dev, a: V, y: V) -> Result<(), BackendError> {
    if a.n() == y.n() {
        return dev.copy(y.at, a.at, y.meta.bytes());
    }
    let (from, to) = (a.shape(), y.shape());
    // Leading dims summed away ([.., C] → [C], a bias' gradient): column sums.
    let pad = from.len().saturating_sub(to.len());
    let trailing = to.iter().skip_while(|&&d| d == 1).copied().collect::<Vec<_>>();
    if !trailing.is_empty() && from.ends_with(&trailing) {
        let cols: usize = trailing.iter().product();
        return column_sum(dev, [a.dtype(), y.dtype()], a.n() / cols, cols, a.at, None, y.at);
    }
    // Otherwise each output element sums its own set of inputs.
    let mut summed = vec![true; pad];
    for (k, &n) in from.iter().enumerate().skip(pad) {
        match to[k - pad] {
            t if t == n => summed.push(false),
            1 => summed.push(true),
            _ => return refused!("{from:?} does not sum to {to:?}"),
        }
    }
    reduce_strided(dev, Reduce::Sum, a, &summed, y)
}

/// When a reduction runs one block per output rather than one thread: where its outputs are
/// fewer than the GPU runs threads at once (a convolution's bias gradient: with a thread per
/// channel summing N·H·W values, a ConvGrad of ResNet-50's first stage took 180 ms on an H200,
/// with a block per channel under 6) and each reduces at least a block's worth of inputs. With many outputs (a row norm's 65,536) the
/// threads' serial loops were the faster, measured on the same GPU.
const BLOCK_PER_OUTPUT_BELOW: usize = 4096;
const BLOCK_PER_OUTPUT_FROM: usize = 256;

/// Reduces `a` (f32, f16, bf16 or f64) over the axes marked in `reduced` (any of them): one
/// thread per output, or one block per output (see [`BLOCK_PER_OUTPUT_BELOW`]; LogSumExp and
/// Prod stay on threads).
fn reduce_strided(dev: Dev, kind: Reduce, a: V, reduced: &[bool], y: V) -> Result<(), BackendError> {
    if !matches!(a.dtype(), DType::F32 | DType::F16 | DType::BF16 | DType::F64) || y.dtype() != a.dtype() {
        return refused!("a reduction of {} into {} (float values of one type expected)", a.dtype(), y.dtype());
    }
    let st = strides(a.shape());
    let (mut kept_shape, mut kept_strides, mut red_shape, mut red_strides) = (vec![], vec![], vec![], vec![]);
    for (k, &n) in a.shape().iter().enumerate() {
        let (shape, at) =
            if reduced[k] { (&mut red_shape, &mut red_strides) } else { (&mut kept_shape, &mut kept_strides) };
        shape.push(n);
        at.push(st[k] as i64);
    }
    let inner: usize = red_shape.iter().product();
    let n = y.n();
    let blocks = n < BLOCK_PER_OUTPUT_BELOW && inner >= BLOCK_PER_OUTPUT_FROM && (kind as i32) <= Reduce::LogSum as i32;
    let (family, cfg) = if blocks {
        ("reduce_strided_blocks", per_row(n.clamp(1, 1 << 16)))
    } else {
        ("reduce_strided", elementwise(n))
    };
    dev.kernel(
        &numeric(family, a.dtype()),
        cfg,
        &mut params![
            kind as i32,
            n as i64,
            dims(&kept_shape)?,
            strides_of(&kept_strides),
            inner as i64,
            dims(&red_shape)?,
            strides_of(&red_strides),
            a.at,
            y.at
        ],
    )
}

/// `n` elements of type `from` at `x` converted to `to` at `y` (ONNX Cast's semantics).
fn cast(dev: Dev, from: DType, to: DType, x: Ptr, y: Ptr, n: usize) -> Result<(), BackendError> {
    dev.kernel("cast", elementwise(n), &mut params![from.onnx_code(), to.onnx_code(), n as i64, x, y])
}

/// A slice of `shape` as (byte offset of its first element, element strides per output dim).
fn slice_view(shape: &[usize], t: DType, starts: &[i64], ends: &[i64], axes: &[i64], steps: &[i64]) -> (i64, Vec<i64>) {
    let plan = slice_plan(starts, ends, axes, steps, shape);
    let st = strides(shape);
    let base: i64 = plan.iter().zip(&st).map(|((s, _), &d)| s * d as i64).sum();
    let s: Vec<i64> = plan.iter().zip(&st).map(|((_, step), &d)| step * d as i64).collect();
    (base * t.size() as i64, s)
}

/// MatMul, FusedMatMul and MatMulUnaryGrad: the product with its bias and `epilogue`.
#[allow(clippy::too_many_arguments)]
fn matmul(
    dev: Dev,
    a: V,
    b: V,
    bias: Option<V>,
    trans_a: bool,
    trans_b: bool,
    epilogue: Epilogue,
    y: V,
) -> Result<(), BackendError> {
    if matches!(y.dtype(), DType::F64 | DType::I32 | DType::I64) && epilogue == Epilogue::Plain {
        plain_product(dev, a, b, trans_a, trans_b, y)?;
        return bias.map_or(Ok(()), |bias| binary(dev, Binary::Add, y, bias, y));
    }
    // A bias of the output's columns and type goes into the product's epilogue (added in f32
    // before the one rounding of D); any other broadcasts after the product, and the rest of
    // the epilogue after it.
    let columns = y.shape().last().copied().unwrap_or(1);
    let fits = bias.filter(|b| b.shape() == [columns] && b.dtype() == y.dtype());
    match bias.filter(|_| fits.is_none()) {
        None => product(dev, a, b, trans_a, trans_b, 1.0, 0.0, fits, epilogue, y),
        Some(bias) => {
            product(dev, a, b, trans_a, trans_b, 1.0, 0.0, None, Epilogue::Plain, y)?;
            binary(dev, Binary::Add, y, bias, y)?;
            activate(dev, epilogue, y)
        }
    }
}

/// y = op(a)·op(b) of f64 or integer matrices (kernels/product.cu; cuBLASLt's path takes the
/// float types with f32 sums), with numpy's broadcast of the batch dims.
fn plain_product(dev: Dev, a: V, b: V, trans_a: bool, trans_b: bool, y: V) -> Result<(), BackendError> {
    let (ra, rb, ry) = (a.shape().len(), b.shape().len(), y.shape().len());
    if a.dtype() != y.dtype() || b.dtype() != y.dtype() || ra < 2 || rb < 2 {
        let (sa, sb) = (a.shape(), b.shape());
        return refused!(
            "a product of {} {sa:?} and {} {sb:?} into {} has no CUDA path",
            a.dtype(),
            b.dtype(),
            y.dtype()
        );
    }
    let (m, k) = if trans_a { (a.shape()[ra - 1], a.shape()[ra - 2]) } else { (a.shape()[ra - 2], a.shape()[ra - 1]) };
    let n = if trans_b { b.shape()[rb - 2] } else { b.shape()[rb - 1] };
    let batch = &y.shape()[..ry - 2];
    // Each operand's strides over y's batch dims, in matrices, then in elements.
    let over_batch = |x: &V, size: usize| -> Result<Strides, BackendError> {
        let mut s = broadcast(&x.shape()[..x.shape().len() - 2], batch)?;
        s.at.iter_mut().for_each(|at| *at *= size as i64);
        Ok(s)
    };
    let (sa, sb) = (over_batch(&a, m * k)?, over_batch(&b, k * n)?);
    let count = y.n();
    dev.kernel(
        &numeric("matmul_plain", y.dtype()),
        elementwise(count),
        &mut params![
            count as i64,
            m as i64,
            n as i64,
            k as i64,
            trans_a as i32,
            trans_b as i32,
            dims(batch)?,
            a.at,
            sa,
            b.at,
            sb,
            y.at
        ],
    )
}

/// y = alpha·op(a)·op(b) + beta·y (+ bias, a vector of y's columns) over the batch dims of y;
/// each operand has those batch dims or none (shared by the whole batch).
#[allow(clippy::too_many_arguments)]
fn product(
    dev: Dev,
    a: V,
    b: V,
    trans_a: bool,
    trans_b: bool,
    alpha: f32,
    beta: f32,
    bias: Option<V>,
    epilogue: Epilogue,
    y: V,
) -> Result<(), BackendError> {
    let dtype = a.dtype();
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) || b.dtype() != dtype || y.dtype() != dtype {
        return refused!(
            "a product of {} and {} into {} has no CUDA path (f32, f16 or bf16 throughout)",
            a.dtype(),
            b.dtype(),
            y.dtype()
        );
    }
    let (ra, rb, ry) = (a.shape().len(), b.shape().len(), y.shape().len());
    if ra < 2 || rb < 2 {
        return refused!("MatMul of a 1-D operand has no CUDA path yet");
    }
    let (m, k) = if trans_a { (a.shape()[ra - 1], a.shape()[ra - 2]) } else { (a.shape()[ra - 2], a.shape()[ra - 1]) };
    let n = if trans_b { b.shape()[rb - 2] } else { b.shape()[rb - 1] };
    let batch_dims = &y.shape()[..ry - 2];
    let batch: usize = batch_dims.iter().product();
    let stride_of = |x: &V, rows: usize, cols: usize| -> Result<i64, BackendError> {
        let own = &x.shape()[..x.shape().len() - 2];
        if own.iter().product::<usize>() == 1 {
            Ok(0)
        } else if own == batch_dims {
            Ok((rows * cols) as i64)
        } else {
            refused!("MatMul batch dims {own:?} against {batch_dims:?}: no CUDA path for this broadcast")
        }
    };
    let (a_stride, b_stride) = (stride_of(&a, m, k)?, stride_of(&b, k, n)?);
    let p = if b_stride == 0 && a_stride != 0 && !trans_a {
        // A shared B: the batch folds into A's rows, one larger product.
        Product {
            m: (batch * m) as u64,
            n: n as u64,
            k: k as u64,
            batch: 1,
            trans_a,
            trans_b,
            a: a.at.0,
            a_stride: 0,
            b: b.at.0,
            b_stride: 0,
            d: y.at.0,
            d_stride: (batch * m * n) as i64,
            alpha,
            beta,
            dtype,
            d_dtype: dtype,
            bias: bias.map_or(0, |b| b.at.0),
            epilogue,
        }
    } else {
        Product {
            m: m as u64,
            n: n as u64,
            k: k as u64,
            batch: batch as u64,
            trans_a,
            trans_b,
            a: a.at.0,
            a_stride,
            b: b.at.0,
            b_stride,
            d: y.at.0,
            d_stride: (m * n) as i64,
            alpha,
            beta,
            dtype,
            d_dtype: dtype,
            bias: bias.map_or(0, |b| b.at.0),
            epilogue,
        }
    };
    match padding(&p) {
        Some(shapes) => padded_product(dev, &p, shapes),
        None => dev.gemm(&p),
    }
}

/// A product's A, B and D with each matrix's row rounded up to whole 16-byte words, where one
/// is not (GPT-2's tied LM head: 50257 logits a row) and the product is one `padded_product`
/// takes: a single plain product that writes D. Only a dimension that is some matrix's row is
/// padded: n always (D's), m when A is stored transposed, k when A is not or B is.
fn padding(p: &Product) -> Option<[Padded; 3]> {
    let plain = p.batch == 1 && !p.has_epilogue() && p.beta == 0.0 && p.d_dtype == p.dtype;
    if !plain || p.m * p.n * p.k == 0 {
        return None;
    }
    let up = |x: u64| x.next_multiple_of(16 / p.dtype.size() as u64);
    let mp = if p.trans_a { up(p.m) } else { p.m };
    let kp = if !p.trans_a || p.trans_b { up(p.k) } else { p.k };
    let np = up(p.n);
    let matrix = |(rows, cols): (u64, u64), (rows_p, cols_p): (u64, u64)| Padded { rows, cols, rows_p, cols_p };
    let a = if p.trans_a { matrix((p.k, p.m), (kp, mp)) } else { matrix((p.m, p.k), (mp, kp)) };
    let b = if p.trans_b { matrix((p.n, p.k), (np, kp)) } else { matrix((p.k, p.n), (kp, np)) };
    let d = matrix((p.m, p.n), (mp, np));
    [a, b, d].iter().any(Padded::pads).then_some([a, b, d])
}

/// A product whose matrices' rows are not 16-byte aligned, run on copies whose rows are (the
/// `padding` shapes): the operands copied into zeroed padded buffers (the zeros add nothing to
/// any sum) and D copied out of a padded one. cuBLASLt's tensor-core kernels need those
/// alignments; without them it falls back to kernels several times slower (measured on an H100:
/// the LM head's three products over 50257 columns ran at 100 to 150 TFLOP/s, the layers' at
/// 640). The copies cost a pass over each padded matrix.
fn padded_product(dev: Dev, p: &Product, [a, b, d]: [Padded; 3]) -> Result<(), BackendError> {
    let esize = p.dtype.size();
    let parts = scratch_parts(dev, &[a.scratch(esize), b.scratch(esize), d.scratch(esize)])?;
    let a_at = a.stage_in(dev, Ptr(p.a), parts[0], esize)?;
    let b_at = b.stage_in(dev, Ptr(p.b), parts[1], esize)?;
    let d_at = if d.pads() { parts[2] } else { Ptr(p.d) };
    let (m, n, k) = (d.rows_p, d.cols_p, if p.trans_a { a.rows_p } else { a.cols_p });
    let padded = Product { m, n, k, a: a_at.0, b: b_at.0, d: d_at.0, d_stride: (m * n) as i64, ..*p };
    dev.gemm(&padded)?;
    if d.pads() {
        let (shape, strides) = ([d.rows as usize, d.cols as usize], [d.cols_p as i64, 1]);
        strided_move(dev, Strided::Source, &shape, &strides, esize, d_at, Ptr(p.d))?;
    }
    Ok(())
}

/// A row-major matrix of a product, `rows` × `cols` as stored, and its shape padded to rows of
/// whole 16-byte words.
#[derive(Clone, Copy)]
struct Padded {
    rows: u64,
    cols: u64,
    rows_p: u64,
    cols_p: u64,
}

impl Padded {
    fn pads(&self) -> bool {
        (self.rows, self.cols) != (self.rows_p, self.cols_p)
    }

    /// The scratch bytes of its padded copy (none when it needs none).
    fn scratch(&self, esize: usize) -> usize {
        if self.pads() {
            (self.rows_p * self.cols_p) as usize * esize
        } else {
            0
        }
    }

    /// Where the product reads it: `from` itself, or its copy at `to` with zeros around it.
    fn stage_in(&self, dev: Dev, from: Ptr, to: Ptr, esize: usize) -> Result<Ptr, BackendError> {
        if !self.pads() {
            return Ok(from);
        }
        let (rows, cols, cols_p) = (self.rows as usize, self.cols as usize, self.cols_p as usize);
        rows_move(dev, rows, cols, esize, (from, cols as i64), (to, cols_p as i64), true)?;
        let tail = (self.rows_p as usize - rows) * cols_p * esize;
        if tail > 0 {
            dev.fill(Ptr(to.0 + (rows * cols_p * esize) as u64), 0, tail)?;
        }
        Ok(to)
    }
}

/// A product's bias and epilogue applied after it, for when cuBLASLt had no algorithm with
/// them: D is packed (batch × m rows of n), the bias a vector of n and the aux laid out like D,
/// all of the product's type. Unlike cuBLASLt's, the GELU reads D rounded to its type. It must
/// ask for no scratch: measuring a step (`scratch_bytes`) does not reach it.
pub fn apply_epilogue(target: &dyn Target, p: &Product) -> Result<(), BackendError> {
    let (rows, n) = ((p.batch * p.m) as usize, p.n as usize);
    if p.batch > 1 && p.d_stride != (p.m * p.n) as i64 {
        return refused!("an epilogue for a product whose outputs are not packed: {p:?}");
    }
    let dev = Dev::new(target);
    let d = Meta::new(p.dtype, &[rows, n]);
    let d = V { meta: &d, at: Ptr(p.d) };
    if p.bias != 0 {
        let bias = Meta::new(p.dtype, &[n]);
        binary(dev, Binary::Add, d, V { meta: &bias, at: Ptr(p.bias) }, d)?;
    }
    activate(dev, p.epilogue, d)
}

/// An epilogue's activation (or activation gradient) over `y` in place, after the product.
fn activate(dev: Dev, epilogue: Epilogue, y: V) -> Result<(), BackendError> {
    let n = y.n();
    match epilogue {
        Epilogue::Plain => Ok(()),
        Epilogue::Gelu { aux } => {
            if aux != 0 {
                dev.copy(Ptr(aux), y.at, n * y.dtype().size())?;
            }
            unary(dev, Unary::GeluTanh, y, y)
        }
        Epilogue::GeluGrad { aux } => {
            let gelu = Unary::GeluTanh.code();
            let kernel = typed("unary_grad", y.dtype())?;
            dev.kernel(&kernel, elementwise(n), &mut params![gelu, 0f32, 0f32, n as i64, y.at, Ptr(aux), y.at])
        }
    }
}

/// Gradient accumulation: dst = dst·keep + src·scale.
pub fn accumulate(dev: Dev, dst: V, keep: f32, src: V, scale: f32) -> Result<(), BackendError> {
    let n = dst.n();
    dev.kernel("accumulate_f32", elementwise(n), &mut params![n as i64, dst.at, keep, src.at, scale])
}

/// Σ x² of an f32 value, in f64 (partials per block, added in order on the host).
pub fn sum_squares(dev: Dev, xs: &[V]) -> Result<f64, BackendError> {
    // Every value's blocks write their partials side by side, read back in one wait; added per
    // value in order, then over the values in order.
    let cfgs: Vec<LaunchConfig> = xs.iter().map(|x| elementwise(x.n())).collect();
    let blocks: Vec<usize> = cfgs.iter().map(|c| c.grid_dim.0 as usize).collect();
    let partial = dev.scratch(blocks.iter().sum::<usize>() * 8)?;
    let mut at = partial;
    for ((x, &cfg), &b) in xs.iter().zip(&cfgs).zip(&blocks) {
        dev.kernel("sum_squares_partial", cfg, &mut params![x.n() as i64, x.at, at])?;
        at = Ptr(at.0 + b as u64 * 8);
    }
    let partials = dev.partials(partial, blocks.iter().sum())?;
    let mut rest = &partials[..];
    let mut total = 0.0;
    for &b in &blocks {
        let (mine, after) = rest.split_at(b);
        total += mine.iter().sum::<f64>();
        rest = after;
    }
    Ok(total)
}

/// One weight's operands of an optimizer update: the weight, its gradient, its state buffers.
pub struct Slot<'a> {
    pub p: V<'a>,
    pub g: V<'a>,
    pub state: Vec<V<'a>>,
}

/// The dispatch's view of a backend's slots, through its `value` of an argument.
pub fn slots<'a, B>(slots: &'a [crate::backend::Slot<'a, B>], value: impl Fn(&Arg<'a, B>) -> V<'a>) -> Vec<Slot<'a>> {
    slots
        .iter()
        .map(|s| Slot { p: value(&s.param), g: value(&s.grad), state: s.state.iter().map(&value).collect() })
        .collect()
}

/// One piece of one weight for one block of a multi-tensor update (`Piece` in kernels/optim.cu).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Piece {
    p: u64,
    g: u64,
    s0: u64,
    s1: u64,
    n: i64,
}

/// Elements per piece: small enough that a group's pieces spread over every SM, large enough
/// that each block's loop amortises its start.
const PIECE: usize = 1 << 15;

/// The pieces of `slots` with `states` state buffers each, written to scratch memory; returns
/// the table and how many pieces it holds.
fn piece_table(dev: Dev, slots: &[Slot], states: usize) -> Result<(Ptr, usize), BackendError> {
    let mut pieces = Vec::new();
    for s in slots {
        if s.state.len() != states {
            return refused!("the update keeps {states} state buffer(s) per weight, not {}", s.state.len());
        }
        let at = |v: Option<&V>, start: usize| v.map_or(0, |v| v.at.0 + 4 * start as u64);
        for start in (0..s.p.n()).step_by(PIECE) {
            pieces.push(Piece {
                p: at(Some(&s.p), start),
                g: at(Some(&s.g), start),
                s0: at(s.state.first(), start),
                s1: at(s.state.get(1), start),
                n: (s.p.n() - start).min(PIECE) as i64,
            });
        }
    }
    let table = dev.scratch(std::mem::size_of_val(&pieces[..]))?;
    dev.write(table, bytemuck::cast_slice(&pieces))?;
    Ok((table, pieces.len()))
}

/// One slice of one pair of an Adasum exchange (`AdasumPiece` in kernels/optim.cu).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct AdasumPiece {
    x: u64,
    y: u64,
    out: u64,
    n: i64,
    tensor: i64,
}

/// Adasum of each pair (`Backend::adasum`): `mine[i]` becomes adasum(lower's, higher's) of it
/// and `theirs[i]`, in three launches over every tensor at once (dot products per piece, per
/// tensor in piece order, the combination) whose figures never leave the device.
pub fn adasum(dev: Dev, mine: &[V], theirs: &[V], mine_is_lower: bool) -> Result<(), BackendError> {
    let mut pieces = Vec::new();
    let mut first = vec![0i64];
    for (t, (m, o)) in mine.iter().zip(theirs).enumerate() {
        if m.dtype() != DType::F32 || o.meta != m.meta {
            return refused!("Adasum of {:?} and {:?} (f32 values of one shape expected)", m.meta, o.meta);
        }
        let (x, y) = if mine_is_lower { (m, o) } else { (o, m) };
        let at = |v: &V, start: usize| v.at.0 + 4 * start as u64;
        for start in (0..m.n()).step_by(PIECE) {
            let n = (m.n() - start).min(PIECE) as i64;
            pieces.push(AdasumPiece { x: at(x, start), y: at(y, start), out: at(m, start), n, tensor: t as i64 });
        }
        first.push(pieces.len() as i64);
    }
    if pieces.is_empty() {
        return Ok(());
    }
    // One scratch: the pieces, the tensors' first pieces, the partial sums, the dot products.
    let bytes = [std::mem::size_of_val(&pieces[..]), 8 * first.len(), 24 * pieces.len(), 24 * mine.len()];
    let [table, starts, partial, dots] = scratch_parts(dev, &bytes)?[..] else { unreachable!("four parts") };
    dev.write(table, bytemuck::cast_slice(&pieces))?;
    dev.write(starts, bytemuck::cast_slice(&first))?;
    let per_piece =
        LaunchConfig { grid_dim: (pieces.len() as u32, 1, 1), block_dim: (super::BLOCK, 1, 1), shared_mem_bytes: 0 };
    dev.kernel("adasum_dots", per_piece, &mut params![table, partial])?;
    let tensors = mine.len();
    dev.kernel("adasum_sums", elementwise(tensors), &mut params![tensors as i64, starts, partial, dots])?;
    dev.kernel("adasum_apply", per_piece, &mut params![table, dots])
}

/// One optimizer update (optim::cpu_step's formulas) of every weight of `slots`: SGD and Adam in
/// one multi-tensor launch, LAMB in three launches per weight whose trust ratio never leaves
/// the device.
pub fn optimizer_step(dev: Dev, update: &Update, h: StepHyper, slots: &[Slot]) -> Result<(), BackendError> {
    if slots.is_empty() {
        return Ok(());
    }
    let multi = |count: usize| LaunchConfig {
        grid_dim: (count as u32, 1, 1),
        block_dim: (super::BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    match *update {
        Update::Sgd { momentum, nesterov, weight_decay } => {
            let (table, count) = piece_table(dev, slots, (momentum != 0.0) as usize)?;
            let first = (h.step == 1) as i32;
            dev.kernel(
                "sgd_f32",
                multi(count),
                &mut params![table, h.lr, h.grad_scale, momentum, nesterov as i32, weight_decay, first],
            )
        }
        Update::Adam { beta1, beta2, epsilon, weight_decay, decoupled } => {
            let (table, count) = piece_table(dev, slots, 2)?;
            let t = h.step as i32;
            let bc1 = 1.0 - (beta1 as f64).powi(t);
            let bc2 = 1.0 - (beta2 as f64).powi(t);
            let step_size = (h.lr as f64 / bc1) as f32;
            let bc2_sqrt = bc2.sqrt() as f32;
            dev.kernel(
                "adam_f32",
                multi(count),
                &mut params![
                    table,
                    h.lr,
                    h.grad_scale,
                    beta1,
                    beta2,
                    epsilon,
                    weight_decay,
                    decoupled as i32,
                    step_size,
                    bc2_sqrt
                ],
            )
        }
        Update::Lamb { beta1, beta2, epsilon, weight_decay } => {
            let t = h.step as i32;
            let bc1 = (1.0 - (beta1 as f64).powi(t)) as f32;
            let bc2 = (1.0 - (beta2 as f64).powi(t)) as f32;
            for s in slots {
                let [m, v] = s.state[..] else { return refused!("LAMB needs two state buffers") };
                let (p, g, n) = (s.p.at, s.g.at, s.p.n() as i64);
                let cfg = elementwise(s.p.n());
                let blocks = cfg.grid_dim.0 as usize;
                // The partial sums, then the trust ratio after them.
                let partial = dev.scratch(blocks * 16 + 8)?;
                let trust = Ptr(partial.0 + blocks as u64 * 16);
                dev.kernel(
                    "lamb_moments_f32",
                    cfg,
                    &mut params![
                        n,
                        h.grad_scale,
                        beta1,
                        beta2,
                        epsilon,
                        weight_decay,
                        bc1,
                        bc2,
                        p,
                        g,
                        m.at,
                        v.at,
                        partial
                    ],
                )?;
                dev.kernel("lamb_trust_f32", per_row(1), &mut params![blocks as i64, partial, trust])?;
                dev.kernel(
                    "lamb_step_f32",
                    cfg,
                    &mut params![n, h.lr, trust, epsilon, weight_decay, bc1, bc2, p, m.at, v.at],
                )?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::op::{Binary, Reduce, Unary};

    /// Each broadcast finds its elements the cheapest way that is right: the output's layout,
    /// `i mod` the operand's size, `i /` the trailing dims' size, or the strides.
    #[test]
    fn operands_reach_their_elements_by_their_broadcast() {
        use super::reach;
        assert_eq!(reach(&[2, 3, 4], &[2, 3, 4]), (0, 1));
        assert_eq!(reach(&[4], &[2, 3, 4]), (1, 4), "a bias");
        assert_eq!(reach(&[1, 3, 4], &[2, 3, 4]), (1, 12));
        assert_eq!(reach(&[1024, 64], &[8, 12, 1024, 64]), (1, 65536), "RoPE's tables");
        assert_eq!(reach(&[], &[2, 3]), (1, 1), "a scalar");
        assert_eq!(reach(&[1, 1], &[2, 3]), (1, 1));
        assert_eq!(reach(&[2, 3, 1], &[2, 3, 4]), (2, 4), "a row statistic");
        assert_eq!(reach(&[2, 1, 1], &[2, 3, 4]), (2, 12));
        assert_eq!(reach(&[2, 1, 4], &[2, 3, 4]), (3, 1), "a middle axis broadcast");
        assert_eq!(reach(&[0, 4], &[0, 4]), (0, 1));
        assert_eq!(reach(&[4], &[0, 4]), (1, 4));
    }

    /// The kernels switch on `op as i32` and `Unary::code` (kernels/elementwise.cu,
    /// kernels/rows.cu): reordering the enums would silently change which function runs.
    #[test]
    fn op_codes_are_the_kernels_switch_cases() {
        use Unary::*;
        let (a, b) = (0.5, 2.0);
        #[rustfmt::skip]
        let unary = [
            Neg, Exp, Log, Sqrt, Tanh, Erf, Relu, Sigmoid, Abs, Reciprocal, Floor, Ceil, Not, Gelu, GeluTanh,
            Sin, Cos, Tan, Asin, Acos, Atan, Sinh, Cosh, Asinh, Acosh, Atanh, Sign, Round, Softplus, Softsign,
            Mish, HardSwish, HardSigmoid { alpha: a, beta: b }, LeakyRelu { alpha: a }, Elu { alpha: a },
            Selu { alpha: a, gamma: b }, Celu { alpha: a }, ThresholdedRelu { alpha: a }, Clip { min: a, max: b },
            IsNaN, IsInf { negative: true, positive: false }, Silu,
        ];
        for (code, u) in unary.iter().enumerate() {
            assert_eq!(u.code(), code as i32, "{u:?}");
        }
        use Binary::*;
        #[rustfmt::skip]
        let binary = [
            Add, Sub, Mul, Div, Pow, Max, Min, Equal, Less, Greater, LessOrEqual, GreaterOrEqual, And, Or, Xor, Mod,
            Fmod, PRelu,
        ];
        for (code, b) in binary.iter().enumerate() {
            assert_eq!(*b as i32, code as i32, "{b:?}");
        }
        // kernels/rows.cu's reduce_rows.
        use Reduce::{LogSum, LogSumExp, Prod, SumSquare, L1, L2};
        let reduce = [Reduce::Sum, Reduce::Mean, Reduce::Max, Reduce::Min, SumSquare, L1, L2, LogSum, LogSumExp, Prod];
        for (code, r) in reduce.iter().enumerate() {
            assert_eq!(*r as i32, code as i32, "{r:?}");
        }
    }
}
