//! Branch-free f32 math that the compiler vectorizes, for the kernels whose cost is one
//! transcendental per element (softmax, cross-entropy over a 50k vocabulary).

/// e^x with about 1 ulp of error over the f32 range (Cephes' expf: round x/ln2 to n, a degree-6
/// polynomial on the remainder, 2^n from the exponent bits). Below −87 it returns 0 (where
/// expf gives a denormal or 0): a logit masked to −∞ (GPT-2's padded vocabulary) then has a
/// probability of exactly 0, as on the GPU, so its gradient is 0 too, where a ~1e-38 was
/// blown up into updates by Adam's normalisation.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two so n·ln2 is exact enough: the high part has few mantissa bits.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5·2^23 rounds to the nearest integer without a branch.
    const ROUND: f32 = 12_582_912.0;
    let underflow = x < -87.0;
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = (((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 1.666_666_5e-1)
        * r
        + 0.5)
        * r
        * r
        + r
        + 1.0;
    // 2^n: n + 127 lands in the low mantissa bits of 2^23 + n + 127; shift them into the exponent.
    let biased = (n + 8_388_735.0).to_bits() - 0x4B00_0000;
    let y = p * f32::from_bits(biased << 23);
    // A select, not a branch: the loops over a row still vectorize.
    if underflow {
        0.0
    } else {
        y
    }
}

/// max over a slice, in 8 independent lanes so it vectorizes.
#[inline]
pub fn max(v: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; 8];
    let chunks = v.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for k in 0..8 {
            m[k] = m[k].max(c[k]);
        }
    }
    tail.iter().fold(m.iter().copied().fold(f32::NEG_INFINITY, f32::max), |a, &b| a.max(b))
}

/// Σ a·b, in 8 lanes.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut s = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            s[k] += x[k] * y[k];
        }
    }
    s.iter().sum::<f32>() + tail
}

/// Σ e^(v − shift), in 8 lanes (lane k sums the elements at k mod 8, the last v.len() mod 8 are
/// summed apart and added last). The exponentials go through a buffer a block at a time: a
/// loop that only maps is one the compiler vectorizes wherever this is compiled, where the
/// exponentials written into the lanes' sums were left scalar, with a branch for the underflow,
/// in some builds (a cross-entropy's forward pass took 3.4 times its gradient's time).
#[inline]
pub fn sum_exp(v: &[f32], shift: f32) -> f32 {
    const BLOCK: usize = 512;
    let mut lanes = [0f32; 8];
    let mut tail = 0f32;
    let mut buf = [0f32; BLOCK];
    for block in v.chunks(BLOCK) {
        let e = &mut buf[..block.len()];
        for (e, &x) in e.iter_mut().zip(block) {
            *e = exp(x - shift);
        }
        let groups = e.chunks_exact(8);
        // Only the last block can leave a remainder: BLOCK is a multiple of 8.
        tail = groups.remainder().iter().sum();
        for g in groups {
            for k in 0..8 {
                lanes[k] += g[k];
            }
        }
    }
    lanes.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    #[test]
    fn exp_is_accurate_over_the_range() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let rel = ((super::exp(x) as f64) - want).abs() / want;
            worst = worst.max(rel);
            x += 0.01731;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!((super::exp(f32::NEG_INFINITY), super::exp(-87.5), super::exp(-1e9)), (0.0, 0.0, 0.0));
        assert_eq!(super::max(&[1.0, 5.0, -2.0, 3.0, 0.0, 9.0, 1.0, 2.0, 11.0, -4.0]), 11.0);
    }

    #[test]
    fn sum_exp_adds_in_lanes_then_the_tail() {
        // Across blocks, with a tail: the order the lanes promise, to the bit.
        for n in [0, 5, 8, 513, 1030] {
            let v: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32) / 25.0 - 2.0).collect();
            let mut lanes = [0f32; 8];
            let whole = n / 8 * 8;
            for (i, &x) in v[..whole].iter().enumerate() {
                lanes[i % 8] += super::exp(x - 0.5);
            }
            let tail: f32 = v[whole..].iter().map(|&x| super::exp(x - 0.5)).sum();
            assert_eq!(super::sum_exp(&v, 0.5).to_bits(), (lanes.iter().sum::<f32>() + tail).to_bits(), "{n}");
        }
    }
}
