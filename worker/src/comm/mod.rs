//! Communication between ranks: the world (who we are among the processes mpirun started), the
//! parallel layout's groups (DP × TP × PP), and one collective interface over a group.
//!
//! - `topology`: the rank ↔ (dp, tp, pp) mapping and group membership; pure arithmetic.
//! - `Collective`: all-reduce, reduce-scatter, all-gather, broadcast, send/recv over a group, for
//!   any buffer type an implementation can move. Host slices (`[f32]`, `[f64]`) through MPI now;
//!   device buffers through NCCL later, behind the same trait.
//! - `solo`: a group of one process, the whole story when the world has one rank.
//! - `mpi` (feature `mpi`): the MPI implementation.
//! - `watchdog`: the collective timeout that turns a dead or hung peer into a prompt, loud exit.
//! - `world`: start-up (MPI or not), local rank, and the groups of a layout.

#[cfg(feature = "mpi")]
pub mod mpi;
pub mod solo;
pub mod topology;
pub mod watchdog;
pub mod world;

pub use solo::SoloGroup;
pub use topology::{Axis, Coords, Layout};
pub use world::{CommOptions, DetachedHostGroup, HostGroup, ParallelGroups, World};

use crate::error::{Error, Result};

/// How an all-reduce or reduce-scatter combines the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// The sum divided by the group size (data-parallel gradients, evaluation losses).
    Average,
    /// The largest value (a vocab-parallel softmax's row maxima).
    Max,
}

/// Who is in a group and where this process sits in it.
pub trait ProcessGroup {
    /// "world", or the axis: "data", "tensor", "pipeline".
    fn name(&self) -> &str;
    fn size(&self) -> usize;
    /// This process's rank within the group (0..size).
    fn rank(&self) -> usize;
    /// The members' world ranks, indexed by group rank.
    fn members(&self) -> &[usize];
    /// Returns once every member has entered the barrier.
    fn barrier(&self) -> Result<()>;
}

/// The collectives over a group, for buffers of type `Buf` (a host slice, or a device buffer).
/// Every member calls the same collectives in the same order with matching lengths; ranks are
/// group ranks. Host implementations return when the result is in place; a device
/// implementation may return once the work is ordered on its stream, as NCCL does.
/// Errors are the caller's mistakes (lengths, ranks); a peer that fails is the watchdog's.
pub trait Collective<Buf: ?Sized>: ProcessGroup {
    /// Every member's `buf` becomes the sum (or average) of all members' `buf`.
    fn all_reduce(&self, buf: &mut Buf, op: ReduceOp) -> Result<()>;

    /// Reduces the members' `send` and leaves chunk `rank` of the result in `recv`;
    /// `send` has `size` chunks of `recv`'s length.
    fn reduce_scatter(&self, send: &Buf, recv: &mut Buf, op: ReduceOp) -> Result<()>;

    /// `recv` becomes the members' `send` buffers concatenated in group-rank order;
    /// `recv` has `size` times `send`'s length.
    fn all_gather(&self, send: &Buf, recv: &mut Buf) -> Result<()>;

    /// Every member's `buf` becomes `root`'s.
    fn broadcast(&self, buf: &mut Buf, root: usize) -> Result<()>;

    /// Sends `buf` to group rank `to`, which receives it with `recv`. May block until it does.
    fn send(&self, buf: &Buf, to: usize) -> Result<()>;

    /// Fills `buf` with what group rank `from` sends; the lengths must match.
    fn recv(&self, buf: &mut Buf, from: usize) -> Result<()>;

    /// `send` to `to` and `recv` from `from` at once, so that a ring or a pipeline's forward
    /// and backward exchange cannot deadlock on two blocking sends.
    fn send_recv(&self, send: &Buf, to: usize, recv: &mut Buf, from: usize) -> Result<()>;
}

/// The element types host collectives reduce: floats, since averages divide.
pub trait HostElement:
    bytemuck::Pod + Default + std::ops::Div<Output = Self> + std::fmt::Debug + Send + Sync + mpi_type::MpiType
{
    /// `n` as this type (the divisor of an average).
    fn from_count(n: usize) -> Self;
}

impl HostElement for f32 {
    fn from_count(n: usize) -> f32 {
        n as f32
    }
}

impl HostElement for f64 {
    fn from_count(n: usize) -> f64 {
        n as f64
    }
}

/// With MPI, host elements must be types MPI knows; without it, any type will do.
mod mpi_type {
    #[cfg(feature = "mpi")]
    pub trait MpiType: ::mpi::traits::Equivalence {}
    #[cfg(feature = "mpi")]
    impl<T: ::mpi::traits::Equivalence> MpiType for T {}

    #[cfg(not(feature = "mpi"))]
    pub trait MpiType {}
    #[cfg(not(feature = "mpi"))]
    impl<T> MpiType for T {}
}

/// "group 'data' (rank 1 of 2, world ranks [1, 3])": how errors and the watchdog name a place.
pub fn describe(group: &(impl ProcessGroup + ?Sized)) -> String {
    format!("group '{}' (rank {} of {}, world ranks {:?})", group.name(), group.rank(), group.size(), group.members())
}

/// The argument checks every implementation makes, so that a wrong call fails the same way
/// (and names the group) whichever implementation serves it.
pub(crate) mod check {
    use super::*;

    pub fn scatter_lengths(g: &(impl ProcessGroup + ?Sized), send: usize, recv: usize) -> Result<()> {
        if send != recv * g.size() {
            return Err(Error::Runtime(format!(
                "reduce_scatter on {}: send holds {send} values, expected {} chunks of the receive length {recv}",
                describe(g),
                g.size()
            )));
        }
        Ok(())
    }

    pub fn gather_lengths(g: &(impl ProcessGroup + ?Sized), send: usize, recv: usize) -> Result<()> {
        if recv != send * g.size() {
            return Err(Error::Runtime(format!(
                "all_gather on {}: receive holds {recv} values, expected {} chunks of the send length {send}",
                describe(g),
                g.size()
            )));
        }
        Ok(())
    }

    pub fn root(g: &(impl ProcessGroup + ?Sized), op: &str, root: usize) -> Result<()> {
        if root >= g.size() {
            return Err(Error::Runtime(format!("{op} on {}: rank {root} is not in the group", describe(g))));
        }
        Ok(())
    }

    /// A blocking send or receive must name another member: to oneself it would wait forever.
    pub fn peer(g: &(impl ProcessGroup + ?Sized), op: &str, peer: usize) -> Result<()> {
        root(g, op, peer)?;
        if peer == g.rank() {
            return Err(Error::Runtime(format!("{op} on {}: the peer is this rank itself", describe(g))));
        }
        Ok(())
    }
}
