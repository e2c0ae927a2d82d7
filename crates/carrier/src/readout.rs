//! How attention reads a key slot (paper 1, appendix E): the conditioning of
//! the readout and how integer round trips of the cache compare with noise.
//!
//! The readout of one kv head at one query position is what its `G` query
//! heads make of the cache: the attention logits `s_g = q_g · k / sqrt(d)`
//! (the softmax's input) and the attention weights `p_g = softmax(s_g)`
//! (the softmax's output). Moving one key slot `k_j` by `delta` changes
//! only column `j` of the logits, by `q_g · delta / sqrt(d)`, and every
//! weight of the row through the normalisation. The **readout gain** of a
//! stage is `|change of readout| / |delta|` (Frobenius norms over the `G`
//! rows), measured here by finite differences.
//!
//! **The analytic per-slot bound.** To first order the weights move by
//! `dp_g = p_gj (e_j - p_g) ds_gj`, and `|e_j - p_g|^2 = (1 - p_gj)^2 +
//! sum_{i != j} p_gi^2 <= 2 (1 - p_gj)^2`, so `|dp_g| <= sqrt(2) p_gj
//! (1 - p_gj) |q_g| |delta| / sqrt(d)`; over the `G` heads that read the
//! slot, `|dP| / |delta| <= sqrt(2G) max_g p_gj (1 - p_gj) |q_g| / sqrt(d)`.
//! The constant `sqrt(2G)` belongs to the attention's shape (grouped-query
//! heads per kv head), not to the weights.
//!
//! Everything here is plain `f32` slices in row-major order, computed in
//! `f64`: the shapes are small (a few heads by a few hundred slots) and the
//! measurement repeats them hundreds of thousands of times.

use crate::error::{CarrierError, Result};
use nalgebra::DMatrix;

fn shape_err(what: &str, reason: String) -> CarrierError {
    CarrierError::Shape {
        what: what.into(),
        reason,
    }
}

/// The attention logits of `G` queries (`queries`, `[G, d]`) over `T`
/// slots (`keys`, `[T, d]`), scaled by `1 / sqrt(d)`: `[G, T]`.
pub fn logits(queries: &[f32], keys: &[f32], d: usize) -> Result<Vec<f64>> {
    if d == 0 || !queries.len().is_multiple_of(d) || !keys.len().is_multiple_of(d) {
        return Err(shape_err(
            "attention logits",
            format!(
                "{} query and {} key values are not rows of width {d}",
                queries.len(),
                keys.len()
            ),
        ));
    }
    let scale = 1.0 / (d as f64).sqrt();
    let t = keys.len() / d;
    let mut out = Vec::with_capacity(queries.len() / d * t);
    for q in queries.chunks(d) {
        for k in keys.chunks(d) {
            out.push(dot(q, k) * scale);
        }
    }
    Ok(out)
}

/// Row-wise softmax of `[rows, t]` logits.
pub fn softmax_rows(logits: &[f64], t: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(logits.len());
    for row in logits.chunks(t.max(1)) {
        let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = row.iter().map(|&x| (x - m).exp()).collect();
        let z: f64 = e.iter().sum();
        out.extend(e.into_iter().map(|x| x / z));
    }
    out
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

fn norm(a: &[f32]) -> f64 {
    dot(a, a).sqrt()
}

/// The readout gains of one displacement of one key slot.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlotGains {
    /// `|change of the logits| / |delta|` over the `G` rows.
    pub logit: f64,
    /// `|change of the attention weights| / |delta|` over the `G` rows.
    pub softmax: f64,
}

/// One kv head's readout at one query position: its `G` queries and the
/// keys they attend over, with the logits and weights precomputed so that
/// many displacements of one slot are cheap.
#[derive(Debug, Clone)]
pub struct Readout {
    queries: Vec<f32>,
    d: usize,
    t: usize,
    logits: Vec<f64>,
    weights: Vec<f64>,
}

impl Readout {
    /// The readout of `queries` (`[G, d]`) over `keys` (`[T, d]`, every
    /// slot the queries may attend to).
    pub fn new(queries: &[f32], keys: &[f32], d: usize) -> Result<Self> {
        let logits = logits(queries, keys, d)?;
        let t = keys.len() / d;
        if t == 0 || queries.is_empty() {
            return Err(shape_err(
                "readout",
                "no slots or no queries to read them".into(),
            ));
        }
        let weights = softmax_rows(&logits, t);
        Ok(Self {
            queries: queries.to_vec(),
            d,
            t,
            logits,
            weights,
        })
    }

    /// Query heads reading the slots (`G`).
    pub fn heads(&self) -> usize {
        self.queries.len() / self.d
    }

    /// Slots read (`T`).
    pub fn slots(&self) -> usize {
        self.t
    }

    /// The attention weight of head `g` on slot `j`.
    pub fn weight(&self, g: usize, j: usize) -> f64 {
        self.weights[g * self.t + j]
    }

    /// Finite-difference gains of moving slot `j` by `delta` (`[d]`, not zero).
    pub fn gains(&self, j: usize, delta: &[f32]) -> Result<SlotGains> {
        if j >= self.t || delta.len() != self.d {
            return Err(shape_err(
                "readout gain",
                format!(
                    "slot {j} of {} with a displacement of width {} (expected {})",
                    self.t,
                    delta.len(),
                    self.d
                ),
            ));
        }
        let dn = norm(delta);
        if dn == 0.0 || !dn.is_finite() {
            return Err(shape_err(
                "readout gain",
                format!("displacement norm {dn}: a gain needs a finite, non-zero displacement"),
            ));
        }
        let scale = 1.0 / (self.d as f64).sqrt();
        let (mut ds2, mut dp2) = (0.0f64, 0.0f64);
        let mut row = vec![0.0f64; self.t];
        for g in 0..self.heads() {
            let q = &self.queries[g * self.d..(g + 1) * self.d];
            let ds = dot(q, delta) * scale;
            ds2 += ds * ds;
            row.copy_from_slice(&self.logits[g * self.t..(g + 1) * self.t]);
            row[j] += ds;
            let p = softmax_rows(&row, self.t);
            for (a, b) in p.iter().zip(&self.weights[g * self.t..(g + 1) * self.t]) {
                dp2 += (a - b) * (a - b);
            }
        }
        Ok(SlotGains {
            logit: ds2.sqrt() / dn,
            softmax: dp2.sqrt() / dn,
        })
    }

    /// The norm of slot `j`'s logits over the `G` heads (for relative gains).
    pub fn logit_column_norm(&self, j: usize) -> f64 {
        (0..self.heads())
            .map(|g| self.logits[g * self.t + j].powi(2))
            .sum::<f64>()
            .sqrt()
    }

    /// The norm of the attention weights of the `G` heads (for relative gains).
    pub fn weights_norm(&self) -> f64 {
        self.weights.iter().map(|p| p * p).sum::<f64>().sqrt()
    }

    /// The analytic first-order bound on the softmax-stage gain of slot `j`:
    /// `sqrt(2G) max_g p_gj (1 - p_gj) |q_g| / sqrt(d)` (module docs).
    pub fn softmax_bound(&self, j: usize) -> f64 {
        let g_heads = self.heads();
        let scale = 1.0 / (self.d as f64).sqrt();
        let worst = (0..g_heads)
            .map(|g| {
                let p = self.weight(g, j);
                p * (1.0 - p) * norm(&self.queries[g * self.d..(g + 1) * self.d]) * scale
            })
            .fold(0.0, f64::max);
        (2.0 * g_heads as f64).sqrt() * worst
    }

    /// The attention output `sum_j p_gj v_j` of every head (`[G, dv]`) over
    /// `values` (`[T, dv]`), with the keys replaced by `keys` when given.
    pub fn output(&self, keys: Option<&[f32]>, values: &[f32]) -> Result<Vec<f64>> {
        if values.is_empty() || !values.len().is_multiple_of(self.t) {
            return Err(shape_err(
                "attention output",
                format!("{} values are not {} rows", values.len(), self.t),
            ));
        }
        let weights = match keys {
            Some(k) => {
                if k.len() != self.t * self.d {
                    return Err(shape_err(
                        "attention output",
                        format!("{} keys, expected {}", k.len(), self.t * self.d),
                    ));
                }
                softmax_rows(&logits(&self.queries, k, self.d)?, self.t)
            }
            None => self.weights.clone(),
        };
        let dv = values.len() / self.t;
        let mut out = vec![0.0f64; self.heads() * dv];
        for g in 0..self.heads() {
            for (j, v) in values.chunks(dv).enumerate() {
                let p = weights[g * self.t + j];
                for (o, &x) in out[g * dv..(g + 1) * dv].iter_mut().zip(v) {
                    *o += p * x as f64;
                }
            }
        }
        Ok(out)
    }
}

/// An orthonormal basis (`[r, d]`, row-major) of the subspace spanned by the
/// leading right singular vectors of `rows` (`[n, d]`) that together hold at
/// least `energy` (in (0, 1]) of its squared Frobenius norm: the directions
/// the queries resolve.
pub fn principal_subspace(rows: &[f32], d: usize, energy: f64) -> Result<Vec<f64>> {
    if d == 0 || rows.is_empty() || !rows.len().is_multiple_of(d) {
        return Err(shape_err(
            "query subspace",
            format!("{} values are not rows of width {d}", rows.len()),
        ));
    }
    if !(energy > 0.0 && energy <= 1.0) {
        return Err(CarrierError::BadParameter {
            field: "energy".into(),
            reason: format!("{energy} is outside (0, 1]"),
        });
    }
    let n = rows.len() / d;
    let m = DMatrix::from_row_iterator(n, d, rows.iter().map(|&x| x as f64));
    let svd = m.svd(false, true);
    let v_t = svd
        .v_t
        .ok_or_else(|| shape_err("query subspace", "the SVD gave no right vectors".into()))?;
    let mut order: Vec<usize> = (0..svd.singular_values.len()).collect();
    order.sort_by(|&a, &b| svd.singular_values[b].total_cmp(&svd.singular_values[a]));
    let total: f64 = svd.singular_values.iter().map(|s| s * s).sum();
    let mut basis = Vec::new();
    let mut held = 0.0;
    for &i in &order {
        if total > 0.0 && held / total >= energy - 1e-12 {
            break;
        }
        held += svd.singular_values[i] * svd.singular_values[i];
        basis.extend(v_t.row(i).iter().copied());
    }
    Ok(basis)
}

/// The share of `|delta|^2` (rows `[n, d]`, summed) that lies in the
/// subspace of the orthonormal `basis` (`[r, d]`).
pub fn subspace_share(delta: &[f32], basis: &[f64], d: usize) -> f64 {
    let (mut inside, mut total) = (0.0f64, 0.0f64);
    for row in delta.chunks(d) {
        total += row.iter().map(|&x| x as f64 * x as f64).sum::<f64>();
        for b in basis.chunks(d) {
            let c: f64 = row.iter().zip(b).map(|(&x, &y)| x as f64 * y).sum();
            inside += c * c;
        }
    }
    if total == 0.0 {
        0.0
    } else {
        inside / total
    }
}

/// A symmetric per-row integer round trip with `bits` bits (the cache
/// quantizer of [`crate::Perturbation::Quantize`]): each row scaled by its
/// absolute maximum to `±(2^(bits-1) - 1)`, rounded and scaled back.
pub fn int_round_trip(rows: &[f32], d: usize, bits: u8) -> Result<Vec<f32>> {
    if !(2..=16).contains(&bits) {
        return Err(CarrierError::BadParameter {
            field: "bits".into(),
            reason: format!("{bits} bits; expected 2..=16"),
        });
    }
    if d == 0 || !rows.len().is_multiple_of(d) {
        return Err(shape_err(
            "integer round trip",
            format!("{} values are not rows of width {d}", rows.len()),
        ));
    }
    let qmax = ((1i32 << (bits - 1)) - 1) as f32;
    Ok(rows
        .chunks(d)
        .flat_map(|v| {
            let m = v.iter().fold(0f32, |m, &x| m.max(x.abs()));
            let scale = if m > 0.0 { m / qmax } else { 1.0 };
            v.iter()
                .map(move |&x| (x / scale).round().clamp(-qmax, qmax) * scale)
        })
        .collect())
}

/// Seeded standard-normal rows (`[n, d]`), each scaled to the norm of the
/// same row of `like`: noise of matched displacement norm, slot by slot.
pub fn matched_noise(like: &[f32], d: usize, seed: u64) -> Vec<f32> {
    let mut g = crate::rng::Gaussian::new(seed);
    let mut out = Vec::with_capacity(like.len());
    for row in like.chunks(d.max(1)) {
        let z: Vec<f64> = (0..row.len()).map(|_| g.next()).collect();
        let zn = z.iter().map(|x| x * x).sum::<f64>().sqrt();
        let target = norm(row);
        out.extend(z.iter().map(|x| {
            if zn > 0.0 {
                (x / zn * target) as f32
            } else {
                0.0
            }
        }));
    }
    out
}

/// A seeded isotropic unit direction of width `d`.
pub fn random_direction(d: usize, seed: u64) -> Vec<f32> {
    let mut g = crate::rng::Gaussian::new(seed);
    let z: Vec<f64> = (0..d).map(|_| g.next()).collect();
    let n = z
        .iter()
        .map(|x| x * x)
        .sum::<f64>()
        .sqrt()
        .max(f64::MIN_POSITIVE);
    z.iter().map(|x| (x / n) as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize, d: usize, seed: u64, scale: f32) -> Vec<f32> {
        (0..n)
            .flat_map(|i| random_direction(d, seed * 1000 + i as u64))
            .map(|x| x * scale)
            .collect()
    }

    #[test]
    fn the_logit_gain_is_the_queries_response_along_the_direction() {
        let d = 16;
        let q = rows(3, d, 1, 4.0);
        let k = rows(10, d, 2, 3.0);
        let r = Readout::new(&q, &k, d).unwrap();
        let u = random_direction(d, 9);
        for eps in [1e-3f32, 1.0] {
            let delta: Vec<f32> = u.iter().map(|x| x * eps).collect();
            let g = r.gains(4, &delta).unwrap();
            let want = (0..3)
                .map(|h| dot(&q[h * d..(h + 1) * d], &u).powi(2))
                .sum::<f64>()
                .sqrt()
                / (d as f64).sqrt();
            assert!(
                (g.logit - want).abs() < 1e-6 * want.max(1.0),
                "{} {want}",
                g.logit
            );
        }
    }

    #[test]
    fn small_displacements_stay_under_the_analytic_bound_and_match_the_jacobian() {
        let d = 16;
        let q = rows(4, d, 3, 6.0);
        let k = rows(12, d, 4, 5.0);
        let r = Readout::new(&q, &k, d).unwrap();
        for j in 0..12 {
            let bound = r.softmax_bound(j);
            for s in 0..5 {
                let u = random_direction(d, 100 + s);
                let delta: Vec<f32> = u.iter().map(|x| x * 1e-4).collect();
                let g = r.gains(j, &delta).unwrap();
                assert!(
                    g.softmax <= bound * (1.0 + 1e-3) + 1e-9,
                    "slot {j}: {} > {bound}",
                    g.softmax
                );
                // The first-order change, computed directly.
                let mut jac2 = 0.0;
                for h in 0..4 {
                    let ds = dot(&q[h * d..(h + 1) * d], &u) / (d as f64).sqrt();
                    let p = |i: usize| r.weight(h, i);
                    for i in 0..12 {
                        let e = if i == j { 1.0 } else { 0.0 };
                        let dp = p(j) * (e - p(i)) * ds;
                        jac2 += dp * dp;
                    }
                }
                let jac = jac2.sqrt();
                assert!(
                    (g.softmax - jac).abs() <= 1e-3 * jac.max(1e-6),
                    "{} {jac}",
                    g.softmax
                );
            }
        }
    }

    #[test]
    fn a_zero_displacement_or_a_bad_slot_is_an_error() {
        let r = Readout::new(&[1.0, 0.0], &[1.0, 0.0, 0.0, 1.0], 2).unwrap();
        assert!(r.gains(0, &[0.0, 0.0]).is_err());
        assert!(r.gains(2, &[1.0, 0.0]).is_err());
        assert!(Readout::new(&[1.0, 0.0], &[], 2).is_err());
    }

    #[test]
    fn the_principal_subspace_holds_the_rows_and_nothing_orthogonal() {
        let d = 6;
        // Rows in the span of e0 and e1.
        let rows = vec![
            3.0, 1.0, 0.0, 0.0, 0.0, 0.0, //
            -1.0, 2.0, 0.0, 0.0, 0.0, 0.0, //
            0.5, 0.5, 0.0, 0.0, 0.0, 0.0,
        ];
        let b = principal_subspace(&rows, d, 1.0).unwrap();
        assert_eq!(b.len() / d, 2);
        assert!((subspace_share(&[0.3, -0.7, 0.0, 0.0, 0.0, 0.0], &b, d) - 1.0).abs() < 1e-9);
        assert!(subspace_share(&[0.0, 0.0, 1.0, 0.0, -2.0, 0.0], &b, d).abs() < 1e-9);
        assert!(principal_subspace(&rows, d, 0.0).is_err());
        // A lower energy keeps only the leading direction.
        let b1 = principal_subspace(&rows, d, 0.5).unwrap();
        assert_eq!(b1.len() / d, 1);
    }

    #[test]
    fn round_trips_and_matched_noise_have_the_stated_sizes() {
        let d = 8;
        let x = rows(5, d, 7, 2.0);
        let q8 = int_round_trip(&x, d, 8).unwrap();
        let q4 = int_round_trip(&x, d, 4).unwrap();
        let err = |a: &[f32]| -> f64 {
            a.iter()
                .zip(&x)
                .map(|(p, q)| ((p - q) as f64).powi(2))
                .sum::<f64>()
                .sqrt()
        };
        assert!(err(&q8) > 0.0 && err(&q8) < err(&q4));
        assert!(int_round_trip(&x, d, 1).is_err());
        let delta: Vec<f32> = q4.iter().zip(&x).map(|(a, b)| a - b).collect();
        let n = matched_noise(&delta, d, 3);
        for (a, b) in delta.chunks(d).zip(n.chunks(d)) {
            assert!((norm(a) - norm(b)).abs() < 1e-5);
        }
        assert_eq!(matched_noise(&delta, d, 3), n);
        assert_ne!(matched_noise(&delta, d, 4), n);
    }
}
