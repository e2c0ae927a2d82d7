//! Codebooks fitted on a key bank (PROTOCOL §5): per layer and kv head, a
//! k-means, PCA or random-subset codebook of the bank's genuine keys.
//! Snapping a key to it (nearest entry by L2 or cosine, or projection onto
//! its span) is a transform; see `transforms`.

use super::bank::{downcast, KeyBank};
use super::{BuildCx, ResourceKind, ResourceSpec, TrainCx, Value};
use crate::error::{DriverError, Result};
use candle_core::{Device, Tensor};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;
use tolerable_carrier::codebook::{Codebook, Construction};
use tolerable_probe::SplitItem;
use tolerable_runtime::ModelConfig;

/// A codebook's parameters (`[resources.<name>] kind = "codebook"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CodebookSpec {
    /// The key bank (`[resources.<bank>]`) it is fitted on.
    pub bank: String,
    /// k-means centroids, principal components, or a random subset of the bank.
    pub construction: Construction,
    /// Entries (k-means, random subset) or components (PCA).
    pub size: usize,
    /// Seed of k-means initialisation and of the random subset.
    #[serde(default)]
    pub seed: u64,
}

/// Built codebooks: `books[layer][kv_head]`.
#[derive(Debug, Clone)]
pub struct CodebookSet {
    /// Codebooks by layer and kv head.
    pub books: Vec<Vec<Codebook>>,
}

impl CodebookSet {
    /// The codebook of layer `l`, kv head `h`.
    pub fn at(&self, l: usize, h: usize) -> Result<&Codebook> {
        self.books
            .get(l)
            .and_then(|v| v.get(h))
            .ok_or_else(|| DriverError::Records(format!("codebook has no layer {l} head {h}")))
    }
}

impl ResourceKind for CodebookSpec {
    fn kind(&self) -> &'static str {
        "codebook"
    }

    fn version(&self) -> u32 {
        1
    }

    fn deps(&self) -> Vec<String> {
        vec![self.bank.clone()]
    }

    fn validate(
        &self,
        field: &str,
        cfg: &ModelConfig,
        all: &BTreeMap<String, ResourceSpec>,
    ) -> Result<()> {
        let bank = match all.get(&self.bank) {
            Some(ResourceSpec::KeyBank(b)) => b,
            Some(_) => {
                return Err(DriverError::Config(format!(
                    "{field}: `bank = \"{}\"` is not a key bank",
                    self.bank
                )))
            }
            None => {
                return Err(DriverError::Config(format!(
                    "{field}: `bank = \"{}\"` names no declared resource",
                    self.bank
                )))
            }
        };
        // L2 snapping adds no condition: the size checks alone (the plan
        // checks each arm's snapping rule).
        tolerable_carrier::codebook::validate(
            self.construction,
            self.size,
            bank.size,
            cfg.head_dim,
            tolerable_carrier::Snapping::L2,
        )
        .map_err(|e| DriverError::Config(format!("{field}: {e}")))?;
        Ok(())
    }

    fn training_items(&self, _cx: &TrainCx) -> Result<Vec<SplitItem>> {
        // Fitted on its bank, whose hash covers the bank's items.
        Ok(Vec::new())
    }

    fn build(&self, cx: &BuildCx, _items: &[SplitItem]) -> Result<Value> {
        let bank = cx.deps.get(&self.bank).ok_or_else(|| {
            DriverError::Config(format!(
                "{}: its bank `{}` was not built first",
                cx.train.field, self.bank
            ))
        })?;
        let bank = downcast::<KeyBank>(bank, "key bank")?;
        let total: usize = bank.keys.iter().map(|v| v.len()).sum();
        let bar = ProgressBar::new(total as u64);
        bar.set_style(
            ProgressStyle::with_template(&format!(
                "codebook {} {{bar:30}} {{pos}}/{{len}} layer-heads eta {{eta}}",
                self.construction.name()
            ))
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        let mut books = Vec::with_capacity(bank.keys.len());
        for per_head in &bank.keys {
            let mut row = Vec::with_capacity(per_head.len());
            for keys in per_head {
                row.push(Codebook::fit(
                    self.construction,
                    keys,
                    self.size,
                    self.seed,
                )?);
                bar.inc(1);
            }
            books.push(row);
        }
        bar.finish_and_clear();
        Ok(Arc::new(CodebookSet { books }))
    }

    fn save(&self, value: &Value, path: &Path) -> Result<()> {
        let set = downcast::<CodebookSet>(value, "codebook")?;
        let mut map: HashMap<String, Tensor> = HashMap::new();
        for (l, per_head) in set.books.iter().enumerate() {
            for (h, b) in per_head.iter().enumerate() {
                map.insert(format!("l{l}.h{h}.entries"), b.entries().clone());
                map.insert(format!("l{l}.h{h}.mean"), b.mean().clone());
                map.insert(format!("l{l}.h{h}.basis"), b.basis().clone());
            }
        }
        candle_core::safetensors::save(&map, path)?;
        Ok(())
    }

    fn load(&self, path: &Path) -> Result<Value> {
        let map = candle_core::safetensors::load(path, &Device::Cpu)?;
        let key = |l: usize, h: usize, part: &str| format!("l{l}.h{h}.{part}");
        let nl = (0..)
            .take_while(|&l| map.contains_key(&key(l, 0, "entries")))
            .count();
        let mut books = Vec::with_capacity(nl);
        for l in 0..nl {
            let nh = (0..)
                .take_while(|&h| map.contains_key(&key(l, h, "entries")))
                .count();
            let mut row = Vec::with_capacity(nh);
            for h in 0..nh {
                let get = |part: &str| {
                    map.get(&key(l, h, part)).cloned().ok_or_else(|| {
                        DriverError::Records(format!(
                            "{}: no tensor {}",
                            path.display(),
                            key(l, h, part)
                        ))
                    })
                };
                row.push(Codebook::from_parts(
                    self.construction,
                    get("entries")?,
                    get("mean")?,
                    get("basis")?,
                )?);
            }
            books.push(row);
        }
        Ok(Arc::new(CodebookSet { books }))
    }

    fn check(&self, value: &Value, cfg: &ModelConfig) -> Result<()> {
        let set = downcast::<CodebookSet>(value, "codebook")?;
        let ok = set.books.len() == cfg.n_layers
            && set.books.iter().all(|h| {
                h.len() == cfg.n_kv_heads
                    && h.iter()
                        .all(|b| b.dim() == cfg.head_dim && b.construction() == self.construction)
            });
        if !ok {
            return Err(DriverError::Records(format!(
                "codebook: its layout does not match the receiver ({} layers x {} kv heads x {} dims, {})",
                cfg.n_layers,
                cfg.n_kv_heads,
                cfg.head_dim,
                self.construction.name()
            )));
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!(
            "codebook {} size={} on bank `{}` seed={}",
            self.construction.name(),
            self.size,
            self.bank,
            self.seed
        )
    }
}
