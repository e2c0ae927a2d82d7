//! The key bank (PROTOCOL §5): per layer and kv head, `size` genuine
//! post-RoPE keys the receiver wrote while reading training passages. The
//! same (context, position) tokens are kept in every layer and head, so the
//! bank is the keys of one fixed set of genuine tokens.

use super::{sample_training, BuildCx, ResourceKind, ResourceSpec, TrainCx, Value};
use crate::config::DataSource;
use crate::error::{DriverError, Result};
use candle_core::{Device, Tensor};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;
use tolerable_probe::SplitItem;
use tolerable_runtime::{HookSpec, LogitsAt, ModelConfig};

/// A key bank's parameters (`[resources.<name>] kind = "key_bank"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyBankSpec {
    /// Genuine keys per layer and kv head.
    #[serde(default = "default_size")]
    pub size: usize,
    /// Training passages read (their passage positions are the pool the
    /// bank is sampled from).
    #[serde(default = "default_contexts")]
    pub contexts: usize,
    /// Where the training passages come from: `squad_train` or `synthetic`.
    #[serde(default = "default_data")]
    pub data: DataSource,
    /// Seed of the passage sample and of the key sample.
    #[serde(default)]
    pub seed: u64,
}

fn default_size() -> usize {
    6000
}
fn default_contexts() -> usize {
    64
}
fn default_data() -> DataSource {
    DataSource::SquadTrain
}

/// A built key bank: `keys[layer][kv_head]` is `[size, head_dim]`.
#[derive(Debug, Clone)]
pub struct KeyBank {
    /// Genuine keys by layer and kv head.
    pub keys: Vec<Vec<Tensor>>,
}

impl KeyBank {
    /// The bank of layer `l`, kv head `h`.
    pub fn at(&self, l: usize, h: usize) -> Result<&Tensor> {
        self.keys
            .get(l)
            .and_then(|v| v.get(h))
            .ok_or_else(|| DriverError::Records(format!("key bank has no layer {l} head {h}")))
    }

    /// Keys per layer and head.
    pub fn size(&self) -> usize {
        self.keys
            .first()
            .and_then(|v| v.first())
            .map(|t| t.dims()[0])
            .unwrap_or(0)
    }
}

impl ResourceKind for KeyBankSpec {
    fn kind(&self) -> &'static str {
        "key_bank"
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
        if self.size == 0 {
            return Err(DriverError::Config(format!(
                "{field}: `size` must be at least 1"
            )));
        }
        if self.contexts == 0 {
            return Err(DriverError::Config(format!(
                "{field}: `contexts` must be at least 1"
            )));
        }
        if self.data == DataSource::SquadDev {
            return Err(DriverError::Config(format!(
                "{field}: `data = \"squad_dev\"`: a bank is built from training passages (squad_train or synthetic), never from evaluation items"
            )));
        }
        Ok(())
    }

    fn training_items(&self, cx: &TrainCx) -> Result<Vec<SplitItem>> {
        sample_training(cx, self.data, self.contexts, self.seed)
    }

    fn build(&self, cx: &BuildCx, items: &[SplitItem]) -> Result<Value> {
        let m = cx.model;
        let cfg = m.config();
        let (nl, nkv) = (cfg.n_layers, cfg.n_kv_heads);
        // Pool of passage keys, per layer and head: [rows, head_dim] pieces.
        let mut pool: Vec<Vec<Vec<Tensor>>> = vec![vec![Vec::new(); nkv]; nl];
        let bar = ProgressBar::new(items.len() as u64);
        bar.set_style(
            ProgressStyle::with_template("key bank {bar:30} {pos}/{len} passages eta {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        for it in items {
            let pair = it.pair();
            let ctx = pair.alt_context();
            let mut cache = m.new_cache(1);
            m.forward(
                &m.tokens(std::slice::from_ref(&ctx))?,
                &mut cache,
                &HookSpec::new(),
                LogitsAt::None,
            )?;
            let (lo, n) = (pair.span_start, ctx.len() - pair.span_start);
            for (l, per_head) in pool.iter_mut().enumerate() {
                let k = &cache.require_layer(l)?.k; // [1, nkv, T, hd]
                for (h, rows) in per_head.iter_mut().enumerate() {
                    rows.push(
                        k.narrow(1, h, 1)?
                            .narrow(2, lo, n)?
                            .squeeze(0)?
                            .squeeze(0)?,
                    );
                }
            }
            bar.inc(1);
        }
        bar.finish_and_clear();
        let mut keys = Vec::with_capacity(nl);
        for per_head in pool {
            let mut row = Vec::with_capacity(nkv);
            for rows in per_head {
                let all = Tensor::cat(&rows, 0)?;
                let have = all.dims()[0];
                if self.size > have {
                    return Err(DriverError::Config(format!(
                        "{}: a bank of {} keys is larger than the {have} genuine keys available in {} training passages; raise `contexts` or lower `size`",
                        cx.train.field,
                        self.size,
                        items.len()
                    )));
                }
                row.push(tolerable_carrier::bank::sample_rows(
                    &all, self.size, self.seed,
                )?);
            }
            keys.push(row);
        }
        Ok(Arc::new(KeyBank { keys }))
    }

    fn save(&self, value: &Value, path: &Path) -> Result<()> {
        let bank = downcast::<KeyBank>(value, "key bank")?;
        let mut map: HashMap<String, Tensor> = HashMap::new();
        for (l, per_head) in bank.keys.iter().enumerate() {
            for (h, t) in per_head.iter().enumerate() {
                map.insert(format!("l{l}.h{h}"), t.clone());
            }
        }
        candle_core::safetensors::save(&map, path)?;
        Ok(())
    }

    fn load(&self, path: &Path) -> Result<Value> {
        let map = candle_core::safetensors::load(path, &Device::Cpu)?;
        let nl = (0..)
            .take_while(|l| map.contains_key(&format!("l{l}.h0")))
            .count();
        let mut keys = Vec::with_capacity(nl);
        for l in 0..nl {
            let nh = (0..)
                .take_while(|h| map.contains_key(&format!("l{l}.h{h}")))
                .count();
            keys.push(
                (0..nh)
                    .map(|h| map[&format!("l{l}.h{h}")].clone())
                    .collect(),
            );
        }
        Ok(Arc::new(KeyBank { keys }))
    }

    fn check(&self, value: &Value, cfg: &ModelConfig) -> Result<()> {
        let bank = downcast::<KeyBank>(value, "key bank")?;
        let bad = |m: String| Err(DriverError::Records(format!("key bank: {m}")));
        if bank.keys.len() != cfg.n_layers {
            return bad(format!(
                "{} layers, the receiver has {}",
                bank.keys.len(),
                cfg.n_layers
            ));
        }
        for (l, heads) in bank.keys.iter().enumerate() {
            if heads.len() != cfg.n_kv_heads {
                return bad(format!(
                    "layer {l} has {} kv heads, the receiver {}",
                    heads.len(),
                    cfg.n_kv_heads
                ));
            }
            for t in heads {
                if t.dims() != [self.size, cfg.head_dim] {
                    return bad(format!(
                        "layer {l} holds {:?}, expected [{}, {}]",
                        t.dims(),
                        self.size,
                        cfg.head_dim
                    ));
                }
            }
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!(
            "key_bank size={} contexts={} data={} seed={}",
            self.size,
            self.contexts,
            self.data.name(),
            self.seed
        )
    }

    fn estimate_tokens(&self) -> usize {
        // About 200 tokens a training context.
        self.contexts * 200
    }
}

/// The value of a resource as its concrete type.
pub fn downcast<'a, T: 'static>(value: &'a Value, what: &str) -> Result<&'a T> {
    value
        .downcast_ref::<T>()
        .ok_or_else(|| DriverError::Records(format!("internal: resource is not a {what}")))
}
