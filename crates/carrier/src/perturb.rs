//! Perturbations of a carrier: cosine-calibrated isotropic noise, sparse
//! damage and dense damage matched to its cosine, destruction of whole
//! sites (heads, layers), and integer quantization round trips.

use crate::error::{CarrierError, Result};
use crate::rng::Gaussian;
use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

/// A perturbation of the source carrier before it is injected.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Perturbation {
    /// Isotropic Gaussian noise scaled per item and layer so the perturbed
    /// carrier reaches `target_cosine` to the original at the sites.
    CosineNoise {
        /// Cosine of perturbed to original, in (0, 1].
        target_cosine: f64,
    },
    /// Destroys (zeroes) a random fraction of the coordinates.
    SparseDamage {
        /// Fraction of coordinates destroyed, in [0, 1).
        fraction: f64,
    },
    /// Dense damage at matched cosine: isotropic noise calibrated to the
    /// cosine that sparse damage of `fraction` (drawn with the same seed)
    /// reaches on the same sites — the dense counterpart of `sparse_damage`.
    DenseMatched {
        /// Fraction of the sparse damage it is matched to, in [0, 1).
        fraction: f64,
    },
    /// Destroys (zeroes) every coordinate at the sites: whole heads or
    /// whole layers, by the injection's `heads` and `layers`.
    Destroy,
    /// A symmetric per-vector integer round trip.
    Quantize {
        /// Bits per coordinate (8 or 4).
        bits: u8,
    },
}

/// Whether `c` can be a matched-cosine target: a state moved, by noise or
/// toward a genuine neighbour, to cosine `c` to where it was. The targets of
/// the papers' arms lie in (0, 1]; the error text names the value and range.
pub fn check_target_cosine(c: f64) -> std::result::Result<(), String> {
    if c > 0.0 && c <= 1.0 {
        Ok(())
    } else {
        Err(format!("target cosine {c} is not in (0, 1]"))
    }
}

impl Perturbation {
    /// Short name used in records.
    pub fn name(&self) -> &'static str {
        match self {
            Perturbation::CosineNoise { .. } => "cosine_noise",
            Perturbation::SparseDamage { .. } => "sparse_damage",
            Perturbation::DenseMatched { .. } => "dense_matched",
            Perturbation::Destroy => "destroy",
            Perturbation::Quantize { .. } => "quantize",
        }
    }

    /// The target cosine, where the perturbation has one.
    pub fn target_cosine(&self) -> Option<f64> {
        match self {
            Perturbation::CosineNoise { target_cosine } => Some(*target_cosine),
            _ => None,
        }
    }

    /// Checks the parameters (`field` names the config field in errors).
    pub fn validate(&self, field: &str) -> Result<()> {
        let bad = |m: String| Err(CarrierError::BadPerturbation(format!("{field}: {m}")));
        match self {
            Perturbation::CosineNoise { target_cosine } => {
                check_target_cosine(*target_cosine).or_else(bad)?;
            }
            Perturbation::SparseDamage { fraction } | Perturbation::DenseMatched { fraction } => {
                if !(0.0..1.0).contains(fraction) {
                    return bad(format!(
                        "fraction {fraction} is not in [0, 1) (to destroy every coordinate, use `kind = \"destroy\"`)"
                    ));
                }
            }
            Perturbation::Destroy => {}
            Perturbation::Quantize { bits } => {
                if !matches!(bits, 4 | 8) {
                    return bad(format!("bits {bits}: only 8 and 4 are supported"));
                }
            }
        }
        Ok(())
    }

    /// `x` perturbed, calibrated on the sites where `mask` (same shape, 1 =
    /// site; `None` = everywhere) is set. Deterministic in `seed`.
    pub fn apply(&self, x: &Tensor, mask: Option<&Tensor>, seed: u64) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let xs: Vec<f32> = x.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
        let ms: Vec<bool> = match mask {
            Some(m) => m
                .broadcast_as(x.shape())?
                .flatten_all()?
                .to_dtype(DType::U8)?
                .to_vec1::<u8>()?
                .into_iter()
                .map(|v| v != 0)
                .collect(),
            None => vec![true; xs.len()],
        };
        let mut rng = Gaussian::new(seed);
        let out: Vec<f32> = match self {
            Perturbation::CosineNoise { target_cosine } => {
                cosine_noise(&xs, &ms, *target_cosine, &mut rng)
            }
            Perturbation::SparseDamage { fraction } => sparse_damage(&xs, *fraction, &mut rng),
            Perturbation::DenseMatched { fraction } => {
                let sparse = sparse_damage(&xs, *fraction, &mut rng);
                let c = masked_cosine(&sparse, &xs, &ms);
                // The noise draws its own stream, so the match is to the
                // sparse damage this seed gives, not a re-use of its draws.
                let mut noise_rng = Gaussian::new(seed ^ 0xD15E_A5ED_0000_0001);
                cosine_noise(&xs, &ms, c, &mut noise_rng)
            }
            Perturbation::Destroy => vec![0.0; xs.len()],
            Perturbation::Quantize { bits } => {
                let last = *dims.last().unwrap_or(&1);
                crate::readout::int_round_trip(&xs, last.max(1), *bits)?
            }
        };
        // Only the sites change; everything else stays bit-exact.
        let out: Vec<f32> = out
            .into_iter()
            .zip(xs.iter())
            .zip(ms.iter())
            .map(|((o, &x), &m)| if m { o } else { x })
            .collect();
        Ok(Tensor::from_vec(out, dims, x.device())?.to_dtype(x.dtype())?)
    }
}

/// `xs` plus isotropic Gaussian noise scaled so that its cosine to `xs` over
/// the masked cells is `target`.
fn cosine_noise(xs: &[f32], ms: &[bool], target: f64, rng: &mut Gaussian) -> Vec<f32> {
    let noise: Vec<f32> = (0..xs.len()).map(|_| rng.next() as f32).collect();
    let (mut a, mut b, mut e) = (0f64, 0f64, 0f64);
    for i in 0..xs.len() {
        if ms[i] {
            let (xi, ni) = (xs[i] as f64, noise[i] as f64);
            a += xi * xi;
            b += xi * ni;
            e += ni * ni;
        }
    }
    let s = noise_scale(a, b, e, target);
    xs.iter()
        .zip(&noise)
        .map(|(&xi, &ni)| xi + (s * ni as f64) as f32)
        .collect()
}

/// `xs` with each coordinate zeroed with probability `fraction`.
fn sparse_damage(xs: &[f32], fraction: f64, rng: &mut Gaussian) -> Vec<f32> {
    xs.iter()
        .map(|&xi| if rng.uniform() < fraction { 0.0 } else { xi })
        .collect()
}

/// Cosine of `a` to `b` over the masked cells (1 when either is zero there).
fn masked_cosine(a: &[f32], b: &[f32], ms: &[bool]) -> f64 {
    let (mut d, mut na, mut nb) = (0f64, 0f64, 0f64);
    for ((&x, &y), &m) in a.iter().zip(b).zip(ms) {
        if m {
            d += x as f64 * y as f64;
            na += (x as f64).powi(2);
            nb += (y as f64).powi(2);
        }
    }
    if na > 0.0 && nb > 0.0 {
        d / (na.sqrt() * nb.sqrt())
    } else {
        1.0
    }
}

/// The scale s > 0 with cos(x, x + s n) = c, given a = |x|², b = x·n,
/// e = |n|²: the positive root of (b² − c²ae) s² + 2ab(1 − c²) s + a²(1 − c²) = 0.
fn noise_scale(a: f64, b: f64, e: f64, c: f64) -> f64 {
    if c >= 1.0 || a == 0.0 || e == 0.0 {
        return 0.0;
    }
    let qa = b * b - c * c * a * e;
    let qb = 2.0 * a * b * (1.0 - c * c);
    let qc = a * a * (1.0 - c * c);
    let disc = (qb * qb - 4.0 * qa * qc).max(0.0);
    (-qb - disc.sqrt()) / (2.0 * qa)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn cos(a: &[f32], b: &[f32]) -> f64 {
        let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
        let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        dot / (na * nb)
    }

    /// `p` applied to `t` (at the sites of `mask`), flattened.
    fn applied(p: &Perturbation, t: &Tensor, mask: Option<&Tensor>, seed: u64) -> Vec<f32> {
        p.apply(t, mask, seed)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    #[test]
    fn cosine_noise_reaches_its_target_and_is_seeded() {
        let x: Vec<f32> = (0..2048)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let t = Tensor::from_vec(x.clone(), (1, 2, 16, 64), &Device::Cpu).unwrap();
        for target in [0.99, 0.95, 0.9, 0.5] {
            let p = Perturbation::CosineNoise {
                target_cosine: target,
            };
            let y = applied(&p, &t, None, 7);
            assert!(
                (cos(&x, &y) - target).abs() < 1e-4,
                "{target}: {}",
                cos(&x, &y)
            );
            let y2 = applied(&p, &t, None, 7);
            assert_eq!(y, y2);
        }
    }

    #[test]
    fn dense_damage_reaches_the_cosine_of_sparse_damage_of_the_same_seed() {
        let x: Vec<f32> = (0..4096)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 9.0)
            .collect();
        let t = Tensor::from_vec(x.clone(), (1, 2, 32, 64), &Device::Cpu).unwrap();
        for fraction in [0.01, 0.05, 0.2] {
            let sparse = applied(&Perturbation::SparseDamage { fraction }, &t, None, 3);
            let dense = applied(&Perturbation::DenseMatched { fraction }, &t, None, 3);
            let (cs, cd) = (cos(&x, &sparse), cos(&x, &dense));
            assert!(
                (cs - cd).abs() < 1e-4,
                "{fraction}: sparse {cs}, dense {cd}"
            );
            // Dense: every coordinate moved; sparse: only the zeroed ones.
            let moved = dense.iter().zip(&x).filter(|(a, b)| a != b).count();
            assert!(moved > x.len() * 9 / 10, "{moved}");
        }
        let gone = applied(&Perturbation::Destroy, &t, None, 1);
        assert!(gone.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn perturbations_touch_only_the_sites() {
        let x: Vec<f32> = (0..64).map(|i| i as f32 + 1.0).collect();
        let t = Tensor::from_vec(x.clone(), (1, 8, 8), &Device::Cpu).unwrap();
        let mask =
            Tensor::from_vec(vec![0u8, 0, 1, 1, 0, 0, 0, 0], (1, 8, 1), &Device::Cpu).unwrap();
        for p in [
            Perturbation::CosineNoise { target_cosine: 0.9 },
            Perturbation::SparseDamage { fraction: 0.5 },
            Perturbation::DenseMatched { fraction: 0.5 },
            Perturbation::Destroy,
            Perturbation::Quantize { bits: 4 },
        ] {
            let y = applied(&p, &t, Some(&mask), 1);
            assert_eq!(&y[..16], &x[..16], "{p:?}");
            assert_eq!(&y[32..], &x[32..], "{p:?}");
            assert_ne!(&y[16..32], &x[16..32], "{p:?}");
            let sites_x = &x[16..32];
            let sites_y = &y[16..32];
            if let Perturbation::CosineNoise { target_cosine } = p {
                assert!((cos(sites_x, sites_y) - target_cosine).abs() < 1e-4);
            }
        }
        assert!(Perturbation::Quantize { bits: 3 }.validate("p").is_err());
        let e = Perturbation::SparseDamage { fraction: 1.0 }
            .validate("arms[0].inject[0].perturb")
            .unwrap_err()
            .to_string();
        assert!(e.contains("[0, 1)") && e.contains("destroy"), "{e}");
        assert!(Perturbation::DenseMatched { fraction: -0.1 }
            .validate("p")
            .is_err());
        assert!(Perturbation::CosineNoise { target_cosine: 1.5 }
            .validate("p")
            .is_err());
    }
}
