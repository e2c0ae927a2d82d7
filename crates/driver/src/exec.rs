//! Executing one arm's program on one item: the receiver's cache after the
//! arm's injections, ready for the question, with what the injections
//! measured. Residual injections restart the forward once, from the lowest
//! injected layer and the first changed position; cache edits and appended
//! segments then act on the cache in order.

use crate::arm::Base;
use crate::error::{DriverError, Result};
use crate::passes::{ItemPasses, Pass};
use crate::plan::{ArmProgram, Step};
use crate::resources::Value;
use crate::sources::CarrierValue;
use crate::transforms::{Memo, TransformCx};
use candle_core::Tensor;
use std::collections::BTreeMap;
use tolerable_carrier::fidelity::{kv_fidelity, logit_correlation, mean_vector_cosine};
use tolerable_carrier::inject::{edit_for, fit_positions};
use tolerable_carrier::{append_kv, edit_kv, edit_resid, Geometry, KvSites, Mechanism};
use tolerable_runtime::{HookPoint, HookSpec, Intervention, KvCache, LogitsAt, Model};

/// What an arm's injections measured on one item.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Measures {
    /// Mean per-vector cosine of the injected slots to the native state.
    pub fidelity_cosine: Option<f64>,
    /// Mean cosine of transformed to untransformed source at the sites.
    pub achieved_cosine: Option<f64>,
    /// The same per layer and tensor, by hook point.
    pub achieved_at: Vec<(String, f64)>,
    /// Mean attention-logit correlation (question queries against the
    /// injected versus the native keys at the sites).
    pub logit_correlation: Option<f64>,
    /// Positions injected per layer (the most of any injection).
    pub n_sites: usize,
}

/// An arm's cache for one item, and its measures.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The receiver's cache after the injections.
    pub cache: KvCache,
    /// What they measured.
    pub measures: Measures,
    /// The hooks the question and decoding run with (a bridge's adapters;
    /// empty for most arms).
    pub question: HookSpec,
    /// Arms whose question hooks are equal share this key (they may decode
    /// as one batch).
    pub question_key: String,
}

/// Everything an arm's execution reads on one item.
pub struct ItemCx<'a> {
    /// The receiver.
    pub model: &'a Model,
    /// The item's passes.
    pub passes: &'a ItemPasses,
    /// The item's index in the run's sample (seeds perturbations).
    pub index: usize,
    /// The run's seed.
    pub seed: u64,
    /// The run's resources.
    pub resources: &'a BTreeMap<String, Value>,
    /// The item's shared work.
    pub memo: &'a Memo,
}

/// A seed from the run's seed and parts (item, arm, injection, layer, which).
pub fn mix(seed: u64, parts: &[u64]) -> u64 {
    let mut h = seed ^ 0x243F_6A88_85A3_08D3;
    for &p in parts {
        h = (h ^ p).wrapping_mul(0x100_0000_01B3).rotate_left(23);
    }
    h
}

/// A stable 64-bit key of a name (an arm's, an item's id; FNV-1a), for seeds.
pub(crate) fn name_key(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// Where a transform of `step` runs on this item.
#[allow(clippy::too_many_arguments)]
fn transform_cx<'a>(
    step: &'a Step,
    base: crate::arm::Base,
    source_geometry: &'a Geometry,
    seed_of: &'a dyn Fn(usize, u64) -> u64,
    cx: &'a ItemCx,
    sites: &'a [usize],
    chain: &'a str,
) -> TransformCx<'a> {
    TransformCx {
        carrier: step.carrier,
        layers: &step.layers,
        sites,
        source_geometry,
        heads: step.heads.as_deref(),
        seed_of,
        resources: cx.resources,
        memo: cx.memo,
        chain,
        passes: cx.passes,
        base,
    }
}

/// The step's source value after its transforms, the sites it acts on (the
/// destination sites the source holds), and the source's geometry.
fn source_value(
    step: &Step,
    program: &ArmProgram,
    cx: &ItemCx,
    fit_to: Option<&Pass>,
    achieved: &mut Vec<(String, f64)>,
) -> Result<(CarrierValue, Vec<usize>, Geometry)> {
    let g = &cx.passes.geometry;
    let (mut value, sg) = step.source.provide(
        cx.passes,
        program.base,
        step.carrier,
        &step.layers,
        cx.resources,
    )?;
    // The sites the source holds: positions outside it keep the receiver's state.
    let have = match &value {
        CarrierValue::Kv(c) => c.len(),
        CarrierValue::Resid(m) => m.values().next().map(|t| t.dims()[1]).unwrap_or(0),
    };
    // An appended span is the source's own (another item's passage): its
    // transforms act where it lies in the source's context.
    let on = if step.mechanism == Mechanism::Append {
        &sg
    } else {
        g
    };
    let mut sites: Vec<usize> = step
        .positions
        .resolve(on)
        .into_iter()
        .filter(|&p| p < have)
        .collect();
    // Perturbations are seeded by the run, the item, the arm's name (or the
    // name it draws as), the injection, the layer and which tensor:
    // reordering arms changes nothing.
    let arm_key = name_key(&program.seed_key);
    let seed_of = |l: usize, which: u64| {
        mix(
            cx.seed,
            &[cx.index as u64, arm_key, step.index as u64, l as u64, which],
        )
    };
    let mut chain = format!("{}:{}", step.source.name(), program.base.name());
    for t in &step.transforms {
        let moved = t.sites(
            sites.clone(),
            &transform_cx(step, program.base, &sg, &seed_of, cx, &sites, &chain),
        );
        sites = moved;
        let (v, ach) = t.apply(
            value,
            &transform_cx(step, program.base, &sg, &seed_of, cx, &sites, &chain),
        )?;
        value = v;
        achieved.extend(ach);
        // The chain keys shared work: a seeded transform makes it the arm's own.
        chain.push_str(&format!("|{t:?}"));
        if t.seeded() {
            chain.push_str(&format!("#{}", program.seed_key));
        }
    }
    // A residual source of another length is fitted to the receiver's:
    // positions it lacks keep the receiver's own state.
    if let (CarrierValue::Resid(m), Some(own)) = (&mut value, fit_to) {
        for (l, t) in m.iter_mut() {
            *t = fit_positions(t, own.resid(*l)?, 1)?;
        }
    }
    Ok((value, sites, sg))
}

/// Runs `program` on one item.
pub fn prepare(program: &ArmProgram, cx: &ItemCx) -> Result<Prepared> {
    let p = cx.passes;
    let base = if program.base == Base::Masked {
        &p.base
    } else {
        &p.alt
    };
    let full = &p.alt;
    let g = &p.geometry;
    let mut cache = base.cache.clone();
    let (mut fid, mut ach, mut corr) = (Vec::new(), Vec::new(), Vec::new());
    let mut n_sites = 0;

    // 1. Residual injections: one restart from the lowest layer, with hook
    //    edits at every injected layer, from the first changed position.
    let mut edits: Vec<(&Step, usize, Vec<usize>, Tensor)> = Vec::new();
    for step in &program.resid_steps {
        let (value, sites, _) = source_value(step, program, cx, Some(base), &mut ach)?;
        n_sites = n_sites.max(sites.len());
        if sites.is_empty() {
            continue;
        }
        for &l in &step.layers {
            let own = base.resid(l)?;
            let src = value.resid(l)?.clone();
            let injected = edit_resid(own, &src, l, &sites, step.mechanism, step.alpha)?;
            fid.push(mean_vector_cosine(
                &injected,
                full.resid(l)?,
                1,
                Some(&sites),
            )?);
            edits.push((step, l, sites.clone(), src));
        }
    }
    if !edits.is_empty() {
        let start = edits.iter().map(|e| e.1).min().unwrap_or(0);
        let p0 = edits
            .iter()
            .flat_map(|e| e.2.iter().copied())
            .min()
            .unwrap_or(0);
        let t = g.context_len;
        let mut spec = HookSpec::new();
        for (step, l, sites, src) in &edits {
            let src = src.narrow(1, p0, t - p0)?;
            let edit = edit_for(step.mechanism, step.alpha, src)?;
            let local: Vec<usize> = sites.iter().map(|p| p - p0).collect();
            spec = spec
                .intervene(Intervention::new(HookPoint::ResidPre(*l), edit).at_positions(local));
        }
        let resid_in = base.resid(start)?.narrow(1, p0, t - p0)?;
        let lower = base.cache.narrow(p0, t - p0)?;
        let mut c = base.cache.truncate(p0)?;
        cx.model
            .forward_from_layer(start, &resid_in, &lower, &mut c, &spec, LogitsAt::None)?;
        cache = c;
    }

    // 2. Cache edits and 3. appended segments, in order.
    for step in &program.cache_steps {
        let (value, sites, sg) = source_value(step, program, cx, None, &mut ach)?;
        let src = value.kv()?;
        if step.mechanism == Mechanism::Append {
            // The appended span is the source's own passage (or context).
            let span = step.positions.resolve(&sg);
            // Counted on the item's own context, as for every injection.
            n_sites = n_sites.max(step.positions.resolve(g).len());
            let (lo, hi) = match (span.first(), span.last()) {
                (Some(&lo), Some(&hi)) => (lo, hi + 1),
                _ => continue,
            };
            if hi > src.len() {
                return Err(DriverError::Inapplicable {
                    arm: program.name.clone(),
                    field: "positions".into(),
                    reason: format!(
                        "the source holds {} entries, the span ends at {hi}",
                        src.len()
                    ),
                });
            }
            cache = append_kv(&cache, src, lo, hi - lo)?;
            // Fidelity of an appended segment: its cosine to the native
            // entries at the same positions (a sender pool's entries have
            // no such counterpart).
            if hi <= full.cache.len() && step.source.name() != "pool" {
                let nat = full.cache.narrow(lo, hi - lo)?;
                let app = src.narrow(lo, hi - lo)?;
                fid.push(kv_fidelity(
                    &app,
                    &nat,
                    step.carrier,
                    &step.layers,
                    None,
                    None,
                )?);
            }
        } else {
            n_sites = n_sites.max(sites.len());
            cache = edit_kv(
                &cache,
                src,
                &KvSites {
                    carrier: step.carrier,
                    layers: &step.layers,
                    positions: Some(&sites),
                    heads: step.heads.as_deref(),
                },
                step.mechanism,
                step.alpha,
            )?;
            if !sites.is_empty() {
                fid.push(kv_fidelity(
                    &cache,
                    &full.cache,
                    step.carrier,
                    &step.layers,
                    Some(&sites),
                    step.heads.as_deref(),
                )?);
                if step.logit_correlation {
                    let mut per_layer = Vec::with_capacity(step.layers.len());
                    for &l in &step.layers {
                        let q = p.queries.get(&l).ok_or_else(|| {
                            DriverError::Records(format!(
                                "internal: question queries of layer {l} were not captured"
                            ))
                        })?;
                        per_layer.push(logit_correlation(
                            q,
                            &full.cache.require_layer(l)?.k,
                            &cache.require_layer(l)?.k,
                            &sites,
                            step.heads.as_deref(),
                        )?);
                    }
                    corr.extend(per_layer);
                }
            }
        }
    }
    // A bridge's adapters run the question and decoding.
    let (question, question_key) = match &program.bridge {
        Some((name, init)) => {
            let v = cx.resources.get(name).ok_or_else(|| {
                DriverError::Records(format!("internal: bridge `{name}` was not built"))
            })?;
            let b: &crate::resources::BridgeValue = crate::resources::bank::downcast(v, "bridge")?;
            if b.trained.is_empty() {
                // A router bridge acts on the pool; the question runs plain.
                (HookSpec::new(), String::new())
            } else {
                (b.spec(*init), format!("bridge {name} init={init}"))
            }
        }
        None => (HookSpec::new(), String::new()),
    };
    Ok(Prepared {
        cache,
        measures: Measures {
            fidelity_cosine: mean(&fid),
            achieved_cosine: mean(&ach.iter().map(|(_, c)| *c).collect::<Vec<f64>>()),
            achieved_at: ach,
            logit_correlation: mean(&corr),
            n_sites,
        },
        question,
        question_key,
    })
}
