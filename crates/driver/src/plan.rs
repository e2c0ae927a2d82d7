//! The plan compiler: a config becomes, for one receiver, the passes every
//! item needs, the resources the arms read, and one program per arm (its
//! base pass and, per injection, a source, a chain of transforms and a
//! mechanism at resolved sites). An arm runs if and only if it compiles:
//! this is the only place that decides whether an arm can apply, and its
//! errors name the config field at fault.

use crate::arm::{Arm, Base, Expect, Source as SourceSpec};
use crate::config::{PlannedArm, SweepConfig};
use crate::cross::ForeignSpec;
use crate::error::{DriverError, Result};
use crate::passes::PassNeeds;
use crate::resources::{build_order, ResourceSpec};
use crate::senders::SenderSpec;
use crate::sources::{PassSource, PoolSource, SenderSource, Source};
use crate::transforms::{
    BankPick, BankSubstitute, BlendBy, BlendToward, CodebookSnap, Displace, FittedSubstitute,
    Perturb, Transform,
};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::Arc;
use tolerable_carrier::perturb::check_target_cosine;
use tolerable_carrier::{Carrier, LayerSet, Mechanism, Positions};
use tolerable_runtime::ModelConfig;

/// One injection, compiled: where it acts, where its carrier comes from,
/// what happens to it on the way, and how it enters.
#[derive(Debug, Clone)]
pub struct Step {
    /// Index of the injection in its arm (seeds perturbations).
    pub index: usize,
    /// The carrier.
    pub carrier: Carrier,
    /// Layers, resolved and sorted.
    pub layers: Vec<usize>,
    /// Destination positions.
    pub positions: Positions,
    /// KV heads; `None` = all.
    pub heads: Option<Vec<usize>>,
    /// The source provider.
    pub source: Arc<dyn Source>,
    /// Transforms, applied in order.
    pub transforms: Vec<Arc<dyn Transform>>,
    /// The mechanism.
    pub mechanism: Mechanism,
    /// Weight of interpolate and add (1 otherwise).
    pub alpha: f64,
    /// Whether the step's attention-logit correlation to the native keys is measured.
    pub logit_correlation: bool,
}

/// One arm, compiled.
#[derive(Debug, Clone)]
pub struct ArmProgram {
    /// The arm's index in the config's (expanded) arm list.
    pub index: usize,
    /// Its name.
    pub name: String,
    /// Its base pass.
    pub base: Base,
    /// Residual injections (one restart from the lowest of their layers).
    pub resid_steps: Vec<Step>,
    /// Cache edits and appended segments, in order.
    pub cache_steps: Vec<Step>,
    /// The per-item bit-exact gate.
    pub expect: Option<Expect>,
    /// Resources it reads (by name).
    pub resources: Vec<String>,
    /// The name its random draws are keyed by (its own, or `seed_as`).
    pub seed_key: String,
    /// The bridge resource whose adapters run its question and decoding,
    /// and whether at their initial values.
    pub bridge: Option<(String, bool)>,
    /// Whether it reads its question and decodes in a batch of its own: set
    /// for an arm gated bit for bit against another arm (`expect = { arm }`)
    /// and for that anchor, unless bridges share batches
    /// ([`Plan::batch_bridges`], which keeps gates comparable its own way). gemm's summation order depends on the row count
    /// (one row takes its gemv path), so two arms are bit-comparable only at
    /// equal batch sizes, and an anchor sharing its layout with a third arm
    /// by chance (a mismatch partner's passage of the same length) would
    /// otherwise decode in a batch of two while the gated arm decodes alone.
    pub decode_alone: bool,
}

impl ArmProgram {
    /// Every step, residual first.
    pub fn steps(&self) -> impl Iterator<Item = &Step> {
        self.resid_steps.iter().chain(&self.cache_steps)
    }
}

/// A compiled sweep.
#[derive(Debug, Clone)]
pub struct Plan {
    /// One program per arm, in config order.
    pub programs: Vec<ArmProgram>,
    /// The passes every item needs.
    pub needs: PassNeeds,
    /// Resources the arms read, with their dependencies, in build order.
    pub resources: Vec<(String, ResourceSpec)>,
    /// Index of the floor arm.
    pub floor: usize,
    /// Index of the native reference arm.
    pub native: usize,
    /// Held-out senders the arms read, by key.
    pub senders: BTreeMap<String, SenderSpec>,
    /// Cross-family holders the arms read (a model through a projection),
    /// by the key of their projected pass.
    pub foreign: BTreeMap<String, ForeignSpec>,
    /// Whether arms that differ only in their bridge's adapters share a
    /// question-and-decoding batch, each sequence with its own adapters
    /// (`[run] batch_bridges`). A gated arm then shares its anchor's batch
    /// where their caches share a layout, and the anchor and all its gated
    /// arms decode alone where one of them does not (the runner decides
    /// that per item); no program is marked `decode_alone`.
    pub batch_bridges: bool,
}

fn bad(arm: &Arm, field: String, reason: impl Into<String>) -> DriverError {
    DriverError::Inapplicable {
        arm: arm.name.clone(),
        field,
        reason: reason.into(),
    }
}

/// Compiles `cfg` for a receiver of geometry `model` (catalog id
/// `receiver_id`); `holder_config` reads a named sender's geometry.
pub fn compile(
    cfg: &SweepConfig,
    model: &ModelConfig,
    receiver_id: &str,
    holder_config: &dyn Fn(&str) -> Result<ModelConfig>,
) -> Result<Plan> {
    for (name, spec) in &cfg.resources {
        spec.kind()
            .validate(&format!("[resources.{name}]"), model, &cfg.resources)?;
    }
    let mut needs = PassNeeds::default();
    let mut programs = Vec::with_capacity(cfg.arms.len());
    // The deepest neighbour asked of each bank: one search per item serves every k.
    let mut depth: BTreeMap<String, usize> = BTreeMap::new();
    for pa in &cfg.arms {
        for inj in &pa.arm.inject {
            if let SourceSpec::Bank(b) = &inj.source {
                if let Some(k) = b.neighbour {
                    let d = depth.entry(b.bank.clone()).or_default();
                    *d = (*d).max(k);
                }
            }
        }
    }
    let mut senders = BTreeMap::new();
    let mut foreign = BTreeMap::new();
    for (a, pa) in cfg.arms.iter().enumerate() {
        programs.push(compile_arm(
            a,
            pa,
            cfg,
            model,
            receiver_id,
            holder_config,
            &depth,
            &mut needs,
            &mut senders,
            &mut foreign,
        )?);
    }
    // Arms gated against another arm, and their anchors, decode alone
    // (with bridges batched, the runner keeps each gate's arms together).
    let gated: Vec<String> = programs
        .iter()
        .filter_map(|p| match &p.expect {
            Some(Expect::Arm(anchor)) => Some([p.name.clone(), anchor.clone()]),
            _ => None,
        })
        .flatten()
        .collect();
    for p in &mut programs {
        p.decode_alone = gated.contains(&p.name) && !cfg.run.batch_bridges;
    }
    // Controls resolve at each arm's grid point once every arm applies.
    for pa in &cfg.arms {
        cfg.controls_of(pa)?;
    }
    let used: BTreeSet<String> = programs.iter().flat_map(|p| p.resources.clone()).collect();
    let mut wanted: BTreeSet<String> = BTreeSet::new();
    let mut stack: Vec<String> = used.into_iter().collect();
    while let Some(n) = stack.pop() {
        if wanted.insert(n.clone()) {
            if let Some(s) = cfg.resources.get(&n) {
                stack.extend(s.kind().deps());
            }
        }
    }
    let resources = build_order(&cfg.resources)?
        .into_iter()
        .filter(|n| wanted.contains(n))
        .map(|n| {
            let s = cfg.resources[&n].clone();
            (n, s)
        })
        .collect();
    // Key pairs read a held-out sender: it is built (and gated) with the arms'.
    for name in &wanted {
        if let Some(ResourceSpec::KeyPairs(p)) = cfg.resources.get(name) {
            if let Some(s) = &p.sender {
                if cfg.run.precision != "f32" {
                    return Err(DriverError::Config(format!(
                        "[resources.{name}].sender: held-out senders are built from the receiver's f32 weights; `[run] precision` is `{}`",
                        cfg.run.precision
                    )));
                }
                senders.entry(s.key()).or_insert_with(|| s.clone());
            }
        }
    }
    for name in cfg.resources.keys() {
        if !wanted.contains(name) {
            tracing::warn!("[resources.{name}] is declared but no arm reads it; it is not built");
        }
    }
    Ok(Plan {
        programs,
        needs,
        resources,
        floor: cfg.anchor(Base::Masked),
        native: cfg.anchor(Base::Full),
        senders,
        foreign,
        batch_bridges: cfg.run.batch_bridges,
    })
}

/// The key pairs a fitted map `name` was fitted on; why not, when `name`
/// is not a fitted map over declared key pairs.
fn fitted_input<'a>(
    cfg: &'a SweepConfig,
    name: &str,
) -> std::result::Result<&'a crate::resources::KeyPairsSpec, String> {
    match cfg.resources.get(name) {
        Some(ResourceSpec::FittedMap(m)) => match cfg.resources.get(&m.pairs) {
            Some(ResourceSpec::KeyPairs(p)) => Ok(p),
            _ => Err(format!(
                "fitted map `{name}` reads `{}`, which is not declared key pairs",
                m.pairs
            )),
        },
        Some(_) => Err(format!(
            "`{name}` is not a fitted map (`kind = \"fitted_map\"`)"
        )),
        None => Err(format!(
            "no `[resources.{name}]` is declared; declare a fitted map of that name"
        )),
    }
}

/// Whether an injection feeds a fitted map the input it was fitted on: the
/// held-out sender's keys (source `holder`, the arm's holder that sender,
/// nothing between), or the receiver's keys under the same calibrated noise
/// (source `native`, `perturb` that noise). The field at fault and why, if not.
fn check_map_input(
    inj: &crate::arm::Injection,
    pairs: &crate::resources::KeyPairsSpec,
    senders: &BTreeMap<String, SenderSpec>,
    arm_sender: Option<&str>,
) -> std::result::Result<(), (&'static str, String)> {
    if inj.blend.is_some() {
        return Err((
            "blend",
            "a fitted map takes its input as fitted; no blend".into(),
        ));
    }
    if inj.source_positions.is_some() {
        return Err((
            "source_positions",
            "a fitted map reads its input where it writes".into(),
        ));
    }
    match (&pairs.sender, pairs.noise_cosine) {
        (Some(want), _) => {
            let have = arm_sender.and_then(|k| senders.get(k));
            if inj.source != SourceSpec::Holder
                || !have.is_some_and(|h| crate::resources::fitted::same_sender(h, want))
            {
                return Err((
                    "source",
                    format!(
                        "the map was fitted on the keys of sender `{}`: the source must be `holder` with the arm's `holder` that sender",
                        want.key()
                    ),
                ));
            }
            if inj.perturb.is_some() {
                return Err((
                    "perturb",
                    "the map was fitted on the sender's keys as they are; no perturb".into(),
                ));
            }
        }
        (None, Some(c)) => {
            let matched = matches!(
                inj.perturb,
                Some(tolerable_carrier::Perturbation::CosineNoise { target_cosine }) if target_cosine == c
            );
            if inj.source != SourceSpec::Native || !matched {
                return Err((
                    "perturb",
                    format!(
                        "the map was fitted on the native keys under noise at cosine {c}: the source must be `native` with `perturb = {{ kind = \"cosine_noise\", target_cosine = {c} }}`"
                    ),
                ));
            }
        }
        (None, None) => return Err(("map", "its key pairs name no input".into())),
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn compile_arm(
    a: usize,
    pa: &PlannedArm,
    cfg: &SweepConfig,
    model: &ModelConfig,
    receiver_id: &str,
    holder_config: &dyn Fn(&str) -> Result<ModelConfig>,
    depth: &BTreeMap<String, usize>,
    needs: &mut PassNeeds,
    senders: &mut BTreeMap<String, SenderSpec>,
    foreign: &mut BTreeMap<String, ForeignSpec>,
) -> Result<ArmProgram> {
    let arm = &pa.arm;
    let prefix = match pa.index {
        Some(i) => format!("arms[{i}]"),
        None => arm.name.clone(),
    };
    if let Some(b) = &arm.bridge {
        match cfg.resources.get(&b.resource) {
            Some(ResourceSpec::Bridge(spec)) => {
                // A router bridge acts through a trained pool; adapters on
                // the question.
                let trained_pool = arm.inject.iter().any(|i| {
                    matches!(&i.source, SourceSpec::Pool(p) if p.router == crate::arm::Router::Trained)
                });
                let router = spec.targets == crate::arm::BridgeTargets::Router;
                if let Some(trained) = spec.routed_injection() {
                    for (j, inj) in arm.inject.iter().enumerate() {
                        if !matches!(&inj.source, SourceSpec::Pool(p) if p.router == crate::arm::Router::Trained)
                        {
                            continue;
                        }
                        let why = if inj.layers != trained.layers {
                            Some(format!(
                                "layers: `{}`, but the router `{}` was trained at `{}`",
                                inj.layers, b.resource, trained.layers
                            ))
                        } else if inj.mechanism != Mechanism::Add || arm.base != Base::Masked {
                            Some(format!(
                                "the router `{}` was trained adding to the masked receiver (base = \"masked\", mechanism = \"add\")",
                                b.resource
                            ))
                        } else {
                            None
                        };
                        if let Some(why) = why {
                            return Err(bad(arm, format!("{prefix}.inject[{j}]"), why));
                        }
                    }
                }
                if router != trained_pool {
                    return Err(bad(
                        arm,
                        format!("{prefix}.bridge.resource"),
                        if router {
                            format!(
                                "`{}` is a router bridge: the arm routes a pool with it (`source = {{ pool = {{ n, router = \"trained\" }} }}`)",
                                b.resource
                            )
                        } else {
                            format!(
                                "`{}` holds adapters; a pool with router = \"trained\" needs a bridge of targets = \"router\"",
                                b.resource
                            )
                        },
                    ));
                }
            }
            Some(other) => {
                return Err(bad(
                    arm,
                    format!("{prefix}.bridge.resource"),
                    format!(
                        "`{}` is a {} resource, not a bridge",
                        b.resource,
                        other.kind().kind()
                    ),
                ))
            }
            None => {
                return Err(bad(
                    arm,
                    format!("{prefix}.bridge.resource"),
                    format!(
                        "no resource `{}`: declare it as [resources.{}] kind = \"bridge\"",
                        b.resource, b.resource
                    ),
                ))
            }
        }
    }
    if let Some(Expect::Arm(name)) = &arm.expect {
        if name == &arm.name || !cfg.arms.iter().any(|o| &o.arm.name == name) {
            return Err(bad(
                arm,
                format!("{prefix}.expect.arm"),
                format!(
                    "`{name}` is not another arm of this config (arm names after grid expansion)"
                ),
            ));
        }
    }
    // A held-out sender: the receiver's weights re-quantized or perturbed.
    let mut sender: Option<String> = None;
    if let Some(h) = &arm.holder {
        let spec = match (&h.requantize, h.weight_cosine) {
            (Some(t), None) => {
                if crate::senders::ggml_type(t).is_none() {
                    return Err(bad(
                        arm,
                        format!("{prefix}.holder.requantize"),
                        format!("`{t}` is not a GGUF type candle quantizes to (Q8_0, Q6_K, Q5_1, Q5_0, Q5_K, Q4_1, Q4_0, Q4_K, Q3_K, Q2_K)"),
                    ));
                }
                Some(SenderSpec::Requantize(t.clone()))
            }
            (None, Some(c)) => {
                if !(c > 0.0 && c < 1.0) {
                    return Err(bad(
                        arm,
                        format!("{prefix}.holder.weight_cosine"),
                        format!("weight cosine {c} is not in (0, 1)"),
                    ));
                }
                Some(SenderSpec::WeightCosine(c))
            }
            (Some(_), Some(_)) => {
                return Err(bad(
                    arm,
                    format!("{prefix}.holder"),
                    "name one of `requantize` and `weight_cosine`",
                ))
            }
            (None, None) => None,
        };
        if let Some(spec) = spec {
            if h.model.is_some() || h.projection.is_some() {
                return Err(bad(
                    arm,
                    format!("{prefix}.holder"),
                    "a held-out sender is built from the receiver: it takes no `model` or `projection`",
                ));
            }
            let key = spec.key();
            senders.insert(key.clone(), spec);
            sender = Some(key);
        }
        if let Some(p) = &h.projection {
            // A cross-family holder: `model` reads the passage with its own
            // tokenizer; its states reach the receiver through the projection.
            let Some(m) = h.model.as_deref() else {
                return Err(bad(
                    arm,
                    format!("{prefix}.holder.model"),
                    "a projection maps a holder model's states: name the model (`model = \"smollm2-135m-instruct\"`, or the receiver's own id for the identity sanity arm)",
                ));
            };
            let fitted_on = match cfg.resources.get(p) {
                Some(ResourceSpec::CrossProjection(c)) => &c.holder,
                Some(_) => {
                    return Err(bad(
                        arm,
                        format!("{prefix}.holder.projection"),
                        format!("`{p}` is not a cross-family projection (`kind = \"cross_projection\"`)"),
                    ))
                }
                None => {
                    return Err(bad(
                        arm,
                        format!("{prefix}.holder.projection"),
                        format!("no `[resources.{p}]` is declared; declare a cross-family projection of that name"),
                    ))
                }
            };
            if fitted_on != m {
                return Err(bad(
                    arm,
                    format!("{prefix}.holder.model"),
                    format!("the projection `{p}` is fitted on holder `{fitted_on}`, the arm's holder is `{m}`"),
                ));
            }
            if m != receiver_id {
                holder_config(m)
                    .map_err(|e| bad(arm, format!("{prefix}.holder.model"), e.to_string()))?;
            }
            let spec = ForeignSpec {
                model: m.to_string(),
                projection: p.clone(),
                partner: None,
            };
            let key = spec.key();
            foreign.insert(key.clone(), spec);
            sender = Some(key);
        } else if let Some(m) = h.model.as_deref().filter(|m| *m != receiver_id) {
            let sc = holder_config(m)
                .map_err(|e| bad(arm, format!("{prefix}.holder.model"), e.to_string()))?;
            let same = sc.n_layers == model.n_layers
                && sc.n_kv_heads == model.n_kv_heads
                && sc.head_dim == model.head_dim
                && sc.d_model == model.d_model;
            if !same {
                return Err(bad(
                    arm,
                    format!("{prefix}.holder.projection"),
                    format!(
                        "sender `{m}` has cache shape {} layers x {} kv heads x {} head_dim (width {}), the receiver {} x {} x {} (width {}); a sender of another shape needs an explicit projection (`projection = \"<name>\"`, a `[resources.<name>] kind = \"cross_projection\"`)",
                        sc.n_layers, sc.n_kv_heads, sc.head_dim, sc.d_model,
                        model.n_layers, model.n_kv_heads, model.head_dim, model.d_model
                    ),
                ));
            }
            return Err(bad(
                arm,
                format!("{prefix}.holder.model"),
                "a sender of the receiver's shape with other weights and another file is not built yet; read it through a projection (`projection = \"<name>\"`), or build a held-out sender (`requantize`, `weight_cosine`)",
            ));
        }
    }
    if arm.expect == Some(Expect::Native) && arm.base == Base::Masked && arm.inject.is_empty() {
        return Err(bad(
            arm,
            format!("{prefix}.expect"),
            "a bare masked pass cannot equal the native reference",
        ));
    }
    let mut appended = false;
    let mut resid_steps = Vec::new();
    let mut cache_steps = Vec::new();
    for (j, inj) in arm.inject.iter().enumerate() {
        let f = |name: &str| format!("{prefix}.inject[{j}].{name}");
        let layers = inj.layers.resolve(model.n_layers, &f("layers"))?;
        if let Some(heads) = &inj.heads {
            if heads.is_empty() {
                return Err(bad(
                    arm,
                    f("heads"),
                    "an empty head list selects nothing; leave `heads` out for every head",
                ));
            }
            if inj.mechanism == Mechanism::Append {
                return Err(bad(
                    arm,
                    f("heads"),
                    "append adds every kv head's entries; it takes no `heads`",
                ));
            }
            if inj.carrier == Carrier::H {
                return Err(bad(arm, f("heads"), "the residual carrier h has no heads"));
            }
            if let Some(&h) = heads.iter().find(|&&h| h >= model.n_kv_heads) {
                return Err(bad(
                    arm,
                    f("heads"),
                    format!(
                        "kv head {h} is out of range for {} kv heads",
                        model.n_kv_heads
                    ),
                ));
            }
        }
        match (inj.mechanism.takes_alpha(), inj.alpha) {
            (true, None) => {
                return Err(bad(
                    arm,
                    f("alpha"),
                    format!("`{}` needs a weight `alpha`", inj.mechanism.name()),
                ))
            }
            (false, Some(_)) => {
                return Err(bad(
                    arm,
                    f("alpha"),
                    format!("`{}` takes no `alpha`", inj.mechanism.name()),
                ))
            }
            (true, Some(x)) if !x.is_finite() => {
                return Err(bad(arm, f("alpha"), format!("alpha {x} is not finite")))
            }
            _ => {}
        }
        if inj.mechanism == Mechanism::Append {
            if inj.carrier != Carrier::Kv {
                return Err(bad(
                    arm,
                    f("carrier"),
                    "append adds attendable entries and needs both keys and values (`kv`)",
                ));
            }
            if !matches!(inj.positions, Positions::Passage | Positions::All) {
                return Err(bad(
                    arm,
                    f("positions"),
                    "append takes a contiguous span: `passage` or `all`",
                ));
            }
            if inj.layers != LayerSet::All {
                return Err(bad(
                    arm,
                    f("layers"),
                    "appended segments are attendable in every layer; `layers` must be `all`",
                ));
            }
            if inj.source_positions.is_some() {
                return Err(bad(
                    arm,
                    f("source_positions"),
                    "append takes its span as is",
                ));
            }
            appended = true;
        } else if appended {
            return Err(bad(
                arm,
                f("mechanism"),
                "slot edits must come before appended segments",
            ));
        }
        let mut transforms: Vec<Arc<dyn Transform>> = Vec::new();
        if let Some(from) = inj.source_positions {
            transforms.push(Arc::new(Displace { from }));
        }
        let key_only = |what: &str| -> Result<()> {
            if inj.carrier != Carrier::K {
                return Err(bad(
                    arm,
                    f("carrier"),
                    format!("{what} substitutes genuine keys: the carrier must be `k`"),
                ));
            }
            if !matches!(inj.mechanism, Mechanism::Replace | Mechanism::Interpolate) {
                return Err(bad(
                    arm,
                    f("mechanism"),
                    format!("{what} substitutes keys in their slots: `replace` or `interpolate`"),
                ));
            }
            Ok(())
        };
        let source: Arc<dyn Source> = match &inj.source {
            SourceSpec::Own => Arc::new(PassSource::own()),
            SourceSpec::Native => Arc::new(PassSource::native()),
            SourceSpec::Holder => match &sender {
                Some(key) => Arc::new(SenderSource {
                    key: key.clone(),
                    partner: None,
                }),
                None => Arc::new(PassSource::holder()),
            },
            // With a cross-family holder, another item's passage read by
            // that holder through the same projection (the mismatch control).
            SourceSpec::OtherItem => match sender.as_ref().and_then(|k| foreign.get(k)).cloned() {
                Some(f) => {
                    let partner = ForeignSpec {
                        partner: Some(0),
                        ..f
                    };
                    let key = partner.key();
                    foreign.insert(key.clone(), partner);
                    Arc::new(SenderSource {
                        key,
                        partner: Some(0),
                    })
                }
                None => Arc::new(PassSource::other_item()),
            },
            SourceSpec::Bank(b) => {
                key_only("a key bank")?;
                let size = match cfg.resources.get(&b.bank) {
                    Some(ResourceSpec::KeyBank(s)) => s.size,
                    Some(_) => {
                        return Err(bad(
                            arm,
                            f("source.bank.bank"),
                            format!("`{}` is not a key bank", b.bank),
                        ))
                    }
                    None => {
                        return Err(bad(
                            arm,
                            f("source.bank.bank"),
                            format!(
                                "no `[resources.{}]` is declared; declare a key bank of that name",
                                b.bank
                            ),
                        ))
                    }
                };
                let pick = match (b.neighbour, b.cosine) {
                    (Some(k), None) => {
                        if k == 0 || k > size {
                            return Err(bad(
                                arm,
                                f("source.bank.neighbour"),
                                format!("neighbour {k} of a bank of {size} keys: need 1 <= k <= {size}"),
                            ));
                        }
                        BankPick::Neighbour {
                            k,
                            depth: depth.get(&b.bank).copied().unwrap_or(k),
                        }
                    }
                    (None, Some(c)) => {
                        check_target_cosine(c).map_err(|why| bad(arm, f("source.bank.cosine"), why))?;
                        BankPick::AtCosine(c)
                    }
                    _ => {
                        return Err(bad(
                            arm,
                            f("source.bank"),
                            "name exactly one of `neighbour` (the k-th nearest genuine key) and `cosine` (the genuine key nearest a target cosine)",
                        ))
                    }
                };
                transforms.push(Arc::new(BankSubstitute {
                    bank: b.bank.clone(),
                    pick,
                }));
                Arc::new(PassSource::native())
            }
            SourceSpec::Codebook(c) => {
                key_only("a codebook")?;
                let spec = match cfg.resources.get(&c.codebook) {
                    Some(ResourceSpec::Codebook(s)) => s,
                    Some(_) => {
                        return Err(bad(
                            arm,
                            f("source.codebook.codebook"),
                            format!("`{}` is not a codebook", c.codebook),
                        ))
                    }
                    None => {
                        return Err(bad(
                            arm,
                            f("source.codebook.codebook"),
                            format!(
                                "no `[resources.{}]` is declared; declare a codebook of that name",
                                c.codebook
                            ),
                        ))
                    }
                };
                let bank_size = match cfg.resources.get(&spec.bank) {
                    Some(ResourceSpec::KeyBank(b)) => b.size,
                    _ => 0,
                };
                tolerable_carrier::codebook::validate(
                    spec.construction,
                    spec.size,
                    bank_size,
                    model.head_dim,
                    c.snapping,
                )
                .map_err(|e| bad(arm, f("source.codebook.snapping"), e.to_string()))?;
                transforms.push(Arc::new(CodebookSnap {
                    codebook: c.codebook.clone(),
                    snapping: c.snapping,
                }));
                Arc::new(PassSource::native())
            }
            SourceSpec::Pool(p) => {
                if inj.mechanism == Mechanism::Append {
                    // The sender pool of KV augmentation (PROTOCOL §7).
                    if p.router != crate::arm::Router::Uniform {
                        return Err(bad(
                            arm,
                            f("source.pool.router"),
                            "an appended pool is read by the receiver's own attention: router = \"uniform\" (undirected)",
                        ));
                    }
                    if inj.carrier == Carrier::H || inj.positions != Positions::Passage {
                        return Err(bad(
                            arm,
                            f("positions"),
                            "an appended pool appends every member's passage keys and values: carrier kv, positions = \"passage\"",
                        ));
                    }
                    let pool = PoolSource::new(p.n, p.router, p.members, None)
                        .map_err(|why| bad(arm, f("source.pool"), why))?;
                    Arc::new(pool.appended())
                } else {
                    if p.router == crate::arm::Router::Trained && inj.carrier != Carrier::H {
                        return Err(bad(
                            arm,
                            f("carrier"),
                            "a trained router routes the activation carrier (`h`)",
                        ));
                    }
                    let trained = arm.bridge.as_ref().map(|b| (b.resource.clone(), b.init));
                    Arc::new(
                        PoolSource::new(p.n, p.router, p.members, trained)
                            .map_err(|why| bad(arm, f("source.pool"), why))?,
                    )
                }
            }
            other => {
                return Err(bad(
                    arm,
                    f("source"),
                    format!(
                        "source `{}` is part of the grammar but not built yet",
                        other.name()
                    ),
                ))
            }
        };
        if let Some(b) = &inj.blend {
            let toward: Arc<dyn Source> = match &b.toward {
                SourceSpec::Own => Arc::new(PassSource::own()),
                SourceSpec::Native => Arc::new(PassSource::native()),
                SourceSpec::Holder => Arc::new(PassSource::holder()),
                SourceSpec::OtherItem => Arc::new(PassSource::other_item()),
                other => {
                    return Err(bad(
                        arm,
                        f("blend.toward"),
                        format!("a blend moves toward a pass's state (own, native, holder, other_item), not `{}`", other.name()),
                    ))
                }
            };
            let by = match (b.alpha, b.target_cosine) {
                (Some(a), None) if a.is_finite() => BlendBy::Alpha(a),
                (Some(a), None) => {
                    return Err(bad(
                        arm,
                        f("blend.alpha"),
                        format!("alpha {a} is not finite"),
                    ))
                }
                (None, Some(c)) => {
                    check_target_cosine(c)
                        .map_err(|why| bad(arm, f("blend.target_cosine"), why))?;
                    BlendBy::Cosine(c)
                }
                _ => {
                    return Err(bad(
                        arm,
                        f("blend"),
                        "name exactly one of `alpha` and `target_cosine`",
                    ))
                }
            };
            toward.needs(arm.base, inj.carrier, &layers, needs);
            transforms.push(Arc::new(BlendToward { toward, by }));
        }
        if let Some(p) = &inj.perturb {
            p.validate(&f("perturb"))?;
            transforms.push(Arc::new(Perturb(p.clone())));
        }
        if let Some(name) = &inj.map {
            key_only("a fitted map")?;
            let pairs = fitted_input(cfg, name).map_err(|why| bad(arm, f("map"), why))?;
            check_map_input(inj, pairs, senders, sender.as_deref())
                .map_err(|(field, why)| bad(arm, f(field), why))?;
            transforms.push(Arc::new(FittedSubstitute { map: name.clone() }));
        }
        source.needs(arm.base, inj.carrier, &layers, needs);
        if inj.carrier == Carrier::H {
            // The base pass is the restart point; the native pass is the fidelity reference.
            let own = if arm.base == Base::Masked {
                &mut needs.base_resid
            } else {
                &mut needs.alt_resid
            };
            own.extend(layers.iter().copied());
            needs.alt_resid.extend(layers.iter().copied());
        }
        let logit_correlation = inj.carrier.has_k()
            && matches!(inj.mechanism, Mechanism::Replace | Mechanism::Interpolate)
            && inj.source_positions.is_none();
        if logit_correlation {
            needs.queries.extend(layers.iter().copied());
        }
        let step = Step {
            index: j,
            carrier: inj.carrier,
            layers,
            positions: inj.positions,
            heads: inj.heads.clone(),
            source,
            transforms,
            mechanism: inj.mechanism,
            alpha: inj.alpha.unwrap_or(1.0),
            logit_correlation,
        };
        if inj.carrier == Carrier::H {
            resid_steps.push(step);
        } else {
            cache_steps.push(step);
        }
    }
    // The resources an arm reads are those its transforms name.
    let mut resources: Vec<String> = resid_steps
        .iter()
        .chain(&cache_steps)
        .flat_map(|s: &Step| s.transforms.iter().flat_map(|t| t.resources()))
        .collect();
    if let Some(b) = &arm.bridge {
        resources.push(b.resource.clone());
    }
    // A cross-family holder's projection, when an injection reads the holder.
    if let (Some(key), true) = (
        &sender,
        arm.inject
            .iter()
            .any(|i| matches!(i.source, SourceSpec::Holder | SourceSpec::OtherItem)),
    ) {
        if let Some(f) = foreign.get(key) {
            resources.push(f.projection.clone());
        }
    }
    resources.sort();
    resources.dedup();
    Ok(ArmProgram {
        index: a,
        name: arm.name.clone(),
        base: arm.base,
        resid_steps,
        cache_steps,
        expect: arm.expect.clone(),
        resources,
        seed_key: arm.seed_as.clone().unwrap_or_else(|| arm.name.clone()),
        bridge: arm.bridge.as_ref().map(|b| (b.resource.clone(), b.init)),
        decode_alone: false,
    })
}

impl Step {
    /// One line: carrier at sites <- source | transforms -> mechanism.
    pub fn describe(&self) -> String {
        let layers = if self.layers.len() > 6 {
            format!(
                "{}..={} ({} layers)",
                self.layers[0],
                self.layers[self.layers.len() - 1],
                self.layers.len()
            )
        } else {
            format!("{:?}", self.layers)
        };
        let heads = self
            .heads
            .as_ref()
            .map(|h| format!(" heads {h:?}"))
            .unwrap_or_default();
        let chain: Vec<String> = std::iter::once(self.source.name().to_string())
            .chain(self.transforms.iter().map(|t| t.name()))
            .collect();
        let alpha = if self.mechanism.takes_alpha() {
            format!(" alpha={}", self.alpha)
        } else {
            String::new()
        };
        format!(
            "{} at layers {layers}, {}{heads} <- {} -> {}{alpha}",
            self.carrier.name(),
            self.positions.name(),
            chain.join(" | "),
            self.mechanism.name()
        )
    }
}

impl Plan {
    /// The plan as text: per-item passes, resources (with the status the
    /// caller supplies), and each arm's program.
    pub fn describe(&self, resource_status: &BTreeMap<String, String>) -> String {
        let mut s = String::new();
        let n = &self.needs;
        let _ = writeln!(s, "per-item passes:");
        let _ = writeln!(
            s,
            "  base (masked) context, residual captured at {:?}",
            n.base_resid
        );
        let _ = writeln!(s, "  alternative (full) context, residual captured at {:?} (the shared prefix read once for both)", n.alt_resid);
        if n.partners > 0 {
            let _ = writeln!(
                s,
                "  {} mis-source partner full pass(es), residual at {:?}",
                n.partners, n.partner_resid
            );
        }
        if !n.queries.is_empty() {
            let _ = writeln!(
                s,
                "  question queries over the native cache at {} layers",
                n.queries.len()
            );
        }
        let _ = writeln!(s, "resources:");
        if self.resources.is_empty() {
            let _ = writeln!(s, "  (none)");
        }
        for (name, spec) in &self.resources {
            let st = resource_status.get(name).cloned().unwrap_or_default();
            let _ = writeln!(s, "  {name}: {} {st}", spec.kind().describe());
        }
        let _ = writeln!(s, "programs ({} arms):", self.programs.len());
        for p in &self.programs {
            let _ = write!(s, "  {}: base {}", p.name, p.base.name());
            if let Some(e) = &p.expect {
                let _ = write!(s, ", expect {e:?}");
            }
            if let Some((b, init)) = &p.bridge {
                let _ = write!(
                    s,
                    ", bridge `{b}`{}",
                    if *init { " (as initialised)" } else { "" }
                );
            }
            let _ = writeln!(s);
            for st in p.steps() {
                let _ = writeln!(s, "    {}", st.describe());
            }
        }
        s
    }
}
