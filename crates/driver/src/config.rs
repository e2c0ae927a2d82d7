//! Sweep configs: a TOML file with a `[run]` table, a `[data]` table,
//! optional `[resources.<name>]` tables and a list of `[[arms]]`, each
//! optionally with a `grid` that expands it into one arm per grid point.
//! Parsing checks every field; whether an arm can apply to a model is the
//! plan compiler's decision ([`crate::plan::compile`]), before any work.

use crate::arm::{Arm, Base};
use crate::error::{DriverError, Result};
use crate::resources::ResourceSpec;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// The `[run]` table: model, decoding, prompt and seed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunSection {
    /// Run name: the default output folder is `results/<name>`.
    pub name: String,
    /// The receiver: a catalog id, `hf:org/repo`, or a path.
    #[serde(default = "default_model")]
    pub model: String,
    /// `f32` (experiments) or `quantized` (inference speed only).
    #[serde(default = "default_precision")]
    pub precision: String,
    /// Seed of sampling, pairing and perturbations.
    #[serde(default)]
    pub seed: u64,
    /// Greedy tokens per arm and item.
    #[serde(default = "default_new_tokens")]
    pub new_tokens: usize,
    /// Prompt template: `raw` (default) or `chat`.
    #[serde(default = "default_template")]
    pub template: String,
    /// Longest prompt kept, in tokens.
    #[serde(default = "default_max_prompt")]
    pub max_prompt_tokens: usize,
    /// Items per cell: the unit written atomically and resumed.
    #[serde(default = "default_cell_items")]
    pub cell_items: usize,
    /// Single-row products (batch-1 decoding, one position's logits) by the
    /// one-row kernel instead of candle's gemm: faster, with its own float
    /// rounding, so off by default; when on it is part of the config's hash
    /// and run.json's `matmul_backend` says so.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub row_kernel: bool,
    /// Items whose questions and decoding run as one padded batch (every
    /// arm of `item_batch` items of a cell together, caches and questions
    /// padded to one length): fewer, larger decoding batches, with the
    /// padding's own float rounding, so 1 (each item's arms alone, by cache
    /// layout) by default; above 1 it is part of the config's hash.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub item_batch: usize,
    /// Arms that differ only in the bridge their question and decoding read
    /// (a LoRA ladder's rungs, their zero-init gates, the untrained arm
    /// over the same cache) run as one batch, each sequence with its own
    /// adapters: far fewer batch-1 decodes, with a batch's own float
    /// rounding (a gated arm then shares its anchor's batch instead of
    /// decoding alone), so off by default; when on it is part of the
    /// config's hash.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub batch_bridges: bool,
    /// Every arm reads its question and decodes alone (batch 1), never in
    /// one batch with another arm of its item: slower, the reference the
    /// batched ways round against, and the way every decoding step is a
    /// single-row product, which the one-row kernel (`row_kernel`) takes
    /// (arms sharing a batch multiply several rows, which it leaves to
    /// gemm); off by default, and when on part of the config's hash. Not
    /// with `item_batch` above 1 or `batch_bridges`, which batch what it
    /// keeps apart.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub one_at_a_time: bool,
}

pub(crate) fn one() -> usize {
    1
}
pub(crate) fn is_one(n: &usize) -> bool {
    *n == 1
}

fn default_model() -> String {
    "qwen2.5-coder-0.5b-instruct".into()
}
fn default_precision() -> String {
    "f32".into()
}
fn default_new_tokens() -> usize {
    8
}
fn default_template() -> String {
    "raw".into()
}
fn default_max_prompt() -> usize {
    512
}
fn default_cell_items() -> usize {
    10
}

/// Where items come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataSource {
    /// The built-in synthetic fact probe.
    Synthetic,
    /// SQuAD v1.1 dev.
    SquadDev,
    /// SQuAD v1.1 train.
    SquadTrain,
}

impl DataSource {
    /// The name used on the command line (`--data squad_dev=PATH`).
    pub fn name(self) -> &'static str {
        match self {
            DataSource::Synthetic => "synthetic",
            DataSource::SquadDev => "squad_dev",
            DataSource::SquadTrain => "squad_train",
        }
    }
}

/// The `[data]` table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// Which items.
    pub source: DataSource,
    /// A file or folder for SQuAD (else `$TOLERABLE_SQUAD_DIR`, or `hf`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// Items sampled.
    pub n: usize,
}

/// An arm after grid expansion, with where it came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannedArm {
    /// The arm.
    pub arm: Arm,
    /// The name it had before grid expansion.
    pub family: String,
    /// Its grid point: key to value (typed: numbers stay numbers).
    pub point: BTreeMap<String, serde_json::Value>,
    /// Index of its `[[arms]]` entry in the file (`None` for anchors added
    /// by the runner).
    pub index: Option<usize>,
}

/// A parsed and expanded sweep config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepConfig {
    /// The `[run]` table.
    pub run: RunSection,
    /// The `[data]` table.
    pub data: DataSection,
    /// Sweep-level resources by name (`[resources.<name>]`): key banks,
    /// codebooks; fitted on training items and cached by content hash.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub resources: BTreeMap<String, ResourceSpec>,
    /// Every arm, expanded; the anchors `floor` and `native` come first
    /// (added when the file does not name them).
    pub arms: Vec<PlannedArm>,
}

fn cfg_err(msg: impl Into<String>) -> DriverError {
    DriverError::Config(msg.into())
}

/// A TOML table read as `T`; an error names the table and the field in it
/// that is wrong (`[run] row_kernel: invalid type: ...`).
fn table_of<T: serde::de::DeserializeOwned>(v: toml::Value, table: &str) -> Result<T> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let msg = inner.message().to_string();
        if path.is_empty() || path == "." {
            cfg_err(format!("{table}: {msg}"))
        } else {
            cfg_err(format!("{table} {path}: {msg}"))
        }
    })
}

impl SweepConfig {
    /// Reads and expands a config file.
    pub fn from_file(path: &std::path::Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| cfg_err(format!("reading {}: {e}", path.display())))?;
        Self::parse(&text).map_err(|e| match e {
            DriverError::Config(m) => cfg_err(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    /// Parses and expands config text.
    pub fn parse(text: &str) -> Result<Self> {
        let table: toml::Table = toml::from_str(text).map_err(|e| cfg_err(e.to_string()))?;
        for key in table.keys() {
            if !matches!(key.as_str(), "run" | "data" | "resources" | "arms") {
                return Err(cfg_err(format!(
                    "unknown top-level field `{key}` (expected `run`, `data`, `resources`, `arms`)"
                )));
            }
        }
        let get = |k: &str| {
            table
                .get(k)
                .cloned()
                .ok_or_else(|| cfg_err(format!("missing `[{k}]` table")))
        };
        let run: RunSection = table_of(get("run")?, "[run]")?;
        let data: DataSection = table_of(get("data")?, "[data]")?;
        let mut resources = BTreeMap::new();
        match table.get("resources") {
            None => {}
            Some(toml::Value::Table(t)) => {
                for (name, v) in t {
                    for (name, v) in expand_resource(name, v)? {
                        let spec: ResourceSpec = table_of(v, &format!("[resources.{name}]"))?;
                        resources.insert(name, spec);
                    }
                }
            }
            Some(_) => {
                return Err(cfg_err(
                    "`resources` must be a table of `[resources.<name>]` tables",
                ))
            }
        }
        crate::resources::build_order(&resources)?;
        if run.cell_items == 0 {
            return Err(cfg_err("[run]: `cell_items` must be at least 1"));
        }
        if run.item_batch == 0 {
            return Err(cfg_err("[run]: `item_batch` must be at least 1"));
        }
        if run.one_at_a_time && (run.item_batch > 1 || run.batch_bridges) {
            return Err(cfg_err(
                "[run]: `one_at_a_time` decodes every arm alone; it cannot go with `item_batch` above 1 or `batch_bridges`, which batch arms together",
            ));
        }
        if run.new_tokens == 0 {
            return Err(cfg_err("[run]: `new_tokens` must be at least 1"));
        }
        if !matches!(run.template.as_str(), "raw" | "chat") {
            return Err(cfg_err(format!(
                "[run]: `template` is `{}`; expected `raw` or `chat`",
                run.template
            )));
        }
        if !matches!(run.precision.as_str(), "f32" | "quantized") {
            return Err(cfg_err(format!(
                "[run]: `precision` is `{}`; expected `f32` or `quantized`",
                run.precision
            )));
        }
        if data.n == 0 {
            return Err(cfg_err("[data]: `n` must be at least 1"));
        }
        let raw_arms = match table.get("arms") {
            None => Vec::new(),
            Some(toml::Value::Array(a)) => a.clone(),
            Some(_) => return Err(cfg_err("`arms` must be a list of tables (`[[arms]]`)")),
        };
        let mut arms = Vec::new();
        for (i, raw) in raw_arms.into_iter().enumerate() {
            arms.extend(expand_arm(i, raw)?);
        }
        // The anchors are re-measured in every run.
        let has = |arms: &[PlannedArm], base: Base| {
            arms.iter().any(|a| {
                a.arm.is_anchor() && a.arm.base == base && a.arm.name == base_anchor_name(base)
            })
        };
        let mut anchors = Vec::new();
        for base in [Base::Masked, Base::Full] {
            if !has(&arms, base) {
                let arm = if base == Base::Masked {
                    Arm::floor()
                } else {
                    Arm::native()
                };
                if arms.iter().any(|a| a.arm.name == arm.name) {
                    return Err(cfg_err(format!(
                        "arm `{}` must be the bare {} pass (no injection), the anchor the runner measures",
                        arm.name,
                        base.name()
                    )));
                }
                anchors.push(PlannedArm {
                    family: arm.name.clone(),
                    arm,
                    point: BTreeMap::new(),
                    index: None,
                });
            }
        }
        anchors.extend(arms);
        let arms = anchors;
        let mut seen = std::collections::HashSet::new();
        for a in &arms {
            if a.arm.name.is_empty() {
                return Err(cfg_err("an arm has an empty `name`"));
            }
            if !seen.insert(a.arm.name.clone()) {
                return Err(cfg_err(format!("two arms are named `{}`", a.arm.name)));
            }
        }
        let cfg = SweepConfig {
            run,
            data,
            resources,
            arms,
        };
        // Control names must name an arm or a family; which arm at each grid
        // point is resolved by the plan compiler, after the arms' own fields.
        for a in &cfg.arms {
            for c in &a.arm.controls {
                if !cfg.arms.iter().any(|b| &b.arm.name == c || &b.family == c) {
                    return Err(cfg_err(format!(
                        "arm `{}`: control `{c}` names no arm or arm family",
                        a.arm.name
                    )));
                }
            }
        }
        Ok(cfg)
    }

    /// The arms named as `arm`'s controls: an arm of that name, or the
    /// members of that family at the same grid point.
    pub fn controls_of(&self, arm: &PlannedArm) -> Result<Vec<usize>> {
        let mut out = Vec::new();
        for c in &arm.arm.controls {
            if let Some(i) = self.arms.iter().position(|a| &a.arm.name == c) {
                out.push(i);
                continue;
            }
            let fam: Vec<usize> = (0..self.arms.len())
                .filter(|&i| &self.arms[i].family == c)
                .collect();
            if fam.is_empty() {
                return Err(cfg_err(format!(
                    "arm `{}`: control `{c}` names no arm or arm family",
                    arm.arm.name
                )));
            }
            let matching: Vec<usize> = fam
                .iter()
                .copied()
                .filter(|&i| {
                    self.arms[i]
                        .point
                        .iter()
                        .all(|(k, v)| arm.point.get(k).is_none_or(|w| w == v))
                })
                .collect();
            match matching.as_slice() {
                [one] => out.push(*one),
                _ => {
                    return Err(cfg_err(format!(
                        "arm `{}`: control family `{c}` has {} arms at its grid point {:?}; name one arm",
                        arm.arm.name,
                        matching.len(),
                        arm.point
                    )))
                }
            }
        }
        Ok(out)
    }

    /// Index of the anchor arm of `base` (floor or native).
    pub fn anchor(&self, base: Base) -> usize {
        self.arms
            .iter()
            .position(|a| {
                a.arm.is_anchor() && a.arm.base == base && a.arm.name == base_anchor_name(base)
            })
            .expect("anchors are added at parse time")
    }

    /// A hash of everything that determines the records (not the data
    /// path, which differs between machines): cells of runs with equal
    /// hashes are interchangeable.
    pub fn hash(&self) -> String {
        let mut data = self.data.clone();
        data.path = None;
        let canon = serde_json::json!({
            "run": self.run,
            "data": data,
            "resources": self.resources,
            "arms": self.arms,
        });
        crate::resources::files::hex_sha256(canon.to_string().as_bytes())[..16].to_string()
    }
}

fn base_anchor_name(base: Base) -> &'static str {
    match base {
        Base::Masked => "floor",
        Base::Full => "native",
    }
}

/// Expands one `[[arms]]` entry over its grid.
fn expand_arm(i: usize, raw: toml::Value) -> Result<Vec<PlannedArm>> {
    let mut table = match raw {
        toml::Value::Table(t) => t,
        _ => return Err(cfg_err(format!("arms[{i}] is not a table"))),
    };
    let name = table
        .get("name")
        .and_then(|v| v.as_str())
        .map(String::from)
        .ok_or_else(|| cfg_err(format!("arms[{i}]: missing `name`")))?;
    let at = |m: String| cfg_err(format!("arms[{i}] (`{name}`): {m}"));
    // One injection may be written as a table; the grammar holds a list.
    if let Some(t @ toml::Value::Table(_)) = table.get("inject").cloned() {
        table.insert("inject".into(), toml::Value::Array(vec![t]));
    }
    let grid = take_grid(&mut table, &at)?;
    // Grid keys on arm-level fields (the holder, the base, ...) set the arm;
    // every other key sets each injection.
    let arm_level = |k: &str| {
        matches!(
            k.split('.').next().unwrap_or(""),
            "holder" | "bridge" | "base" | "expect" | "seed_as"
        )
    };
    if grid.iter().any(|(k, _)| !arm_level(k))
        && table
            .get("inject")
            .and_then(|v| v.as_array())
            .is_none_or(|a| a.is_empty())
    {
        return Err(at(
            "`grid` varies injection fields, but the arm has no `inject`".into(),
        ));
    }
    let points = grid_points(&grid);
    let mut out = Vec::new();
    for p in points {
        let mut t = toml::Value::Table(table.clone());
        for (k, v) in p.iter().filter(|(k, _)| arm_level(k)) {
            set_dotted(&mut t, k, v.clone()).map_err(|m| at(format!("`grid.{k}`: {m}")))?;
        }
        let toml::Value::Table(mut t) = t else {
            unreachable!("an arm is a table")
        };
        if let Some(toml::Value::Array(injs)) = t.get_mut("inject") {
            for inj in injs.iter_mut() {
                for (k, v) in p.iter().filter(|(k, _)| !arm_level(k)) {
                    set_dotted(inj, k, v.clone()).map_err(|m| at(format!("`grid.{k}`: {m}")))?;
                }
            }
        }
        let point: BTreeMap<String, serde_json::Value> = p
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::to_value(v).unwrap_or_default()))
            .collect();
        if !p.is_empty() {
            t.insert("name".into(), toml::Value::String(point_name(&name, &p)));
        }
        let arm: Arm = toml::Value::Table(t)
            .try_into()
            .map_err(|e: toml::de::Error| at(e.message().to_string()))?;
        out.push(PlannedArm {
            arm,
            family: name.clone(),
            point,
            index: Some(i),
        });
    }
    Ok(out)
}

/// Removes a table's `grid` and returns its keys with their values (none
/// without a grid); `at` names the table in errors.
fn take_grid(
    table: &mut toml::Table,
    at: &dyn Fn(String) -> DriverError,
) -> Result<Vec<(String, Vec<toml::Value>)>> {
    match table.remove("grid") {
        None => Ok(Vec::new()),
        Some(toml::Value::Table(g)) => g
            .into_iter()
            .map(|(k, v)| match v {
                toml::Value::Array(vals) if !vals.is_empty() => Ok((k, vals)),
                _ => Err(at(format!("`grid.{k}` must be a non-empty list of values"))),
            })
            .collect(),
        Some(_) => Err(at("`grid` must be a table of lists".into())),
    }
}

/// The cartesian product of a grid's values, first key slowest.
fn grid_points(grid: &[(String, Vec<toml::Value>)]) -> Vec<Vec<(String, toml::Value)>> {
    let mut points: Vec<Vec<(String, toml::Value)>> = vec![Vec::new()];
    for (k, vals) in grid {
        let mut next = Vec::new();
        for p in &points {
            for v in vals {
                let mut q = p.clone();
                q.push((k.clone(), v.clone()));
                next.push(q);
            }
        }
        points = next;
    }
    points
}

/// The name of a grid point: `name@key=value,...`, keys sorted.
fn point_name(name: &str, point: &[(String, toml::Value)]) -> String {
    let mut named: Vec<(&String, String)> = point.iter().map(|(k, v)| (k, value_text(v))).collect();
    named.sort();
    let suffix: Vec<String> = named.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("{name}@{}", suffix.join(","))
}

/// A `[resources.<name>]` table, or one resource per point of its `grid`
/// (`grid = { seed = [0, 1, 2] }` gives `<name>@seed=0` .. `<name>@seed=2`,
/// named as arm grid points are; arms name them in their own grids).
fn expand_resource(name: &str, v: &toml::Value) -> Result<Vec<(String, toml::Value)>> {
    let at = |m: String| cfg_err(format!("[resources.{name}]: {m}"));
    let mut table = match v {
        toml::Value::Table(t) => t.clone(),
        _ => return Err(at("not a table".into())),
    };
    if !table.contains_key("grid") {
        return Ok(vec![(name.to_string(), v.clone())]);
    }
    let grid = take_grid(&mut table, &at)?;
    let mut out = Vec::new();
    for p in grid_points(&grid) {
        let mut t = toml::Value::Table(table.clone());
        for (k, v) in &p {
            set_dotted(&mut t, k, v.clone()).map_err(|m| at(format!("`grid.{k}`: {m}")))?;
        }
        out.push((point_name(name, &p), t));
    }
    Ok(out)
}

fn value_text(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn set_dotted(
    target: &mut toml::Value,
    key: &str,
    value: toml::Value,
) -> std::result::Result<(), String> {
    let mut cur = target;
    let parts: Vec<&str> = key.split('.').collect();
    for (n, part) in parts.iter().enumerate() {
        let t = cur
            .as_table_mut()
            .ok_or_else(|| format!("`{part}` is inside a value that is not a table"))?;
        if n + 1 == parts.len() {
            t.insert(part.to_string(), value);
            return Ok(());
        }
        cur = t
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    }
    Ok(())
}
