//! The world: every rank mpirun started, how this process learns its place in it, and the
//! groups of a parallel layout.
//!
//! A process that no MPI launcher started (no launcher variables in its environment) is a world
//! of one and never initialises MPI: a single-process run then needs no MPI daemon, behaves the
//! same whether or not the worker was built with MPI, and starts faster.

use super::solo::SoloGroup;
use super::topology::{Axis, Coords, Layout};
use super::watchdog::Watchdog;
use super::{Collective, HostElement, ProcessGroup, ReduceOp};
use crate::error::{Error, Result};
use std::time::Duration;

#[cfg(feature = "mpi")]
use super::mpi::{MpiGroup, MpiStart};

/// How the world communicates.
#[derive(Clone, Debug)]
pub struct CommOptions {
    /// How long one collective may wait for its peers before this rank gives up on them and
    /// aborts the job; zero waits forever. It must exceed the longest work one rank does while
    /// the others wait (a checkpoint written by one rank, an evaluation), hence the generous
    /// default, the same as PyTorch's process groups.
    pub collective_timeout: Duration,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions { collective_timeout: Duration::from_secs(600) }
    }
}

/// This process among the ranks.
pub struct World {
    rank: usize,
    size: usize,
    local_rank: usize,
    local_size: usize,
    #[cfg(feature = "mpi")]
    mpi: Option<MpiStart>,
}

/// The world size an MPI launcher announced in the environment: OpenMPI's mpirun, or the
/// Hydra launcher of MPICH and Intel MPI.
fn launcher_world_size() -> Option<(usize, &'static str)> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]
        .into_iter()
        .find_map(|var| std::env::var(var).ok()?.trim().parse().ok().map(|n| (n, var)))
}

impl World {
    /// Joins the world: with MPI when a launcher started this process, else as a world of one.
    /// Once per process.
    pub fn init(options: &CommOptions) -> Result<World> {
        match launcher_world_size() {
            None => Ok(World::solo()),
            Some((size, var)) => World::init_launched(options, size, var),
        }
    }

    /// A world of one process.
    pub fn solo() -> World {
        World {
            rank: 0,
            size: 1,
            local_rank: 0,
            local_size: 1,
            #[cfg(feature = "mpi")]
            mpi: None,
        }
    }

    #[cfg(feature = "mpi")]
    fn init_launched(options: &CommOptions, announced: usize, var: &str) -> Result<World> {
        let start = super::mpi::start(options.collective_timeout)?;
        if start.size != announced {
            return Err(Error::Runtime(format!(
                "rank {}: MPI reports a world of {} ranks but the launcher announced {announced} ({var})",
                start.rank, start.size
            )));
        }
        Ok(World {
            rank: start.rank,
            size: start.size,
            local_rank: start.local_rank,
            local_size: start.local_size,
            mpi: Some(start),
        })
    }

    #[cfg(not(feature = "mpi"))]
    fn init_launched(_options: &CommOptions, announced: usize, var: &str) -> Result<World> {
        if announced == 1 {
            return Ok(World::solo());
        }
        // Going on would train `announced` independent copies of the model.
        Err(Error::Config(format!(
            "a launcher started {announced} ranks ({var}), but this tensorfleet-worker was built without \
             MPI; build it with the `mpi` feature (the default) or run one process"
        )))
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn size(&self) -> usize {
        self.size
    }
    /// This rank's index among the ranks on its node: which GPU it drives.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }
    pub fn local_size(&self) -> usize {
        self.local_size
    }

    /// The collective timeout in force, if any.
    pub fn watchdog(&self) -> Option<&Watchdog> {
        #[cfg(feature = "mpi")]
        if let Some(start) = &self.mpi {
            return start.watchdog.as_deref();
        }
        None
    }

    /// Ends the whole job at once with exit code `code`: under mpirun, MPI_Abort (mpirun ends
    /// every rank and exits with `code`); alone, the process exits. For a rank whose run failed
    /// while its peers may wait for it in a collective: finishing MPI would wait for them.
    pub fn abort(&self, code: i32) -> ! {
        #[cfg(feature = "mpi")]
        if self.mpi.is_some() {
            use mpi::topology::Communicator;
            mpi::topology::SimpleCommunicator::world().abort(code);
        }
        std::process::exit(code)
    }

    /// All ranks as one group. Collective: every rank calls it.
    pub fn world_group(&self) -> HostGroup {
        #[cfg(feature = "mpi")]
        if let Some(start) = &self.mpi {
            return HostGroup::Mpi(MpiGroup::world(start));
        }
        HostGroup::Solo(SoloGroup::new("world", self.rank))
    }

    /// This rank's data, tensor and pipeline groups. Collective: every rank calls it with the
    /// same layout, and before any other group is made or used.
    pub fn parallel_groups(&self, layout: Layout) -> Result<ParallelGroups> {
        if layout.world_size() != self.size {
            // Repeats Layout::new's check for a layout made for another world.
            Layout::new(layout.data, layout.tensor, layout.pipeline, self.size)?;
        }
        let group = |axis: Axis| -> Result<HostGroup> {
            let members = layout.group(axis, self.rank);
            #[cfg(feature = "mpi")]
            if let Some(start) = &self.mpi {
                // Every rank takes part in every split, even into a group of one, since a split
                // is collective over the world.
                let color = layout.group_index(axis, self.rank);
                return Ok(HostGroup::Mpi(MpiGroup::split(start, axis.name(), color, members)?));
            }
            debug_assert_eq!(members, [self.rank]);
            Ok(HostGroup::Solo(SoloGroup::new(axis.name(), self.rank)))
        };
        Ok(ParallelGroups {
            layout,
            coords: layout.coords(self.rank),
            data: group(Axis::Data)?,
            tensor: group(Axis::Tensor)?,
            pipeline: group(Axis::Pipeline)?,
        })
    }
}

/// A rank's groups in a layout.
pub struct ParallelGroups {
    pub layout: Layout,
    pub coords: Coords,
    pub data: HostGroup,
    pub tensor: HostGroup,
    pub pipeline: HostGroup,
}

impl ParallelGroups {
    pub fn get(&self, axis: Axis) -> &HostGroup {
        match axis {
            Axis::Data => &self.data,
            Axis::Tensor => &self.tensor,
            Axis::Pipeline => &self.pipeline,
        }
    }
}

/// A group for host buffers, whichever way the world was started.
pub enum HostGroup {
    Solo(SoloGroup),
    #[cfg(feature = "mpi")]
    Mpi(MpiGroup),
}

/// A host group on its way to another thread (see `HostGroup::detach`).
pub enum DetachedHostGroup {
    #[cfg(feature = "mpi")]
    Mpi(super::mpi::DetachedGroup),
}

impl DetachedHostGroup {
    /// The group, for the thread that received it.
    pub fn into_group(self) -> HostGroup {
        match self {
            #[cfg(feature = "mpi")]
            DetachedHostGroup::Mpi(g) => HostGroup::Mpi(g.into_group()),
        }
    }
}

impl HostGroup {
    /// A duplicate of this group that another thread can own (collective over the group), for
    /// communication that overlaps computation; None for a group of one, or where MPI does not
    /// let several threads call it.
    pub fn detach(&self) -> Option<DetachedHostGroup> {
        match self {
            HostGroup::Solo(_) => None,
            #[cfg(feature = "mpi")]
            HostGroup::Mpi(g) => g.detach().map(DetachedHostGroup::Mpi),
        }
    }
}

/// Calls the same method on whichever group this is.
macro_rules! dispatch {
    ($self:ident, $g:ident => $call:expr) => {
        match $self {
            HostGroup::Solo($g) => $call,
            #[cfg(feature = "mpi")]
            HostGroup::Mpi($g) => $call,
        }
    };
}

impl ProcessGroup for HostGroup {
    fn name(&self) -> &str {
        dispatch!(self, g => g.name())
    }
    fn size(&self) -> usize {
        dispatch!(self, g => g.size())
    }
    fn rank(&self) -> usize {
        dispatch!(self, g => g.rank())
    }
    fn members(&self) -> &[usize] {
        dispatch!(self, g => g.members())
    }
    fn barrier(&self) -> Result<()> {
        dispatch!(self, g => g.barrier())
    }
}

impl<T: HostElement> Collective<[T]> for HostGroup {
    fn all_reduce(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        dispatch!(self, g => g.all_reduce(buf, op))
    }
    fn reduce_scatter(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        dispatch!(self, g => g.reduce_scatter(send, recv, op))
    }
    fn all_gather(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        dispatch!(self, g => g.all_gather(send, recv))
    }
    fn broadcast(&self, buf: &mut [T], root: usize) -> Result<()> {
        dispatch!(self, g => g.broadcast(buf, root))
    }
    fn send(&self, buf: &[T], to: usize) -> Result<()> {
        dispatch!(self, g => g.send(buf, to))
    }
    fn recv(&self, buf: &mut [T], from: usize) -> Result<()> {
        dispatch!(self, g => g.recv(buf, from))
    }
    fn send_recv(&self, send: &[T], to: usize, recv: &mut [T], from: usize) -> Result<()> {
        dispatch!(self, g => g.send_recv(send, to, recv, from))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_world_of_one_has_trivial_groups_and_rejects_bigger_layouts() {
        let w = World::solo();
        assert_eq!((w.rank(), w.size(), w.local_rank(), w.local_size()), (0, 1, 0, 1));
        let g = w.parallel_groups(Layout::new(1, 1, 1, 1).unwrap()).unwrap();
        assert_eq!(g.coords, Coords { dp: 0, tp: 0, pp: 0 });
        for axis in Axis::ALL {
            assert_eq!(g.get(axis).name(), axis.name());
            assert_eq!(g.get(axis).members(), [0]);
        }
        let mut x = [2.0f32, 4.0];
        g.data.all_reduce(&mut x, ReduceOp::Average).unwrap();
        assert_eq!(x, [2.0, 4.0]);
        let e = w.parallel_groups(Layout { data: 2, tensor: 1, pipeline: 1 }).err().unwrap().to_string();
        assert!(e.contains("parallelism.data (2)") && e.contains("1 rank(s)"), "{e}");
    }
}
