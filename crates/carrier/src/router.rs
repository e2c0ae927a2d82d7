//! A per-token router over a pool of holders (PROTOCOL §7, the trained
//! router on the activation carrier): at every position t, the weight of
//! holder i is a softmax over the pool of the score
//! `(n(own_t) W_q) . (n(h_i,t) W_k) / sqrt(rank)`, where `own_t` is the
//! receiver's own residual stream at t, `h_i,t` the holder's, and `n`
//! divides a vector by its root mean square (so scores do not scale with
//! the residual norm of the layer). The routed value is `sum_i w_i,t h_i,t`.
//!
//! With `W_q = 0` every score is zero and every weight `1 / n`: the uniform
//! router, which is where training starts (the zero-init gate). Everything
//! here is tensor operations, so gradients reach `W_q` and `W_k`.

use crate::error::{CarrierError, Result};
use candle_core::{Tensor, D};

/// The router of one layer: query and key maps of the scoring, `[d_model, rank]` each.
#[derive(Debug, Clone)]
pub struct RouterLayer {
    /// The layer whose residual stream it routes.
    pub layer: usize,
    /// Maps the receiver's own (normalised) state to a query of width rank.
    pub wq: Tensor,
    /// Maps each holder's (normalised) state to a key of width rank.
    pub wk: Tensor,
}

fn rms_normalised(x: &Tensor) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(x.broadcast_div(&(ms + 1e-6)?.sqrt()?)?)
}

impl RouterLayer {
    /// The weights of the pool's holders at every position, `[1, T, n]`:
    /// `own` is the receiver's state `[1, T, d]`, `members` the holders'
    /// states at the same positions (each `[1, T, d]`).
    pub fn weights(&self, own: &Tensor, members: &[Tensor]) -> Result<Tensor> {
        let (d, rank) = self.wq.dims2()?;
        if members.is_empty() {
            return Err(CarrierError::Shape {
                what: format!("router of layer {}", self.layer),
                reason: "an empty pool".into(),
            });
        }
        for m in std::iter::once(own).chain(members) {
            if m.dims().len() != 3 || m.dim(2)? != d || m.dims() != own.dims() {
                return Err(CarrierError::Shape {
                    what: format!("router of layer {}", self.layer),
                    reason: format!(
                        "states {:?} against the receiver's {:?} and a router of width {d}",
                        m.dims(),
                        own.dims()
                    ),
                });
            }
        }
        let q = rms_normalised(own)?.broadcast_matmul(&self.wq)?;
        let mut scores = Vec::with_capacity(members.len());
        for m in members {
            let k = rms_normalised(m)?.broadcast_matmul(&self.wk)?;
            scores.push((q.mul(&k)?.sum_keepdim(D::Minus1)? / (rank as f64).sqrt())?);
        }
        let scores = Tensor::cat(&scores, 2)?;
        Ok(candle_nn::ops::softmax(&scores, D::Minus1)?)
    }

    /// The routed state `sum_i w_i,t h_i,t`, `[1, T, d]`.
    pub fn route(&self, own: &Tensor, members: &[Tensor]) -> Result<Tensor> {
        let w = self.weights(own, members)?;
        let mut acc: Option<Tensor> = None;
        for (i, m) in members.iter().enumerate() {
            let t = m.broadcast_mul(&w.narrow(2, i, 1)?)?;
            acc = Some(match acc {
                None => t,
                Some(a) => (a + t)?,
            });
        }
        acc.ok_or_else(|| CarrierError::Shape {
            what: format!("router of layer {}", self.layer),
            reason: "an empty pool".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn randn(shape: &[usize], seed: u64) -> Tensor {
        let n: usize = shape.iter().product();
        Tensor::from_vec(crate::uniform_symmetric(n, 1.0, seed), shape, &Device::Cpu).unwrap()
    }

    #[test]
    fn zero_queries_route_uniformly_and_gradients_reach_both_maps() {
        let (t, d, r) = (5, 8, 3);
        let own = randn(&[1, t, d], 1);
        let members: Vec<Tensor> = (0..3)
            .map(|i| (randn(&[1, t, d], 10 + i) * 4.0).unwrap())
            .collect();
        let wq = Var::from_tensor(
            &Tensor::zeros((d, r), candle_core::DType::F32, &Device::Cpu).unwrap(),
        )
        .unwrap();
        let wk = Var::from_tensor(&randn(&[d, r], 7)).unwrap();
        let router = RouterLayer {
            layer: 2,
            wq: wq.as_tensor().clone(),
            wk: wk.as_tensor().clone(),
        };
        let w = router
            .weights(&own, &members)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert!(w.iter().all(|&x| (x - 1.0 / 3.0).abs() < 1e-7), "{w:?}");
        let routed = router.route(&own, &members).unwrap();
        let mean = ((&members[0] + &members[1]).unwrap() + &members[2]).unwrap() / 3.0;
        let diff = (routed - mean.unwrap())
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(diff < 1e-5, "{diff}");
        // A loss that prefers holder 0 moves W_q (W_k's gradient is zero
        // while every query is zero).
        let loss = router
            .route(&own, &members)
            .unwrap()
            .mul(&members[0])
            .unwrap()
            .sum_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        let gq = grads
            .get(wq.as_tensor())
            .unwrap()
            .abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(gq > 0.0);
        // Bad shapes are named.
        let e = router
            .weights(&own, &[randn(&[1, t + 1, d], 3)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("router of layer 2"), "{e}");
        assert!(router.weights(&own, &[]).is_err());
    }

    #[test]
    fn a_router_that_scores_one_holder_high_gives_it_the_weight() {
        let (t, d) = (4, 6);
        let own = Tensor::ones((1, t, d), candle_core::DType::F32, &Device::Cpu).unwrap();
        let members = vec![(own.clone() * -1.0).unwrap(), own.clone()];
        // q = n(own) . 1 (rank 1), k = n(h) . 1: the holder aligned with own scores high.
        let ones = Tensor::ones((d, 1), candle_core::DType::F32, &Device::Cpu).unwrap();
        let router = RouterLayer {
            layer: 0,
            wq: (ones.clone() * 3.0).unwrap(),
            wk: ones,
        };
        let w = router
            .weights(&own, &members)
            .unwrap()
            .to_vec3::<f32>()
            .unwrap();
        for row in &w[0] {
            assert!(row[1] > 0.999 && row[0] < 1e-3, "{row:?}");
        }
    }
}
