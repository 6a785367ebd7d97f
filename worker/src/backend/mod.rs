//! The device abstraction. A backend owns device memory and runs ops on it; the executor plans
//! which bytes of which buffer every value lives in and asks the backend to run each step.
//!
//! The trait is shaped for asynchronous devices: `upload`, `launch` and the optimizer calls
//! are enqueued work (the CPU backend simply does them at once), and only `download`,
//! `sum_squares` and `synchronize` wait. A CUDA backend implements the same calls with a
//! stream, device allocations and kernel launches.

pub mod collective;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;

pub use crate::error::BackendError;
pub use collective::{DeviceCollective, Group};

use crate::comm::HostGroup;
use crate::graph::ir::{Graph, Meta};
use crate::op::Op;
use crate::optim::{StepHyper, Update};
use crate::tensor::Tensor;

/// A value's place on the device: a buffer, a byte offset into it, and its type and shape.
pub struct Arg<'a, B> {
    pub buf: &'a B,
    pub offset: usize,
    pub meta: &'a Meta,
}

impl<B> Clone for Arg<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for Arg<'_, B> {}

/// Temporary memory the executor's plan set aside for one step (the bytes
/// [`Backend::scratch_bytes`] asked for), in the arena beside the step's values: the kernels
/// may use it until the step's work is done, and the plan gives it to later values after that.
pub struct Scratch<'a, B> {
    pub buf: &'a B,
    pub offset: usize,
    pub bytes: usize,
}

/// One weight's operands in an optimizer update: the weight, its gradient, and its state
/// buffers (momentum; or Adam's first and second moments), all f32 of the weight's meta.
pub struct Slot<'a, B> {
    pub param: Arg<'a, B>,
    pub grad: Arg<'a, B>,
    pub state: Vec<Arg<'a, B>>,
}

/// An f32 value's elements, copied to host memory (where host collectives reduce it).
pub fn read_f32<B: Backend>(backend: &B, x: Arg<B::Buffer>) -> crate::error::Result<Vec<f32>> {
    let mut out = Vec::with_capacity(x.meta.numel());
    backend.with_host_f32(x, &mut |v| {
        out.extend_from_slice(v);
        Ok::<_, BackendError>(())
    })?;
    Ok(out)
}

/// Sets an f32 value's elements from host memory (`src` of its length).
pub fn write_f32<B: Backend>(backend: &B, x: Arg<B::Buffer>, src: &[f32]) -> crate::error::Result<()> {
    backend.with_host_f32(x, &mut |v| {
        v.copy_from_slice(src);
        Ok::<_, BackendError>(())
    })?;
    Ok(())
}

pub trait Backend: Send + Sync + 'static {
    type Buffer: Send + Sync + 'static;

    fn name(&self) -> String;

    /// `bytes` of zeroed device memory.
    fn alloc(&self, bytes: usize) -> Result<Self::Buffer, BackendError>;

    /// Copies a host tensor to `dst` (its bytes must fit at `dst.offset`).
    fn upload(&self, src: &Tensor, dst: Arg<Self::Buffer>) -> Result<(), BackendError>;

    /// Copies a device value to a host tensor of the same meta; waits for pending work.
    fn download(&self, src: Arg<Self::Buffer>) -> Result<Tensor, BackendError>;

    /// Runs one static op. `outputs` never overlap live `inputs` (the planner sees to it);
    /// `scratch`, where the plan gave the step some, overlaps neither.
    fn launch(
        &self,
        op: &Op,
        inputs: &[Option<Arg<Self::Buffer>>],
        outputs: &[Arg<Self::Buffer>],
        scratch: Option<Scratch<Self::Buffer>>,
    ) -> Result<(), BackendError>;

    /// The temporary memory `launch` would use for `op` on values of these metas, which the
    /// executor's plan then places in its arena (and counts in its peak). None by default: a
    /// backend whose kernels need none, or that allocates its own (the CPU's).
    fn scratch_bytes(&self, _op: &Op, _inputs: &[Option<&Meta>], _outputs: &[&Meta]) -> usize {
        0
    }

    /// dst = dst·keep + src·scale over f32 values of the same meta (gradient accumulation);
    /// keep 0 overwrites dst, whatever it held (the inf or NaN of a skipped fp16 step too).
    fn accumulate(
        &self,
        dst: Arg<Self::Buffer>,
        keep: f32,
        src: Arg<Self::Buffer>,
        scale: f32,
    ) -> Result<(), BackendError>;

    /// Σ x² over f32 values, for global gradient norms: summed per value, then over the values
    /// in order. Waits for pending work, once for all of them.
    fn sum_squares(&self, xs: &[Arg<Self::Buffer>]) -> Result<f64, BackendError>;

    /// One optimizer update of every weight in `slots`, which share `update` and `hyper` (a
    /// parameter group): a GPU updates them all in one launch rather than one per weight.
    fn optimizer_step(
        &self,
        update: &Update,
        hyper: StepHyper,
        slots: &[Slot<Self::Buffer>],
    ) -> Result<(), BackendError>;

    /// Adasum of each pair of f32 values (`kernels::adasum::combine_pair`): `mine[i]` becomes
    /// adasum(lower rank's, higher rank's) of it and `theirs[i]`, the partner's (which may be
    /// overwritten), the same floats on both ranks of the pair. A device does it without waiting.
    fn adasum(
        &self,
        mine: &[Arg<Self::Buffer>],
        theirs: &[Arg<Self::Buffer>],
        mine_is_lower: bool,
    ) -> Result<(), BackendError>;

    /// The nodes of `graph` this backend has no kernel for, one line each naming the node and
    /// why; empty when it can run them all (the CPU runs every op).
    fn unsupported(&self, _graph: &Graph) -> Vec<String> {
        Vec::new()
    }

    /// Opens `group`'s collectives over this backend's buffers, when the device has its own
    /// (NCCL on GPUs). Collective: every member calls it for the group, and all must get the
    /// same answer. None: values cross host memory (`with_host_f32`) and the group's MPI.
    fn open_collective(
        &self,
        _group: &HostGroup,
    ) -> Result<Option<Box<dyn DeviceCollective<Self::Buffer>>>, BackendError> {
        Ok(None)
    }

    /// The memory a plan may take on this device, asked before its arena is allocated: a GPU's
    /// free memory; the machine's (or its container's) for the CPU. None when unknown.
    fn memory_available(&self) -> Option<usize> {
        None
    }

    /// Waits until all enqueued work is done.
    fn synchronize(&self) -> Result<(), BackendError>;

    /// Ends this rank's device collectives at once, whatever their peers do: the run is ending
    /// in an error, and its in-flight collectives (which may wait for peers that wait for this
    /// rank) must not hold up its exit, nor the freeing of the memory they use. NCCL's
    /// communicators are aborted; host collectives need nothing.
    fn abort_collectives(&self) {}

    /// The device's dense peak FLOP/s for products computing in `compute` (f32, or a half
    /// type's tensor cores), when known: what model FLOPs utilization is measured against.
    fn peak_flops(&self, _compute: crate::tensor::DType) -> Option<f64> {
        None
    }

    /// Lets `f` change an f32 value in host memory: the CPU hands over the value's own bytes; a
    /// device copies it to the host and back. Host collectives (MPI) reduce values through it
    /// where the device has no collectives of its own.
    fn with_host_f32<E: From<BackendError>>(
        &self,
        x: Arg<Self::Buffer>,
        f: &mut dyn FnMut(&mut [f32]) -> Result<(), E>,
    ) -> Result<(), E>;
}
