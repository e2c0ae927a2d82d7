//! Codebooks fitted on a key bank, and snapping to them.
//!
//! A *codebook* is a small set of vectors fitted on a bank of genuine keys
//! (see [`crate::bank`]), by one of three [`Construction`]s — k-means
//! centroids, principal axes (PCA), or a random subset of the bank. *Snapping*
//! replaces a key by something the codebook can express, by one of three
//! [`Snapping`] rules: the nearest entry by L2, the entry of highest cosine
//! (keeping the key's norm), or the orthogonal projection onto the
//! codebook's span. PROTOCOL.md section 5 crosses the three constructions
//! with the three rules and logs fidelity (cosine, attention-logit
//! correlation) beside transfer.
//!
//! Everything here is a pure, deterministic function of `f32` tensors on the
//! CPU (internally `f64` where precision matters); fitting is seeded.

use crate::bank::{sample_rows, top_k_cosine};
use crate::error::{CarrierError, Result};
use candle_core::{DType, Device, Tensor};
use linfa::traits::Fit;
use linfa::DatasetBase;
use linfa_clustering::{KMeans, KMeansInit};
use nalgebra::{DMatrix, SymmetricEigen, SVD};
use rand_xoshiro::rand_core::SeedableRng;
use rand_xoshiro::Xoshiro256Plus;
use serde::{Deserialize, Serialize};

/// How a codebook is fitted on a bank of genuine keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Construction {
    /// `size` k-means centroids of the bank (Lloyd's algorithm from a
    /// k-means++ start).
    Kmeans,
    /// The bank's top `size` principal axes: entries one standard deviation
    /// either side of the mean along each, and the affine principal subspace
    /// for projection.
    Pca,
    /// `size` genuine keys drawn from the bank.
    RandomSubset,
}

impl Construction {
    /// Short name used in configs and records (`kmeans`, `pca`, `random_subset`).
    pub fn name(self) -> &'static str {
        match self {
            Construction::Kmeans => "kmeans",
            Construction::Pca => "pca",
            Construction::RandomSubset => "random_subset",
        }
    }
}

/// How a key is snapped to a codebook.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Snapping {
    /// Replaced by the entry nearest in Euclidean distance.
    L2,
    /// Replaced by the entry of highest cosine, rescaled to the key's own
    /// norm: cosine snapping chooses a direction and keeps the norm.
    Cosine,
    /// Replaced by its orthogonal projection onto the codebook's (affine) span.
    Projection,
}

impl Snapping {
    /// Short name used in configs and records (`l2`, `cosine`, `projection`).
    pub fn name(self) -> &'static str {
        match self {
            Snapping::L2 => "l2",
            Snapping::Cosine => "cosine",
            Snapping::Projection => "projection",
        }
    }
}

/// Lloyd iterations at most per k-means run.
pub const KMEANS_MAX_ITERATIONS: u64 = 300;
/// Independent k-means runs (each from its own k-means++ start, all from the
/// one seed); the run of lowest inertia is kept.
pub const KMEANS_RUNS: usize = 3;
/// k-means stops when the centroids move (Frobenius norm of the change) less
/// than this fraction of the bank's root-mean-square row norm.
pub const KMEANS_RELATIVE_TOLERANCE: f64 = 1e-6;
/// Directions whose singular value is below this fraction of the largest are
/// taken as outside the span of a codebook's entries (the entries are `f32`).
pub const SPAN_RELATIVE_TOLERANCE: f64 = 1e-6;

fn bad<T>(m: String) -> Result<T> {
    Err(CarrierError::BadCodebook(m))
}

/// Checks a codebook's size against its bank (`bank_size` vectors of
/// dimension `d`), as [`Codebook::fit`] does.
fn check_size(construction: Construction, size: usize, bank_size: usize, d: usize) -> Result<()> {
    if size == 0 {
        return bad(format!(
            "a {} codebook needs at least one entry",
            construction.name()
        ));
    }
    if size > bank_size {
        return bad(format!(
            "a codebook of {size} entries is larger than its bank of {bank_size}"
        ));
    }
    if construction == Construction::Pca && size > d {
        return bad(format!(
            "a pca codebook of {size} components in {d} dimensions; choose size <= {d}"
        ));
    }
    Ok(())
}

/// Checks a codebook arm before any work: `size` entries (components for
/// PCA) fitted on a bank of `bank_size` vectors of dimension `d` (head_dim),
/// snapped by `rule`. Beyond [`Codebook::fit`]'s own checks, projection onto
/// the span of `size >= d` entries is refused: it is (generically) the
/// identity, and the arm would be a no-op.
pub fn validate(
    construction: Construction,
    size: usize,
    bank_size: usize,
    d: usize,
    rule: Snapping,
) -> Result<()> {
    check_size(construction, size, bank_size, d)?;
    if rule == Snapping::Projection && size >= d {
        return bad(identity_message(size, d));
    }
    Ok(())
}

fn identity_message(size: usize, d: usize) -> String {
    format!(
        "projection onto the span of {size} entries in {d} dimensions is the identity; choose size < {d}"
    )
}

/// A codebook fitted on a key bank.
///
/// Fields are private; read them with the accessors. All tensors are `f32`
/// on the CPU:
/// - [`entries`](Self::entries) `[m, d]`: the points L2 and cosine snapping
///   choose among (k-means centroids; PCA's μ ± σ_j u_j, so m = 2·size; the
///   drawn bank rows);
/// - [`mean`](Self::mean) `[d]` and [`basis`](Self::basis) `[r, d]` with
///   orthonormal rows: projection maps x to mean + basisᵀ basis (x − mean).
///   For k-means and random subsets the mean is zero and the basis spans the
///   entries' linear span (r ≤ min(size, d)); for PCA the mean is the bank's
///   and the basis its top `size` principal directions.
#[derive(Debug, Clone)]
pub struct Codebook {
    construction: Construction,
    size: usize,
    entries: Tensor,
    mean: Tensor,
    basis: Tensor,
}

impl Codebook {
    /// Fits a codebook of `size` on `bank` (`[N, d]` genuine keys), seeded
    /// by `seed` (k-means starts and random subsets; PCA is deterministic).
    ///
    /// - [`Construction::Kmeans`]: `size` centroids by Lloyd's algorithm from
    ///   a k-means++ start (linfa-clustering, in `f64`, [`KMEANS_RUNS`] runs,
    ///   at most [`KMEANS_MAX_ITERATIONS`] iterations, tolerance
    ///   [`KMEANS_RELATIVE_TOLERANCE`]); the basis spans the centroids.
    /// - [`Construction::Pca`]: the bank mean μ and the top `size`
    ///   eigenvectors u_j of its covariance (descending eigenvalue λ_j, each
    ///   signed so its largest-magnitude coordinate is positive), with
    ///   σ_j = √λ_j. Entries are μ + σ_1 u_1, μ − σ_1 u_1, μ + σ_2 u_2, … (the
    ///   principal axes one standard deviation from the mean serve as the
    ///   entries for nearest-entry snapping); the basis is the u_j.
    /// - [`Construction::RandomSubset`]: `size` distinct bank rows
    ///   ([`sample_rows`]); the basis spans them.
    ///
    /// Errors: `size == 0`; `size > N`; for PCA `size > d`.
    pub fn fit(construction: Construction, bank: &Tensor, size: usize, seed: u64) -> Result<Self> {
        let (n, d) = bank.dims2().map_err(|_| CarrierError::Shape {
            what: "codebook bank".into(),
            reason: format!("a bank is [N, d], not {:?}", bank.dims()),
        })?;
        check_size(construction, size, n, d)?;
        let bank = bank.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
        let (entries, mean, basis) = match construction {
            Construction::Kmeans => {
                let c = kmeans(&bank, size, seed)?;
                let basis = span_basis(&c, d);
                (c, vec![0.0; d], basis)
            }
            Construction::Pca => pca(&bank, size)?,
            Construction::RandomSubset => {
                let rows: Vec<Vec<f32>> = sample_rows(&bank, size, seed)?.to_vec2()?;
                let rows: Vec<Vec<f64>> = rows
                    .into_iter()
                    .map(|r| r.into_iter().map(f64::from).collect())
                    .collect();
                let basis = span_basis(&rows, d);
                (rows, vec![0.0; d], basis)
            }
        };
        Ok(Self {
            construction,
            size,
            entries: matrix(&entries, d)?,
            mean: Tensor::from_vec(
                mean.iter().map(|&x| x as f32).collect::<Vec<_>>(),
                d,
                &Device::Cpu,
            )?,
            basis: matrix(&basis, d)?,
        })
    }

    /// A codebook from its saved parts (see [`entries`](Self::entries),
    /// [`mean`](Self::mean), [`basis`](Self::basis)): what a cache of fitted
    /// codebooks reloads. `size` is read back from the entries (PCA holds two
    /// entries per component).
    pub fn from_parts(
        construction: Construction,
        entries: Tensor,
        mean: Tensor,
        basis: Tensor,
    ) -> Result<Self> {
        let (m, d) = entries.dims2()?;
        let (_, bd) = basis.dims2()?;
        if mean.dims() != [d] || bd != d {
            return Err(CarrierError::Shape {
                what: "codebook parts".into(),
                reason: format!(
                    "entries {:?}, mean {:?}, basis {:?}",
                    entries.dims(),
                    mean.dims(),
                    basis.dims()
                ),
            });
        }
        let size = if construction == Construction::Pca {
            m / 2
        } else {
            m
        };
        Ok(Self {
            construction,
            size,
            entries,
            mean,
            basis,
        })
    }

    /// How it was fitted.
    pub fn construction(&self) -> Construction {
        self.construction
    }

    /// The size asked for (entries for k-means and random subsets,
    /// components for PCA).
    pub fn size(&self) -> usize {
        self.size
    }

    /// The entries `[m, d]` that L2 and cosine snapping choose among.
    pub fn entries(&self) -> &Tensor {
        &self.entries
    }

    /// The origin `[d]` of the projection's affine span (zero except for PCA).
    pub fn mean(&self) -> &Tensor {
        &self.mean
    }

    /// Orthonormal rows `[r, d]` spanning the projection's subspace.
    pub fn basis(&self) -> &Tensor {
        &self.basis
    }

    /// Dimension r of the projection's subspace.
    pub fn rank(&self) -> usize {
        self.basis.dims()[0]
    }

    /// Dimension d of the keys.
    pub fn dim(&self) -> usize {
        self.mean.dims()[0]
    }

    /// Whether the basis spans the whole space, so projection would leave
    /// every key unchanged ([`snap`](Self::snap) refuses it).
    pub fn projection_is_identity(&self) -> bool {
        self.rank() >= self.dim()
    }

    /// `x` (`[n, d]`) with every row snapped to the codebook by `rule`,
    /// `[n, d]` in `f32`:
    /// - [`Snapping::L2`]: the entry nearest in Euclidean distance (ties to
    ///   the lower entry);
    /// - [`Snapping::Cosine`]: the entry of highest cosine (ties to the lower
    ///   entry), rescaled to the row's own norm (a zero row, or a zero entry,
    ///   gives a zero row);
    /// - [`Snapping::Projection`]: mean + basisᵀ basis (x − mean), the
    ///   orthogonal projection onto the affine span; an error when that is the
    ///   identity (see [`projection_is_identity`](Self::projection_is_identity)).
    pub fn snap(&self, x: &Tensor, rule: Snapping) -> Result<Tensor> {
        let d = self.dim();
        let (n, xd) = x.dims2().map_err(|_| CarrierError::Shape {
            what: "keys to snap".into(),
            reason: format!("keys are [n, d], not {:?}", x.dims()),
        })?;
        if xd != d {
            return Err(CarrierError::Shape {
                what: "keys to snap".into(),
                reason: format!("keys of dimension {xd} against a codebook of dimension {d}"),
            });
        }
        let device = x.device().clone();
        let x = x.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
        let out = match rule {
            Snapping::L2 => {
                if n == 0 {
                    return Ok(x.to_device(&device)?);
                }
                // argmin_j |x − e_j|² = argmin_j (|e_j|² − 2 x·e_j), in f64.
                let e = self.entries.to_dtype(DType::F64)?;
                let e_sq: Vec<f64> = e.sqr()?.sum(1)?.to_vec1()?;
                let dots: Vec<Vec<f64>> = x.to_dtype(DType::F64)?.matmul(&e.t()?)?.to_vec2()?;
                let index: Vec<u32> = dots
                    .iter()
                    .map(|row| {
                        let mut best = 0usize;
                        let mut best_d = f64::INFINITY;
                        for (j, (&dot, &sq)) in row.iter().zip(&e_sq).enumerate() {
                            let dist = sq - 2.0 * dot;
                            if dist < best_d {
                                best = j;
                                best_d = dist;
                            }
                        }
                        best as u32
                    })
                    .collect();
                let idx = Tensor::from_vec(index, n, &Device::Cpu)?;
                self.entries.index_select(&idx, 0)?
            }
            Snapping::Cosine => {
                if n == 0 {
                    return Ok(x.to_device(&device)?);
                }
                let nearest = top_k_cosine(&x, &self.entries, 1)?;
                let idx = Tensor::from_vec(nearest.rank(0).0, n, &Device::Cpu)?;
                let chosen = self.entries.index_select(&idx, 0)?.to_dtype(DType::F64)?;
                let x_norm: Vec<f64> = x.to_dtype(DType::F64)?.sqr()?.sum(1)?.sqrt()?.to_vec1()?;
                let e_norm: Vec<f64> = chosen.sqr()?.sum(1)?.sqrt()?.to_vec1()?;
                let scale: Vec<f64> = x_norm
                    .iter()
                    .zip(&e_norm)
                    .map(|(&a, &b)| if b > 0.0 { a / b } else { 0.0 })
                    .collect();
                let scale = Tensor::from_vec(scale, (n, 1), &Device::Cpu)?;
                chosen.broadcast_mul(&scale)?.to_dtype(DType::F32)?
            }
            Snapping::Projection => {
                if self.projection_is_identity() {
                    return bad(identity_message(self.size, d));
                }
                let mean = self.mean.to_dtype(DType::F64)?.unsqueeze(0)?;
                let basis = self.basis.to_dtype(DType::F64)?;
                let centred = x.to_dtype(DType::F64)?.broadcast_sub(&mean)?;
                let coords = centred.matmul(&basis.t()?)?;
                coords
                    .matmul(&basis)?
                    .broadcast_add(&mean)?
                    .to_dtype(DType::F32)?
            }
        };
        Ok(out.to_device(&device)?)
    }
}

/// Rows as an `f32` tensor `[rows.len(), d]`.
fn matrix(rows: &[Vec<f64>], d: usize) -> Result<Tensor> {
    let flat: Vec<f32> = rows.iter().flatten().map(|&x| x as f32).collect();
    Ok(Tensor::from_vec(flat, (rows.len(), d), &Device::Cpu)?)
}

/// Flips `v` so its largest-magnitude coordinate (the first such) is positive.
fn fix_sign(v: &mut [f64]) {
    let mut at = 0;
    for (i, x) in v.iter().enumerate() {
        if x.abs() > v[at].abs() {
            at = i;
        }
    }
    if v.get(at).is_some_and(|&x| x < 0.0) {
        v.iter_mut().for_each(|x| *x = -*x);
    }
}

/// An orthonormal basis (rows) of the linear span of `rows` (each of length
/// `d`): the right singular vectors whose singular value exceeds
/// [`SPAN_RELATIVE_TOLERANCE`] of the largest, in descending singular value,
/// each signed by [`fix_sign`].
fn span_basis(rows: &[Vec<f64>], d: usize) -> Vec<Vec<f64>> {
    let m = rows.len();
    if m == 0 || d == 0 {
        return Vec::new();
    }
    let flat: Vec<f64> = rows.iter().flatten().copied().collect();
    let a = DMatrix::from_row_slice(m, d, &flat);
    let svd = SVD::new(a, false, true);
    let v_t = svd.v_t.expect("SVD asked for V^T");
    let s = &svd.singular_values;
    let top = s.iter().cloned().fold(0.0, f64::max);
    if top <= 0.0 {
        return Vec::new();
    }
    let mut order: Vec<usize> = (0..s.len())
        .filter(|&i| s[i] > SPAN_RELATIVE_TOLERANCE * top)
        .collect();
    order.sort_by(|&i, &j| s[j].total_cmp(&s[i]).then(i.cmp(&j)));
    order
        .into_iter()
        .map(|i| {
            let mut v: Vec<f64> = v_t.row(i).iter().copied().collect();
            fix_sign(&mut v);
            v
        })
        .collect()
}

/// `size` k-means centroids of `bank` (`[N, d]`, f32), in `f64`.
///
/// linfa-clustering's `KMeans`: k-means++ initialisation (sequential, from a
/// `Xoshiro256Plus` seeded with `seed`), then Lloyd iterations — its update
/// counts the previous centroid as one more member of its cluster, which
/// has the same fixed points as plain Lloyd and keeps an emptied cluster
/// where it was instead of dividing by zero. The assignment step runs rows
/// in parallel but each row's result is independent of the others, so the
/// fit is deterministic in the seed.
fn kmeans(bank: &Tensor, size: usize, seed: u64) -> Result<Vec<Vec<f64>>> {
    let (n, d) = bank.dims2()?;
    let flat: Vec<f64> = bank.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let rms = (flat.iter().map(|x| x * x).sum::<f64>() / n as f64).sqrt();
    let tolerance = (KMEANS_RELATIVE_TOLERANCE * rms).max(f64::MIN_POSITIVE);
    let data = ndarray::Array2::from_shape_vec((n, d), flat)
        .map_err(|e| CarrierError::BadCodebook(format!("k-means input: {e}")))?;
    let model = KMeans::params_with_rng(size, Xoshiro256Plus::seed_from_u64(seed))
        .init_method(KMeansInit::KMeansPlusPlus)
        .n_runs(KMEANS_RUNS)
        .max_n_iterations(KMEANS_MAX_ITERATIONS)
        .tolerance(tolerance)
        .fit(&DatasetBase::from(data))
        .map_err(|e| CarrierError::BadCodebook(format!("k-means of {size} on {n}: {e}")))?;
    Ok(model
        .centroids()
        .rows()
        .into_iter()
        .map(|r| r.to_vec())
        .collect())
}

/// Entries, mean and basis of a PCA codebook of `size` components.
type Fitted = (Vec<Vec<f64>>, Vec<f64>, Vec<Vec<f64>>);

fn pca(bank: &Tensor, size: usize) -> Result<Fitted> {
    let (n, d) = bank.dims2()?;
    let x = bank.to_dtype(DType::F64)?;
    let mean_t = x.mean_keepdim(0)?;
    let centred = x.broadcast_sub(&mean_t)?;
    let cov = (centred.t()?.matmul(&centred)? / (n.max(2) - 1) as f64)?;
    let cov: Vec<f64> = cov.flatten_all()?.to_vec1()?;
    let mean: Vec<f64> = mean_t.flatten_all()?.to_vec1()?;
    // Symmetrise against rounding before the decomposition.
    let mut c = DMatrix::from_row_slice(d, d, &cov);
    c = (&c + c.transpose()) * 0.5;
    let eig = SymmetricEigen::new(c);
    let mut order: Vec<usize> = (0..d).collect();
    order.sort_by(|&i, &j| {
        eig.eigenvalues[j]
            .total_cmp(&eig.eigenvalues[i])
            .then(i.cmp(&j))
    });
    let mut entries = Vec::with_capacity(2 * size);
    let mut basis = Vec::with_capacity(size);
    for &i in order.iter().take(size) {
        let mut u: Vec<f64> = eig.eigenvectors.column(i).iter().copied().collect();
        fix_sign(&mut u);
        let sigma = eig.eigenvalues[i].max(0.0).sqrt();
        entries.push(mean.iter().zip(&u).map(|(m, u)| m + sigma * u).collect());
        entries.push(mean.iter().zip(&u).map(|(m, u)| m - sigma * u).collect());
        basis.push(u);
    }
    Ok((entries, mean, basis))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bank::tests::{cos64, normal};
    use crate::rng::Gaussian;

    fn rows(t: &Tensor) -> Vec<Vec<f32>> {
        t.to_vec2().unwrap()
    }

    fn dist2(a: &[f32], b: &[f32]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
            .sum()
    }

    fn norm(a: &[f32]) -> f64 {
        a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt()
    }

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar()
            .unwrap()
    }

    /// 3 Gaussian blobs (sd 0.3) of 100 points each around known centres in 8
    /// dimensions, shuffled together.
    fn blobs() -> (Tensor, Vec<Vec<f32>>) {
        let centres: Vec<Vec<f32>> = vec![
            vec![5., 0., 0., 0., 1., 0., 0., 0.],
            vec![0., 5., 0., 0., 0., -1., 0., 0.],
            vec![0., 0., -5., 5., 0., 0., 0., 0.],
        ];
        let mut g = Gaussian::new(17);
        let mut data = Vec::new();
        for i in 0..300 {
            let c = &centres[(i * 7) % 3];
            data.extend(c.iter().map(|&x| x + 0.3 * g.next() as f32));
        }
        (
            Tensor::from_vec(data, (300, 8), &Device::Cpu).unwrap(),
            centres,
        )
    }

    #[test]
    fn names_and_serde_use_snake_case() {
        #[derive(Deserialize)]
        struct Arm {
            construction: Construction,
            snapping: Snapping,
        }
        let arm: Arm =
            toml::from_str("construction = \"random_subset\"\nsnapping = \"l2\"").unwrap();
        assert_eq!(arm.construction, Construction::RandomSubset);
        assert_eq!(arm.snapping, Snapping::L2);
        for c in [
            Construction::Kmeans,
            Construction::Pca,
            Construction::RandomSubset,
        ] {
            let s = toml::to_string(&std::collections::BTreeMap::from([("c", c)])).unwrap();
            assert_eq!(s.trim(), format!("c = \"{}\"", c.name()));
        }
        for r in [Snapping::L2, Snapping::Cosine, Snapping::Projection] {
            let s = toml::to_string(&std::collections::BTreeMap::from([("r", r)])).unwrap();
            assert_eq!(s.trim(), format!("r = \"{}\"", r.name()));
        }
    }

    #[test]
    fn kmeans_recovers_separated_centres_and_is_seeded() {
        let (bank, centres) = blobs();
        let cb = Codebook::fit(Construction::Kmeans, &bank, 3, 5).unwrap();
        let got = rows(cb.entries());
        assert_eq!(got.len(), 3);
        for c in &centres {
            let nearest = got
                .iter()
                .map(|g| dist2(g, c))
                .fold(f64::INFINITY, f64::min);
            assert!(nearest.sqrt() < 0.15, "centre {c:?}: {got:?}");
        }
        let again = Codebook::fit(Construction::Kmeans, &bank, 3, 5).unwrap();
        assert_eq!(rows(again.entries()), got);
        assert_eq!(cb.rank(), 3);
        assert_eq!(cb.mean().to_vec1::<f32>().unwrap(), vec![0.0; 8]);
    }

    #[test]
    fn pca_recovers_axes_in_order_of_variance() {
        // Standard deviations 6, 3, 1, 0.2, 0.2, 0.2 along a rotated frame:
        // axes e0 ± e1 (normalised) for the first two, e2 for the third.
        let s = std::f32::consts::FRAC_1_SQRT_2;
        let axes: Vec<Vec<f32>> = vec![
            vec![s, s, 0., 0., 0., 0.],
            vec![s, -s, 0., 0., 0., 0.],
            vec![0., 0., 1., 0., 0., 0.],
        ];
        let sds = [6f32, 3., 1.];
        let mean = [1f32, -2., 3., 0.5, 0., 0.];
        let mut g = Gaussian::new(23);
        let n = 4000;
        let mut data = Vec::new();
        for _ in 0..n {
            let mut x: Vec<f32> = mean.to_vec();
            for (a, sd) in axes.iter().zip(sds) {
                let z = sd * g.next() as f32;
                x.iter_mut().zip(a).for_each(|(xi, ai)| *xi += z * ai);
            }
            for xi in x.iter_mut().skip(3) {
                *xi += 0.2 * g.next() as f32;
            }
            data.extend(x);
        }
        let bank = Tensor::from_vec(data, (n, 6), &Device::Cpu).unwrap();
        let cb = Codebook::fit(Construction::Pca, &bank, 3, 0).unwrap();
        let basis = rows(cb.basis());
        assert_eq!(basis.len(), 3);
        for (u, a) in basis.iter().zip(&axes) {
            assert!(cos64(u, a).abs() > 0.995, "{u:?} against {a:?}");
        }
        let m = rows(&cb.mean().unsqueeze(0).unwrap())[0].clone();
        assert!(
            m.iter().zip(mean).all(|(a, b)| (a - b).abs() < 0.3),
            "{m:?}"
        );
        // Entries: μ ± σ_j u_j, σ_j near the true standard deviations.
        let e = rows(cb.entries());
        assert_eq!(e.len(), 6);
        for (j, sd) in sds.iter().enumerate() {
            let sigma = dist2(&e[2 * j], &m).sqrt();
            assert!((sigma / *sd as f64 - 1.0).abs() < 0.05, "axis {j}: {sigma}");
            let mid: Vec<f32> = e[2 * j]
                .iter()
                .zip(&e[2 * j + 1])
                .map(|(a, b)| (a + b) / 2.0)
                .collect();
            assert!(dist2(&mid, &m) < 1e-8);
        }
        // Orthonormal basis.
        for i in 0..3 {
            for j in 0..3 {
                let dot: f64 = basis[i]
                    .iter()
                    .zip(&basis[j])
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum();
                assert!((dot - if i == j { 1.0 } else { 0.0 }).abs() < 1e-5);
            }
        }
        // Deterministic sign: the largest-magnitude coordinate is positive.
        for u in &basis {
            let big = u
                .iter()
                .cloned()
                .fold(0f32, |m, x| if x.abs() > m.abs() { x } else { m });
            assert!(big > 0.0);
        }
    }

    #[test]
    fn projection_onto_a_subspace_the_data_lies_in_is_exact() {
        // 500 points in a 3-dim affine subspace of R^10.
        let (coeffs, _) = normal(500, 3, 31);
        let (dirs, _) = normal(3, 10, 32);
        let offset = Tensor::from_vec(
            (0..10).map(|i| i as f32 - 4.5).collect::<Vec<_>>(),
            (1, 10),
            &Device::Cpu,
        )
        .unwrap();
        let data = coeffs
            .matmul(&dirs)
            .unwrap()
            .broadcast_add(&offset)
            .unwrap();
        let cb = Codebook::fit(Construction::Pca, &data, 3, 0).unwrap();
        let snapped = cb.snap(&data, Snapping::Projection).unwrap();
        assert!(max_abs_diff(&snapped, &data) < 1e-4);
        // With two components it is not exact.
        let cb2 = Codebook::fit(Construction::Pca, &data, 2, 0).unwrap();
        let snapped2 = cb2.snap(&data, Snapping::Projection).unwrap();
        assert!(max_abs_diff(&snapped2, &data) > 0.1);
    }

    #[test]
    fn random_subset_entries_are_bank_rows() {
        let (bank, b) = normal(100, 8, 41);
        let cb = Codebook::fit(Construction::RandomSubset, &bank, 5, 9).unwrap();
        let e = rows(cb.entries());
        assert_eq!(e.len(), 5);
        for row in &e {
            assert!(b.contains(row));
        }
        assert_eq!(rows(&sample_rows(&bank, 5, 9).unwrap()), e);
        assert_eq!(cb.rank(), 5);
        let other = Codebook::fit(Construction::RandomSubset, &bank, 5, 10).unwrap();
        assert_ne!(rows(other.entries()), e);
    }

    #[test]
    fn l2_and_cosine_snapping_pick_the_brute_force_entry() {
        let (bank, _) = normal(300, 8, 51);
        let (x, xs) = normal(40, 8, 52);
        for c in [
            Construction::Kmeans,
            Construction::Pca,
            Construction::RandomSubset,
        ] {
            let cb = Codebook::fit(c, &bank, 6, 3).unwrap();
            let e = rows(cb.entries());
            let l2 = rows(&cb.snap(&x, Snapping::L2).unwrap());
            let cs = rows(&cb.snap(&x, Snapping::Cosine).unwrap());
            for (i, xi) in xs.iter().enumerate() {
                let best = e
                    .iter()
                    .map(|ej| dist2(xi, ej))
                    .fold(f64::INFINITY, f64::min);
                assert!(e.contains(&l2[i]), "{c:?}");
                assert!(dist2(xi, &l2[i]) - best < 1e-6, "{c:?} row {i}");
                let best_cos = e
                    .iter()
                    .map(|ej| cos64(xi, ej))
                    .fold(f64::NEG_INFINITY, f64::max);
                assert!((cos64(xi, &cs[i]) - best_cos).abs() < 1e-5, "{c:?} row {i}");
                assert!((norm(&cs[i]) / norm(xi) - 1.0).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn projection_is_idempotent_and_orthogonal() {
        let (bank, _) = normal(300, 12, 61);
        let (x, _) = normal(30, 12, 62);
        let x = (x * 3.0).unwrap();
        for c in [
            Construction::Kmeans,
            Construction::Pca,
            Construction::RandomSubset,
        ] {
            let cb = Codebook::fit(c, &bank, 5, 1).unwrap();
            assert_eq!(cb.rank(), 5);
            assert!(!cb.projection_is_identity());
            let p = cb.snap(&x, Snapping::Projection).unwrap();
            let pp = cb.snap(&p, Snapping::Projection).unwrap();
            assert!(max_abs_diff(&p, &pp) < 1e-5, "{c:?}");
            // The residual x − p is orthogonal to the basis.
            let residual = (&x - &p).unwrap();
            let along = residual.matmul(&cb.basis().t().unwrap()).unwrap();
            let worst = max_abs_diff(&along, &along.zeros_like().unwrap());
            assert!(worst < 1e-4, "{c:?}: {worst}");
            assert!(max_abs_diff(&p, &x) > 0.1);
        }
    }

    #[test]
    fn identity_projection_and_bad_sizes_are_errors() {
        let (bank, _) = normal(100, 8, 71);
        let (x, _) = normal(3, 8, 72);
        for c in [Construction::Kmeans, Construction::RandomSubset] {
            for size in [8, 12] {
                let cb = Codebook::fit(c, &bank, size, 2).unwrap();
                assert!(cb.projection_is_identity());
                let msg = cb.snap(&x, Snapping::Projection).unwrap_err().to_string();
                assert!(
                    msg.contains(&format!("projection onto the span of {size} entries in 8 dimensions is the identity; choose size < 8")),
                    "{msg}"
                );
                assert!(cb.snap(&x, Snapping::L2).is_ok());
                assert!(validate(c, size, 100, 8, Snapping::Projection).is_err());
                assert!(validate(c, size, 100, 8, Snapping::Cosine).is_ok());
            }
            assert!(validate(c, 7, 100, 8, Snapping::Projection).is_ok());
        }
        let pca = Codebook::fit(Construction::Pca, &bank, 8, 0).unwrap();
        assert!(pca.snap(&x, Snapping::Projection).is_err());
        assert!(validate(Construction::Pca, 8, 100, 8, Snapping::Projection).is_err());
        assert!(Codebook::fit(Construction::Pca, &bank, 9, 0).is_err());
        for c in [
            Construction::Kmeans,
            Construction::Pca,
            Construction::RandomSubset,
        ] {
            assert!(Codebook::fit(c, &bank, 0, 0).is_err());
        }
        let msg = Codebook::fit(Construction::Kmeans, &bank, 101, 0)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("a codebook of 101 entries is larger than its bank of 100"),
            "{msg}"
        );
        let (x9, _) = normal(3, 9, 73);
        assert!(pca.snap(&x9, Snapping::L2).is_err());
    }

    /// Fit times on a bank of the default size: `cargo test -p
    /// tolerable-carrier --lib fit_timings -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn fit_timings() {
        let (bank, _) = normal(6000, 64, 81);
        for c in [
            Construction::Kmeans,
            Construction::Pca,
            Construction::RandomSubset,
        ] {
            let t = std::time::Instant::now();
            let cb = Codebook::fit(c, &bank, 32, 1).unwrap();
            let fit = t.elapsed();
            let (x, _) = normal(512, 64, 82);
            let t = std::time::Instant::now();
            for rule in [Snapping::L2, Snapping::Cosine, Snapping::Projection] {
                cb.snap(&x, rule).unwrap();
            }
            println!(
                "{}: fit {:.3} s, snap 512 keys by all three rules {:.3} s",
                c.name(),
                fit.as_secs_f64(),
                t.elapsed().as_secs_f64()
            );
        }
    }
}
