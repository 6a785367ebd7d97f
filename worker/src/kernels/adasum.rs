//! Adasum's combination of two ranks' gradients (the formula and its recursive doubling are in
//! `parallel::adasum`): the host reference the CPU backend runs, which the CUDA kernels match.

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
