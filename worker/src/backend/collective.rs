//! A group's collectives over a backend's values. A device with collectives of its own (NCCL on
//! GPUs) reduces them where they are, enqueued on its stream like a kernel; otherwise each value
//! crosses host memory (`Backend::with_host_f32`) and the group's MPI collective.
//!
//! The host side of the group stays at hand (`Group` dereferences to its `HostGroup`) for what is
//! host data anyway: per-step scalars, ZeRO's flat shards, a pipeline's packed messages.

use super::{Arg, Backend, BackendError};
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
    fn all_reduce(&self, values: &[Arg<Buf>], op: ReduceOp) -> std::result::Result<(), BackendError>;

    /// Every member's `values` become group rank `root`'s.
    fn broadcast(&self, values: &[Arg<Buf>], root: usize) -> std::result::Result<(), BackendError>;

    /// `all_reduce` beside the device's later work: ordered after the work enqueued so far,
    /// on the group's communication stream, which the device's work waits for only from
    /// `join` on. Until then nothing may write `values` (nor read the reduction).
    fn start_all_reduce(&self, values: &[Arg<Buf>], op: ReduceOp) -> std::result::Result<(), BackendError>;

    /// The device's work from here on waits for every collective started.
    fn join(&self) -> std::result::Result<(), BackendError>;

    /// Every member's `recv` becomes its part of the reduction of all members' `send`, which
    /// holds `recv`'s count per member, in member order.
    fn reduce_scatter(&self, send: Arg<Buf>, recv: Arg<Buf>, op: ReduceOp) -> std::result::Result<(), BackendError>;

    /// Every member's `recv` becomes all members' `send` end to end, in member order; `send`
    /// may be this member's part of `recv`.
    fn all_gather(&self, send: Arg<Buf>, recv: Arg<Buf>) -> std::result::Result<(), BackendError>;

    /// Sends `x` to group rank `to`, which receives it with `recv` (a pipeline's messages).
    fn send(&self, x: Arg<Buf>, to: usize) -> std::result::Result<(), BackendError>;

    /// Receives into `x` what group rank `from` sends.
    fn recv(&self, x: Arg<Buf>, from: usize) -> std::result::Result<(), BackendError>;

    /// Sends `send` to `to` and receives `recv` from `from` together, so that two ranks
    /// exchanging messages cannot wait on each other.
    fn send_recv(
        &self,
        send: Arg<Buf>,
        to: usize,
        recv: Arg<Buf>,
        from: usize,
    ) -> std::result::Result<(), BackendError>;
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
            backend.open_collective(&host).map_err(|e| Error::from(e.at(describe(&host))))?
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
        let d = self.device.as_ref().ok_or_else(|| {
            Error::Runtime(format!("start_all_reduce on {}: the group is not on a device", describe(&self.host)))
        })?;
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

    /// Every member's `recv` (f32) becomes its part of the reduction of all members' `send`
    /// (ZeRO's gradient shards).
    pub fn reduce_scatter_values(
        &self,
        backend: &B,
        send: Arg<B::Buffer>,
        recv: Arg<B::Buffer>,
        op: ReduceOp,
    ) -> Result<()> {
        match &self.device {
            Some(d) => d.reduce_scatter(send, recv, op).map_err(|e| self.error("reduce_scatter", e)),
            None => {
                let whole = super::read_f32(backend, send)?;
                let mut part = vec![0f32; recv.meta.numel()];
                self.host.reduce_scatter(&whole, &mut part[..], op)?;
                super::write_f32(backend, recv, &part)
            }
        }
    }

    /// Every member's `recv` (f32) becomes all members' `send` end to end (ZeRO's updated
    /// shards); `send` may be this member's part of `recv`.
    pub fn all_gather_values(&self, backend: &B, send: Arg<B::Buffer>, recv: Arg<B::Buffer>) -> Result<()> {
        match &self.device {
            Some(d) => d.all_gather(send, recv).map_err(|e| self.error("all_gather", e)),
            None => {
                let mine = super::read_f32(backend, send)?;
                let mut whole = vec![0f32; recv.meta.numel()];
                self.host.all_gather(&mine, &mut whole[..])?;
                super::write_f32(backend, recv, &whole)
            }
        }
    }

    /// Sends the f32 value `x` to group rank `to` (a pipeline's messages).
    pub fn send_value(&self, backend: &B, x: Arg<B::Buffer>, to: usize) -> Result<()> {
        match &self.device {
            Some(d) => d.send(x, to).map_err(|e| self.error("send", e)),
            None => self.on_host(backend, x, &mut |v| self.host.send(v, to)),
        }
    }

    /// Receives into the f32 value `x` what group rank `from` sends.
    pub fn recv_value(&self, backend: &B, x: Arg<B::Buffer>, from: usize) -> Result<()> {
        match &self.device {
            Some(d) => d.recv(x, from).map_err(|e| self.error("recv", e)),
            None => self.on_host(backend, x, &mut |v| self.host.recv(v, from)),
        }
    }

    /// Sends `send` to `to` and receives `recv` from `from`, neither waiting for the other.
    pub fn send_recv_values(
        &self,
        backend: &B,
        send: Arg<B::Buffer>,
        to: usize,
        recv: Arg<B::Buffer>,
        from: usize,
    ) -> Result<()> {
        match &self.device {
            Some(d) => d.send_recv(send, to, recv, from).map_err(|e| self.error("send_recv", e)),
            None => {
                let outgoing = super::read_f32(backend, send)?;
                self.on_host(backend, recv, &mut |v| self.host.send_recv(&outgoing, to, v, from))
            }
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
        values.iter().try_for_each(|&v| self.on_host(backend, v, collective))
    }

    /// Runs `f` on the value `x` in host memory (the CPU's own bytes; a device's, copied).
    fn on_host(&self, backend: &B, x: Arg<B::Buffer>, f: &mut dyn FnMut(&mut [f32]) -> Result<()>) -> Result<()> {
        backend.with_host_f32(x, &mut |v| f(v))
    }

    fn error(&self, op: &str, e: BackendError) -> Error {
        e.at(format_args!("{op} on {}", describe(&self.host))).into()
    }
}

impl<B: Backend> std::ops::Deref for Group<B> {
    type Target = HostGroup;

    fn deref(&self) -> &HostGroup {
        &self.host
    }
}
