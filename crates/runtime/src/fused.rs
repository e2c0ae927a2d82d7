//! CPU ops that do in one pass what the written-out forward does in several,
//! with the same arithmetic in the same order, so their outputs are the
//! unfused path's bit for bit (each is tested against it). They pass no
//! gradient: the forward uses them only under [`crate::model::Kernels::Fused`].

use candle_core::cpu::kernels::VecOps;
use candle_core::{CpuStorage, CustomOp1, Layout, Shape};
use rayon::prelude::*;
use std::sync::Arc;

use crate::weights::contiguous_f32;

/// `silu(gate) * up` over a fused gate/up projection's output `[.., 2f]`
/// (gate first): `g / (1 + exp(-g)) * u` per element, candle's silu and
/// product in one pass.
pub(crate) struct SiluMul;

impl CustomOp1 for SiluMul {
    fn name(&self) -> &'static str {
        "silu-mul"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(storage, layout, "silu-mul")?;
        let dims = layout.shape().dims();
        let two_f = *dims.last().unwrap_or(&0);
        if !two_f.is_multiple_of(2) {
            candle_core::bail!("silu-mul: an odd last axis {two_f}");
        }
        let f = two_f / 2;
        let mut out = Vec::with_capacity(x.len() / 2);
        for row in x.chunks_exact(two_f) {
            let (g, u) = row.split_at(f);
            out.extend(g.iter().zip(u).map(|(&g, &u)| (g / (1.0 + (-g).exp())) * u));
        }
        let mut shape = dims.to_vec();
        if let Some(last) = shape.last_mut() {
            *last = f;
        }
        Ok((CpuStorage::F32(out), shape.into()))
    }
}

/// The attention pattern from raw scores `q kᵀ` laid out `[.., rows, t]`,
/// where row r is query position `r % s` of the call's `s` new positions and
/// the last `s` of the `t` keys are those positions' own: `softmax(scores *
/// scale + causal mask)` in one pass, the mask taken from the shape (new
/// position i sees every cached key and new keys 0..=i) instead of a
/// materialised tensor. Masked slots get the unfused path's `f32::MIN`;
/// maximum, exponentials, sum and division are candle's softmax's own.
pub(crate) struct CausalSoftmax {
    /// The score scale, 1/√head_dim.
    pub scale: f32,
    /// New positions in the call.
    pub s: usize,
    /// A padded batch's key validity, `[batch * t]` (sequence-major):
    /// invalid keys are masked for every query of their sequence. `None`:
    /// every key valid.
    pub valid: Option<Arc<Vec<bool>>>,
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "causal-softmax"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(storage, layout, "causal-softmax")?;
        let dims = layout.shape().dims();
        let t = *dims.last().unwrap_or(&0);
        let s = self.s;
        if t == 0 || s == 0 || s > t || !(x.len() / t).is_multiple_of(s) {
            candle_core::bail!("causal-softmax: {s} new positions do not fit scores {dims:?}");
        }
        let past = t - s;
        let scale = self.scale;
        let rows = x.len() / t;
        // Rows of scores per sequence, when a padded batch says which keys
        // each sequence may see.
        let per_seq = match &self.valid {
            Some(v)
                if !v.len().is_multiple_of(t)
                    || v.is_empty()
                    || !rows.is_multiple_of(v.len() / t) =>
            {
                candle_core::bail!(
                    "causal-softmax: key validity of {} entries does not fit scores {dims:?}",
                    v.len()
                )
            }
            Some(v) => rows / (v.len() / t),
            None => rows,
        };
        let valid = self.valid.as_deref();
        let mut out = vec![0f32; x.len()];
        x.par_chunks(t)
            .zip(out.par_chunks_mut(t))
            .enumerate()
            .for_each(|(r, (src, dst))| {
                let sees = past + r % s;
                let keys = valid.map(|v| &v[(r / per_seq) * t..(r / per_seq + 1) * t]);
                for (j, (a, d)) in src.iter().zip(dst.iter_mut()).enumerate() {
                    // As the unfused path: the scale's affine (`* scale + 0`),
                    // then the mask's add (0, or f32::MIN, which absorbs any
                    // finite score).
                    *d = if j <= sees && keys.is_none_or(|k| k[j]) {
                        a * scale + 0.0 + 0.0
                    } else {
                        f32::MIN
                    };
                }
                let mut max = f32::NEG_INFINITY;
                // SAFETY: `dst` holds `t` initialised floats.
                unsafe { f32::vec_reduce_max(dst.as_ptr(), &mut max, t) };
                for d in dst.iter_mut() {
                    *d = (*d - max).exp();
                }
                let mut sum = 0f32;
                // SAFETY: as above.
                unsafe { f32::vec_reduce_sum(dst.as_ptr(), &mut sum, t) };
                for d in dst.iter_mut() {
                    *d /= sum;
                }
            });
        Ok((CpuStorage::F32(out), dims.into()))
    }
}
