//! Measurement runs: measurements that are not arms (PROTOCOL.md §10, last
//! line), recorded to Parquet with the same provenance as sweeps.
//!
//! A measurement config is a TOML file with a `[run]` table and a
//! `[measure]` table (instead of `[data]` and `[[arms]]`); `kind` names the
//! measurement: `mode_d` ([`mode_d`]: activation-delta caching for code
//! edits, measured against prefix KV reuse), `conditioning` and
//! `quantization` ([`attention`]: how attention reads a displaced key slot,
//! paper 1 appendix E).
//!
//! ```toml
//! [run]
//! name = "mode-d-0.5b"
//! model = "qwen2.5-coder-0.5b-instruct"   # catalog id, hf:org/repo or a path
//! precision = "f32"                       # f32 or quantized
//! seed = 0                                # the edits' site picks
//!
//! [measure]
//! kind = "mode_d"
//! taus = [0.05, 0.1, 0.2]                 # dirtiness thresholds, each in (0, inf)
//! layers = "all"                          # injection layers (LayerSet syntax)
//! contexts = "builtin"                    # the probe's corpus, or a folder of code files
//! # select = ["py_bank.py", "rs_stack.rs"] # only these contexts (file names)
//! # archetypes = ["rename_identifier"]    # only these archetypes (default all seven)
//! min_downstream = 8                      # fewer common-suffix tokens: the pair is skipped
//! timing_reps = 1                         # timed calls repeated, the fastest kept
//! ```
//!
//! The shared machinery here is the run folder: the config is validated
//! (errors name the field) and its pairs built before the model loads, the
//! model is loaded through [`tolerable_fetch::load`] (sha256 verified), the
//! runtime gates run first and nothing is written if one fails, `run.json`
//! carries the config, its hash, the model's id, sha256, path, precision and
//! geometry, the git revision, the skips and every invocation; each unit
//! (a context) is written atomically and a rerun skips finished units. It
//! also holds what any measurement of the forward pass needs: the analytic
//! FLOP count ([`FlopModel`]), next-token comparisons against a reference
//! ([`LogitReference`]) and per-position relative L2 ([`relative_l2_rows`]).

pub mod attention;
mod attention_report;
pub mod mode_d;
pub mod report;

use crate::error::{io, DriverError, Result};
use crate::records::{self, columns, MeasureRow};
use candle_core::{Tensor, D};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub use attention::{ConditioningSpec, QuantizationSpec};
pub use mode_d::ModeDSpec;

/// The `[run]` table of a measurement config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeasureRunSection {
    /// Run name: the default output folder is `results/<name>`.
    pub name: String,
    /// The model: a catalog id, `hf:org/repo`, or a path.
    #[serde(default = "default_model")]
    pub model: String,
    /// `f32` (default) or `quantized`.
    #[serde(default = "default_precision")]
    pub precision: String,
    /// Seed of the measurement's random choices (Mode D: the edits' sites).
    #[serde(default)]
    pub seed: u64,
}

fn default_model() -> String {
    "qwen2.5-coder-0.5b-instruct".into()
}
fn default_precision() -> String {
    "f32".into()
}

/// What a `[measure]` table asks for, by `kind`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum MeasureSpec {
    /// Mode D: activation-delta caching for code edits ([`mode_d`]).
    ModeD(ModeDSpec),
    /// Readout gains of a key slot, on and off the manifold, with their
    /// analytic bound ([`attention`]).
    Conditioning(ConditioningSpec),
    /// Integer round trips of the cache against matched-norm noise
    /// ([`attention`]).
    Quantization(QuantizationSpec),
}

impl MeasureSpec {
    /// The kind's name (`mode_d`).
    pub fn kind(&self) -> &'static str {
        match self {
            MeasureSpec::ModeD(_) => "mode_d",
            MeasureSpec::Conditioning(_) => "conditioning",
            MeasureSpec::Quantization(_) => "quantization",
        }
    }
}

/// A parsed measurement config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MeasureConfig {
    /// The `[run]` table.
    pub run: MeasureRunSection,
    /// The `[measure]` table.
    pub measure: MeasureSpec,
}

fn cfg_err(msg: impl Into<String>) -> DriverError {
    DriverError::Config(msg.into())
}

/// Whether the TOML file at `path` is a measurement config (it has a
/// `[measure]` table) rather than a sweep config.
pub fn is_measure_config(path: &Path) -> Result<bool> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| cfg_err(format!("reading {}: {e}", path.display())))?;
    let table: toml::Table =
        toml::from_str(&text).map_err(|e| cfg_err(format!("{}: {e}", path.display())))?;
    Ok(table.contains_key("measure"))
}

impl MeasureConfig {
    /// Reads and checks a config file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| cfg_err(format!("reading {}: {e}", path.display())))?;
        Self::parse(&text).map_err(|e| match e {
            DriverError::Config(m) => cfg_err(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    /// Parses and checks config text: every field that can be checked
    /// without the model (the injection layers are checked against the
    /// model's geometry, the contexts against its tokenizer, before the
    /// weights load).
    pub fn parse(text: &str) -> Result<Self> {
        let table: toml::Table = toml::from_str(text).map_err(|e| cfg_err(e.to_string()))?;
        for key in table.keys() {
            if !matches!(key.as_str(), "run" | "measure") {
                return Err(cfg_err(format!(
                    "unknown top-level field `{key}` in a measurement config (expected `run`, `measure`; `data` and `arms` belong to sweeps)"
                )));
            }
        }
        let run: MeasureRunSection = table
            .get("run")
            .cloned()
            .ok_or_else(|| cfg_err("missing `[run]` table"))?
            .try_into()
            .map_err(|e: toml::de::Error| cfg_err(format!("[run]: {}", e.message())))?;
        if run.name.trim().is_empty() {
            return Err(cfg_err("[run] name: empty"));
        }
        if !matches!(run.precision.as_str(), "f32" | "quantized") {
            return Err(cfg_err(format!(
                "[run] precision: `{}`; expected `f32` or `quantized`",
                run.precision
            )));
        }
        let mut m = match table.get("measure") {
            Some(toml::Value::Table(t)) => t.clone(),
            Some(_) => return Err(cfg_err("`measure` must be a table (`[measure]`)")),
            None => return Err(cfg_err("missing `[measure]` table")),
        };
        let kind = match m.remove("kind") {
            Some(toml::Value::String(k)) => k,
            Some(other) => {
                return Err(cfg_err(format!(
                    "[measure] kind: {other} is not a string; expected \"mode_d\", \"conditioning\" or \"quantization\""
                )))
            }
            None => return Err(cfg_err("[measure] kind: missing; expected \"mode_d\", \"conditioning\" or \"quantization\"")),
        };
        let measure = match kind.as_str() {
            "mode_d" => {
                let spec: ModeDSpec = toml::Value::Table(m)
                    .try_into()
                    .map_err(|e: toml::de::Error| cfg_err(format!("[measure]: {}", e.message())))?;
                spec.check()?;
                MeasureSpec::ModeD(spec)
            }
            "conditioning" => {
                let spec: ConditioningSpec = toml::Value::Table(m)
                    .try_into()
                    .map_err(|e: toml::de::Error| cfg_err(format!("[measure]: {}", e.message())))?;
                spec.check()?;
                MeasureSpec::Conditioning(spec)
            }
            "quantization" => {
                let spec: QuantizationSpec = toml::Value::Table(m)
                    .try_into()
                    .map_err(|e: toml::de::Error| cfg_err(format!("[measure]: {}", e.message())))?;
                spec.check()?;
                MeasureSpec::Quantization(spec)
            }
            other => {
                return Err(cfg_err(format!(
                    "[measure] kind: `{other}` is not a measurement (expected \"mode_d\")"
                )))
            }
        };
        Ok(Self { run, measure })
    }

    /// A hash of everything that determines the records: unit files of runs
    /// with equal hashes are interchangeable.
    pub fn hash(&self) -> String {
        let canon = serde_json::json!({ "run": self.run, "measure": self.measure });
        crate::resources::files::hex_sha256(canon.to_string().as_bytes())[..16].to_string()
    }
}

/// Options of one measurement invocation.
#[derive(Debug, Clone, Default)]
pub struct MeasureOptions {
    /// Output folder (default `results/<run.name>`).
    pub out: Option<PathBuf>,
    /// Only these contexts (file names): replaces `[measure] select` (and
    /// so changes the config hash: a restricted run needs its own folder).
    pub contexts: Option<Vec<String>>,
    /// Injection layers (`LayerSet` syntax): replaces `[measure] layers`
    /// (the config hash changes too).
    pub layers: Option<String>,
    /// Data paths by source name (`squad_dev`, `squad_train`), else
    /// `$TOLERABLE_SQUAD_DIR` (conditioning and quantization probes, banks).
    pub data: BTreeMap<String, PathBuf>,
    /// Where fitted resources are cached (default the resource store's root).
    pub resource_root: Option<PathBuf>,
}

/// What a measurement invocation did.
#[derive(Debug, Clone)]
pub struct MeasureOutcome {
    /// The run folder.
    pub dir: PathBuf,
    /// Units (contexts) of the run.
    pub units: usize,
    /// Units this invocation computed (both phases).
    pub computed: usize,
    /// Units found finished.
    pub skipped: usize,
    /// Whether `summary.parquet` was written (every unit finished).
    pub summary_written: bool,
}

/// Loads a config and applies the command line's overrides.
pub fn load_config(path: &Path, opts: &MeasureOptions) -> Result<MeasureConfig> {
    let mut cfg = MeasureConfig::from_file(path)?;
    if let Some(names) = &opts.contexts {
        if names.is_empty() {
            return Err(cfg_err("--contexts: an empty list"));
        }
        match &mut cfg.measure {
            MeasureSpec::ModeD(s) => s.select = Some(names.clone()),
            other => {
                return Err(cfg_err(format!(
                    "--contexts: a `{}` measurement reads SQuAD probes, not code contexts",
                    other.kind()
                )))
            }
        }
    }
    if let Some(layers) = &opts.layers {
        let set: tolerable_carrier::LayerSet = layers
            .parse()
            .map_err(|e| cfg_err(format!("--layers {layers}: {e}")))?;
        match &mut cfg.measure {
            MeasureSpec::ModeD(s) => s.layers = set,
            MeasureSpec::Conditioning(s) => s.layers = set,
            MeasureSpec::Quantization(s) => s.layers = set,
        }
    }
    Ok(cfg)
}

/// The output folder of a config under the options.
pub fn out_dir(cfg: &MeasureConfig, opts: &MeasureOptions) -> PathBuf {
    opts.out
        .clone()
        .unwrap_or_else(|| PathBuf::from("results").join(&cfg.run.name))
}

/// Runs (or resumes) a measurement config.
pub fn run(config_path: &Path, opts: &MeasureOptions) -> Result<MeasureOutcome> {
    let cfg = load_config(config_path, opts)?;
    match &cfg.measure {
        MeasureSpec::ModeD(spec) => mode_d::run(config_path, &cfg, spec, opts),
        MeasureSpec::Conditioning(spec) => attention::run(
            config_path,
            &cfg,
            attention::Which::Conditioning(spec),
            opts,
        ),
        MeasureSpec::Quantization(spec) => attention::run(
            config_path,
            &cfg,
            attention::Which::Quantization(spec),
            opts,
        ),
    }
}

/// What a measurement would do, without loading weights: its pairs, skips
/// and an estimate of the work.
pub fn dry_run(config_path: &Path, opts: &MeasureOptions) -> Result<String> {
    let cfg = load_config(config_path, opts)?;
    match &cfg.measure {
        MeasureSpec::ModeD(spec) => mode_d::dry_run(&cfg, spec, opts),
        MeasureSpec::Conditioning(spec) => {
            attention::dry_run(&cfg, attention::Which::Conditioning(spec), opts)
        }
        MeasureSpec::Quantization(spec) => {
            attention::dry_run(&cfg, attention::Which::Quantization(spec), opts)
        }
    }
}

// ---------------------------------------------------------------------------
// The run folder.

/// A measurement run's folder: `run.json`, per-unit files under
/// subfolders, `summary.parquet`, the report.
#[derive(Debug, Clone)]
pub struct RunDir {
    /// The folder.
    pub dir: PathBuf,
}

impl RunDir {
    /// The folder `dir`, after checking that it is empty of runs or holds
    /// a run of this config (hash `hash`) whose finished units were
    /// computed with this build's matmul kernels
    /// ([`crate::sweep::check_kernels_unchanged`]).
    pub fn open(dir: &Path, hash: &str, unit_dirs: &[&str]) -> Result<Self> {
        let has_units = unit_dirs.iter().find(|sub| {
            std::fs::read_dir(dir.join(sub))
                .map(|mut it| it.next().is_some())
                .unwrap_or(false)
        });
        let meta = dir.join("run.json");
        if meta.exists() {
            let v = read_json(&meta).map_err(|e| DriverError::OutDir {
                dir: dir.display().to_string(),
                reason: format!("run.json is not readable ({e})"),
            })?;
            let theirs = v["config_hash"].as_str().unwrap_or("");
            if theirs != hash {
                return Err(DriverError::OutDir {
                    dir: dir.display().to_string(),
                    reason: format!(
                        "it holds a run of another config (hash {theirs}, this one {hash}); choose another --out"
                    ),
                });
            }
            if has_units.is_some() {
                crate::sweep::check_kernels_unchanged(
                    dir,
                    &v,
                    tolerable_runtime::avx512_kernels(),
                )?;
            }
        } else if let Some(sub) = has_units {
            return Err(DriverError::OutDir {
                dir: dir.display().to_string(),
                reason: format!("it holds files under {sub}/ but no run.json"),
            });
        }
        Ok(Self {
            dir: dir.to_path_buf(),
        })
    }

    /// `run.json`'s path.
    pub fn meta_path(&self) -> PathBuf {
        self.dir.join("run.json")
    }

    /// The previous invocations recorded in `run.json` (none for a new run).
    pub fn invocations(&self) -> Vec<serde_json::Value> {
        read_json(&self.meta_path())
            .ok()
            .and_then(|v| v["invocations"].as_array().cloned())
            .unwrap_or_default()
    }

    /// Writes `run.json` atomically.
    pub fn write_meta(&self, v: &serde_json::Value) -> Result<()> {
        crate::sweep::write_json_atomic(&self.meta_path(), v)
    }

    /// The file of unit `name` under `sub`, with extension `ext`.
    pub fn unit(&self, sub: &str, name: &str, ext: &str) -> PathBuf {
        unit_path(&self.dir, sub, name, ext)
    }
}

/// The file of unit `name` under `sub` of the run folder `dir`, with
/// extension `ext` (what [`RunDir::unit`] names, for readers that do not
/// open the run).
pub(crate) fn unit_path(dir: &Path, sub: &str, name: &str, ext: &str) -> PathBuf {
    dir.join(sub).join(format!("{name}.{ext}"))
}

/// A measurement's progress bar over `len` units named `unit`.
pub(crate) fn progress(len: usize, prefix: String, unit: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(len as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(&format!(
            "{{prefix}} {{bar:30}} {{pos}}/{{len}} {unit} {{per_sec}} eta {{eta}} {{msg}}"
        ))
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_prefix(prefix);
    bar
}

/// Loads the run's model (sha256 verified on load) and runs the runtime
/// gates; an error, with nothing written, when one fails.
pub(crate) fn load_gated(
    cfg: &MeasureConfig,
    precision: tolerable_runtime::Precision,
) -> Result<(tolerable_runtime::Checkpoint, serde_json::Value)> {
    let t_load = std::time::Instant::now();
    let ck = tolerable_fetch::load(&cfg.run.model, precision, &candle_core::Device::Cpu)?;
    tracing::info!(
        "loaded {} in {:.1} s (sha256 {})",
        cfg.run.model,
        t_load.elapsed().as_secs_f64(),
        ck.sha256.as_deref().unwrap_or("not hashed")
    );
    let t_gates = std::time::Instant::now();
    let gates = crate::gates::run_all(&ck, false)?;
    let passed = gates["passed"] == true;
    tracing::info!(
        "gates {} in {:.1} s",
        if passed { "passed" } else { "FAILED" },
        t_gates.elapsed().as_secs_f64()
    );
    if !passed {
        return Err(DriverError::Gate(format!(
            "{} failed the verification gates; nothing was written: {}",
            cfg.run.model,
            serde_json::to_string(&gates).unwrap_or_default()
        )));
    }
    Ok((ck, gates))
}

/// What every measurement's `run.json` holds: the run, its config and
/// hash, the model as verified, revisions, gates, threads, the command and
/// every invocation. A kind adds its own fields to the object.
pub(crate) fn run_meta(
    cfg: &MeasureConfig,
    config_path: &Path,
    ck: &tolerable_runtime::Checkpoint,
    gates: &serde_json::Value,
    invocations: Vec<serde_json::Value>,
) -> serde_json::Value {
    serde_json::json!({
        "name": cfg.run.name,
        "kind": "measure",
        "measurement": cfg.measure.kind(),
        "config_hash": cfg.hash(),
        "config_file": config_path.display().to_string(),
        "config": cfg,
        "model": {
            "id": cfg.run.model,
            "sha256": ck.sha256,
            "sha256_verified": ck.sha256.is_some(),
            "path": ck.path.display().to_string(),
            "precision": cfg.run.precision,
            "config": ck.model.config(),
        },
        "git_revision": crate::sweep::git_revision(),
        "build_revision": build_revision(),
        "gates": gates,
        "threads": candle_core::utils::get_num_threads(),
        "matmul_backend": tolerable_runtime::matmul_backend(false),
        "machine": tolerable_runtime::machine(),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "invocations": invocations,
    })
}

/// Adds `fields` (an object) to the object `meta`.
pub(crate) fn extend_meta(meta: &mut serde_json::Value, fields: serde_json::Value) {
    if let (Some(o), serde_json::Value::Object(f)) = (meta.as_object_mut(), fields) {
        o.extend(f);
    }
}

/// Reads a JSON file.
pub fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(io(format!("reading {}", path.display())))?;
    serde_json::from_str(&text)
        .map_err(|e| DriverError::Records(format!("{}: {e}", path.display())))
}

/// The git revision the driver was built from, where the build recorded
/// one (`TOLERABLE_BUILD_REVISION`), else `unknown`.
pub fn build_revision() -> &'static str {
    option_env!("TOLERABLE_BUILD_REVISION").unwrap_or("unknown")
}

/// The record of this invocation for `run.json`'s `invocations` (sweeps'
/// and measurement runs' alike): the matrix-multiply backend it ran on
/// (see [`tolerable_runtime::matmul_backend`]), and `extra`'s fields (a
/// sweep's shard).
pub fn invocation(backend: &str, extra: serde_json::Value) -> serde_json::Value {
    let mut v = stamp();
    let computed = serde_json::json!({
        "gates_passed": true,
        "threads": candle_core::utils::get_num_threads(),
        "matmul_backend": backend,
        "machine": tolerable_runtime::machine(),
    });
    for more in [computed, extra] {
        if let (Some(o), serde_json::Value::Object(e)) = (v.as_object_mut(), more) {
            o.extend(e);
        }
    }
    v
}

/// What any record of a command on a run folder holds (an invocation's,
/// a `--merge`'s): its command line, the working tree's and the binary's
/// revisions, and the time (seconds since the Unix epoch).
pub fn stamp() -> serde_json::Value {
    serde_json::json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "git_revision": crate::sweep::git_revision(),
        "build_revision": build_revision(),
        "unix_time": std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    })
}

/// Writes measurement rows atomically (zstd Parquet, see
/// [`records::write_rows`]).
pub fn write_rows(rows: Vec<MeasureRow>, path: &Path) -> Result<()> {
    records::write_rows(rows, path)
}

/// Reads measurement rows.
pub fn read_rows(path: &Path) -> Result<Vec<MeasureRow>> {
    columns::rows(&records::read_parquet(path)?)
}

/// Writes named tensors as safetensors atomically (a temporary name with
/// the process id, then a rename).
pub fn write_tensors_atomic(
    tensors: &std::collections::BTreeMap<String, Tensor>,
    path: &Path,
) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("out");
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let map: std::collections::HashMap<String, Tensor> = tensors
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if let Err(e) = candle_core::safetensors::save(&map, &tmp) {
        let _ = std::fs::remove_file(&tmp);
        return Err(DriverError::Records(format!(
            "writing {}: {e}",
            tmp.display()
        )));
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io(format!("renaming {} to {}", tmp.display(), path.display()))(e)
    })
}

// ---------------------------------------------------------------------------
// Compute.

/// Analytic FLOPs of the forward pass from a model's geometry: matrix
/// multiplications only, two FLOPs per multiply-add.
///
/// One token at position `p` (attending over `p + 1` keys: the cache and
/// itself) through one block costs
///
/// ```text
/// proj(p) = 2·d·(n_h + 2·n_kv)·h_d      q, k, v projections
///         + 2·(n_h·h_d)·d               output projection
///         + 2·d·(2·d_ffn) + 2·d_ffn·d   gate, up and down projections
/// attn(p) = 2·n_h·h_d·(p + 1)           scores q·kᵀ
///         + 2·n_h·h_d·(p + 1)           weighted values p·v
/// block(p) = proj(p) + attn(p)
/// ```
///
/// and the head costs `2·d·V` per position whose logits are computed.
/// Norms, RoPE, softmax, SiLU and residual additions (a few FLOPs per
/// element, well under 1%) are not counted, nor is memory traffic. A run of
/// tokens at positions `a..b` through `k` blocks costs
/// `k · Σ_{p=a}^{b-1} block(p)`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FlopModel {
    /// Residual width d.
    pub d_model: usize,
    /// Query heads n_h.
    pub n_heads: usize,
    /// Key/value heads n_kv.
    pub n_kv_heads: usize,
    /// Head width h_d.
    pub head_dim: usize,
    /// MLP width d_ffn.
    pub d_ffn: usize,
    /// Vocabulary V.
    pub vocab: usize,
    /// Blocks L.
    pub n_layers: usize,
}

impl FlopModel {
    /// The FLOP model of a model configuration.
    pub fn of(cfg: &tolerable_runtime::ModelConfig) -> Self {
        Self {
            d_model: cfg.d_model,
            n_heads: cfg.n_heads,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
            d_ffn: cfg.d_ffn,
            vocab: cfg.vocab_size,
            n_layers: cfg.n_layers,
        }
    }

    /// `proj(p)`: the projections of one token through one block.
    pub fn projections(&self) -> f64 {
        let (d, hd) = (self.d_model as f64, self.head_dim as f64);
        let (nh, nkv, f) = (
            self.n_heads as f64,
            self.n_kv_heads as f64,
            self.d_ffn as f64,
        );
        2.0 * d * (nh + 2.0 * nkv) * hd + 2.0 * nh * hd * d + 2.0 * d * 2.0 * f + 2.0 * f * d
    }

    /// `block(p)`: one token at position `p` through one block.
    pub fn block(&self, p: usize) -> f64 {
        self.projections() + 4.0 * (self.n_heads * self.head_dim) as f64 * (p + 1) as f64
    }

    /// Tokens at positions `a..b` through `blocks` blocks.
    pub fn tokens(&self, a: usize, b: usize, blocks: usize) -> f64 {
        if b <= a {
            return 0.0;
        }
        let n = (b - a) as f64;
        // Σ (p + 1) for p in a..b = n·(a + b + 1)/2.
        let keys = n * (a + b + 1) as f64 / 2.0;
        blocks as f64
            * (n * self.projections() + 4.0 * (self.n_heads * self.head_dim) as f64 * keys)
    }

    /// The head at `positions` positions.
    pub fn head(&self, positions: usize) -> f64 {
        2.0 * (self.d_model * self.vocab) as f64 * positions as f64
    }
}

// ---------------------------------------------------------------------------
// Comparisons.

/// Per position of `a` and `b` (`[1, n, d]` or `[n, d]`): `|a − b| / |b|`
/// (the relative L2 of `a`'s displacement from the reference `b`); infinite
/// where `b` is zero and `a` is not, 0 where both are.
pub fn relative_l2_rows(a: &Tensor, b: &Tensor) -> Result<Vec<f64>> {
    let a = a.to_dtype(candle_core::DType::F64)?;
    let b = b.to_dtype(candle_core::DType::F64)?;
    let num: Vec<f64> = (&a - &b)?.sqr()?.sum(D::Minus1)?.flatten_all()?.to_vec1()?;
    let den: Vec<f64> = b.sqr()?.sum(D::Minus1)?.flatten_all()?.to_vec1()?;
    Ok(num
        .iter()
        .zip(&den)
        .map(|(&n, &r)| {
            if r == 0.0 {
                if n == 0.0 {
                    0.0
                } else {
                    f64::INFINITY
                }
            } else {
                (n / r).sqrt()
            }
        })
        .collect())
}

/// The fraction of values above `tau` (0 for none).
pub fn fraction_above(values: &[f64], tau: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.iter().filter(|&&v| v > tau).count() as f64 / values.len() as f64
}

/// A reference next-token distribution at n positions (the full
/// recompute), prepared once for many comparisons: per position the
/// probabilities and `Σ p log p` in f64, and the argmax.
///
/// `KL(p || q) = Σ p·(log p − log q) = Σ p log p − Σ p·z_q + logsumexp(z_q)`
/// for logits `z_q` of q: each comparison costs one pass over the
/// vocabulary per position, in f64.
#[derive(Debug, Clone)]
pub struct LogitReference {
    probs: Vec<Vec<f64>>,
    neg_entropy: Vec<f64>,
    argmax: Vec<usize>,
}

/// One comparison of next-token predictions with a reference.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    /// Positions compared.
    pub n: usize,
    /// Fraction of positions with the reference's argmax.
    pub agreement: f64,
    /// Mean KL(reference || compared), nats.
    pub kl_mean: f64,
    /// Largest KL over the positions.
    pub kl_max: f64,
    /// Disagreements whose two tokens are within the tie tolerance in the
    /// reference's logits (`|z_a − z_b| <= tie`).
    pub ties: usize,
}

fn rows_of(logits: &Tensor) -> Result<Vec<Vec<f32>>> {
    let t = match logits.rank() {
        3 => logits.squeeze(0)?,
        _ => logits.clone(),
    };
    Ok(t.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?)
}

fn argmax_f32(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best
}

impl LogitReference {
    /// The reference of logits `[1, n, V]` (or `[n, V]`).
    pub fn new(logits: &Tensor) -> Result<Self> {
        // Positions in parallel (each row's arithmetic is sequential, so the
        // figures do not depend on the thread count).
        let per_row: Vec<(Vec<f64>, f64, usize)> = rows_of(logits)?
            .par_iter()
            .map(|row| {
                let lp = tolerable_stats::log_softmax(row);
                let p: Vec<f64> = lp.iter().map(|x| x.exp()).collect();
                let neg_entropy = p
                    .iter()
                    .zip(&lp)
                    .map(|(p, l)| if *p > 0.0 { p * l } else { 0.0 })
                    .sum();
                (p, neg_entropy, argmax_f32(row))
            })
            .collect();
        let mut r = Self {
            probs: Vec::with_capacity(per_row.len()),
            neg_entropy: Vec::with_capacity(per_row.len()),
            argmax: Vec::with_capacity(per_row.len()),
        };
        for (p, h, a) in per_row {
            r.probs.push(p);
            r.neg_entropy.push(h);
            r.argmax.push(a);
        }
        Ok(r)
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.probs.len()
    }

    /// Whether it holds no position.
    pub fn is_empty(&self) -> bool {
        self.probs.is_empty()
    }

    /// Compares logits `[1, n, V]` (same positions) with the reference;
    /// `tie` is the tie tolerance in logits.
    pub fn compare(&self, logits: &Tensor, tie: f64) -> Result<Comparison> {
        let rows = rows_of(logits)?;
        if rows.len() != self.probs.len() {
            return Err(DriverError::Records(format!(
                "internal: comparing {} positions with a reference of {}",
                rows.len(),
                self.probs.len()
            )));
        }
        let n = rows.len();
        // Each position's KL, agreement and tie in parallel (each row's
        // arithmetic sequential); the sums below run in position order, so
        // the figures do not depend on the thread count.
        let per_row: Vec<(f64, bool, bool)> = rows
            .par_iter()
            .enumerate()
            .map(|(i, row)| {
                let p = &self.probs[i];
                let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
                let (mut se, mut pz) = (0f64, 0f64);
                for (&z, &pi) in row.iter().zip(p) {
                    let z = z as f64;
                    se += (z - m).exp();
                    pz += pi * z;
                }
                let kl = (self.neg_entropy[i] - pz + m + se.ln()).max(0.0);
                let (a, b) = (self.argmax[i], argmax_f32(row));
                // z_a − z_b = log p_a − log p_b in the reference.
                let tied = a != b && (p[a].ln() - p[b].ln()).abs() <= tie;
                (kl, a == b, tied)
            })
            .collect();
        let (mut agree, mut ties, mut sum, mut max) = (0usize, 0usize, 0f64, 0f64);
        for (kl, agreed, tied) in per_row {
            sum += kl;
            max = max.max(kl);
            agree += agreed as usize;
            ties += tied as usize;
        }
        Ok(Comparison {
            n,
            agreement: if n == 0 { 1.0 } else { agree as f64 / n as f64 },
            kl_mean: if n == 0 { 0.0 } else { sum / n as f64 },
            kl_max: max,
            ties,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn a_measurement_is_not_resumed_with_other_matmul_kernels() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        std::fs::create_dir_all(run.join("units")).unwrap();
        let other = if tolerable_runtime::avx512_kernels() {
            tolerable_runtime::MATMUL_BACKEND.to_string()
        } else {
            format!(
                "{}{}",
                tolerable_runtime::MATMUL_BACKEND,
                tolerable_runtime::AVX512_KERNELS
            )
        };
        let meta = |b: &str| {
            serde_json::json!({ "config_hash": "h", "matmul_backend": b,
                "invocations": [{ "matmul_backend": b }] })
            .to_string()
        };
        std::fs::write(run.join("run.json"), meta(&other)).unwrap();
        // No unit yet: nothing to mix.
        RunDir::open(&run, "h", &["units"]).unwrap();
        std::fs::write(run.join("units/ctx.parquet"), b"x").unwrap();
        let e = RunDir::open(&run, "h", &["units"]).unwrap_err().to_string();
        assert!(e.contains("round differently"), "{e}");
        std::fs::write(
            run.join("run.json"),
            meta(&tolerable_runtime::matmul_backend(false)),
        )
        .unwrap();
        RunDir::open(&run, "h", &["units"]).unwrap();
        // Units without run.json: refused, naming the folder.
        std::fs::remove_file(run.join("run.json")).unwrap();
        let e = RunDir::open(&run, "h", &["units"]).unwrap_err().to_string();
        assert!(e.contains("under units/ but no run.json"), "{e}");
    }

    #[test]
    fn the_reference_kl_is_the_stats_kl() {
        let dev = Device::Cpu;
        let p = vec![0.3f32, -1.0, 2.0, 0.5, 0.0, 1.9];
        let q = vec![0.1f32, -0.5, 1.0, 2.5, 0.2, 1.0];
        let pt = Tensor::from_vec(p.clone(), (1, 1, 6), &dev).unwrap();
        let qt = Tensor::from_vec(q.clone(), (1, 1, 6), &dev).unwrap();
        let r = LogitReference::new(&pt).unwrap();
        let c = r.compare(&qt, 1e-3).unwrap();
        let want = tolerable_stats::kl_divergence_logits(&p, &q).unwrap();
        assert!((c.kl_mean - want).abs() < 1e-12, "{} {want}", c.kl_mean);
        assert_eq!(c.agreement, 0.0);
        assert_eq!(c.ties, 0);
        let same = r.compare(&pt, 1e-3).unwrap();
        assert!(same.kl_mean < 1e-14 && same.agreement == 1.0);
        // A near-tie: 2.0 vs 1.9995 is within 1e-3.
        let t = Tensor::from_vec(vec![0f32, 0., 1.9995, 0., 0., 2.0], (1, 1, 6), &dev).unwrap();
        let u = Tensor::from_vec(vec![0f32, 0., 2.0, 0., 0., 1.9995], (1, 1, 6), &dev).unwrap();
        let c = LogitReference::new(&t).unwrap().compare(&u, 1e-3).unwrap();
        assert_eq!((c.agreement, c.ties), (0.0, 1));
    }

    /// The comparison's positions run in parallel; its figures are the
    /// same bits on one thread as on several.
    #[test]
    fn the_comparison_does_not_depend_on_the_thread_count() {
        let dev = Device::Cpu;
        let (n, v) = (37, 501);
        let wave = |k: f32| -> Vec<f32> {
            (0..n * v)
                .map(|i| (i as f32 * k).sin() * 4.0 + (i % 7) as f32 * 0.3)
                .collect()
        };
        let a = Tensor::from_vec(wave(0.37), (1, n, v), &dev).unwrap();
        let b = Tensor::from_vec(wave(0.41), (1, n, v), &dev).unwrap();
        let run = || {
            let r = LogitReference::new(&a).unwrap();
            (r.compare(&b, 1e-3).unwrap(), r.neg_entropy.clone())
        };
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap()
            .install(run);
        let four = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .unwrap()
            .install(run);
        assert_eq!(one.0.kl_mean.to_bits(), four.0.kl_mean.to_bits());
        assert_eq!(one, four);
        assert!(one.0.kl_mean > 0.0 && one.0.agreement < 1.0, "{:?}", one.0);
    }

    #[test]
    fn relative_l2_rows_match_the_stats_measure() {
        let dev = Device::Cpu;
        let a = vec![1f32, 2., 3., 0., 0., 0.];
        let b = vec![1f32, 2., 4., 0., 0., 0.];
        let at = Tensor::from_vec(a.clone(), (1, 2, 3), &dev).unwrap();
        let bt = Tensor::from_vec(b.clone(), (1, 2, 3), &dev).unwrap();
        let r = relative_l2_rows(&at, &bt).unwrap();
        let want = tolerable_stats::relative_l2(&a[..3], &b[..3]).unwrap();
        assert!((r[0] - want).abs() < 1e-12);
        assert_eq!(r[1], 0.0);
        assert_eq!(fraction_above(&r, want / 2.0), 0.5);
        assert_eq!(fraction_above(&[], 0.1), 0.0);
    }

    #[test]
    fn flops_sum_per_position() {
        let f = FlopModel {
            d_model: 8,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 4,
            d_ffn: 16,
            vocab: 10,
            n_layers: 3,
        };
        let by_hand: f64 = (5..9).map(|p| f.block(p)).sum::<f64>() * 2.0;
        assert!((f.tokens(5, 9, 2) - by_hand).abs() < 1e-9);
        assert_eq!(f.tokens(4, 4, 3), 0.0);
        assert_eq!(f.head(2), 2.0 * 80.0 * 2.0);
    }

    /// The model against independent figures for the 0.5B: its projections
    /// are 2 FLOPs per weight per token (14,909,440 weights a block, from
    /// the checkpoint's matrix shapes: q/k/v 896x1152, o 896x896, gate/up
    /// 896x9728, down 4864x896), and a 300-token prefill lies between that
    /// alone (214.7 GFLOP) and the shared speed notes' 222.7 GFLOP, which
    /// counts the attention products over the full square instead of the
    /// causal triangle.
    #[test]
    fn the_flop_model_of_the_half_b_matches_its_weights_and_the_notes() {
        let f = FlopModel {
            d_model: 896,
            n_heads: 14,
            n_kv_heads: 2,
            head_dim: 64,
            d_ffn: 4864,
            vocab: 151_936,
            n_layers: 24,
        };
        let weights_per_block = 896.0 * 1152.0 + 896.0 * 896.0 + 896.0 * 9728.0 + 4864.0 * 896.0;
        assert_eq!(weights_per_block, 14_909_440.0);
        assert_eq!(f.projections(), 2.0 * weights_per_block);
        let prefill = f.tokens(0, 300, 24) + f.head(1);
        let matmuls = 2.0 * weights_per_block * 300.0 * 24.0;
        let full_square = matmuls + 24.0 * 4.0 * 896.0 * 300.0 * 300.0 + f.head(1);
        assert!(
            (full_square / 1e9 - 222.7).abs() < 0.05,
            "{}",
            full_square / 1e9
        );
        assert!(prefill > matmuls && prefill < full_square, "{prefill}");
        // The causal triangle: attention over (p + 1) keys at position p.
        let causal = 24.0 * 4.0 * 896.0 * (300.0 * 301.0 / 2.0);
        assert!((prefill - matmuls - causal - f.head(1)).abs() < 1.0);
    }
}
