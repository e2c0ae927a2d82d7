//! Fidelity of a substituted carrier to the native one: mean cosine of key
//! (or value, or residual) vectors over layers, heads and sites, and the
//! attention-logit correlation of substituted against true keys.

use crate::error::{CarrierError, Result};
use candle_core::{DType, Tensor, D};

/// Mean over vectors of cos(a_i, b_i), where vectors run along the last
/// axis of two equal-shape tensors, restricted to `positions` on
/// `position_axis` (`None` = all). Vectors of zero norm count as cosine 1
/// when both are zero, 0 otherwise.
pub fn mean_vector_cosine(
    a: &Tensor,
    b: &Tensor,
    position_axis: usize,
    positions: Option<&[usize]>,
) -> Result<f64> {
    let (a, b) = match positions {
        Some(p) => {
            let idx = Tensor::from_vec(
                p.iter().map(|&x| x as u32).collect::<Vec<_>>(),
                p.len(),
                a.device(),
            )?;
            (
                a.contiguous()?.index_select(&idx, position_axis)?,
                b.contiguous()?.index_select(&idx, position_axis)?,
            )
        }
        None => (a.clone(), b.clone()),
    };
    if a.elem_count() == 0 {
        return Ok(1.0);
    }
    let a = a.to_dtype(DType::F64)?;
    let b = b.to_dtype(DType::F64)?;
    let dot: Vec<f64> = (&a * &b)?.sum(D::Minus1)?.flatten_all()?.to_vec1()?;
    let na: Vec<f64> = a.sqr()?.sum(D::Minus1)?.flatten_all()?.to_vec1()?;
    let nb: Vec<f64> = b.sqr()?.sum(D::Minus1)?.flatten_all()?.to_vec1()?;
    let n = dot.len();
    let total: f64 = (0..n)
        .map(|i| {
            let d = (na[i] * nb[i]).sqrt();
            if d > 0.0 {
                dot[i] / d
            } else if na[i] == nb[i] {
                1.0
            } else {
                0.0
            }
        })
        .sum();
    Ok(total / n as f64)
}

/// Attention-logit correlation: how well substituted keys preserve the
/// logits the receiver's queries compute against the true keys.
///
/// `queries` is `[b, n_heads, q, hd]` (the question tokens' post-RoPE
/// queries), `true_keys` and `sub_keys` are `[b, n_kv_heads, T, hd]`, and
/// `sites` are the key positions (< T) that were substituted. Grouped-query
/// attention: query head h reads kv head h / (n_heads / n_kv_heads). For
/// each kv head, the logits q·k of every query of its G query heads (and
/// every batch row) against the keys at `sites` are computed with the true
/// and with the substituted keys; the Pearson correlation of the two sets,
/// pooled over all (query, site) pairs of that kv head, is taken, and the
/// mean over kv heads returned (over `heads` only, when given: the heads an
/// arm substituted). The 1/√hd scale does not change it.
///
/// Conventions: a kv head whose two logit sets are both constant counts 1.0
/// if they are identical and 0.0 otherwise, and so does one where only one
/// set is constant (0.0, since they then differ); no sites or no queries
/// gives 1.0. Computed in `f64`.
pub fn logit_correlation(
    queries: &Tensor,
    true_keys: &Tensor,
    sub_keys: &Tensor,
    sites: &[usize],
    heads: Option<&[usize]>,
) -> Result<f64> {
    let shape_err = |reason: String| CarrierError::Shape {
        what: "attention-logit correlation".into(),
        reason,
    };
    let (b, n_heads, n_q, hd) = queries.dims4().map_err(|_| {
        shape_err(format!(
            "queries {:?} are not [b, heads, q, hd]",
            queries.dims()
        ))
    })?;
    let (kb, n_kv, t, khd) = true_keys.dims4().map_err(|_| {
        shape_err(format!(
            "keys {:?} are not [b, kv_heads, T, hd]",
            true_keys.dims()
        ))
    })?;
    if sub_keys.dims() != true_keys.dims() {
        return Err(shape_err(format!(
            "substituted keys {:?} against true keys {:?}",
            sub_keys.dims(),
            true_keys.dims()
        )));
    }
    if kb != b || khd != hd || n_kv == 0 || n_heads % n_kv != 0 {
        return Err(shape_err(format!(
            "queries {:?} against keys {:?}: batch and head_dim must agree and the \
             query heads be a multiple of the kv heads",
            queries.dims(),
            true_keys.dims()
        )));
    }
    if let Some(&bad) = sites.iter().find(|&&s| s >= t) {
        return Err(CarrierError::BadSites {
            field: "sites".into(),
            reason: format!("site {bad} outside the {t} cached positions"),
        });
    }
    if sites.is_empty() || n_q == 0 || b == 0 {
        return Ok(1.0);
    }
    let group = n_heads / n_kv;
    let idx = Tensor::from_vec(
        sites.iter().map(|&s| s as u32).collect::<Vec<_>>(),
        sites.len(),
        true_keys.device(),
    )?;
    // Query heads are laid out kv head by kv head: [b, kv, G·q, hd].
    let q = queries
        .to_dtype(DType::F64)?
        .reshape((b, n_kv, group * n_q, hd))?;
    let logits = |keys: &Tensor| -> Result<Vec<f64>> {
        let k = keys
            .contiguous()?
            .index_select(&idx, 2)?
            .to_dtype(DType::F64)?;
        // [b, kv, G·q, S] → [kv, b·G·q·S]
        let l = q.matmul(&k.t()?.contiguous()?)?;
        Ok(l.transpose(0, 1)?.flatten_all()?.to_vec1()?)
    };
    let a = logits(true_keys)?;
    let s = logits(sub_keys)?;
    let per_head = a.len() / n_kv;
    let chosen: Vec<f64> = a
        .chunks(per_head)
        .zip(s.chunks(per_head))
        .enumerate()
        .filter(|(h, _)| heads.is_none_or(|hs| hs.contains(h)))
        .map(|(_, (x, y))| pearson(x, y))
        .collect();
    if chosen.is_empty() {
        return Ok(1.0);
    }
    Ok(chosen.iter().sum::<f64>() / chosen.len() as f64)
}

/// Pearson correlation (the cosine of the centred vectors); 1.0 when a set
/// is constant and the two are identical, 0.0 when one is constant and they
/// differ.
fn pearson(x: &[f64], y: &[f64]) -> f64 {
    let n = x.len() as f64;
    let mx = x.iter().sum::<f64>() / n;
    let my = y.iter().sum::<f64>() / n;
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for (a, b) in x.iter().zip(y) {
        let (da, db) = (a - mx, b - my);
        sxy += da * db;
        sxx += da * da;
        syy += db * db;
    }
    if sxx > 0.0 && syy > 0.0 {
        (sxy / (sxx * syy).sqrt()).clamp(-1.0, 1.0)
    } else if x == y {
        1.0
    } else {
        0.0
    }
}

/// The kv `heads` (axis 1) of a `[b, heads, T, hd]` tensor.
pub fn select_heads(t: &Tensor, heads: &[usize]) -> Result<Tensor> {
    let idx = Tensor::from_vec(
        heads.iter().map(|&h| h as u32).collect::<Vec<_>>(),
        heads.len(),
        t.device(),
    )?;
    Ok(t.contiguous()?.index_select(&idx, 1)?)
}

/// Per-vector cosine of two equal-length vectors, in `f64`, with the
/// convention of [`mean_vector_cosine`]: zero vectors count 1 when both are
/// zero, 0 otherwise.
pub fn vector_cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut d, mut na, mut nb) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        d += *x as f64 * *y as f64;
        na += (*x as f64).powi(2);
        nb += (*y as f64).powi(2);
    }
    if na > 0.0 && nb > 0.0 {
        d / (na.sqrt() * nb.sqrt())
    } else if na == nb {
        1.0
    } else {
        0.0
    }
}

/// Cosine of `a` to `b` flattened over the `sites` along `axis` (as
/// cosine-calibrated noise calibrates it): one cosine of the whole selected
/// block, not a mean over vectors. No sites: 1. A zero block against a
/// non-zero one (destroyed sites) has cosine 0, two zero blocks 1, as in
/// [`mean_vector_cosine`].
pub fn site_cosine(a: &Tensor, b: &Tensor, axis: usize, sites: &[usize]) -> Result<f64> {
    if sites.is_empty() {
        return Ok(1.0);
    }
    let idx = Tensor::from_vec(
        sites.iter().map(|&s| s as u32).collect::<Vec<_>>(),
        sites.len(),
        a.device(),
    )?;
    let a = a
        .contiguous()?
        .index_select(&idx, axis)?
        .flatten_all()?
        .to_dtype(DType::F64)?;
    let b = b
        .contiguous()?
        .index_select(&idx, axis)?
        .flatten_all()?
        .to_dtype(DType::F64)?;
    let dot = (&a * &b)?.sum(D::Minus1)?.to_scalar::<f64>()?;
    let na = a.sqr()?.sum(D::Minus1)?.to_scalar::<f64>()?.sqrt();
    let nb = b.sqr()?.sum(D::Minus1)?.to_scalar::<f64>()?.sqrt();
    Ok(if na * nb > 0.0 {
        dot / (na * nb)
    } else if na == nb {
        1.0
    } else {
        0.0
    })
}

/// Fidelity of a cache's carrier to the native cache: the mean per-vector
/// cosine of its keys (and/or values) over `layers`, the kv `heads` (every
/// head when `None`) and `sites` (every entry when `None`), the keys' and
/// the values' means averaged.
pub fn kv_fidelity(
    cache: &tolerable_runtime::KvCache,
    native: &tolerable_runtime::KvCache,
    carrier: crate::sites::Carrier,
    layers: &[usize],
    sites: Option<&[usize]>,
    heads: Option<&[usize]>,
) -> Result<f64> {
    let mut acc = Vec::new();
    let pick = |t: &Tensor| -> Result<Tensor> {
        Ok(match heads {
            Some(h) => select_heads(t, h)?,
            None => t.clone(),
        })
    };
    for &l in layers {
        let (a, b) = (cache.require_layer(l)?, native.require_layer(l)?);
        if carrier.has_k() {
            acc.push(mean_vector_cosine(&pick(&a.k)?, &pick(&b.k)?, 2, sites)?);
        }
        if carrier.has_v() {
            acc.push(mean_vector_cosine(&pick(&a.v)?, &pick(&b.v)?, 2, sites)?);
        }
    }
    Ok(acc.iter().sum::<f64>() / acc.len().max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn cosine_of_a_tensor_with_itself_is_one_and_opposite_is_minus_one() {
        let a = Tensor::from_vec(
            (1..=24).map(|x| x as f32).collect::<Vec<_>>(),
            (1, 2, 3, 4),
            &Device::Cpu,
        )
        .unwrap();
        assert!((mean_vector_cosine(&a, &a, 2, None).unwrap() - 1.0).abs() < 1e-12);
        let neg = a.neg().unwrap();
        assert!((mean_vector_cosine(&a, &neg, 2, Some(&[0, 2])).unwrap() + 1.0).abs() < 1e-12);
        // Strided views (a cache layer with spare capacity) measure the same.
        let view = a.narrow(2, 0, 2).unwrap();
        let copy = view.contiguous().unwrap();
        assert!(!view.is_contiguous());
        for sites in [None, Some(&[1usize][..])] {
            assert_eq!(
                mean_vector_cosine(&view, &neg.narrow(2, 0, 2).unwrap(), 2, sites).unwrap(),
                mean_vector_cosine(
                    &copy,
                    &neg.narrow(2, 0, 2).unwrap().contiguous().unwrap(),
                    2,
                    sites
                )
                .unwrap()
            );
        }
        assert_eq!(
            site_cosine(&view, &copy, 2, &[0, 1]).unwrap(),
            site_cosine(&copy, &copy, 2, &[0, 1]).unwrap()
        );
        // Destroyed (zeroed) sites keep nothing of the original: cosine 0;
        // two zero blocks are the same block: 1.
        let zero = a.zeros_like().unwrap();
        assert_eq!(site_cosine(&zero, &a, 2, &[0, 1]).unwrap(), 0.0);
        assert_eq!(site_cosine(&a, &zero, 2, &[1]).unwrap(), 0.0);
        assert_eq!(site_cosine(&zero, &zero, 2, &[0]).unwrap(), 1.0);
    }

    /// `[shape]` tensor of f32 values from a deterministic pattern.
    fn pattern(shape: &[usize], mul: usize, add: usize) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| ((i * mul + add) % 17) as f32 - 8.0)
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    #[test]
    fn logit_correlation_of_identical_and_negated_keys() {
        let q = pattern(&[1, 4, 3, 8], 5, 1);
        let k = pattern(&[1, 2, 6, 8], 7, 3);
        let sites = [1, 2, 4];
        assert!((logit_correlation(&q, &k, &k, &sites, None).unwrap() - 1.0).abs() < 1e-12);
        // Negate the keys at the sites only: every logit there flips sign.
        let mask = Tensor::from_vec(
            vec![1f32, -1., -1., 1., -1., 1.],
            (1, 1, 6, 1),
            &Device::Cpu,
        )
        .unwrap();
        let neg = k.broadcast_mul(&mask).unwrap();
        assert!((logit_correlation(&q, &k, &neg, &sites, None).unwrap() + 1.0).abs() < 1e-12);
        // Outside the sites changes nothing.
        assert!((logit_correlation(&q, &k, &neg, &[0, 3], None).unwrap() - 1.0).abs() < 1e-12);
        assert_eq!(logit_correlation(&q, &k, &neg, &[], None).unwrap(), 1.0);
        assert!(logit_correlation(&q, &k, &neg, &[6], None).is_err());
        let q3 = pattern(&[1, 3, 3, 8], 5, 1);
        assert!(logit_correlation(&q3, &k, &k, &sites, None).is_err());
    }

    #[test]
    fn logit_correlation_matches_a_hand_computation_with_two_query_heads_per_kv_head() {
        // 2 query heads, 1 kv head, hd = 2, one query each, two sites.
        let q = Tensor::from_vec(vec![1f32, 0., 0., 1.], (1, 2, 1, 2), &Device::Cpu).unwrap();
        let k = Tensor::from_vec(vec![1f32, 2., 3., 5.], (1, 1, 2, 2), &Device::Cpu).unwrap();
        let s = Tensor::from_vec(vec![1f32, 1., 2., 3.], (1, 1, 2, 2), &Device::Cpu).unwrap();
        // True logits: head 0 reads x: (1, 3); head 1 reads y: (2, 5).
        // Substituted: head 0 (1, 2); head 1 (1, 3).
        let x = [1.0, 3.0, 2.0, 5.0];
        let y = [1.0, 2.0, 1.0, 3.0];
        let want = pearson(&x, &y);
        // By hand: means 2.75 and 1.75; centred x (-1.75, .25, -.75, 2.25),
        // y (-.75, .25, -.75, 1.25): sxy 4.75, sxx 8.75, syy 2.75.
        assert!((want - 4.75 / (8.75f64 * 2.75).sqrt()).abs() < 1e-12);
        let got = logit_correlation(&q, &k, &s, &[0, 1], None).unwrap();
        assert!((got - want).abs() < 1e-12, "{got} against {want}");
        // Constant logit sets: identical → 1, different → 0.
        let zq = q.zeros_like().unwrap();
        assert_eq!(logit_correlation(&zq, &k, &s, &[0, 1], None).unwrap(), 1.0);
        assert_eq!(pearson(&[2.0, 2.0], &[1.0, 3.0]), 0.0);
    }

    #[test]
    fn logit_correlation_averages_over_kv_heads() {
        // kv head 0 substituted by its negation, kv head 1 unchanged: mean 0.
        let q = pattern(&[1, 4, 2, 4], 3, 2);
        let k = pattern(&[1, 2, 5, 4], 11, 5);
        let mask = Tensor::from_vec(vec![-1f32, 1.], (1, 2, 1, 1), &Device::Cpu).unwrap();
        let s = k.broadcast_mul(&mask).unwrap();
        let got = logit_correlation(&q, &k, &s, &[0, 1, 2, 3, 4], None).unwrap();
        assert!(got.abs() < 1e-12, "{got}");
        // Over the substituted head only: -1; over the untouched one: 1.
        let h0 = logit_correlation(&q, &k, &s, &[0, 1, 2, 3, 4], Some(&[0])).unwrap();
        let h1 = logit_correlation(&q, &k, &s, &[0, 1, 2, 3, 4], Some(&[1])).unwrap();
        assert!(
            (h0 + 1.0).abs() < 1e-12 && (h1 - 1.0).abs() < 1e-12,
            "{h0} {h1}"
        );
    }
}
