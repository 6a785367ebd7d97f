//! A group's collectives over a backend's values. A device with collectives of its own (NCCL on
//! GPUs) reduces them where they are, enqueued on its stream like a kernel; otherwise each value
//! crosses host memory (`Backend::with_host_f32`) and the group's MPI collective.
//!
//! The host side of the group stays at hand (`Group` dereferences to its `HostGroup`) for what is
//! host data anyway: per-step scalars, ZeRO's flat shards, a pipeline's packed messages.

use super::{Arg, Backend};
use crate::comm::{describe, Collective, HostGroup, ProcessGroup, ReduceOp};
use crate::error::{Error, Result};

/// The collectives of one group over a backend's own buffers. Every member calls the same ones
/// in the same order with values of the same metas; each call may return once its work is
/// ordered on the device.
pub trait DeviceCollective<Buf>: Send + Sync {
    /// What carries them, for logs: "NCCL 2.23.4".
    fn name(&self) -> String;

    /// Every member's `values` become their sum (average, maximum) over the group; the values
    /// are reduced together (one NCCL group), not one after another.
    fn all_reduce(&self, values: &[Arg<Buf>], op: ReduceOp) -> std::result::Result<(), String>;

    /// Every member's `values` become group rank `root`'s.
    fn broadcast(&self, values: &[Arg<Buf>], root: usize) -> std::result::Result<(), String>;

    /// `all_reduce` beside the device's later work: ordered after the work enqueued so far,
    /// on the group's communication stream, which the device's work waits for only from
    /// `join` on. Until then nothing may write `values` (nor read the reduction).
    fn start_all_reduce(&self, values: &[Arg<Buf>], op: ReduceOp) -> std::result::Result<(), String>;

    /// The device's work from here on waits for every collective started.
    fn join(&self) -> std::result::Result<(), String>;
}

pub struct Group<B: Backend> {
    host: HostGroup,
    device: Option<Box<dyn DeviceCollective<B::Buffer>>>,
}

impl<B: Backend> Group<B> {
    /// The group's collectives on `backend`: its device's own when it has them (opening them is
    /// collective: every member opens its groups in the same order), else the host's.
    pub fn open(backend: &B, host: HostGroup) -> Result<Group<B>> {
        let device = if host.size() > 1 {
            backend.open_collective(&host).map_err(|e| Error::Runtime(format!("{}: {e}", describe(&host))))?
        } else {
            None
        };
        if let Some(d) = &device {
            tracing::info!(
                group = host.name(),
                "values of {} are reduced on the device by {}",
                describe(&host),
                d.name()
            );
        }
        Ok(Group { host, device })
    }

    /// The group with host collectives only.
    pub fn host(host: HostGroup) -> Group<B> {
        Group { host, device: None }
    }

    /// Whether values are reduced on the device (a host thread then has nothing to overlap).
    pub fn on_device(&self) -> bool {
        self.device.is_some()
    }

    /// Every member's `values` (f32) become their reduction over the group.
    pub fn all_reduce_values(&self, backend: &B, values: &[Arg<B::Buffer>], op: ReduceOp) -> Result<()> {
        match &self.device {
            Some(d) => d.all_reduce(values, op).map_err(|e| self.error("all_reduce", e)),
            None => self.through_host(backend, values, &mut |x| self.host.all_reduce(x, op)),
        }
    }

    /// Every member's `values` become their reduction over the group, on the device's
    /// communication stream beside its later work, until `join` (see
    /// [`DeviceCollective::start_all_reduce`]); only for a group `on_device`.
    pub fn start_all_reduce(&self, values: &[Arg<B::Buffer>], op: ReduceOp) -> Result<()> {
        let d = self
            .device
            .as_ref()
            .ok_or_else(|| self.error("start_all_reduce", "the group is not on a device".into()))?;
        d.start_all_reduce(values, op).map_err(|e| self.error("all_reduce", e))
    }

    /// The device's work from here on waits for every all-reduce started (nothing to wait for
    /// on the host).
    pub fn join(&self) -> Result<()> {
        match &self.device {
            Some(d) => d.join().map_err(|e| self.error("join", e)),
            None => Ok(()),
        }
    }

    /// Every member's `values` (f32) become group rank `root`'s.
    pub fn broadcast_values(&self, backend: &B, values: &[Arg<B::Buffer>], root: usize) -> Result<()> {
        crate::comm::check::root(&self.host, "broadcast", root)?;
        match &self.device {
            Some(d) => d.broadcast(values, root).map_err(|e| self.error("broadcast", e)),
            None => self.through_host(backend, values, &mut |x| self.host.broadcast(x, root)),
        }
    }

    /// Runs a host collective on each value in turn, copied to host memory and back.
    fn through_host(
        &self,
        backend: &B,
        values: &[Arg<B::Buffer>],
        collective: &mut dyn FnMut(&mut [f32]) -> Result<()>,
    ) -> Result<()> {
        for &v in values {
            backend.with_host_f32(v, &mut |x| collective(x).map_err(|e| e.to_string())).map_err(Error::Runtime)?;
        }
        Ok(())
    }

    fn error(&self, op: &str, e: String) -> Error {
        Error::Runtime(format!("{op} on {}: {e}", describe(&self.host)))
    }
}

impl<B: Backend> std::ops::Deref for Group<B> {
    type Target = HostGroup;

    fn deref(&self) -> &HostGroup {
        &self.host
    }
}
