//! The passes of one item that every arm shares: the receiver reading the
//! base context and the alternative context (the fact-free shared prefix is
//! read once), the mis-source partners' alternative contexts, and the
//! question's queries over the native cache. What is captured is declared by
//! the plan ([`PassNeeds`]); nothing else is kept.

use crate::error::{DriverError, Result};
use crate::sources::PassRef;
use candle_core::Tensor;
use std::collections::{BTreeMap, BTreeSet};
use tolerable_carrier::{Geometry, Positions};
use tolerable_probe::ContextPair;
use tolerable_runtime::{HookPoint, HookSpec, KvCache, LogitsAt, Model};

/// The receiver's pass over one context (template prefix and passage): its
/// cache, and its residual stream at the layers arms need.
#[derive(Debug, Clone)]
pub struct Pass {
    /// Keys and values of every context position, batch 1.
    pub cache: KvCache,
    /// `blocks.{l}.hook_resid_pre`, `[1, context_len, d_model]`, where needed.
    pub resid: BTreeMap<usize, Tensor>,
}

impl Pass {
    /// The residual stream at the input of block `l`.
    pub fn resid(&self, l: usize) -> Result<&Tensor> {
        self.resid.get(&l).ok_or_else(|| {
            DriverError::Records(format!("internal: residual of layer {l} was not captured"))
        })
    }
}

/// What the plan needs of every item's passes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PassNeeds {
    /// Residual layers captured on the base (masked) context.
    pub base_resid: BTreeSet<usize>,
    /// Residual layers captured on the alternative (full) context.
    pub alt_resid: BTreeSet<usize>,
    /// Residual layers captured on the partners' alternative contexts.
    pub partner_resid: BTreeSet<usize>,
    /// Mis-source partners read per item.
    pub partners: usize,
    /// Layers whose question queries (`hook_rot_q` of the suffix read over
    /// the native cache) are captured, for attention-logit correlations.
    pub queries: BTreeSet<usize>,
    /// Held-out senders reading the alternative context, by key, with the
    /// residual layers captured.
    pub senders: BTreeMap<String, BTreeSet<usize>>,
}

impl PassNeeds {
    /// The capture set of a pass.
    pub fn resid_of(&mut self, pass: PassRef) -> &mut BTreeSet<usize> {
        match pass {
            PassRef::ArmBase => &mut self.base_resid,
            PassRef::Alt => &mut self.alt_resid,
            PassRef::Partner(_) => &mut self.partner_resid,
        }
    }
}

/// One item's shared passes.
#[derive(Debug, Clone)]
pub struct ItemPasses {
    /// The base (masked) context.
    pub base: Pass,
    /// The alternative (full) context.
    pub alt: Pass,
    /// The partners' alternative contexts, with their geometry.
    pub partners: Vec<(Pass, Geometry)>,
    /// The item's geometry.
    pub geometry: Geometry,
    /// Question queries over the native cache, `[1, n_heads, suffix_len, head_dim]` by layer.
    pub queries: BTreeMap<usize, Tensor>,
    /// Held-out senders' passes over the alternative context, by key.
    pub senders: BTreeMap<String, Pass>,
}

/// The layout of a pair's context.
pub fn geometry(pair: &ContextPair) -> Geometry {
    Geometry {
        passage_start: pair.span_start,
        context_len: pair.base_len(),
        fact: pair.focus.clone(),
    }
}

/// The positions `positions` names in `pair`'s full-passage (alternative)
/// context, those past its end dropped: the rows a fitted resource reads
/// from a passage.
pub fn alt_sites(positions: Positions, pair: &ContextPair) -> Vec<usize> {
    let len = pair.alt_len();
    positions
        .resolve(&geometry(pair))
        .into_iter()
        .filter(|&p| p < len)
        .collect()
}

fn capture(layers: &BTreeSet<usize>) -> HookSpec {
    HookSpec::new().capture_all(layers.iter().map(|&l| HookPoint::ResidPre(l)))
}

/// The base and alternative passes of `pair`: the fact-free shared prefix
/// is read once, then each remainder on top of it.
pub fn context_passes(
    model: &Model,
    pair: &ContextPair,
    needs: &PassNeeds,
) -> Result<(Pass, Pass)> {
    let m = model;
    let alt = pair.alt_context();
    let base = pair.base_context();
    // At least one token remains for each remainder.
    let shared = pair.shared.len().min(alt.len() - 1).min(base.len() - 1);
    let union: BTreeSet<usize> = needs.base_resid.union(&needs.alt_resid).copied().collect();
    let mut prefix = m.new_cache(1);
    let mut prefix_resid = BTreeMap::new();
    if shared > 0 {
        let out = m.forward(
            &m.tokens(&[alt[..shared].to_vec()])?,
            &mut prefix,
            &capture(&union),
            LogitsAt::None,
        )?;
        for &l in &union {
            prefix_resid.insert(l, out.hooks.require(HookPoint::ResidPre(l))?.clone());
        }
    }
    let rest = |ids: &[u32], need: &BTreeSet<usize>| -> Result<Pass> {
        let mut cache = prefix.clone();
        let out = m.forward(
            &m.tokens(&[ids[shared..].to_vec()])?,
            &mut cache,
            &capture(need),
            LogitsAt::None,
        )?;
        let mut resid = BTreeMap::new();
        for &l in need {
            let tail = out.hooks.require(HookPoint::ResidPre(l))?;
            let whole = match prefix_resid.get(&l) {
                Some(head) => Tensor::cat(&[head, tail], 1)?,
                None => tail.clone(),
            };
            resid.insert(l, whole);
        }
        Ok(Pass { cache, resid })
    };
    Ok((
        rest(&base, &needs.base_resid)?,
        rest(&alt, &needs.alt_resid)?,
    ))
}

/// A context's alternative (full-passage) pass by `model`, read in one
/// call: a mis-source partner's, or a held-out sender's.
pub fn partner_pass(model: &Model, pair: &ContextPair, need: &BTreeSet<usize>) -> Result<Pass> {
    let m = model;
    let mut cache = m.new_cache(1);
    let out = m.forward(
        &m.tokens(&[pair.alt_context()])?,
        &mut cache,
        &capture(need),
        LogitsAt::None,
    )?;
    let mut resid = BTreeMap::new();
    for &l in need {
        resid.insert(l, out.hooks.require(HookPoint::ResidPre(l))?.clone());
    }
    Ok(Pass { cache, resid })
}

/// The question's post-RoPE queries at `layers`, read over the native cache
/// (`alt`): the queries the receiver forms when it has read the passage.
pub fn question_queries(
    model: &Model,
    pair: &ContextPair,
    alt: &Pass,
    layers: &BTreeSet<usize>,
) -> Result<BTreeMap<usize, Tensor>> {
    if layers.is_empty() {
        return Ok(BTreeMap::new());
    }
    let mut cache = alt.cache.clone();
    let spec = HookSpec::new().capture_all(layers.iter().map(|&l| HookPoint::RotQ(l)));
    let out = model.forward(
        &model.tokens(std::slice::from_ref(&pair.suffix))?,
        &mut cache,
        &spec,
        LogitsAt::None,
    )?;
    let mut q = BTreeMap::new();
    for &l in layers {
        q.insert(l, out.hooks.require(HookPoint::RotQ(l))?.clone());
    }
    Ok(q)
}

/// Every pass of one item that the plan needs; `senders` are the held-out
/// senders by key.
pub fn item_passes(
    model: &Model,
    pair: &ContextPair,
    partners: &[&ContextPair],
    needs: &PassNeeds,
    senders: &BTreeMap<String, Model>,
) -> Result<ItemPasses> {
    item_passes_with(model, pair, partners, needs, senders, None, None)
}

/// Mis-source partners' passes, read once per partner for the whole item
/// set: an item that is the partner of several items (every item of a pool
/// of N holders has N - 1) is read once. The same call computes the same
/// pass, so a cached pass is the pass. Bounded: past `limit` entries the
/// oldest half is dropped.
#[derive(Debug)]
pub struct PartnerPasses {
    map: std::sync::Mutex<(Vec<String>, std::collections::HashMap<String, Pass>)>,
    limit: usize,
}

impl Default for PartnerPasses {
    fn default() -> Self {
        Self::with_limit(512)
    }
}

impl PartnerPasses {
    /// A cache of at most `limit` partner passes.
    pub fn with_limit(limit: usize) -> Self {
        Self {
            map: Default::default(),
            limit: limit.max(1),
        }
    }

    /// The pass of `pair`'s alternative context capturing `need`.
    pub fn get_or_read(
        &self,
        model: &Model,
        pair: &ContextPair,
        need: &BTreeSet<usize>,
    ) -> Result<Pass> {
        let key = format!("{} {:?}", pair.id, need);
        if let Some(p) = self.map.lock().ok().and_then(|m| m.1.get(&key).cloned()) {
            return Ok(p);
        }
        let pass = partner_pass(model, pair, need)?;
        if let Ok(mut m) = self.map.lock() {
            if m.0.len() >= self.limit {
                let old: Vec<String> = m.0.drain(..self.limit.div_ceil(2)).collect();
                for k in old {
                    m.1.remove(&k);
                }
            }
            m.0.push(key.clone());
            m.1.insert(key, pass.clone());
        }
        Ok(pass)
    }

    /// Passes held.
    pub fn len(&self) -> usize {
        self.map.lock().map(|m| m.1.len()).unwrap_or(0)
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// As [`item_passes`], with the plan's cross-family holders (a sender key
/// that is no held-out sender is a cross-family holder, whose pass is its
/// projected reading of the alternative context, [`crate::cross`]) and the
/// item set's partner passes read so far.
pub fn item_passes_with(
    model: &Model,
    pair: &ContextPair,
    partners: &[&ContextPair],
    needs: &PassNeeds,
    senders: &BTreeMap<String, Model>,
    foreign: Option<&crate::cross::ForeignCx>,
    read: Option<&PartnerPasses>,
) -> Result<ItemPasses> {
    let (base, alt) = context_passes(model, pair, needs)?;
    if partners.len() < needs.partners {
        return Err(DriverError::Config(format!(
            "item {}: an arm takes {} other items' states, but {} partners were given",
            pair.id,
            needs.partners,
            partners.len()
        )));
    }
    let mut ps = Vec::with_capacity(needs.partners);
    for p in partners.iter().take(needs.partners) {
        let pass = match read {
            Some(r) => r.get_or_read(model, p, &needs.partner_resid)?,
            None => partner_pass(model, p, &needs.partner_resid)?,
        };
        ps.push((pass, geometry(p)));
    }
    let queries = question_queries(model, pair, &alt, &needs.queries)?;
    let mut sender_passes = BTreeMap::new();
    for (key, layers) in &needs.senders {
        let pass = match (senders.get(key), foreign) {
            (Some(sender), _) => partner_pass(sender, pair, layers)?,
            (None, Some(f)) if f.specs.contains_key(key) => match f.specs[key].partner {
                None => f.pass(key, &pair.alt_context(), &alt, layers)?,
                Some(r) => {
                    let (p, own) = match (partners.get(r), ps.get(r)) {
                        (Some(p), Some((own, _))) => (p, own),
                        _ => {
                            return Err(DriverError::Records(format!(
                                "internal: mis-source partner {r} of `{key}` missing"
                            )))
                        }
                    };
                    f.pass(key, &p.alt_context(), own, layers)?
                }
            },
            _ => {
                return Err(DriverError::Records(format!(
                    "internal: sender `{key}` was not built"
                )))
            }
        };
        sender_passes.insert(key.clone(), pass);
    }
    Ok(ItemPasses {
        base,
        alt,
        partners: ps,
        geometry: geometry(pair),
        queries,
        senders: sender_passes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn a_partner_is_read_once_and_the_cache_stays_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let ck = crate::test_support::tiny_checkpoint(dir.path());
        let items = tolerable_probe::sample::sample(
            &tolerable_probe::synthetic::generate(8, 1),
            &ck.tokenizer,
            &tolerable_probe::SplitOptions::default(),
            3,
            1,
        )
        .unwrap();
        let pairs: Vec<ContextPair> = items.items.iter().map(|i| i.pair()).collect();
        let need = BTreeSet::from([1usize]);
        let read = PartnerPasses::with_limit(2);
        let bits = |p: &Pass| {
            let k = &p.cache.require_layer(0).unwrap().k;
            let r = &p.resid[&1];
            (
                k.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                r.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            )
        };
        let fresh = partner_pass(&ck.model, &pairs[0], &need).unwrap();
        let a = read.get_or_read(&ck.model, &pairs[0], &need).unwrap();
        let b = read.get_or_read(&ck.model, &pairs[0], &need).unwrap();
        assert_eq!(read.len(), 1);
        assert_eq!(bits(&a), bits(&fresh));
        assert_eq!(bits(&b), bits(&fresh));
        read.get_or_read(&ck.model, &pairs[1], &need).unwrap();
        read.get_or_read(&ck.model, &pairs[2], &need).unwrap();
        assert!(read.len() <= 2, "{}", read.len());
        // Another capture set is another pass.
        let other = read
            .get_or_read(&ck.model, &pairs[2], &BTreeSet::from([0usize]))
            .unwrap();
        assert!(other.resid.contains_key(&0) && !other.resid.contains_key(&1));
    }
}
