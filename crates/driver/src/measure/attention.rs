//! How attention reads the cache (paper 1, appendix E; PROTOCOL.md §5):
//! two measurements that are not arms.
//!
//! - **Conditioning** (`kind = "conditioning"`): the readout gain
//!   `|change of readout| / |displacement|` of one key slot, by finite
//!   differences, at the attention-logit stage and the softmax-output stage
//!   ([`tolerable_carrier::readout`]), for displacements toward a genuine
//!   bank neighbour (on-manifold) and isotropic ones (off-manifold); per
//!   layer; `probes x magnitudes x directions x seeds`; with the analytic
//!   per-slot bound whose constant is `sqrt(2G)` and its correlation with
//!   the measured gains.
//! - **Quantization** (`kind = "quantization"`): integer round trips (int8,
//!   int4) of the whole cache against Gaussian noise of matched displacement
//!   norm, slot by slot: the attention-output error and the share of the key
//!   displacement in the query subspace, at the round trip's own norm and
//!   rescaled to fixed relative norms.
//!
//! A **probe** is one SQuAD item read with its full passage: one forward
//! pass captures every layer's post-RoPE queries and the cache. The readout
//! is that of the **decision query** (the last prompt position, where the
//! answer's first token is chosen) of the `G` query heads of each kv head,
//! over every slot of the prompt; the query subspace is spanned by the
//! question's queries (every position after the passage). The displaced
//! slot is a fact-region slot (the answer tokens), drawn per seed.
//!
//! The bank of genuine keys is the key-bank resource (`[measure.bank]`, the
//! sweeps' `key_bank` kind: fitted on training items, cached by content
//! hash, its hash in `run.json`). Records are [`MeasureRow`]s, one unit file
//! per probe (`units/<item id>.parquet`, resumable), and `summary.parquet`.

use super::{
    invocation, read_rows, write_rows, MeasureConfig, MeasureOptions, MeasureOutcome, RunDir,
};
use crate::config::{DataSection, DataSource};
use crate::error::{DriverError, Result};
use crate::records::MeasureRow;
use crate::resources::{EvalSet, KeyBank, KeyBankSpec, ResourceSpec, TrainCx};
use candle_core::{IndexOp, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::Path;
use std::time::Instant;
use tolerable_carrier::readout::{
    int_round_trip, matched_noise, principal_subspace, random_direction, subspace_share, Readout,
};
use tolerable_carrier::LayerSet;
use tolerable_probe::{SplitItem, SplitOptions, Template};
use tolerable_runtime::{HookPoint, HookSpec, LogitsAt, Model, ModelConfig, Precision};

fn cfg_err(msg: impl Into<String>) -> DriverError {
    DriverError::Config(msg.into())
}

/// The `[measure]` table of a conditioning measurement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConditioningSpec {
    /// Probes: SQuAD items read with their full passage.
    #[serde(default = "default_probes")]
    pub probes: usize,
    /// Where the probes come from (`squad_dev`; `synthetic` for smoke tests).
    #[serde(default = "default_data")]
    pub data: DataSource,
    /// Layers measured (LayerSet syntax).
    #[serde(default = "default_layers")]
    pub layers: LayerSet,
    /// Displacement magnitudes `|delta| / |k|`, each finite and above zero.
    #[serde(default = "default_magnitudes")]
    pub magnitudes: Vec<f64>,
    /// Directions per probe, slot and seed (on-manifold: toward that many
    /// distinct bank neighbours; off-manifold: that many isotropic draws).
    #[serde(default = "default_directions")]
    pub directions: usize,
    /// Seeds: each draws its own slot, neighbours and isotropic directions.
    #[serde(default = "default_seeds")]
    pub seeds: usize,
    /// The bank of genuine keys the on-manifold directions point to.
    #[serde(default = "default_bank")]
    pub bank: KeyBankSpec,
}

/// The `[measure]` table of a quantization measurement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuantizationSpec {
    /// Probes: SQuAD items read with their full passage.
    #[serde(default = "default_probes")]
    pub probes: usize,
    /// Where the probes come from (`squad_dev`; `synthetic` for smoke tests).
    #[serde(default = "default_data")]
    pub data: DataSource,
    /// Layers measured (LayerSet syntax).
    #[serde(default = "default_layers")]
    pub layers: LayerSet,
    /// Integer widths of the round trips (2..=8).
    #[serde(default = "default_bits")]
    pub bits: Vec<u8>,
    /// Relative displacement norms `|delta| / |K|` the round trip's
    /// displacement (and its noise) are also rescaled to, each above zero.
    #[serde(default = "default_fixed_norms")]
    pub fixed_norms: Vec<f64>,
    /// Share of the question queries' squared norm the query subspace holds.
    #[serde(default = "default_energy")]
    pub query_energy: f64,
    /// Noise draws averaged per probe, layer and head.
    #[serde(default = "default_noise_seeds")]
    pub noise_seeds: usize,
}

fn default_probes() -> usize {
    40
}
fn default_data() -> DataSource {
    DataSource::SquadDev
}
fn default_layers() -> LayerSet {
    LayerSet::All
}
fn default_magnitudes() -> Vec<f64> {
    vec![0.001, 0.003, 0.01, 0.03, 0.1, 0.3]
}
fn default_directions() -> usize {
    8
}
fn default_seeds() -> usize {
    3
}
fn default_bank() -> KeyBankSpec {
    toml::from_str("").expect("the key bank's defaults")
}
fn default_bits() -> Vec<u8> {
    vec![8, 4]
}
fn default_fixed_norms() -> Vec<f64> {
    vec![0.05]
}
fn default_energy() -> f64 {
    0.9
}
fn default_noise_seeds() -> usize {
    3
}

fn check_probes(probes: usize, data: DataSource) -> Result<()> {
    if probes == 0 {
        return Err(cfg_err("[measure] probes: 0; at least one probe is needed"));
    }
    if data == DataSource::SquadTrain {
        return Err(cfg_err(
            "[measure] data: `squad_train`; probes are evaluation items (`squad_dev`, or `synthetic`), the bank is fitted on training items",
        ));
    }
    Ok(())
}

impl ConditioningSpec {
    /// Checks every field that does not need the model.
    pub fn check(&self) -> Result<()> {
        check_probes(self.probes, self.data)?;
        if self.magnitudes.is_empty() {
            return Err(cfg_err("[measure] magnitudes: empty"));
        }
        if let Some(m) = self
            .magnitudes
            .iter()
            .find(|m| !(m.is_finite() && **m > 0.0))
        {
            return Err(cfg_err(format!(
                "[measure] magnitudes: {m}; a readout gain needs a finite displacement above zero"
            )));
        }
        if self.directions == 0 {
            return Err(cfg_err("[measure] directions: 0; at least one direction"));
        }
        if self.seeds == 0 {
            return Err(cfg_err("[measure] seeds: 0; at least one seed"));
        }
        let need = self.directions * self.seeds;
        if self.bank.size < need {
            return Err(cfg_err(format!(
                "[measure.bank] size: {} keys, but {} directions x {} seeds take {need} distinct neighbours",
                self.bank.size, self.directions, self.seeds
            )));
        }
        if self.bank.data != DataSource::SquadTrain && self.bank.data != DataSource::Synthetic {
            return Err(cfg_err(format!(
                "[measure.bank] data: {:?}; a bank is fitted on training items (`squad_train`)",
                self.bank.data
            )));
        }
        Ok(())
    }
}

impl QuantizationSpec {
    /// Checks every field that does not need the model.
    pub fn check(&self) -> Result<()> {
        check_probes(self.probes, self.data)?;
        if self.bits.is_empty() {
            return Err(cfg_err("[measure] bits: empty"));
        }
        if let Some(b) = self.bits.iter().find(|b| !(2..=8).contains(*b)) {
            return Err(cfg_err(format!("[measure] bits: {b}; expected 2..=8")));
        }
        if let Some(f) = self
            .fixed_norms
            .iter()
            .find(|f| !(f.is_finite() && **f > 0.0))
        {
            return Err(cfg_err(format!(
                "[measure] fixed_norms: {f}; a displacement norm must be finite and above zero"
            )));
        }
        if !(self.query_energy > 0.0 && self.query_energy <= 1.0) {
            return Err(cfg_err(format!(
                "[measure] query_energy: {} is outside (0, 1]",
                self.query_energy
            )));
        }
        if self.noise_seeds == 0 {
            return Err(cfg_err("[measure] noise_seeds: 0; at least one noise draw"));
        }
        Ok(())
    }
}

/// Which of the two measurements.
#[derive(Debug, Clone, Copy)]
pub enum Which<'a> {
    /// Readout gains.
    Conditioning(&'a ConditioningSpec),
    /// Round trips against noise.
    Quantization(&'a QuantizationSpec),
}

impl Which<'_> {
    fn name(&self) -> &'static str {
        match self {
            Which::Conditioning(_) => "conditioning",
            Which::Quantization(_) => "quantization",
        }
    }
    fn probes(&self) -> usize {
        match self {
            Which::Conditioning(s) => s.probes,
            Which::Quantization(s) => s.probes,
        }
    }
    fn data(&self) -> DataSource {
        match self {
            Which::Conditioning(s) => s.data,
            Which::Quantization(s) => s.data,
        }
    }
    fn layer_set(&self) -> &LayerSet {
        match self {
            Which::Conditioning(s) => &s.layers,
            Which::Quantization(s) => &s.layers,
        }
    }
}

/// The prompt settings of the probes (the sweeps' defaults: raw template,
/// prompts of at most 512 tokens), so the bank's content hash matches the
/// one the key-bank sweep builds.
fn split_options(mcfg: &ModelConfig) -> SplitOptions {
    SplitOptions {
        template: Template::Raw,
        max_prompt_tokens: 512usize.min(mcfg.context_length.saturating_sub(8)),
        ..SplitOptions::default()
    }
}

fn resolve_layers(set: &LayerSet, mcfg: &ModelConfig) -> Result<Vec<usize>> {
    let layers = set
        .resolve(mcfg.n_layers, "[measure] layers")
        .map_err(|e| cfg_err(e.to_string()))?;
    if layers.is_empty() {
        return Err(cfg_err("[measure] layers: no layer"));
    }
    Ok(layers)
}

/// The probes of a run: `n` SQuAD items (seeded like sweeps), checked to
/// have a fact region and a question after the passage.
fn sample_probes(
    source: DataSource,
    n: usize,
    seed: u64,
    opts: &MeasureOptions,
    tokenizer: &tolerable_runtime::Tokenizer,
    split: &SplitOptions,
) -> Result<(Vec<SplitItem>, String)> {
    let data = DataSection {
        source,
        path: None,
        n,
    };
    let (items, source) =
        crate::items::load_items(&data, opts.data.get("squad_dev").map(|p| p.as_path()), seed)?;
    let sample = tolerable_probe::sample::sample(&items, tokenizer, split, n, seed)?;
    Ok((sample.items, source))
}

/// One kv head of one layer of one probe, as plain rows.
struct HeadView {
    /// The decision query of each of the head's `G` query heads, `[G, d]`.
    decision: Vec<f32>,
    /// The question's queries of the `G` heads, `[G * n_q, d]`.
    question: Vec<f32>,
    /// Every slot's key, `[T, d]`.
    keys: Vec<f32>,
    /// Every slot's value, `[T, d]`.
    values: Vec<f32>,
}

/// Reads a probe once: the queries of `layers` and the cache, split by kv head.
fn read_probe(
    model: &Model,
    item: &SplitItem,
    layers: &[usize],
) -> Result<BTreeMap<usize, Vec<HeadView>>> {
    let cfg = model.config();
    let prompt = item.full_prompt();
    let t = prompt.len();
    let q_start = item.context_len();
    if q_start >= t {
        return Err(DriverError::Records(format!(
            "probe {}: no question tokens after the passage",
            item.item.id
        )));
    }
    let mut cache = model.new_cache(1);
    let spec = HookSpec::new().capture_all(layers.iter().map(|&l| HookPoint::RotQ(l)));
    let out = model.forward(&model.tokens(&[prompt])?, &mut cache, &spec, LogitsAt::None)?;
    let g = cfg.n_heads / cfg.n_kv_heads;
    let mut views = BTreeMap::new();
    for &l in layers {
        let q = out.hooks.require(HookPoint::RotQ(l))?.i(0)?; // [n_heads, T, d]
        let layer = cache.require_layer(l)?;
        let (k, v) = (layer.k.i(0)?, layer.v.i(0)?); // [n_kv, T, d]
        let mut heads = Vec::with_capacity(cfg.n_kv_heads);
        for h in 0..cfg.n_kv_heads {
            let mut decision = Vec::with_capacity(g * cfg.head_dim);
            let mut question = Vec::new();
            for qh in h * g..(h + 1) * g {
                let rows = q.i(qh)?.to_dtype(candle_core::DType::F32)?;
                decision.extend(rows.i(t - 1)?.to_vec1::<f32>()?);
                question.extend(
                    rows.narrow(0, q_start, t - q_start)?
                        .flatten_all()?
                        .to_vec1::<f32>()?,
                );
            }
            heads.push(HeadView {
                decision,
                question,
                keys: k
                    .i(h)?
                    .to_dtype(candle_core::DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?,
                values: v
                    .i(h)?
                    .to_dtype(candle_core::DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?,
            });
        }
        views.insert(l, heads);
    }
    Ok(views)
}

fn norm(x: &[f32]) -> f64 {
    x.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt()
}

/// The bank rows nearest `k` by cosine, best first (`take` of them): the
/// key-bank arms' own neighbour search ([`tolerable_carrier::top_k_cosine`]).
fn nearest(bank: &Tensor, k: &[f32], take: usize) -> Result<Vec<Vec<f32>>> {
    let q = Tensor::from_slice(k, (1, k.len()), bank.device())?;
    let near = tolerable_carrier::top_k_cosine(&q, bank, take)?;
    Ok(tolerable_carrier::gather_rows(bank, &near.index[0])?.to_vec2::<f32>()?)
}

/// Accumulates a mean.
#[derive(Default, Clone, Copy)]
struct Mean {
    sum: f64,
    n: usize,
}

impl Mean {
    fn add(&mut self, x: f64) {
        self.sum += x;
        self.n += 1;
    }
    fn get(&self) -> f64 {
        if self.n == 0 {
            f64::NAN
        } else {
            self.sum / self.n as f64
        }
    }
}

/// The conditioning rows of one probe.
fn conditioning_probe(
    run: &str,
    model_id: &str,
    spec: &ConditioningSpec,
    item: &SplitItem,
    views: &BTreeMap<usize, Vec<HeadView>>,
    bank: &KeyBank,
    d: usize,
) -> Result<Vec<MeasureRow>> {
    let fact = item.fact_positions();
    if fact.is_empty() {
        return Err(DriverError::Records(format!(
            "probe {}: empty fact region",
            item.item.id
        )));
    }
    let pid = crate::exec::name_key(&item.item.id);
    let mut rows = Vec::new();
    for (&l, heads) in views {
        // (manifold, magnitude index) -> (logit, softmax, logit relative, softmax relative) means.
        let mut acc: BTreeMap<(&str, usize), [Mean; 4]> = BTreeMap::new();
        let (mut bound, mut weight) = (Mean::default(), Mean::default());
        for (h, view) in heads.iter().enumerate() {
            let readout = Readout::new(&view.decision, &view.keys, d)?;
            let bank = bank.at(l, h)?;
            for s in 0..spec.seeds {
                let pick = crate::exec::mix(pid, &[l as u64, h as u64, s as u64, 1]);
                let j = fact[(pick % fact.len() as u64) as usize];
                let k = &view.keys[j * d..(j + 1) * d];
                let kn = norm(k);
                bound.add(readout.softmax_bound(j));
                for g in 0..readout.heads() {
                    weight.add(readout.weight(g, j));
                }
                // On-manifold: toward this seed's neighbours (ranks s*D+1 ..= (s+1)*D).
                let near = nearest(bank, k, spec.directions * spec.seeds)?;
                let mut dirs: Vec<(&str, Vec<f32>)> = Vec::new();
                for row in near.iter().skip(s * spec.directions).take(spec.directions) {
                    let diff: Vec<f32> = row.iter().zip(k).map(|(x, y)| x - y).collect();
                    let dn = norm(&diff);
                    if dn > 0.0 {
                        dirs.push((
                            "on_manifold",
                            diff.iter().map(|x| (*x as f64 / dn) as f32).collect(),
                        ));
                    }
                }
                for di in 0..spec.directions {
                    dirs.push((
                        "off_manifold",
                        random_direction(
                            d,
                            crate::exec::mix(pid, &[l as u64, h as u64, s as u64, 2, di as u64]),
                        ),
                    ));
                }
                for (manifold, u) in &dirs {
                    for (mi, &m) in spec.magnitudes.iter().enumerate() {
                        let scale = (m * kn) as f32;
                        let delta: Vec<f32> = u.iter().map(|x| x * scale).collect();
                        let gains = readout.gains(j, &delta)?;
                        let e = acc.entry((manifold, mi)).or_default();
                        e[0].add(gains.logit);
                        e[1].add(gains.softmax);
                        e[2].add(
                            gains.logit * kn / readout.logit_column_norm(j).max(f64::MIN_POSITIVE),
                        );
                        e[3].add(
                            gains.softmax * kn / readout.weights_norm().max(f64::MIN_POSITIVE),
                        );
                    }
                }
            }
        }
        for ((manifold, mi), [lg, sm, lgr, smr]) in &acc {
            for (metric, mean) in [
                ("gain_logit", lg),
                ("gain_softmax", sm),
                ("gain_logit_rel", lgr),
                ("gain_softmax_rel", smr),
            ] {
                let mut r =
                    MeasureRow::new(run, "conditioning", model_id, metric, mean.get(), mean.n)
                        .layer(l)
                        .variant(manifold);
                r.context = Some(item.item.id.clone());
                r.magnitude = Some(spec.magnitudes[*mi]);
                rows.push(r);
            }
        }
        for (metric, mean) in [("bound_softmax", bound), ("slot_weight", weight)] {
            let mut r =
                MeasureRow::new(run, "conditioning", model_id, metric, mean.get(), mean.n).layer(l);
            r.context = Some(item.item.id.clone());
            rows.push(r);
        }
    }
    Ok(rows)
}

/// The quantization rows of one probe.
fn quantization_probe(
    run: &str,
    model_id: &str,
    spec: &QuantizationSpec,
    item: &SplitItem,
    views: &BTreeMap<usize, Vec<HeadView>>,
    d: usize,
) -> Result<Vec<MeasureRow>> {
    let pid = crate::exec::name_key(&item.item.id);
    let mut rows = Vec::new();
    let row =
        |metric: &str, value: f64, n: usize, l: usize, variant: Option<&str>, mag: Option<f64>| {
            let mut r = MeasureRow::new(run, "quantization", model_id, metric, value, n).layer(l);
            r.context = Some(item.item.id.clone());
            r.variant = variant.map(String::from);
            r.magnitude = mag;
            r
        };
    for (&l, heads) in views {
        // (variant, fixed norm bits or None, metric) -> mean over heads (and noise draws).
        let mut acc: BTreeMap<(String, Option<u64>, &str), Mean> = BTreeMap::new();
        let (mut rank, mut iso) = (Mean::default(), Mean::default());
        for (h, view) in heads.iter().enumerate() {
            let readout = Readout::new(&view.decision, &view.keys, d)?;
            let clean = f32s(&readout.output(None, &view.values)?);
            let basis = principal_subspace(&view.question, d, spec.query_energy)?;
            let r = basis.len() / d;
            rank.add(r as f64);
            iso.add(r as f64 / d as f64);
            let (kn, vn) = (norm(&view.keys), norm(&view.values));
            for &bits in &spec.bits {
                let kq = int_round_trip(&view.keys, d, bits)?;
                let vq = int_round_trip(&view.values, d, bits)?;
                let dk: Vec<f32> = kq.iter().zip(&view.keys).map(|(a, b)| a - b).collect();
                let dv: Vec<f32> = vq.iter().zip(&view.values).map(|(a, b)| a - b).collect();
                let quant = format!("int{bits}");
                let noise = format!("noise_int{bits}");
                // Scales: the round trip's own norm, then each fixed relative norm.
                let mut scales: Vec<(Option<u64>, f64, f64)> = vec![(None, 1.0, 1.0)];
                let (dkn, dvn) = (norm(&dk), norm(&dv));
                for &f in &spec.fixed_norms {
                    let sk = if dkn > 0.0 { f * kn / dkn } else { 0.0 };
                    let sv = if dvn > 0.0 { f * vn / dvn } else { 0.0 };
                    scales.push((Some(f.to_bits()), sk, sv));
                }
                for &(fixed, sk, sv) in &scales {
                    let apply = |base: &[f32], delta: &[f32], s: f64| -> Vec<f32> {
                        base.iter()
                            .zip(delta)
                            .map(|(b, x)| b + (*x as f64 * s) as f32)
                            .collect()
                    };
                    let measure = |acc: &mut BTreeMap<(String, Option<u64>, &str), Mean>,
                                   name: &str,
                                   dk: &[f32],
                                   dv: &[f32]|
                     -> Result<()> {
                        let k2 = apply(&view.keys, dk, sk);
                        let v2 = apply(&view.values, dv, sv);
                        let out = readout.output(Some(&k2), &v2)?;
                        acc.entry((name.to_string(), fixed, "output_error"))
                            .or_default()
                            .add(tolerable_stats::relative_l2(&f32s(&out), &clean)?);
                        acc.entry((name.to_string(), fixed, "query_share"))
                            .or_default()
                            .add(subspace_share(dk, &basis, d));
                        acc.entry((name.to_string(), fixed, "displacement"))
                            .or_default()
                            .add(norm(dk) * sk / kn.max(f64::MIN_POSITIVE));
                        Ok(())
                    };
                    measure(&mut acc, &quant, &dk, &dv)?;
                    for s in 0..spec.noise_seeds {
                        let seed =
                            crate::exec::mix(pid, &[l as u64, h as u64, bits as u64, s as u64]);
                        let nk = matched_noise(&dk, d, seed);
                        let nv = matched_noise(&dv, d, seed ^ 0x05EE_D0F0_A1E5);
                        measure(&mut acc, &noise, &nk, &nv)?;
                    }
                }
            }
        }
        for ((variant, fixed, metric), mean) in &acc {
            rows.push(row(
                metric,
                mean.get(),
                mean.n,
                l,
                Some(variant),
                fixed.map(f64::from_bits),
            ));
        }
        rows.push(row("query_rank", rank.get(), rank.n, l, None, None));
        rows.push(row(
            "query_share_isotropic",
            iso.get(),
            iso.n,
            l,
            None,
            None,
        ));
    }
    Ok(rows)
}

/// A readout computed in f64, as the f32 rows `tolerable_stats` compares.
fn f32s(x: &[f64]) -> Vec<f32> {
    x.iter().map(|&v| v as f32).collect()
}

/// Aggregates per-probe rows: means over probes per (layer, variant,
/// magnitude, metric); pooled over layers (layer null); beside each mean
/// over two or more probes its standard error over probes (`<metric>_se`,
/// n = probes: the standard deviation of the per-probe means over the
/// square root of their number, the probe being the independent unit);
/// for conditioning the off/on ratios (`variant = off_over_on`) and the
/// bound's correlation with the measured gains; for quantization the round
/// trip over its matched noise (`variant = int<b>_over_noise`).
pub fn summarize(
    run: &str,
    model: &str,
    measurement: &str,
    rows: &[MeasureRow],
) -> Vec<MeasureRow> {
    type Key = (Option<i64>, Option<String>, Option<u64>, String);
    let mut by: BTreeMap<Key, Mean> = BTreeMap::new();
    // The same cells split by probe (the row's context), for the standard
    // errors. `by` is not derived from these: summing per-probe partial sums
    // would change the published means in their last bits.
    let mut per_probe: BTreeMap<Key, BTreeMap<Option<String>, Mean>> = BTreeMap::new();
    for r in rows
        .iter()
        .filter(|r| r.measurement == measurement && r.value.is_finite())
    {
        let mag = r.magnitude.map(f64::to_bits);
        let mut keys = vec![
            (r.layer, r.variant.clone(), mag, r.metric.clone()),
            (None, r.variant.clone(), mag, r.metric.clone()),
        ];
        if measurement == "conditioning" && mag.is_some() {
            keys.push((r.layer, r.variant.clone(), None, r.metric.clone()));
            keys.push((None, r.variant.clone(), None, r.metric.clone()));
        }
        for k in keys {
            by.entry(k.clone()).or_default().add(r.value);
            per_probe
                .entry(k)
                .or_default()
                .entry(r.context.clone())
                .or_default()
                .add(r.value);
        }
    }
    let mk = |k: &Key, value: f64, n: usize| {
        let mut r = MeasureRow::new(run, measurement, model, &k.3, value, n);
        r.layer = k.0;
        r.variant = k.1.clone();
        r.magnitude = k.2.map(f64::from_bits);
        r
    };
    let mut out: Vec<MeasureRow> = by.iter().map(|(k, m)| mk(k, m.get(), m.n)).collect();
    for (k, probes) in &per_probe {
        let means: Vec<f64> = probes.values().map(Mean::get).collect();
        // One probe has no standard error: no row.
        let Ok(se) = tolerable_stats::mean_standard_error(&means) else {
            continue;
        };
        let mut r = mk(
            &(k.0, k.1.clone(), k.2, format!("{}_se", k.3)),
            se,
            means.len(),
        );
        r.note = Some("standard error over probes: the standard deviation of the per-probe means over the square root of their number".into());
        out.push(r);
    }
    let get = |l: Option<i64>, v: Option<&str>, mag: Option<u64>, metric: &str| {
        by.get(&(l, v.map(String::from), mag, metric.to_string()))
            .map(|m| m.get())
    };
    let layers: Vec<i64> = by
        .keys()
        .filter_map(|k| k.0)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    if measurement == "conditioning" {
        let mags: Vec<Option<u64>> = by
            .keys()
            .map(|k| k.2)
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        for metric in [
            "gain_logit",
            "gain_softmax",
            "gain_logit_rel",
            "gain_softmax_rel",
        ] {
            for l in std::iter::once(None).chain(layers.iter().map(|&l| Some(l))) {
                for &mag in &mags {
                    if let (Some(off), Some(on)) = (
                        get(l, Some("off_manifold"), mag, metric),
                        get(l, Some("on_manifold"), mag, metric),
                    ) {
                        out.push(mk(
                            &(l, Some("off_over_on".into()), mag, metric.into()),
                            off / on,
                            1,
                        ));
                    }
                }
            }
        }
        // The bound against the first-order gain (the smallest magnitude), across layers.
        if let Some(&smallest) = mags
            .iter()
            .flatten()
            .min_by(|a, b| f64::from_bits(**a).total_cmp(&f64::from_bits(**b)))
        {
            let bounds: Vec<f64> = layers
                .iter()
                .filter_map(|&l| get(Some(l), None, None, "bound_softmax"))
                .collect();
            for manifold in ["on_manifold", "off_manifold"] {
                let gains: Vec<f64> = layers
                    .iter()
                    .filter_map(|&l| get(Some(l), Some(manifold), Some(smallest), "gain_softmax"))
                    .collect();
                if gains.len() == bounds.len() {
                    let mut r = mk(
                        &(
                            None,
                            Some(manifold.into()),
                            Some(smallest),
                            "bound_correlation".into(),
                        ),
                        tolerable_stats::pearson(&f32s(&bounds), &f32s(&gains)).unwrap_or(f64::NAN),
                        layers.len(),
                    );
                    r.note = Some("Pearson, across layers, of the mean analytic bound and the mean measured softmax gain at the smallest magnitude".into());
                    out.push(r);
                    let ratio: Vec<f64> = gains.iter().zip(&bounds).map(|(g, b)| g / b).collect();
                    let mut r = mk(
                        &(
                            None,
                            Some(manifold.into()),
                            Some(smallest),
                            "gain_over_bound_max".into(),
                        ),
                        ratio.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                        layers.len(),
                    );
                    r.note = Some("the largest per-layer ratio of the measured mean gain to the mean bound (at most 1 where the bound holds)".into());
                    out.push(r);
                }
            }
        }
    } else {
        let variants: Vec<String> = by
            .keys()
            .filter_map(|k| k.1.clone())
            .filter(|v| v.starts_with("int"))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        let mags: Vec<Option<u64>> = by
            .keys()
            .map(|k| k.2)
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        for v in &variants {
            for &mag in &mags {
                for metric in ["output_error", "query_share"] {
                    if let (Some(q), Some(n)) = (
                        get(None, Some(v), mag, metric),
                        get(None, Some(&format!("noise_{v}")), mag, metric),
                    ) {
                        out.push(mk(
                            &(None, Some(format!("{v}_over_noise")), mag, metric.into()),
                            q / n,
                            1,
                        ));
                    }
                }
            }
        }
    }
    out
}

/// What a run and its dry run both need before any weight loads: the
/// model's header, the layers, the prompt settings and the probes.
struct Setup {
    mcfg: ModelConfig,
    path: std::path::PathBuf,
    layers: Vec<usize>,
    split: SplitOptions,
    probes: Vec<SplitItem>,
    source: String,
}

fn setup(cfg: &MeasureConfig, which: Which, opts: &MeasureOptions) -> Result<Setup> {
    let (mcfg, tk, path) = crate::sweep::header(&cfg.run.model)?;
    let layers = resolve_layers(which.layer_set(), &mcfg)?;
    let split = split_options(&mcfg);
    let (probes, source) = sample_probes(
        which.data(),
        which.probes(),
        cfg.run.seed,
        opts,
        &tk,
        &split,
    )?;
    if probes.len() < which.probes() {
        return Err(cfg_err(format!(
            "[measure] probes: {} asked, {} usable items in {source}",
            which.probes(),
            probes.len()
        )));
    }
    Ok(Setup {
        mcfg,
        path,
        layers,
        split,
        probes,
        source,
    })
}

/// What a conditioning or quantization run would do, without weights.
pub fn dry_run(cfg: &MeasureConfig, which: Which, opts: &MeasureOptions) -> Result<String> {
    let Setup {
        mcfg,
        path,
        layers,
        probes,
        source,
        ..
    } = setup(cfg, which, opts)?;
    let tokens: usize = probes.iter().map(|p| p.full_prompt().len()).sum();
    let g = mcfg.n_heads / mcfg.n_kv_heads;
    let mut s = format!(
        "{} `{}` (config hash {}), model {} ({} layers, {} kv heads, G = {g}, head_dim {}), {}\n{} probes from {source}, {tokens} prompt tokens (one forward pass each)\nlayers {:?}\n",
        which.name(),
        cfg.run.name,
        cfg.hash(),
        cfg.run.model,
        mcfg.n_layers,
        mcfg.n_kv_heads,
        mcfg.head_dim,
        path.display(),
        probes.len(),
        layers
    );
    match which {
        Which::Conditioning(c) => {
            let evals = probes.len()
                * layers.len()
                * mcfg.n_kv_heads
                * c.seeds
                * c.directions
                * 2
                * c.magnitudes.len();
            s.push_str(&format!(
                "{evals} finite differences ({} magnitudes x {} directions x 2 manifolds x {} seeds per probe, layer and kv head); bank: {} keys from {} training passages\n",
                c.magnitudes.len(), c.directions, c.seeds, c.bank.size, c.bank.contexts
            ));
        }
        Which::Quantization(q) => {
            s.push_str(&format!(
                "bits {:?}, fixed norms {:?}, query energy {}, {} noise draws\n",
                q.bits, q.fixed_norms, q.query_energy, q.noise_seeds
            ));
        }
    }
    s.push_str(&format!(
        "estimate: about {:.0} s of forward passes on two cores\n",
        tokens as f64
            / (crate::sweep::PREFILL_TOKENS_PER_S_05B * crate::sweep::speed_relative_to_05b(&mcfg))
    ));
    Ok(s)
}

/// Runs (or resumes) a conditioning or quantization measurement.
pub fn run(
    config_path: &Path,
    cfg: &MeasureConfig,
    which: Which,
    opts: &MeasureOptions,
) -> Result<MeasureOutcome> {
    let dir = super::out_dir(cfg, opts);
    let hash = cfg.hash();
    let rd = RunDir::open(&dir, &hash, &["units"])?;
    let precision: Precision = cfg
        .run
        .precision
        .parse()
        .map_err(|e| cfg_err(format!("[run] precision: {e}")))?;
    if precision != Precision::F32 {
        return Err(cfg_err(format!(
            "[run] precision: `{}`; readout measurements run on the exact f32 path",
            cfg.run.precision
        )));
    }
    let Setup {
        mcfg,
        layers,
        split,
        probes,
        source,
        ..
    } = setup(cfg, which, opts)?;
    let need = (probes.len() * layers.len() * 200 * 128) as u64 + 16 * 1024 * 1024;
    crate::sweep::check_writable_in(&dir, "units", need)?;
    let (ck, gates) = super::load_gated(cfg, precision)?;
    let model = &ck.model;
    // The bank (conditioning): the sweeps' key-bank resource, cached by content hash.
    let mut resources_meta = serde_json::Map::new();
    let bank_value = match which {
        Which::Conditioning(c) => {
            let eval = EvalSet::of(&probes);
            let store = crate::resources::store::Store::new(
                opts.resource_root
                    .clone()
                    .unwrap_or_else(crate::resources::store::Store::default_root),
            );
            let list = vec![("bank".to_string(), ResourceSpec::KeyBank(c.bank.clone()))];
            let (values, info) = crate::sweep::obtain_resources(
                &list,
                &ck,
                &cfg.run.precision,
                &TrainCx {
                    tokenizer: &ck.tokenizer,
                    split: &split,
                    data: &opts.data,
                    eval: &eval,
                    field: "[measure.bank]".into(),
                    receiver: ck.model.config(),
                },
                &BTreeMap::new(),
                &BTreeMap::new(),
                &store,
                None,
            )?;
            resources_meta = crate::sweep::resources_meta(&list, &values, &info);
            values.get("bank").cloned()
        }
        Which::Quantization(_) => None,
    };
    let bank: Option<&KeyBank> = match &bank_value {
        Some(v) => Some(crate::resources::bank::downcast(v, "key bank")?),
        None => None,
    };
    let mut invocations = rd.invocations();
    invocations.push(invocation(
        &tolerable_runtime::matmul_backend(false),
        serde_json::json!({}),
    ));
    let mut meta = super::run_meta(cfg, config_path, &ck, &gates, invocations);
    super::extend_meta(
        &mut meta,
        serde_json::json!({
            "seeds": { "probes": cfg.run.seed },
            "probes": {
                "source": source,
                "ids": probes.iter().map(|p| p.item.id.clone()).collect::<Vec<_>>(),
                "template": "raw",
                "max_prompt_tokens": split.max_prompt_tokens,
            },
            "layers": layers,
            "group_size": mcfg.n_heads / mcfg.n_kv_heads,
            "bound_constant": ((2 * mcfg.n_heads / mcfg.n_kv_heads) as f64).sqrt(),
            "resources": resources_meta,
        }),
    );
    rd.write_meta(&meta)?;
    let todo: Vec<&SplitItem> = probes
        .iter()
        .filter(|p| !rd.unit("units", &p.item.id, "parquet").exists())
        .collect();
    let skipped = probes.len() - todo.len();
    if skipped > 0 {
        tracing::info!(
            "resuming: {skipped} of {} probes already finished in {}",
            probes.len(),
            dir.display()
        );
    }
    let headless = !std::io::stderr().is_terminal();
    let bar = super::progress(
        todo.len(),
        format!("{} {}", which.name(), cfg.run.name),
        "probes",
    );
    let t0 = Instant::now();
    for (i, p) in todo.iter().enumerate() {
        bar.set_message(p.item.id.clone());
        let views = read_probe(model, p, &layers)?;
        let rows = match which {
            Which::Conditioning(c) => conditioning_probe(
                &cfg.run.name,
                &cfg.run.model,
                c,
                p,
                &views,
                bank.ok_or_else(|| DriverError::Records("internal: no key bank".into()))?,
                mcfg.head_dim,
            )?,
            Which::Quantization(q) => {
                quantization_probe(&cfg.run.name, &cfg.run.model, q, p, &views, mcfg.head_dim)?
            }
        };
        write_rows(rows, &rd.unit("units", &p.item.id, "parquet"))?;
        bar.inc(1);
        if headless {
            let rate = (i + 1) as f64 / t0.elapsed().as_secs_f64().max(1e-9);
            tracing::info!(
                "probe {} written: {}/{} this invocation, {rate:.3} probes/s, eta {:.0} s",
                p.item.id,
                i + 1,
                todo.len(),
                (todo.len() - i - 1) as f64 / rate.max(1e-9)
            );
        }
    }
    bar.finish_and_clear();
    let mut all = Vec::new();
    for p in &probes {
        all.extend(read_rows(&rd.unit("units", &p.item.id, "parquet"))?);
    }
    write_rows(
        summarize(&cfg.run.name, &cfg.run.model, which.name(), &all),
        &dir.join("summary.parquet"),
    )?;
    Ok(MeasureOutcome {
        dir,
        units: probes.len(),
        computed: todo.len(),
        skipped,
        summary_written: true,
    })
}
