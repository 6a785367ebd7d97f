//! The CPU backend: host memory buffers, kernels on rayon's thread pool, GEMM from the `gemm`
//! crate. Work runs when it is launched, so `synchronize` has nothing to wait for. The kernels
//! themselves are the crate's host reference ops, `crate::kernels`.

use super::{Arg, Backend, BackendError, Scratch, Slot};
use crate::kernels;
use crate::op::Op;
use crate::optim::{StepHyper, Update};
use crate::refused;
use crate::tensor::{Tensor, TensorView, TensorViewMut};
use rayon::prelude::*;
use std::cell::UnsafeCell;

/// Host memory, 8-byte aligned. Written through shared references: the executor's plan
/// guarantees that no two live values overlap, which is what makes the views below sound.
pub struct CpuBuffer {
    words: UnsafeCell<Vec<u64>>,
    len: usize,
}

unsafe impl Send for CpuBuffer {}
unsafe impl Sync for CpuBuffer {}

impl CpuBuffer {
    fn bytes_at(&self, offset: usize, len: usize) -> *mut u8 {
        assert!(offset + len <= self.len, "a value runs past its buffer ({offset}+{len} > {})", self.len);
        unsafe { ((*self.words.get()).as_mut_ptr() as *mut u8).add(offset) }
    }
}

fn view<'a>(a: &Arg<'a, CpuBuffer>) -> TensorView<'a> {
    let len = a.meta.bytes();
    let p = a.buf.bytes_at(a.offset, len);
    TensorView { dtype: a.meta.dtype, shape: &a.meta.shape, bytes: unsafe { std::slice::from_raw_parts(p, len) } }
}

fn view_mut<'a>(a: &Arg<'a, CpuBuffer>) -> TensorViewMut<'a> {
    let len = a.meta.bytes();
    let p = a.buf.bytes_at(a.offset, len);
    TensorViewMut {
        dtype: a.meta.dtype,
        shape: &a.meta.shape,
        bytes: unsafe { std::slice::from_raw_parts_mut(p, len) },
    }
}

/// The host's CPU, with the memory the machine (or its container) offers, or less.
#[derive(Default)]
pub struct CpuBackend {
    /// A cap on what `memory_available` reports, below the machine's.
    memory_limit: Option<usize>,
}

impl CpuBackend {
    pub fn new() -> CpuBackend {
        CpuBackend { memory_limit: None }
    }

    /// As a machine with only `bytes` of memory, for the checks that a run fits before it
    /// allocates (a machine's real size makes their bounds a test cannot reach).
    pub fn with_memory_limit(bytes: usize) -> CpuBackend {
        CpuBackend { memory_limit: Some(bytes) }
    }
}

impl Backend for CpuBackend {
    type Buffer = CpuBuffer;

    fn name(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn alloc(&self, bytes: usize) -> Result<CpuBuffer, BackendError> {
        let mut v = Vec::new();
        v.try_reserve_exact(bytes.div_ceil(8)).map_err(|_| BackendError::OutOfMemory {
            place: "the host".into(),
            bytes,
            // The machine's total is known, its free memory is not (the page cache counts).
            free: None,
        })?;
        v.resize(bytes.div_ceil(8), 0);
        Ok(CpuBuffer { words: UnsafeCell::new(v), len: bytes })
    }

    fn upload(&self, src: &Tensor, dst: Arg<CpuBuffer>) -> Result<(), BackendError> {
        if src.byte_len() != dst.meta.bytes() {
            return refused!("uploading {} bytes into a value of {}", src.byte_len(), dst.meta.bytes());
        }
        view_mut(&dst).bytes.copy_from_slice(src.bytes());
        Ok(())
    }

    fn download(&self, src: Arg<CpuBuffer>) -> Result<Tensor, BackendError> {
        Ok(view(&src).to_tensor())
    }

    fn launch(
        &self,
        op: &Op,
        inputs: &[Option<Arg<CpuBuffer>>],
        outputs: &[Arg<CpuBuffer>],
        _scratch: Option<Scratch<CpuBuffer>>,
    ) -> Result<(), BackendError> {
        let ins: Vec<Option<TensorView>> = inputs.iter().map(|a| a.as_ref().map(view)).collect();
        let mut outs: Vec<TensorViewMut> = outputs.iter().map(view_mut).collect();
        kernels::run(op, &ins, &mut outs)
    }

    fn accumulate(&self, dst: Arg<CpuBuffer>, keep: f32, src: Arg<CpuBuffer>, scale: f32) -> Result<(), BackendError> {
        let s = view(&src).as_slice::<f32>();
        let mut d = view_mut(&dst);
        d.as_mut_slice::<f32>()
            .par_iter_mut()
            .zip(s.par_iter())
            .for_each(|(d, s)| *d = if keep == 0.0 { s * scale } else { *d * keep + s * scale });
        Ok(())
    }

    fn adasum(
        &self,
        mine: &[Arg<CpuBuffer>],
        theirs: &[Arg<CpuBuffer>],
        mine_is_lower: bool,
    ) -> Result<(), BackendError> {
        for (m, t) in mine.iter().zip(theirs) {
            let (mut m, mut t) = (view_mut(m), view_mut(t));
            crate::kernels::adasum::combine_pair(m.as_mut_slice::<f32>(), t.as_mut_slice::<f32>(), mine_is_lower);
        }
        Ok(())
    }

    fn with_host_f32<E: From<BackendError>>(
        &self,
        x: Arg<CpuBuffer>,
        f: &mut dyn FnMut(&mut [f32]) -> Result<(), E>,
    ) -> Result<(), E> {
        f(view_mut(&x).as_mut_slice::<f32>())
    }

    fn sum_squares(&self, xs: &[Arg<CpuBuffer>]) -> Result<f64, BackendError> {
        // Partial sums collected in order, then added in order: the same bits on every run,
        // whichever thread finished first (resumed runs must repeat the clipping exactly).
        let value = |x: &Arg<CpuBuffer>| -> f64 {
            let partials: Vec<f64> = view(x)
                .as_slice::<f32>()
                .par_chunks(4096)
                .map(|c| c.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>())
                .collect();
            partials.iter().sum()
        };
        Ok(xs.iter().map(value).fold(0.0, |total, sq| total + sq))
    }

    fn optimizer_step(&self, update: &Update, h: StepHyper, slots: &[Slot<CpuBuffer>]) -> Result<(), BackendError> {
        for s in slots {
            let mut p = view_mut(&s.param);
            let g = view(&s.grad).as_slice::<f32>();
            let mut st: Vec<TensorViewMut> = s.state.iter().map(view_mut).collect();
            crate::optim::cpu_step(update, h, p.as_mut_slice::<f32>(), g, &mut st)?;
        }
        Ok(())
    }

    fn memory_available(&self) -> Option<usize> {
        let machine = crate::host::memory_bytes();
        self.memory_limit.map_or(machine, |limit| Some(machine.map_or(limit, |m| m.min(limit))))
    }

    fn synchronize(&self) -> Result<(), BackendError> {
        Ok(())
    }
}
