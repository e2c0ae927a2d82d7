//! Transforms: what happens to a source's carrier value between the source
//! and the mechanism, chained in order — displacement to other positions,
//! perturbations (cosine-calibrated noise, sparse damage, integer round
//! trips), substitution of genuine keys from a bank or a codebook, and
//! fitted substitutes (a sender-side key through a map fitted to the
//! receiver's keys).
//! Each acts only at the injection's sites (layers, positions, kv heads);
//! everything else passes through bit for bit.

use crate::arm::Base;
use crate::error::{DriverError, Result};
use crate::passes::ItemPasses;
use crate::resources::bank::downcast;
use crate::resources::{CodebookSet, FittedMap, KeyBank, Value};
use crate::sources::CarrierValue;
use crate::sources::Source;
use candle_core::Tensor;
use std::any::Any;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::rc::Rc;
use tolerable_carrier::codebook::Snapping;
use tolerable_carrier::fidelity::{select_heads, site_cosine, vector_cosine};
use tolerable_carrier::{Carrier, Geometry, Perturbation, Positions};
use tolerable_runtime::hooks::site_mask;
use tolerable_runtime::HookPoint;

/// Work shared by the arms of one item (e.g. a bank's neighbours of the
/// true keys, computed once for every k), keyed by a description of it.
#[derive(Default)]
pub struct Memo {
    cells: RefCell<HashMap<String, Rc<dyn Any>>>,
}

impl Memo {
    /// The value under `key`, computed by `make` the first time.
    pub fn get_or<T: 'static>(&self, key: &str, make: impl FnOnce() -> Result<T>) -> Result<Rc<T>> {
        if let Some(v) = self.cells.borrow().get(key) {
            if let Ok(t) = v.clone().downcast::<T>() {
                return Ok(t);
            }
        }
        let v = Rc::new(make()?);
        self.cells
            .borrow_mut()
            .insert(key.to_string(), v.clone() as Rc<dyn Any>);
        Ok(v)
    }
}

/// Where and for whom a transform runs: the injection's sites on this item,
/// the seed parts of perturbations, the run's resources, the item's memo.
pub struct TransformCx<'a> {
    /// The carrier of the injection.
    pub carrier: Carrier,
    /// Its layers.
    pub layers: &'a [usize],
    /// Destination sites (context positions), restricted to those the source holds.
    pub sites: &'a [usize],
    /// The geometry of the context the source was read from.
    pub source_geometry: &'a Geometry,
    /// KV heads (KV carriers), `None` = all.
    pub heads: Option<&'a [usize]>,
    /// Seeds a perturbation at (layer, which: 0 residual, 1 keys, 2 values).
    pub seed_of: &'a dyn Fn(usize, u64) -> u64,
    /// The run's resources by name.
    pub resources: &'a BTreeMap<String, Value>,
    /// The item's shared work.
    pub memo: &'a Memo,
    /// The source and the transforms before this one (keys shared work:
    /// two arms share a bank search only when they search the same keys).
    pub chain: &'a str,
    /// The item's passes (a blend reads another pass's state).
    pub passes: &'a ItemPasses,
    /// The arm's base pass.
    pub base: Base,
}

/// What a transform measured: the cosine of its output to its input at the
/// sites, once per layer and tensor, named by the hook point it acts at
/// (`blocks.{l}.attn.hook_rot_k`, `blocks.{l}.attn.hook_v`,
/// `blocks.{l}.hook_resid_pre`).
pub type Achieved = Vec<(String, f64)>;

/// One step of the chain between source and mechanism.
pub trait Transform: fmt::Debug + Send + Sync {
    /// Name in plans and records.
    fn name(&self) -> String;
    /// Resources it reads.
    fn resources(&self) -> Vec<String> {
        Vec::new()
    }
    /// Applies the transform at the sites.
    fn apply(&self, value: CarrierValue, cx: &TransformCx) -> Result<(CarrierValue, Achieved)>;
    /// Whether its output depends on the arm's seed (then no other arm
    /// shares work keyed after it).
    fn seeded(&self) -> bool {
        false
    }
    /// The destination sites after this transform (displacement may shorten them).
    fn sites(&self, sites: Vec<usize>, _cx: &TransformCx) -> Vec<usize> {
        sites
    }
}

/// A perturbation of the source (PROTOCOL §5): noise, damage, quantization.
#[derive(Debug, Clone)]
pub struct Perturb(pub Perturbation);

impl Transform for Perturb {
    fn seeded(&self) -> bool {
        true
    }

    fn name(&self) -> String {
        match self.0.target_cosine() {
            Some(c) => format!("{}({c})", self.0.name()),
            None => self.0.name().to_string(),
        }
    }

    fn apply(&self, value: CarrierValue, cx: &TransformCx) -> Result<(CarrierValue, Achieved)> {
        let mut ach = Vec::new();
        match value {
            CarrierValue::Resid(mut m) => {
                for &l in cx.layers {
                    let src = m.get(&l).ok_or_else(|| {
                        DriverError::Records(format!("internal: no residual at layer {l}"))
                    })?;
                    let mask = site_mask(src.dims(), Some((1, cx.sites)), None, src.device())?;
                    let pert = self.0.apply(src, Some(&mask), (cx.seed_of)(l, 0))?;
                    if !cx.sites.is_empty() {
                        ach.push((
                            HookPoint::ResidPre(l).to_string(),
                            site_cosine(&pert, src, 1, cx.sites)?,
                        ));
                    }
                    m.insert(l, pert);
                }
                Ok((CarrierValue::Resid(m), ach))
            }
            CarrierValue::Kv(mut src) => {
                for &l in cx.layers {
                    let kv = src.require_layer(l)?.clone();
                    let mut one = |t: &Tensor, which: u64, site: HookPoint| -> Result<Tensor> {
                        let live: Vec<usize> = cx
                            .sites
                            .iter()
                            .copied()
                            .filter(|&s| s < t.dims()[2])
                            .collect();
                        let mask = site_mask(
                            t.dims(),
                            Some((2, &live)),
                            cx.heads.map(|h| (1, h)),
                            t.device(),
                        )?;
                        let out = self.0.apply(t, Some(&mask), (cx.seed_of)(l, which))?;
                        // Measured where it was calibrated: the sites of the chosen heads.
                        if !live.is_empty() {
                            let (o, r) = match cx.heads {
                                Some(h) => (select_heads(&out, h)?, select_heads(t, h)?),
                                None => (out.clone(), t.clone()),
                            };
                            ach.push((site.to_string(), site_cosine(&o, &r, 2, &live)?));
                        }
                        Ok(out)
                    };
                    let k = if cx.carrier.has_k() {
                        one(&kv.k, 1, HookPoint::RotK(l))?
                    } else {
                        kv.k.clone()
                    };
                    let v = if cx.carrier.has_v() {
                        one(&kv.v, 2, HookPoint::V(l))?
                    } else {
                        kv.v.clone()
                    };
                    src.set_layer(l, k, v)?;
                }
                Ok((CarrierValue::Kv(src), ach))
            }
        }
    }
}

/// The source read at other positions (`source_positions`) and written at
/// the injection's: the displaced control's right content in the wrong
/// place. Source and destination sites pair in order; the shorter list
/// decides how many move.
#[derive(Debug, Clone)]
pub struct Displace {
    /// Where the source is read.
    pub from: Positions,
}

impl Displace {
    fn pairs(&self, sites: &[usize], cx: &TransformCx) -> Vec<(usize, usize)> {
        let from = self.from.resolve(cx.source_geometry);
        from.into_iter().zip(sites.iter().copied()).collect()
    }
}

/// `t` with, along `axis`, row `dst` replaced by row `src` for each pair.
fn move_rows(t: &Tensor, axis: usize, pairs: &[(usize, usize)]) -> Result<Tensor> {
    if pairs.is_empty() {
        return Ok(t.clone());
    }
    let n = t.dims()[axis];
    let mut index: Vec<u32> = (0..n as u32).collect();
    for &(src, dst) in pairs {
        if src >= n || dst >= n {
            return Err(DriverError::Records(format!(
                "displacement {src} -> {dst} outside {n} positions"
            )));
        }
        index[dst] = src as u32;
    }
    let idx = Tensor::from_vec(index, n, t.device())?;
    Ok(t.contiguous()?.index_select(&idx, axis)?)
}

impl Transform for Displace {
    fn name(&self) -> String {
        format!("displace(from {})", self.from.name())
    }

    fn sites(&self, sites: Vec<usize>, cx: &TransformCx) -> Vec<usize> {
        let n = self.from.resolve(cx.source_geometry).len();
        sites.into_iter().take(n).collect()
    }

    fn apply(&self, value: CarrierValue, cx: &TransformCx) -> Result<(CarrierValue, Achieved)> {
        let pairs = self.pairs(cx.sites, cx);
        Ok((
            match value {
                CarrierValue::Resid(m) => CarrierValue::Resid(
                    m.into_iter()
                        .map(|(l, t)| Ok((l, move_rows(&t, 1, &pairs)?)))
                        .collect::<Result<_>>()?,
                ),
                CarrierValue::Kv(mut c) => {
                    for &l in cx.layers {
                        let kv = c.require_layer(l)?.clone();
                        c.set_layer(
                            l,
                            move_rows(&kv.k, 2, &pairs)?,
                            move_rows(&kv.v, 2, &pairs)?,
                        )?;
                    }
                    CarrierValue::Kv(c)
                }
            },
            Vec::new(),
        ))
    }
}

/// How a bank chooses the genuine key that stands in for a true key.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BankPick {
    /// The k-th nearest by cosine (1 = nearest); `depth` neighbours are
    /// searched once per item and shared by every k.
    Neighbour {
        /// Which neighbour.
        k: usize,
        /// How many the search keeps (the largest k of the run on this bank).
        depth: usize,
    },
    /// The genuine key whose cosine to the true key is nearest `target`.
    AtCosine(f64),
}

/// Substitution of genuine keys (PROTOCOL §5, key bank): each true key at
/// the sites replaced by a key of the bank.
#[derive(Debug, Clone)]
pub struct BankSubstitute {
    /// The bank's resource name.
    pub bank: String,
    /// Which genuine key.
    pub pick: BankPick,
}

/// Codebook reconstruction (PROTOCOL §5): each true key at the sites snapped
/// to a codebook fitted on a bank.
#[derive(Debug, Clone)]
pub struct CodebookSnap {
    /// The codebook's resource name.
    pub codebook: String,
    /// The snapping rule.
    pub snapping: Snapping,
}

/// Replaces, in keys `k` `[1, n_kv, T, hd]`, the rows at `sites` of every
/// selected head with `rows(l, head, true_rows)` and returns the new keys
/// and the per-vector cosines of new to true rows.
fn substitute_keys(
    k: &Tensor,
    sites: &[usize],
    heads: Option<&[usize]>,
    mut rows: impl FnMut(usize, &Tensor) -> Result<Tensor>,
) -> Result<(Tensor, Vec<f64>)> {
    let (b, nkv, t, hd) = k.dims4()?;
    if b != 1 {
        return Err(DriverError::Records(format!(
            "internal: key substitution on a batch of {b}; sources are batch 1"
        )));
    }
    let live: Vec<usize> = sites.iter().copied().filter(|&s| s < t).collect();
    if live.is_empty() {
        return Ok((k.clone(), Vec::new()));
    }
    let mut data: Vec<f32> = k.flatten_all()?.to_vec1()?;
    let idx = Tensor::from_vec(
        live.iter().map(|&s| s as u32).collect::<Vec<_>>(),
        live.len(),
        k.device(),
    )?;
    let mut cos = Vec::new();
    for h in 0..nkv {
        if heads.is_some_and(|hs| !hs.contains(&h)) {
            continue;
        }
        let truth = k
            .narrow(1, h, 1)?
            .squeeze(0)?
            .squeeze(0)?
            .contiguous()?
            .index_select(&idx, 0)?; // [n, hd]
        let new = rows(h, &truth)?;
        let new_v: Vec<Vec<f32>> = new.to_vec2()?;
        let true_v: Vec<Vec<f32>> = truth.to_vec2()?;
        for (i, &s) in live.iter().enumerate() {
            let at = (h * t + s) * hd;
            data[at..at + hd].copy_from_slice(&new_v[i]);
            cos.push(vector_cosine(&new_v[i], &true_v[i]));
        }
    }
    Ok((Tensor::from_vec(data, k.dims(), k.device())?, cos))
}

fn sites_key(sites: &[usize]) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    sites.hash(&mut h);
    format!("{}:{:x}", sites.len(), h.finish())
}

fn resource<'a>(cx: &'a TransformCx, name: &str) -> Result<&'a Value> {
    cx.resources
        .get(name)
        .ok_or_else(|| DriverError::Records(format!("internal: resource `{name}` was not built")))
}

/// Keys of a KV value with the transform applied per layer; values untouched.
fn map_keys(
    value: CarrierValue,
    cx: &TransformCx,
    mut per_layer: impl FnMut(usize, &Tensor) -> Result<(Tensor, Vec<f64>)>,
) -> Result<(CarrierValue, Achieved)> {
    let mut c = match value {
        CarrierValue::Kv(c) => c,
        CarrierValue::Resid(_) => {
            return Err(DriverError::Records(
                "internal: a key substitution on the residual carrier".into(),
            ))
        }
    };
    let mut ach = Vec::new();
    for &l in cx.layers {
        let kv = c.require_layer(l)?.clone();
        let (k, cos) = per_layer(l, &kv.k)?;
        if !cos.is_empty() {
            ach.push((
                HookPoint::RotK(l).to_string(),
                cos.iter().sum::<f64>() / cos.len() as f64,
            ));
        }
        c.set_layer(l, k, kv.v)?;
    }
    Ok((CarrierValue::Kv(c), ach))
}

impl Transform for BankSubstitute {
    fn name(&self) -> String {
        match self.pick {
            BankPick::Neighbour { k, .. } => format!("bank({}, neighbour {k})", self.bank),
            BankPick::AtCosine(c) => format!("bank({}, cosine {c})", self.bank),
        }
    }

    fn resources(&self) -> Vec<String> {
        vec![self.bank.clone()]
    }

    fn apply(&self, value: CarrierValue, cx: &TransformCx) -> Result<(CarrierValue, Achieved)> {
        let bank = downcast::<KeyBank>(resource(cx, &self.bank)?, "key bank")?;
        let skey = sites_key(cx.sites);
        map_keys(value, cx, |l, k| {
            substitute_keys(k, cx.sites, cx.heads, |h, truth| {
                let b = bank.at(l, h)?;
                match self.pick {
                    BankPick::Neighbour { k, depth } => {
                        let key = format!("bank:{}:{}:{l}:{h}:{skey}:{depth}", self.bank, cx.chain);
                        let nb = cx.memo.get_or(&key, || {
                            Ok(tolerable_carrier::bank::top_k_cosine(truth, b, depth)?)
                        })?;
                        let (idx, _) = nb.rank(k - 1);
                        Ok(tolerable_carrier::bank::gather_rows(b, &idx)?)
                    }
                    BankPick::AtCosine(target) => {
                        let (idx, _) = tolerable_carrier::bank::at_target_cosine(truth, b, target)?;
                        Ok(tolerable_carrier::bank::gather_rows(b, &idx)?)
                    }
                }
            })
        })
    }
}

impl Transform for CodebookSnap {
    fn name(&self) -> String {
        format!("codebook({}, {})", self.codebook, self.snapping.name())
    }

    fn resources(&self) -> Vec<String> {
        vec![self.codebook.clone()]
    }

    fn apply(&self, value: CarrierValue, cx: &TransformCx) -> Result<(CarrierValue, Achieved)> {
        let set = downcast::<CodebookSet>(resource(cx, &self.codebook)?, "codebook")?;
        map_keys(value, cx, |l, k| {
            substitute_keys(k, cx.sites, cx.heads, |h, truth| {
                Ok(set.at(l, h)?.snap(truth, self.snapping)?)
            })
        })
    }
}

/// A fitted substitute (PROTOCOL §5, sender-side construction): the
/// source's keys at the sites (a held-out sender's, or the receiver's under
/// calibrated noise: what the map was fitted on; the plan checks) replaced
/// by the fitted map's prediction of the receiver's keys. Its achieved
/// cosine is that of the mapped keys to the keys it was given.
#[derive(Debug, Clone)]
pub struct FittedSubstitute {
    /// The fitted map's resource name.
    pub map: String,
}

impl Transform for FittedSubstitute {
    fn name(&self) -> String {
        format!("map({})", self.map)
    }

    fn resources(&self) -> Vec<String> {
        vec![self.map.clone()]
    }

    fn apply(&self, value: CarrierValue, cx: &TransformCx) -> Result<(CarrierValue, Achieved)> {
        let fm = downcast::<FittedMap>(resource(cx, &self.map)?, "fitted map")?;
        map_keys(value, cx, |l, k| {
            let t = k.dims()[2];
            let live: Vec<usize> = cx.sites.iter().copied().filter(|&s| s < t).collect();
            if live.is_empty() {
                return Ok((k.clone(), Vec::new()));
            }
            let idx = Tensor::from_vec(
                live.iter().map(|&s| s as u32).collect::<Vec<_>>(),
                live.len(),
                k.device(),
            )?;
            // [n, n_kv, hd]: every head's keys at the sites (an MLP maps
            // them jointly), positions for the pre-RoPE frame.
            let rows = k
                .squeeze(0)?
                .contiguous()?
                .index_select(&idx, 1)?
                .transpose(0, 1)?
                .contiguous()?;
            let mapped = fm.apply(l, &rows, &live)?;
            substitute_keys(k, cx.sites, cx.heads, |h, _| {
                Ok(mapped.narrow(1, h, 1)?.squeeze(1)?.contiguous()?)
            })
        })
    }
}

/// How far a blend moves toward the other state.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BlendBy {
    /// By a fixed weight: x + alpha (y - x).
    Alpha(f64),
    /// By the weight at which the blend's cosine to the source, flattened
    /// over the sites (and heads) of one layer's keys or values, reaches a
    /// target (found by bisection on [0, 1]; 1 when even the other state
    /// itself is closer than the target, so the achieved cosine stays above
    /// it; 0 for a target of 1, the source as it is).
    Cosine(f64),
}

/// Genuine interpolation (PROTOCOL §5): the source moved toward another
/// pass's state (another item's cache) at the sites both hold; positions
/// outside the overlap keep the source's values. The on-manifold-in-content
/// counterpart of cosine-calibrated noise: a blend of two genuine caches.
#[derive(Debug, Clone)]
pub struct BlendToward {
    /// The state moved toward.
    pub toward: std::sync::Arc<dyn Source>,
    /// How far.
    pub by: BlendBy,
}

/// `x + a (y - x)` at the masked cells, `x` elsewhere.
fn blend_at(x: &[f32], y: &[f32], mask: &[bool], a: f64) -> Vec<f32> {
    x.iter()
        .zip(y)
        .zip(mask)
        .map(|((&xi, &yi), &m)| {
            if m {
                (xi as f64 + a * (yi as f64 - xi as f64)) as f32
            } else {
                xi
            }
        })
        .collect()
}

/// Cosine of `a` to `b` over the masked cells.
fn masked_cosine(a: &[f32], b: &[f32], mask: &[bool]) -> f64 {
    let (mut d, mut na, mut nb) = (0f64, 0f64, 0f64);
    for ((&x, &y), &m) in a.iter().zip(b).zip(mask) {
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

impl BlendToward {
    /// `x` (one layer's keys or values, or a residual) blended toward `y`
    /// (same rank; fitted to `x`'s length along `axis`) at the `sites` (and
    /// `heads` on axis 1), and the achieved cosine to `x` there.
    fn blend(
        &self,
        x: &Tensor,
        y: &Tensor,
        axis: usize,
        sites: &[usize],
        heads: Option<&[usize]>,
    ) -> Result<(Tensor, Option<f64>)> {
        let have = y.dims()[axis];
        let live: Vec<usize> = sites.iter().copied().filter(|&s| s < have).collect();
        if live.is_empty() {
            return Ok((x.clone(), None));
        }
        let y = tolerable_carrier::inject::fit_positions(y, x, axis)?;
        let mask = site_mask(
            x.dims(),
            Some((axis, &live)),
            heads.map(|h| (1, h)),
            x.device(),
        )?
        .broadcast_as(x.dims())?
        .flatten_all()?
        .to_vec1::<u8>()?
        .into_iter()
        .map(|m| m != 0)
        .collect::<Vec<bool>>();
        let xs: Vec<f32> = x.flatten_all()?.to_vec1()?;
        let ys: Vec<f32> = y.flatten_all()?.to_vec1()?;
        let a = match self.by {
            BlendBy::Alpha(a) => a,
            // A target of 1 is the source itself (bisection would stop a
            // rounding step away from it).
            BlendBy::Cosine(target) if target >= 1.0 => 0.0,
            BlendBy::Cosine(target) => {
                let at = |a: f64| masked_cosine(&blend_at(&xs, &ys, &mask, a), &xs, &mask);
                if at(1.0) >= target {
                    1.0
                } else {
                    let (mut lo, mut hi) = (0.0, 1.0);
                    for _ in 0..60 {
                        let mid = 0.5 * (lo + hi);
                        if at(mid) >= target {
                            lo = mid;
                        } else {
                            hi = mid;
                        }
                    }
                    lo
                }
            }
        };
        let out = blend_at(&xs, &ys, &mask, a);
        let cos = masked_cosine(&out, &xs, &mask);
        Ok((Tensor::from_vec(out, x.dims(), x.device())?, Some(cos)))
    }
}

impl Transform for BlendToward {
    fn name(&self) -> String {
        match self.by {
            BlendBy::Alpha(a) => format!("blend(toward {}, alpha {a})", self.toward.name()),
            BlendBy::Cosine(c) => format!("blend(toward {}, cosine {c})", self.toward.name()),
        }
    }

    fn apply(&self, value: CarrierValue, cx: &TransformCx) -> Result<(CarrierValue, Achieved)> {
        let (other, _) =
            self.toward
                .provide(cx.passes, cx.base, cx.carrier, cx.layers, cx.resources)?;
        let mut ach = Vec::new();
        match value {
            CarrierValue::Resid(mut m) => {
                for &l in cx.layers {
                    let x = m.get(&l).ok_or_else(|| {
                        DriverError::Records(format!("internal: no residual at layer {l}"))
                    })?;
                    let (out, cos) = self.blend(x, other.resid(l)?, 1, cx.sites, None)?;
                    ach.extend(cos.map(|c| (HookPoint::ResidPre(l).to_string(), c)));
                    m.insert(l, out);
                }
                Ok((CarrierValue::Resid(m), ach))
            }
            CarrierValue::Kv(mut c) => {
                let o = other.kv()?;
                for &l in cx.layers {
                    let (kv, ov) = (c.require_layer(l)?.clone(), o.require_layer(l)?);
                    let k = if cx.carrier.has_k() {
                        let (t, cos) = self.blend(&kv.k, &ov.k, 2, cx.sites, cx.heads)?;
                        ach.extend(cos.map(|c| (HookPoint::RotK(l).to_string(), c)));
                        t
                    } else {
                        kv.k.clone()
                    };
                    let v = if cx.carrier.has_v() {
                        let (t, cos) = self.blend(&kv.v, &ov.v, 2, cx.sites, cx.heads)?;
                        ach.extend(cos.map(|c| (HookPoint::V(l).to_string(), c)));
                        t
                    } else {
                        kv.v.clone()
                    };
                    c.set_layer(l, k, v)?;
                }
                Ok((CarrierValue::Kv(c), ach))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blend(by: BlendBy) -> BlendToward {
        BlendToward {
            toward: std::sync::Arc::new(crate::sources::PassSource::own()),
            by,
        }
    }

    /// Two sites of two coordinates: at site 0 (never blended) x = e0 and
    /// y = e1; at site 1, x = e0 and y = c e0 + sqrt(1 - c^2) e1, at cosine c.
    fn pair(c: f64) -> (Tensor, Tensor) {
        let s = (1.0 - c * c).sqrt();
        let x = Tensor::from_vec(
            vec![1f32, 0.0, 1.0, 0.0],
            (1, 2, 2),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let y = Tensor::from_vec(
            vec![0f32, 1.0, c as f32, s as f32],
            (1, 2, 2),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        (x, y)
    }

    #[test]
    fn a_blend_reaches_a_reachable_cosine_and_stops_at_the_other_state_below_it() {
        // Site 1 only: x's row is e0 there, y's is at cosine -0.6 to it.
        let (x, y) = pair(-0.6);
        let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        // Reachable targets, including 0 and negative ones, are met.
        for target in [0.9, 0.0, -0.5] {
            let (out, cos) = blend(BlendBy::Cosine(target))
                .blend(&x, &y, 1, &[1], None)
                .unwrap();
            let c = cos.unwrap();
            assert!((c - target).abs() < 1e-6, "{target}: {c}");
            // The unmasked site keeps x's values.
            assert_eq!(&bits(&out)[..2], &[1.0, 0.0]);
        }
        // Below the other state's own cosine the blend is the other state,
        // and the achieved cosine (above the target) says so.
        let (out, cos) = blend(BlendBy::Cosine(-0.9))
            .blend(&x, &y, 1, &[1], None)
            .unwrap();
        assert!((cos.unwrap() - -0.6).abs() < 1e-6);
        assert_eq!(&bits(&out)[2..], &bits(&y)[2..]);
        // A target of 1 leaves x as it was.
        let (out, cos) = blend(BlendBy::Cosine(1.0))
            .blend(&x, &y, 1, &[1], None)
            .unwrap();
        assert_eq!(bits(&out), bits(&x));
        assert!((cos.unwrap() - 1.0).abs() < 1e-12);
    }
}
