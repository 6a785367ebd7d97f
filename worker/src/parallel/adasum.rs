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
//! here ([`all_reduce`]); on a device its backend combines (`Backend::adasum`, kernels that sum
//! the dot products in a fixed order) and its collectives exchange (NCCL send/receive).

use crate::comm::Collective;
use crate::error::{Error, Result};

/// `a` becomes adasum(a, b). Dot products in f64; a zero vector leaves the other unchanged.
pub fn combine(a: &mut [f32], b: &[f32]) {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (x as f64, y as f64);
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    let ca = if aa > 0.0 { 1.0 - ab / (2.0 * aa) } else { 1.0 };
    let cb = if bb > 0.0 { 1.0 - ab / (2.0 * bb) } else { 1.0 };
    for (x, &y) in a.iter_mut().zip(b) {
        *x = (ca * *x as f64 + cb * y as f64) as f32;
    }
}

/// `mine` becomes adasum(lower rank's, higher rank's) of this rank's and its partner's values
/// (`theirs`, which may be overwritten), so that both ranks of a pair hold the same floats.
pub fn combine_pair(mine: &mut [f32], theirs: &mut [f32], mine_is_lower: bool) {
    if mine_is_lower {
        combine(mine, theirs);
    } else {
        combine(theirs, mine);
        mine.copy_from_slice(theirs);
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_gradients_are_averaged_and_orthogonal_ones_added() {
        let mut a = vec![2.0f32, 4.0, -6.0];
        combine(&mut a, &[2.0, 4.0, -6.0]);
        assert_eq!(a, [2.0, 4.0, -6.0], "adasum(g, g) = g: the mean of equal gradients");
        let mut a = vec![1.0f32, 0.0, 0.0];
        combine(&mut a, &[0.0, 3.0, 0.0]);
        assert_eq!(a, [1.0, 3.0, 0.0], "orthogonal gradients add up");
        let mut a = vec![0.0f32, 0.0];
        combine(&mut a, &[1.5, -2.0]);
        assert_eq!(a, [1.5, -2.0], "a zero gradient leaves the other");
    }

    #[test]
    fn combine_matches_the_formula_in_f64() {
        let a0: Vec<f32> = (0..37).map(|i| ((i * 7919) % 23) as f32 / 7.0 - 1.5).collect();
        let b: Vec<f32> = (0..37).map(|i| ((i * 104729) % 31) as f32 / 11.0 - 1.2).collect();
        let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(&p, &q)| p as f64 * q as f64).sum::<f64>();
        let (ab, aa, bb) = (dot(&a0, &b), dot(&a0, &a0), dot(&b, &b));
        let mut a = a0.clone();
        combine(&mut a, &b);
        for i in 0..37 {
            let want = (1.0 - ab / (2.0 * aa)) * a0[i] as f64 + (1.0 - ab / (2.0 * bb)) * b[i] as f64;
            assert!((a[i] as f64 - want).abs() < 1e-6, "{i}: {} vs {want}", a[i]);
        }
    }
}
