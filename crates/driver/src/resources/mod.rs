//! Resources: sweep-level state fitted on training items (never on
//! evaluation items) and shared by every item of a run — the key bank,
//! codebooks fitted on it, and later projections, pools and trained bridges.
//!
//! Each resource is declared in the config (`[resources.<name>]`), has a
//! content hash over its spec, the receiver's sha256, the ids of the
//! training items it reads and the hashes of the resources it is fitted on,
//! and is cached on disk outside the run directory (see [`store`]). A cached
//! file is used only when its recorded hash, model and file checksum all
//! match; anything else is rebuilt. The hash goes into `run.json` and into
//! every item row that used the resource.

pub mod bank;
pub mod codebook;
pub mod store;

use crate::config::DataSource;
use crate::error::{DriverError, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::any::Any;
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tolerable_probe::{SplitItem, SplitOptions};
use tolerable_runtime::{Model, Tokenizer};

pub use bank::{KeyBank, KeyBankSpec};
pub use codebook::{CodebookSet, CodebookSpec};

/// A resource as the config declares it: its kind and parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ResourceSpec {
    /// Genuine post-RoPE keys of the receiver on training contexts, per
    /// layer and kv head.
    KeyBank(KeyBankSpec),
    /// A codebook per layer and kv head, fitted on a key bank.
    Codebook(CodebookSpec),
}

impl ResourceSpec {
    /// The kind's behaviour.
    pub fn kind(&self) -> &dyn ResourceKind {
        match self {
            ResourceSpec::KeyBank(s) => s,
            ResourceSpec::Codebook(s) => s,
        }
    }
}

/// A built resource value, shared by every arm and item that uses it.
pub type Value = Arc<dyn Any + Send + Sync>;

/// What choosing a resource's training items reads: the tokenizer, the
/// run's prompt settings, data paths, and the evaluation items it must
/// never be fitted on. No model runs here (a dry run uses it too).
pub struct TrainCx<'a> {
    /// The receiver's tokenizer.
    pub tokenizer: &'a Tokenizer,
    /// How training contexts are built (the run's template and length cap).
    pub split: &'a SplitOptions,
    /// Data paths by source name (`squad_train`), else `$TOLERABLE_SQUAD_DIR`.
    pub data: &'a BTreeMap<String, PathBuf>,
    /// Ids and passages of the run's evaluation items.
    pub eval: &'a EvalSet,
}

/// What building a resource may read: its training context, the receiver,
/// and the resources it depends on (built first).
pub struct BuildCx<'a> {
    /// Training items and settings.
    pub train: TrainCx<'a>,
    /// The receiver.
    pub model: &'a Model,
    /// Built dependencies by resource name.
    pub deps: &'a BTreeMap<String, Value>,
}

/// The evaluation items a resource must not be fitted on.
#[derive(Debug, Clone, Default)]
pub struct EvalSet {
    /// Item ids.
    pub ids: HashSet<String>,
    /// Passages (so a training item that reuses an evaluation passage is caught too).
    pub passages: HashSet<String>,
}

/// The behaviour of one resource kind: what it depends on, what it is
/// fitted on, how it is built, saved and loaded.
pub trait ResourceKind {
    /// Kind name (`key_bank`, `codebook`).
    fn kind(&self) -> &'static str;
    /// Names of the resources it is fitted on.
    fn deps(&self) -> Vec<String> {
        Vec::new()
    }
    /// Checks the spec against the receiver's geometry and the other
    /// declared resources; `field` names the config table.
    fn validate(
        &self,
        field: &str,
        cfg: &tolerable_runtime::ModelConfig,
        all: &BTreeMap<String, ResourceSpec>,
    ) -> Result<()>;
    /// The training items it reads (ids, in order), for its content hash.
    fn training_items(&self, cx: &TrainCx) -> Result<Vec<SplitItem>>;
    /// Fits the resource.
    fn build(&self, cx: &BuildCx, items: &[SplitItem]) -> Result<Value>;
    /// Writes a built value to `path` (safetensors).
    fn save(&self, value: &Value, path: &Path) -> Result<()>;
    /// Reads a value written by `save`.
    fn load(&self, path: &Path) -> Result<Value>;
    /// A one-line description for plans and logs.
    fn describe(&self) -> String;
    /// Forward tokens building it costs, roughly (for plan estimates).
    fn estimate_tokens(&self) -> usize {
        0
    }
}

/// The content hash of a resource: its spec, the receiver's sha256, the
/// training item ids and its dependencies' hashes (16 hex digits).
pub fn content_hash(
    spec: &ResourceSpec,
    model_sha256: &str,
    item_ids: &[String],
    dep_hashes: &BTreeMap<String, String>,
) -> String {
    let canon = serde_json::json!({
        "spec": spec,
        "model_sha256": model_sha256,
        "items": item_ids,
        "deps": dep_hashes,
    });
    let mut h = Sha256::new();
    h.update(canon.to_string().as_bytes());
    h.finalize()
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The resources of a run in dependency order (a resource after those it is
/// fitted on); an unknown dependency or a cycle is a config error.
pub fn build_order(all: &BTreeMap<String, ResourceSpec>) -> Result<Vec<String>> {
    let mut order: Vec<String> = Vec::new();
    let mut visiting: Vec<String> = Vec::new();
    fn visit(
        name: &str,
        all: &BTreeMap<String, ResourceSpec>,
        order: &mut Vec<String>,
        visiting: &mut Vec<String>,
    ) -> Result<()> {
        if order.iter().any(|n| n == name) {
            return Ok(());
        }
        if visiting.iter().any(|n| n == name) {
            return Err(DriverError::Config(format!(
                "[resources]: `{name}` depends on itself ({} -> {name})",
                visiting.join(" -> ")
            )));
        }
        let spec = all.get(name).ok_or_else(|| {
            DriverError::Config(format!(
                "[resources.{}]: depends on `{name}`, which is not declared",
                visiting.last().cloned().unwrap_or_default()
            ))
        })?;
        visiting.push(name.to_string());
        for d in spec.kind().deps() {
            visit(&d, all, order, visiting)?;
        }
        visiting.pop();
        order.push(name.to_string());
        Ok(())
    }
    for name in all.keys() {
        visit(name, all, &mut order, &mut visiting)?;
    }
    Ok(order)
}

/// Training items for a resource: `n` split items with distinct passages,
/// sampled with `seed` from `source` (SQuAD train, or synthetic items of a
/// seed no evaluation run uses), none of them an evaluation item or passage.
pub fn sample_training(
    cx: &TrainCx,
    source: DataSource,
    n: usize,
    seed: u64,
    field: &str,
) -> Result<Vec<SplitItem>> {
    let raw = match source {
        DataSource::SquadTrain => {
            let path = tolerable_probe::squad::resolve_path(
                cx.data.get("squad_train").map(|p| p.as_path()),
                tolerable_probe::squad::Split::Train,
            )?;
            tolerable_probe::squad::load(&path)?
        }
        // Synthetic training items come from a seed stream of their own:
        // their ids (`syn-<seed>-<k>`) cannot collide with an evaluation run's.
        DataSource::Synthetic => {
            tolerable_probe::synthetic::generate(n * 4, seed ^ 0x7EA1_0000_0000_0000)
        }
        DataSource::SquadDev => {
            return Err(DriverError::Config(format!(
                "{field}: `data = \"squad_dev\"`: resources are fitted on training items (squad_train or synthetic), never on the evaluation split"
            )))
        }
    };
    // One item per passage: the bank wants distinct contexts.
    let mut seen = HashSet::new();
    let distinct: Vec<_> = raw
        .into_iter()
        .filter(|it| !cx.eval.ids.contains(&it.id) && !cx.eval.passages.contains(&it.context))
        .filter(|it| seen.insert(it.context.clone()))
        .collect();
    let sample = tolerable_probe::sample::sample(&distinct, cx.tokenizer, cx.split, n, seed)
        .map_err(|e| DriverError::Config(format!("{field}: training items: {e}")))?;
    Ok(sample.items)
}
