//! A small seeded random number generator shared by the perturbations and the
//! key bank: SplitMix64 for uniform draws, Box–Muller for standard normals.
//! Deterministic in the seed on every platform; not for cryptography.

/// Seeded uniform draws (SplitMix64).
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A stream determined by `seed`.
    pub(crate) fn new(seed: u64) -> Self {
        Self {
            state: seed ^ 0x5DEE_CE66_D1CE_4E5B,
        }
    }

    /// The next 64 uniform bits.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub(crate) fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in `0..m` (`m > 0`), by Lemire's multiply–shift with
    /// rejection, so exactly uniform.
    pub(crate) fn below(&mut self, m: u64) -> u64 {
        debug_assert!(m > 0);
        let threshold = m.wrapping_neg() % m;
        loop {
            let r = (self.next_u64() as u128) * (m as u128);
            if (r as u64) >= threshold {
                return (r >> 64) as u64;
            }
        }
    }
}

/// Seeded standard normal draws (SplitMix64 and Box–Muller).
#[derive(Debug, Clone)]
pub(crate) struct Gaussian {
    uniform: SplitMix64,
    spare: Option<f64>,
}

impl Gaussian {
    /// A stream determined by `seed`.
    pub(crate) fn new(seed: u64) -> Self {
        Self {
            uniform: SplitMix64::new(seed),
            spare: None,
        }
    }

    /// Uniform in [0, 1) from the same stream.
    pub(crate) fn uniform(&mut self) -> f64 {
        self.uniform.uniform()
    }

    /// The next standard normal draw.
    pub(crate) fn next(&mut self) -> f64 {
        if let Some(s) = self.spare.take() {
            return s;
        }
        let u1 = self.uniform().max(f64::MIN_POSITIVE);
        let u2 = self.uniform();
        let r = (-2.0 * u1.ln()).sqrt();
        let t = std::f64::consts::TAU * u2;
        self.spare = Some(r * t.sin());
        r * t.cos()
    }
}

/// `n` distinct indices of `0..m`, uniformly without replacement, in
/// increasing order (`n <= m`). A partial Fisher–Yates shuffle over a sparse
/// map, so memory is O(n) whatever `m` is.
pub(crate) fn sample_indices(m: usize, n: usize, seed: u64) -> Vec<usize> {
    assert!(n <= m, "sample of {n} from {m}");
    let mut rng = SplitMix64::new(seed);
    let mut moved: std::collections::HashMap<usize, usize> = std::collections::HashMap::new();
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let j = i + rng.below((m - i) as u64) as usize;
        let at_j = *moved.get(&j).unwrap_or(&j);
        let at_i = *moved.get(&i).unwrap_or(&i);
        moved.insert(j, at_i);
        out.push(at_j);
    }
    out.sort_unstable();
    out
}

/// `n` seeded draws uniform in `[-bound, bound)` (SplitMix64): the one
/// seeded uniform stream the workspace initialises trainable weights from.
pub fn uniform_symmetric(n: usize, bound: f64, seed: u64) -> Vec<f32> {
    let mut u = SplitMix64::new(seed);
    (0..n)
        .map(|_| ((2.0 * u.uniform() - 1.0) * bound) as f32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn below_stays_in_range_and_covers_it() {
        let mut rng = SplitMix64::new(3);
        let mut seen = [0usize; 7];
        for _ in 0..7000 {
            seen[rng.below(7) as usize] += 1;
        }
        assert!(seen.iter().all(|&c| (800..1200).contains(&c)), "{seen:?}");
    }

    #[test]
    fn sampled_indices_are_distinct_sorted_and_uniform() {
        let mut hits = vec![0usize; 20];
        for seed in 0..2000 {
            let s = sample_indices(20, 5, seed);
            assert_eq!(s.len(), 5);
            assert!(s.windows(2).all(|w| w[0] < w[1]), "{s:?}");
            for i in s {
                hits[i] += 1;
            }
        }
        // Each index is chosen with probability 1/4: 500 of 2000 expected.
        assert!(hits.iter().all(|&h| (400..600).contains(&h)), "{hits:?}");
        assert_eq!(sample_indices(9, 9, 1), (0..9).collect::<Vec<_>>());
        assert!(sample_indices(9, 0, 1).is_empty());
    }
}
