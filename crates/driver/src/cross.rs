//! Cross-family holders (PROTOCOL §6): a model of another family — its own
//! depth, width, heads and tokenizer — reads the receiver's passage, and a
//! frozen per-layer linear projection fitted on training items
//! ([`crate::resources::cross`]) maps its states into the receiver's space.
//! The receiver itself can stand in as the holder (the identity sanity arm:
//! its own states through a projection fitted to itself).
//!
//! **Text.** The holder reads exactly the text the receiver's context ids
//! spell (template prefix and passage, as [`Tokenizer::token_spans`] gives
//! it), tokenized at once by its own tokenizer.
//!
//! **Tokens** are aligned by character offsets ([`align_by_offsets`]): each
//! receiver position takes the holder's state at the last holder token that
//! starts before the receiver token ends — the holder token holding the
//! receiver token's last byte. In a causal model that is the first holder
//! state to have read all of the receiver token's text. A holder token
//! coarser than the receiver's serves several receiver positions; a finer
//! one contributes only through the tokens after it.
//!
//! **Depth** is aligned proportionally ([`depth_map`]): receiver layer `l`
//! reads holder layer `round(l (L_h − 1) / (L_r − 1))`, so the embedding
//! (`resid_pre` of layer 0) maps to the embedding and the last block to the
//! last.
//!
//! **Keys and RoPE.** The holder's positions are not the receiver's (its
//! tokenization differs), and a rotary key is its pre-RoPE key rotated by a
//! position-dependent angle: one position-free linear map cannot carry
//! post-RoPE keys between the two position sets. Keys are therefore mapped
//! in the pre-RoPE frame (`hook_k` of both models, read at aligned
//! positions) and the receiver's RoPE is applied at the receiver's own
//! positions afterwards; values carry no rotation and are mapped as they
//! are. Every carrier comes out aligned to the receiver's positions, so the
//! projected holder is a pass of the receiver's geometry: a cache for KV
//! augmentation (`append`) or slot edits, and `resid_pre` for activation
//! replacement.

use crate::error::{DriverError, Result};
use crate::passes::Pass;
use crate::resources::cross::CrossProjection;
use candle_core::{Device, Tensor};
use std::collections::{BTreeMap, BTreeSet};
use tolerable_runtime::{HookPoint, HookSpec, LogitsAt, Model, Tokenizer};

/// A cross-family holder, loaded: its model, its own tokenizer, and the
/// sha256 its file was verified with (a key of the projection's hash).
#[derive(Debug, Clone)]
pub struct CrossHolder {
    /// The id it was loaded by (catalog id or path).
    pub id: String,
    /// The model.
    pub model: Model,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// Its file's sha256 (or `unhashed:<path>`).
    pub sha256: String,
}

/// A cross-family holder of a plan: the model an arm names and the
/// projection (`[resources.<name>] kind = "cross_projection"`) its states
/// go through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForeignSpec {
    /// The holder's model id or path.
    pub model: String,
    /// The projection resource.
    pub projection: String,
    /// Which context the holder reads: the item's own full passage
    /// (`None`), or the `r`-th mis-source partner's (the mismatch control
    /// through the same holder and projection).
    pub partner: Option<usize>,
}

impl ForeignSpec {
    /// The key naming the projected holder's pass
    /// (`holder=<id>|projection=<name>`, `|partner=<r>` for a partner's).
    pub fn key(&self) -> String {
        let own = format!("holder={}|projection={}", self.model, self.projection);
        match self.partner {
            Some(r) => format!("{own}|partner={r}"),
            None => own,
        }
    }
}

/// What reading an item through the plan's cross-family holders needs: the
/// receiver's tokenizer (for the text its ids spell), the holders by model
/// id, the plan's foreign specs by key, and the run's resources (the
/// projections).
#[derive(Clone, Copy)]
pub struct ForeignCx<'a> {
    /// The receiver's tokenizer.
    pub tokenizer: &'a Tokenizer,
    /// Loaded holders by model id.
    pub holders: &'a BTreeMap<String, CrossHolder>,
    /// The plan's cross-family holders by key.
    pub specs: &'a BTreeMap<String, ForeignSpec>,
    /// The run's built resources.
    pub resources: &'a BTreeMap<String, crate::resources::Value>,
}

impl ForeignCx<'_> {
    /// The projected pass of holder `key` over the receiver's alternative
    /// context `ids` (the receiver's own pass `alt`), with `resid_pre` at
    /// receiver layers `resid`.
    pub fn pass(
        &self,
        key: &str,
        ids: &[u32],
        alt: &Pass,
        resid: &BTreeSet<usize>,
    ) -> Result<Pass> {
        let spec = self.specs.get(key).ok_or_else(|| {
            DriverError::Records(format!("internal: no cross-family holder `{key}`"))
        })?;
        let holder = self.holders.get(&spec.model).ok_or_else(|| {
            DriverError::Records(format!(
                "internal: cross-family holder `{}` was not loaded",
                spec.model
            ))
        })?;
        let proj = self.resources.get(&spec.projection).ok_or_else(|| {
            DriverError::Records(format!(
                "internal: projection `{}` was not built",
                spec.projection
            ))
        })?;
        let proj = crate::resources::bank::downcast::<CrossProjection>(proj, "cross projection")?;
        projected_pass(holder, proj, self.tokenizer, ids, alt, resid)
    }
}

/// The holder layer receiver layer `l` reads: `round(l (L_h − 1) / (L_r − 1))`
/// (layer 0 to layer 0, the last to the last; a one-layer receiver reads 0).
pub fn depth_map(l: usize, receiver_layers: usize, holder_layers: usize) -> usize {
    if receiver_layers <= 1 || holder_layers == 0 {
        return 0;
    }
    let (num, den) = (l * (holder_layers - 1), receiver_layers - 1);
    ((2 * num + den) / (2 * den)).min(holder_layers - 1)
}

/// For each receiver token (byte span `[s, e)` in a text), the holder token
/// (byte spans in the same text, in order) it reads: the last holder token
/// that starts before `e` — the one holding the receiver token's last byte,
/// or, where holder tokens leave that byte uncovered, the last before it.
/// A receiver token with no holder token starting before its end (a
/// zero-width BOS) reads holder token 0.
pub fn align_by_offsets(receiver: &[(usize, usize)], holder: &[(usize, usize)]) -> Vec<usize> {
    let mut out = Vec::with_capacity(receiver.len());
    let mut j = 0usize; // holder tokens [0, j) start before the current end
    for &(_, e) in receiver {
        while j < holder.len() && holder[j].0 < e {
            j += 1;
        }
        out.push(j.saturating_sub(1));
    }
    out
}

/// A model's states on one context as rows, `[T, ·]` per layer: `resid_pre`
/// (`[T, d_model]`), pre-RoPE keys and values (`[T, n_kv_heads·head_dim]`,
/// heads concatenated).
#[derive(Debug, Clone, Default)]
pub struct Rows {
    /// `resid_pre` by layer.
    pub resid: BTreeMap<usize, Tensor>,
    /// Pre-RoPE keys by layer.
    pub k: BTreeMap<usize, Tensor>,
    /// Values by layer.
    pub v: BTreeMap<usize, Tensor>,
}

/// `[1, nkv, T, hd]` as rows `[T, nkv·hd]`.
fn head_rows(t: &Tensor) -> Result<Tensor> {
    let (_, nkv, n, hd) = t.dims4()?;
    Ok(t.squeeze(0)?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((n, nkv * hd))?)
}

/// `model`'s states on `ids` at `resid` layers (`resid_pre`) and `kv`
/// layers (pre-RoPE keys, values), gathered at positions `index` (all
/// positions when `None`).
pub fn read_rows(
    model: &Model,
    ids: &[u32],
    resid: &BTreeSet<usize>,
    kv: &BTreeSet<usize>,
    index: Option<&[usize]>,
) -> Result<Rows> {
    let mut spec = HookSpec::new().capture_all(resid.iter().map(|&l| HookPoint::ResidPre(l)));
    for &l in kv {
        spec = spec.capture(HookPoint::K(l)).capture(HookPoint::V(l));
    }
    let mut cache = model.new_cache(1);
    let out = model.forward(
        &model.tokens(&[ids.to_vec()])?,
        &mut cache,
        &spec,
        LogitsAt::None,
    )?;
    let idx = match index {
        Some(ix) => Some(Tensor::from_vec(
            ix.iter().map(|&p| p as u32).collect::<Vec<_>>(),
            ix.len(),
            &Device::Cpu,
        )?),
        None => None,
    };
    let pick = |t: Tensor| -> Result<Tensor> {
        Ok(match &idx {
            Some(i) => t.index_select(i, 0)?,
            None => t,
        })
    };
    let mut rows = Rows::default();
    for &l in resid {
        let h = out.hooks.require(HookPoint::ResidPre(l))?.squeeze(0)?;
        rows.resid.insert(l, pick(h)?);
    }
    for &l in kv {
        rows.k
            .insert(l, pick(head_rows(out.hooks.require(HookPoint::K(l))?)?)?);
        rows.v
            .insert(l, pick(head_rows(out.hooks.require(HookPoint::V(l))?)?)?);
    }
    Ok(rows)
}

/// The holder's reading of the text `receiver_ids` spell: the alignment of
/// receiver positions to holder tokens, and the holder's states at
/// `resid` and `kv` holder layers gathered at the aligned tokens (one row
/// per receiver position).
pub fn read_aligned(
    holder: &CrossHolder,
    receiver_tokenizer: &Tokenizer,
    receiver_ids: &[u32],
    resid: &BTreeSet<usize>,
    kv: &BTreeSet<usize>,
) -> Result<(Vec<usize>, Rows)> {
    let (text, rspans) = receiver_tokenizer.token_spans(receiver_ids)?;
    let (hids, hspans) = holder.tokenizer.encode_with_offsets(&text)?;
    if hids.is_empty() {
        return Err(DriverError::Config(format!(
            "cross-family holder `{}` reads no token of a context of {} receiver tokens",
            holder.id,
            receiver_ids.len()
        )));
    }
    let ctx = holder.model.config().context_length;
    if hids.len() > ctx {
        return Err(DriverError::Config(format!(
            "cross-family holder `{}`: the context is {} of its tokens, more than its context length {ctx}",
            holder.id,
            hids.len()
        )));
    }
    let index = align_by_offsets(&rspans, &hspans);
    let rows = read_rows(&holder.model, &hids, resid, kv, Some(&index))?;
    Ok((index, rows))
}

/// The projected holder's pass over the receiver's alternative context
/// `ids` (whose own pass is `alt`): a cache of the receiver's layout (keys
/// mapped pre-RoPE and rotated at the receiver's positions, values mapped)
/// and `resid_pre` at `resid_layers` of the receiver, all at the receiver's
/// positions.
pub fn projected_pass(
    holder: &CrossHolder,
    proj: &CrossProjection,
    receiver_tokenizer: &Tokenizer,
    ids: &[u32],
    alt: &Pass,
    resid_layers: &BTreeSet<usize>,
) -> Result<Pass> {
    let nl = alt.cache.n_layers();
    let want_resid: BTreeSet<usize> = resid_layers.iter().map(|&l| proj.depth[l]).collect();
    let want_kv: BTreeSet<usize> = (0..nl).map(|l| proj.depth[l]).collect();
    let (_, rows) = read_aligned(holder, receiver_tokenizer, ids, &want_resid, &want_kv)?;
    let t = ids.len();
    let positions: Vec<usize> = (0..t).collect();
    let mut cache = alt.cache.clone();
    for l in 0..nl {
        let m = proj.depth[l];
        let kl = cache.require_layer(l)?;
        let (_, nkv, _, hd) = kl.k.dims4()?;
        let k = proj.k[l].apply(&rows.k[&m])?; // [T, nkv·hd], pre-RoPE
        let v = proj.v[l].apply(&rows.v[&m])?;
        let mut heads = Vec::with_capacity(nkv);
        for h in 0..nkv {
            let pre = k.narrow(1, h * hd, hd)?.contiguous()?;
            heads.push(tolerable_carrier::fit::rope_rotate(
                &pre,
                &positions,
                proj.rope.0,
                proj.rope.1,
                false,
            )?);
        }
        let k = Tensor::stack(&heads, 0)?.unsqueeze(0)?; // [1, nkv, T, hd]
        let v = v
            .reshape((t, nkv, hd))?
            .transpose(0, 1)?
            .contiguous()?
            .unsqueeze(0)?;
        cache.set_layer(l, k, v)?;
    }
    let mut resid = BTreeMap::new();
    for &l in resid_layers {
        let h = proj.h[l].apply(&rows.resid[&proj.depth[l]])?;
        resid.insert(l, h.unsqueeze(0)?);
    }
    Ok(Pass { cache, resid })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depth_is_aligned_proportionally_end_to_end() {
        // smollm2-135m (30 layers) into qwen2.5-0.5b (24 layers).
        let m: Vec<usize> = (0..24).map(|l| depth_map(l, 24, 30)).collect();
        assert_eq!(m[0], 0);
        assert_eq!(m[23], 29);
        assert_eq!(m[12], 15); // 12 * 29 / 23 = 15.13
        assert_eq!(m[4], 5); // 5.04
        assert!(m.windows(2).all(|w| w[0] < w[1]), "{m:?}");
        // The same depth is the identity; a one-layer receiver reads layer 0.
        assert!((0..24).all(|l| depth_map(l, 24, 24) == l));
        assert_eq!(depth_map(0, 1, 30), 0);
        // A shallower holder: rounding to nearest, halves up.
        assert_eq!(
            (0..5).map(|l| depth_map(l, 5, 3)).collect::<Vec<_>>(),
            vec![0, 1, 1, 2, 2]
        );
    }

    #[test]
    fn tokens_align_to_the_holder_token_holding_their_last_byte() {
        // Text "the cats sat": receiver [the][ cats][ sat], holder [the][ c][ats][ s][at].
        let r = [(0, 3), (3, 8), (8, 12)];
        let h = [(0, 3), (3, 5), (5, 8), (8, 10), (10, 12)];
        assert_eq!(align_by_offsets(&r, &h), vec![0, 2, 4]);
        // A coarser holder serves several receiver tokens.
        let h = [(0, 8), (8, 12)];
        assert_eq!(align_by_offsets(&r, &h), vec![0, 0, 1]);
        // A holder token straddling a receiver boundary is read by the
        // receiver token whose end it holds.
        let h = [(0, 4), (4, 12)];
        assert_eq!(align_by_offsets(&r, &h), vec![0, 1, 1]);
        // A zero-width BOS on either side; multi-byte characters split over
        // holder tokens that share a span.
        let r = [(0, 0), (0, 2), (2, 5)];
        let h = [(0, 0), (0, 2), (2, 4), (2, 4), (4, 5)];
        assert_eq!(align_by_offsets(&r, &h), vec![0, 1, 4]);
        // Identical tokenizations align position by position.
        let s = [(0, 1), (1, 4), (4, 9)];
        assert_eq!(align_by_offsets(&s, &s), vec![0, 1, 2]);
    }
}
