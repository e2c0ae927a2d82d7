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
