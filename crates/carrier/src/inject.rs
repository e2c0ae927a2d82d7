//! Injection: putting a source carrier into the receiver's slots by
//! replacement, interpolation or addition, or appending it as extra
//! attendable cache segments (augmentation).

use crate::error::{CarrierError, Result};
use crate::sites::{Carrier, Mechanism};
use candle_core::Tensor;
use tolerable_runtime::{Edit, HookPoint, Intervention, KvCache};

/// The hook edit that puts `source` into the slots by `mech` with weight
/// `alpha` (append is not a slot edit and is refused).
pub fn edit_for(mech: Mechanism, alpha: f64, source: Tensor) -> Result<Edit> {
    Ok(match mech {
        Mechanism::Replace => Edit::Replace(source),
        Mechanism::Interpolate => Edit::Interpolate { alpha, source },
        Mechanism::Add => Edit::Add((source * alpha)?),
        Mechanism::Append => {
            return Err(CarrierError::BadSites {
                field: "mechanism".into(),
                reason: "append adds cache segments; it does not edit slots".into(),
            })
        }
    })
}

/// Brings `src` to `own`'s length along the position axis `axis`: narrowed
/// when longer, padded with `own`'s entries when shorter (positions the
/// source lacks keep the receiver's state).
pub fn fit_positions(src: &Tensor, own: &Tensor, axis: usize) -> Result<Tensor> {
    let len = own.dim(axis)?;
    let have = src.dim(axis)?;
    Ok(if have == len {
        src.clone()
    } else if have > len {
        src.narrow(axis, 0, len)?
    } else {
        Tensor::cat(&[src, &own.narrow(axis, have, len - have)?], axis)?
    })
}

/// The cache slots an edit touches.
#[derive(Debug, Clone, Copy)]
pub struct KvSites<'a> {
    /// Keys, values or both.
    pub carrier: Carrier,
    /// Layers.
    pub layers: &'a [usize],
    /// Cache entries; `None` = all.
    pub positions: Option<&'a [usize]>,
    /// KV heads; `None` = all.
    pub heads: Option<&'a [usize]>,
}

/// The receiver's cache `own` with the slots at `sites` filled from
/// `source` by `mech` with weight `alpha`.
///
/// `source` may be shorter than `own` (another item's passage): positions
/// it lacks keep the receiver's entries, and `positions` must lie inside it.
pub fn edit_kv(
    own: &KvCache,
    source: &KvCache,
    sites: &KvSites,
    mech: Mechanism,
    alpha: f64,
) -> Result<KvCache> {
    let KvSites {
        carrier,
        layers,
        positions,
        heads,
    } = *sites;
    if !carrier.is_kv() {
        return Err(CarrierError::BadSites {
            field: "carrier".into(),
            reason: "the residual carrier h is not in the KV cache".into(),
        });
    }
    if source.n_layers() != own.n_layers() {
        return Err(CarrierError::Shape {
            what: "kv source".into(),
            reason: format!("{} layers against {}", source.n_layers(), own.n_layers()),
        });
    }
    let pos: Option<Vec<usize>> = positions.map(|p| p.to_vec());
    if let Some(p) = &pos {
        if let Some(&bad) = p.iter().find(|&&p| p >= source.len().min(own.len())) {
            return Err(CarrierError::BadSites {
                field: "positions".into(),
                reason: format!(
                    "position {bad} outside the source ({} entries) or the receiver ({} entries)",
                    source.len(),
                    own.len()
                ),
            });
        }
    }
    let mut out = own.clone();
    for &l in layers {
        let mine = own.require_layer(l)?;
        let theirs = source.require_layer(l)?;
        if theirs.k.dim(1)? != mine.k.dim(1)? || theirs.k.dim(3)? != mine.k.dim(3)? {
            return Err(CarrierError::Shape {
                what: format!("kv source at layer {l}"),
                reason: format!("{:?} against {:?}", theirs.k.dims(), mine.k.dims()),
            });
        }
        let apply = |point: HookPoint, own_t: &Tensor, src_t: &Tensor| -> Result<Tensor> {
            let src = fit_positions(src_t, own_t, 2)?;
            let mut iv = Intervention::new(point, edit_for(mech, alpha, src)?);
            iv.positions = pos.clone();
            iv.heads = heads.map(|h| h.to_vec());
            Ok(iv.apply(own_t)?)
        };
        let k = if carrier.has_k() {
            apply(HookPoint::RotK(l), &mine.k, &theirs.k)?
        } else {
            mine.k.clone()
        };
        let v = if carrier.has_v() {
            apply(HookPoint::V(l), &mine.v, &theirs.v)?
        } else {
            mine.v.clone()
        };
        out.set_layer(l, k, v)?;
    }
    Ok(out)
}

/// The receiver's cache `own` with `source`'s entries `start..start+len`
/// appended in every layer as an extra attendable segment (augmentation);
/// the appended keys keep the RoPE of their own positions.
pub fn append_kv(own: &KvCache, source: &KvCache, start: usize, len: usize) -> Result<KvCache> {
    let mut out = own.clone();
    out.append_segment(&source.narrow(start, len)?)?;
    Ok(out)
}

/// The receiver's residual `own` (`[b, seq, d]`, the input of block `layer`)
/// with `positions` filled from `source` by `mech` with `alpha`. A source of
/// another length (another item) is fitted: positions must lie inside it.
pub fn edit_resid(
    own: &Tensor,
    source: &Tensor,
    layer: usize,
    positions: &[usize],
    mech: Mechanism,
    alpha: f64,
) -> Result<Tensor> {
    let (b, _, d) = own.dims3()?;
    let (sb, sl, sd) = source.dims3()?;
    if (sb, sd) != (b, d) && (sb, sd) != (1, d) {
        return Err(CarrierError::Shape {
            what: format!("residual source at layer {layer}"),
            reason: format!("{:?} against {:?}", source.dims(), own.dims()),
        });
    }
    if let Some(&bad) = positions.iter().find(|&&p| p >= sl) {
        return Err(CarrierError::BadSites {
            field: "positions".into(),
            reason: format!("position {bad} outside the source's {sl} positions"),
        });
    }
    let source = fit_positions(source, own, 1)?;
    let iv = Intervention::new(HookPoint::ResidPre(layer), edit_for(mech, alpha, source)?)
        .at_positions(positions.to_vec());
    Ok(iv.apply(own)?)
}
