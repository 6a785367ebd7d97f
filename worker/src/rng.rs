//! Deterministic, counter-based random numbers: the same seed gives the same weights, dropout
//! masks and data order on every machine and thread count (a resumed run depends on it).

/// SplitMix64's finalizer: a good 64-bit mix of a counter.
#[inline]
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Uniform in [0, 1) from the i-th draw of stream `seed`.
#[inline]
pub fn uniform(seed: u64, i: u64) -> f64 {
    (mix(seed ^ mix(i)) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// A sequential generator over the same stream, for code that draws one number at a time.
#[derive(Clone, Debug)]
pub struct Rng {
    pub seed: u64,
    pub counter: u64,
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng { seed, counter: 0 }
    }
    pub fn next_f64(&mut self) -> f64 {
        self.counter += 1;
        uniform(self.seed, self.counter)
    }
    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.next_f64().max(1e-300);
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
    /// Uniform integer in 0..n.
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_f64() * n as f64) as usize).min(n.saturating_sub(1))
    }
    /// Fisher–Yates shuffle.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}
