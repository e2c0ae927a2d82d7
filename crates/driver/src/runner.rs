//! The runner: for one item, the receiver's masked and full passes (and a
//! mis-source partner's full pass where an arm needs it) are computed once
//! and shared by every arm. A cache-only arm then recomputes only the
//! question and the decoded tokens; a residual arm at layer l recomputes
//! only layers >= l, and only from the first position it changes. Arms
//! whose caches share a layout run the question and decoding as one batch.

use crate::arm::{Base, Expect, Source};
use crate::config::PlannedArm;
use crate::error::{DriverError, Result};
use candle_core::{Tensor, D};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;
use tolerable_carrier::fidelity::mean_vector_cosine;
use tolerable_carrier::{append_kv, edit_kv, Carrier, Geometry, KvSites, Mechanism};
use tolerable_probe::SplitItem;
use tolerable_runtime::gates::bit_equal;
use tolerable_runtime::{
    GreedyOptions, HookPoint, HookSpec, Intervention, KvCache, LogitsAt, Model,
};

/// The receiver's pass over one item's context (template prefix and
/// passage): its cache, and its residual stream at the layers arms need.
#[derive(Debug, Clone)]
pub struct Pass {
    /// Keys and values of every context position, batch 1.
    pub cache: KvCache,
    /// `blocks.{l}.hook_resid_pre`, `[1, context_len, d_model]`, where needed.
    pub resid: BTreeMap<usize, Tensor>,
}

impl Pass {
    fn resid(&self, l: usize) -> Result<&Tensor> {
        self.resid.get(&l).ok_or_else(|| {
            DriverError::Records(format!("internal: residual of layer {l} was not captured"))
        })
    }
}

/// What one arm produced on one item.
#[derive(Debug, Clone)]
pub struct ArmOutcome {
    /// Greedy continuation ids.
    pub tokens: Vec<u32>,
    /// Logits at the last question position, for the bit-exact gates.
    pub first_logits: Tensor,
    /// Mean cosine of the injected slots to the native state there
    /// (over layers, heads and sites); `None` without injection.
    pub fidelity_cosine: Option<f64>,
    /// Mean cosine of the perturbed source to the unperturbed source at the
    /// sites; `None` without perturbation.
    pub achieved_cosine: Option<f64>,
    /// Positions injected (per layer).
    pub n_sites: usize,
    /// Seconds spent on this arm: its own preparation plus its share of
    /// the batched question and decoding.
    pub seconds: f64,
    /// Outcome of the arm's `expect` gate, where it has one.
    pub bit_exact: Option<bool>,
}

/// Where one item's time went.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ItemTiming {
    /// The shared masked and full passes (and a partner's pass).
    pub passes_s: f64,
    /// Preparing every arm's cache (edits, residual restarts).
    pub prepare_s: f64,
    /// The question and decoding of every arm (batched or not).
    pub decode_s: f64,
}

/// How the runner batches arms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Batching {
    /// Arms whose caches share a layout run the question and decoding together.
    Batched,
    /// Each arm runs the question and decoding alone (the baseline).
    OneAtATime,
}

/// Runs a set of arms on items with one receiver.
pub struct Runner<'a> {
    model: &'a Model,
    arms: &'a [PlannedArm],
    layers: Vec<Vec<Vec<usize>>>,
    greedy: GreedyOptions,
    seed: u64,
    batching: Batching,
    need_masked: BTreeSet<usize>,
    need_full: BTreeSet<usize>,
    need_partner: bool,
    floor: usize,
    native: usize,
}

fn mix(seed: u64, parts: &[u64]) -> u64 {
    let mut h = seed ^ 0x243F_6A88_85A3_08D3;
    for &p in parts {
        h = (h ^ p).wrapping_mul(0x100_0000_01B3).rotate_left(23);
    }
    h
}

impl<'a> Runner<'a> {
    /// A runner for `arms` (validated) on `model`, decoding `new_tokens`
    /// greedily; `seed` seeds perturbations. `floor` and `native` index the
    /// anchor arms.
    pub fn new(
        model: &'a Model,
        arms: &'a [PlannedArm],
        floor: usize,
        native: usize,
        new_tokens: usize,
        seed: u64,
    ) -> Result<Self> {
        let n = model.config().n_layers;
        let mut layers = Vec::with_capacity(arms.len());
        let (mut need_masked, mut need_full) = (BTreeSet::new(), BTreeSet::new());
        let mut need_partner = false;
        for pa in arms {
            let mut per = Vec::new();
            for (j, inj) in pa.arm.inject.iter().enumerate() {
                let ls = inj
                    .layers
                    .resolve(n, &format!("{}.inject[{j}].layers", pa.arm.name))?;
                if inj.carrier == Carrier::H {
                    // Base pass (own state and restart point) and native (fidelity).
                    let base = if pa.arm.base == Base::Masked {
                        &mut need_masked
                    } else {
                        &mut need_full
                    };
                    base.extend(ls.iter().copied());
                    need_full.extend(ls.iter().copied());
                    if matches!(inj.source, Source::Own) {
                        let own = if pa.arm.base == Base::Masked {
                            &mut need_masked
                        } else {
                            &mut need_full
                        };
                        own.extend(ls.iter().copied());
                    }
                }
                if matches!(inj.source, Source::OtherItem) {
                    need_partner = true;
                }
                per.push(ls);
            }
            layers.push(per);
        }
        Ok(Self {
            model,
            arms,
            layers,
            greedy: GreedyOptions::tokens(new_tokens),
            seed,
            batching: Batching::Batched,
            need_masked,
            need_full,
            need_partner,
            floor,
            native,
        })
    }

    /// Sets how arms are batched.
    pub fn with_batching(mut self, batching: Batching) -> Self {
        self.batching = batching;
        self
    }

    /// Whether some arm needs a mis-source partner's pass.
    pub fn needs_partner(&self) -> bool {
        self.need_partner
    }

    /// The item's context geometry.
    pub fn geometry(item: &SplitItem) -> Geometry {
        Geometry {
            passage_start: item.prefix_ids.len(),
            context_len: item.context_len(),
            fact: item.fact_positions(),
        }
    }

    fn capture(layers: &BTreeSet<usize>) -> HookSpec {
        HookSpec::new().capture_all(layers.iter().map(|&l| HookPoint::ResidPre(l)))
    }

    /// The masked and full passes of `item`: the fact-free common prefix is
    /// read once, then each remainder on top of it.
    pub fn passes(&self, item: &SplitItem) -> Result<(Pass, Pass)> {
        let m = self.model;
        let full: Vec<u32> = [&item.prefix_ids[..], &item.full_passage].concat();
        let masked: Vec<u32> = [&item.prefix_ids[..], &item.masked_passage].concat();
        // At least one token remains for each remainder.
        let shared = item.common_prefix_len().min(full.len() - 1);
        let union: BTreeSet<usize> = self.need_masked.union(&self.need_full).copied().collect();
        let mut prefix = m.new_cache(1);
        let mut prefix_resid = BTreeMap::new();
        if shared > 0 {
            let out = m.forward(
                &m.tokens(&[full[..shared].to_vec()])?,
                &mut prefix,
                &Self::capture(&union),
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
                &Self::capture(need),
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
            rest(&masked, &self.need_masked)?,
            rest(&full, &self.need_full)?,
        ))
    }

    /// A partner item's full pass (the mis-source holder).
    pub fn partner_pass(&self, item: &SplitItem) -> Result<Pass> {
        let m = self.model;
        let full: Vec<u32> = [&item.prefix_ids[..], &item.full_passage].concat();
        let mut cache = m.new_cache(1);
        let need: BTreeSet<usize> = self.need_full.clone();
        let out = m.forward(
            &m.tokens(&[full])?,
            &mut cache,
            &Self::capture(&need),
            LogitsAt::None,
        )?;
        let mut resid = BTreeMap::new();
        for &l in &need {
            resid.insert(l, out.hooks.require(HookPoint::ResidPre(l))?.clone());
        }
        Ok(Pass { cache, resid })
    }

    /// Runs every arm on `item` (its index `item_index` seeds
    /// perturbations); `partner` is the mis-source partner, needed when
    /// [`Runner::needs_partner`].
    pub fn run_item(
        &self,
        item: &SplitItem,
        item_index: usize,
        partner: Option<&SplitItem>,
    ) -> Result<Vec<ArmOutcome>> {
        Ok(self.run_item_timed(item, item_index, partner)?.0)
    }

    /// As [`Runner::run_item`], also saying where the time went.
    pub fn run_item_timed(
        &self,
        item: &SplitItem,
        item_index: usize,
        partner: Option<&SplitItem>,
    ) -> Result<(Vec<ArmOutcome>, ItemTiming)> {
        let mut timing = ItemTiming::default();
        let t_passes = Instant::now();
        let (masked, full) = self.passes(item)?;
        let partner_pass = match (self.need_partner, partner) {
            (true, Some(p)) => Some((self.partner_pass(p)?, Self::geometry(p))),
            (true, None) => {
                return Err(DriverError::Config(format!(
                    "item {}: an arm takes another item's state, but no partner was given",
                    item.item.id
                )))
            }
            _ => None,
        };
        timing.passes_s = t_passes.elapsed().as_secs_f64();
        let g = Self::geometry(item);
        let mut prepared = Vec::with_capacity(self.arms.len());
        for (a, pa) in self.arms.iter().enumerate() {
            let t0 = Instant::now();
            let p = self.prepare(
                a,
                pa,
                &g,
                &masked,
                &full,
                partner_pass.as_ref().map(|(p, g)| (p, g)),
                item_index,
            )?;
            prepared.push((p, t0.elapsed().as_secs_f64()));
        }
        timing.prepare_s = prepared.iter().map(|p| p.1).sum();
        // Group arms by cache layout; each group runs the question and decoding as one batch.
        let mut groups: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (a, (p, _)) in prepared.iter().enumerate() {
            let key = match self.batching {
                Batching::Batched => format!("{}:{:?}", p.cache.len(), p.cache.segments()),
                Batching::OneAtATime => format!("arm{a:06}"),
            };
            groups.entry(key).or_default().push(a);
        }
        let mut results: Vec<Option<(Vec<u32>, Tensor, f64)>> = vec![None; self.arms.len()];
        for members in groups.values() {
            let t0 = Instant::now();
            let refs: Vec<&KvCache> = members.iter().map(|&a| &prepared[a].0.cache).collect();
            let mut cache = KvCache::stack(&refs)?;
            let prompt = vec![item.suffix_ids.clone(); members.len()];
            let gen = self.model.generate(&prompt, &mut cache, &self.greedy)?;
            let spent = t0.elapsed().as_secs_f64();
            timing.decode_s += spent;
            let share = spent / members.len() as f64;
            for (row, &a) in members.iter().enumerate() {
                results[a] = Some((
                    gen.tokens[row].clone(),
                    gen.first_logits.narrow(0, row, 1)?,
                    share,
                ));
            }
        }
        let mut out = Vec::with_capacity(self.arms.len());
        for (a, (p, prep_s)) in prepared.into_iter().enumerate() {
            let (tokens, first_logits, share) = results[a].take().expect("every arm ran");
            out.push(ArmOutcome {
                tokens,
                first_logits,
                fidelity_cosine: p.fidelity,
                achieved_cosine: p.achieved,
                n_sites: p.n_sites,
                seconds: prep_s + share,
                bit_exact: None,
            });
        }
        // The per-item gates: arms that must equal an anchor bit for bit.
        for (a, pa) in self.arms.iter().enumerate() {
            if let Some(e) = pa.arm.expect {
                let r = match e {
                    Expect::Floor => self.floor,
                    Expect::Native => self.native,
                };
                let same = out[a].tokens == out[r].tokens
                    && bit_equal(&out[a].first_logits, &out[r].first_logits)?;
                out[a].bit_exact = Some(same);
            }
        }
        Ok((out, timing))
    }

    #[allow(clippy::too_many_arguments)]
    fn prepare(
        &self,
        a: usize,
        pa: &PlannedArm,
        g: &Geometry,
        masked: &Pass,
        full: &Pass,
        partner: Option<(&Pass, &Geometry)>,
        item_index: usize,
    ) -> Result<Prepared> {
        let arm = &pa.arm;
        let base = if arm.base == Base::Masked {
            masked
        } else {
            full
        };
        let source_pass = |s: &Source| -> Result<&Pass> {
            Ok(match s {
                Source::Own => base,
                Source::Native | Source::Holder => full,
                Source::OtherItem => partner.map(|p| p.0).ok_or_else(|| {
                    DriverError::Config("internal: mis-source partner pass missing".into())
                })?,
                other => {
                    return Err(DriverError::Inapplicable {
                        arm: arm.name.clone(),
                        field: "source".into(),
                        reason: format!("source `{}` is not built by this runner", other.name()),
                    })
                }
            })
        };
        let mut cache = base.cache.clone();
        let mut fid: Vec<f64> = Vec::new();
        let mut ach: Vec<f64> = Vec::new();
        let mut n_sites = 0;
        let seed_of = |j: usize, l: usize, which: u64| {
            mix(
                self.seed,
                &[item_index as u64, a as u64, j as u64, l as u64, which],
            )
        };

        // 1. Residual injections: one restart from the lowest layer, with
        //    hook edits at every injected layer, from the first changed position.
        let h_injs: Vec<usize> = (0..arm.inject.len())
            .filter(|&j| arm.inject[j].carrier == Carrier::H)
            .collect();
        let mut edits: Vec<(usize, usize, Vec<usize>, Tensor)> = Vec::new(); // (j, layer, sites, source)
        for &j in &h_injs {
            let inj = &arm.inject[j];
            let sites = inj.positions.resolve(g);
            n_sites = n_sites.max(sites.len());
            if sites.is_empty() {
                continue;
            }
            let sp = source_pass(&inj.source)?;
            for &l in &self.layers[a][j] {
                let own = base.resid(l)?;
                let mut src = sp.resid(l)?.clone();
                let have = src.dim(1)?;
                if let Some(&bad) = sites.iter().find(|&&p| p >= have) {
                    return Err(DriverError::Inapplicable {
                        arm: arm.name.clone(),
                        field: "positions".into(),
                        reason: format!("position {bad} is outside the source's {have} positions"),
                    });
                }
                src = tolerable_carrier::inject::fit_positions(&src, own, 1)?;
                if let Some(p) = &inj.perturb {
                    let mask = site_mask(&sites, own.dim(1)?, 1, own.rank())?;
                    let pert = p.apply(&src, Some(&mask), seed_of(j, l, 0))?;
                    ach.push(site_cosine(&pert, &src, 1, &sites)?);
                    src = pert;
                }
                let injected = tolerable_carrier::edit_resid(
                    own,
                    &src,
                    l,
                    &sites,
                    inj.mechanism,
                    inj.alpha.unwrap_or(1.0),
                )?;
                fid.push(mean_vector_cosine(
                    &injected,
                    full.resid(l)?,
                    1,
                    Some(&sites),
                )?);
                edits.push((j, l, sites.clone(), src));
            }
        }
        if !edits.is_empty() {
            let start = edits.iter().map(|e| e.1).min().unwrap();
            let p0 = edits
                .iter()
                .flat_map(|e| e.2.iter().copied())
                .min()
                .unwrap();
            let t = g.context_len;
            let mut spec = HookSpec::new();
            for (j, l, sites, src) in &edits {
                let inj = &arm.inject[*j];
                let src = src.narrow(1, p0, t - p0)?;
                let alpha = inj.alpha.unwrap_or(1.0);
                let edit = tolerable_carrier::inject::edit_for(inj.mechanism, alpha, src)?;
                let local: Vec<usize> = sites.iter().map(|p| p - p0).collect();
                spec = spec.intervene(
                    Intervention::new(HookPoint::ResidPre(*l), edit).at_positions(local),
                );
            }
            let resid_in = base.resid(start)?.narrow(1, p0, t - p0)?;
            let lower = base.cache.narrow(p0, t - p0)?;
            let mut c = base.cache.truncate(p0)?;
            self.model.forward_from_layer(
                start,
                &resid_in,
                &lower,
                &mut c,
                &spec,
                LogitsAt::None,
            )?;
            cache = c;
        }

        // 2. Cache edits and 3. appended segments, in order.
        for (j, inj) in arm.inject.iter().enumerate() {
            if inj.carrier == Carrier::H {
                continue;
            }
            let sites = inj.positions.resolve(g);
            n_sites = n_sites.max(sites.len());
            let sp = source_pass(&inj.source)?;
            let mut src = sp.cache.clone();
            if let Some(p) = &inj.perturb {
                for &l in &self.layers[a][j] {
                    let kv = src.require_layer(l)?.clone();
                    let perturb_one =
                        |t: &Tensor, which: u64, ach: &mut Vec<f64>| -> Result<Tensor> {
                            let live: Vec<usize> = sites
                                .iter()
                                .copied()
                                .filter(|&s| s < t.dim(2).unwrap_or(0))
                                .collect();
                            let mut mask = site_mask(&live, t.dim(2)?, 2, 4)?;
                            if let Some(h) = &inj.heads {
                                mask = mask.broadcast_mul(&head_mask(h, t.dim(1)?)?)?;
                            }
                            let out = p.apply(t, Some(&mask), seed_of(j, l, which))?;
                            ach.push(site_cosine(&out, t, 2, &live)?);
                            Ok(out)
                        };
                    let k = if inj.carrier.has_k() {
                        perturb_one(&kv.k, 1, &mut ach)?
                    } else {
                        kv.k.clone()
                    };
                    let v = if inj.carrier.has_v() {
                        perturb_one(&kv.v, 2, &mut ach)?
                    } else {
                        kv.v.clone()
                    };
                    src.set_layer(l, k, v)?;
                }
            }
            if inj.mechanism == Mechanism::Append {
                // The appended span is the source's own passage (or context).
                let span = match (&inj.source, partner) {
                    (Source::OtherItem, Some((_, pg))) => inj.positions.resolve(pg),
                    _ => sites.clone(),
                };
                let (lo, hi) = (span[0], *span.last().unwrap() + 1);
                if hi > src.len() {
                    return Err(DriverError::Inapplicable {
                        arm: arm.name.clone(),
                        field: "positions".into(),
                        reason: format!(
                            "the source holds {} entries, the span ends at {hi}",
                            src.len()
                        ),
                    });
                }
                cache = append_kv(&cache, &src, lo, hi - lo)?;
                // Fidelity of an appended segment: its cosine to the native entries at the same positions.
                if hi <= full.cache.len() {
                    let nat = full.cache.narrow(lo, hi - lo)?;
                    let app = src.narrow(lo, hi - lo)?;
                    fid.push(kv_fidelity(
                        &app,
                        &nat,
                        inj.carrier,
                        &self.layers[a][j],
                        None,
                    )?);
                }
            } else {
                let live: Vec<usize> = sites.iter().copied().filter(|&s| s < src.len()).collect();
                if live.len() < sites.len() {
                    return Err(DriverError::Inapplicable {
                        arm: arm.name.clone(),
                        field: "positions".into(),
                        reason: format!(
                            "the source holds {} entries, fewer than the sites need",
                            src.len()
                        ),
                    });
                }
                cache = edit_kv(
                    &cache,
                    &src,
                    &KvSites {
                        carrier: inj.carrier,
                        layers: &self.layers[a][j],
                        positions: Some(&sites),
                        heads: inj.heads.as_deref(),
                    },
                    inj.mechanism,
                    inj.alpha.unwrap_or(1.0),
                )?;
                if !sites.is_empty() {
                    fid.push(kv_fidelity(
                        &cache,
                        &full.cache,
                        inj.carrier,
                        &self.layers[a][j],
                        Some(&sites),
                    )?);
                }
            }
        }
        let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
        Ok(Prepared {
            cache,
            fidelity: mean(&fid),
            achieved: mean(&ach),
            n_sites,
        })
    }
}

struct Prepared {
    cache: KvCache,
    fidelity: Option<f64>,
    achieved: Option<f64>,
    n_sites: usize,
}

/// A u8 mask `[1, .., len at axis, ..]` of rank `rank`, 1 at `sites`.
fn site_mask(sites: &[usize], len: usize, axis: usize, rank: usize) -> Result<Tensor> {
    let mut data = vec![0u8; len];
    for &s in sites {
        if s < len {
            data[s] = 1;
        }
    }
    let mut shape = vec![1usize; rank];
    shape[axis] = len;
    Ok(Tensor::from_vec(data, shape, &candle_core::Device::Cpu)?)
}

fn head_mask(heads: &[usize], n: usize) -> Result<Tensor> {
    let mut data = vec![0u8; n];
    for &h in heads {
        data[h] = 1;
    }
    Ok(Tensor::from_vec(
        data,
        (1, n, 1, 1),
        &candle_core::Device::Cpu,
    )?)
}

/// Cosine of `a` to `b` flattened over the sites (as the perturbation calibrates it).
fn site_cosine(a: &Tensor, b: &Tensor, axis: usize, sites: &[usize]) -> Result<f64> {
    if sites.is_empty() {
        return Ok(1.0);
    }
    let idx = Tensor::from_vec(
        sites.iter().map(|&s| s as u32).collect::<Vec<_>>(),
        sites.len(),
        a.device(),
    )?;
    let a = a
        .index_select(&idx, axis)?
        .flatten_all()?
        .to_dtype(candle_core::DType::F64)?;
    let b = b
        .index_select(&idx, axis)?
        .flatten_all()?
        .to_dtype(candle_core::DType::F64)?;
    let dot = (&a * &b)?.sum(D::Minus1)?.to_scalar::<f64>()?;
    let na = a.sqr()?.sum(D::Minus1)?.to_scalar::<f64>()?.sqrt();
    let nb = b.sqr()?.sum(D::Minus1)?.to_scalar::<f64>()?.sqrt();
    Ok(if na * nb > 0.0 { dot / (na * nb) } else { 1.0 })
}

/// Mean per-vector cosine of a cache's carrier to the native cache over
/// `layers` (and `sites`, else every entry).
fn kv_fidelity(
    cache: &KvCache,
    native: &KvCache,
    carrier: Carrier,
    layers: &[usize],
    sites: Option<&[usize]>,
) -> Result<f64> {
    let mut acc = Vec::new();
    for &l in layers {
        let (a, b) = (cache.require_layer(l)?, native.require_layer(l)?);
        if carrier.has_k() {
            acc.push(mean_vector_cosine(&a.k, &b.k, 2, sites)?);
        }
        if carrier.has_v() {
            acc.push(mean_vector_cosine(&a.v, &b.v, 2, sites)?);
        }
    }
    Ok(acc.iter().sum::<f64>() / acc.len().max(1) as f64)
}
