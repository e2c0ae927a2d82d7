//! AdamW whose state can be read and restored, so that a bridge's training
//! resumes from its last finished epoch.
//!
//! The update is candle_nn's `AdamW` operation for operation (the same
//! tensor expressions in the same order), so a training run gives the same
//! bits with either; `candle_nn::AdamW` keeps its moments and step count
//! private, which is why this copy exists. The test below holds the two
//! equal bit for bit.

use crate::error::Result;
use candle_core::{Tensor, Var};

/// AdamW over a fixed list of parameters: first and second moment per
/// parameter and the number of steps taken.
pub struct AdamW {
    vars: Vec<Var>,
    first: Vec<Var>,
    second: Vec<Var>,
    step_t: usize,
    params: candle_nn::ParamsAdamW,
}

/// What an optimizer has accumulated: each parameter's first and second
/// moments (in parameter order) and the steps taken.
pub struct AdamState {
    /// First moments, one per parameter.
    pub first: Vec<Tensor>,
    /// Second moments, one per parameter.
    pub second: Vec<Tensor>,
    /// Steps taken (the bias corrections depend on it).
    pub step_t: usize,
}

impl AdamW {
    /// A fresh optimizer (zero moments, no step taken) over `vars`.
    pub fn new(vars: Vec<Var>, params: candle_nn::ParamsAdamW) -> Result<Self> {
        let zeros = |v: &Var| Var::zeros(v.shape(), v.dtype(), v.device());
        let first = vars.iter().map(zeros).collect::<candle_core::Result<_>>()?;
        let second = vars.iter().map(zeros).collect::<candle_core::Result<_>>()?;
        Ok(Self {
            vars,
            first,
            second,
            step_t: 0,
            params,
        })
    }

    /// One step down the gradient of `loss`.
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        let grads = loss.backward()?;
        self.step_t += 1;
        let p = &self.params;
        let (lr, beta1, beta2) = (p.lr, p.beta1, p.beta2);
        let lr_lambda = lr * p.weight_decay;
        let scale_m = 1f64 / (1f64 - beta1.powi(self.step_t as i32));
        let scale_v = 1f64 / (1f64 - beta2.powi(self.step_t as i32));
        for ((theta, m), v) in self.vars.iter().zip(&self.first).zip(&self.second) {
            if let Some(g) = grads.get(theta) {
                let next_m = ((m.as_tensor() * beta1)? + (g * (1.0 - beta1))?)?;
                let next_v = ((v.as_tensor() * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
                let m_hat = (&next_m * scale_m)?;
                let v_hat = (&next_v * scale_v)?;
                let next_theta = (theta.as_tensor() * (1f64 - lr_lambda))?;
                let adjusted_grad = (m_hat / (v_hat.sqrt()? + p.eps)?)?;
                let next_theta = (next_theta - (adjusted_grad * lr)?)?;
                m.set(&next_m)?;
                v.set(&next_v)?;
                theta.set(&next_theta)?;
            }
        }
        Ok(())
    }

    /// A copy of the accumulated state.
    pub fn state(&self) -> Result<AdamState> {
        let copy = |vs: &[Var]| -> Result<Vec<Tensor>> {
            vs.iter()
                .map(|v| Ok(v.as_tensor().detach().copy()?))
                .collect()
        };
        Ok(AdamState {
            first: copy(&self.first)?,
            second: copy(&self.second)?,
            step_t: self.step_t,
        })
    }

    /// Continues from `state` (as [`AdamW::state`] gave it for the same
    /// parameters); a moment of another shape is refused.
    pub fn restore(&mut self, state: &AdamState) -> Result<()> {
        if state.first.len() != self.vars.len() || state.second.len() != self.vars.len() {
            return Err(crate::error::DriverError::Records(format!(
                "optimizer state for {} and {} moments, the optimizer has {} parameters",
                state.first.len(),
                state.second.len(),
                self.vars.len()
            )));
        }
        // Every shape is checked before anything is set.
        let pairs = || {
            [(&self.first, &state.first), (&self.second, &state.second)]
                .into_iter()
                .flat_map(|(vars, saved)| vars.iter().zip(saved))
        };
        for (var, t) in pairs() {
            if var.dims() != t.dims() {
                return Err(crate::error::DriverError::Records(format!(
                    "optimizer moment of shape {:?} for a parameter of shape {:?}",
                    t.dims(),
                    var.dims()
                )));
            }
        }
        for (var, t) in pairs() {
            var.set(&t.to_device(var.device())?)?;
        }
        self.step_t = state.step_t;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use candle_nn::Optimizer;

    fn vars(seed: u64) -> Vec<Var> {
        [(3usize, 4usize), (4, 2)]
            .iter()
            .enumerate()
            .map(|(i, &(r, c))| {
                let v = tolerable_carrier::uniform_symmetric(r * c, 0.5, seed + i as u64);
                Var::from_tensor(&Tensor::from_vec(v, (r, c), &Device::Cpu).unwrap()).unwrap()
            })
            .collect()
    }

    fn loss(vs: &[Var], x: &Tensor) -> Tensor {
        let h = x.matmul(vs[0].as_tensor()).unwrap().tanh().unwrap();
        let y = h.matmul(vs[1].as_tensor()).unwrap();
        candle_nn::loss::cross_entropy(&y, &Tensor::new(&[1u32, 0], &Device::Cpu).unwrap()).unwrap()
    }

    fn bits(vs: &[Var]) -> Vec<u32> {
        vs.iter()
            .flat_map(|v| {
                v.as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            })
            .map(f32::to_bits)
            .collect()
    }

    fn params() -> candle_nn::ParamsAdamW {
        candle_nn::ParamsAdamW {
            lr: 0.05,
            weight_decay: 0.01,
            ..Default::default()
        }
    }

    /// The same bits as candle_nn's AdamW, step after step, and a copy
    /// restored from the state of step 3 goes on as the original did.
    #[test]
    fn the_same_bits_as_candle_and_a_restored_copy_goes_on_alike() {
        let x = Tensor::from_vec(
            tolerable_carrier::uniform_symmetric(6, 1.0, 9),
            (2, 3),
            &Device::Cpu,
        )
        .unwrap();
        let (ours, theirs) = (vars(1), vars(1));
        let mut a = AdamW::new(ours.clone(), params()).unwrap();
        let mut b = candle_nn::AdamW::new(theirs.clone(), params()).unwrap();
        let mut saved = None;
        for step in 1..=6 {
            a.backward_step(&loss(&ours, &x)).unwrap();
            b.backward_step(&loss(&theirs, &x)).unwrap();
            assert_eq!(bits(&ours), bits(&theirs), "step {step}");
            if step == 3 {
                let copy: Vec<Tensor> = ours
                    .iter()
                    .map(|v| v.as_tensor().detach().copy().unwrap())
                    .collect();
                saved = Some((copy, a.state().unwrap()));
            }
        }
        assert_ne!(bits(&ours), bits(&vars(1)), "training moved the parameters");
        // Restore step 3 into fresh parameters and a fresh optimizer.
        let (copy, state) = saved.unwrap();
        let resumed = vars(7);
        for (v, t) in resumed.iter().zip(&copy) {
            v.set(t).unwrap();
        }
        let mut c = AdamW::new(resumed.clone(), params()).unwrap();
        c.restore(&state).unwrap();
        for _ in 4..=6 {
            c.backward_step(&loss(&resumed, &x)).unwrap();
        }
        assert_eq!(bits(&resumed), bits(&ours));
        // Without the moments the continuation differs.
        let fresh = vars(7);
        for (v, t) in fresh.iter().zip(&copy) {
            v.set(t).unwrap();
        }
        let mut d = AdamW::new(fresh.clone(), params()).unwrap();
        for _ in 4..=6 {
            d.backward_step(&loss(&fresh, &x)).unwrap();
        }
        assert_ne!(bits(&fresh), bits(&ours));
        // A state of another shape is refused.
        let wrong = AdamState {
            first: vec![Tensor::zeros((2, 2), DType::F32, &Device::Cpu).unwrap(); 2],
            second: vec![Tensor::zeros((2, 2), DType::F32, &Device::Cpu).unwrap(); 2],
            step_t: 1,
        };
        assert!(c.restore(&wrong).is_err());
    }
}
