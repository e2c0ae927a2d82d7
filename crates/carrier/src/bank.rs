//! Key banks: nearest genuine vectors.
//!
//! A *key bank* is, for one layer and one kv head, a set of N *genuine* keys
//! — post-RoPE keys the receiver itself produced on training contexts —
//! stored as a `[N, d]` tensor (N = 6,000 by default, d = head_dim). The
//! on-manifold arms of PROTOCOL.md section 5 replace a true key by a genuine
//! one: its k-th nearest neighbour by cosine ([`top_k_cosine`]), or the
//! genuine key whose cosine to it is nearest a target
//! ([`at_target_cosine`]), the on-manifold counterpart of cosine-calibrated
//! noise. [`sample_rows`] draws a bank from a larger pool of genuine keys.
//!
//! Everything here is a pure function of `f32` tensors on the CPU, and
//! deterministic: ties go to the lower bank index, and sampling is seeded.

use crate::error::{CarrierError, Result};
use crate::rng::sample_indices;
use candle_core::{DType, Tensor};
use std::cmp::Ordering;

/// The nearest bank vectors of each query, nearest first.
///
/// Row `i` of `index` and of `cosine` belongs to query row `i`; entry `r` of
/// a row is the bank row of rank `r` (0 = nearest, so the protocol's "k-th
/// nearest neighbour", k = 1..16, is rank k − 1) and its cosine to the query.
/// Ranks are by decreasing cosine, ties broken by the lower bank index.
#[derive(Debug, Clone, PartialEq)]
pub struct Neighbours {
    /// Bank row indices, `n` rows of `k`.
    pub index: Vec<Vec<u32>>,
    /// Their cosines to the query, `n` rows of `k`, non-increasing along a row.
    pub cosine: Vec<Vec<f32>>,
}

impl Neighbours {
    /// Number of queries.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether there are no queries.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Neighbours kept per query.
    pub fn k(&self) -> usize {
        self.index.first().map_or(0, Vec::len)
    }

    /// The neighbour of rank `r` (0-based) of every query: bank indices
    /// (ready for [`gather_rows`]) and cosines. Panics if `r >= k`.
    pub fn rank(&self, r: usize) -> (Vec<u32>, Vec<f32>) {
        (
            self.index.iter().map(|row| row[r]).collect(),
            self.cosine.iter().map(|row| row[r]).collect(),
        )
    }
}

/// `(n, N, d)` of a query matrix and a bank, checked to be rank-2 `[n, d]`
/// and `[N, d]` with equal `d`.
fn check_pair(queries: &Tensor, bank: &Tensor, what: &str) -> Result<(usize, usize, usize)> {
    let shape = |t: &Tensor| -> Result<(usize, usize)> {
        t.dims2().map_err(|_| CarrierError::Shape {
            what: what.into(),
            reason: format!(
                "queries {:?} and bank {:?} must both be [rows, d]",
                queries.dims(),
                bank.dims()
            ),
        })
    };
    let (n, d) = shape(queries)?;
    let (big_n, bd) = shape(bank)?;
    if d != bd {
        return Err(CarrierError::Shape {
            what: what.into(),
            reason: format!("queries of dimension {d} against a bank of dimension {bd}"),
        });
    }
    Ok((n, big_n, d))
}

/// The rows of `x` (`[rows, d]`) scaled to unit norm, in `f32`; a row of zero
/// norm stays zero, so its cosine to everything is 0.
pub(crate) fn unit_rows(x: &Tensor) -> Result<Tensor> {
    let x = x.to_dtype(DType::F32)?;
    let norms: Vec<f32> = x.sqr()?.sum(1)?.sqrt()?.to_vec1()?;
    let inv: Vec<f32> = norms
        .iter()
        .map(|&n| if n > 0.0 { 1.0 / n } else { 0.0 })
        .collect();
    let inv = Tensor::from_vec(inv, (norms.len(), 1), x.device())?;
    Ok(x.broadcast_mul(&inv)?)
}

/// Cosine of every query row to every bank row, `[n, N]` in `f32`: one
/// matmul of the row-normalised matrices. A row of zero norm has cosine 0 to
/// everything.
pub fn cosine_matrix(queries: &Tensor, bank: &Tensor) -> Result<Tensor> {
    check_pair(queries, bank, "cosine to a key bank")?;
    let q = unit_rows(queries)?;
    let b = unit_rows(bank)?;
    Ok(q.matmul(&b.t()?)?)
}

/// Rows of the cosine matrix as vectors.
fn cosine_rows(queries: &Tensor, bank: &Tensor) -> Result<Vec<Vec<f32>>> {
    let (n, big_n, _) = check_pair(queries, bank, "cosine to a key bank")?;
    if n == 0 || big_n == 0 {
        return Ok(vec![Vec::new(); n]);
    }
    Ok(cosine_matrix(queries, bank)?.to_vec2()?)
}

/// Order of bank rows by decreasing cosine, ties to the lower index; a NaN
/// cosine ranks last.
fn by_cosine(row: &[f32]) -> impl Fn(&u32, &u32) -> Ordering + '_ {
    let key = |c: f32| if c.is_nan() { f32::NEG_INFINITY } else { c };
    move |&a, &b| {
        key(row[b as usize])
            .total_cmp(&key(row[a as usize]))
            .then(a.cmp(&b))
    }
}

/// For each query row (`queries` `[n, d]`), the `k` bank rows (`bank`
/// `[N, d]`, genuine keys) of highest cosine similarity, nearest first, ties
/// broken by the lower bank index.
///
/// Cosines come from one `f32` matmul of the row-normalised matrices; the
/// top-k selection is done per row on the CPU. A row of zero norm has cosine
/// 0 to everything. Errors if `k == 0`, `k > N`, or the dimensions differ.
pub fn top_k_cosine(queries: &Tensor, bank: &Tensor, k: usize) -> Result<Neighbours> {
    let (_, big_n, _) = check_pair(queries, bank, "nearest genuine keys")?;
    if k == 0 || k > big_n {
        return Err(CarrierError::BadBank(format!(
            "k = {k} nearest neighbours asked of a bank of {big_n}; k must be in 1..={big_n}"
        )));
    }
    let rows = cosine_rows(queries, bank)?;
    let mut index = Vec::with_capacity(rows.len());
    let mut cosine = Vec::with_capacity(rows.len());
    for row in &rows {
        let cmp = by_cosine(row);
        let mut idx: Vec<u32> = (0..big_n as u32).collect();
        if k < big_n {
            idx.select_nth_unstable_by(k - 1, &cmp);
            idx.truncate(k);
        }
        idx.sort_unstable_by(&cmp);
        cosine.push(idx.iter().map(|&j| row[j as usize]).collect());
        index.push(idx);
    }
    Ok(Neighbours { index, cosine })
}

/// The bank rows at `index` (`[index.len(), d]`), e.g. the substitutes a
/// [`Neighbours::rank`] chose. Errors on an index outside the bank.
pub fn gather_rows(bank: &Tensor, index: &[u32]) -> Result<Tensor> {
    let (big_n, _) = bank.dims2().map_err(|_| CarrierError::Shape {
        what: "key bank".into(),
        reason: format!("a bank is [N, d], not {:?}", bank.dims()),
    })?;
    if let Some(&bad) = index.iter().find(|&&i| i as usize >= big_n) {
        return Err(CarrierError::BadBank(format!(
            "row {bad} asked of a bank of {big_n}"
        )));
    }
    let idx = Tensor::from_vec(index.to_vec(), index.len(), bank.device())?;
    Ok(bank.contiguous()?.index_select(&idx, 0)?)
}

/// For each query row, the bank row whose cosine to the query is nearest
/// `target` (|cos − target| minimal, ties to the lower index): a genuine key
/// at a matched cosine, the on-manifold counterpart of cosine-calibrated
/// noise. Returns the bank indices and the cosines they achieve (which may
/// be far from `target` if the bank has nothing near it).
///
/// `target` must lie in (−1, 1]; an empty bank is an error.
pub fn at_target_cosine(
    queries: &Tensor,
    bank: &Tensor,
    target: f64,
) -> Result<(Vec<u32>, Vec<f32>)> {
    let (_, big_n, _) = check_pair(queries, bank, "genuine keys at a target cosine")?;
    if !(target > -1.0 && target <= 1.0) {
        return Err(CarrierError::BadBank(format!(
            "target cosine {target} is not in (-1, 1]"
        )));
    }
    if big_n == 0 {
        return Err(CarrierError::BadBank("the bank is empty".into()));
    }
    let rows = cosine_rows(queries, bank)?;
    let mut index = Vec::with_capacity(rows.len());
    let mut cosine = Vec::with_capacity(rows.len());
    for row in &rows {
        let mut best = 0usize;
        let mut best_gap = f64::INFINITY;
        for (j, &c) in row.iter().enumerate() {
            let gap = (c as f64 - target).abs();
            // Strictly better only, so ties keep the lower index; NaN never wins.
            if gap < best_gap {
                best = j;
                best_gap = gap;
            }
        }
        index.push(best as u32);
        cosine.push(row[best]);
    }
    Ok((index, cosine))
}

/// `n` distinct rows of `pool` (`[M, d]`), chosen uniformly without
/// replacement with a generator seeded by `seed`, kept in increasing row
/// order: a bank of `n` genuine keys drawn from all the keys collected.
/// Errors if `n > M`.
pub fn sample_rows(pool: &Tensor, n: usize, seed: u64) -> Result<Tensor> {
    let (m, _) = pool.dims2().map_err(|_| CarrierError::Shape {
        what: "pool of genuine keys".into(),
        reason: format!("a pool is [M, d], not {:?}", pool.dims()),
    })?;
    if n > m {
        return Err(CarrierError::BadBank(format!(
            "a bank of {n} is larger than the {m} vectors available"
        )));
    }
    let index: Vec<u32> = sample_indices(m, n, seed)
        .into_iter()
        .map(|i| i as u32)
        .collect();
    gather_rows(pool, &index)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::rng::Gaussian;
    use candle_core::Device;

    /// A `[rows, cols]` tensor of seeded standard normals, and its data.
    pub(crate) fn normal(rows: usize, cols: usize, seed: u64) -> (Tensor, Vec<Vec<f32>>) {
        let mut g = Gaussian::new(seed);
        let data: Vec<Vec<f32>> = (0..rows)
            .map(|_| (0..cols).map(|_| g.next() as f32).collect())
            .collect();
        let t = Tensor::from_vec(data.concat(), (rows, cols), &Device::Cpu).unwrap();
        (t, data)
    }

    pub(crate) fn cos64(a: &[f32], b: &[f32]) -> f64 {
        let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
        let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        if na == 0.0 || nb == 0.0 {
            0.0
        } else {
            dot / (na * nb)
        }
    }

    #[test]
    fn top_k_matches_brute_force() {
        let (bank, b) = normal(200, 16, 1);
        let (queries, q) = normal(12, 16, 2);
        let k = 7;
        let got = top_k_cosine(&queries, &bank, k).unwrap();
        assert_eq!((got.len(), got.k()), (12, k));
        for (i, qi) in q.iter().enumerate() {
            let mut reference: Vec<(f64, u32)> = b
                .iter()
                .enumerate()
                .map(|(j, bj)| (cos64(qi, bj), j as u32))
                .collect();
            reference.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
            let want: Vec<u32> = reference[..k].iter().map(|r| r.1).collect();
            assert_eq!(got.index[i], want, "query {i}");
            for (r, &(c, _)) in reference[..k].iter().enumerate() {
                assert!((got.cosine[i][r] as f64 - c).abs() < 1e-5);
            }
            assert!(got.cosine[i].windows(2).all(|w| w[0] >= w[1]));
        }
        let (idx, cos) = got.rank(2);
        assert_eq!(idx[5], got.index[5][2]);
        assert_eq!(cos[5], got.cosine[5][2]);
        // k = N keeps everything, in order.
        let all = top_k_cosine(&queries, &bank, 200).unwrap();
        assert_eq!(&all.index[0][..k], &got.index[0][..]);
    }

    #[test]
    fn a_query_in_the_bank_finds_itself_first() {
        let (bank, b) = normal(200, 16, 3);
        let queries = Tensor::from_vec(b[37].clone(), (1, 16), &Device::Cpu).unwrap();
        let got = top_k_cosine(&queries, &bank, 3).unwrap();
        assert_eq!(got.index[0][0], 37);
        assert!((got.cosine[0][0] - 1.0).abs() < 1e-6);
    }

    #[test]
    fn ties_go_to_the_lower_index_and_zero_rows_have_cosine_zero() {
        // Rows 1, 3 and 4 all normalise to e0 exactly; row 2 is zero.
        #[rustfmt::skip]
        let bank = Tensor::from_vec(
            vec![0f32, 1., 0.,  2., 0., 0.,  0., 0., 0.,  1., 0., 0.,  4., 0., 0.,  -1., 0., 0.],
            (6, 3),
            &Device::Cpu,
        )
        .unwrap();
        let q = Tensor::from_vec(vec![3f32, 0., 0., 0., 0., 0.], (2, 3), &Device::Cpu).unwrap();
        let got = top_k_cosine(&q, &bank, 6).unwrap();
        assert_eq!(got.index[0], vec![1, 3, 4, 0, 2, 5]);
        assert_eq!(got.cosine[0], vec![1., 1., 1., 0., 0., -1.]);
        // The zero query has cosine 0 to all: pure index order.
        assert_eq!(got.index[1], vec![0, 1, 2, 3, 4, 5]);
        assert!(got.cosine[1].iter().all(|&c| c == 0.0));
        let (idx, cos) = at_target_cosine(&q, &bank, 0.9).unwrap();
        assert_eq!((idx[0], cos[0]), (1, 1.0));
        assert_eq!((idx[1], cos[1]), (0, 0.0));
    }

    #[test]
    fn bad_k_and_mismatched_dimensions_are_errors() {
        let (bank, _) = normal(10, 4, 1);
        let (q, _) = normal(2, 4, 2);
        let (q5, _) = normal(2, 5, 2);
        let msg = top_k_cosine(&q, &bank, 11).unwrap_err().to_string();
        assert!(msg.contains("bank of 10"), "{msg}");
        assert!(top_k_cosine(&q, &bank, 0).is_err());
        assert!(top_k_cosine(&q, &bank, 10).is_ok());
        assert!(top_k_cosine(&q5, &bank, 1).is_err());
        assert!(at_target_cosine(&q5, &bank, 0.5).is_err());
        assert!(at_target_cosine(&q, &bank, -1.0).is_err());
        assert!(at_target_cosine(&q, &bank, 1.01).is_err());
        assert!(at_target_cosine(&q, &bank, f64::NAN).is_err());
        assert!(gather_rows(&bank, &[3, 10]).is_err());
    }

    #[test]
    fn at_target_cosine_picks_the_nearest_cosine() {
        let (bank, b) = normal(300, 8, 5);
        let (queries, q) = normal(20, 8, 6);
        for target in [1.0, 0.9, 0.5, 0.0, -0.3] {
            let (idx, cos) = at_target_cosine(&queries, &bank, target).unwrap();
            for (i, qi) in q.iter().enumerate() {
                let gaps: Vec<f64> = b.iter().map(|bj| (cos64(qi, bj) - target).abs()).collect();
                let best = gaps.iter().cloned().fold(f64::INFINITY, f64::min);
                let j = idx[i] as usize;
                assert!(
                    gaps[j] - best < 1e-6,
                    "{target} query {i}: {} vs {best}",
                    gaps[j]
                );
                assert!((cos[i] as f64 - cos64(qi, &b[j])).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn gather_rows_returns_the_rows() {
        let (bank, b) = normal(10, 4, 9);
        let got: Vec<Vec<f32>> = gather_rows(&bank, &[7, 2, 7]).unwrap().to_vec2().unwrap();
        assert_eq!(got, vec![b[7].clone(), b[2].clone(), b[7].clone()]);
    }

    #[test]
    fn sample_rows_is_distinct_sorted_and_seeded() {
        // Row i of the pool is (i, i): the chosen row numbers can be read back.
        let pool: Vec<f32> = (0..500).flat_map(|i| [i as f32, i as f32]).collect();
        let pool = Tensor::from_vec(pool, (500, 2), &Device::Cpu).unwrap();
        let rows = |n, seed| -> Vec<usize> {
            let t = sample_rows(&pool, n, seed).unwrap();
            let v: Vec<Vec<f32>> = t.to_vec2().unwrap();
            v.iter()
                .map(|r| {
                    assert_eq!(r[0], r[1]);
                    r[0] as usize
                })
                .collect()
        };
        let a = rows(60, 11);
        assert_eq!(a.len(), 60);
        assert!(a.windows(2).all(|w| w[0] < w[1]), "{a:?}");
        assert_eq!(a, rows(60, 11));
        assert_ne!(a, rows(60, 12));
        assert_eq!(rows(500, 3), (0..500).collect::<Vec<_>>());
        let msg = sample_rows(&pool, 501, 1).unwrap_err().to_string();
        assert!(
            msg.contains("a bank of 501 is larger than the 500 vectors available"),
            "{msg}"
        );
    }
}
