//! The CUDA backend's kernels and dispatch, run on the CPU (`emulator.hpp` says how): a
//! [`Backend`] whose memory is host memory and whose launches go through the same dispatch
//! (`backend::cuda::launch`) as the GPU's, into the kernel program compiled by the host's C++
//! compiler. Products go to a plain triple loop here, so cuBLASLt's part (gemm.rs) is the one
//! piece of the backend this does not check.

use libloading::{Library, Symbol};
use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};
use tensorfleet_worker::backend::cuda::gemm::{Epilogue, Product};
use tensorfleet_worker::backend::cuda::launch::{self, Dev, Ptr, Target, V};
use tensorfleet_worker::backend::cuda::{compile, CudaBackend};
use tensorfleet_worker::backend::{Arg, Backend, BackendError, DeviceCollective, Scratch, Slot};
use tensorfleet_worker::comm::{Collective, HostGroup, ReduceOp};
use tensorfleet_worker::graph::ir::{Graph, Meta};
use tensorfleet_worker::kernels::elementwise::{gelu_tanh, gelu_tanh_grad};
use tensorfleet_worker::op::Op;
use tensorfleet_worker::optim::StepHyper;
use tensorfleet_worker::optim::Update;
use tensorfleet_worker::tensor::{DType, Tensor};

type LaunchFn = unsafe extern "C" fn(*const c_char, u32, u32, u32, *mut *mut c_void) -> i32;
type FailureFn = unsafe extern "C" fn() -> *const c_char;

/// The kernel program built as a shared library for this machine. Its state (the fibers, the
/// thread and block indices) is global, so launches take turns, whichever test makes them.
pub struct Emulator {
    lib: Library,
    turn: Mutex<()>,
}

/// The C++ that turns `emu_launch(name, grid, block, params)` into a call of the kernel with
/// its parameters cast back to their declared types.
fn dispatcher() -> String {
    let mut s = String::from(
        "extern \"C\" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned bx, void** p) {\n",
    );
    for (name, types) in compile::declarations() {
        let args: Vec<String> = types.iter().enumerate().map(|(i, ty)| format!("*({ty}*)p[{i}]")).collect();
        s.push_str(&format!(
            "    if (strcmp(name, \"{name}\") == 0) return emu_run_grid(name, gx, gy, bx, [=] {{ {name}({}); }});\n",
            args.join(", ")
        ));
    }
    s.push_str("    emu::failure = std::string(\"no kernel named \") + name;\n    return 2;\n}\n");
    s
}

fn build(dir: &Path) -> Result<PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cuda_emulator");
    let src = dir.join("kernels_emulated.cpp");
    let program = format!("#define TF_EMULATE 1\n#include \"emulator.hpp\"\n{}\n{}", compile::source(), dispatcher());
    std::fs::write(&src, program).map_err(|e| e.to_string())?;
    let lib = dir.join("libkernels_emulated.so");
    let out = Command::new("g++")
        // No _FORTIFY_SOURCE: its checked _longjmp refuses to jump between the fibers' stacks.
        .args(["-std=c++17", "-O1", "-U_FORTIFY_SOURCE", "-fPIC", "-shared", "-w", "-I"])
        .arg(&here)
        .arg("-o")
        .arg(&lib)
        .arg(&src)
        .output()
        .map_err(|e| format!("g++ (build-essential, which `make deps` installs): {e}"))?;
    if !out.status.success() {
        return Err(format!("g++ could not build the emulated kernels:\n{}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(lib)
}

/// The emulator, built once per test binary.
pub fn emulator() -> &'static Emulator {
    static EMU: OnceLock<Emulator> = OnceLock::new();
    EMU.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("tf-cuda-emulator-{}", std::process::id()));
        let path = build(&dir).unwrap_or_else(|e| panic!("{e}"));
        // SAFETY: the library is ours, built just now; it has no initialisers with side effects.
        let lib = unsafe { Library::new(&path) }.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        std::fs::remove_dir_all(&dir).ok();
        Emulator { lib, turn: Mutex::new(()) }
    })
}

impl Emulator {
    fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), BackendError> {
        let cname = CString::new(name).unwrap();
        let _turn = self.turn.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the symbols are the dispatcher's; `params` point at values of the kernel's
        // declared types (the dispatch checked them) that outlive this synchronous call.
        unsafe {
            let launch: Symbol<LaunchFn> =
                self.lib.get(b"emu_launch").map_err(|e| BackendError::Device(e.to_string()))?;
            if launch(cname.as_ptr(), grid.0, grid.1, block, params.as_mut_ptr()) == 0 {
                return Ok(());
            }
            let failure: Symbol<FailureFn> =
                self.lib.get(b"emu_failure").map_err(|e| BackendError::Device(e.to_string()))?;
            Err(BackendError::Device(CStr::from_ptr(failure()).to_string_lossy().into_owned()))
        }
    }
}

/// Host memory in 64-byte lines, aligned as the executor's values on a GPU are, written through
/// shared references as the GPU's is (the plan keeps live values apart).
pub struct HostBuffer {
    lines: UnsafeCell<Vec<Line>>,
}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

unsafe impl Send for HostBuffer {}
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    fn new(bytes: usize) -> HostBuffer {
        HostBuffer { lines: UnsafeCell::new(vec![Line([0; 64]); bytes.div_ceil(64).max(1)]) }
    }
    fn base(&self) -> u64 {
        // SAFETY: the vector is never resized after creation.
        unsafe { (*self.lines.get()).as_mut_ptr() as u64 }
    }
}

fn at(a: &Arg<HostBuffer>) -> u64 {
    a.buf.base() + a.offset as u64
}

fn value<'a>(a: &Arg<'a, HostBuffer>) -> V<'a> {
    V { meta: a.meta, at: Ptr(at(a)) }
}

/// The CUDA backend's dispatch and kernels on the CPU.
pub struct EmulatedGpu {
    emu: &'static Emulator,
    scratch: Mutex<HostBuffer>,
    fault: HostBuffer,
    faults: Mutex<Vec<String>>,
    /// How many times the host has waited for the device: every call that would wait on a GPU
    /// (download, synchronize, a host copy, a read of partial sums).
    pub waits: std::sync::atomic::AtomicUsize,
    /// How many times each kernel has been launched, by name.
    pub launches: Mutex<HashMap<String, usize>>,
    /// Set, the stand-in for cuBLASLt offers no algorithm with an epilogue, as cuBLASLt may
    /// not for some layouts: products run plain and the dispatch applies the epilogue after.
    pub declines_epilogues: std::sync::atomic::AtomicBool,
    /// Set, groups of more than one rank get the device's own collectives (`Collectives`) as a
    /// GPU's get NCCL; each call is counted by name.
    pub device_collectives: std::sync::atomic::AtomicBool,
    pub collective_calls: Arc<Mutex<HashMap<&'static str, usize>>>,
    /// What the dispatch is told to keep its splittable temporaries to (`Target::scratch_budget`;
    /// the GPU's 64 MiB unless a test makes it small to split the work).
    pub scratch_budget: std::sync::atomic::AtomicUsize,
    /// The attention kernels' grid limit (`Target::attention_grid_limit`; the GPU's 2^20 unless
    /// a test makes it small to run their striding loops).
    pub attention_grid_limit: std::sync::atomic::AtomicUsize,
    /// Set while a step runs with the scratch its plan gave it: a request beyond that is the
    /// plan's mistake (`Backend::scratch_bytes` measured too little), an error here.
    planned_scratch: std::sync::atomic::AtomicBool,
}

/// The collectives of emulated GPUs, NCCL's stand-in: the group's MPI collectives run straight
/// on the emulator's memory (host memory), as NCCL's would on the GPU's. The emulator has one
/// stream, so a started all-reduce runs at once: a session that started one before its values
/// were final, or wrote them before joining, would get other sums than the host path's.
struct Collectives {
    group: HostGroup,
    calls: Arc<Mutex<HashMap<&'static str, usize>>>,
}

// SAFETY: the group is a duplicate communicator of its own (`HostGroup::detach`, which
// requires MPI_THREAD_MULTIPLE), used by the session that opened it, one call at a time.
unsafe impl Send for Collectives {}
unsafe impl Sync for Collectives {}

impl Collectives {
    fn count(&self, call: &'static str) {
        *self.calls.lock().unwrap().entry(call).or_default() += 1;
    }

    /// A value's f32 elements, in the emulator's (host) memory.
    #[allow(clippy::mut_from_ref)]
    fn elements<'a>(&self, v: &Arg<'a, HostBuffer>) -> &'a mut [f32] {
        assert_eq!(v.meta.dtype, DType::F32, "a collective of a {} value", v.meta.dtype);
        unsafe { std::slice::from_raw_parts_mut(at(v) as *mut f32, v.meta.numel()) }
    }

    fn each(&self, call: &'static str, values: &[Arg<HostBuffer>], op: ReduceOp) -> Result<(), BackendError> {
        self.count(call);
        values.iter().try_for_each(|v| {
            self.group.all_reduce(self.elements(v), op).map_err(|e| BackendError::Device(e.to_string()))
        })
    }
}

impl DeviceCollective<HostBuffer> for Collectives {
    fn name(&self) -> String {
        "the emulator's MPI".into()
    }
    fn all_reduce(&self, values: &[Arg<HostBuffer>], op: ReduceOp) -> Result<(), BackendError> {
        self.each("all_reduce", values, op)
    }
    fn broadcast(&self, values: &[Arg<HostBuffer>], root: usize) -> Result<(), BackendError> {
        self.count("broadcast");
        values.iter().try_for_each(|v| {
            self.group.broadcast(self.elements(v), root).map_err(|e| BackendError::Device(e.to_string()))
        })
    }
    fn start_all_reduce(&self, values: &[Arg<HostBuffer>], op: ReduceOp) -> Result<(), BackendError> {
        self.each("start_all_reduce", values, op)
    }
    fn join(&self) -> Result<(), BackendError> {
        self.count("join");
        Ok(())
    }
    fn reduce_scatter(&self, send: Arg<HostBuffer>, recv: Arg<HostBuffer>, op: ReduceOp) -> Result<(), BackendError> {
        self.count("reduce_scatter");
        let whole = self.elements(&send).to_vec();
        self.group.reduce_scatter(&whole, self.elements(&recv), op).map_err(|e| BackendError::Device(e.to_string()))
    }
    fn all_gather(&self, send: Arg<HostBuffer>, recv: Arg<HostBuffer>) -> Result<(), BackendError> {
        self.count("all_gather");
        // `send` may lie inside `recv`: a copy of it first.
        let mine = self.elements(&send).to_vec();
        self.group.all_gather(&mine, self.elements(&recv)).map_err(|e| BackendError::Device(e.to_string()))
    }
    fn send(&self, x: Arg<HostBuffer>, to: usize) -> Result<(), BackendError> {
        self.count("send");
        self.group.send(self.elements(&x), to).map_err(|e| BackendError::Device(e.to_string()))
    }
    fn recv(&self, x: Arg<HostBuffer>, from: usize) -> Result<(), BackendError> {
        self.count("recv");
        self.group.recv(self.elements(&x), from).map_err(|e| BackendError::Device(e.to_string()))
    }
    fn send_recv(
        &self,
        send: Arg<HostBuffer>,
        to: usize,
        recv: Arg<HostBuffer>,
        from: usize,
    ) -> Result<(), BackendError> {
        self.count("send_recv");
        self.group
            .send_recv(self.elements(&send), to, self.elements(&recv), from)
            .map_err(|e| BackendError::Device(e.to_string()))
    }
}

impl EmulatedGpu {
    pub fn new() -> EmulatedGpu {
        EmulatedGpu {
            emu: emulator(),
            scratch: Mutex::new(HostBuffer::new(8)),
            fault: HostBuffer::new(8),
            faults: Mutex::new(Vec::new()),
            waits: Default::default(),
            launches: Default::default(),
            declines_epilogues: Default::default(),
            device_collectives: Default::default(),
            collective_calls: Default::default(),
            scratch_budget: std::sync::atomic::AtomicUsize::new(64 << 20),
            attention_grid_limit: std::sync::atomic::AtomicUsize::new(1 << 20),
            planned_scratch: Default::default(),
        }
    }

    /// A wait for the device, counted; reports a fault a kernel recorded since the last one.
    fn wait(&self) -> Result<(), BackendError> {
        self.waits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.fault_check()
    }

    fn fault_check(&self) -> Result<(), BackendError> {
        let sources = std::mem::take(&mut *self.faults.lock().unwrap());
        // SAFETY: the fault word is 8 bytes of host memory that kernels write through.
        let word = unsafe { std::ptr::read(self.fault.base() as *const u64) };
        if word == 0 {
            return Ok(());
        }
        unsafe { std::ptr::write(self.fault.base() as *mut u64, 0) };
        Err(BackendError::BadData(format!(
            "an index out of range at position {} in one of: {}",
            word - 1,
            sources.join("; ")
        )))
    }
}

// SAFETY (all the raw reads and writes below): the addresses are host memory of the sizes the
// executor's plan, or the scratch request, gave them.
impl Target for EmulatedGpu {
    fn launch(
        &self,
        name: &str,
        cfg: cudarc::driver::LaunchConfig,
        params: &mut [*mut c_void],
    ) -> Result<(), BackendError> {
        *self.launches.lock().unwrap().entry(name.to_string()).or_default() += 1;
        self.emu.launch(name, cfg.grid_dim, cfg.block_dim.0, params)
    }
    fn copy(&self, dst: Ptr, src: Ptr, bytes: usize) -> Result<(), BackendError> {
        if dst != src {
            unsafe { std::ptr::copy(src.0 as *const u8, dst.0 as *mut u8, bytes) };
        }
        Ok(())
    }
    fn fill(&self, dst: Ptr, byte: u8, bytes: usize) -> Result<(), BackendError> {
        unsafe { std::ptr::write_bytes(dst.0 as *mut u8, byte, bytes) };
        Ok(())
    }
    fn write(&self, dst: Ptr, bytes: &[u8]) -> Result<(), BackendError> {
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst.0 as *mut u8, bytes.len()) };
        Ok(())
    }
    fn gemm(&self, p: &Product) -> Result<(), BackendError> {
        // cuBLASLt takes no empty matrix (the dispatch keeps such products from it).
        if p.batch == 0 || p.m == 0 || p.n == 0 || p.k == 0 {
            return Err(BackendError::refused(format!("an empty product reached cuBLASLt's stand-in: {p:?}")));
        }
        // f32 accumulation (in f64 here), half elements widened on load and rounded on store, as
        // cuBLASLt's CUBLAS_COMPUTE_32F does with f16/bf16 matrices; the epilogue on the f32 sum.
        if p.has_epilogue() && self.declines_epilogues.load(std::sync::atomic::Ordering::Relaxed) {
            self.gemm(&Product { bias: 0, epilogue: Epilogue::Plain, ..*p })?;
            return launch::apply_epilogue(self, p);
        }
        let (size, d_size) = (p.dtype.size() as isize, p.d_dtype.size() as isize);
        let load_as = |t: DType, at: *const u8| -> f32 {
            match t {
                DType::F16 => half::f16::from_bits(unsafe { *(at as *const u16) }).to_f32(),
                DType::BF16 => half::bf16::from_bits(unsafe { *(at as *const u16) }).to_f32(),
                _ => unsafe { *(at as *const f32) },
            }
        };
        let load = |at: *const u8| load_as(p.dtype, at);
        // D (and the aux, laid out like it) of D's type.
        let store = |at: *mut u8, v: f32| match p.d_dtype {
            DType::F16 => unsafe { *(at as *mut u16) = half::f16::from_f32(v).to_bits() },
            DType::BF16 => unsafe { *(at as *mut u16) = half::bf16::from_f32(v).to_bits() },
            _ => unsafe { *(at as *mut f32) = v },
        };
        let (m, n, k) = (p.m as usize, p.n as usize, p.k as usize);
        for b in 0..p.batch as usize {
            let a = (p.a as *const u8).wrapping_offset(b as isize * p.a_stride as isize * size);
            let bm = (p.b as *const u8).wrapping_offset(b as isize * p.b_stride as isize * size);
            let d = (p.d as *mut u8).wrapping_offset(b as isize * p.d_stride as isize * d_size);
            for i in 0..m {
                for j in 0..n {
                    let mut s = 0f64;
                    for l in 0..k {
                        let ai = if p.trans_a { l * m + i } else { i * k + l };
                        let bi = if p.trans_b { j * k + l } else { l * n + j };
                        let av = load(a.wrapping_offset(ai as isize * size));
                        let bv = load(bm.wrapping_offset(bi as isize * size));
                        s += av as f64 * bv as f64;
                    }
                    let at = (i * n + j) as isize * d_size;
                    let out = d.wrapping_offset(at);
                    let prior = if p.beta != 0.0 { p.beta * load_as(p.d_dtype, out) } else { 0.0 };
                    // The epilogue: the bias, then GELU or its gradient, before D's one rounding;
                    // an aux laid out like D.
                    let bias =
                        if p.bias != 0 { load((p.bias as *const u8).wrapping_offset(j as isize * size)) } else { 0.0 };
                    let result = p.alpha * s as f32 + prior + bias;
                    let aux =
                        |aux: u64| (aux as *mut u8).wrapping_offset(b as isize * p.d_stride as isize * d_size + at);
                    let value = match p.epilogue {
                        Epilogue::Plain => result,
                        Epilogue::Gelu { aux: 0 } => gelu_tanh(result),
                        Epilogue::Gelu { aux: pre } => {
                            store(aux(pre), result);
                            gelu_tanh(result)
                        }
                        Epilogue::GeluGrad { aux: pre } => result * gelu_tanh_grad(load_as(p.d_dtype, aux(pre))),
                    };
                    store(out, value);
                }
            }
        }
        Ok(())
    }
    fn scratch(&self, bytes: usize) -> Result<Ptr, BackendError> {
        if self.planned_scratch.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(BackendError::Device(format!("{bytes} bytes of scratch beyond what the step was planned")));
        }
        let mut s = self.scratch.lock().unwrap();
        if unsafe { (*s.lines.get()).len() } * 64 < bytes {
            *s = HostBuffer::new(bytes);
        }
        // Scratch comes with whatever the last user left, which on a GPU may be NaN: poisoned
        // with NaN bytes on every request, so that a kernel reading scratch it did not write
        // (a padded product's padding left unzeroed, NaN × 0) fails its test here.
        // SAFETY: the buffer holds at least `bytes`, and no launch is running (one at a time).
        unsafe { std::ptr::write_bytes(s.base() as *mut u8, 0xff, bytes) };
        Ok(Ptr(s.base()))
    }
    fn lend_planned_scratch(&self, at: Ptr, bytes: usize) {
        // Poisoned on every request, as `scratch` poisons its own.
        // SAFETY: the step's planned scratch, host memory of at least `bytes`.
        unsafe { std::ptr::write_bytes(at.0 as *mut u8, 0xff, bytes) };
    }
    fn scratch_budget(&self) -> usize {
        self.scratch_budget.load(std::sync::atomic::Ordering::Relaxed)
    }
    fn attention_grid_limit(&self) -> usize {
        self.attention_grid_limit.load(std::sync::atomic::Ordering::Relaxed)
    }
    fn fault(&self, what: String) -> Ptr {
        self.faults.lock().unwrap().push(what);
        Ptr(self.fault.base())
    }
    fn partials(&self, at: Ptr, count: usize) -> Result<Vec<f64>, BackendError> {
        // A read that waits for the stream without a fault check, as the GPU's does.
        self.waits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(unsafe { std::slice::from_raw_parts(at.0 as *const f64, count) }.to_vec())
    }
}

impl Backend for EmulatedGpu {
    type Buffer = HostBuffer;

    fn name(&self) -> String {
        "the CUDA kernels, emulated on the CPU".into()
    }

    fn open_collective(
        &self,
        group: &HostGroup,
    ) -> Result<Option<Box<dyn DeviceCollective<HostBuffer>>>, BackendError> {
        if !self.device_collectives.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(None);
        }
        // The MPI library at hand offers too low a threading level: no retry changes that.
        let threads = || BackendError::refused("the device's collectives need MPI_THREAD_MULTIPLE");
        let group = group.detach().ok_or_else(threads)?.into_group();
        Ok(Some(Box::new(Collectives { group, calls: self.collective_calls.clone() })))
    }

    fn alloc(&self, bytes: usize) -> Result<HostBuffer, BackendError> {
        Ok(HostBuffer::new(bytes))
    }

    fn upload(&self, src: &Tensor, dst: Arg<HostBuffer>) -> Result<(), BackendError> {
        assert_eq!(src.byte_len(), dst.meta.bytes());
        unsafe { std::ptr::copy_nonoverlapping(src.bytes().as_ptr(), at(&dst) as *mut u8, src.byte_len()) };
        Ok(())
    }

    fn download(&self, src: Arg<HostBuffer>) -> Result<Tensor, BackendError> {
        self.wait()?;
        let bytes = unsafe { std::slice::from_raw_parts(at(&src) as *const u8, src.meta.bytes()) };
        Ok(Tensor::from_bytes(src.meta.dtype, &src.meta.shape, bytes).expect("the meta's size"))
    }

    fn launch(
        &self,
        op: &Op,
        inputs: &[Option<Arg<HostBuffer>>],
        outputs: &[Arg<HostBuffer>],
        scratch: Option<Scratch<HostBuffer>>,
    ) -> Result<(), BackendError> {
        let ins: Vec<Option<V>> = inputs.iter().map(|a| a.as_ref().map(value)).collect();
        let outs: Vec<V> = outputs.iter().map(value).collect();
        let Some(s) = scratch else { return launch::run(self, op, &ins, &outs, None) };
        self.planned_scratch.store(true, std::sync::atomic::Ordering::Relaxed);
        let ran = launch::run(self, op, &ins, &outs, Some((Ptr(s.buf.base() + s.offset as u64), s.bytes)));
        self.planned_scratch.store(false, std::sync::atomic::Ordering::Relaxed);
        ran
    }

    fn scratch_bytes(&self, op: &Op, inputs: &[Option<&Meta>], outputs: &[&Meta]) -> usize {
        launch::scratch_bytes(self, op, inputs, outputs)
    }

    fn accumulate(
        &self,
        dst: Arg<HostBuffer>,
        keep: f32,
        src: Arg<HostBuffer>,
        scale: f32,
    ) -> Result<(), BackendError> {
        launch::accumulate(Dev::new(self), value(&dst), keep, value(&src), scale)
    }

    fn sum_squares(&self, xs: &[Arg<HostBuffer>]) -> Result<f64, BackendError> {
        let xs: Vec<V> = xs.iter().map(value).collect();
        launch::sum_squares(Dev::new(self), &xs)
    }

    fn optimizer_step(&self, update: &Update, h: StepHyper, slots: &[Slot<HostBuffer>]) -> Result<(), BackendError> {
        launch::optimizer_step(Dev::new(self), update, h, &launch::slots(slots, value))
    }

    fn adasum(
        &self,
        mine: &[Arg<HostBuffer>],
        theirs: &[Arg<HostBuffer>],
        mine_is_lower: bool,
    ) -> Result<(), BackendError> {
        let (mine, theirs): (Vec<V>, Vec<V>) = (mine.iter().map(value).collect(), theirs.iter().map(value).collect());
        launch::adasum(Dev::new(self), &mine, &theirs, mine_is_lower)
    }

    fn unsupported(&self, graph: &Graph) -> Vec<String> {
        CudaBackend::unsupported_nodes(graph)
    }

    fn synchronize(&self) -> Result<(), BackendError> {
        self.wait()
    }

    fn with_host_f32<E: From<BackendError>>(
        &self,
        x: Arg<HostBuffer>,
        f: &mut dyn FnMut(&mut [f32]) -> Result<(), E>,
    ) -> Result<(), E> {
        self.wait()?;
        f(unsafe { std::slice::from_raw_parts_mut(at(&x) as *mut f32, x.meta.numel()) })
    }
}
