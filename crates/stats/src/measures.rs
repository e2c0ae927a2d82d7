//! Fidelity and divergence measures between carriers and between output
//! distributions.

use crate::{Result, StatsError};

fn same_len(a: &[f32], b: &[f32]) -> Result<()> {
    if a.len() != b.len() {
        return Err(StatsError::LengthMismatch(a.len(), b.len()));
    }
    if a.is_empty() {
        return Err(StatsError::Empty("vector"));
    }
    Ok(())
}

/// a·b / (|a||b|) over f64 values; 0 when either is zero.
fn cosine_f64(a: impl Iterator<Item = f64>, b: impl Iterator<Item = f64>) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (x, y) in a.zip(b) {
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    if aa == 0.0 || bb == 0.0 {
        return 0.0;
    }
    ab / (aa.sqrt() * bb.sqrt())
}

/// Cosine similarity a·b / (|a||b|), in f64; 0 when either vector is zero.
pub fn cosine(a: &[f32], b: &[f32]) -> Result<f64> {
    same_len(a, b)?;
    Ok(cosine_f64(
        a.iter().map(|&x| x as f64),
        b.iter().map(|&y| y as f64),
    ))
}

/// Pearson correlation (the cosine of the centred vectors); 0 when either
/// input is constant.
pub fn pearson(a: &[f32], b: &[f32]) -> Result<f64> {
    same_len(a, b)?;
    let n = a.len() as f64;
    let ma = a.iter().map(|&x| x as f64).sum::<f64>() / n;
    let mb = b.iter().map(|&x| x as f64).sum::<f64>() / n;
    Ok(cosine_f64(
        a.iter().map(|&x| x as f64 - ma),
        b.iter().map(|&y| y as f64 - mb),
    ))
}

/// |a − b| / |b|: the displacement of `a` relative to the reference `b`.
pub fn relative_l2(a: &[f32], b: &[f32]) -> Result<f64> {
    same_len(a, b)?;
    let (mut d, mut r) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        d += (x as f64 - y as f64).powi(2);
        r += (y as f64).powi(2);
    }
    if r == 0.0 {
        return Ok(if d == 0.0 { 0.0 } else { f64::INFINITY });
    }
    Ok((d / r).sqrt())
}

/// The spread of independent replicates of one measurement (an arm's
/// accuracy under bridges trained from different seeds): how many, their
/// mean, and their sample standard deviation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    /// Number of replicates.
    pub n: usize,
    /// Their mean.
    pub mean: f64,
    /// Their sample standard deviation (divisor n − 1); none for a single
    /// replicate, which says nothing of the spread.
    pub sd: Option<f64>,
}

/// The spread of independent replicates; at least one value.
pub fn spread(x: &[f64]) -> Result<Spread> {
    if x.is_empty() {
        return Err(StatsError::Empty("replicates"));
    }
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let sd = (x.len() > 1)
        .then(|| (x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt());
    Ok(Spread {
        n: x.len(),
        mean,
        sd,
    })
}

/// The standard error of the mean of independent measurements: their
/// sample standard deviation (divisor n − 1) over the square root of their
/// number. Needs at least two values.
pub fn mean_standard_error(x: &[f64]) -> Result<f64> {
    // sqrt(var / n), not spread's sd / sqrt(n): the two can differ in the
    // last bit, and recorded measurements must reproduce exactly.
    if x.len() < 2 {
        return Err(StatsError::Empty("sample of at least two values"));
    }
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    Ok((var / n).sqrt())
}

/// log softmax of logits, in f64.
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let lse = logits
        .iter()
        .map(|&x| (x as f64 - m).exp())
        .sum::<f64>()
        .ln()
        + m;
    logits.iter().map(|&x| x as f64 - lse).collect()
}

/// softmax of logits, in f64.
pub fn softmax(logits: &[f32]) -> Vec<f64> {
    log_softmax(logits).into_iter().map(f64::exp).collect()
}

/// KL(P || Q) in nats, for P and Q given as logits.
pub fn kl_divergence_logits(p_logits: &[f32], q_logits: &[f32]) -> Result<f64> {
    same_len(p_logits, q_logits)?;
    let lp = log_softmax(p_logits);
    let lq = log_softmax(q_logits);
    Ok(lp
        .iter()
        .zip(&lq)
        .map(|(a, b)| a.exp() * (a - b))
        .sum::<f64>()
        .max(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn standard_error_of_a_mean() {
        // 1, 2, 3, 4: sample variance 5/3, SE sqrt(5/12).
        let se = mean_standard_error(&[1., 2., 3., 4.]).unwrap();
        assert!((se - (5.0f64 / 12.0).sqrt()).abs() < 1e-12);
        assert_eq!(mean_standard_error(&[2., 2., 2.]), Ok(0.0));
        assert!(mean_standard_error(&[1.]).is_err());
        assert!(mean_standard_error(&[]).is_err());
    }

    #[test]
    fn spread_of_replicates() {
        // 0.55, 0.60, 0.65: mean 0.60, sample SD 0.05.
        let s = spread(&[0.55, 0.60, 0.65]).unwrap();
        assert_eq!(s.n, 3);
        assert!((s.mean - 0.60).abs() < 1e-12);
        assert!((s.sd.unwrap() - 0.05).abs() < 1e-12);
        // One replicate: a mean, no spread.
        assert_eq!(
            spread(&[0.5]),
            Ok(Spread {
                n: 1,
                mean: 0.5,
                sd: None
            })
        );
        assert!(spread(&[]).is_err());
    }

    #[test]
    fn cosine_values() {
        assert!((cosine(&[1., 0.], &[0., 1.]).unwrap()).abs() < 1e-12);
        assert!((cosine(&[1., 2.], &[2., 4.]).unwrap() - 1.0).abs() < 1e-12);
        assert!(
            (cosine(&[1., 0.], &[1., 1.]).unwrap() - std::f64::consts::FRAC_1_SQRT_2).abs() < 1e-12
        );
        assert_eq!(
            cosine(&[1.], &[1., 2.]),
            Err(StatsError::LengthMismatch(1, 2))
        );
    }

    #[test]
    fn pearson_values() {
        assert!((pearson(&[1., 2., 3.], &[2., 4., 6.5]).unwrap() - 0.997_949).abs() < 1e-5); // statistics.correlation
        assert!((pearson(&[1., 2., 3.], &[3., 2., 1.]).unwrap() + 1.0).abs() < 1e-12);
        assert_eq!(pearson(&[1., 1.], &[1., 2.]).unwrap(), 0.0);
    }

    #[test]
    fn kl_and_l2() {
        assert!(
            kl_divergence_logits(&[1., 2., 3.], &[1., 2., 3.])
                .unwrap()
                .abs()
                < 1e-12
        );
        // KL([.5,.5] || [.9,.1]) = .5 ln(.5/.9) + .5 ln(.5/.1) = 0.5108
        let q = [0.9f32.ln(), 0.1f32.ln()];
        let kl = kl_divergence_logits(&[0., 0.], &q).unwrap();
        assert!((kl - 0.5108).abs() < 1e-3, "{kl}");
        assert!((relative_l2(&[3., 4.], &[0., 0.]).unwrap()).is_infinite());
        assert!((relative_l2(&[1., 1.], &[1., 0.]).unwrap() - 1.0).abs() < 1e-12);
        let s: f64 = softmax(&[1., 2., 3.]).iter().sum();
        assert!((s - 1.0).abs() < 1e-12);
    }
}
