//! Trained bridges (PROTOCOL §7): low-rank adapters (LoRA) on the
//! receiver's query, key+value or query+key+value projections, trained with
//! candle autograd on the f32 path while every receiver weight stays
//! frozen.
//!
//! A bridge is trained **under an arm**: `arm = { base, inject }` in its
//! spec is compiled by the same plan compiler as the sweep's arms, and each
//! training item's cache is prepared by the same executor (for the raw KV
//! augmentation arm: the receiver's masked cache with the holder's
//! full-passage keys and values appended), once per item and without
//! gradient. Training then runs the question over that cache with the
//! adapters and minimises the cross-entropy of the gold answer's first
//! token at the decision step (the last prompt position); AdamW, `batch`
//! items a step (1 by default; more are read as one padded batch, the loss
//! their mean), `epochs` passes over `train_items` training items in a seeded
//! order. After each epoch, and before the first step (epoch 0), the
//! adapters are scored on a slice of `slice_items` further training items
//! (first-token accuracy, then mean loss); the best epoch's adapters are
//! kept. `B` starts at zero, so epoch 0 is the raw arm bit for bit (the
//! zero-init gate: an arm with `bridge = { resource, init = true }` and
//! `expect = { arm = "<raw arm>" }`).
//!
//! A bridge of `targets = "router"` trains no adapter: it trains the
//! per-token router of a pool on the activation carrier (paper 2's
//! additive, router-only arm; [`tolerable_carrier::RouterLayer`]). Its
//! training arm is one injection `source = { pool = { n, router =
//! "trained" } }`, carrier `h`, mechanism `add`, at one layer; each step
//! adds the routed pool at the sites, re-runs the context from that layer
//! and the question with gradients reaching only the router's maps. Pool
//! distractors are other training items' passages. W_q starts at zero, so
//! the initial router is the uniform one (its zero-init gate is `expect =
//! { arm = "<uniform pool arm>" }`).
//!
//! A non-finite loss (a training step's, or the slice's after an epoch)
//! stops training: the log and `run.json` name the epoch and step, and the
//! best epoch before it is kept.
//!
//! The value holds the kept adapters, the initial ones and the training
//! curve (epoch, mean training loss, slice loss, slice first-token
//! accuracy), which `run.json` records. Its file stores the kept adapters
//! (or a router's kept maps) and the curve; the initial adapters and
//! router maps are derived from the seed on load and checked against the
//! sums the file keeps (files written before e8f579b store the initial
//! adapters, and before 735c13d the initial router maps).

use super::kept::{self, Fit, Keep, Parts};
use super::progress::Progress;
use super::{sample_training, BuildCx, ResourceKind, ResourceSpec, TrainCx, Value};
use crate::arm::{Arm, Base, BridgeTargets, Injection, PoolSpec, Router, Source as SourceSpec};
use crate::config::{DataSection, DataSource, PlannedArm, SweepConfig};
use crate::error::{DriverError, Result};
use candle_core::{DType, Device, Tensor, Var};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tolerable_carrier::{Carrier, LayerSet, Mechanism, RouterLayer};
use tolerable_probe::SplitItem;
use tolerable_runtime::{
    Adapter, HookSpec, Kernels, KvCache, LogitsAt, Model, ModelConfig, Projection,
};

/// The arm a bridge is trained under.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainArm {
    /// Its base pass (`masked` by default: the receiver has not read the passage).
    #[serde(default = "masked")]
    pub base: Base,
    /// Its injections (for the KV augmentation bridge: the holder's
    /// passage cache appended).
    #[serde(default)]
    pub inject: Vec<Injection>,
}

fn masked() -> Base {
    Base::Masked
}

/// A bridge's parameters (`[resources.<name>] kind = "bridge"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BridgeSpec {
    /// Which projections carry adapters: `q`, `kv` or `qkv`.
    pub targets: BridgeTargets,
    /// LoRA rank.
    #[serde(default = "sixteen")]
    pub rank: usize,
    /// LoRA alpha: the low-rank term is scaled by alpha / rank.
    #[serde(default = "alpha")]
    pub alpha: f64,
    /// Layers adapted (LayerSet syntax).
    #[serde(default = "all")]
    pub layers: LayerSet,
    /// Training items (squad_train; never an evaluation item or passage).
    #[serde(default = "two_hundred")]
    pub train_items: usize,
    /// Further training items the kept epoch is chosen on.
    #[serde(default = "thirty_two")]
    pub slice_items: usize,
    /// Passes over the training items.
    #[serde(default = "four")]
    pub epochs: usize,
    /// Training examples a step: a mini-batch whose questions are read as
    /// one padded batch, each over its own cache, the loss their mean. 1
    /// (the default, one item per step) is the recipe every committed
    /// bridge was trained with; above 1 it is part of the spec and its hash.
    /// Adapter bridges only: a router trains one example a step.
    #[serde(
        default = "crate::config::one",
        skip_serializing_if = "crate::config::is_one"
    )]
    pub batch: usize,
    /// AdamW learning rate.
    #[serde(default = "lr")]
    pub lr: f64,
    /// AdamW weight decay.
    #[serde(default)]
    pub weight_decay: f64,
    /// Seed of the item sample, the initialisation of A and the item order.
    #[serde(default)]
    pub seed: u64,
    /// Where training items come from (`squad_train`, or `synthetic`).
    #[serde(default = "train")]
    pub data: DataSource,
    /// Train only on items that share no normalised gold answer with the
    /// evaluation items (the answer-disjoint split: a bridge that memorised
    /// answers earns nothing there).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub answer_disjoint: bool,
    /// Train only on items in which no normalised evaluation answer
    /// appears anywhere: not as the gold answer, nor as whole words of the
    /// passage or the question (the strict answer-disjoint split; it keeps
    /// fewer items, since short answers such as "two" or a year occur in
    /// many passages). It implies the answer-disjoint split.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub answer_free: bool,
    /// The arm the bridge is trained under.
    pub arm: TrainArm,
}

fn sixteen() -> usize {
    16
}
fn alpha() -> f64 {
    16.0
}
fn all() -> LayerSet {
    LayerSet::All
}
fn two_hundred() -> usize {
    200
}
fn thirty_two() -> usize {
    32
}
fn four() -> usize {
    4
}
fn lr() -> f64 {
    5e-4
}
fn train() -> DataSource {
    DataSource::SquadTrain
}

const TRAIN_ARM: &str = "bridge_train";

impl BridgeSpec {
    /// The initial down-projection A (`d_model` x `rank`) of the adapter at
    /// `layer` on `projection`: uniform in ±1/sqrt(d_model), drawn from the
    /// bridge's seed, the layer and the projection (its B starts at zero).
    /// A saved bridge derives its initial adapters from this instead of
    /// storing them.
    fn init_a(
        &self,
        d_model: usize,
        rank: usize,
        layer: usize,
        projection: Projection,
    ) -> Result<Tensor> {
        let seed = crate::exec::mix(self.seed, &[layer as u64, projection as u64]);
        Ok(Tensor::from_vec(
            tolerable_carrier::uniform_symmetric(
                d_model * rank,
                1.0 / (d_model as f64).sqrt(),
                seed,
            ),
            (d_model, rank),
            &Device::Cpu,
        )?)
    }

    /// The initial router at `layer` (`d_model` x `rank` maps): the query
    /// map zero, so every holder weighs alike (the uniform router), the key
    /// map uniform in ±1/sqrt(d_model), drawn from the bridge's seed and the
    /// layer. A saved router derives its initial maps from this instead of
    /// storing them.
    fn init_router(&self, d_model: usize, rank: usize, layer: usize) -> Result<RouterLayer> {
        Ok(RouterLayer {
            layer,
            wq: Tensor::zeros((d_model, rank), DType::F32, &Device::Cpu)?,
            wk: Tensor::from_vec(
                tolerable_carrier::uniform_symmetric(
                    d_model * rank,
                    1.0 / (d_model as f64).sqrt(),
                    crate::exec::mix(self.seed, &[layer as u64, 0x7017E]),
                ),
                (d_model, rank),
                &Device::Cpu,
            )?,
        })
    }

    fn projections(&self) -> Vec<Projection> {
        match self.targets {
            BridgeTargets::Q => vec![Projection::Q],
            BridgeTargets::Kv => vec![Projection::K, Projection::V],
            BridgeTargets::Qkv => vec![Projection::Q, Projection::K, Projection::V],
            BridgeTargets::Router => Vec::new(),
        }
    }

    /// The injection a router bridge was trained under (`None` for adapters).
    pub fn routed_injection(&self) -> Option<&Injection> {
        match self.targets {
            BridgeTargets::Router => self.router_pool().map(|(inj, _)| inj),
            _ => None,
        }
    }

    /// The pool a router bridge routes: the training arm's one injection.
    fn router_pool(&self) -> Option<(&Injection, &PoolSpec)> {
        match self.arm.inject.as_slice() {
            [inj] => match &inj.source {
                SourceSpec::Pool(p) => Some((inj, p)),
                _ => None,
            },
            _ => None,
        }
    }

    fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// The one-arm sweep the bridge is trained under (with the anchors the
    /// plan compiler wants).
    fn mini_config(&self) -> Result<SweepConfig> {
        let run = toml::from_str(&format!("name = \"{TRAIN_ARM}\""))
            .map_err(|e| DriverError::Config(format!("internal: {e}")))?;
        let planned = |arm: Arm, index: Option<usize>| PlannedArm {
            family: arm.name.clone(),
            arm,
            point: BTreeMap::new(),
            index,
        };
        let mut arm = Arm::floor();
        arm.name = TRAIN_ARM.into();
        arm.base = self.arm.base;
        arm.inject = self.arm.inject.clone();
        // A router is trained on the pool's passes; the plan compiles the
        // pool with the uniform router (the maps are the bridge's own).
        for inj in &mut arm.inject {
            if let SourceSpec::Pool(p) = &mut inj.source {
                if p.router == Router::Trained {
                    p.router = Router::Uniform;
                }
            }
        }
        Ok(SweepConfig {
            run,
            data: DataSection {
                source: self.data,
                path: None,
                n: 1,
            },
            resources: BTreeMap::new(),
            arms: vec![
                planned(Arm::floor(), None),
                planned(Arm::native(), None),
                planned(arm, Some(0)),
            ],
        })
    }

    fn compile(&self, field: &str, cfg: &ModelConfig) -> Result<crate::plan::Plan> {
        let mini = self.mini_config()?;
        let no_sender = |id: &str| -> Result<ModelConfig> {
            Err(DriverError::Config(format!(
                "{field} arm: a bridge is trained on the receiver's own states (sender `{id}`)"
            )))
        };
        let plan = crate::plan::compile(&mini, cfg, "receiver", &no_sender)
            .map_err(|e| DriverError::Config(format!("{field} arm: {e}")))?;
        // A pool (a router's, or a sender pool) holds other training items'
        // passages; otherwise a bridge is trained on the item's own passes.
        let partners_ok = self.targets == BridgeTargets::Router
            || self
                .arm
                .inject
                .iter()
                .any(|i| matches!(i.source, SourceSpec::Pool(_)));
        if (plan.needs.partners > 0 && !partners_ok)
            || !plan.resources.is_empty()
            || !plan.senders.is_empty()
        {
            return Err(DriverError::Config(format!(
                "{field} arm: a bridge is trained under an arm of the item's own passes (no other items, resources or senders)"
            )));
        }
        Ok(plan)
    }
}

/// A trained bridge: the kept adapters, the initial ones, and the curve.
#[derive(Debug, Clone)]
pub struct BridgeValue {
    /// The adapters of the kept epoch.
    pub trained: Vec<Adapter>,
    /// The adapters before the first step (B = 0; derived from the seed on
    /// load, not stored).
    pub init: Vec<Adapter>,
    /// Per epoch (0 = before training): epoch, mean training loss (NaN at
    /// epoch 0), slice loss, slice first-token accuracy.
    pub curve: Vec<[f64; 4]>,
    /// The kept epoch.
    pub best_epoch: usize,
    /// Where training stopped early on a non-finite loss: the epoch and the
    /// step within it (1-based); the kept adapters are the best epoch's
    /// before it.
    pub stopped: Option<(usize, usize)>,
    /// The trained router's maps of the kept epoch (a bridge of `targets =
    /// "router"`; empty otherwise).
    pub router: Vec<RouterLayer>,
    /// The router's maps before the first step (W_q = 0: uniform weights;
    /// derived from the seed on load, not stored).
    pub init_router: Vec<RouterLayer>,
}

impl BridgeValue {
    /// The router of `layer` (its initial maps with `init`).
    pub fn router(&self, layer: usize, init: bool) -> Result<&RouterLayer> {
        let set = if init {
            &self.init_router
        } else {
            &self.router
        };
        set.iter().find(|r| r.layer == layer).ok_or_else(|| {
            DriverError::Records(format!(
                "the bridge holds no router of layer {layer} (it routes layers {:?})",
                set.iter().map(|r| r.layer).collect::<Vec<_>>()
            ))
        })
    }

    /// The hooks an arm runs its question and decoding with.
    pub fn spec(&self, init: bool) -> HookSpec {
        HookSpec::new().adapt_all(if init {
            self.init.clone()
        } else {
            self.trained.clone()
        })
    }
}

fn proj_name(p: Projection) -> &'static str {
    match p {
        Projection::Q => "q",
        Projection::K => "k",
        Projection::V => "v",
    }
}

/// The name of a trained adapter's tensors in a bridge's files, its value
/// file and its training progress (`.a` and `.b` appended).
fn trained_adapter_key(layer: usize, p: Projection) -> String {
    format!("trained.{layer}.{}", proj_name(p))
}

/// The name of a trained router map (`wq` or `wk`) in a bridge's files,
/// its value file and its training progress.
fn trained_router_key(layer: usize, map: &str) -> String {
    format!("router.trained.{layer}.{map}")
}

/// A training or slice example: the prepared cache, the question, the
/// gold answer's first token.
struct Example {
    cache: KvCache,
    question: Vec<u32>,
    target: u32,
}

impl Keep for Example {
    fn to_parts(&self) -> Result<Parts> {
        let (tensors, mut fields) = kept::cache_parts("cache", &self.cache)?;
        fields["question"] = serde_json::json!(self.question);
        fields["target"] = self.target.into();
        Ok((tensors, fields))
    }

    fn from_parts(
        tensors: &mut HashMap<String, Tensor>,
        fields: &serde_json::Value,
        fit: &Fit,
    ) -> std::result::Result<Self, String> {
        Ok(Example {
            cache: kept::cache_from("cache", tensors, fields, fit)?,
            question: kept::ids(fields, "question")?,
            target: kept::uint(fields, "target")? as u32,
        })
    }
}

impl Keep for RouterExample {
    fn to_parts(&self) -> Result<Parts> {
        let (mut tensors, lower) = kept::cache_parts("lower", &self.lower)?;
        let (prefix_tensors, prefix) = kept::cache_parts("prefix", &self.prefix)?;
        tensors.extend(prefix_tensors);
        tensors.push(("own".into(), self.own.clone()));
        tensors.push(("mask".into(), self.mask.clone()));
        for (i, m) in self.members.iter().enumerate() {
            tensors.push((format!("member.{i}"), m.clone()));
        }
        let fields = serde_json::json!({
            "lower": lower,
            "prefix": prefix,
            "layer": self.layer,
            "members": self.members.len(),
            "alpha_bits": self.alpha.to_bits(),
            "p0": self.p0,
            "question": self.question,
            "target": self.target,
        });
        Ok((tensors, fields))
    }

    fn from_parts(
        tensors: &mut HashMap<String, Tensor>,
        fields: &serde_json::Value,
        fit: &Fit,
    ) -> std::result::Result<Self, String> {
        let members = (0..kept::uint(fields, "members")?)
            .map(|i| kept::take(tensors, &format!("member.{i}")))
            .collect::<std::result::Result<Vec<_>, String>>()?;
        Ok(RouterExample {
            layer: kept::uint(fields, "layer")?,
            own: kept::take(tensors, "own")?,
            members,
            mask: kept::take(tensors, "mask")?,
            alpha: f64::from_bits(
                fields["alpha_bits"]
                    .as_u64()
                    .ok_or("no field `alpha_bits`")?,
            ),
            p0: kept::uint(fields, "p0")?,
            lower: kept::cache_from("lower", tensors, &fields["lower"], fit)?,
            prefix: kept::cache_from("prefix", tensors, &fields["prefix"], fit)?,
            question: kept::ids(fields, "question")?,
            target: kept::uint(fields, "target")? as u32,
        })
    }
}

/// The examples of `set.items[range]` under the training arm; bridges
/// trained under the same arm on the same items in one invocation share
/// them (`scratch`, in `group`: [`ResourceKind::shared_work`]), and with
/// [`BuildCx::shared_dir`] each is kept on disk as it is computed, so that
/// an invocation after one cut short reads it back ([`kept`]; the file
/// must name the example's key and the digest of the item's and its
/// partners' context pairs and gold answers). After a file that cannot be
/// written (a full disk) the rest are not kept.
/// Mis-source partners (a router's distractor holders) are other training
/// items of `set`.
#[allow(clippy::too_many_arguments)]
fn examples<E: Keep + Send + Sync + 'static>(
    cx: &BuildCx,
    group: &str,
    spec: &BridgeSpec,
    plan: &crate::plan::Plan,
    set: &crate::items::ItemSet,
    range: std::ops::Range<usize>,
    what: &str,
    make: &dyn Fn(
        &crate::passes::ItemPasses,
        &crate::plan::ArmProgram,
        &SplitItem,
        &crate::exec::ItemCx,
    ) -> Result<E>,
) -> Result<Vec<Arc<E>>> {
    let model = cx.model;
    let arm_key = serde_json::to_string(&spec.arm).unwrap_or_default();
    let program = plan
        .programs
        .iter()
        .find(|p| p.name == TRAIN_ARM)
        .ok_or_else(|| {
            DriverError::Records("internal: the training arm was not compiled".into())
        })?;
    let none = BTreeMap::new();
    let senders = BTreeMap::new();
    let partner_passes = crate::passes::PartnerPasses::default();
    let bar = ProgressBar::new(range.len() as u64);
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "bridge {what} caches {{bar:30}} {{pos}}/{{len}} eta {{eta}}"
        ))
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    if let Some(dir) = &cx.shared_dir {
        tracing::info!(
            "bridge {what} examples kept in {} (read back by a build resumed after a stop; removed once the group's resources are obtained)",
            dir.display()
        );
    }
    let keeping = std::cell::Cell::new(cx.shared_dir.is_some());
    let (read_back, computed) = (std::cell::Cell::new(0usize), std::cell::Cell::new(0usize));
    let fit = Fit {
        cfg: model.config(),
        device: model.device(),
    };
    let mut out = Vec::with_capacity(range.len());
    for i in range {
        let it = &set.items[i];
        let partner_ids: Vec<&str> = set.partners[i]
            .iter()
            .map(|&j| set.items[j].item.id.as_str())
            .collect();
        let key = format!(
            "bridge example {} {arm_key} {i} {} {partner_ids:?}",
            std::any::type_name::<E>(),
            it.item.id,
        );
        let v = cx.scratch.get_or_make(group, &key, || {
            let pair = &set.pairs[i];
            // Where the example is kept, and the digest of what it is
            // made from (the item's and its partners' pairs and answers).
            let kept_at = cx.shared_dir.as_deref().filter(|_| keeping.get()).map(|dir| {
                let answers: Vec<&Vec<String>> = std::iter::once(i)
                    .chain(set.partners[i].iter().copied())
                    .map(|j| &set.items[j].item.answers)
                    .collect();
                let pairs: Vec<&tolerable_probe::ContextPair> =
                    std::iter::once(pair).chain(set.partners_of(i)).collect();
                let made_of = serde_json::to_string(&(pairs, answers));
                (dir, super::files::hex_sha256(made_of.unwrap_or_default().as_bytes()))
            });
            if let Some((dir, digest)) = &kept_at {
                if let Some(e) = kept::read::<E>(dir, &key, digest, &fit) {
                    read_back.set(read_back.get() + 1);
                    return Ok(Arc::new(e) as Value);
                }
            }
            let passes = crate::passes::item_passes_with(
                model,
                pair,
                &set.partners_of(i),
                &plan.needs,
                &senders,
                None,
                Some(&partner_passes),
            )?;
            let memo = crate::transforms::Memo::default();
            let icx = crate::exec::ItemCx {
                model,
                passes: &passes,
                index: i,
                seed: 0,
                resources: &none,
                memo: &memo,
            };
            let e = make(&passes, program, it, &icx)?;
            computed.set(computed.get() + 1);
            if let Some((dir, digest)) = &kept_at {
                // A file not written costs a recomputation on a resume only.
                if let Err(err) = kept::write(dir, &key, digest, &e) {
                    tracing::warn!(
                        "{}: an example was not kept on disk ({err}); the rest of this set are not kept",
                        dir.display()
                    );
                    keeping.set(false);
                }
            }
            Ok(Arc::new(e))
        })?;
        out.push(v.downcast::<E>().map_err(|_| {
            DriverError::Records(format!("internal: scratch `{key}` is not an example"))
        })?);
        bar.inc(1);
    }
    bar.finish_and_clear();
    if cx.shared_dir.is_some() {
        tracing::info!(
            "bridge {what} examples: {} read back from disk, {} computed",
            read_back.get(),
            computed.get()
        );
    }
    Ok(out)
}

/// The gold answer's first token of a training item.
fn target_of(it: &SplitItem, tokenizer: &tolerable_runtime::Tokenizer) -> Result<u32> {
    let answer = it.item.answers.first().ok_or_else(|| {
        DriverError::Config(format!("training item {} has no gold answer", it.item.id))
    })?;
    tokenizer
        .encode(&format!(" {}", answer.trim()))?
        .first()
        .copied()
        .ok_or_else(|| {
            DriverError::Config(format!("training item {}: an empty answer", it.item.id))
        })
}

/// One adapter training example: the training arm's prepared cache.
fn adapter_example(
    program: &crate::plan::ArmProgram,
    it: &SplitItem,
    icx: &crate::exec::ItemCx,
    tokenizer: &tolerable_runtime::Tokenizer,
) -> Result<Example> {
    let prepared = crate::exec::prepare(program, icx)?;
    Ok(Example {
        cache: prepared.cache,
        question: it.pair().suffix.clone(),
        target: target_of(it, tokenizer)?,
    })
}

/// A router training or slice example: the receiver's own state and the
/// pool members' at the routed layer, the sites, and the masked cache the
/// context is re-run over from the first site.
struct RouterExample {
    layer: usize,
    own: Tensor,
    members: Vec<Tensor>,
    mask: Tensor,
    alpha: f64,
    p0: usize,
    lower: KvCache,
    prefix: KvCache,
    question: Vec<u32>,
    target: u32,
}

fn router_example(
    spec: &BridgeSpec,
    passes: &crate::passes::ItemPasses,
    program: &crate::plan::ArmProgram,
    it: &SplitItem,
    tokenizer: &tolerable_runtime::Tokenizer,
) -> Result<RouterExample> {
    let (_, pool) = spec
        .router_pool()
        .ok_or_else(|| DriverError::Records("internal: a router bridge without a pool".into()))?;
    let step = program.resid_steps.first().ok_or_else(|| {
        DriverError::Records("internal: the router's training arm has no residual step".into())
    })?;
    let layer = *step.layers.first().ok_or_else(|| {
        DriverError::Records("internal: the router's injection has no layer".into())
    })?;
    let own = passes.base.resid(layer)?.clone();
    let t = own.dim(1)?;
    let sites: Vec<usize> = step
        .positions
        .resolve(&passes.geometry)
        .into_iter()
        .filter(|&p| p < t)
        .collect();
    let p0 = *sites.first().ok_or_else(|| {
        DriverError::Config(format!(
            "training item {}: the router's injection finds no site",
            it.item.id
        ))
    })?;
    let pool = crate::sources::PoolSource::new(pool.n, Router::Uniform, pool.members, None)
        .map_err(DriverError::Config)?;
    let mut m = vec![0f32; t];
    for &p in &sites {
        m[p] = 1.0;
    }
    Ok(RouterExample {
        layer,
        members: pool.member_resids(passes, layer)?,
        mask: Tensor::from_vec(m, (1, t, 1), &Device::Cpu)?,
        alpha: step.alpha,
        p0,
        lower: passes.base.cache.narrow(p0, t - p0)?,
        prefix: passes.base.cache.truncate(p0)?,
        own,
        question: it.pair().suffix.clone(),
        target: target_of(it, tokenizer)?,
    })
}

/// Loss and first-token hit of a router example: the routed pool added at
/// the sites, the context re-run from the routed layer, then the question.
fn router_score(model: &Model, ex: &RouterExample, router: &RouterLayer) -> Result<(Tensor, bool)> {
    let routed = router.route(&ex.own, &ex.members)?;
    let injected = (&ex.own + (routed * ex.alpha)?.broadcast_mul(&ex.mask)?)?;
    let t = ex.own.dim(1)?;
    let resid_in = injected.narrow(1, ex.p0, t - ex.p0)?;
    let mut cache = ex.prefix.clone();
    model.forward_from_layer(
        ex.layer,
        &resid_in,
        &ex.lower,
        &mut cache,
        &HookSpec::new(),
        LogitsAt::None,
    )?;
    question_score(model, cache, &ex.question, ex.target, &HookSpec::new())
}

fn adapters_of(
    vars: &[(usize, Projection, Var, Var)],
    scale: f64,
    snapshot: bool,
) -> Result<Vec<Adapter>> {
    vars.iter()
        .map(|(l, p, a, b)| {
            let (a, b) = if snapshot {
                (
                    a.as_tensor().detach().copy()?,
                    b.as_tensor().detach().copy()?,
                )
            } else {
                (a.as_tensor().clone(), b.as_tensor().clone())
            };
            Ok(Adapter {
                layer: *l,
                projection: *p,
                a,
                b,
                scale,
                rows: None,
            })
        })
        .collect()
}

/// The sum of a parameter tensor's entries in f64, added in order (a saved
/// bridge's check on its derived initial adapters).
fn a_sum(t: &Tensor) -> Result<f64> {
    Ok(t.flatten_all()?
        .to_vec1::<f32>()?
        .iter()
        .map(|&x| x as f64)
        .sum())
}

/// Refuses a derived initial tensor (`what`, from `path`'s bridge) whose
/// sum is not the one the file kept: the seed's draw changed since the
/// bridge was trained.
fn check_init_sum(path: &Path, what: &str, stored: &Tensor, derived: &Tensor) -> Result<()> {
    let want = stored.to_vec1::<f64>()?;
    let got = a_sum(derived)?;
    if want.len() != 1 || want[0].to_bits() != got.to_bits() {
        return Err(DriverError::Records(format!(
            "{}: {what} derived from the seed sums to {got}, the saved bridge's to {want:?}: the initialisation changed since it was trained",
            path.display()
        )));
    }
    Ok(())
}

/// Loss and first-token hit of one example under `spec`.
fn score(model: &Model, ex: &Example, spec: &HookSpec) -> Result<(Tensor, bool)> {
    question_score(model, ex.cache.clone(), &ex.question, ex.target, spec)
}

/// The mean loss of a mini-batch of examples under `spec`: one example
/// alone as [`score`] (the one-item recipe, bit for bit); several read
/// their questions as one padded batch, each over its own cache
/// ([`KvCache::stack_padded`]), the cross-entropy averaged over them.
fn batch_loss(model: &Model, batch: &[&Example], spec: &HookSpec) -> Result<Tensor> {
    if let [one] = batch {
        return Ok(score(model, one, spec)?.0);
    }
    let caches: Vec<&KvCache> = batch.iter().map(|e| &e.cache).collect();
    let mut cache = KvCache::stack_padded(&caches)?;
    let questions: Vec<Vec<u32>> = batch.iter().map(|e| e.question.clone()).collect();
    let logits = model.prompt_logits_padded(&questions, &mut cache, spec)?;
    let targets: Vec<u32> = batch.iter().map(|e| e.target).collect();
    let targets = Tensor::new(targets.as_slice(), logits.device())?;
    Ok(candle_nn::loss::cross_entropy(&logits, &targets)?)
}

/// The cross-entropy of `target` after `question` over `cache`, and whether
/// it is the argmax.
fn question_score(
    model: &Model,
    mut cache: KvCache,
    question: &[u32],
    target: u32,
    spec: &HookSpec,
) -> Result<(Tensor, bool)> {
    let logits = model
        .forward(
            &model.tokens(&[question.to_vec()])?,
            &mut cache,
            spec,
            LogitsAt::Last,
        )?
        .logits
        .ok_or_else(|| DriverError::Records("internal: no logits".into()))?
        .squeeze(1)?;
    let target_t = Tensor::new(&[target], logits.device())?;
    let loss = candle_nn::loss::cross_entropy(&logits, &target_t)?;
    let hit = logits.argmax(candle_core::D::Minus1)?.to_vec1::<u32>()?[0] == target;
    Ok((loss, hit))
}

/// Mean loss and first-token accuracy over a slice.
fn slice_scores<E>(
    slice: &[Arc<E>],
    score: &dyn Fn(&E) -> Result<(Tensor, bool)>,
) -> Result<(f64, f64)> {
    let (mut loss, mut hits) = (0.0, 0usize);
    for ex in slice {
        let (l, h) = score(ex)?;
        loss += l.to_scalar::<f32>()? as f64;
        hits += h as usize;
    }
    Ok((
        loss / slice.len().max(1) as f64,
        hits as f64 / slice.len().max(1) as f64,
    ))
}

/// What a training loop ends with: the initial parameters, the kept ones,
/// the curve, the kept epoch, where it stopped early and the epoch its
/// progress file let it resume after.
struct Trained<S> {
    init: S,
    kept: S,
    curve: Vec<[f64; 4]>,
    best_epoch: usize,
    stopped: Option<(usize, usize)>,
    resumed_after: Option<super::ResumedAt>,
}

/// The training loop every bridge shares: AdamW on `params`, `spec.batch`
/// examples per step (the last step of an epoch takes what is left) in a
/// seeded order, the slice scored before the first step and after each
/// epoch, the best epoch (slice accuracy, then loss) kept; a non-finite
/// loss stops training. With `progress`, each finished epoch is saved
/// there, and inside an epoch the steps taken when `save_every` has passed
/// since the last save; a training that finds a usable file resumes after
/// its epoch and steps (the same bits as one uninterrupted run). `params`
/// are named, in training order; a progress file of other names is not
/// used.
#[allow(clippy::too_many_arguments)]
fn train_loop<S: Clone>(
    spec: &BridgeSpec,
    field: &str,
    n_train: usize,
    params: Vec<(String, Var)>,
    snapshot: &dyn Fn() -> Result<S>,
    step_loss: &dyn Fn(&[usize]) -> Result<Tensor>,
    slice: &dyn Fn(&S) -> Result<(f64, f64)>,
    progress: Option<&Path>,
    save_every: Duration,
) -> Result<Trained<S>> {
    let per_step = spec.batch.max(1);
    let steps_per_epoch = n_train.div_ceil(per_step);
    let (names, params): (Vec<String>, Vec<Var>) = params.into_iter().unzip();
    let mut opt = super::optim::AdamW::new(
        params.clone(),
        candle_nn::ParamsAdamW {
            lr: spec.lr,
            weight_decay: spec.weight_decay,
            ..Default::default()
        },
    )?;
    let init = snapshot()?;
    let mut order: Vec<usize> = (0..n_train).collect();
    let set_all = |values: &[Tensor]| -> Result<()> {
        for (v, t) in params.iter().zip(values) {
            v.set(&t.to_device(v.device())?)?;
        }
        Ok(())
    };
    let copy_all = || -> Result<Vec<Tensor>> {
        params
            .iter()
            .map(|v| Ok(v.as_tensor().detach().copy()?))
            .collect()
    };
    let saved = match progress {
        Some(path) => match Progress::load(path, &names, &params, spec.epochs)?
            .map(|p| p.and_then(|p| p.fits(steps_per_epoch)))
        {
            Some(Ok(p)) => Some(p),
            Some(Err(why)) => {
                tracing::warn!(
                    "{field}: the training progress in {} is not used ({why}); training from the start",
                    path.display()
                );
                None
            }
            None => None,
        },
        None => None,
    };
    let resumed_after = saved.as_ref().map(|p| super::ResumedAt {
        epoch: p.epoch,
        steps: p.steps,
    });
    // Steps already taken of the first epoch to run, and their summed loss.
    let (skip, partial_loss) = saved
        .as_ref()
        .map_or((0, 0.0), |p| (p.steps, p.partial_loss));
    let (mut curve, mut best_epoch, mut kept, mut kept_params, first) = match saved {
        Some(p) => {
            let kept = match &p.kept {
                Some(values) => {
                    set_all(values)?;
                    snapshot()?
                }
                None => init.clone(),
            };
            set_all(&p.params)?;
            opt.restore(&p.adam)?;
            for epoch in 1..=p.epoch {
                shuffle_epoch(spec.seed, epoch, &mut order);
            }
            tracing::info!(
                "{field}: resuming after epoch {} of {} and {} of the next epoch's {steps_per_epoch} steps (kept epoch {}) from {}",
                p.epoch,
                spec.epochs,
                p.steps,
                p.best_epoch,
                progress
                    .map(|p| p.display().to_string())
                    .unwrap_or_default()
            );
            (p.curve, p.best_epoch, kept, p.kept, p.epoch + 1)
        }
        None => {
            let (l0, a0) = slice(&init)?;
            tracing::info!(
                "{field}: epoch 0 (initial): slice loss {l0:.3}, first-token accuracy {a0:.3}"
            );
            (vec![[0.0, f64::NAN, l0, a0]], 0usize, init.clone(), None, 1)
        }
    };
    let mut best = (curve[best_epoch][3], -curve[best_epoch][2]);
    // Saves the progress after `at` = (epochs finished, steps of the next,
    // their summed loss); a file that cannot be written costs a resume,
    // not the training, and is logged.
    let save = |path: &Path,
                at: (usize, usize, f64),
                opt: &super::optim::AdamW,
                kept: &Option<Vec<Tensor>>,
                curve: &[[f64; 4]],
                best_epoch: usize|
     -> Result<()> {
        let (epoch, steps, partial_loss) = at;
        let p = Progress {
            epoch,
            steps,
            partial_loss,
            names: names.clone(),
            params: copy_all()?,
            adam: opt.state()?,
            kept: kept.clone(),
            curve: curve.to_vec(),
            best_epoch,
        };
        if let Err(e) = p.save(path) {
            tracing::warn!(
                "{field}: the progress after epoch {epoch} and {steps} steps was not saved to {}: {e}",
                path.display()
            );
        }
        Ok(())
    };
    let mut stopped = None;
    let mut last_save = Instant::now();
    'epochs: for epoch in first..=spec.epochs {
        shuffle_epoch(spec.seed, epoch, &mut order);
        let bar = ProgressBar::new(order.len() as u64);
        bar.set_style(
            ProgressStyle::with_template(&format!(
                "bridge epoch {epoch}/{} {{bar:30}} {{pos}}/{{len}} loss {{msg}} eta {{eta}}",
                spec.epochs
            ))
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        let (done, mut total) = if epoch == first {
            (skip, partial_loss)
        } else {
            (0, 0.0)
        };
        bar.set_position(order.len().min(done * per_step) as u64);
        for (step, batch) in order.chunks(per_step).enumerate().skip(done) {
            let loss = step_loss(batch)?;
            let value = loss.to_scalar::<f32>()? as f64;
            if !value.is_finite() {
                bar.finish_and_clear();
                tracing::warn!(
                    "{field}: training stopped at epoch {epoch}, step {}: the loss is {value}; the parameters of epoch {best_epoch} are kept",
                    step + 1
                );
                stopped = Some((epoch, step + 1));
                break 'epochs;
            }
            // The epoch's mean training loss is over examples.
            total += value * batch.len() as f64;
            opt.backward_step(&loss)?;
            bar.inc(batch.len() as u64);
            bar.set_message(format!("{:.3}", total / bar.position() as f64));
            if let Some(path) =
                progress.filter(|_| step + 1 < steps_per_epoch && last_save.elapsed() >= save_every)
            {
                let at = (epoch - 1, step + 1, total);
                save(path, at, &opt, &kept_params, &curve, best_epoch)?;
                last_save = Instant::now();
            }
        }
        bar.finish_and_clear();
        let now = snapshot()?;
        let (sl, sa) = slice(&now)?;
        let mean = total / order.len() as f64;
        tracing::info!("{field}: epoch {epoch}: training loss {mean:.3}, slice loss {sl:.3}, first-token accuracy {sa:.3}");
        curve.push([epoch as f64, mean, sl, sa]);
        if !sl.is_finite() {
            tracing::warn!(
                "{field}: training stopped after epoch {epoch}: the slice loss is {sl}; the parameters of epoch {best_epoch} are kept"
            );
            stopped = Some((epoch, steps_per_epoch));
            break;
        }
        if (sa, -sl) > best {
            best = (sa, -sl);
            best_epoch = epoch;
            kept = now;
            kept_params = Some(copy_all()?);
        }
        if let Some(path) = progress {
            save(
                path,
                (epoch, 0, 0.0),
                &opt,
                &kept_params,
                &curve,
                best_epoch,
            )?;
            last_save = Instant::now();
        }
    }
    Ok(Trained {
        init,
        kept,
        curve,
        best_epoch,
        stopped,
        resumed_after,
    })
}

/// How often a training saves its progress inside an epoch (after the
/// first step this long after the last save), unless
/// `$TOLERABLE_PROGRESS_SECS` says otherwise: a training cut short loses
/// about this much of its epoch, a step and a save more at most.
const PROGRESS_EVERY: Duration = Duration::from_secs(60);

/// The environment variable that sets, in seconds, how often a training
/// saves its progress inside an epoch (0: after every step).
pub const PROGRESS_SECS_ENV: &str = "TOLERABLE_PROGRESS_SECS";

/// How often a training saves its progress inside an epoch: `value` (the
/// environment variable's, if set) in seconds, else [`PROGRESS_EVERY`]; a
/// value that is not a number of seconds is refused by name.
fn progress_every(value: Option<&str>) -> Result<Duration> {
    match value {
        None => Ok(PROGRESS_EVERY),
        Some(v) => v
            .trim()
            .parse::<f64>()
            .ok()
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
            .ok_or_else(|| {
                DriverError::Config(format!(
                    "${PROGRESS_SECS_ENV} is `{v}`, not a number of seconds (at least 0)"
                ))
            }),
    }
}

/// How often a training saves its progress inside an epoch, as this
/// process's environment sets it ([`PROGRESS_SECS_ENV`]); an invalid value
/// is refused by name (by a bridge's validation, before a sweep's model
/// loads).
fn progress_setting() -> Result<Duration> {
    progress_every(std::env::var(PROGRESS_SECS_ENV).ok().as_deref())
}

/// Shuffles the training order for `epoch` (each epoch shuffles the order
/// the previous one left).
fn shuffle_epoch(seed: u64, epoch: usize, order: &mut [usize]) {
    let mut rng = tolerable_probe::rng::Rng::new(crate::exec::mix(seed, &[epoch as u64, 0xE90C]));
    rng.shuffle(order);
}

impl ResourceKind for BridgeSpec {
    fn kind(&self) -> &'static str {
        "bridge"
    }

    fn version(&self) -> u32 {
        1
    }

    /// The training caches: bridges trained under the same arm from the
    /// same item sample (data source and seed) share them, whatever they
    /// adapt. An answer-disjoint split is the plain split with a few items
    /// replaced in place (5 of the 0.5B ladder's 232), so its caches are
    /// mostly the plain split's: they are one group. (The caches themselves
    /// are keyed by item and position, so grouping changes no value.)
    fn shared_work(&self, _items: &[SplitItem]) -> Option<String> {
        Some(format!(
            "bridge examples {} from {:?}, sample seed {}",
            serde_json::to_string(&self.arm).unwrap_or_default(),
            self.data,
            self.seed
        ))
    }

    fn validate(
        &self,
        field: &str,
        cfg: &ModelConfig,
        _all: &BTreeMap<String, ResourceSpec>,
    ) -> Result<()> {
        let err = |m: String| Err(DriverError::Config(format!("{field} {m}")));
        if self.targets == BridgeTargets::Router {
            let Some((inj, pool)) = self.router_pool() else {
                return err("arm: a router is trained under one injection whose source is a pool (`source = { pool = { n, router = \"trained\" } }`)".into());
            };
            if pool.router != Router::Trained {
                return err(format!(
                    "arm.inject.source.pool.router: `{:?}`: a router bridge trains the pool's router; write router = \"trained\"",
                    pool.router
                ));
            }
            if inj.carrier != Carrier::H || inj.mechanism != Mechanism::Add {
                return err("arm.inject: a trained router routes the activation carrier additively (carrier = \"h\", mechanism = \"add\")".into());
            }
            if self.arm.base != Base::Masked {
                return err("arm.base: a router is trained on the masked receiver".into());
            }
            if inj.perturb.is_some()
                || inj.blend.is_some()
                || inj.map.is_some()
                || inj.source_positions.is_some()
                || inj.heads.is_some()
            {
                return err("arm.inject: a router is trained on the pool's states as they are (no perturb, blend, map, source_positions or heads)".into());
            }
            let n = inj
                .layers
                .resolve(cfg.n_layers, &format!("{field} arm.inject.layers"))?
                .len();
            if n != 1 {
                return err(format!(
                    "arm.inject.layers: a router is trained at one layer, this injection names {n}"
                ));
            }
            if self.layers != LayerSet::All {
                return err("layers: a router routes the layer of its injection (arm.inject.layers); leave `layers` out".into());
            }
        } else if self
            .arm
            .inject
            .iter()
            .any(|i| matches!(&i.source, SourceSpec::Pool(p) if p.router == Router::Trained))
        {
            return err(format!(
                "targets: `{:?}`: a pool with router = \"trained\" is trained by a bridge of targets = \"router\"",
                self.targets
            ));
        }
        if self.rank == 0 || self.rank > cfg.d_model {
            return err(format!(
                "rank: {} is outside 1..={}",
                self.rank, cfg.d_model
            ));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return err(format!(
                "alpha: {} must be finite and above zero",
                self.alpha
            ));
        }
        super::check_training(field, self.train_items, self.data, "bridges are")?;
        if self.batch == 0 || self.batch > self.train_items {
            return err(format!(
                "batch: {} is outside 1..={} (the training items)",
                self.batch, self.train_items
            ));
        }
        if self.batch > 1 && self.targets == BridgeTargets::Router {
            return err(format!(
                "batch: {}: a router trains one example a step (batch = 1)",
                self.batch
            ));
        }
        if self.slice_items == 0 || self.epochs == 0 {
            return err(format!(
                "slice_items and epochs must be at least 1 (got {}, {})",
                self.slice_items, self.epochs
            ));
        }
        if !(self.lr.is_finite()
            && self.lr > 0.0
            && self.weight_decay.is_finite()
            && self.weight_decay >= 0.0)
        {
            return err(format!(
                "lr {} / weight_decay {}: lr above zero, weight decay at least zero",
                self.lr, self.weight_decay
            ));
        }
        let layers = self
            .layers
            .resolve(cfg.n_layers, &format!("{field} layers"))?;
        if layers.is_empty() {
            return err("layers: no layer".into());
        }
        self.compile(field, cfg)?;
        // Read from the environment: refused with the plan, before the
        // model loads, not after the gates and the training examples.
        progress_setting()?;
        Ok(())
    }

    fn training_items(&self, cx: &TrainCx) -> Result<Vec<SplitItem>> {
        let n = self.train_items + self.slice_items;
        let reaches = cx.eval.reach_test();
        let mut draw = |k: usize| {
            if self.answer_free {
                super::sample_training_where(cx, self.data, k, self.seed, &|it| !reaches(it))
            } else if self.answer_disjoint {
                super::sample_training_where(cx, self.data, k, self.seed, &|it| {
                    !cx.eval.shares_gold(it)
                })
            } else {
                sample_training(cx, self.data, k, self.seed)
            }
        };
        // A pool's distractors are other training items: those that cannot
        // get enough are replaced by the next drawn (as in an evaluation run).
        let n_partners = self.compile(&cx.field, cx.receiver)?.needs.partners;
        let (set, short) = crate::items::with_partners(&mut draw, n, n_partners, self.seed)
            .map_err(|e| DriverError::Config(format!("{}: {e}", cx.field)))?;
        if !short.is_empty() {
            tracing::warn!(
                "{}: {} training item(s) replaced for too few distractor partners ({n_partners} wanted)",
                cx.field,
                short.len()
            );
        }
        Ok(set.items)
    }

    fn build(&self, cx: &BuildCx, items: &[SplitItem]) -> Result<Value> {
        let field = cx.train.field.clone();
        let model = cx.model;
        if model.precision() != tolerable_runtime::Precision::F32 {
            return Err(DriverError::Config(format!(
                "{field}: bridges train on the f32 path (quantized projections pass no gradient); run with precision = \"f32\""
            )));
        }
        let save_every = progress_setting()?;
        let cfg = model.config().clone();
        let plan = self.compile(&field, &cfg)?;
        let n = self.train_items + self.slice_items;
        if items.len() < n {
            return Err(DriverError::Config(format!(
                "{field}: {} training items asked ({} + {} for the slice), {} available",
                n,
                self.train_items,
                self.slice_items,
                items.len()
            )));
        }
        // Partners (a router's distractors) come from the whole training set.
        let set = crate::items::ItemSet::new(items[..n].to_vec(), plan.needs.partners, self.seed)
            .map_err(|e| DriverError::Config(format!("{field}: {e}")))?;
        let (tr, sl) = (0..self.train_items, self.train_items..n);
        let tokenizer = cx.train.tokenizer;
        let group = self.shared_work(items).unwrap_or_default();
        let diff = model.clone().with_kernels(Kernels::Differentiable);
        if self.targets == BridgeTargets::Router {
            let make = |passes: &crate::passes::ItemPasses,
                        program: &crate::plan::ArmProgram,
                        it: &SplitItem,
                        _: &crate::exec::ItemCx| {
                router_example(self, passes, program, it, tokenizer)
            };
            let train = examples(cx, &group, self, &plan, &set, tr, "training", &make)?;
            let slice = examples(cx, &group, self, &plan, &set, sl, "slice", &make)?;
            let layer = train.first().map(|e| e.layer).unwrap_or(0);
            let r0 = self.init_router(cfg.d_model, self.rank, layer)?;
            let (wq, wk) = (Var::from_tensor(&r0.wq)?, Var::from_tensor(&r0.wk)?);
            let live = || RouterLayer {
                layer,
                wq: wq.as_tensor().clone(),
                wk: wk.as_tensor().clone(),
            };
            let snapshot = || -> Result<Vec<RouterLayer>> {
                Ok(vec![RouterLayer {
                    layer,
                    wq: wq.as_tensor().detach().copy()?,
                    wk: wk.as_tensor().detach().copy()?,
                }])
            };
            let done = train_loop(
                self,
                &field,
                train.len(),
                vec![
                    (trained_router_key(layer, "wq"), wq.clone()),
                    (trained_router_key(layer, "wk"), wk.clone()),
                ],
                &snapshot,
                &|batch| match batch {
                    [i] => Ok(router_score(&diff, &train[*i], &live())?.0),
                    _ => Err(DriverError::Records(format!(
                        "internal: a router step of {} examples",
                        batch.len()
                    ))),
                },
                &|s: &Vec<RouterLayer>| slice_scores(&slice, &|e| router_score(model, e, &s[0])),
                cx.progress.as_deref(),
                save_every,
            )?;
            cx.note_resumed(done.resumed_after);
            return Ok(Arc::new(BridgeValue {
                trained: Vec::new(),
                init: Vec::new(),
                curve: done.curve,
                best_epoch: done.best_epoch,
                stopped: done.stopped,
                router: done.kept,
                init_router: done.init,
            }));
        }
        let make = |_: &crate::passes::ItemPasses,
                    program: &crate::plan::ArmProgram,
                    it: &SplitItem,
                    icx: &crate::exec::ItemCx| {
            adapter_example(program, it, icx, tokenizer)
        };
        let train = examples(cx, &group, self, &plan, &set, tr, "training", &make)?;
        let slice = examples(cx, &group, self, &plan, &set, sl, "slice", &make)?;
        // Adapters: A uniform in ±1/sqrt(d) (seeded), B zero.
        let layers = self.layers.resolve(cfg.n_layers, &field)?;
        let hd = cfg.head_dim;
        let mut vars = Vec::new();
        for &l in &layers {
            for p in self.projections() {
                let out = match p {
                    Projection::Q => cfg.n_heads * hd,
                    Projection::K | Projection::V => cfg.n_kv_heads * hd,
                };
                let a = self.init_a(cfg.d_model, self.rank, l, p)?;
                let b = Tensor::zeros((self.rank, out), DType::F32, &Device::Cpu)?;
                vars.push((l, p, Var::from_tensor(&a)?, Var::from_tensor(&b)?));
            }
        }
        let scale = self.scale();
        let params = vars
            .iter()
            .flat_map(|(l, p, a, b)| {
                let at = trained_adapter_key(*l, *p);
                [
                    (format!("{at}.a"), a.clone()),
                    (format!("{at}.b"), b.clone()),
                ]
            })
            .collect();
        let done = train_loop(
            self,
            &field,
            train.len(),
            params,
            &|| adapters_of(&vars, scale, true),
            &|batch| {
                let spec = HookSpec::new().adapt_all(adapters_of(&vars, scale, false)?);
                let examples: Vec<&Example> = batch.iter().map(|&i| &*train[i]).collect();
                batch_loss(&diff, &examples, &spec)
            },
            &|s: &Vec<Adapter>| {
                let spec = HookSpec::new().adapt_all(s.clone());
                slice_scores(&slice, &|e| score(model, e, &spec))
            },
            cx.progress.as_deref(),
            save_every,
        )?;
        cx.note_resumed(done.resumed_after);
        Ok(Arc::new(BridgeValue {
            trained: done.kept,
            init: done.init,
            curve: done.curve,
            best_epoch: done.best_epoch,
            stopped: done.stopped,
            router: Vec::new(),
            init_router: Vec::new(),
        }))
    }

    fn save(&self, value: &Value, path: &Path) -> Result<()> {
        let v: &BridgeValue = super::bank::downcast(value, "bridge")?;
        let mut map: HashMap<String, Tensor> = HashMap::new();
        // The kept adapters only: the initial ones are derived from the seed
        // on load (B = 0, A from `init_a`); the sum of each initial A is kept
        // so that a load can tell a changed draw (a check on the values
        // drawn, not on their layout: a reordering keeps the sum). With B =
        // 0 the initial A changes no output; it matters to a reader of the
        // initial adapters only.
        for ad in v.trained.iter() {
            let key = trained_adapter_key(ad.layer, ad.projection);
            map.insert(format!("{key}.a"), ad.a.clone());
            map.insert(format!("{key}.b"), ad.b.clone());
        }
        for ad in v.init.iter() {
            let key = format!("init_sum.{}.{}", ad.layer, proj_name(ad.projection));
            map.insert(key, Tensor::new(&[a_sum(&ad.a)?], &Device::Cpu)?);
        }
        // A router likewise: its trained maps, and the sum of each initial
        // key map (the initial query map is zero).
        for r in v.router.iter() {
            map.insert(trained_router_key(r.layer, "wq"), r.wq.clone());
            map.insert(trained_router_key(r.layer, "wk"), r.wk.clone());
        }
        for r in v.init_router.iter() {
            map.insert(
                format!("router.init_sum.{}.wk", r.layer),
                Tensor::new(&[a_sum(&r.wk)?], &Device::Cpu)?,
            );
        }
        map.insert("curve".into(), super::progress::curve_tensor(&v.curve)?);
        map.insert(
            "best_epoch".into(),
            Tensor::new(&[v.best_epoch as u32], &Device::Cpu)?,
        );
        if let Some((epoch, step)) = v.stopped {
            map.insert(
                "stopped".into(),
                Tensor::new(&[epoch as u32, step as u32], &Device::Cpu)?,
            );
        }
        candle_core::safetensors::save(&map, path)?;
        Ok(())
    }

    fn load(&self, path: &Path) -> Result<Value> {
        let map = candle_core::safetensors::load(path, &Device::Cpu)?;
        let get = |k: &str| {
            map.get(k)
                .cloned()
                .ok_or_else(|| DriverError::Records(format!("{}: no tensor `{k}`", path.display())))
        };
        let curve = super::progress::curve_rows(&get("curve")?)
            .map_err(|e| DriverError::Records(format!("{}: {e}", path.display())))?;
        let best_epoch = get("best_epoch")?.to_vec1::<u32>()?[0] as usize;
        let stopped = match map.get("stopped") {
            Some(t) => match t.to_vec1::<u32>()?[..] {
                [epoch, step] => Some((epoch as usize, step as usize)),
                _ => {
                    return Err(DriverError::Records(format!(
                        "{}: `stopped` holds {:?}, not [epoch, step]",
                        path.display(),
                        t.dims()
                    )))
                }
            },
            None => None,
        };
        let scale = self.scale();
        let mut trained = Vec::new();
        let mut init = Vec::new();
        let mut keys: Vec<(usize, Projection)> = map
            .keys()
            .filter_map(|k| {
                let parts: Vec<&str> = k.split('.').collect();
                if parts.len() == 4 && parts[0] == "trained" && parts[3] == "a" {
                    let p = match parts[2] {
                        "q" => Projection::Q,
                        "k" => Projection::K,
                        _ => Projection::V,
                    };
                    parts[1].parse().ok().map(|l| (l, p))
                } else {
                    None
                }
            })
            .collect();
        keys.sort_by_key(|(l, p)| (*l, proj_name(*p)));
        for (l, p) in keys {
            let key = trained_adapter_key(l, p);
            let (a, b) = (get(&format!("{key}.a"))?, get(&format!("{key}.b"))?);
            let old = format!("init.{l}.{}", proj_name(p));
            let (a0, b0) = if map.contains_key(&format!("{old}.a")) {
                // Files saved before e8f579b store the initial adapters.
                (get(&format!("{old}.a"))?, get(&format!("{old}.b"))?)
            } else {
                // The file's own shapes: whether they fit the receiver and
                // the spec is `check`'s to say.
                let (d_model, rank) = a.dims2()?;
                let a0 = self.init_a(d_model, rank, l, p)?;
                let b0 = b.zeros_like()?;
                check_init_sum(
                    path,
                    &format!("the initial adapter at layer {l} ({})", proj_name(p)),
                    &get(&format!("init_sum.{l}.{}", proj_name(p)))?,
                    &a0,
                )?;
                (a0, b0)
            };
            trained.push(Adapter {
                layer: l,
                projection: p,
                a,
                b,
                scale,
                rows: None,
            });
            init.push(Adapter {
                layer: l,
                projection: p,
                a: a0,
                b: b0,
                scale,
                rows: None,
            });
        }
        let mut router_layers: Vec<usize> = map
            .keys()
            .filter_map(|k| {
                let parts: Vec<&str> = k.split('.').collect();
                match parts[..] {
                    ["router", "trained", l, "wq"] => l.parse().ok(),
                    _ => None,
                }
            })
            .collect();
        router_layers.sort();
        let (mut router, mut init_router) = (Vec::new(), Vec::new());
        for l in router_layers {
            let trained = RouterLayer {
                layer: l,
                wq: get(&trained_router_key(l, "wq"))?,
                wk: get(&trained_router_key(l, "wk"))?,
            };
            let init = if map.contains_key(&format!("router.init.{l}.wq")) {
                // Files saved before the initial maps were derived store them.
                RouterLayer {
                    layer: l,
                    wq: get(&format!("router.init.{l}.wq"))?,
                    wk: get(&format!("router.init.{l}.wk"))?,
                }
            } else {
                // The file's own shapes, as for adapters.
                let (d_model, rank) = trained.wq.dims2()?;
                let r0 = self.init_router(d_model, rank, l)?;
                check_init_sum(
                    path,
                    &format!("the initial router at layer {l}"),
                    &get(&format!("router.init_sum.{l}.wk"))?,
                    &r0.wk,
                )?;
                r0
            };
            router.push(trained);
            init_router.push(init);
        }
        Ok(Arc::new(BridgeValue {
            trained,
            init,
            curve,
            best_epoch,
            stopped,
            router,
            init_router,
        }))
    }

    fn check(&self, value: &Value, cfg: &ModelConfig) -> Result<()> {
        let v: &BridgeValue = super::bank::downcast(value, "bridge")?;
        if self.targets == BridgeTargets::Router {
            if v.router.len() != 1 || v.init_router.len() != 1 || !v.trained.is_empty() {
                return Err(DriverError::Records(format!(
                    "a router bridge holds one router and no adapters; this one holds {} router(s) and {} adapter(s)",
                    v.router.len(),
                    v.trained.len()
                )));
            }
            for r in v.router.iter().chain(&v.init_router) {
                let want = [cfg.d_model, self.rank];
                if r.wq.dims() != want || r.wk.dims() != want {
                    return Err(DriverError::Records(format!(
                        "router of layer {} has maps {:?} and {:?}; the receiver needs {want:?}",
                        r.layer,
                        r.wq.dims(),
                        r.wk.dims()
                    )));
                }
            }
            return Ok(());
        }
        if !v.router.is_empty() {
            return Err(DriverError::Records(
                "an adapter bridge holds a router".into(),
            ));
        }
        let want = self.layers.resolve(cfg.n_layers, "layers")?.len() * self.projections().len();
        if v.trained.len() != want || v.init.len() != want {
            return Err(DriverError::Records(format!(
                "bridge holds {} adapters, the spec asks for {want}",
                v.trained.len()
            )));
        }
        for ad in v.trained.iter().chain(&v.init) {
            let out = match ad.projection {
                Projection::Q => cfg.n_heads * cfg.head_dim,
                _ => cfg.n_kv_heads * cfg.head_dim,
            };
            if ad.a.dims() != [cfg.d_model, self.rank] || ad.b.dims() != [self.rank, out] {
                return Err(DriverError::Records(format!(
                    "bridge adapter at layer {} ({:?}) has A {:?} and B {:?}; the receiver needs [{}, {}] and [{}, {out}]",
                    ad.layer,
                    ad.projection,
                    ad.a.dims(),
                    ad.b.dims(),
                    cfg.d_model,
                    self.rank,
                    self.rank
                )));
            }
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!(
            "bridge targets={:?} rank={} alpha={} layers={} train_items={} slice_items={} epochs={}{} lr={} seed={}{}{}",
            self.targets,
            self.rank,
            self.alpha,
            self.layers,
            self.train_items,
            self.slice_items,
            self.epochs,
            if self.batch > 1 {
                format!(" batch={}", self.batch)
            } else {
                String::new()
            },
            self.lr,
            self.seed,
            if self.answer_disjoint { " answer_disjoint" } else { "" },
            if self.answer_free { " answer_free" } else { "" }
        )
    }

    fn estimate_tokens(&self) -> usize {
        (self.train_items + self.slice_items) * 2 * 250 + self.train_items * self.epochs * 60
    }

    fn report_rows(&self, value: &Value) -> Vec<(Option<i64>, String, f64)> {
        let Ok(v) = super::bank::downcast::<BridgeValue>(value, "bridge") else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for r in &v.curve {
            let e = Some(r[0] as i64);
            if r[1].is_finite() {
                out.push((e, "train_loss".to_string(), r[1]));
            }
            out.push((e, "slice_loss".to_string(), r[2]));
            out.push((e, "slice_first_token_accuracy".to_string(), r[3]));
            out.push((
                e,
                "kept".to_string(),
                (r[0] as usize == v.best_epoch) as u8 as f64,
            ));
        }
        out
    }

    fn summary(&self, value: &Value) -> serde_json::Value {
        match super::bank::downcast::<BridgeValue>(value, "bridge") {
            Ok(v) => serde_json::json!({
                "best_epoch": v.best_epoch,
                "stopped": v.stopped.map(|(epoch, step)| serde_json::json!({ "epoch": epoch, "step": step, "why": "non-finite loss" })),
                "curve": v.curve.iter().map(|r| serde_json::json!({
                    "epoch": r[0],
                    "train_loss": if r[1].is_finite() { serde_json::json!(r[1]) } else { serde_json::Value::Null },
                    "slice_loss": r[2],
                    "slice_first_token_accuracy": r[3],
                })).collect::<Vec<_>>(),
            }),
            Err(_) => serde_json::Value::Null,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tensor's f32 values as bits, for bit-for-bit comparisons.
    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    }

    /// A saved bridge keeps its trained adapters and derives its initial
    /// ones from the seed: the file holds no initial tensors, the loaded
    /// ones are the bits the training started from, a file whose recorded
    /// initial sums no longer match is refused by name, and a file of the
    /// older format (initial adapters stored) still loads them.
    #[test]
    fn a_saved_bridge_derives_its_initial_adapters_from_the_seed() {
        let spec: BridgeSpec = toml::from_str(
            r#"
targets = "qkv"
train_items = 6
slice_items = 2
seed = 5
arm = { inject = [{ carrier = "kv", layers = "all", positions = "passage", source = "holder", mechanism = "append" }] }
"#,
        )
        .unwrap();
        let (d, r) = (12usize, spec.rank);
        let ad = |l: usize, p: Projection, a: Tensor, out: usize, b0: bool| Adapter {
            layer: l,
            projection: p,
            a,
            b: if b0 {
                Tensor::zeros((r, out), DType::F32, &Device::Cpu).unwrap()
            } else {
                Tensor::from_vec(
                    tolerable_carrier::uniform_symmetric(r * out, 0.3, 40 + l as u64),
                    (r, out),
                    &Device::Cpu,
                )
                .unwrap()
            },
            scale: spec.scale(),
            rows: None,
        };
        let (mut trained, mut init) = (Vec::new(), Vec::new());
        for l in [0usize, 2] {
            for (p, out) in [(Projection::Q, 12), (Projection::K, 4), (Projection::V, 4)] {
                let a0 = spec.init_a(d, r, l, p).unwrap();
                trained.push(ad(l, p, (&a0 * 1.5).unwrap(), out, false));
                init.push(ad(l, p, a0, out, true));
            }
        }
        let value: Value = Arc::new(BridgeValue {
            trained: trained.clone(),
            init: init.clone(),
            curve: vec![[0.0, f64::NAN, 1.0, 0.5], [1.0, 0.9, 0.8, 0.5]],
            best_epoch: 1,
            stopped: None,
            router: Vec::new(),
            init_router: Vec::new(),
        });
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("value.safetensors");
        spec.save(&value, &path).unwrap();
        let map = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
        assert!(
            !map.keys().any(|k| k.starts_with("init.")),
            "{:?}",
            map.keys()
        );
        let same = |x: &[Adapter], y: &[Adapter]| {
            assert_eq!(x.len(), y.len());
            for (x, y) in x.iter().zip(y) {
                assert_eq!((x.layer, x.projection), (y.layer, y.projection));
                assert_eq!(bits(&x.a), bits(&y.a));
                assert_eq!(bits(&x.b), bits(&y.b));
                assert_eq!(x.b.dims(), y.b.dims());
            }
        };
        let sorted = |v: &[Adapter]| {
            let mut v = v.to_vec();
            v.sort_by_key(|a| (a.layer, proj_name(a.projection)));
            v
        };
        let back = spec.load(&path).unwrap();
        let back: &BridgeValue = super::super::bank::downcast(&back, "bridge").unwrap();
        same(&back.trained, &sorted(&trained));
        same(&back.init, &sorted(&init));
        // Another seed derives other initial adapters: refused by name.
        let other = BridgeSpec {
            seed: 6,
            ..spec.clone()
        };
        let e = other.load(&path).unwrap_err().to_string();
        assert!(e.contains("the initialisation changed"), "{e}");
        // The older format: initial adapters stored, loaded as they are.
        let mut old = map.clone();
        old.retain(|k, _| !k.starts_with("init_sum."));
        for a in &init {
            let key = format!("init.{}.{}", a.layer, proj_name(a.projection));
            old.insert(format!("{key}.a"), (&a.a + 0.25).unwrap());
            old.insert(format!("{key}.b"), a.b.clone());
        }
        let old_path = dir.path().join("old.safetensors");
        candle_core::safetensors::save(&old, &old_path).unwrap();
        let back = other.load(&old_path).unwrap();
        let back: &BridgeValue = super::super::bank::downcast(&back, "bridge").unwrap();
        let shifted: Vec<Adapter> = sorted(&init)
            .into_iter()
            .map(|a| Adapter {
                a: (&a.a + 0.25).unwrap(),
                ..a
            })
            .collect();
        same(&back.init, &shifted);
    }

    /// A saved router keeps its trained maps and derives its initial ones
    /// from the seed (zero query map, seeded key map), as adapters do: no
    /// initial maps in the file, the loaded ones the training's starting
    /// bits, another seed refused by name, the older format still loaded.
    #[test]
    fn a_saved_router_derives_its_initial_maps_from_the_seed() {
        let spec: BridgeSpec = toml::from_str(
            r#"
targets = "router"
rank = 4
seed = 5
arm = { inject = [{ carrier = "kv", layers = "all", positions = "passage", source = "holder", mechanism = "append" }] }
"#,
        )
        .unwrap();
        let (d, l) = (12usize, 3usize);
        let init = spec.init_router(d, spec.rank, l).unwrap();
        let trained = RouterLayer {
            layer: l,
            wq: (&init.wk * 0.5).unwrap(),
            wk: (&init.wk * 1.5).unwrap(),
        };
        let value: Value = Arc::new(BridgeValue {
            trained: Vec::new(),
            init: Vec::new(),
            curve: vec![[0.0, f64::NAN, 1.0, 0.5]],
            best_epoch: 0,
            stopped: None,
            router: vec![trained.clone()],
            init_router: vec![init.clone()],
        });
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("value.safetensors");
        spec.save(&value, &path).unwrap();
        let map = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
        assert!(
            !map.keys().any(|k| k.starts_with("router.init.")),
            "{:?}",
            map.keys()
        );
        let same = |x: &RouterLayer, y: &RouterLayer| {
            assert_eq!(x.layer, y.layer);
            assert_eq!(bits(&x.wq), bits(&y.wq));
            assert_eq!(bits(&x.wk), bits(&y.wk));
            assert_eq!(x.wq.dims(), y.wq.dims());
        };
        let back = spec.load(&path).unwrap();
        let back: &BridgeValue = super::super::bank::downcast(&back, "bridge").unwrap();
        same(&back.router[0], &trained);
        same(&back.init_router[0], &init);
        // Another seed draws another initial key map: refused by name.
        let other = BridgeSpec {
            seed: 6,
            ..spec.clone()
        };
        let e = other.load(&path).unwrap_err().to_string();
        assert!(e.contains("the initialisation changed"), "{e}");
        // The older format: initial maps stored, loaded as they are.
        let mut old = map.clone();
        old.retain(|k, _| !k.starts_with("router.init_sum."));
        let shifted = RouterLayer {
            layer: l,
            wq: (&init.wq + 0.25).unwrap(),
            wk: (&init.wk + 0.25).unwrap(),
        };
        old.insert(format!("router.init.{l}.wq"), shifted.wq.clone());
        old.insert(format!("router.init.{l}.wk"), shifted.wk.clone());
        let old_path = dir.path().join("old.safetensors");
        candle_core::safetensors::save(&old, &old_path).unwrap();
        let back = other.load(&old_path).unwrap();
        let back: &BridgeValue = super::super::bank::downcast(&back, "bridge").unwrap();
        same(&back.router[0], &trained);
        same(&back.init_router[0], &shifted);
    }

    /// A training cut short after an epoch resumes from its progress file
    /// and ends with the bits of an uninterrupted training: the kept and
    /// initial parameters, the curve and the kept epoch. A file for other
    /// parameters is set aside and the training starts over.
    #[test]
    fn a_training_cut_short_resumes_bit_for_bit() {
        let spec: BridgeSpec = toml::from_str(
            r#"
targets = "kv"
train_items = 6
slice_items = 2
epochs = 4
lr = 0.05
weight_decay = 0.01
seed = 3
arm = { inject = [{ carrier = "kv", layers = "all", positions = "passage", source = "holder", mechanism = "append" }] }
"#,
        )
        .unwrap();
        let x = Tensor::from_vec(
            tolerable_carrier::uniform_symmetric(8 * 3, 1.0, 11),
            (8, 3),
            &Device::Cpu,
        )
        .unwrap();
        let targets = Tensor::new(&[0u32, 1, 1, 0, 1, 0, 0, 1], &Device::Cpu).unwrap();
        let names: Vec<String> = vec!["w1".into(), "w2".into()];
        let fresh = || -> Vec<Var> {
            [(3usize, 5usize), (5, 2)]
                .iter()
                .enumerate()
                .map(|(i, &(r, c))| {
                    let v = tolerable_carrier::uniform_symmetric(r * c, 0.7, 20 + i as u64);
                    Var::from_tensor(&Tensor::from_vec(v, (r, c), &Device::Cpu).unwrap()).unwrap()
                })
                .collect()
        };
        let loss_of = |vs: &[Tensor], rows: &[usize]| -> Result<Tensor> {
            let idx: Vec<u32> = rows.iter().map(|&i| i as u32).collect();
            let idx = Tensor::new(idx.as_slice(), &Device::Cpu)?;
            let h = x.index_select(&idx, 0)?.matmul(&vs[0])?.tanh()?;
            let y = h.matmul(&vs[1])?;
            Ok(candle_nn::loss::cross_entropy(
                &y,
                &targets.index_select(&idx, 0)?,
            )?)
        };
        let bits = |ts: &[Tensor]| -> Vec<u32> { ts.iter().flat_map(bits).collect() };
        // Trains `vars`; `fail_at` makes the step of that call number fail
        // (the process dies mid-epoch). The slice is the training loss; its
        // accuracy is 1 inside `band` and 0 outside, so that the kept epoch
        // can be one before the cut.
        // `every` is how often a step's progress is saved inside an epoch
        // (`Duration::MAX`: at epochs' ends only); `batch` examples a step.
        let train_every = |vars: &[Var],
                           progress: Option<&Path>,
                           fail_at: Option<usize>,
                           band: (f64, f64),
                           every: Duration,
                           batch: usize| {
            let spec = BridgeSpec {
                batch,
                ..spec.clone()
            };
            let calls = std::cell::Cell::new(0usize);
            let snapshot = || -> Result<Vec<Tensor>> {
                vars.iter()
                    .map(|v| Ok(v.as_tensor().detach().copy()?))
                    .collect()
            };
            train_loop(
                &spec,
                "[resources.test]",
                6,
                names.iter().cloned().zip(vars.iter().cloned()).collect(),
                &snapshot,
                &|batch| {
                    calls.set(calls.get() + 1);
                    if Some(calls.get()) == fail_at {
                        return Err(DriverError::Records("killed".into()));
                    }
                    let live: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
                    loss_of(&live, batch)
                },
                &|s: &Vec<Tensor>| {
                    let l = loss_of(s, &[0, 1, 2, 3, 4, 5])?.to_scalar::<f32>()? as f64;
                    Ok((l, (band.0 < l && l < band.1) as u8 as f64))
                },
                progress,
                every,
            )
        };
        let train =
            |vars: &[Var], progress: Option<&Path>, fail_at: Option<usize>, band: (f64, f64)| {
                train_every(vars, progress, fail_at, band, Duration::MAX, 1)
            };
        // The progress a file holds for this training, or why it is refused.
        let loaded = |p: &Path| {
            Progress::load(p, &names, &fresh(), 4)
                .unwrap()
                .unwrap()
                .unwrap()
        };
        let refused = |p: &Path| {
            Progress::load(p, &names, &fresh(), 4)
                .unwrap()
                .unwrap()
                .err()
                .unwrap()
        };
        // The slice losses of a first training set the band around epoch 2.
        let probe = train(&fresh(), None, None, (0.0, 0.0)).unwrap();
        let l: Vec<f64> = probe.curve.iter().map(|r| r[2]).collect();
        assert!(l.windows(2).all(|w| w[1] < w[0]), "slice losses {l:?}");
        let band = ((l[2] + l[3]) / 2.0, (l[1] + l[2]) / 2.0);
        let whole = train(&fresh(), None, None, band).unwrap();
        assert_eq!(whole.best_epoch, 2);
        assert_ne!(bits(&whole.kept), bits(&whole.init));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bridge-x.progress.safetensors");
        // Killed in the fourth epoch (6 steps an epoch): epochs 1 to 3 saved,
        // the kept parameters (epoch 2) among them.
        let err = train(&fresh(), Some(&path), Some(21), band).err().unwrap();
        assert!(err.to_string().contains("killed"));
        let saved = loaded(&path);
        assert_eq!(
            (saved.epoch, saved.adam.step_t, saved.best_epoch),
            (3, 18, 2)
        );
        assert_eq!(whole.resumed_after, None);
        let resumed = train(&fresh(), Some(&path), None, band).unwrap();
        assert_eq!(
            resumed.resumed_after,
            Some(super::super::ResumedAt { epoch: 3, steps: 0 })
        );
        assert_eq!(bits(&resumed.kept), bits(&whole.kept));
        assert_eq!(bits(&resumed.init), bits(&whole.init));
        assert_eq!(resumed.best_epoch, whole.best_epoch);
        let curve_bits =
            |c: &[[f64; 4]]| -> Vec<u64> { c.iter().flatten().map(|v| v.to_bits()).collect() };
        assert_eq!(curve_bits(&resumed.curve), curve_bits(&whole.curve));
        // Resumed after epoch 3 of 4 with the optimizer state of a fresh
        // optimizer, the last epoch goes elsewhere: the moments matter.
        let mut no_moments = loaded(&path);
        assert_eq!(no_moments.epoch, 4);
        let probe_path = dir.path().join("bridge-y.progress.safetensors");
        no_moments.epoch = 3;
        no_moments.curve.pop();
        no_moments.params = saved.params.clone();
        no_moments.adam = crate::resources::optim::AdamW::new(fresh(), Default::default())
            .unwrap()
            .state()
            .unwrap();
        no_moments.adam.step_t = 18;
        no_moments.save(&probe_path).unwrap();
        let off = train(&fresh(), Some(&probe_path), None, (0.0, 0.0)).unwrap();
        assert_ne!(
            off.curve[4][2].to_bits(),
            probe.curve[4][2].to_bits(),
            "zero moments changed nothing"
        );
        // The finished training's progress is there until the sweep removes
        // it; resuming from it trains nothing more and keeps the result.
        let again = train(&fresh(), Some(&path), Some(1), band).unwrap();
        assert_eq!(bits(&again.kept), bits(&whole.kept));
        // A file for parameters of other shapes is not used.
        let other: Vec<Var> = vec![
            Var::zeros((2, 2), DType::F32, &Device::Cpu).unwrap(),
            Var::zeros((5, 2), DType::F32, &Device::Cpu).unwrap(),
        ];
        let why = Progress::load(&path, &names, &other, 4)
            .unwrap()
            .unwrap()
            .err()
            .unwrap();
        assert!(why.contains("param.0"), "{why}");
        // Nor a file of the same shapes saved for parameters in another
        // order or of other names.
        let swapped: Vec<String> = vec!["w2".into(), "w1".into()];
        let why = Progress::load(&path, &swapped, &fresh(), 4)
            .unwrap()
            .unwrap()
            .err()
            .unwrap();
        assert!(
            why.contains("w1 .. w2") && why.contains("at position 0 it has w1, the training w2"),
            "{why}"
        );
        // A file written before the layout was kept is read by position.
        let saved_last = loaded(&path);
        let mut map = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
        assert!(map.remove("layout").is_some());
        let unnamed = dir.path().join("bridge-u.progress.safetensors");
        candle_core::safetensors::save(&map, &unnamed).unwrap();
        let old = Progress::load(&unnamed, &swapped, &fresh(), 4)
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(bits(&old.params), bits(&saved_last.params));
        // Nor a file of more epochs than the training has.
        assert!(Progress::load(&path, &names, &fresh(), 3)
            .unwrap()
            .unwrap()
            .is_err());
        // Nor one whose curve is not four columns (no panic).
        let mut map = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
        map.insert(
            "curve".into(),
            Tensor::zeros((5, 2), DType::F64, &Device::Cpu).unwrap(),
        );
        let odd = dir.path().join("bridge-z.progress.safetensors");
        candle_core::safetensors::save(&map, &odd).unwrap();
        let why = refused(&odd);
        assert!(why.contains("curve"), "{why}");
        // Saved at every step, a training killed inside its second epoch
        // (the third step fails) resumes after that epoch's second step:
        // the same bits, the epoch's mean training loss among them.
        let inside = dir.path().join("bridge-s.progress.safetensors");
        let every = Duration::ZERO;
        assert!(train_every(&fresh(), Some(&inside), Some(9), band, every, 1).is_err());
        let mid = loaded(&inside);
        assert_eq!(
            (mid.epoch, mid.steps, mid.adam.step_t, mid.curve.len()),
            (1, 2, 8, 2)
        );
        assert!(mid.partial_loss > 0.0);
        let on = train_every(&fresh(), Some(&inside), None, band, every, 1).unwrap();
        assert_eq!(
            on.resumed_after,
            Some(super::super::ResumedAt { epoch: 1, steps: 2 })
        );
        assert_eq!(bits(&on.kept), bits(&whole.kept));
        assert_eq!(curve_bits(&on.curve), curve_bits(&whole.curve));
        // Steps that do not fit the training (an epoch of fewer steps, or an
        // optimizer count that is not the steps') are not used.
        let mid = loaded(&inside);
        assert_eq!(mid.steps, 0, "the finished training saved its last epoch");
        let mut odd_steps = loaded(&path);
        odd_steps.epoch = 3;
        odd_steps.curve.pop();
        odd_steps.steps = 6;
        odd_steps.adam.step_t = 24;
        let why = odd_steps.fits(6).err().unwrap();
        assert!(why.contains("6 steps into epoch 4"), "{why}");
        let mut odd_count = loaded(&path);
        odd_count.steps = 0;
        odd_count.adam.step_t = 23;
        let why = odd_count.fits(6).err().unwrap();
        assert!(why.contains("(24 expected)"), "{why}");
        // Steps into an epoch the training does not have are refused.
        let mut past = loaded(&path);
        past.steps = 1;
        past.partial_loss = 0.5;
        past.adam.step_t = 25;
        let past_path = dir.path().join("bridge-p.progress.safetensors");
        past.save(&past_path).unwrap();
        let why = refused(&past_path);
        assert!(why.contains("1 steps of the next"), "{why}");
        // A summed loss that is not one finite value, or not zero at an
        // epoch's end, is refused.
        for (steps, loss) in [(0usize, 0.5f64), (2, f64::NAN)] {
            let mut odd = loaded(&inside);
            (odd.epoch, odd.steps, odd.partial_loss) = (1, steps, loss);
            odd.curve.truncate(2);
            let odd_path = dir.path().join("bridge-l.progress.safetensors");
            odd.save(&odd_path).unwrap();
            let why = refused(&odd_path);
            assert!(why.contains("`partial_loss` is"), "{why}");
        }
        // Four examples a step over six items (steps of 4 and 2), killed
        // in the second step of epoch 2: resumed after its first step, the
        // same bits as four a step uninterrupted.
        let whole4 = train_every(&fresh(), None, None, band, Duration::MAX, 4).unwrap();
        let batched = dir.path().join("bridge-b.progress.safetensors");
        assert!(train_every(&fresh(), Some(&batched), Some(4), band, every, 4).is_err());
        let cut = loaded(&batched);
        assert_eq!((cut.epoch, cut.steps, cut.adam.step_t), (1, 1, 3));
        let on4 = train_every(&fresh(), Some(&batched), None, band, every, 4).unwrap();
        assert_eq!(
            on4.resumed_after,
            Some(super::super::ResumedAt { epoch: 1, steps: 1 })
        );
        assert_eq!(bits(&on4.kept), bits(&whole4.kept));
        assert_eq!(curve_bits(&on4.curve), curve_bits(&whole4.curve));
        assert_ne!(
            curve_bits(&whole4.curve),
            curve_bits(&whole.curve),
            "four a step trains as one a step"
        );
        // A file of an epoch's end written before steps were saved (three
        // counts, no summed loss) is read as that epoch's end.
        let mut map = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
        assert!(map.remove("partial_loss").is_some());
        map.insert(
            "counts".into(),
            Tensor::new(&[4u32, 24, 2], &Device::Cpu).unwrap(),
        );
        let three = dir.path().join("bridge-t.progress.safetensors");
        candle_core::safetensors::save(&map, &three).unwrap();
        let old = loaded(&three);
        assert_eq!((old.epoch, old.steps, old.partial_loss), (4, 0, 0.0));
        // A corrupt file is set aside: the training starts over and ends
        // as the uninterrupted one did.
        std::fs::write(&path, b"not a safetensors file").unwrap();
        let over = train(&fresh(), Some(&path), None, band).unwrap();
        assert_eq!(over.resumed_after, None);
        assert_eq!(bits(&over.kept), bits(&whole.kept));
    }

    /// How often progress is saved inside an epoch: a minute unless the
    /// environment says otherwise in seconds; anything else is refused by
    /// the variable's name.
    #[test]
    fn the_progress_interval_is_a_minute_or_the_environments_seconds() {
        assert_eq!(progress_every(None).unwrap(), Duration::from_secs(60));
        assert_eq!(progress_every(Some("0")).unwrap(), Duration::ZERO);
        assert_eq!(
            progress_every(Some(" 2.5 ")).unwrap(),
            Duration::from_millis(2500)
        );
        for bad in ["-1", "soon", "", "inf", "NaN"] {
            let e = progress_every(Some(bad)).unwrap_err().to_string();
            assert!(
                e.contains("TOLERABLE_PROGRESS_SECS") && e.contains(&format!("`{bad}`")),
                "{e}"
            );
        }
    }

    /// A mini-batch step (`batch > 1`) minimises the mean of its examples'
    /// losses: its loss and its gradients on A and B equal the mean of the
    /// examples scored one at a time, on examples whose caches and
    /// questions differ in length (the padded batch), under the
    /// differentiable kernels.
    #[test]
    fn a_mini_batch_is_the_mean_of_its_examples() {
        let dir = tempfile::tempdir().unwrap();
        let ck = crate::test_support::tiny_checkpoint(dir.path());
        let model = ck.model.clone().with_kernels(Kernels::Differentiable);
        let text = "[run]\nname = \"t\"\n[data]\nsource = \"synthetic\"\nn = 1\n\
             [resources.lora]\nkind = \"bridge\"\ntargets = \"qkv\"\nrank = 4\ndata = \"synthetic\"\nbatch = 3\n\
             arm = { inject = [{ carrier = \"kv\", layers = \"all\", positions = \"passage\", source = \"holder\", mechanism = \"append\" }] }\n\
             [[arms]]\nname = \"floor\"\nbase = \"masked\"\n";
        let cfg = SweepConfig::parse(text).unwrap();
        let ResourceSpec::Bridge(spec) = &cfg.resources["lora"] else {
            panic!("not a bridge")
        };
        assert_eq!(spec.batch, 3);
        let plan = spec.compile("[resources.lora]", model.config()).unwrap();
        let program = plan.programs.iter().find(|p| p.name == TRAIN_ARM).unwrap();
        let items = tolerable_probe::sample::sample(
            &tolerable_probe::synthetic::generate(12, 5),
            &ck.tokenizer,
            &tolerable_probe::SplitOptions::default(),
            3,
            5,
        )
        .unwrap();
        let set = crate::items::ItemSet::new(items.items, 0, 5).unwrap();
        let examples: Vec<Example> = (0..3)
            .map(|i| {
                let passes = crate::passes::item_passes(
                    &model,
                    &set.pairs[i],
                    &set.partners_of(i),
                    &plan.needs,
                    &BTreeMap::new(),
                )
                .unwrap();
                let memo = crate::transforms::Memo::default();
                let none = BTreeMap::new();
                let icx = crate::exec::ItemCx {
                    model: &model,
                    passes: &passes,
                    index: i,
                    seed: 0,
                    resources: &none,
                    memo: &memo,
                };
                adapter_example(program, &set.items[i], &icx, &ck.tokenizer).unwrap()
            })
            .collect();
        // Padding on both sides: caches of different lengths (the masks
        // and RoPE positions per row) and questions of different lengths
        // (the logits at each row's own last position).
        let distinct = |f: &dyn Fn(&Example) -> usize| {
            examples
                .iter()
                .map(f)
                .collect::<std::collections::BTreeSet<_>>()
                .len()
        };
        assert!(distinct(&|e| e.cache.len()) > 1, "caches of one length");
        assert!(
            distinct(&|e| e.question.len()) > 1,
            "questions of one length"
        );
        // Adapters with B away from zero, so every parameter has a gradient.
        let cfg = model.config();
        let mut vars = Vec::new();
        for l in 0..cfg.n_layers {
            for (k, p) in spec.projections().into_iter().enumerate() {
                let out = match p {
                    Projection::Q => cfg.n_heads * cfg.head_dim,
                    _ => cfg.n_kv_heads * cfg.head_dim,
                };
                let t = |n: usize, shape: (usize, usize), seed: u64| {
                    Var::from_tensor(
                        &Tensor::from_vec(
                            tolerable_carrier::uniform_symmetric(n, 0.3, seed),
                            shape,
                            &Device::Cpu,
                        )
                        .unwrap(),
                    )
                    .unwrap()
                };
                let seed = (l * 8 + k) as u64;
                vars.push((
                    l,
                    p,
                    t(cfg.d_model * 4, (cfg.d_model, 4), seed),
                    t(4 * out, (4, out), seed + 100),
                ));
            }
        }
        let hooks = HookSpec::new().adapt_all(adapters_of(&vars, spec.scale(), false).unwrap());
        let grads_of = |loss: &Tensor| {
            let g = loss.backward().unwrap();
            vars.iter()
                .flat_map(|(_, _, a, b)| [a, b])
                .map(|v| {
                    g.get(v.as_tensor())
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                })
                .collect::<Vec<_>>()
        };
        let (mut mean_loss, mut mean_grads) = (0f32, Vec::<Vec<f32>>::new());
        for e in &examples {
            let one = batch_loss(&model, &[e], &hooks).unwrap();
            mean_loss += one.to_scalar::<f32>().unwrap() / 3.0;
            let g = grads_of(&one);
            if mean_grads.is_empty() {
                mean_grads = vec![Vec::new(); g.len()];
            }
            for (m, g) in mean_grads.iter_mut().zip(g) {
                if m.is_empty() {
                    *m = vec![0.0; g.len()];
                }
                for (m, g) in m.iter_mut().zip(g) {
                    *m += g / 3.0;
                }
            }
        }
        let refs: Vec<&Example> = examples.iter().collect();
        let batch = batch_loss(&model, &refs, &hooks).unwrap();
        let b = batch.to_scalar::<f32>().unwrap();
        assert!(
            (b - mean_loss).abs() < 1e-5 * mean_loss.abs().max(1.0),
            "batch loss {b}, mean of the examples {mean_loss}"
        );
        let grads = grads_of(&batch);
        for (i, (g, m)) in grads.iter().zip(&mean_grads).enumerate() {
            let scale = m.iter().fold(0f32, |a, x| a.max(x.abs()));
            assert!(scale > 0.0, "parameter {i} has no gradient");
            let worst = g.iter().zip(m).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
            assert!(
                worst <= 1e-4 * scale,
                "parameter {i}: the batch gradient is off the mean by {worst} (scale {scale})"
            );
        }
    }
    /// The router's training step scores exactly what the evaluation arm
    /// builds: the same item, the same pool and the same maps give the same
    /// first-token loss through `router_score` (training) and through the
    /// pool source, `exec::prepare` and the question (evaluation).
    #[test]
    fn router_training_scores_what_the_routed_arm_evaluates() {
        let dir = tempfile::tempdir().unwrap();
        let ck = crate::test_support::tiny_checkpoint(dir.path());
        let model = &ck.model;
        let inject = "{ carrier = \"h\", layers = 1, positions = \"fact_region\", source = { pool = { n = 3, router = \"trained\" } }, mechanism = \"add\", alpha = 2.0 }";
        let text = format!(
            "[run]\nname = \"t\"\n[data]\nsource = \"synthetic\"\nn = 1\n\
             [resources.router]\nkind = \"bridge\"\ntargets = \"router\"\nrank = 4\ndata = \"synthetic\"\n\
             arm = {{ inject = [{inject}] }}\n\
             [[arms]]\nname = \"routed\"\nbridge = {{ resource = \"router\" }}\ninject = {inject}\n"
        );
        let cfg = SweepConfig::parse(&text).unwrap();
        let ResourceSpec::Bridge(spec) = &cfg.resources["router"] else {
            panic!("not a bridge")
        };
        let train_plan = spec.compile("[resources.router]", model.config()).unwrap();
        let eval_plan =
            crate::plan::compile(&cfg, model.config(), "tiny", &|_| unreachable!()).unwrap();
        let items = tolerable_probe::sample::sample(
            &tolerable_probe::synthetic::generate(12, 3),
            &ck.tokenizer,
            &tolerable_probe::SplitOptions::default(),
            6,
            3,
        )
        .unwrap();
        let set = crate::items::ItemSet::new(items.items, 2, 3).unwrap();
        // Non-trivial maps: neither is zero.
        let d = model.config().d_model;
        let map = |seed| {
            Tensor::from_vec(
                tolerable_carrier::uniform_symmetric(d * 4, 0.5, seed),
                (d, 4),
                &Device::Cpu,
            )
            .unwrap()
        };
        let router = RouterLayer {
            layer: 1,
            wq: map(1),
            wk: map(2),
        };
        let value: Value = Arc::new(BridgeValue {
            trained: Vec::new(),
            init: Vec::new(),
            curve: Vec::new(),
            best_epoch: 0,
            stopped: None,
            router: vec![router.clone()],
            init_router: vec![router.clone()],
        });
        let resources = BTreeMap::from([("router".to_string(), value)]);
        for i in 0..3 {
            let it = &set.items[i];
            let passes = |needs| {
                crate::passes::item_passes(
                    model,
                    &set.pairs[i],
                    &set.partners_of(i),
                    needs,
                    &BTreeMap::new(),
                )
                .unwrap()
            };
            let program = |plan: &crate::plan::Plan, name: &str| {
                plan.programs
                    .iter()
                    .find(|p| p.name == name)
                    .unwrap()
                    .clone()
            };
            let tp = passes(&train_plan.needs);
            let ex = router_example(
                spec,
                &tp,
                &program(&train_plan, TRAIN_ARM),
                it,
                &ck.tokenizer,
            )
            .unwrap();
            let (train_loss, _) = router_score(model, &ex, &router).unwrap();
            let ep = passes(&eval_plan.needs);
            let memo = crate::transforms::Memo::default();
            let cx = crate::exec::ItemCx {
                model,
                passes: &ep,
                index: i,
                seed: 0,
                resources: &resources,
                memo: &memo,
            };
            let prepared = crate::exec::prepare(&program(&eval_plan, "routed"), &cx).unwrap();
            let (eval_loss, _) = question_score(
                model,
                prepared.cache,
                &ex.question,
                ex.target,
                &prepared.question,
            )
            .unwrap();
            let (a, b) = (
                train_loss.to_scalar::<f32>().unwrap(),
                eval_loss.to_scalar::<f32>().unwrap(),
            );
            assert!(
                (a - b).abs() < 1e-4,
                "item {i}: training {a}, evaluation {b}"
            );
            // The routed pool moves the loss off the floor's.
            let (floor, _) = question_score(
                model,
                ep.base.cache.clone(),
                &ex.question,
                ex.target,
                &HookSpec::new(),
            )
            .unwrap();
            assert_ne!(floor.to_scalar::<f32>().unwrap(), b, "item {i}");
        }
    }
}
