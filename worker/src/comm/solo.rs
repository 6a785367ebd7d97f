//! A group of one process. This is not a placeholder: with one member, the sum and the average
//! of the members' buffers are the buffer itself, a gather is a copy, and there is nobody to
//! wait for, so these are the collectives' exact results. It serves a world of one rank (a run
//! without mpirun, or a build without MPI) and the size-1 axes of any layout.

use super::{check, describe, Collective, HostElement, ProcessGroup, ReduceOp};
use crate::error::{Error, Result};

pub struct SoloGroup {
    name: String,
    /// This process's world rank, as a one-element list for `members`.
    member: [usize; 1],
}

impl SoloGroup {
    pub fn new(name: &str, world_rank: usize) -> SoloGroup {
        SoloGroup { name: name.to_string(), member: [world_rank] }
    }
}

impl ProcessGroup for SoloGroup {
    fn name(&self) -> &str {
        &self.name
    }
    fn size(&self) -> usize {
        1
    }
    fn rank(&self) -> usize {
        0
    }
    fn members(&self) -> &[usize] {
        &self.member
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
}

impl<T: HostElement> Collective<[T]> for SoloGroup {
    fn all_reduce(&self, _buf: &mut [T], _op: ReduceOp) -> Result<()> {
        Ok(())
    }

    fn reduce_scatter(&self, send: &[T], recv: &mut [T], _op: ReduceOp) -> Result<()> {
        check::scatter_lengths(self, send.len(), recv.len())?;
        recv.copy_from_slice(send);
        Ok(())
    }

    fn all_gather(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        check::gather_lengths(self, send.len(), recv.len())?;
        recv.copy_from_slice(send);
        Ok(())
    }

    fn broadcast(&self, _buf: &mut [T], root: usize) -> Result<()> {
        check::root(self, "broadcast", root)
    }

    fn send(&self, _buf: &[T], to: usize) -> Result<()> {
        check::peer(self, "send", to)
    }

    fn recv(&self, _buf: &mut [T], from: usize) -> Result<()> {
        check::peer(self, "recv", from)
    }

    /// Exchanging with oneself is a copy (as MPI_Sendrecv to oneself is).
    fn send_recv(&self, send: &[T], to: usize, recv: &mut [T], from: usize) -> Result<()> {
        check::root(self, "send_recv", to)?;
        check::root(self, "send_recv", from)?;
        if send.len() != recv.len() {
            return Err(Error::Runtime(format!(
                "send_recv on {}: sending {} values to itself into room for {}",
                describe(self),
                send.len(),
                recv.len()
            )));
        }
        recv.copy_from_slice(send);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_of_one_returns_its_own_values() {
        let g = SoloGroup::new("data", 0);
        let mut x = vec![1.5f32, -2.0, 3.25];
        g.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        g.all_reduce(&mut x, ReduceOp::Average).unwrap();
        g.broadcast(&mut x, 0).unwrap();
        assert_eq!(x, [1.5, -2.0, 3.25]);
        let mut y = vec![0.0f32; 3];
        g.reduce_scatter(&x, &mut y, ReduceOp::Average).unwrap();
        assert_eq!(y, x);
        let mut z = vec![0.0f32; 3];
        g.all_gather(&y, &mut z).unwrap();
        assert_eq!(z, x);
        let mut w = vec![0.0f64; 2];
        g.send_recv(&[4.0f64, 5.0], 0, &mut w, 0).unwrap();
        assert_eq!(w, [4.0, 5.0]);
    }

    #[test]
    fn wrong_lengths_and_ranks_are_errors_that_name_the_group() {
        let g = SoloGroup::new("tensor", 3);
        let e = g.all_gather(&[1.0f32, 2.0], &mut [0.0; 3]).unwrap_err().to_string();
        assert!(e.contains("all_gather on group 'tensor' (rank 0 of 1, world ranks [3])"), "{e}");
        assert!(g.reduce_scatter(&[1.0f32, 2.0], &mut [0.0; 1], ReduceOp::Sum).is_err());
        assert!(g.broadcast(&mut [0.0f32], 1).unwrap_err().to_string().contains("rank 1 is not in the group"));
        assert!(Collective::<[f32]>::send(&g, &[1.0], 0).unwrap_err().to_string().contains("this rank itself"));
        assert!(Collective::<[f32]>::recv(&g, &mut [1.0], 1).is_err());
    }
}
