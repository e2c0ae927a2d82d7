//! Resources: sweep-level state fitted on training items (never on
//! evaluation items) and shared by every item of a run — the key bank,
//! codebooks fitted on it, key pairs and the maps fitted on them (fitted
//! substitutes), and later projections, pools and trained bridges.
//!
//! Each resource is declared in the config (`[resources.<name>]`), has a
//! content hash over its spec, the receiver's sha256, the ids of the
//! training items it reads and the hashes of the resources it is fitted on,
//! and is cached on disk outside the run directory (see [`store`]). A cached
//! file is used only when its recorded hash, model and file checksum all
//! match; anything else is rebuilt. The hash goes into `run.json` and into
//! every item row that used the resource.

pub mod bank;
pub mod bridge;
pub mod codebook;
pub mod cross;
pub mod files;
pub mod fitted;
pub(crate) mod kept;
pub mod optim;
pub mod progress;
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
pub use bridge::{BridgeSpec, BridgeValue, TrainArm};
pub use codebook::{CodebookSet, CodebookSpec};
pub use cross::{CrossProjection, CrossProjectionSpec, ProjectionFit};
pub use fitted::{FitMethod, FittedMap, FittedMapSpec, KeyPairs, KeyPairsSpec};

/// A resource as the config declares it: its kind and parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ResourceSpec {
    /// Genuine post-RoPE keys of the receiver on training contexts, per
    /// layer and kv head.
    KeyBank(KeyBankSpec),
    /// A codebook per layer and kv head, fitted on a key bank.
    Codebook(CodebookSpec),
    /// Sender-side keys beside the receiver's genuine keys on training
    /// passages: the rows fitted maps are fitted on.
    KeyPairs(KeyPairsSpec),
    /// A map from a sender-side key to the receiver's (fitted substitutes).
    FittedMap(FittedMapSpec),
    /// Low-rank adapters on the receiver's attention projections, trained
    /// under an arm (PROTOCOL §7).
    Bridge(BridgeSpec),
    /// A frozen per-layer projection of a cross-family holder's states into
    /// the receiver's space (PROTOCOL §6, cross-family).
    CrossProjection(CrossProjectionSpec),
}

impl ResourceSpec {
    /// The kind's behaviour.
    pub fn kind(&self) -> &dyn ResourceKind {
        match self {
            ResourceSpec::KeyBank(s) => s,
            ResourceSpec::Codebook(s) => s,
            ResourceSpec::KeyPairs(s) => s,
            ResourceSpec::FittedMap(s) => s,
            ResourceSpec::Bridge(s) => s,
            ResourceSpec::CrossProjection(s) => s,
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
    /// The config table of the resource (`[resources.<name>]`), for errors.
    pub field: String,
    /// The receiver's geometry (a projection's rank depends on it).
    pub receiver: &'a tolerable_runtime::ModelConfig,
}

/// What building a resource may read: its training context, the receiver,
/// the held-out senders of the plan (built and gated first), and the
/// resources it depends on (built first).
pub struct BuildCx<'a> {
    /// Training items and settings.
    pub train: TrainCx<'a>,
    /// The receiver.
    pub model: &'a Model,
    /// Held-out senders of the plan by key (`requantize=Q4_0`).
    pub senders: &'a BTreeMap<String, Model>,
    /// Built dependencies by resource name.
    pub deps: &'a BTreeMap<String, Value>,
    /// Cross-family holders of the plan by model id, loaded.
    pub holders: &'a BTreeMap<String, crate::cross::CrossHolder>,
    /// Work shared by the resources built in one invocation (the training
    /// caches of bridges trained under the same arm on the same items; the
    /// normal equations of cross-family projections from the same holder
    /// on the same passages).
    pub scratch: &'a Scratch,
    /// Where a resource that trains over epochs keeps its progress so that
    /// a build cut short resumes there (a bridge's last finished epoch);
    /// `None` keeps none.
    pub progress: Option<PathBuf>,
    /// Where the work this resource shares with its group
    /// ([`ResourceKind::shared_work`]) is kept on disk as it is computed,
    /// so that a build cut short reads it back instead of computing it
    /// again (a bridge's training examples, `resources/kept.rs`); `None` keeps it in
    /// memory only.
    pub shared_dir: Option<PathBuf>,
    /// Where a build resumed, from its progress file (set by the build;
    /// read by the sweep for `run.json`): its build seconds then count
    /// only the last invocation's part.
    pub resumed_after: std::sync::OnceLock<ResumedAt>,
}

/// Where a training cut short resumed: after `epoch` finished epochs and
/// `steps` steps of the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResumedAt {
    /// Epochs finished before the resume.
    pub epoch: usize,
    /// Steps of the next epoch taken before the resume (0 at an epoch's
    /// end).
    pub steps: usize,
}

impl ResumedAt {
    /// Where a build resumed, read back from a record's two fields (the
    /// epoch, and the steps of the next, absent in records written before
    /// steps inside an epoch were saved: the resume was at the epoch's
    /// end); none where the record has no epoch.
    pub fn from_record(epoch: Option<usize>, steps: Option<usize>) -> Option<Self> {
        epoch.map(|epoch| ResumedAt {
            epoch,
            steps: steps.unwrap_or(0),
        })
    }
}

impl std::fmt::Display for ResumedAt {
    /// "epoch 2", or "epoch 1 and 3 steps of the next".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "epoch {}", self.epoch)?;
        if self.steps > 0 {
            write!(f, " and {} steps of the next", self.steps)?;
        }
        Ok(())
    }
}

impl BuildCx<'_> {
    /// Records where the build resumed (when it did).
    pub fn note_resumed(&self, at: Option<ResumedAt>) {
        if let Some(at) = at {
            let _ = self.resumed_after.set(at);
        }
    }
}

/// Work shared between resource builds of one invocation: values by key
/// within groups, a group being what [`ResourceKind::shared_work`] names
/// (a bridge's training caches); the sweep drops a group once the last
/// resource that shares it is built.
#[derive(Default)]
pub struct Scratch(
    std::sync::Mutex<std::collections::HashMap<String, std::collections::HashMap<String, Value>>>,
);

impl Scratch {
    /// The value under `key` in `group`, computed by `make` the first time.
    pub fn get_or_make(
        &self,
        group: &str,
        key: &str,
        make: impl FnOnce() -> Result<Value>,
    ) -> Result<Value> {
        if let Some(v) = self
            .0
            .lock()
            .expect("scratch lock")
            .get(group)
            .and_then(|g| g.get(key))
        {
            return Ok(v.clone());
        }
        let v = make()?;
        self.0
            .lock()
            .expect("scratch lock")
            .entry(group.to_string())
            .or_default()
            .insert(key.to_string(), v.clone());
        Ok(v)
    }

    /// Drops the work of `group`; how many values it held.
    pub fn release(&self, group: &str) -> usize {
        self.0
            .lock()
            .expect("scratch lock")
            .remove(group)
            .map_or(0, |g| g.len())
    }

    /// Values held, over every group.
    pub fn len(&self) -> usize {
        self.0
            .lock()
            .expect("scratch lock")
            .values()
            .map(|g| g.len())
            .sum()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The evaluation items a resource must not be fitted on.
#[derive(Debug, Clone, Default)]
pub struct EvalSet {
    /// Item ids.
    pub ids: HashSet<String>,
    /// Passages (so a training item that reuses an evaluation passage is caught too).
    pub passages: HashSet<String>,
    /// Gold answers, normalised (for answer-disjoint training sets).
    pub answers: HashSet<String>,
}

impl EvalSet {
    /// The evaluation set of `items`.
    pub fn of(items: &[SplitItem]) -> Self {
        Self {
            ids: items.iter().map(|i| i.item.id.clone()).collect(),
            passages: items.iter().map(|i| i.item.context.clone()).collect(),
            answers: items
                .iter()
                .flat_map(|i| {
                    i.item
                        .answers
                        .iter()
                        .map(|a| tolerable_probe::score::normalize(a))
                })
                .collect(),
        }
    }

    /// Whether a gold answer of `item` is an evaluation answer (normalised
    /// as SQuAD scores): what an answer-disjoint training set excludes.
    pub fn shares_gold(&self, item: &tolerable_probe::QaItem) -> bool {
        item.answers
            .iter()
            .any(|a| self.answers.contains(&tolerable_probe::score::normalize(a)))
    }

    /// A test of whether a text mentions an evaluation answer as whole
    /// words, both normalised as SQuAD scores.
    fn mention_test(&self) -> impl Fn(&str) -> bool + '_ {
        let answers: Vec<String> = self
            .answers
            .iter()
            .filter(|a| !a.is_empty())
            .map(|a| format!(" {a} "))
            .collect();
        move |text: &str| {
            let t = format!(" {} ", tolerable_probe::score::normalize(text));
            answers.iter().any(|a| t.contains(a.as_str()))
        }
    }

    /// A test of whether an evaluation answer appears anywhere in an item:
    /// as its gold answer, or as whole words of its passage or question
    /// (what the strict answer-disjoint split, `answer_free`, excludes).
    /// Built once, then applied to every candidate item.
    pub fn reach_test(&self) -> impl Fn(&tolerable_probe::QaItem) -> bool + '_ {
        let mentions = self.mention_test();
        move |item| self.shares_gold(item) || mentions(&item.context) || mentions(&item.question)
    }

    /// How the evaluation answers reach `items` (a resource's training
    /// items): whose gold answer is one (what an answer-disjoint set
    /// excludes), and whose passage or question mentions one as whole
    /// words (what an answer-free set also excludes), all normalised as
    /// SQuAD scores.
    pub fn answer_mentions(&self, items: &[SplitItem]) -> AnswerMentions {
        let mentions = self.mention_test();
        AnswerMentions {
            items: items.len(),
            gold: items.iter().filter(|i| self.shares_gold(&i.item)).count(),
            passages: items.iter().filter(|i| mentions(&i.item.context)).count(),
            questions: items.iter().filter(|i| mentions(&i.item.question)).count(),
        }
    }
}

/// Counts of a resource's training items that an evaluation answer
/// reaches (see [`EvalSet::answer_mentions`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct AnswerMentions {
    /// Training items.
    pub items: usize,
    /// Items whose gold answer is an evaluation answer.
    pub gold: usize,
    /// Items whose passage mentions an evaluation answer.
    pub passages: usize,
    /// Items whose question mentions an evaluation answer.
    pub questions: usize,
}

/// The behaviour of one resource kind: what it depends on, what it is
/// fitted on, how it is built, saved and loaded.
pub trait ResourceKind {
    /// Kind name (`key_bank`, `codebook`).
    fn kind(&self) -> &'static str;
    /// Version of how this kind is built and saved: part of the content
    /// hash, so a change to the construction never reuses old files.
    fn version(&self) -> u32;
    /// Names of the resources it is fitted on.
    fn deps(&self) -> Vec<String> {
        Vec::new()
    }
    /// Models other than the receiver it reads (cross-family holders, by
    /// id): loaded before it is built, their sha256 in its content hash.
    fn holders(&self) -> Vec<String> {
        Vec::new()
    }
    /// The work it shares with other resources built in the same
    /// invocation, as a group name (a bridge's training caches: one per
    /// training arm and item list), or none. The sweep builds the
    /// resources of one group one after another and drops the group's
    /// work after the last of them, so an invocation holds one group's
    /// caches at a time.
    fn shared_work(&self, _items: &[SplitItem]) -> Option<String> {
        None
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
    /// Checks a value (built or loaded) against the receiver's geometry and
    /// the spec; a loaded value that fails is rebuilt.
    fn check(&self, value: &Value, cfg: &tolerable_runtime::ModelConfig) -> Result<()>;
    /// A one-line description for plans and logs.
    fn describe(&self) -> String;
    /// Forward tokens building it costs, roughly (for plan estimates).
    fn estimate_tokens(&self) -> usize {
        0
    }
    /// What `run.json` records about a built value beyond its hash (a
    /// bridge's training curve); null for most kinds.
    fn summary(&self, _value: &Value) -> serde_json::Value {
        serde_json::Value::Null
    }
    /// Values it reports about its fitting, as (epoch, metric, value), for
    /// the run's `resources.parquet` (a bridge's training curve); none for
    /// most kinds.
    fn report_rows(&self, _value: &Value) -> Vec<(Option<i64>, String, f64)> {
        Vec::new()
    }
}

/// What a resource's value depends on besides its spec.
#[derive(Debug, Clone)]
pub struct HashInputs<'a> {
    /// sha256 of the receiver's weights (as verified on load).
    pub model_sha256: &'a str,
    /// The precision the receiver runs in.
    pub precision: &'a str,
    /// How training contexts are built (template, length cap, filler).
    pub split: &'a SplitOptions,
    /// The training items, whose ids and context token ids are hashed.
    pub items: &'a [SplitItem],
    /// The content hashes of the resources it is fitted on.
    pub deps: &'a BTreeMap<String, String>,
}

/// What every resource fitted on training rows checks: at least one
/// training item, none from the evaluation split (`what` says what is
/// fitted, for the message).
pub(crate) fn check_training(
    field: &str,
    train_items: usize,
    data: DataSource,
    what: &str,
) -> Result<()> {
    if train_items == 0 {
        return Err(DriverError::Config(format!(
            "{field}.train_items: at least 1 training item is needed"
        )));
    }
    if data == DataSource::SquadDev {
        return Err(DriverError::Config(format!(
            "{field}.data: `squad_dev`: {what} fitted on training items (squad_train or synthetic), never on the evaluation split"
        )));
    }
    Ok(())
}

/// The positions a resource takes training rows from: `fact_region`,
/// `passage` or `all`.
pub(crate) fn check_row_positions(
    field: &str,
    positions: &tolerable_carrier::Positions,
) -> Result<()> {
    use tolerable_carrier::Positions;
    if !matches!(
        positions,
        Positions::FactRegion | Positions::Passage | Positions::All
    ) {
        return Err(DriverError::Config(format!(
            "{field}.positions: `{}`: training rows come from `fact_region`, `passage` or `all`",
            positions.name()
        )));
    }
    Ok(())
}

/// The content hash of a resource (16 hex digits): its kind's build
/// version, its spec, the receiver's sha256 and precision, the prompt
/// settings, the training items (ids and the token ids of their contexts)
/// and its dependencies' hashes. Anything that changes the value changes it.
pub fn content_hash(spec: &ResourceSpec, inputs: &HashInputs) -> String {
    let mut tokens = Sha256::new();
    for it in inputs.items {
        for t in it.pair().alt_context() {
            tokens.update(t.to_le_bytes());
        }
        tokens.update(u32::MAX.to_le_bytes());
    }
    let tokens = files::hex(&tokens.finalize());
    let canon = serde_json::json!({
        "kind_version": spec.kind().version(),
        "spec": spec,
        "model_sha256": inputs.model_sha256,
        "precision": inputs.precision,
        "split": inputs.split,
        "items": inputs.items.iter().map(|i| i.item.id.as_str()).collect::<Vec<_>>(),
        "context_tokens_sha256": tokens,
        "deps": inputs.deps,
    });
    files::hex_sha256(canon.to_string().as_bytes())[..16].to_string()
}

/// A resource of a plan with its training items and content hash.
#[derive(Debug, Clone)]
pub struct Hashed {
    /// Its name.
    pub name: String,
    /// Its spec.
    pub spec: ResourceSpec,
    /// The training items it is fitted on.
    pub items: Vec<SplitItem>,
    /// Its content hash.
    pub hash: String,
}

/// The training items and content hash of every resource of `resources`
/// (in build order; a dependency's hash goes into its dependants').
/// Chooses training items with the tokenizer only: no model runs.
/// `holder_sha256` gives the sha256 of each holder model a resource reads
/// (by id); it enters that resource's hash beside its dependencies'.
pub fn hash_all(
    resources: &[(String, ResourceSpec)],
    train: &TrainCx,
    model_sha256: &str,
    precision: &str,
    holder_sha256: &BTreeMap<String, String>,
) -> Result<Vec<Hashed>> {
    let mut out: Vec<Hashed> = Vec::new();
    for (name, spec) in resources {
        let kind = spec.kind();
        let cx = TrainCx {
            field: format!("[resources.{name}]"),
            ..*train
        };
        let items = kind.training_items(&cx)?;
        let mut deps: BTreeMap<String, String> = kind
            .deps()
            .into_iter()
            .map(|d| {
                let h = out
                    .iter()
                    .find(|o| o.name == d)
                    .map(|o| o.hash.clone())
                    .unwrap_or_default();
                (d, h)
            })
            .collect();
        for id in kind.holders() {
            let sha = holder_sha256.get(&id).cloned().ok_or_else(|| {
                DriverError::Config(format!(
                    "[resources.{name}]: the sha256 of holder `{id}` is not known"
                ))
            })?;
            deps.insert(format!("holder:{id}"), sha);
        }
        let hash = content_hash(
            spec,
            &HashInputs {
                model_sha256,
                precision,
                split: train.split,
                items: &items,
                deps: &deps,
            },
        );
        out.push(Hashed {
            name: name.clone(),
            spec: spec.clone(),
            items,
            hash,
        });
    }
    Ok(out)
}

/// The order to build resources in: the given (dependency) order, except
/// that a resource of a shared-work group (`groups[i]`) that depends on no
/// other resource (`has_deps[i]` false) is built right after the first
/// resource of its group, so a group's shared work is computed once and
/// can be dropped before the next group's. Positions into the given order.
pub fn grouped_order(groups: &[Option<String>], has_deps: &[bool]) -> Vec<usize> {
    let n = groups.len();
    let mut placed = vec![false; n];
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        if placed[i] {
            continue;
        }
        placed[i] = true;
        out.push(i);
        if let Some(g) = &groups[i] {
            for j in i + 1..n {
                if !placed[j] && !has_deps[j] && groups[j].as_ref() == Some(g) {
                    placed[j] = true;
                    out.push(j);
                }
            }
        }
    }
    out
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
) -> Result<Vec<SplitItem>> {
    sample_training_where(cx, source, n, seed, &|_| true)
}

/// As [`sample_training`], keeping only the raw items `keep` accepts (an
/// answer-disjoint training set keeps those that share no normalised gold
/// answer with the evaluation items).
pub fn sample_training_where(
    cx: &TrainCx,
    source: DataSource,
    n: usize,
    seed: u64,
    keep: &dyn Fn(&tolerable_probe::QaItem) -> bool,
) -> Result<Vec<SplitItem>> {
    let field = cx.field.as_str();
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
        .filter(|it| keep(it))
        .filter(|it| seen.insert(it.context.clone()))
        .collect();
    let sample = tolerable_probe::sample::sample(&distinct, cx.tokenizer, cx.split, n, seed)
        .map_err(|e| DriverError::Config(format!("{field}: training items: {e}")))?;
    Ok(sample.items)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tolerable_probe::{QaItem, Template};

    /// Resources of one shared-work group are built one after another
    /// (each dependency-free member joins its group's first), the others
    /// keep their places, and a resource with dependencies is not moved
    /// ahead of them.
    #[test]
    fn a_group_is_built_together_and_dependants_keep_their_place() {
        let g = |s: &str| Some(s.to_string());
        // Four groups a-d, their members interleaved (resources in name
        // order).
        let groups = [
            g("a"),
            g("b"),
            g("c"),
            g("d"),
            g("a"),
            g("b"),
            g("c"),
            g("d"),
        ];
        assert_eq!(
            grouped_order(&groups, &[false; 8]),
            vec![0, 4, 1, 5, 2, 6, 3, 7]
        );
        // A bank without a group stays between; a dependant of it (a
        // codebook in group a) is not pulled ahead of it.
        let groups = [g("a"), None, g("a"), g("a")];
        assert_eq!(
            grouped_order(&groups, &[false, false, true, false]),
            vec![0, 3, 1, 2]
        );
        assert_eq!(grouped_order(&[], &[]), Vec::<usize>::new());
    }

    /// Bridges share their training caches where they train under the
    /// same arm from the same sample (seed), whatever they adapt and
    /// whichever split of it (the answer-disjoint split keeps most of the
    /// plain split's items in place); another seed or another arm is
    /// another group.
    #[test]
    fn bridges_share_work_by_arm_and_sample() {
        let spec = |extra: &str, source: &str| -> bridge::BridgeSpec {
            toml::from_str(&format!(
                "{extra}\narm = {{ inject = [{{ carrier = \"kv\", positions = \"passage\", source = \"{source}\", mechanism = \"append\" }}] }}"
            ))
            .unwrap()
        };
        let a = [item("x", vec![1, 2]), item("y", vec![3])];
        let b = [item("x", vec![1, 2]), item("z", vec![3])];
        let q = spec("targets = \"q\"\nseed = 1", "holder").shared_work(&a);
        assert!(q.is_some());
        assert_eq!(
            q,
            spec(
                "targets = \"kv\"\nseed = 1\nanswer_disjoint = true",
                "holder"
            )
            .shared_work(&b)
        );
        assert_ne!(
            q,
            spec("targets = \"q\"\nseed = 2", "holder").shared_work(&a)
        );
        assert_ne!(
            q,
            spec("targets = \"q\"\nseed = 1", "native").shared_work(&a)
        );
    }

    /// Scratch work is kept by group and dropped by group.
    #[test]
    fn scratch_work_is_dropped_by_group() {
        let s = Scratch::default();
        let calls = std::cell::Cell::new(0);
        let make = || -> Result<Value> {
            calls.set(calls.get() + 1);
            Ok(Arc::new(calls.get()))
        };
        s.get_or_make("a", "k1", make).unwrap();
        s.get_or_make("a", "k1", make).unwrap();
        s.get_or_make("a", "k2", make).unwrap();
        s.get_or_make("b", "k1", make).unwrap();
        assert_eq!((calls.get(), s.len()), (3, 3));
        assert_eq!(s.release("a"), 2);
        assert_eq!(s.release("a"), 0);
        assert_eq!(s.len(), 1);
        // Made again after its group was dropped.
        s.get_or_make("a", "k1", make).unwrap();
        assert_eq!(calls.get(), 4);
    }

    fn item(id: &str, passage: Vec<u32>) -> SplitItem {
        SplitItem {
            item: QaItem {
                id: id.into(),
                title: "t".into(),
                context: "c".into(),
                question: "q".into(),
                answers: vec!["a".into()],
            },
            prefix_ids: vec![1, 2],
            full_passage: passage.clone(),
            masked_passage: passage.iter().map(|_| 9).collect(),
            suffix_ids: vec![3],
            fact_region: vec![0],
            n_answer_spans: 1,
        }
    }

    #[test]
    fn the_content_hash_changes_with_everything_the_value_depends_on() {
        let spec = ResourceSpec::KeyBank(KeyBankSpec {
            size: 10,
            contexts: 2,
            data: DataSource::SquadTrain,
            seed: 0,
        });
        let split = SplitOptions::default();
        let items = vec![item("a", vec![5, 6]), item("b", vec![7])];
        let deps = BTreeMap::new();
        let inputs = HashInputs {
            model_sha256: "m",
            precision: "f32",
            split: &split,
            items: &items,
            deps: &deps,
        };
        let h = content_hash(&spec, &inputs);
        assert_eq!(h, content_hash(&spec, &inputs));
        let chat = SplitOptions {
            template: Template::Chat,
            ..SplitOptions::default()
        };
        let other_tokens = vec![item("a", vec![5, 8]), item("b", vec![7])];
        let other_spec = ResourceSpec::KeyBank(KeyBankSpec {
            size: 11,
            contexts: 2,
            data: DataSource::SquadTrain,
            seed: 0,
        });
        let dep = BTreeMap::from([("x".to_string(), "h".to_string())]);
        for changed in [
            content_hash(&other_spec, &inputs),
            content_hash(
                &spec,
                &HashInputs {
                    model_sha256: "n",
                    ..inputs.clone()
                },
            ),
            content_hash(
                &spec,
                &HashInputs {
                    precision: "quantized",
                    ..inputs.clone()
                },
            ),
            content_hash(
                &spec,
                &HashInputs {
                    split: &chat,
                    ..inputs.clone()
                },
            ),
            content_hash(
                &spec,
                &HashInputs {
                    items: &other_tokens,
                    ..inputs.clone()
                },
            ),
            content_hash(
                &spec,
                &HashInputs {
                    items: &items[..1],
                    ..inputs.clone()
                },
            ),
            content_hash(
                &spec,
                &HashInputs {
                    deps: &dep,
                    ..inputs.clone()
                },
            ),
        ] {
            assert_ne!(changed, h);
        }
    }

    /// A record's resume reads back as written; a record from before steps
    /// inside an epoch were saved resumed at the epoch's end; a record
    /// without an epoch did not resume.
    #[test]
    fn a_recorded_resume_reads_back() {
        let at = ResumedAt::from_record(Some(1), Some(139)).unwrap();
        assert_eq!((at.epoch, at.steps), (1, 139));
        assert_eq!(at.to_string(), "epoch 1 and 139 steps of the next");
        let old = ResumedAt::from_record(Some(2), None).unwrap();
        assert_eq!((old.epoch, old.steps), (2, 0));
        assert_eq!(old.to_string(), "epoch 2");
        assert_eq!(ResumedAt::from_record(None, Some(3)), None);
        assert_eq!(ResumedAt::from_record(None, None), None);
    }
}
