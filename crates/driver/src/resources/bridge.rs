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
//! token at the decision step (the last prompt position); AdamW, one item
//! per step, `epochs` passes over `train_items` training items in a seeded
//! order. After each epoch, and before the first step (epoch 0), the
//! adapters are scored on a slice of `slice_items` further training items
//! (first-token accuracy, then mean loss); the best epoch's adapters are
//! kept. `B` starts at zero, so epoch 0 is the raw arm bit for bit (the
//! zero-init gate: an arm with `bridge = { resource, init = true }` and
//! `expect = { arm = "<raw arm>" }`).
//!
//! A non-finite loss (a training step's, or the slice's after an epoch)
//! stops training: the log and `run.json` name the epoch and step, and the
//! best epoch before it is kept.
//!
//! The value holds the kept adapters, the initial ones and the training
//! curve (epoch, mean training loss, slice loss, slice first-token
//! accuracy), which `run.json` records.

use super::{sample_training, BuildCx, ResourceKind, ResourceSpec, TrainCx, Value};
use crate::arm::{Arm, Base, BridgeTargets, Injection};
use crate::config::{DataSection, DataSource, PlannedArm, SweepConfig};
use crate::error::{DriverError, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Optimizer;
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;
use tolerable_carrier::LayerSet;
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
    fn projections(&self) -> Vec<Projection> {
        match self.targets {
            BridgeTargets::Q => vec![Projection::Q],
            BridgeTargets::Kv => vec![Projection::K, Projection::V],
            BridgeTargets::Qkv | BridgeTargets::Router => {
                vec![Projection::Q, Projection::K, Projection::V]
            }
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
        if plan.needs.partners > 0 || !plan.resources.is_empty() || !plan.senders.is_empty() {
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
    /// The adapters before the first step (B = 0).
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
}

impl BridgeValue {
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

/// A training or slice example: the prepared cache, the question, the
/// gold answer's first token.
struct Example {
    cache: KvCache,
    question: Vec<u32>,
    target: u32,
}

/// The examples of `items` under the training arm; bridges trained under
/// the same arm on the same items in one invocation share them (`scratch`).
fn examples(
    cx: &BuildCx,
    spec: &BridgeSpec,
    plan: &crate::plan::Plan,
    items: &[SplitItem],
    what: &str,
) -> Result<Vec<Arc<Example>>> {
    let (model, tokenizer) = (cx.model, cx.train.tokenizer);
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
    let bar = ProgressBar::new(items.len() as u64);
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "bridge {what} caches {{bar:30}} {{pos}}/{{len}} eta {{eta}}"
        ))
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut out = Vec::with_capacity(items.len());
    for (i, it) in items.iter().enumerate() {
        let key = format!("bridge example {arm_key} {i} {}", it.item.id);
        let v = cx.scratch.get_or_make(&key, || {
            Ok(Arc::new(example(
                model, plan, program, it, i, tokenizer, &none, &senders,
            )?))
        })?;
        out.push(v.downcast::<Example>().map_err(|_| {
            DriverError::Records(format!("internal: scratch `{key}` is not an example"))
        })?);
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(out)
}

/// One training example: the item's passes, the training arm's cache, the
/// gold answer's first token.
#[allow(clippy::too_many_arguments)]
fn example(
    model: &Model,
    plan: &crate::plan::Plan,
    program: &crate::plan::ArmProgram,
    it: &SplitItem,
    i: usize,
    tokenizer: &tolerable_runtime::Tokenizer,
    none: &BTreeMap<String, Value>,
    senders: &BTreeMap<String, Model>,
) -> Result<Example> {
    {
        let pair = it.pair();
        let passes = crate::passes::item_passes(model, &pair, &[], &plan.needs, senders)?;
        let memo = crate::transforms::Memo::default();
        let cx = crate::exec::ItemCx {
            model,
            passes: &passes,
            index: i,
            seed: 0,
            resources: none,
            memo: &memo,
        };
        let prepared = crate::exec::prepare(program, &cx)?;
        let answer = it.item.answers.first().ok_or_else(|| {
            DriverError::Config(format!("training item {} has no gold answer", it.item.id))
        })?;
        let target = *tokenizer
            .encode(&format!(" {}", answer.trim()))?
            .first()
            .ok_or_else(|| {
                DriverError::Config(format!("training item {}: an empty answer", it.item.id))
            })?;
        Ok(Example {
            cache: prepared.cache,
            question: pair.suffix.clone(),
            target,
        })
    }
}

/// The adapters of `vars`: live (gradients flow into the variables), or a
/// snapshot (fresh storage: the optimizer updates variables in place, so a
/// detached view would change with them).
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
            })
        })
        .collect()
}

/// Loss and first-token hit of one example under `spec`.
fn score(model: &Model, ex: &Example, spec: &HookSpec) -> Result<(Tensor, bool)> {
    let mut cache = ex.cache.clone();
    let logits = model
        .forward(
            &model.tokens(std::slice::from_ref(&ex.question))?,
            &mut cache,
            spec,
            LogitsAt::Last,
        )?
        .logits
        .ok_or_else(|| DriverError::Records("internal: no logits".into()))?
        .squeeze(1)?;
    let target = Tensor::new(&[ex.target], logits.device())?;
    let loss = candle_nn::loss::cross_entropy(&logits, &target)?;
    let hit = logits.argmax(candle_core::D::Minus1)?.to_vec1::<u32>()?[0] == ex.target;
    Ok((loss, hit))
}

fn slice_scores(model: &Model, slice: &[Arc<Example>], spec: &HookSpec) -> Result<(f64, f64)> {
    let (mut loss, mut hits) = (0.0, 0usize);
    for ex in slice {
        let (l, h) = score(model, ex, spec)?;
        loss += l.to_scalar::<f32>()? as f64;
        hits += h as usize;
    }
    Ok((
        loss / slice.len().max(1) as f64,
        hits as f64 / slice.len().max(1) as f64,
    ))
}

impl ResourceKind for BridgeSpec {
    fn kind(&self) -> &'static str {
        "bridge"
    }

    fn version(&self) -> u32 {
        1
    }

    fn validate(
        &self,
        field: &str,
        cfg: &ModelConfig,
        _all: &BTreeMap<String, ResourceSpec>,
    ) -> Result<()> {
        let err = |m: String| Err(DriverError::Config(format!("{field} {m}")));
        if self.targets == BridgeTargets::Router {
            return err("targets: `router`: the trained router of the activation carrier is not built yet (q, kv or qkv)".into());
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
        Ok(())
    }

    fn training_items(&self, cx: &TrainCx) -> Result<Vec<SplitItem>> {
        let n = self.train_items + self.slice_items;
        if self.answer_disjoint {
            let eval = &cx.eval.answers;
            super::sample_training_where(cx, self.data, n, self.seed, &|it| {
                !it.answers
                    .iter()
                    .any(|a| eval.contains(&tolerable_probe::score::normalize(a)))
            })
        } else {
            sample_training(cx, self.data, n, self.seed)
        }
    }

    fn build(&self, cx: &BuildCx, items: &[SplitItem]) -> Result<Value> {
        let field = cx.train.field.clone();
        let model = cx.model;
        let cfg = model.config().clone();
        let plan = self.compile(&field, &cfg)?;
        if items.len() < self.train_items + self.slice_items {
            return Err(DriverError::Config(format!(
                "{field}: {} training items asked ({} + {} for the slice), {} available",
                self.train_items + self.slice_items,
                self.train_items,
                self.slice_items,
                items.len()
            )));
        }
        let (train_items, slice_items) = items.split_at(self.train_items);
        let train = examples(cx, self, &plan, train_items, "training")?;
        let slice = examples(cx, self, &plan, &slice_items[..self.slice_items], "slice")?;
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
                let seed = crate::exec::mix(self.seed, &[l as u64, p as u64]);
                let a = Tensor::from_vec(
                    tolerable_carrier::uniform_symmetric(
                        cfg.d_model * self.rank,
                        1.0 / (cfg.d_model as f64).sqrt(),
                        seed,
                    ),
                    (cfg.d_model, self.rank),
                    &Device::Cpu,
                )?;
                let b = Tensor::zeros((self.rank, out), DType::F32, &Device::Cpu)?;
                vars.push((l, p, Var::from_tensor(&a)?, Var::from_tensor(&b)?));
            }
        }
        let scale = self.scale();
        let init = adapters_of(&vars, scale, true)?;
        let params = vars
            .iter()
            .flat_map(|(_, _, a, b)| [a.clone(), b.clone()])
            .collect();
        let mut opt = candle_nn::AdamW::new(
            params,
            candle_nn::ParamsAdamW {
                lr: self.lr,
                weight_decay: self.weight_decay,
                ..Default::default()
            },
        )?;
        let diff = model.clone().with_kernels(Kernels::Differentiable);
        let init_spec = HookSpec::new().adapt_all(init.clone());
        let (l0, a0) = slice_scores(model, &slice, &init_spec)?;
        let mut curve = vec![[0.0, f64::NAN, l0, a0]];
        let (mut best, mut best_epoch, mut kept) = ((a0, -l0), 0usize, init.clone());
        tracing::info!(
            "{field}: epoch 0 (B = 0): slice loss {l0:.3}, first-token accuracy {a0:.3}"
        );
        let mut order: Vec<usize> = (0..train.len()).collect();
        let mut stopped = None;
        'epochs: for epoch in 1..=self.epochs {
            let mut rng = tolerable_probe::rng::Rng::new(crate::exec::mix(
                self.seed,
                &[epoch as u64, 0xE90C],
            ));
            rng.shuffle(&mut order);
            let bar = ProgressBar::new(order.len() as u64);
            bar.set_style(
                ProgressStyle::with_template(&format!(
                    "bridge epoch {epoch}/{} {{bar:30}} {{pos}}/{{len}} loss {{msg}} eta {{eta}}",
                    self.epochs
                ))
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            let mut total = 0.0;
            for (step, &i) in order.iter().enumerate() {
                let spec = HookSpec::new().adapt_all(adapters_of(&vars, scale, false)?);
                let (loss, _) = score(&diff, &train[i], &spec)?;
                let value = loss.to_scalar::<f32>()? as f64;
                if !value.is_finite() {
                    bar.finish_and_clear();
                    tracing::warn!(
                        "{field}: training stopped at epoch {epoch}, step {}: the loss is {value}; the adapters of epoch {best_epoch} are kept",
                        step + 1
                    );
                    stopped = Some((epoch, step + 1));
                    break 'epochs;
                }
                total += value;
                opt.backward_step(&loss)?;
                bar.inc(1);
                bar.set_message(format!("{:.3}", total / bar.position() as f64));
            }
            bar.finish_and_clear();
            let now = adapters_of(&vars, scale, true)?;
            let (sl, sa) = slice_scores(model, &slice, &HookSpec::new().adapt_all(now.clone()))?;
            let mean = total / order.len() as f64;
            tracing::info!("{field}: epoch {epoch}: training loss {mean:.3}, slice loss {sl:.3}, first-token accuracy {sa:.3}");
            curve.push([epoch as f64, mean, sl, sa]);
            if !sl.is_finite() {
                tracing::warn!(
                    "{field}: training stopped after epoch {epoch}: the slice loss is {sl}; the adapters of epoch {best_epoch} are kept"
                );
                stopped = Some((epoch, order.len()));
                break;
            }
            if (sa, -sl) > best {
                best = (sa, -sl);
                best_epoch = epoch;
                kept = now;
            }
        }
        Ok(Arc::new(BridgeValue {
            trained: kept,
            init,
            curve,
            best_epoch,
            stopped,
        }))
    }

    fn save(&self, value: &Value, path: &Path) -> Result<()> {
        let v: &BridgeValue = super::bank::downcast(value, "bridge")?;
        let mut map: HashMap<String, Tensor> = HashMap::new();
        for (tag, ads) in [("trained", &v.trained), ("init", &v.init)] {
            for ad in ads.iter() {
                let key = format!("{tag}.{}.{}", ad.layer, proj_name(ad.projection));
                map.insert(format!("{key}.a"), ad.a.clone());
                map.insert(format!("{key}.b"), ad.b.clone());
            }
        }
        let flat: Vec<f64> = v.curve.iter().flatten().copied().collect();
        map.insert(
            "curve".into(),
            Tensor::from_vec(flat, (v.curve.len(), 4), &Device::Cpu)?,
        );
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
        let curve_t = get("curve")?;
        let curve = curve_t
            .to_vec2::<f64>()?
            .into_iter()
            .map(|r| [r[0], r[1], r[2], r[3]])
            .collect();
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
            for (tag, out) in [("trained", &mut trained), ("init", &mut init)] {
                let key = format!("{tag}.{l}.{}", proj_name(p));
                out.push(Adapter {
                    layer: l,
                    projection: p,
                    a: get(&format!("{key}.a"))?,
                    b: get(&format!("{key}.b"))?,
                    scale,
                });
            }
        }
        Ok(Arc::new(BridgeValue {
            trained,
            init,
            curve,
            best_epoch,
            stopped,
        }))
    }

    fn check(&self, value: &Value, cfg: &ModelConfig) -> Result<()> {
        let v: &BridgeValue = super::bank::downcast(value, "bridge")?;
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
            "bridge targets={:?} rank={} alpha={} layers={} train_items={} slice_items={} epochs={} lr={} seed={}{}",
            self.targets,
            self.rank,
            self.alpha,
            self.layers,
            self.train_items,
            self.slice_items,
            self.epochs,
            self.lr,
            self.seed,
            if self.answer_disjoint { " answer_disjoint" } else { "" }
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
