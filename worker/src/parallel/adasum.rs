//! Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021;
//! Horovod's `op=hvd.Adasum`): combines data-parallel gradients so that parallel components
//! are averaged and orthogonal ones added, per tensor:
//!
//! ```text
//! adasum(a, b) = (1 − a·b / 2‖a‖²) · a + (1 − a·b / 2‖b‖²) · b
//! ```
//!
//! Over 2^k ranks it is applied as a binary tree by recursive doubling: at level d a rank
//! exchanges its current vectors with rank XOR 2^d and both combine them, the lower rank's as
//! `a`, so that after k levels every rank holds the same result, bit for bit. In host memory
//! here ([`all_reduce`], with `kernels::adasum`'s combination); on a device its backend
//! combines (`Backend::adasum`, kernels that sum the dot products in a fixed order) and its
//! collectives exchange (NCCL send/receive).

use crate::comm::Collective;
use crate::error::{Error, Result};
use crate::kernels::adasum::combine_pair;

/// Adasum's schedule over a group of `size` ranks (a power of two, or an error naming
/// parallelism.data): recursive doubling, at level d `level(partner, mine_is_lower)` with
/// partner = rank XOR 2^d, which exchanges the current values with the partner and combines
/// them (`combine_pair`). The host path and the device path (NCCL, kernels) share it.
pub fn recursive_doubling(size: usize, rank: usize, mut level: impl FnMut(usize, bool) -> Result<()>) -> Result<()> {
    if !size.is_power_of_two() {
        return Err(Error::Config(format!(
            "parallelism.adasum: Adasum combines ranks in pairs, so parallelism.data must be a power of two, not {size}"
        )));
    }
    let mut distance = 1;
    while distance < size {
        let partner = rank ^ distance;
        level(partner, rank < partner)?;
        distance *= 2;
    }
    Ok(())
}

/// Replaces every member's `tensors` (one gradient per weight) with their Adasum over `group`,
/// tensor by tensor, in host memory. The group's size must be a power of two.
pub fn all_reduce<G: Collective<[f32]> + ?Sized>(group: &G, tensors: &mut [&mut [f32]]) -> Result<()> {
    let mut mine: Vec<f32> = tensors.iter().flat_map(|t| t.iter().copied()).collect();
    let mut theirs = vec![0f32; mine.len()];
    recursive_doubling(group.size(), group.rank(), |partner, mine_is_lower| {
        group.send_recv(&mine[..], partner, &mut theirs[..], partner)?;
        let mut at = 0;
        for t in tensors.iter() {
            let n = t.len();
            combine_pair(&mut mine[at..at + n], &mut theirs[at..at + n], mine_is_lower);
            at += n;
        }
        Ok(())
    })?;
    let mut at = 0;
    for t in tensors.iter_mut() {
        let n = t.len();
        t.copy_from_slice(&mine[at..at + n]);
        at += n;
    }
    Ok(())
}
