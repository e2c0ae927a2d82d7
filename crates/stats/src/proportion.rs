//! Accuracies as binomial proportions, their intervals, and comparisons.

use crate::{Result, StatsError};
use serde::{Deserialize, Serialize};

/// z of a two-sided 95% interval.
pub const Z95: f64 = 1.959_963_984_540_054;

/// A closed interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Interval {
    /// Lower end.
    pub lo: f64,
    /// Upper end.
    pub hi: f64,
}

impl Interval {
    /// Whether `x` lies inside.
    pub fn contains(&self, x: f64) -> bool {
        self.lo <= x && x <= self.hi
    }
}

/// An accuracy: `successes` correct items out of `n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proportion {
    /// Items scored correct.
    pub successes: usize,
    /// Items scored.
    pub n: usize,
}

impl Proportion {
    /// A proportion; `n` must be positive and at least `successes`.
    pub fn new(successes: usize, n: usize) -> Result<Self> {
        if n == 0 || successes > n {
            return Err(StatsError::InvalidProportion { successes, n });
        }
        Ok(Self { successes, n })
    }

    /// The proportion of a list of outcomes.
    pub fn from_outcomes(outcomes: &[bool]) -> Result<Self> {
        if outcomes.is_empty() {
            return Err(StatsError::Empty("outcomes"));
        }
        Self::new(outcomes.iter().filter(|&&c| c).count(), outcomes.len())
    }

    /// p = successes / n.
    pub fn p(&self) -> f64 {
        self.successes as f64 / self.n as f64
    }

    /// Binomial standard error sqrt(p(1-p)/n).
    pub fn se(&self) -> f64 {
        let p = self.p();
        (p * (1.0 - p) / self.n as f64).sqrt()
    }

    /// Normal 95% interval p ± 1.96 SE.
    pub fn normal_ci95(&self) -> Interval {
        let (p, h) = (self.p(), Z95 * self.se());
        Interval {
            lo: p - h,
            hi: p + h,
        }
    }

    /// Wilson 95% score interval (for p near 0 or 1).
    pub fn wilson_ci95(&self) -> Interval {
        let (p, n, z) = (self.p(), self.n as f64, Z95);
        let z2 = z * z;
        let centre = (p + z2 / (2.0 * n)) / (1.0 + z2 / n);
        let half = z / (1.0 + z2 / n) * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt();
        Interval {
            lo: centre - half,
            hi: centre + half,
        }
    }
}

/// The difference of two accuracies, `a − b`, with its normal statistics.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Difference {
    /// p_a − p_b.
    pub diff: f64,
    /// sqrt(p_a(1−p_a)/n_a + p_b(1−p_b)/n_b).
    pub se: f64,
    /// diff / se (0 when se is 0 and diff is 0; ±inf when only se is 0).
    pub z: f64,
    /// diff ± 1.96 se.
    pub ci95: Interval,
}

/// `a − b` as independent proportions.
pub fn difference(a: Proportion, b: Proportion) -> Difference {
    let diff = a.p() - b.p();
    let se = (a.se().powi(2) + b.se().powi(2)).sqrt();
    let z = if se > 0.0 {
        diff / se
    } else if diff == 0.0 {
        0.0
    } else {
        diff.signum() * f64::INFINITY
    };
    Difference {
        diff,
        se,
        z,
        ci95: Interval {
            lo: diff - Z95 * se,
            hi: diff + Z95 * se,
        },
    }
}

/// Two arms scored on the same items: `a − b` with the statistics of
/// paired outcomes (the discordant items carry all the information).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Paired {
    /// Items scored by both.
    pub n: usize,
    /// Items `a` gets right and `b` wrong.
    pub gained: usize,
    /// Items `a` gets wrong and `b` right.
    pub lost: usize,
    /// p_a − p_b = (gained − lost) / n.
    pub diff: f64,
    /// The paired standard error sqrt(g + l − (g − l)² / n) / n.
    pub se: f64,
    /// Exact two-sided McNemar p-value: the binomial(g + l, 1/2) tail of
    /// the smaller discordant count, doubled and capped at 1 (1 when no
    /// item is discordant).
    pub mcnemar_p: f64,
}

/// `a − b` over paired outcomes (`a[i]` and `b[i]` are the same item).
pub fn paired(a: &[bool], b: &[bool]) -> Result<Paired> {
    if a.len() != b.len() {
        return Err(StatsError::LengthMismatch(a.len(), b.len()));
    }
    if a.is_empty() {
        return Err(StatsError::Empty("paired outcomes"));
    }
    let n = a.len();
    let gained = a.iter().zip(b).filter(|(x, y)| **x && !**y).count();
    let lost = a.iter().zip(b).filter(|(x, y)| !**x && **y).count();
    let (g, l, nf) = (gained as f64, lost as f64, n as f64);
    let diff = (g - l) / nf;
    let se = (g + l - (g - l).powi(2) / nf).max(0.0).sqrt() / nf;
    Ok(Paired {
        n,
        gained,
        lost,
        diff,
        se,
        mcnemar_p: mcnemar_exact(gained, lost),
    })
}

/// Exact two-sided McNemar p-value of `gained` against `lost` discordant
/// items: 2 P(X <= min) for X ~ binomial(gained + lost, 1/2), capped at 1.
pub fn mcnemar_exact(gained: usize, lost: usize) -> f64 {
    let m = gained + lost;
    if m == 0 {
        return 1.0;
    }
    let k = gained.min(lost);
    // Sum C(m, i) / 2^m in log space (m can be in the hundreds).
    let ln_half_m = -(m as f64) * std::f64::consts::LN_2;
    let mut ln_c = 0.0f64; // ln C(m, 0)
    let mut tail = 0.0f64;
    for i in 0..=k {
        if i > 0 {
            ln_c += ((m - i + 1) as f64).ln() - (i as f64).ln();
        }
        tail += (ln_c + ln_half_m).exp();
    }
    (2.0 * tail).min(1.0)
}

/// Accuracy minus the strongest (highest) control.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Lift {
    /// Name of the strongest control.
    pub control: String,
    /// The treatment minus that control.
    pub difference: Difference,
}

/// Control-subtracted lift of `treatment` over the strongest of `controls`.
pub fn lift(treatment: Proportion, controls: &[(&str, Proportion)]) -> Result<Lift> {
    let (name, strongest) = controls
        .iter()
        .max_by(|a, b| a.1.p().total_cmp(&b.1.p()))
        .ok_or(StatsError::NoControl)?;
    Ok(Lift {
        control: name.to_string(),
        difference: difference(treatment, *strongest),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(x: f64, n: usize) -> Proportion {
        Proportion::new((x * n as f64).round() as usize, n).unwrap()
    }

    #[test]
    fn papers_difference_check() {
        // PROTOCOL.md section 8: 0.695 vs 0.665 at n=200 gives SE 0.047, z ~ 0.6.
        let d = difference(p(0.695, 200), p(0.665, 200));
        assert!((d.se - 0.047).abs() < 0.0005, "{}", d.se);
        assert!((d.z - 0.64).abs() < 0.01, "{}", d.z);
        assert!((d.diff - 0.030).abs() < 1e-12);
    }

    #[test]
    fn paired_outcomes_and_the_exact_mcnemar_test() {
        // Known values: 2 P(X <= 2), X ~ Bin(10, 1/2) = 2 * 56/1024.
        assert!((mcnemar_exact(8, 2) - 0.109375).abs() < 1e-12);
        assert!((mcnemar_exact(2, 8) - 0.109375).abs() < 1e-12);
        assert_eq!(mcnemar_exact(0, 0), 1.0);
        assert_eq!(mcnemar_exact(3, 3), 1.0);
        // 2 P(X <= 0), X ~ Bin(5, 1/2) = 2/32.
        assert!((mcnemar_exact(5, 0) - 0.0625).abs() < 1e-12);
        // Large counts stay exact: 2 P(X <= 100), X ~ Bin(300, 1/2) =
        // 8.014875216538918e-9 (Python's math.comb, summed exactly).
        let p = mcnemar_exact(200, 100);
        assert!((p / 8.014_875_216_538_918e-9 - 1.0).abs() < 1e-9, "{p}");
        // Items: a right on 0..6, b right on 4..9 of 10.
        let a: Vec<bool> = (0..10).map(|i| i < 6).collect();
        let b: Vec<bool> = (0..10).map(|i| (4..9).contains(&i)).collect();
        let d = paired(&a, &b).unwrap();
        assert_eq!((d.n, d.gained, d.lost), (10, 4, 3));
        assert!((d.diff - 0.1).abs() < 1e-12);
        assert!(
            (d.se - (7.0f64 - 0.1).sqrt() / 10.0).abs() < 1e-12,
            "{}",
            d.se
        );
        assert!((d.mcnemar_p - 1.0).abs() < 1e-12);
        assert!(paired(&a, &b[..9]).is_err());
        assert!(paired(&[], &[]).is_err());
    }

    #[test]
    fn papers_lift_check() {
        // 0.550 against a strongest control of 0.225 at n=200: +0.325 [+0.235, +0.415].
        let l = lift(
            p(0.550, 200),
            &[("mismatch", p(0.180, 200)), ("position", p(0.225, 200))],
        )
        .unwrap();
        assert_eq!(l.control, "position");
        assert!((l.difference.diff - 0.325).abs() < 1e-12);
        assert!(
            (l.difference.ci95.lo - 0.235).abs() < 0.0005,
            "{:?}",
            l.difference.ci95
        );
        assert!(
            (l.difference.ci95.hi - 0.415).abs() < 0.0005,
            "{:?}",
            l.difference.ci95
        );
    }

    #[test]
    fn se_and_intervals() {
        let a = p(0.5, 100);
        assert!((a.se() - 0.05).abs() < 1e-12);
        let ci = a.normal_ci95();
        assert!((ci.lo - (0.5 - Z95 * 0.05)).abs() < 1e-12);
        // Wilson stays inside [0, 1] at the edges where the normal interval does not.
        let z = Proportion::new(0, 20).unwrap();
        let w = z.wilson_ci95();
        assert!(w.lo.abs() < 1e-12 && w.hi > 0.1 && w.hi < 0.2, "{w:?}");
        assert_eq!(z.normal_ci95().hi, 0.0);
        // Known value: 8 of 10 → Wilson [0.490, 0.943].
        let w = Proportion::new(8, 10).unwrap().wilson_ci95();
        assert!(
            (w.lo - 0.4902).abs() < 1e-3 && (w.hi - 0.9433).abs() < 1e-3,
            "{w:?}"
        );
    }

    #[test]
    fn bad_inputs() {
        assert!(Proportion::new(3, 2).is_err());
        assert!(Proportion::new(0, 0).is_err());
        assert_eq!(
            Proportion::from_outcomes(&[]),
            Err(StatsError::Empty("outcomes"))
        );
        assert_eq!(lift(p(0.5, 10), &[]).unwrap_err(), StatsError::NoControl);
        let same = difference(p(1.0, 10), p(1.0, 10));
        assert_eq!(same.z, 0.0);
    }
}
