//! The CUDA backend: device memory from the driver API, kernels compiled at run time by NVRTC
//! (`kernels/`, [`compile`]), matrix products through cuBLASLt ([`gemm`]), all enqueued on one
//! stream. Only `download`, `sum_squares`, `synchronize` and `with_host_f32` wait for it.
//! Collectives between GPUs go through NCCL ([`nccl`]) on the same stream, where NCCL loads.
//!
//! Every CUDA library is loaded at run time after [`probe`] has found it, so the worker builds
//! and runs where there is no CUDA at all. Which ops have kernels, and with which types and
//! shapes, is [`launch`]'s to say: [`CudaBackend::check`] runs its dispatch without launching.

pub mod compile;
pub mod gemm;
pub mod launch;
pub mod nccl;
pub mod probe;

use super::{Arg, Backend, BackendError, DeviceCollective, Scratch, Slot};
use crate::comm::{HostGroup, ProcessGroup, ReduceOp};
use crate::graph::ir::{Graph, Meta};
use crate::op::Op;
use crate::optim::{StepHyper, Update};
use crate::tensor::{DType, Tensor};
use cudarc::driver::result as driver;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Device memory: a pointer from cuMemAlloc, freed when dropped. The executor's plan keeps
/// live values apart, so kernels write through shared references to it.
pub struct CudaBuffer {
    ptr: u64,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl CudaBuffer {
    /// The device address `offset` bytes in.
    pub fn at(&self, offset: usize) -> u64 {
        self.ptr + offset as u64
    }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemAlloc in this context and freed once; cuMemFree waits for
        // the work still using it.
        let _ = self.ctx.bind_to_thread();
        unsafe {
            let _ = driver::free_sync(self.ptr);
        }
    }
}

/// The device address of an executor value.
pub fn addr(a: &Arg<CudaBuffer>) -> u64 {
    a.buf.at(a.offset)
}

/// Threads per block of the elementwise and row kernels (`BLOCK` in kernels/common.cuh); the
/// tensor-core attention and the column sums' finish size their own blocks.
pub const BLOCK: u32 = 256;
/// The most blocks a grid-stride kernel is given: enough to fill any current GPU.
const MAX_BLOCKS: usize = 4096;

/// A grid-stride kernel over `n` elements.
pub fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// A row kernel: one block per row (none for no rows: the dispatch then launches nothing; more
/// rows than a grid holds are refused by the dispatch's launch check).
pub fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows.min(u32::MAX as usize) as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// The environment variable that picks the attention kernels: `auto` (or unset: the tensor-core
/// kernels for the f16/bf16 heads they take, on sm_80 and later) or `warp` (the warp kernels
/// everywhere: a fallback should the tensor-core ones fail on some GPU, and the GPU benchmark's
/// measure of what they are worth).
pub const ATTENTION_ENV: &str = "TENSORFLEET_CUDA_ATTENTION";

/// Which attention kernels a GPU runs ([`ATTENTION_ENV`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKernels {
    /// The tensor-core kernels where the GPU has them (sm_80 and later), else the warp kernels.
    Auto,
    Warp,
}

impl AttentionKernels {
    /// [`ATTENTION_ENV`]'s choice; an unknown value is an error naming the variable.
    pub fn from_env() -> Result<AttentionKernels, String> {
        AttentionKernels::parse(std::env::var(ATTENTION_ENV).ok().as_deref())
    }

    pub fn parse(value: Option<&str>) -> Result<AttentionKernels, String> {
        match value.unwrap_or("auto") {
            "auto" | "" => Ok(AttentionKernels::Auto),
            "warp" => Ok(AttentionKernels::Warp),
            other => Err(format!("{ATTENTION_ENV} is '{other}': auto or warp")),
        }
    }

    /// Whether a GPU of compute capability `capability` runs the tensor-core kernels.
    pub fn tensor_cores(self, capability: (i32, i32)) -> bool {
        self == AttentionKernels::Auto && capability >= (8, 0)
    }
}

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    /// Whether attention runs on the tensor-core kernels ([`AttentionKernels`]).
    tensor_core_attention: bool,
    stream: Arc<CudaStream>,
    kernels: HashMap<String, CudaFunction>,
    gemm: Mutex<gemm::Gemm>,
    _workspace: CudaBuffer,
    /// Temporaries of single launches (row partials, loss sums), grown on demand. Reuse is
    /// safe because every launch is ordered on the one stream.
    scratch: Mutex<Option<CudaBuffer>>,
    /// Data-dependent faults: a kernel that meets an index out of range writes 1 + its
    /// position here; the next wait reports it with what `fault_sources` says ran.
    fault: CudaBuffer,
    fault_sources: Mutex<Vec<String>>,
    name: String,
    /// How long a wait for the stream may last while NCCL communicators are open
    /// (parallelism.timeoutSeconds): NCCL itself waits for a hung peer forever.
    wait_limit: Option<Duration>,
    /// This backend's NCCL communicators, aborted when a wait outlasts its limit.
    comms: Mutex<Vec<Arc<nccl::Comm>>>,
}

/// A driver call's failure: the device's (a lost or faulted GPU, a kernel's illegal address),
/// which a restarted pod may not meet again.
fn cuda_err(what: &str) -> impl Fn(driver::DriverError) -> BackendError + '_ {
    move |e| BackendError::Device(format!("CUDA {what}: {e:?}"))
}

/// The device's free memory, as the driver counts it.
fn free_memory() -> Option<usize> {
    driver::mem_get_info().ok().map(|(free, _total)| free)
}

/// An allocation's failure: out of memory when the driver says so, else the device's.
fn alloc_err(place: &str, bytes: usize) -> impl Fn(driver::DriverError) -> BackendError + '_ {
    move |e| match e.0 {
        cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
            BackendError::OutOfMemory { place: place.to_string(), bytes, free: free_memory() }
        }
        _ => BackendError::Device(format!("CUDA allocation of {bytes} bytes on {place}: {e:?}")),
    }
}

impl CudaBackend {
    /// The backend on GPU `ordinal`: creates its context and stream, compiles (or takes from the
    /// process' cache) and loads the kernels, and creates the cuBLASLt handle.
    pub fn new(ordinal: usize) -> Result<CudaBackend, BackendError> {
        probe::libraries().map_err(|u| BackendError::Device(u.0))?;
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("context"))?;
        let stream = ctx.new_stream().map_err(cuda_err("stream"))?;
        let (major, minor) = ctx.compute_capability().map_err(cuda_err("compute capability"))?;
        let tensor_core_attention =
            AttentionKernels::from_env().map_err(BackendError::Refused)?.tensor_cores((major, minor));
        let ptx = compile::compile(major, minor).map_err(BackendError::Device)?;
        let module = ctx.load_module((*ptx).clone()).map_err(cuda_err("loading the kernels"))?;
        let mut kernels = HashMap::new();
        for name in compile::kernel_names() {
            let f = module.load_function(&name).map_err(cuda_err(&format!("kernel {name}")))?;
            kernels.insert(name, f);
        }
        let alloc = |bytes: usize| -> Result<CudaBuffer, BackendError> {
            // SAFETY: the context is current (CudaContext::new binds it to this thread).
            let ptr = unsafe { driver::malloc_sync(bytes.max(1)) }.map_err(alloc_err("the GPU", bytes))?;
            Ok(CudaBuffer { ptr, bytes, ctx: ctx.clone() })
        };
        let workspace = alloc(gemm::WORKSPACE_BYTES)?;
        let fault = alloc(8)?;
        // SAFETY: 8 bytes of the allocation above, zeroed on the stream the kernels write it on.
        unsafe { driver::memset_d8_async(fault.ptr, 0, 8, stream.cu_stream()) }.map_err(cuda_err("memset"))?;
        stream.synchronize().map_err(cuda_err("synchronize"))?;
        let gemm = gemm::Gemm::new(workspace.ptr, gemm::WORKSPACE_BYTES).map_err(BackendError::Device)?;
        let device = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        Ok(CudaBackend {
            name: format!("cuda:{ordinal} ({device}, sm_{major}{minor})"),
            tensor_core_attention,
            ctx,
            stream,
            kernels,
            gemm: Mutex::new(gemm),
            _workspace: workspace,
            scratch: Mutex::new(None),
            fault,
            fault_sources: Mutex::new(Vec::new()),
            wait_limit: None,
            comms: Mutex::new(Vec::new()),
        })
    }

    /// Makes a wait for the GPU's work that outlasts `limit`, while collectives are open, an
    /// error: a collective waiting for a rank that has stopped (MPI's collectives have their
    /// own watchdog; NCCL's have none).
    pub fn with_wait_limit(mut self, limit: Duration) -> CudaBackend {
        self.wait_limit = Some(limit);
        self
    }

    /// Waits until the stream has run everything enqueued. With NCCL communicators open and a
    /// wait limit, polls instead of blocking, so that a hung peer or an NCCL error ends this
    /// rank with an error (its communicators aborted) rather than hanging it.
    fn sync(&self) -> Result<(), BackendError> {
        let comms = match self.wait_limit {
            Some(_) => self.comms.lock().unwrap().clone(),
            None => Vec::new(),
        };
        let (Some(limit), false) = (self.wait_limit, comms.is_empty()) else {
            return self.stream.synchronize().map_err(cuda_err("synchronize"));
        };
        let start = Instant::now();
        loop {
            // SAFETY: the backend's live stream.
            match unsafe { cudarc::driver::sys::cuStreamQuery(self.stream.cu_stream()) } {
                cudarc::driver::sys::CUresult::CUDA_SUCCESS => return Ok(()),
                cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY => {}
                e => return Err(cuda_err("synchronize")(driver::DriverError(e))),
            }
            let failed = comms.iter().find_map(|c| c.async_error());
            let waited = start.elapsed();
            if failed.is_some() || waited > limit {
                comms.iter().for_each(|c| c.abort());
                self.comms.lock().unwrap().clear();
                return Err(BackendError::Device(match failed {
                    Some(e) => format!("{e}; this rank's NCCL communicators are aborted"),
                    None => format!(
                        "the GPU's work has not finished after {} s (parallelism.timeoutSeconds): a collective is \
                         waiting for a rank that has stopped; this rank's NCCL communicators are aborted",
                        limit.as_secs()
                    ),
                }));
            }
            // Spin for the first millisecond (a step's wait is usually short), then nap.
            if waited < Duration::from_millis(1) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }

    /// The nodes of `graph` the CUDA backend cannot run, one line each; empty when it can run
    /// them all. Needs no GPU ([`launch::check`]).
    pub fn unsupported_nodes(graph: &Graph) -> Vec<String> {
        let mut missing = Vec::new();
        for node in &graph.nodes {
            let meta = |v: &Option<usize>| v.and_then(|v| graph.meta(v).cloned());
            let ins: Vec<Option<crate::graph::ir::Meta>> = node.inputs.iter().map(meta).collect();
            let outs: Vec<crate::graph::ir::Meta> = node.outputs.iter().filter_map(meta).collect();
            if let Err(why) = launch::check(&node.op, &ins, &outs) {
                missing.push(format!("{}: {why}", node.describe()));
            }
        }
        missing
    }

    fn bind(&self) -> Result<(), BackendError> {
        self.ctx.bind_to_thread().map_err(cuda_err("binding the context"))
    }

    /// Launches kernel `name` with its parameters, each a pointer to the argument's value.
    pub(crate) fn launch_kernel(
        &self,
        name: &str,
        cfg: LaunchConfig,
        params: &mut [*mut c_void],
    ) -> Result<(), BackendError> {
        let f = self.kernels.get(name).ok_or_else(|| BackendError::Refused(format!("no CUDA kernel named {name}")))?;
        // SAFETY: the parameters match the kernel's signature (launch.rs passes them in the
        // order kernels/*.cu declares), and the pointers are device memory of the sizes the
        // executor's plan gives the values.
        unsafe {
            driver::launch_kernel(
                f.cu_function(),
                cfg.grid_dim,
                cfg.block_dim,
                cfg.shared_mem_bytes,
                self.stream.cu_stream(),
                params,
            )
        }
        .map_err(|e| BackendError::Device(format!("launching {name}: {e:?}")))
    }

    pub(crate) fn gemm(&self, p: &gemm::Product) -> Result<(), BackendError> {
        let applied = self.gemm.lock().unwrap().run(p, self.stream.cu_stream() as _)?;
        if p.has_epilogue() && !applied {
            launch::apply_epilogue(self, p)?;
        }
        Ok(())
    }

    /// At least `bytes` of scratch memory, valid until the next launch that asks for scratch:
    /// for work outside the graph's steps (the optimizer, the gradient norm), whose steps get
    /// theirs in the executor's arena (`Backend::scratch_bytes`).
    pub(crate) fn scratch(&self, bytes: usize) -> Result<u64, BackendError> {
        let mut s = self.scratch.lock().unwrap();
        if s.as_ref().is_none_or(|b| b.bytes < bytes) {
            // The old buffer may still be in use by enqueued work.
            self.sync()?;
            *s = None;
            // SAFETY: the context is bound (every entry point binds it).
            let ptr = unsafe { driver::malloc_sync(bytes.max(1)) }.map_err(alloc_err("the GPU's scratch", bytes))?;
            *s = Some(CudaBuffer { ptr, bytes, ctx: self.ctx.clone() });
        }
        Ok(s.as_ref().map(|b| b.ptr).unwrap_or(0))
    }

    /// The fault word's address, for a kernel that can meet bad data; `what` says what ran.
    pub(crate) fn fault_word(&self, what: String) -> u64 {
        self.fault_sources.lock().unwrap().push(what);
        self.fault.ptr
    }

    pub(crate) fn memcpy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), BackendError> {
        if dst == src || bytes == 0 {
            return Ok(());
        }
        // SAFETY: both ranges are device memory of `bytes` (the plan's sizes).
        unsafe { driver::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }.map_err(cuda_err("copy"))
    }

    /// Copies host bytes to device memory at `dst`, ordered on the stream; `bytes` may go as
    /// soon as this returns (a copy from pageable memory is staged before it does).
    pub(crate) fn write_bytes(&self, dst: u64, bytes: &[u8]) -> Result<(), BackendError> {
        // SAFETY: `bytes.len()` bytes of device memory at `dst` (a scratch request of that size).
        unsafe { driver::memcpy_htod_async(dst, bytes, self.stream.cu_stream()) }.map_err(cuda_err("upload"))
    }

    pub(crate) fn memset(&self, dst: u64, byte: u8, bytes: usize) -> Result<(), BackendError> {
        // SAFETY: device memory of `bytes`.
        unsafe { driver::memset_d8_async(dst, byte, bytes, self.stream.cu_stream()) }.map_err(cuda_err("memset"))
    }

    fn read<T: Copy + Default>(&self, src: u64, count: usize) -> Result<Vec<T>, BackendError> {
        let mut host = vec![T::default(); count];
        // SAFETY: `count` elements of device memory at `src`; the wait below completes the copy
        // before `host` is read or dropped.
        unsafe { driver::memcpy_dtoh_async(&mut host, src, self.stream.cu_stream()) }.map_err(cuda_err("download"))?;
        self.sync()?;
        Ok(host)
    }

    /// Waits for the stream, then reports a fault a kernel recorded since the last wait.
    fn wait(&self) -> Result<(), BackendError> {
        self.sync()?;
        let sources = std::mem::take(&mut *self.fault_sources.lock().unwrap());
        if sources.is_empty() {
            return Ok(());
        }
        let word = self.read::<u64>(self.fault.ptr, 1)?[0];
        if word == 0 {
            return Ok(());
        }
        self.memset(self.fault.ptr, 0, 8)?;
        Err(BackendError::BadData(format!(
            "an index out of range at position {} in one of: {}",
            word - 1,
            sources.join("; ")
        )))
    }

    /// The f64 partial sums a kernel left at `partial`, for the host to add in order.
    pub(crate) fn sum_partials(&self, partial: u64, count: usize) -> Result<Vec<f64>, BackendError> {
        self.read::<f64>(partial, count)
    }
}

/// Dense peaks from NVIDIA's data sheets, TFLOP/s: (a substring of the device's name, FP32
/// without tensor cores — the products run CUBLAS_COMPUTE_32F, no TF32 — and BF16/FP16 on
/// tensor cores). More specific names come first (an "H100 PCIe" is also an "H100").
const PEAKS: [(&str, f64, f64); 10] = [
    ("H100 PCIe", 51.2, 756.0),
    ("H100 NVL", 60.0, 835.0),
    ("H100", 66.9, 989.4),
    ("H200", 66.9, 989.4),
    ("A100", 19.5, 312.0),
    ("L40S", 91.6, 362.1),
    ("L40", 90.5, 181.0),
    ("L4", 30.3, 121.0),
    ("A10", 31.2, 125.0),
    ("A6000", 38.7, 154.8),
];

/// The peak of a device named `device` for products in `compute`, when the table knows it.
pub fn peak_flops_of(device: &str, compute: DType) -> Option<f64> {
    let (_, fp32, half) = PEAKS.iter().find(|(name, _, _)| device.contains(name))?;
    Some(1e12 * if matches!(compute, DType::F16 | DType::BF16) { *half } else { *fp32 })
}

impl Backend for CudaBackend {
    type Buffer = CudaBuffer;

    fn name(&self) -> String {
        self.name.clone()
    }

    fn peak_flops(&self, compute: DType) -> Option<f64> {
        peak_flops_of(&self.name, compute)
    }

    fn alloc(&self, bytes: usize) -> Result<CudaBuffer, BackendError> {
        self.bind()?;
        // SAFETY: the context is bound; the memset is ordered before any use on the stream.
        let ptr = unsafe { driver::malloc_sync(bytes.max(1)) }.map_err(alloc_err(&self.name, bytes))?;
        let buf = CudaBuffer { ptr, bytes, ctx: self.ctx.clone() };
        self.memset(ptr, 0, bytes)?;
        Ok(buf)
    }

    fn upload(&self, src: &Tensor, dst: Arg<CudaBuffer>) -> Result<(), BackendError> {
        self.bind()?;
        if src.byte_len() != dst.meta.bytes() {
            return crate::refused!("uploading {} bytes into a value of {}", src.byte_len(), dst.meta.bytes());
        }
        // SAFETY: the value's bytes at its place; a copy from pageable host memory returns once
        // the source has been staged, so `src` may go right after.
        unsafe { driver::memcpy_htod_async(addr(&dst), src.bytes(), self.stream.cu_stream()) }
            .map_err(cuda_err("upload"))
    }

    fn download(&self, src: Arg<CudaBuffer>) -> Result<Tensor, BackendError> {
        self.bind()?;
        self.wait()?;
        let mut t = Tensor::zeros(src.meta.dtype, &src.meta.shape);
        // SAFETY: the value's bytes; the wait completes the copy before `t` is used.
        unsafe { driver::memcpy_dtoh_async(t.bytes_mut(), addr(&src), self.stream.cu_stream()) }
            .map_err(cuda_err("download"))?;
        self.sync()?;
        Ok(t)
    }

    fn launch(
        &self,
        op: &Op,
        inputs: &[Option<Arg<CudaBuffer>>],
        outputs: &[Arg<CudaBuffer>],
        scratch: Option<Scratch<CudaBuffer>>,
    ) -> Result<(), BackendError> {
        self.bind()?;
        let ins: Vec<Option<launch::V>> = inputs.iter().map(|a| a.as_ref().map(launch::value)).collect();
        let outs: Vec<launch::V> = outputs.iter().map(launch::value).collect();
        let scratch = scratch.map(|s| (launch::Ptr(s.buf.ptr + s.offset as u64), s.bytes));
        launch::run(self, op, &ins, &outs, scratch)
    }

    fn scratch_bytes(&self, op: &Op, inputs: &[Option<&Meta>], outputs: &[&Meta]) -> usize {
        launch::scratch_bytes(self, op, inputs, outputs)
    }

    fn accumulate(
        &self,
        dst: Arg<CudaBuffer>,
        keep: f32,
        src: Arg<CudaBuffer>,
        scale: f32,
    ) -> Result<(), BackendError> {
        self.bind()?;
        launch::accumulate(launch::Dev::new(self), launch::value(&dst), keep, launch::value(&src), scale)
    }

    fn sum_squares(&self, xs: &[Arg<CudaBuffer>]) -> Result<f64, BackendError> {
        self.bind()?;
        let xs: Vec<launch::V> = xs.iter().map(launch::value).collect();
        launch::sum_squares(launch::Dev::new(self), &xs)
    }

    fn optimizer_step(&self, update: &Update, h: StepHyper, slots: &[Slot<CudaBuffer>]) -> Result<(), BackendError> {
        self.bind()?;
        launch::optimizer_step(launch::Dev::new(self), update, h, &launch::slots(slots, launch::value))
    }

    fn adasum(
        &self,
        mine: &[Arg<CudaBuffer>],
        theirs: &[Arg<CudaBuffer>],
        mine_is_lower: bool,
    ) -> Result<(), BackendError> {
        self.bind()?;
        let (mine, theirs): (Vec<_>, Vec<_>) =
            (mine.iter().map(launch::value).collect(), theirs.iter().map(launch::value).collect());
        launch::adasum(launch::Dev::new(self), &mine, &theirs, mine_is_lower)
    }

    fn unsupported(&self, graph: &Graph) -> Vec<String> {
        CudaBackend::unsupported_nodes(graph)
    }

    fn synchronize(&self) -> Result<(), BackendError> {
        self.bind()?;
        self.wait()
    }

    fn abort_collectives(&self) {
        self.comms.lock().unwrap().iter().for_each(|c| c.abort());
    }

    fn open_collective(
        &self,
        group: &HostGroup,
    ) -> Result<Option<Box<dyn DeviceCollective<CudaBuffer>>>, BackendError> {
        let Some(id) = nccl::shared_id(group).map_err(BackendError::Device)? else { return Ok(None) };
        self.bind()?;
        let comm = Arc::new(nccl::Comm::init(group.size(), group.rank(), &id).map_err(BackendError::Device)?);
        self.comms.lock().unwrap().push(comm.clone());
        let side = self.ctx.new_stream().map_err(cuda_err("communication stream"))?;
        Ok(Some(Box::new(NcclGroup {
            comm,
            stream: self.stream.clone(),
            side,
            ctx: self.ctx.clone(),
            version: nccl::version().map_err(BackendError::Device)?,
        })))
    }

    fn with_host_f32<E: From<BackendError>>(
        &self,
        x: Arg<CudaBuffer>,
        f: &mut dyn FnMut(&mut [f32]) -> Result<(), E>,
    ) -> Result<(), E> {
        self.bind()?;
        self.wait()?;
        let mut host = self.read::<f32>(addr(&x), x.meta.numel())?;
        f(&mut host)?;
        // SAFETY: the value's bytes; the wait keeps `host` alive until the copy is done.
        unsafe { driver::memcpy_htod_async(addr(&x), &host, self.stream.cu_stream()) }.map_err(cuda_err("upload"))?;
        Ok(self.sync()?)
    }

    fn memory_available(&self) -> Option<usize> {
        self.bind().ok()?;
        free_memory()
    }
}

/// A group's collectives through an NCCL communicator, on the backend's stream: ordered after
/// the kernels that computed the values and before those that read them, with no host wait.
/// Started ones run on the group's own communication stream, beside the compute stream's
/// kernels, until the compute stream joins it.
struct NcclGroup {
    comm: Arc<nccl::Comm>,
    stream: Arc<CudaStream>,
    side: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    version: String,
}

impl NcclGroup {
    fn region(x: &Arg<CudaBuffer>) -> nccl::Region {
        nccl::Region { ptr: addr(x), count: x.meta.numel(), dtype: x.meta.dtype }
    }

    /// Runs `each` for every value inside one NCCL group on `stream`, on the bound context.
    fn grouped(
        &self,
        stream: &CudaStream,
        values: &[Arg<CudaBuffer>],
        each: impl Fn(nccl::Region, *mut c_void) -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        self.ctx.bind_to_thread().map_err(cuda_err("binding the context"))?;
        let stream = stream.cu_stream() as *mut c_void;
        self.comm.grouped(|| values.iter().try_for_each(|v| each(Self::region(v), stream)))
    }
}

impl DeviceCollective<CudaBuffer> for NcclGroup {
    fn name(&self) -> String {
        format!("NCCL {}", self.version)
    }

    fn all_reduce(&self, values: &[Arg<CudaBuffer>], op: ReduceOp) -> Result<(), BackendError> {
        // SAFETY: executor values on this backend's GPU, kept by their buffers' owners past the
        // next wait on the stream (which every read of them does first).
        self.grouped(&self.stream, values, |x, stream| unsafe { self.comm.all_reduce(x, op, stream) })
    }

    fn broadcast(&self, values: &[Arg<CudaBuffer>], root: usize) -> Result<(), BackendError> {
        // SAFETY: as above.
        self.grouped(&self.stream, values, |x, stream| unsafe { self.comm.broadcast(x, root, stream) })
    }

    fn start_all_reduce(&self, values: &[Arg<CudaBuffer>], op: ReduceOp) -> Result<(), BackendError> {
        // The communication stream takes up after the compute stream's work so far (which
        // computed the values), then goes its own way.
        self.side.join(&self.stream).map_err(cuda_err("ordering the communication stream"))?;
        // SAFETY: as above; nothing on the compute stream writes the values before it joins
        // this stream (the caller's promise: they are final until `join`).
        self.grouped(&self.side, values, |x, stream| unsafe { self.comm.all_reduce(x, op, stream) })
    }

    fn join(&self) -> Result<(), BackendError> {
        self.stream.join(&self.side).map_err(cuda_err("joining the communication stream"))
    }

    fn reduce_scatter(&self, send: Arg<CudaBuffer>, recv: Arg<CudaBuffer>, op: ReduceOp) -> Result<(), BackendError> {
        let (send, recv) = (Self::region(&send), Self::region(&recv));
        self.ctx.bind_to_thread().map_err(cuda_err("binding the context"))?;
        // SAFETY: as for all_reduce, both values.
        unsafe { self.comm.reduce_scatter(send, recv, op, self.stream.cu_stream() as *mut c_void) }
    }

    fn all_gather(&self, send: Arg<CudaBuffer>, recv: Arg<CudaBuffer>) -> Result<(), BackendError> {
        let (send, recv) = (Self::region(&send), Self::region(&recv));
        self.ctx.bind_to_thread().map_err(cuda_err("binding the context"))?;
        // SAFETY: as for all_reduce, both values.
        unsafe { self.comm.all_gather(send, recv, self.stream.cu_stream() as *mut c_void) }
    }

    fn send(&self, x: Arg<CudaBuffer>, to: usize) -> Result<(), BackendError> {
        // SAFETY: as for all_reduce.
        self.grouped(&self.stream, &[x], |x, stream| unsafe { self.comm.send(x, to, stream) })
    }

    fn recv(&self, x: Arg<CudaBuffer>, from: usize) -> Result<(), BackendError> {
        // SAFETY: as for all_reduce.
        self.grouped(&self.stream, &[x], |x, stream| unsafe { self.comm.recv(x, from, stream) })
    }

    fn send_recv(
        &self,
        send: Arg<CudaBuffer>,
        to: usize,
        recv: Arg<CudaBuffer>,
        from: usize,
    ) -> Result<(), BackendError> {
        let (send, recv) = (Self::region(&send), Self::region(&recv));
        self.ctx.bind_to_thread().map_err(cuda_err("binding the context"))?;
        let stream = self.stream.cu_stream() as *mut c_void;
        // One NCCL group: both are posted before either waits.
        // SAFETY: as for all_reduce, both values.
        self.comm
            .grouped(|| unsafe { self.comm.send(send, to, stream).and_then(|()| self.comm.recv(recv, from, stream)) })
    }
}
