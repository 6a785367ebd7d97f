//! Collectives over MPI communicators (rsmpi), for host buffers.
//!
//! MPI is initialised with `MPI_THREAD_MULTIPLE` when the library offers it: the watchdog
//! aborts the job from its own thread while the main thread is blocked inside MPI, and the
//! data-parallel all-reduce is to overlap with backward on a thread of its own.
//!
//! Each group is its own communicator (a duplicate of the world, or a split of it), so the
//! traffic of one group can never match a message of another, and MPI's errors stay fatal
//! (`MPI_ERRORS_ARE_FATAL`, the default): a broken connection aborts the job rather than
//! returning an error code that every call would have to check.

use super::watchdog::{InCollective, Watchdog};
use super::{check, describe, Collective, HostElement, ProcessGroup, ReduceOp};
use crate::error::{Error, Result};
use ::mpi::collective::SystemOperation;
use ::mpi::environment::Universe;
use ::mpi::point_to_point::send_receive_into_with_tags;
use ::mpi::topology::{Color, SimpleCommunicator};
use ::mpi::traits::*;
use ::mpi::Threading;
use std::cell::RefCell;
use std::sync::Arc;
use std::time::Duration;

/// The exit code of a rank whose collective timed out: 1, "anything else, worth retrying", in
/// the command line's contract (DESIGN.md), since a dead peer is what a gang restart fixes.
pub const TIMEOUT_EXIT_CODE: i32 = 1;

/// Point-to-point messages of a group use one tag: MPI keeps messages between two ranks of one
/// communicator in order, which is all the pipeline's sends need.
const TAG: ::mpi::Tag = 0;

/// The initialised MPI library. Finalised when the last holder is dropped; every group holds
/// it, so no communicator outlives `MPI_Finalize`.
pub struct MpiRuntime {
    /// Dropping it calls `MPI_Finalize`.
    _universe: Universe,
    pub threading: Threading,
}

/// What MPI says about this process at start-up.
pub struct MpiStart {
    pub runtime: Arc<MpiRuntime>,
    pub rank: usize,
    pub size: usize,
    /// Rank and size among the ranks sharing this node's memory.
    pub local_rank: usize,
    pub local_size: usize,
    pub watchdog: Option<Arc<Watchdog>>,
}

/// Initialises MPI (once per process) and starts the collective watchdog (unless the timeout
/// is zero).
pub fn start(collective_timeout: Duration) -> Result<MpiStart> {
    let (universe, threading) = ::mpi::initialize_with_threading(Threading::Multiple).ok_or_else(|| {
        Error::Runtime("MPI was already initialised in this process: the world can be started only once".into())
    })?;
    // An Arc, not an Rc: a group detached to a communication thread holds it too.
    #[allow(clippy::arc_with_non_send_sync)]
    let runtime = Arc::new(MpiRuntime { _universe: universe, threading });
    let world = SimpleCommunicator::world();
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    // Ranks that share memory are the ranks on this node; their order follows the world's.
    let node = world.split_shared(rank as i32);
    let (local_rank, local_size) = (node.rank() as usize, node.size() as usize);
    drop(node);
    let watchdog = if collective_timeout.is_zero() {
        None
    } else {
        let can_abort_from_any_thread = threading == Threading::Multiple;
        let dog = Watchdog::start(collective_timeout, move |_message| {
            if can_abort_from_any_thread {
                // mpirun kills every rank of the job and exits with this code.
                SimpleCommunicator::world().abort(TIMEOUT_EXIT_CODE);
            }
            // Calling MPI from this thread is not allowed at this threading level; a rank that
            // exits without MPI_Finalize makes mpirun tear the job down all the same.
            std::process::exit(TIMEOUT_EXIT_CODE);
        })
        .map_err(|e| Error::Runtime(format!("rank {rank}: cannot start the collective watchdog thread: {e}")))?;
        Some(dog)
    };
    Ok(MpiStart { runtime, rank, size, local_rank, local_size, watchdog })
}

/// A process group backed by an MPI communicator. Not `Send`: MPI handles belong to the thread
/// that made them, unless the library is fully thread-safe.
pub struct MpiGroup {
    /// Declared before `runtime` so that it is freed before MPI can be finalised.
    comm: SimpleCommunicator,
    name: String,
    rank: usize,
    members: Vec<usize>,
    /// `describe(self)`, made once, for the watchdog.
    place: Arc<str>,
    watchdog: Option<Arc<Watchdog>>,
    /// The send side of an in-place all-reduce (rsmpi has no `MPI_IN_PLACE`): grown to the
    /// largest buffer once, then reused. Words of 8 bytes keep any float element aligned.
    scratch: RefCell<Vec<u64>>,
    runtime: Arc<MpiRuntime>,
}

impl MpiGroup {
    /// The whole world, on a duplicate of `MPI_COMM_WORLD` that no library shares with us.
    pub fn world(start: &MpiStart) -> MpiGroup {
        let comm = SimpleCommunicator::world().duplicate();
        MpiGroup::new(comm, "world", (0..start.size).collect(), start)
    }

    /// Collective over the world: every rank calls it, with its own `color` (equal within a
    /// group) and `members` (the group's world ranks; this rank's position in them is its
    /// group rank, and MPI orders the split by the same key).
    pub fn split(start: &MpiStart, name: &str, color: usize, members: Vec<usize>) -> Result<MpiGroup> {
        let key = members.iter().position(|&r| r == start.rank).ok_or_else(|| {
            Error::Runtime(format!("rank {}: not a member of its own {name} group {members:?}", start.rank))
        })?;
        let comm = SimpleCommunicator::world()
            .split_by_color_with_key(Color::with_value(color as i32), key as i32)
            .ok_or_else(|| {
                Error::Runtime(format!("rank {}: MPI gave no communicator for group '{name}'", start.rank))
            })?;
        let g = MpiGroup::new(comm, name, members, start);
        if g.comm.size() as usize != g.members.len() || g.comm.rank() as usize != key {
            return Err(Error::Runtime(format!(
                "{}: MPI split it into rank {} of {} ranks; the ranks disagree on the layout",
                describe(&g),
                g.comm.rank(),
                g.comm.size()
            )));
        }
        Ok(g)
    }

    fn new(comm: SimpleCommunicator, name: &str, members: Vec<usize>, start: &MpiStart) -> MpiGroup {
        let rank = comm.rank() as usize;
        let mut g = MpiGroup {
            comm,
            name: name.to_string(),
            rank,
            members,
            place: Arc::from(""),
            watchdog: start.watchdog.clone(),
            scratch: RefCell::new(Vec::new()),
            runtime: start.runtime.clone(),
        };
        g.place = describe(&g).into();
        g
    }

    /// A duplicate of this group for another thread (collective over the group), when MPI
    /// runs with `MPI_THREAD_MULTIPLE`; None at a lower threading level, where only one thread
    /// may call MPI.
    pub fn detach(&self) -> Option<DetachedGroup> {
        if self.runtime.threading != Threading::Multiple {
            return None;
        }
        let mut g = MpiGroup {
            comm: self.comm.duplicate(),
            name: self.name.clone(),
            rank: self.rank,
            members: self.members.clone(),
            place: Arc::from(""),
            watchdog: self.watchdog.clone(),
            scratch: RefCell::new(Vec::new()),
            runtime: self.runtime.clone(),
        };
        g.place = describe(&g).into();
        Some(DetachedGroup(g))
    }

    fn enter(&self, op: &'static str) -> Option<InCollective<'_>> {
        self.watchdog.as_ref().map(|dog| dog.enter(op, &self.place))
    }

    /// MPI counts are C ints.
    fn count(&self, op: &str, n: usize) -> Result<()> {
        if n > i32::MAX as usize {
            return Err(Error::Runtime(format!(
                "{op} on {}: {n} values is more than one MPI call can move (2^31 - 1)",
                describe(self)
            )));
        }
        Ok(())
    }

    /// MPI accepts a message shorter than the receive buffer; the pipeline must not.
    fn received<T: HostElement>(
        &self,
        from: usize,
        status: ::mpi::point_to_point::Status,
        expected: usize,
    ) -> Result<()> {
        let got = status.count(T::equivalent_datatype()) as usize;
        if got != expected {
            return Err(Error::Runtime(format!(
                "recv on {}: rank {from} sent {got} values, expected {expected}",
                describe(self)
            )));
        }
        Ok(())
    }

    fn peer(&self, rank: usize) -> ::mpi::topology::Process<'_> {
        self.comm.process_at_rank(rank as i32)
    }
}

/// A group on its own duplicate communicator, on its way to the one thread that will use it
/// (the data-parallel gradient all-reduce overlapping the backward pass).
pub struct DetachedGroup(MpiGroup);

// SAFETY: MPI runs with MPI_THREAD_MULTIPLE (`detach` checks), so any thread may call it; the
// communicator is a fresh duplicate that only the receiving thread uses; the scratch buffer
// moves with the group; the runtime is shared through an Arc, and MPI is finalised only when
// its last holder is gone.
unsafe impl Send for DetachedGroup {}

impl DetachedGroup {
    /// The group, for the thread that received it.
    pub fn into_group(self) -> MpiGroup {
        self.0
    }
}

impl ProcessGroup for MpiGroup {
    fn name(&self) -> &str {
        &self.name
    }
    fn size(&self) -> usize {
        self.members.len()
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn members(&self) -> &[usize] {
        &self.members
    }
    fn barrier(&self) -> Result<()> {
        let _in = self.enter("barrier");
        self.comm.barrier();
        Ok(())
    }
}

/// Divides by the group size: an average is a sum divided after the reduction, so that every
/// rank divides the same sum the same way and the results agree bit for bit.
fn average<T: HostElement>(buf: &mut [T], size: usize) {
    let n = T::from_count(size);
    for x in buf {
        *x = *x / n;
    }
}

/// MPI's operation for a reduction (an average is a sum, divided afterwards).
fn system_op(op: ReduceOp) -> SystemOperation {
    match op {
        ReduceOp::Sum | ReduceOp::Average => SystemOperation::sum(),
        ReduceOp::Max => SystemOperation::max(),
    }
}

impl<T: HostElement> Collective<[T]> for MpiGroup {
    fn all_reduce(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.count("all_reduce", buf.len())?;
        let mut scratch = self.scratch.borrow_mut();
        let words = std::mem::size_of_val(buf).div_ceil(8);
        if scratch.len() < words {
            scratch.resize(words, 0);
        }
        let send = &mut bytemuck::cast_slice_mut::<u64, T>(&mut scratch[..words])[..buf.len()];
        send.copy_from_slice(buf);
        {
            let _in = self.enter("all_reduce");
            self.comm.all_reduce_into(&*send, buf, system_op(op));
        }
        if op == ReduceOp::Average {
            average(buf, self.size());
        }
        Ok(())
    }

    fn reduce_scatter(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        check::scatter_lengths(self, send.len(), recv.len())?;
        self.count("reduce_scatter", send.len())?;
        {
            let _in = self.enter("reduce_scatter");
            self.comm.reduce_scatter_block_into(send, recv, system_op(op));
        }
        if op == ReduceOp::Average {
            average(recv, self.size());
        }
        Ok(())
    }

    fn all_gather(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        check::gather_lengths(self, send.len(), recv.len())?;
        self.count("all_gather", recv.len())?;
        let _in = self.enter("all_gather");
        self.comm.all_gather_into(send, recv);
        Ok(())
    }

    fn broadcast(&self, buf: &mut [T], root: usize) -> Result<()> {
        check::root(self, "broadcast", root)?;
        self.count("broadcast", buf.len())?;
        let _in = self.enter("broadcast");
        self.peer(root).broadcast_into(buf);
        Ok(())
    }

    fn send(&self, buf: &[T], to: usize) -> Result<()> {
        check::peer(self, "send", to)?;
        self.count("send", buf.len())?;
        let _in = self.enter("send");
        self.peer(to).send_with_tag(buf, TAG);
        Ok(())
    }

    fn recv(&self, buf: &mut [T], from: usize) -> Result<()> {
        check::peer(self, "recv", from)?;
        self.count("recv", buf.len())?;
        let status = {
            let _in = self.enter("recv");
            self.peer(from).receive_into_with_tag(buf, TAG)
        };
        self.received::<T>(from, status, buf.len())
    }

    fn send_recv(&self, send: &[T], to: usize, recv: &mut [T], from: usize) -> Result<()> {
        check::root(self, "send_recv", to)?;
        check::root(self, "send_recv", from)?;
        self.count("send_recv", send.len().max(recv.len()))?;
        let status = {
            let _in = self.enter("send_recv");
            send_receive_into_with_tags(send, &self.peer(to), TAG, recv, &self.peer(from), TAG)
        };
        self.received::<T>(from, status, recv.len())
    }
}
