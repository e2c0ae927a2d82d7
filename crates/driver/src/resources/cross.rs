//! Cross-family projections (`[resources.<name>] kind = "cross_projection"`,
//! PROTOCOL §6): a frozen per-layer linear map from a holder model's states
//! to the receiver's, fitted on training passages that both read. For each
//! receiver layer `l` and holder layer `m = depth_map(l)` three affine maps
//! are fitted by least squares (ridge, optionally truncated by SVD to a
//! rank): `resid_pre` (holder width → receiver width), pre-RoPE keys and
//! values (the holder's kv heads concatenated → the receiver's). Rows are
//! the receiver's positions of each passage, each beside the holder's state
//! at the holder token aligned to it by character offsets (see
//! [`crate::cross`] for the alignment, the depth map and why keys are mapped
//! before RoPE). The holder may be the receiver itself (the identity sanity
//! arm: a projection fitted to itself).

use super::bank::downcast;
use super::{sample_training, BuildCx, ResourceKind, ResourceSpec, TrainCx, Value};
use crate::config::DataSource;
use crate::cross::{depth_map, read_aligned, read_rows};
use crate::error::{DriverError, Result};
use candle_core::{Device, Tensor};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::Arc;
use tolerable_carrier::fit::{AffineMap, NormalEquations};
use tolerable_carrier::Positions;
use tolerable_probe::SplitItem;
use tolerable_runtime::{ModelConfig, RopeStyle};

fn forty() -> usize {
    40
}
fn squad_train() -> DataSource {
    DataSource::SquadTrain
}
fn passage() -> Positions {
    Positions::Passage
}

/// How a cross-family projection is fitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProjectionFit {
    /// Ridge least squares, full rank.
    LeastSquares,
    /// The least-squares map truncated to its `rank` largest singular values.
    Svd,
}

impl ProjectionFit {
    /// Name in configs and records.
    pub fn name(self) -> &'static str {
        match self {
            ProjectionFit::LeastSquares => "least_squares",
            ProjectionFit::Svd => "svd",
        }
    }
}

/// A cross-family projection as the config declares it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CrossProjectionSpec {
    /// The holder model (catalog id or path) whose states are projected;
    /// the receiver's own id fits the identity sanity projection.
    pub holder: String,
    /// The fit: `least_squares` or `svd`.
    pub fit: ProjectionFit,
    /// Rank the `svd` fit keeps (required there; no `least_squares` rank).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<usize>,
    /// Ridge penalty relative to the input's scale (default 1e-3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ridge: Option<f64>,
    /// Training passages read (distinct, never evaluation items).
    #[serde(default = "forty")]
    pub train_items: usize,
    /// Where they come from: `squad_train` or `synthetic`.
    #[serde(default = "squad_train")]
    pub data: DataSource,
    /// Which receiver positions of each passage give rows: `passage`
    /// (default), `fact_region` or `all`.
    #[serde(default = "passage")]
    pub positions: Positions,
    /// Seed of the passage sample.
    #[serde(default)]
    pub seed: u64,
}

impl CrossProjectionSpec {
    fn ridge(&self) -> f64 {
        self.ridge.unwrap_or(1e-3)
    }

    /// The rank of the projection given the holder's and the receiver's
    /// geometry: the largest rank of its maps (`min(d_in, d_out)`, capped
    /// by `rank` for `svd`). Fitting needs at least this many rows.
    pub fn map_rank(&self, holder: &ModelConfig, receiver: &ModelConfig) -> usize {
        let h = holder.d_model.min(receiver.d_model);
        let kv = (holder.n_kv_heads * holder.head_dim).min(receiver.n_kv_heads * receiver.head_dim);
        let full = h.max(kv);
        match self.rank {
            Some(r) => r.min(full),
            None => full,
        }
    }

    /// The holder layer each receiver layer reads.
    pub fn depth(holder: &ModelConfig, receiver: &ModelConfig) -> Vec<usize> {
        (0..receiver.n_layers)
            .map(|l| depth_map(l, receiver.n_layers, holder.n_layers))
            .collect()
    }
}

/// A fitted cross-family projection: per receiver layer, the holder layer
/// it reads and three affine maps (rows in, rows out).
#[derive(Debug, Clone)]
pub struct CrossProjection {
    /// The holder layer receiver layer `l` reads.
    pub depth: Vec<usize>,
    /// `resid_pre`: `[d_holder, d_receiver]` maps.
    pub h: Vec<AffineMap>,
    /// Pre-RoPE keys, kv heads concatenated.
    pub k: Vec<AffineMap>,
    /// Values, kv heads concatenated.
    pub v: Vec<AffineMap>,
    /// The receiver's RoPE (base, pairing), applied to mapped keys.
    pub rope: (f64, RopeStyle),
    /// Training rows per map.
    pub rows: usize,
    /// Variance of the receiver's states explained on the training rows
    /// (R²) per layer, for `h`, `k` and `v`.
    pub explained: [Vec<f64>; 3],
}

fn style_code(s: RopeStyle) -> u32 {
    match s {
        RopeStyle::Half => 0,
        RopeStyle::Interleaved => 1,
    }
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

const PARTS: [&str; 3] = ["h", "k", "v"];

/// The normal equations of every receiver layer's three maps (`resid_pre`,
/// pre-RoPE keys, values) over `items`: each passage read once by the
/// receiver and once by `holder`, rows at `positions`.
fn normal_equations(
    cx: &BuildCx,
    holder: &crate::cross::CrossHolder,
    depth: &[usize],
    positions: &Positions,
    items: &[SplitItem],
) -> Result<Vec<[NormalEquations; 3]>> {
    let r = cx.model.config();
    let hc = holder.model.config();
    let all_r: BTreeSet<usize> = (0..r.n_layers).collect();
    let all_h: BTreeSet<usize> = depth.iter().copied().collect();
    let (dh, dr) = (hc.d_model, r.d_model);
    let (kh, kr) = (hc.n_kv_heads * hc.head_dim, r.n_kv_heads * r.head_dim);
    let mut eq: Vec<[NormalEquations; 3]> = (0..r.n_layers)
        .map(|_| {
            [
                NormalEquations::new(dh, dr),
                NormalEquations::new(kh, kr),
                NormalEquations::new(kh, kr),
            ]
        })
        .collect();
    let bar = ProgressBar::new(items.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("cross projection {bar:30} {pos}/{len} passages eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    for it in items {
        bar.inc(1);
        let pair = it.pair();
        let ids = pair.alt_context();
        let pos = crate::passes::alt_sites(*positions, &pair);
        if pos.is_empty() {
            continue;
        }
        let idx = Tensor::from_vec(
            pos.iter().map(|&p| p as u32).collect::<Vec<_>>(),
            pos.len(),
            &Device::Cpu,
        )?;
        let target = read_rows(cx.model, &ids, &all_r, &all_r, None)?;
        let (_, input) = read_aligned(holder, cx.train.tokenizer, &ids, &all_h, &all_h)?;
        for (l, eqs) in eq.iter_mut().enumerate() {
            let m = depth[l];
            let pairs = [
                (&input.resid[&m], &target.resid[&l]),
                (&input.k[&m], &target.k[&l]),
                (&input.v[&m], &target.v[&l]),
            ];
            for (e, (x, y)) in eqs.iter_mut().zip(pairs) {
                e.add(&x.index_select(&idx, 0)?, &y.index_select(&idx, 0)?)?;
            }
        }
    }
    bar.finish_and_clear();
    Ok(eq)
}

impl ResourceKind for CrossProjectionSpec {
    fn kind(&self) -> &'static str {
        "cross_projection"
    }

    fn version(&self) -> u32 {
        1
    }

    /// The normal equations: projections from the same holder on the same
    /// passages and positions share them, whatever their fit.
    fn shared_work(&self, items: &[SplitItem]) -> Option<String> {
        let ids: Vec<&str> = items.iter().map(|it| it.item.id.as_str()).collect();
        Some(format!(
            "cross normal equations {} {} {ids:?}",
            self.holder,
            self.positions.name()
        ))
    }

    fn holders(&self) -> Vec<String> {
        vec![self.holder.clone()]
    }

    fn validate(
        &self,
        field: &str,
        _cfg: &ModelConfig,
        _all: &BTreeMap<String, ResourceSpec>,
    ) -> Result<()> {
        match (self.fit, self.rank) {
            (ProjectionFit::Svd, None) => {
                return Err(DriverError::Config(format!(
                    "{field}.rank: `fit = \"svd\"` keeps a rank; name it (`rank = 64`)"
                )))
            }
            (ProjectionFit::Svd, Some(0)) => {
                return Err(DriverError::Config(format!(
                    "{field}.rank: rank 0 keeps nothing"
                )))
            }
            (ProjectionFit::LeastSquares, Some(_)) => {
                return Err(DriverError::Config(format!(
                    "{field}.rank: `fit = \"least_squares\"` is full rank; a rank is a parameter of `fit = \"svd\"`"
                )))
            }
            _ => {}
        }
        if let Some(r) = self.ridge {
            if !(r >= 0.0 && r.is_finite()) {
                return Err(DriverError::Config(format!(
                    "{field}.ridge: {r} is not a finite non-negative number"
                )));
            }
        }
        super::check_training(field, self.train_items, self.data, "projections are")?;
        super::check_row_positions(field, &self.positions)?;
        Ok(())
    }

    fn training_items(&self, cx: &TrainCx) -> Result<Vec<SplitItem>> {
        let items = sample_training(cx, self.data, self.train_items, self.seed)?;
        // Fewer rows than the map's rank leave it underdetermined: refused
        // here, before any model loads or evaluation item runs.
        let holder = crate::sweep::model_config_of(&self.holder).map_err(|e| {
            DriverError::Config(format!("{}.holder: `{}`: {e}", cx.field, self.holder))
        })?;
        let rank = self.map_rank(&holder, cx.receiver);
        let rows: usize = items
            .iter()
            .map(|it| crate::passes::alt_sites(self.positions, &it.pair()).len())
            .sum();
        if rows < rank {
            return Err(DriverError::Config(format!(
                "{}.train_items: the projection from `{}` has rank {rank}, but its {} training items give {rows} rows at `{}`: fewer rows than its rank leave the fit underdetermined; raise `train_items`{}",
                cx.field,
                self.holder,
                items.len(),
                self.positions.name(),
                if self.fit == ProjectionFit::Svd { " or lower `rank`" } else { " or use `fit = \"svd\"` with a lower `rank`" }
            )));
        }
        Ok(items)
    }

    fn build(&self, cx: &BuildCx, items: &[SplitItem]) -> Result<Value> {
        let holder = cx.holders.get(&self.holder).ok_or_else(|| {
            DriverError::Config(format!(
                "{}.holder: the holder `{}` was not loaded before the resource",
                cx.train.field, self.holder
            ))
        })?;
        let r = cx.model.config().clone();
        let hc = holder.model.config().clone();
        let depth = Self::depth(&hc, &r);
        // The fit's sufficient statistics depend on the holder, the
        // passages and the positions only: projections that differ in
        // their fit (`svd` and its rank, the ridge) share them within an
        // invocation, so the receiver and the holder read each passage once.
        let ids: Vec<&str> = items.iter().map(|it| it.item.id.as_str()).collect();
        let key = format!(
            "cross normal equations {} {} {} {ids:?}",
            self.holder,
            holder.sha256,
            self.positions.name()
        );
        let group = self.shared_work(items).unwrap_or_default();
        let shared = cx.scratch.get_or_make(&group, &key, || {
            Ok(Arc::new(normal_equations(
                cx,
                holder,
                &depth,
                &self.positions,
                items,
            )?))
        })?;
        let eq: &Vec<[NormalEquations; 3]> = downcast(&shared, "cross normal equations")?;
        let rows = eq.first().map(|e| e[0].rows()).unwrap_or(0);
        let rank = self.map_rank(&hc, &r);
        if rows < rank {
            return Err(DriverError::Config(format!(
                "{}.train_items: {rows} training rows for a projection of rank {rank}",
                cx.train.field
            )));
        }
        let mut maps: [Vec<AffineMap>; 3] = Default::default();
        let mut explained: [Vec<f64>; 3] = Default::default();
        for eqs in eq {
            for (c, e) in eqs.iter().enumerate() {
                let map = e.solve(self.ridge(), self.rank)?;
                explained[c].push(e.explained(&map)?);
                maps[c].push(map);
            }
        }
        tracing::info!(
            "{}: holder `{}` ({} layers, width {}) into the receiver ({} layers, width {}) on {rows} rows: mean R² h {:.4}, k {:.4}, v {:.4}",
            cx.train.field,
            self.holder,
            hc.n_layers,
            hc.d_model,
            r.n_layers,
            r.d_model,
            mean(&explained[0]),
            mean(&explained[1]),
            mean(&explained[2])
        );
        let [h, k, v] = maps;
        Ok(Arc::new(CrossProjection {
            depth,
            h,
            k,
            v,
            rope: (r.rope_theta, r.rope_style),
            rows,
            explained,
        }))
    }

    fn save(&self, value: &Value, path: &Path) -> Result<()> {
        let p = downcast::<CrossProjection>(value, "cross projection")?;
        let mut map: HashMap<String, Tensor> = HashMap::new();
        for (c, maps) in [&p.h, &p.k, &p.v].into_iter().enumerate() {
            for (l, m) in maps.iter().enumerate() {
                map.insert(format!("{}.l{l}.weight", PARTS[c]), m.weight.clone());
                map.insert(format!("{}.l{l}.bias", PARTS[c]), m.bias.clone());
            }
            map.insert(
                format!("{}.explained", PARTS[c]),
                Tensor::from_vec(p.explained[c].clone(), p.explained[c].len(), &Device::Cpu)?,
            );
        }
        let depth: Vec<u32> = p.depth.iter().map(|&d| d as u32).collect();
        map.insert(
            "depth".into(),
            Tensor::from_vec(depth, p.depth.len(), &Device::Cpu)?,
        );
        map.insert(
            "rope_theta".into(),
            Tensor::from_vec(vec![p.rope.0], 1, &Device::Cpu)?,
        );
        map.insert(
            "rope_style".into(),
            Tensor::from_vec(vec![style_code(p.rope.1)], 1, &Device::Cpu)?,
        );
        map.insert(
            "rows".into(),
            Tensor::from_vec(vec![p.rows as u32], 1, &Device::Cpu)?,
        );
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
        let depth: Vec<usize> = get("depth")?
            .to_vec1::<u32>()?
            .into_iter()
            .map(|d| d as usize)
            .collect();
        let mut maps: [Vec<AffineMap>; 3] = Default::default();
        let mut explained: [Vec<f64>; 3] = Default::default();
        for c in 0..3 {
            for l in 0..depth.len() {
                maps[c].push(AffineMap {
                    weight: get(&format!("{}.l{l}.weight", PARTS[c]))?,
                    bias: get(&format!("{}.l{l}.bias", PARTS[c]))?,
                });
            }
            explained[c] = get(&format!("{}.explained", PARTS[c]))?.to_vec1()?;
        }
        let theta = get("rope_theta")?.to_vec1::<f64>()?[0];
        let style = match get("rope_style")?.to_vec1::<u32>()?[0] {
            0 => RopeStyle::Half,
            _ => RopeStyle::Interleaved,
        };
        let rows = get("rows")?.to_vec1::<u32>()?[0] as usize;
        let [h, k, v] = maps;
        Ok(Arc::new(CrossProjection {
            depth,
            h,
            k,
            v,
            rope: (theta, style),
            rows,
            explained,
        }))
    }

    fn check(&self, value: &Value, cfg: &ModelConfig) -> Result<()> {
        let p = downcast::<CrossProjection>(value, "cross projection")?;
        let kv = cfg.n_kv_heads * cfg.head_dim;
        let nl = cfg.n_layers;
        let ok = p.depth.len() == nl
            && p.rope == (cfg.rope_theta, cfg.rope_style)
            && [&p.h, &p.k, &p.v].iter().all(|m| m.len() == nl)
            && p.h.iter().all(|m| m.d_out() == cfg.d_model)
            && p.k.iter().chain(&p.v).all(|m| m.d_out() == kv);
        if !ok {
            return Err(DriverError::Records(format!(
                "cross projection: its layout does not match the receiver ({nl} layers, width {}, {} kv heads x {})",
                cfg.d_model, cfg.n_kv_heads, cfg.head_dim
            )));
        }
        Ok(())
    }

    fn describe(&self) -> String {
        let rank = match self.rank {
            Some(r) => format!(" rank={r}"),
            None => String::new(),
        };
        format!(
            "cross_projection from `{}` ({}{rank} ridge={}), {} train items ({}) at {}, seed={}",
            self.holder,
            self.fit.name(),
            self.ridge(),
            self.train_items,
            self.data.name(),
            self.positions.name(),
            self.seed
        )
    }

    fn estimate_tokens(&self) -> usize {
        // About 200 tokens a training context, read by receiver and holder.
        self.train_items * 200 * 2
    }
}
