//! Fitted substitutes (PROTOCOL §5, the paper's "sender-side construction"
//! family): maps fitted on training items to reproduce the receiver's
//! genuine keys from a sender-side input. Two resource kinds:
//!
//! - `key_pairs` ([`KeyPairsSpec`]): the training rows — per layer and kv
//!   head, a sender-side key (a held-out sender's post-RoPE key, or the
//!   receiver's own key under cosine-calibrated noise) beside the receiver's
//!   genuine key at the same position of a training passage. The costly
//!   part (forward passes of receiver and sender) is done once and shared by
//!   every map fitted on it.
//! - `fitted_map` ([`FittedMapSpec`]): a map fitted on key pairs: ridge
//!   least squares, least squares restricted to `W_k`'s spaces, or an MLP
//!   trained with candle's autograd. Applying it is the `FittedSubstitute`
//!   transform (`map = "<name>"` on an injection).
//!
//! Reader-aware fitting (against the receiver's behaviour) is out of scope,
//! as in the paper: every map is fitted to the keys alone.

use super::bank::downcast;
use super::{sample_training, BuildCx, ResourceKind, ResourceSpec, TrainCx, Value};
use crate::config::DataSource;
use crate::error::{DriverError, Result};
use crate::senders::SenderSpec;
use candle_core::{DType, Device, Tensor};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;
use tolerable_carrier::fit::{self, AffineMap, Mlp, MlpTraining, Objective};
use tolerable_carrier::{Perturbation, Positions};
use tolerable_probe::SplitItem;
use tolerable_runtime::hooks::site_mask;
use tolerable_runtime::{HookSpec, KvCache, LogitsAt, Model, ModelConfig, RopeStyle};

fn forty() -> usize {
    40
}
fn squad_train() -> DataSource {
    DataSource::SquadTrain
}
fn fact_region() -> Positions {
    Positions::FactRegion
}

/// Training rows for fitted maps (`[resources.<name>] kind = "key_pairs"`):
/// the sender-side input is exactly one of `sender` and `noise_cosine`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyPairsSpec {
    /// A held-out sender built from the receiver (`{ requantize = "Q4_0" }`
    /// or `{ weight_cosine = 0.99 }`): its post-RoPE keys are the input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sender: Option<SenderSpec>,
    /// The receiver's own keys under isotropic noise calibrated to this
    /// cosine (per item and layer, at the training positions) are the input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub noise_cosine: Option<f64>,
    /// Training passages read (distinct, never evaluation items).
    #[serde(default = "forty")]
    pub train_items: usize,
    /// Where they come from: `squad_train` or `synthetic`.
    #[serde(default = "squad_train")]
    pub data: DataSource,
    /// Which positions of each passage give rows: `fact_region` (default),
    /// `passage` or `all`.
    #[serde(default = "fact_region")]
    pub positions: Positions,
    /// Seed of the passage sample and of the noise.
    #[serde(default)]
    pub seed: u64,
}

/// Built key pairs: `inputs[layer][kv_head]` and `targets[layer][kv_head]`
/// are `[rows, head_dim]` (post-RoPE), row `i` at prompt position
/// `positions[i]` of its passage.
#[derive(Debug, Clone)]
pub struct KeyPairs {
    /// Sender-side keys.
    pub inputs: Vec<Vec<Tensor>>,
    /// The receiver's genuine keys.
    pub targets: Vec<Vec<Tensor>>,
    /// The prompt position of each row (for the pre-RoPE frame).
    pub positions: Vec<usize>,
}

impl KeyPairs {
    /// Rows per layer and head.
    pub fn rows(&self) -> usize {
        self.positions.len()
    }
}

/// A seed of the fit-time noise at (item, layer).
fn noise_seed(seed: u64, item: usize, layer: usize) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for x in [item as u64, layer as u64, 0x4b45_5950] {
        h = (h ^ x).wrapping_mul(0x100_0000_01b3);
        h ^= h >> 29;
    }
    h
}

impl KeyPairsSpec {
    /// The sender the pairs read, if any.
    pub fn sender_key(&self) -> Option<String> {
        self.sender.as_ref().map(|s| s.key())
    }
}

/// Checks a held-out sender's spec (the checks of an arm's `holder`).
pub fn check_sender(field: &str, s: &SenderSpec) -> Result<()> {
    match s {
        SenderSpec::Requantize(t) if crate::senders::ggml_type(t).is_none() => {
            Err(DriverError::Config(format!(
                "{field}.requantize: `{t}` is not a GGUF type candle quantizes to (Q8_0, Q6_K, Q5_1, Q5_0, Q5_K, Q4_1, Q4_0, Q4_K, Q3_K, Q2_K)"
            )))
        }
        SenderSpec::WeightCosine(c) if !(*c > 0.0 && *c < 1.0) => Err(DriverError::Config(
            format!("{field}.weight_cosine: weight cosine {c} is not in (0, 1)"),
        )),
        _ => Ok(()),
    }
}

/// Whether two sender specs build the same sender (type names compared as
/// GGUF types: `q4_0` and `Q4_0` are one).
pub fn same_sender(a: &SenderSpec, b: &SenderSpec) -> bool {
    match (a, b) {
        (SenderSpec::Requantize(x), SenderSpec::Requantize(y)) => {
            crate::senders::ggml_type(x).is_some()
                && crate::senders::ggml_type(x) == crate::senders::ggml_type(y)
        }
        (SenderSpec::WeightCosine(x), SenderSpec::WeightCosine(y)) => x == y,
        _ => false,
    }
}

impl ResourceKind for KeyPairsSpec {
    fn kind(&self) -> &'static str {
        "key_pairs"
    }

    fn version(&self) -> u32 {
        1
    }

    fn validate(
        &self,
        field: &str,
        _cfg: &ModelConfig,
        _all: &BTreeMap<String, ResourceSpec>,
    ) -> Result<()> {
        match (&self.sender, self.noise_cosine) {
            (Some(s), None) => check_sender(&format!("{field}.sender"), s)?,
            (None, Some(c)) => {
                tolerable_carrier::perturb::check_target_cosine(c).map_err(|why| {
                    DriverError::Config(format!("{field}.noise_cosine: {why}"))
                })?;
            }
            _ => {
                return Err(DriverError::Config(format!(
                    "{field}: name exactly one sender-side input: `sender` (a held-out sender, e.g. {{ requantize = \"Q4_0\" }}) or `noise_cosine` (the receiver's keys under calibrated noise)"
                )))
            }
        }
        super::check_training(field, self.train_items, self.data, "maps are")?;
        super::check_row_positions(field, &self.positions)?;
        Ok(())
    }

    fn training_items(&self, cx: &TrainCx) -> Result<Vec<SplitItem>> {
        sample_training(cx, self.data, self.train_items, self.seed)
    }

    fn build(&self, cx: &BuildCx, items: &[SplitItem]) -> Result<Value> {
        let m = cx.model;
        let cfg = m.config();
        let (nl, nkv) = (cfg.n_layers, cfg.n_kv_heads);
        let sender: Option<&Model> = match self.sender_key() {
            Some(key) => Some(cx.senders.get(&key).ok_or_else(|| {
                DriverError::Config(format!(
                    "{}.sender: the sender `{key}` was not built before the resource",
                    cx.train.field
                ))
            })?),
            None => None,
        };
        let run = |model: &Model, ctx: &[u32]| -> Result<KvCache> {
            let mut cache = model.new_cache(1);
            model.forward(
                &model.tokens(&[ctx.to_vec()])?,
                &mut cache,
                &HookSpec::new(),
                LogitsAt::None,
            )?;
            Ok(cache)
        };
        let mut inputs: Vec<Vec<Vec<Tensor>>> = vec![vec![Vec::new(); nkv]; nl];
        let mut targets: Vec<Vec<Vec<Tensor>>> = vec![vec![Vec::new(); nkv]; nl];
        let mut positions = Vec::new();
        let bar = ProgressBar::new(items.len() as u64);
        bar.set_style(
            ProgressStyle::with_template("key pairs {bar:30} {pos}/{len} passages eta {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        for (i, it) in items.iter().enumerate() {
            bar.inc(1);
            let pair = it.pair();
            let ctx = pair.alt_context();
            let pos = crate::passes::alt_sites(self.positions, &pair);
            if pos.is_empty() {
                continue;
            }
            let rc = run(m, &ctx)?;
            let sc = match sender {
                Some(s) => Some(run(s, &ctx)?),
                None => None,
            };
            let idx = Tensor::from_vec(
                pos.iter().map(|&p| p as u32).collect::<Vec<_>>(),
                pos.len(),
                &Device::Cpu,
            )?;
            for l in 0..nl {
                let rk = &rc.require_layer(l)?.k; // [1, nkv, T, hd]
                let sk = match (&sc, self.noise_cosine) {
                    (Some(c), _) => c.require_layer(l)?.k.clone(),
                    (None, Some(c)) => {
                        let mask = site_mask(rk.dims(), Some((2, &pos)), None, rk.device())?;
                        Perturbation::CosineNoise { target_cosine: c }.apply(
                            rk,
                            Some(&mask),
                            noise_seed(self.seed, i, l),
                        )?
                    }
                    (None, None) => {
                        return Err(DriverError::Config(format!(
                            "{}: no sender-side input",
                            cx.train.field
                        )))
                    }
                };
                for h in 0..nkv {
                    let rows = |k: &Tensor| -> Result<Tensor> {
                        Ok(k.narrow(1, h, 1)?
                            .squeeze(0)?
                            .squeeze(0)?
                            .contiguous()?
                            .index_select(&idx, 0)?)
                    };
                    inputs[l][h].push(rows(&sk)?);
                    targets[l][h].push(rows(rk)?);
                }
            }
            positions.extend(pos);
        }
        bar.finish_and_clear();
        if positions.is_empty() {
            return Err(DriverError::Config(format!(
                "{}: the {} training passages give no rows at `{}`",
                cx.train.field,
                items.len(),
                self.positions.name()
            )));
        }
        let cat = |v: Vec<Vec<Vec<Tensor>>>| -> Result<Vec<Vec<Tensor>>> {
            v.into_iter()
                .map(|per_head| {
                    per_head
                        .into_iter()
                        .map(|rows| Ok(Tensor::cat(&rows, 0)?))
                        .collect()
                })
                .collect()
        };
        Ok(Arc::new(KeyPairs {
            inputs: cat(inputs)?,
            targets: cat(targets)?,
            positions,
        }))
    }

    fn save(&self, value: &Value, path: &Path) -> Result<()> {
        let p = downcast::<KeyPairs>(value, "key pairs")?;
        let mut map: HashMap<String, Tensor> = HashMap::new();
        for (l, heads) in p.inputs.iter().enumerate() {
            for (h, t) in heads.iter().enumerate() {
                map.insert(format!("l{l}.h{h}.input"), t.clone());
                map.insert(format!("l{l}.h{h}.target"), p.targets[l][h].clone());
            }
        }
        let pos: Vec<u32> = p.positions.iter().map(|&x| x as u32).collect();
        map.insert(
            "positions".into(),
            Tensor::from_vec(pos, p.positions.len(), &Device::Cpu)?,
        );
        candle_core::safetensors::save(&map, path)?;
        Ok(())
    }

    fn load(&self, path: &Path) -> Result<Value> {
        let map = candle_core::safetensors::load(path, &Device::Cpu)?;
        let key = |l: usize, h: usize, part: &str| format!("l{l}.h{h}.{part}");
        let get = |k: &str| {
            map.get(k)
                .cloned()
                .ok_or_else(|| DriverError::Records(format!("{}: no tensor {k}", path.display())))
        };
        let nl = (0..)
            .take_while(|&l| map.contains_key(&key(l, 0, "input")))
            .count();
        let (mut inputs, mut targets) = (Vec::new(), Vec::new());
        for l in 0..nl {
            let nh = (0..)
                .take_while(|&h| map.contains_key(&key(l, h, "input")))
                .count();
            inputs.push(
                (0..nh)
                    .map(|h| get(&key(l, h, "input")))
                    .collect::<Result<_>>()?,
            );
            targets.push(
                (0..nh)
                    .map(|h| get(&key(l, h, "target")))
                    .collect::<Result<_>>()?,
            );
        }
        let positions = get("positions")?
            .to_vec1::<u32>()?
            .into_iter()
            .map(|x| x as usize)
            .collect();
        Ok(Arc::new(KeyPairs {
            inputs,
            targets,
            positions,
        }))
    }

    fn check(&self, value: &Value, cfg: &ModelConfig) -> Result<()> {
        let p = downcast::<KeyPairs>(value, "key pairs")?;
        let n = p.rows();
        let ok = n > 0
            && p.inputs.len() == cfg.n_layers
            && p.targets.len() == cfg.n_layers
            && p.inputs.iter().chain(&p.targets).all(|heads| {
                heads.len() == cfg.n_kv_heads && heads.iter().all(|t| t.dims() == [n, cfg.head_dim])
            });
        if !ok {
            return Err(DriverError::Records(format!(
                "key pairs: the layout does not match the receiver ({} layers x {} kv heads x [{n}, {}])",
                cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
            )));
        }
        Ok(())
    }

    fn describe(&self) -> String {
        let input = match (&self.sender, self.noise_cosine) {
            (Some(s), _) => format!("sender {}", s.key()),
            (None, Some(c)) => format!("native keys under noise at cosine {c}"),
            _ => "no input".into(),
        };
        format!(
            "key_pairs from {input}, {} train items ({}) at {}, seed={}",
            self.train_items,
            self.data.name(),
            self.positions.name(),
            self.seed
        )
    }

    fn estimate_tokens(&self) -> usize {
        // About 200 tokens a training context; a sender reads it too.
        self.train_items * 200 * if self.sender.is_some() { 2 } else { 1 }
    }
}

/// How a fitted map is fitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FitMethod {
    /// Per layer and kv head, an affine map of post-RoPE keys, ridge least
    /// squares ([`fit::least_squares`]).
    LeastSquares,
    /// Per layer and kv head, least squares in the pre-RoPE frame restricted
    /// to the row and column space of the head's `W_k`, with the layer's own
    /// key bias ([`fit::key_subspace`] says what that means concretely).
    LeastSquaresWk,
    /// Per layer (every kv head at once), one hidden layer on a residual
    /// path trained with candle's autograd ([`fit::train_mlp`]).
    Mlp,
}

impl FitMethod {
    /// Name in configs and records.
    pub fn name(self) -> &'static str {
        match self {
            FitMethod::LeastSquares => "least_squares",
            FitMethod::LeastSquaresWk => "least_squares_wk",
            FitMethod::Mlp => "mlp",
        }
    }
}

/// A fitted map (`[resources.<name>] kind = "fitted_map"`). Parameters of
/// one method are errors with another.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FittedMapSpec {
    /// The key pairs (`[resources.<pairs>]`) it is fitted on.
    pub pairs: String,
    /// The fit.
    pub method: FitMethod,
    /// Ridge penalty relative to the input's scale (least-squares methods;
    /// default 1e-3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ridge: Option<f64>,
    /// Rank of `W_k`'s subspace (`least_squares_wk`; default: full, the
    /// numerical rank).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<usize>,
    /// Hidden width (`mlp`; default 256).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden: Option<usize>,
    /// Objective (`mlp`; default `mse`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub objective: Option<Objective>,
    /// Hinge margin, a cosine (`mlp` with `objective = "hinge"`; default 0.99).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub margin: Option<f64>,
    /// Full-batch AdamW steps (`mlp`; default 300).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<usize>,
    /// Learning rate (`mlp`; default 1e-3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// AdamW weight decay (`mlp`; default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<f64>,
    /// Seed of the MLP's initial weights.
    #[serde(default)]
    pub seed: u64,
}

impl FittedMapSpec {
    fn ridge(&self) -> f64 {
        self.ridge.unwrap_or(1e-3)
    }

    /// The MLP training of the spec, for vectors of `group` coordinates.
    pub fn training(&self, group: usize) -> MlpTraining {
        MlpTraining {
            hidden: self.hidden.unwrap_or(256),
            objective: self.objective.unwrap_or(Objective::Mse),
            margin: self.margin.unwrap_or(0.99),
            steps: self.steps.unwrap_or(300),
            lr: self.lr.unwrap_or(1e-3),
            weight_decay: self.weight_decay.unwrap_or(0.0),
            group,
            seed: self.seed,
        }
    }
}

/// The map of one layer.
#[derive(Debug, Clone)]
pub enum LayerMap {
    /// One affine map per kv head (`[head_dim, head_dim]`).
    Heads(Vec<AffineMap>),
    /// One MLP over the layer's kv heads concatenated.
    Mlp(Mlp),
}

/// A built fitted map.
#[derive(Debug, Clone)]
pub struct FittedMap {
    /// How it was fitted.
    pub method: FitMethod,
    /// Per layer.
    pub layers: Vec<LayerMap>,
    /// RoPE of the receiver (`least_squares_wk` maps act pre-RoPE): base
    /// frequency and pairing.
    pub rope: (f64, RopeStyle),
    /// Mean per-vector cosine of the inputs to the targets on the training
    /// rows, per layer.
    pub input_cosine: Vec<f64>,
    /// The same of the fitted outputs.
    pub fit_cosine: Vec<f64>,
}

impl FittedMap {
    /// Sender-side keys of layer `l` at prompt `positions`, `[n, n_kv,
    /// head_dim]` (post-RoPE), mapped to predicted receiver keys (same shape).
    pub fn apply(&self, l: usize, rows: &Tensor, positions: &[usize]) -> Result<Tensor> {
        let (n, nkv, hd) = rows.dims3()?;
        let layer = self
            .layers
            .get(l)
            .ok_or_else(|| DriverError::Records(format!("fitted map has no layer {l}")))?;
        Ok(match layer {
            LayerMap::Mlp(m) => m
                .apply(&rows.reshape((n, nkv * hd))?)?
                .reshape((n, nkv, hd))?,
            LayerMap::Heads(maps) => {
                let mut out = Vec::with_capacity(nkv);
                for (h, map) in maps.iter().enumerate().take(nkv) {
                    let x = rows.narrow(1, h, 1)?.squeeze(1)?.contiguous()?;
                    let y = if self.method == FitMethod::LeastSquaresWk {
                        let (theta, style) = self.rope;
                        let pre = fit::rope_rotate(&x, positions, theta, style, true)?;
                        fit::rope_rotate(&map.apply(&pre)?, positions, theta, style, false)?
                    } else {
                        map.apply(&x)?
                    };
                    out.push(y);
                }
                Tensor::stack(&out, 1)?
            }
        })
    }
}

fn mean_cosine(a: &Tensor, b: &Tensor) -> Result<f64> {
    let (a, b): (Vec<Vec<f32>>, Vec<Vec<f32>>) = (a.to_vec2()?, b.to_vec2()?);
    let n = a.len().max(1) as f64;
    Ok(a.iter()
        .zip(&b)
        .map(|(x, y)| tolerable_carrier::fidelity::vector_cosine(x, y))
        .sum::<f64>()
        / n)
}

fn style_code(s: RopeStyle) -> u32 {
    match s {
        RopeStyle::Half => 0,
        RopeStyle::Interleaved => 1,
    }
}

impl ResourceKind for FittedMapSpec {
    fn kind(&self) -> &'static str {
        "fitted_map"
    }

    fn version(&self) -> u32 {
        1
    }

    fn deps(&self) -> Vec<String> {
        vec![self.pairs.clone()]
    }

    fn validate(
        &self,
        field: &str,
        cfg: &ModelConfig,
        all: &BTreeMap<String, ResourceSpec>,
    ) -> Result<()> {
        match all.get(&self.pairs) {
            Some(ResourceSpec::KeyPairs(_)) => {}
            Some(_) => {
                return Err(DriverError::Config(format!(
                    "{field}.pairs: `{}` is not key pairs (`kind = \"key_pairs\"`)",
                    self.pairs
                )))
            }
            None => {
                return Err(DriverError::Config(format!(
                    "{field}.pairs: `{}` names no declared resource",
                    self.pairs
                )))
            }
        }
        let only = |name: &str, set: bool, methods: &str| -> Result<()> {
            if set {
                return Err(DriverError::Config(format!(
                    "{field}.{name}: `method = \"{}\"` takes no `{name}` (it is a parameter of {methods})",
                    self.method.name()
                )));
            }
            Ok(())
        };
        let ls = matches!(
            self.method,
            FitMethod::LeastSquares | FitMethod::LeastSquaresWk
        );
        let mlp = self.method == FitMethod::Mlp;
        only(
            "ridge",
            self.ridge.is_some() && !ls,
            "the least-squares methods",
        )?;
        only(
            "rank",
            self.rank.is_some() && self.method != FitMethod::LeastSquaresWk,
            "least_squares_wk",
        )?;
        for (name, set) in [
            ("hidden", self.hidden.is_some()),
            ("objective", self.objective.is_some()),
            ("margin", self.margin.is_some()),
            ("steps", self.steps.is_some()),
            ("lr", self.lr.is_some()),
            ("weight_decay", self.weight_decay.is_some()),
        ] {
            only(name, set && !mlp, "mlp")?;
        }
        if let Some(r) = self.ridge {
            if !(r >= 0.0 && r.is_finite()) {
                return Err(DriverError::Config(format!(
                    "{field}.ridge: {r} is not a finite non-negative number"
                )));
            }
        }
        if let Some(r) = self.rank {
            if r == 0 || r > cfg.head_dim {
                return Err(DriverError::Config(format!(
                    "{field}.rank: rank {r} of a key projection of head_dim {}: need 1 <= rank <= {}",
                    cfg.head_dim, cfg.head_dim
                )));
            }
        }
        if mlp {
            if self.margin.is_some() && self.objective != Some(Objective::Hinge) {
                return Err(DriverError::Config(format!(
                    "{field}.margin: only the hinge objective takes a margin"
                )));
            }
            let t = self.training(cfg.head_dim);
            let name = |e: &str| {
                if e.contains("hidden") {
                    "hidden"
                } else if e.contains("steps") {
                    "steps"
                } else if e.contains("learning rate") {
                    "lr"
                } else if e.contains("weight decay") {
                    "weight_decay"
                } else if e.contains("margin") {
                    "margin"
                } else {
                    "method"
                }
            };
            fit::validate_mlp(&t, cfg.n_kv_heads * cfg.head_dim).map_err(|e| {
                let e = e.to_string();
                DriverError::Config(format!("{field}.{}: {e}", name(&e)))
            })?;
        }
        Ok(())
    }

    fn training_items(&self, _cx: &TrainCx) -> Result<Vec<SplitItem>> {
        // Fitted on its key pairs, whose hash covers their items.
        Ok(Vec::new())
    }

    fn build(&self, cx: &BuildCx, _items: &[SplitItem]) -> Result<Value> {
        let pairs = cx.deps.get(&self.pairs).ok_or_else(|| {
            DriverError::Config(format!(
                "{}: its key pairs `{}` were not built first",
                cx.train.field, self.pairs
            ))
        })?;
        let pairs = downcast::<KeyPairs>(pairs, "key pairs")?;
        let cfg = cx.model.config();
        let (hd, nkv) = (cfg.head_dim, cfg.n_kv_heads);
        let bar = ProgressBar::new(pairs.inputs.len() as u64);
        bar.set_style(
            ProgressStyle::with_template(&format!(
                "fitted map {} {{bar:30}} {{pos}}/{{len}} layers eta {{eta}}",
                self.method.name()
            ))
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        let mut layers = Vec::with_capacity(pairs.inputs.len());
        for l in 0..pairs.inputs.len() {
            let (xs, ys) = (&pairs.inputs[l], &pairs.targets[l]);
            layers.push(match self.method {
                FitMethod::LeastSquares => LayerMap::Heads(
                    xs.iter()
                        .zip(ys)
                        .map(|(x, y)| Ok(fit::least_squares(x, y, self.ridge())?))
                        .collect::<Result<_>>()?,
                ),
                FitMethod::LeastSquaresWk => {
                    let (wk, bk) = cx.model.key_projection(l)?;
                    let mut maps = Vec::with_capacity(nkv);
                    for (h, (x, y)) in xs.iter().zip(ys).enumerate() {
                        let w = wk.narrow(0, h * hd, hd)?;
                        let b = match &bk {
                            Some(b) => b.narrow(0, h * hd, hd)?,
                            None => Tensor::zeros(hd, DType::F32, &Device::Cpu)?,
                        };
                        let basis = fit::key_subspace(&w, self.rank)?;
                        let (theta, style) = (cfg.rope_theta, cfg.rope_style);
                        let pre =
                            |t: &Tensor| fit::rope_rotate(t, &pairs.positions, theta, style, true);
                        maps.push(fit::least_squares_in_subspace(
                            &pre(x)?,
                            &pre(y)?,
                            &basis,
                            &b,
                            self.ridge(),
                        )?);
                    }
                    LayerMap::Heads(maps)
                }
                FitMethod::Mlp => {
                    let x = Tensor::cat(xs, 1)?;
                    let y = Tensor::cat(ys, 1)?;
                    let (mlp, losses) = fit::train_mlp(&x, &y, &self.training(hd))?;
                    tracing::debug!(
                        "layer {l}: {} loss {:.5} -> {:.5}",
                        self.training(hd).objective.name(),
                        losses[0],
                        losses[losses.len() - 1]
                    );
                    LayerMap::Mlp(mlp)
                }
            });
            bar.inc(1);
        }
        bar.finish_and_clear();
        let mut map = FittedMap {
            method: self.method,
            layers,
            rope: (cfg.rope_theta, cfg.rope_style),
            input_cosine: Vec::new(),
            fit_cosine: Vec::new(),
        };
        fill_cosines(&mut map, pairs)?;
        tracing::info!(
            "{}: on {} training rows, mean key cosine to the receiver's {:.5} (input) -> {:.5} (fitted)",
            cx.train.field,
            pairs.rows(),
            mean(&map.input_cosine),
            mean(&map.fit_cosine)
        );
        Ok(Arc::new(map))
    }

    fn save(&self, value: &Value, path: &Path) -> Result<()> {
        let fm = downcast::<FittedMap>(value, "fitted map")?;
        let mut map: HashMap<String, Tensor> = HashMap::new();
        for (l, layer) in fm.layers.iter().enumerate() {
            match layer {
                LayerMap::Heads(maps) => {
                    for (h, m) in maps.iter().enumerate() {
                        map.insert(format!("l{l}.h{h}.weight"), m.weight.clone());
                        map.insert(format!("l{l}.h{h}.bias"), m.bias.clone());
                    }
                }
                LayerMap::Mlp(m) => {
                    map.insert(format!("l{l}.w1"), m.w1.clone());
                    map.insert(format!("l{l}.b1"), m.b1.clone());
                    map.insert(format!("l{l}.w2"), m.w2.clone());
                    map.insert(format!("l{l}.b2"), m.b2.clone());
                    map.insert(
                        format!("l{l}.scale"),
                        Tensor::from_vec(vec![m.scale], 1, &Device::Cpu)?,
                    );
                }
            }
        }
        map.insert(
            "rope_theta".into(),
            Tensor::from_vec(vec![fm.rope.0], 1, &Device::Cpu)?,
        );
        map.insert(
            "rope_style".into(),
            Tensor::from_vec(vec![style_code(fm.rope.1)], 1, &Device::Cpu)?,
        );
        let f64s = |v: &[f64]| Tensor::from_vec(v.to_vec(), v.len(), &Device::Cpu);
        map.insert("input_cosine".into(), f64s(&fm.input_cosine)?);
        map.insert("fit_cosine".into(), f64s(&fm.fit_cosine)?);
        candle_core::safetensors::save(&map, path)?;
        Ok(())
    }

    fn load(&self, path: &Path) -> Result<Value> {
        let map = candle_core::safetensors::load(path, &Device::Cpu)?;
        let get = |k: &str| {
            map.get(k)
                .cloned()
                .ok_or_else(|| DriverError::Records(format!("{}: no tensor {k}", path.display())))
        };
        let mut layers = Vec::new();
        for l in 0.. {
            if self.method == FitMethod::Mlp {
                if !map.contains_key(&format!("l{l}.w1")) {
                    break;
                }
                layers.push(LayerMap::Mlp(Mlp {
                    w1: get(&format!("l{l}.w1"))?,
                    b1: get(&format!("l{l}.b1"))?,
                    w2: get(&format!("l{l}.w2"))?,
                    b2: get(&format!("l{l}.b2"))?,
                    scale: get(&format!("l{l}.scale"))?.to_vec1::<f32>()?[0],
                }));
            } else {
                let nh = (0..)
                    .take_while(|h| map.contains_key(&format!("l{l}.h{h}.weight")))
                    .count();
                if nh == 0 {
                    break;
                }
                layers.push(LayerMap::Heads(
                    (0..nh)
                        .map(|h| {
                            Ok(AffineMap {
                                weight: get(&format!("l{l}.h{h}.weight"))?,
                                bias: get(&format!("l{l}.h{h}.bias"))?,
                            })
                        })
                        .collect::<Result<_>>()?,
                ));
            }
        }
        let theta = get("rope_theta")?.to_vec1::<f64>()?[0];
        let style = match get("rope_style")?.to_vec1::<u32>()?[0] {
            0 => RopeStyle::Half,
            _ => RopeStyle::Interleaved,
        };
        Ok(Arc::new(FittedMap {
            method: self.method,
            layers,
            rope: (theta, style),
            input_cosine: get("input_cosine")?.to_vec1()?,
            fit_cosine: get("fit_cosine")?.to_vec1()?,
        }))
    }

    fn check(&self, value: &Value, cfg: &ModelConfig) -> Result<()> {
        let fm = downcast::<FittedMap>(value, "fitted map")?;
        let (hd, nkv) = (cfg.head_dim, cfg.n_kv_heads);
        let ok = fm.method == self.method
            && fm.layers.len() == cfg.n_layers
            && fm.rope == (cfg.rope_theta, cfg.rope_style)
            && fm.layers.iter().all(|layer| match layer {
                LayerMap::Heads(maps) => {
                    maps.len() == nkv
                        && maps
                            .iter()
                            .all(|m| m.weight.dims() == [hd, hd] && m.bias.dims() == [hd])
                }
                LayerMap::Mlp(m) => m.dim() == nkv * hd && m.hidden() == self.training(hd).hidden,
            });
        if !ok {
            return Err(DriverError::Records(format!(
                "fitted map: its layout does not match the receiver ({} layers x {nkv} kv heads x {hd} dims, {})",
                cfg.n_layers,
                self.method.name()
            )));
        }
        Ok(())
    }

    fn describe(&self) -> String {
        let extra = match self.method {
            FitMethod::LeastSquares => format!(" ridge={}", self.ridge()),
            FitMethod::LeastSquaresWk => format!(
                " ridge={} rank={}",
                self.ridge(),
                self.rank
                    .map(|r| r.to_string())
                    .unwrap_or_else(|| "full".into())
            ),
            FitMethod::Mlp => {
                let t = self.training(0);
                format!(
                    " hidden={} objective={}{} steps={} lr={} seed={}",
                    t.hidden,
                    t.objective.name(),
                    if t.objective == Objective::Hinge {
                        format!(" margin={}", t.margin)
                    } else {
                        String::new()
                    },
                    t.steps,
                    t.lr,
                    self.seed
                )
            }
        };
        format!(
            "fitted_map {}{extra} on pairs `{}`",
            self.method.name(),
            self.pairs
        )
    }
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// The training-row cosines of a map's inputs and outputs to the targets.
fn fill_cosines(map: &mut FittedMap, pairs: &KeyPairs) -> Result<()> {
    for l in 0..pairs.inputs.len() {
        let x = Tensor::stack(&pairs.inputs[l], 1)?; // [n, nkv, hd]
        let y = Tensor::stack(&pairs.targets[l], 1)?;
        let out = map.apply(l, &x, &pairs.positions)?;
        let (n, nkv, hd) = y.dims3()?;
        let flat = |t: &Tensor| t.reshape((n * nkv, hd));
        map.input_cosine.push(mean_cosine(&flat(&x)?, &flat(&y)?)?);
        map.fit_cosine.push(mean_cosine(&flat(&out)?, &flat(&y)?)?);
    }
    Ok(())
}
