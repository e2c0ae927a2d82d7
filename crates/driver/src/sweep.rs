//! A sweep: the grid of arms over a sample of items, cut into cells of
//! items. The config compiles into a plan first; the output folder is
//! checked before the model loads; resources are built or loaded; gates run
//! before anything is written; each finished cell is written atomically; a
//! rerun skips finished cells, so a killed sweep resumes where it stopped
//! and shards of one sweep merge into one folder.

use crate::config::SweepConfig;
use crate::cross::CrossHolder;
use crate::error::{io, DriverError, Result};
use crate::items::ItemSet;
use crate::plan::{compile, Plan};
use crate::records::{self, ArmColumns, ItemRow, SampleRow};
use crate::resources::store::{Meta, Obtained, Store};
use crate::resources::{hash_all, BuildCx, EvalSet, ResourceSpec, TrainCx, Value};
use crate::runner::{Batching, ItemJob, Runner};
use indicatif::{ProgressBar, ProgressStyle};
use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tolerable_probe::score::score;
use tolerable_probe::{SplitItem, SplitOptions, Template};
use tolerable_runtime::{Checkpoint, ModelConfig, Precision, Tokenizer};

/// Prefill tokens a second of the 0.5B on this project's 2-core AVX2
/// machine, fitted to its sweeps' wall times (the dry runs' estimates).
pub const PREFILL_TOKENS_PER_S_05B: f64 = 107.0;

/// Decoded tokens a second per arm-item of the 0.5B on the same machine,
/// batched as the runner batches them, fitted with the prefill rate; it
/// also absorbs each arm's own costs (cache edits, calibration, fidelity
/// measures), which scale with arms x items as decoded tokens do.
pub const DECODED_TOKENS_PER_S_05B: f64 = 22.5;

/// How much faster than the 0.5B a model of this geometry runs, by the
/// parameters of its blocks (the rates above scaled for a dry run).
pub fn speed_relative_to_05b(mcfg: &ModelConfig) -> f64 {
    let params = |l: usize, d: usize, f: usize| (l * (4 * d * d + 3 * d * f)) as f64;
    params(24, 896, 4864) / params(mcfg.n_layers, mcfg.d_model, mcfg.d_ffn)
}

/// Options of one sweep invocation.
#[derive(Debug, Clone, Default)]
pub struct SweepOptions {
    /// Output folder (default `results/<run.name>`).
    pub out: Option<PathBuf>,
    /// Run only cells `c` with `c % n == i`.
    pub shard: Option<(usize, usize)>,
    /// Data paths by source name (`squad_dev`, `squad_train`).
    pub data: BTreeMap<String, PathBuf>,
    /// Override of `[data] n`.
    pub n: Option<usize>,
    /// Only merge finished cells into the summary (no model, no gates).
    pub merge_only: bool,
    /// Where resources are cached (default [`Store::default_root`]).
    pub resource_root: Option<PathBuf>,
}

/// What a sweep invocation did.
#[derive(Debug, Clone)]
pub struct SweepOutcome {
    /// The run folder.
    pub dir: PathBuf,
    /// Cells in the whole sweep.
    pub cells: usize,
    /// Cells this invocation computed.
    pub computed: usize,
    /// Cells found finished.
    pub skipped: usize,
    /// Whether the summary was written (every cell finished).
    pub summary_written: bool,
}

/// Name of cell `c`'s file.
pub fn cell_path(dir: &Path, c: usize) -> PathBuf {
    dir.join("items").join(format!("cell-{c:05}.parquet"))
}

/// Reads a model's geometry (for shape checks and plans) from a catalog id
/// or a path (a GGUF file's header only; a checkpoint folder is loaded).
pub fn model_config_of(id: &str) -> Result<ModelConfig> {
    Ok(header(id)?.0)
}

/// The geometry and tokenizer of a model: a GGUF file's header only (no
/// weights), or, for a checkpoint folder, the loaded checkpoint.
pub(crate) fn header(id: &str) -> Result<(ModelConfig, Tokenizer, PathBuf)> {
    let path = tolerable_fetch::resolve(id)?.path;
    if path.is_dir() {
        let ck = Checkpoint::load_path(id, &path, Precision::F32, &candle_core::Device::Cpu)?;
        return Ok((ck.model.config().clone(), ck.tokenizer, path));
    }
    let mut f = std::fs::File::open(&path).map_err(io(format!("opening {}", path.display())))?;
    let ct = candle_core::quantized::gguf_file::Content::read(&mut f)
        .map_err(|e| DriverError::Config(format!("reading {}: {e}", path.display())))?;
    Ok((
        ModelConfig::from_gguf(&ct)?,
        Tokenizer::from_gguf(&ct)?,
        path,
    ))
}

/// The git revision of the working tree, `-dirty` when tracked files
/// outside `results/` have changes.
pub(crate) fn git_revision() -> String {
    let run = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match run(&["rev-parse", "HEAD"]) {
        Some(rev) => {
            // Results are outputs, not code: changes under results/ do not
            // make the revision dirty.
            let dirty = run(&[
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":(exclude)results",
            ])
            .is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{rev}-dirty")
            } else {
                rev
            }
        }
        None => "unknown".into(),
    }
}

pub(crate) fn write_json_atomic(path: &Path, v: &serde_json::Value) -> Result<()> {
    let tmp = path.with_extension(format!("json.tmp-{}", std::process::id()));
    if let Err(e) = std::fs::write(&tmp, serde_json::to_string_pretty(v).unwrap_or_default()) {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(format!("writing {}", tmp.display()))(e));
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io(format!("renaming {}", tmp.display()))(e)
    })?;
    Ok(())
}

/// Adds `fields` to this invocation's record (the last of `meta`'s
/// `invocations`) and rewrites run.json: how long it has taken so far,
/// after every cell, so a run cut short still says what its cells cost.
fn record_time(meta: &mut serde_json::Value, dir: &Path, fields: serde_json::Value) -> Result<()> {
    if let (Some(last), serde_json::Value::Object(f)) = (
        meta["invocations"]
            .as_array_mut()
            .and_then(|a| a.last_mut())
            .and_then(|v| v.as_object_mut()),
        fields,
    ) {
        last.extend(f);
    }
    write_json_atomic(&dir.join("run.json"), meta)
}

/// How a run's arms share question-and-decoding batches, and how run.json
/// (`batching`) and the dry run name it: float rounding differs between the
/// ways, so rows are comparable within one.
fn batching(cfg: &SweepConfig) -> (Batching, String) {
    let way = if cfg.run.one_at_a_time {
        Batching::OneAtATime
    } else if cfg.run.item_batch > 1 {
        Batching::Padded
    } else {
        Batching::Batched
    };
    let mut text = match way {
        Batching::Padded => format!("padded, {} items a batch", cfg.run.item_batch),
        Batching::Batched => "per item, by cache layout".to_string(),
        Batching::OneAtATime => "one arm at a time".to_string(),
    };
    if cfg.run.batch_bridges && way != Batching::OneAtATime {
        text.push_str("; bridges batched, each sequence with its own adapters");
    }
    (way, text)
}

/// Adds this `--merge` to run.json's `summaries`: the command, the
/// revisions and the time of the binary that wrote summary.parquet again
/// from the cells (the cells' own invocations stay as they were).
fn record_summary(dir: &Path) -> Result<()> {
    let path = dir.join("run.json");
    let mut meta = crate::measure::read_json(&path)?;
    let entry = crate::measure::stamp();
    match meta["summaries"].as_array_mut() {
        Some(list) => list.push(entry),
        None => meta["summaries"] = serde_json::json!([entry]),
    }
    write_json_atomic(&path, &meta)
}

/// Loads the config and applies the command line's overrides.
pub fn load_config(config: &Path, opts: &SweepOptions) -> Result<SweepConfig> {
    let mut cfg = SweepConfig::from_file(config)?;
    if let Some(n) = opts.n {
        if n == 0 {
            return Err(DriverError::Config("--n must be at least 1".into()));
        }
        cfg.data.n = n;
    }
    for key in opts.data.keys() {
        if !matches!(key.as_str(), "squad_dev" | "squad_train") {
            return Err(DriverError::Config(format!(
                "--data {key}=...: unknown data source (squad_dev, squad_train)"
            )));
        }
    }
    if let Some(p) = opts.data.get(cfg.data.source.name()) {
        cfg.data.path = Some(p.clone());
    }
    Ok(cfg)
}

/// The output folder of a config under the options.
pub fn out_dir(cfg: &SweepConfig, opts: &SweepOptions) -> PathBuf {
    opts.out
        .clone()
        .unwrap_or_else(|| PathBuf::from("results").join(&cfg.run.name))
}

/// Checks that `dir` is empty of runs or holds this config's run.
fn check_out_dir(dir: &Path, hash: &str) -> Result<()> {
    let meta = dir.join("run.json");
    if meta.exists() {
        let text =
            std::fs::read_to_string(&meta).map_err(io(format!("reading {}", meta.display())))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| DriverError::OutDir {
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
        if !records::cell_files(dir)?.is_empty() {
            check_kernels_unchanged(dir, &v, tolerable_runtime::avx512_kernels())?;
        }
    } else if !records::cell_files(dir)?.is_empty() {
        return Err(DriverError::OutDir {
            dir: dir.display().to_string(),
            reason: "it holds item files but no run.json".into(),
        });
    }
    Ok(())
}

/// Refuses to add cells (a sweep's) or units (a measurement's) to a run
/// whose finished records were computed with
/// other matmul kernels than this process's (gemm's AVX-512 kernels, the
/// `avx512` build feature on a CPU with avx512f, against its default
/// AVX2/FMA ones): the kernels round differently, so one run's rows would
/// mix two computations. `meta` is the run's run.json.
pub(crate) fn check_kernels_unchanged(
    dir: &Path,
    meta: &serde_json::Value,
    avx512_now: bool,
) -> Result<()> {
    let recorded = meta["invocations"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|i| &i["matmul_backend"])
        .chain(std::iter::once(&meta["matmul_backend"]))
        .filter_map(|b| b.as_str());
    for backend in recorded {
        let avx512_then = backend.contains(tolerable_runtime::AVX512_KERNELS);
        if avx512_then != avx512_now {
            let kernels = |a: bool| {
                if a {
                    "gemm's AVX-512 kernels"
                } else {
                    "gemm's default (AVX2/FMA) kernels"
                }
            };
            return Err(DriverError::OutDir {
                dir: dir.display().to_string(),
                reason: format!(
                    "its finished records were computed with {} (`{backend}`), this build uses {}; \
                     the kernels round differently, so they cannot be merged (build {} the \
                     `avx512` feature, or run into another --out)",
                    kernels(avx512_then),
                    kernels(avx512_now),
                    if avx512_then { "with" } else { "without" },
                ),
            });
        }
    }
    Ok(())
}

/// Bytes a run's records need, generously: item rows of about 1 KiB each
/// (zstd makes them smaller), twice over for the temporary copies, plus the
/// summary, the sample table and run.json.
pub fn bytes_needed(items: usize, arms: usize) -> u64 {
    (items * arms) as u64 * 2048 + 16 * 1024 * 1024
}

/// Checks, before anything expensive, that the output folder can be
/// created and written and that its file system has room for the records.
fn check_writable(dir: &Path, need: u64) -> Result<()> {
    check_writable_in(dir, "items", need)
}

/// [`check_writable`] for a run folder whose records go under `sub`.
pub(crate) fn check_writable_in(dir: &Path, sub: &str, need: u64) -> Result<()> {
    let unusable = |reason: String| DriverError::OutDir {
        dir: dir.display().to_string(),
        reason,
    };
    std::fs::create_dir_all(dir.join(sub))
        .map_err(|e| unusable(format!("cannot be created ({e})")))?;
    let probe = dir.join(format!(".write-check-{}", std::process::id()));
    std::fs::write(&probe, b"tolerable").map_err(|e| unusable(format!("is not writable ({e})")))?;
    let _ = std::fs::remove_file(&probe);
    if let Ok(free) = fs4::available_space(dir) {
        if free < need {
            return Err(unusable(format!(
                "has {:.1} MiB free; the run's records need about {:.1} MiB",
                free as f64 / 1048576.0,
                need as f64 / 1048576.0
            )));
        }
    }
    Ok(())
}

fn split_options(cfg: &SweepConfig, ctx: usize) -> SplitOptions {
    SplitOptions {
        template: if cfg.run.template == "chat" {
            Template::Chat
        } else {
            Template::Raw
        },
        max_prompt_tokens: cfg.run.max_prompt_tokens.min(ctx - cfg.run.new_tokens),
        ..SplitOptions::default()
    }
}

/// The sampled evaluation items of a run.
fn sample_items(
    cfg: &SweepConfig,
    tokenizer: &Tokenizer,
    split: &SplitOptions,
    n_partners: usize,
) -> Result<(tolerable_probe::sample::Sample, String, ItemSet)> {
    let (items, source) = crate::items::load_items(&cfg.data, None, cfg.run.seed)?;
    let seed = cfg.run.seed;
    let mut last = None;
    let mut draw = |k: usize| -> Result<Vec<SplitItem>> {
        let s = tolerable_probe::sample::sample(&items, tokenizer, split, k, seed)?;
        let items = s.items.clone();
        last = Some(s);
        Ok(items)
    };
    let (set, short) = crate::items::with_partners(&mut draw, cfg.data.n, n_partners, seed)?;
    let mut sample =
        last.ok_or_else(|| DriverError::Records("internal: no sample drawn".into()))?;
    sample.items = set.items.clone();
    if !short.is_empty() {
        sample
            .dropped
            .insert(crate::items::TOO_FEW_PARTNERS.into(), short.len());
        tracing::warn!(
            "{} item(s) dropped for too few mis-source partners ({n_partners} wanted): {}",
            short.len(),
            short.join(", ")
        );
    }
    tracing::info!(
        "{} items from {source} (seed {seed}, {} considered, dropped {:?})",
        sample.items.len(),
        sample.considered,
        sample.dropped
    );
    Ok((sample, source, set))
}

/// A resource of the plan after building or loading it.
#[derive(Debug, Clone)]
pub struct ObtainedResource {
    /// Its content hash.
    pub hash: String,
    /// How it was obtained.
    pub obtained: Obtained,
    /// Seconds its build took (when it was built), in the invocation that
    /// finished it.
    pub build_seconds: f64,
    /// Where its build resumed, from the progress file of an invocation
    /// cut short (`build_seconds` then leaves out the training before it).
    pub resumed_after: Option<crate::resources::ResumedAt>,
    /// Training items it was fitted on.
    pub items: Vec<String>,
    /// Why a cached copy was not used (when it was rebuilt): another
    /// model, another spec, a checksum that does not match, or a value that
    /// does not fit the receiver (an adapter of another rank or width).
    pub rejected: Option<String>,
    /// sha256 of the value's file: what the run's cells actually read (a
    /// rebuilt resource of the same spec hash that trained differently has
    /// another).
    pub value_sha256: String,
    /// How the evaluation answers reach its training items.
    pub eval_answers: crate::resources::AnswerMentions,
}

/// The sha256 a run's resource hashes use for its receiver: the hash
/// verified on load, or `unhashed:<path>` for a checkpoint folder (which is
/// not hashed: a changed folder is not noticed).
pub fn model_key(sha256: Option<&str>, path: &Path) -> String {
    sha256
        .map(String::from)
        .unwrap_or_else(|| format!("unhashed:{}", path.display()))
}

/// Builds (or loads from the cache) every resource of `resources` (a
/// plan's, in dependency order), a shared-work group's members one after
/// another ([`crate::resources::grouped_order`]); `senders` are the plan's held-out
/// senders, built and gated; `holders` its cross-family holders, loaded.
/// With `resuming`, a run folder whose finished cells read recorded
/// resources, each resource is compared with its record as soon as it is
/// obtained ([`check_resources_unchanged`]), so a retrain that differs
/// stops the sweep before the next resource is trained, not after all of
/// them (the built value stays in the cache).
#[allow(clippy::too_many_arguments)]
pub fn obtain_resources(
    resources: &[(String, crate::resources::ResourceSpec)],
    ck: &Checkpoint,
    precision: &str,
    train: &TrainCx,
    senders: &BTreeMap<String, tolerable_runtime::Model>,
    holders: &BTreeMap<String, CrossHolder>,
    store: &Store,
    resuming: Option<&Path>,
) -> Result<(BTreeMap<String, Value>, BTreeMap<String, ObtainedResource>)> {
    let model_sha = model_key(ck.sha256.as_deref(), &ck.path);
    let cfg = ck.model.config();
    let mut values: BTreeMap<String, Value> = BTreeMap::new();
    let mut info: BTreeMap<String, ObtainedResource> = BTreeMap::new();
    let scratch = crate::resources::Scratch::default();
    let holder_sha: BTreeMap<String, String> = holders
        .iter()
        .map(|(id, h)| (id.clone(), h.sha256.clone()))
        .collect();
    let hashed = hash_all(resources, train, &model_sha, precision, &holder_sha)?;
    // Resources sharing work (a bridge's training caches) are built one
    // after another, and the work dropped after the last of them.
    let groups: Vec<Option<String>> = hashed
        .iter()
        .map(|r| r.spec.kind().shared_work(&r.items))
        .collect();
    let has_deps: Vec<bool> = hashed
        .iter()
        .map(|r| !r.spec.kind().deps().is_empty())
        .collect();
    let order = crate::resources::grouped_order(&groups, &has_deps);
    // Where each group's work is kept on disk while its resources are built:
    // named by what the work depends on beyond its own keys.
    let backend = tolerable_runtime::matmul_backend(ck.model.row_kernel());
    let shared_dirs: Vec<Option<PathBuf>> = hashed
        .iter()
        .zip(&groups)
        .map(|(r, g)| {
            g.as_ref().map(|g| {
                store.shared_dir(&format!(
                    "{g}\nreceiver {model_sha}\nprecision {precision}\nkernels {backend}\n{} version {}",
                    r.spec.kind().kind(),
                    r.spec.kind().version()
                ))
            })
        })
        .collect();
    for d in store.shared_dirs() {
        if !shared_dirs.iter().flatten().any(|s| s == &d) {
            let n = std::fs::read_dir(&d).map(|e| e.count()).unwrap_or(0);
            tracing::warn!(
                "{}: {n} files kept by a stopped build of another plan (or receiver, precision or binary); delete it once no sweep will resume that build",
                d.display()
            );
        }
    }
    for (pos, &i) in order.iter().enumerate() {
        let r = &hashed[i];
        let (name, spec, hash) = (&r.name, &r.spec, &r.hash);
        let kind = spec.kind();
        let ids: Vec<String> = r.items.iter().map(|i| i.item.id.clone()).collect();
        let (value, obtained, secs, rejected, value_sha256, resumed_after) =
            match store.load(spec, hash, &model_sha, cfg)? {
                Ok((v, meta)) => {
                    tracing::info!(
                        "resource `{name}` ({}) loaded from the cache ({hash})",
                        kind.describe()
                    );
                    (
                        v,
                        Obtained::Cached,
                        meta.build_seconds,
                        None,
                        meta.value_sha256,
                        crate::resources::ResumedAt::from_record(
                            meta.resumed_after_epoch,
                            meta.resumed_after_steps,
                        ),
                    )
                }
                Err(why) => {
                    let (obtained, rejected) = if why == "absent" {
                        (Obtained::Built, None)
                    } else {
                        tracing::warn!(
                            "resource `{name}`: the cached copy is not used: {why}; rebuilding"
                        );
                        (Obtained::Rebuilt, Some(why))
                    };
                    tracing::info!(
                        "building resource `{name}` ({}) on {} training items",
                        kind.describe(),
                        ids.len()
                    );
                    let cx = BuildCx {
                        train: TrainCx {
                            field: format!("[resources.{name}]"),
                            ..*train
                        },
                        model: &ck.model,
                        senders,
                        deps: &values,
                        holders,
                        scratch: &scratch,
                        progress: Some(store.progress_file(kind.kind(), hash)),
                        shared_dir: shared_dirs[i].clone(),
                        resumed_after: Default::default(),
                    };
                    let t0 = Instant::now();
                    let v = kind.build(&cx, &r.items)?;
                    kind.check(&v, cfg)?;
                    let secs = t0.elapsed().as_secs_f64();
                    let resumed = cx.resumed_after.get().copied();
                    let sum = store.save(
                        &v,
                        &Meta {
                            hash: hash.clone(),
                            spec: spec.clone(),
                            model_sha256: model_sha.clone(),
                            items: ids.clone(),
                            value_sha256: String::new(),
                            build_seconds: secs,
                            resumed_after_epoch: resumed.map(|r| r.epoch),
                            resumed_after_steps: resumed.map(|r| r.steps),
                        },
                    )?;
                    let how = resumed
                        .map(|r| format!(" this invocation, resumed after {r}"))
                        .unwrap_or_default();
                    tracing::info!("resource `{name}` built in {secs:.1} s{how} ({hash})");
                    (v, obtained, secs, rejected, sum, resumed)
                }
            };
        values.insert(name.clone(), value);
        info.insert(
            name.clone(),
            ObtainedResource {
                hash: hash.clone(),
                obtained,
                build_seconds: secs,
                items: ids,
                rejected,
                value_sha256,
                resumed_after,
                eval_answers: train.eval.answer_mentions(&r.items),
            },
        );
        if let Some(g) = &groups[i] {
            if !order[pos + 1..]
                .iter()
                .any(|&j| groups[j].as_ref() == Some(g))
            {
                let n = scratch.release(g);
                if n > 0 {
                    tracing::debug!(
                        "after resource `{name}`: {n} values of its shared work dropped"
                    );
                }
                // Its copy on disk too: the group's resources are obtained.
                if let Some(kept) = &shared_dirs[i] {
                    if store.remove_shared(kept) {
                        tracing::info!(
                            "after resource `{name}`: its group's kept examples removed ({})",
                            kept.display()
                        );
                    }
                }
            }
        }
        if let Some(dir) = resuming {
            let one = [(name.clone(), spec.clone())];
            check_resources_unchanged(dir, &resources_meta(&one, &values, &info))?;
        }
    }
    Ok((values, info))
}

/// What `run.json` records of obtained resources: per resource its spec,
/// content hash, how it was obtained, build seconds, training item ids and
/// its kind's summary (a bridge's training curve).
pub(crate) fn resources_meta(
    specs: &[(String, crate::resources::ResourceSpec)],
    values: &BTreeMap<String, Value>,
    obtained: &BTreeMap<String, ObtainedResource>,
) -> serde_json::Map<String, serde_json::Value> {
    specs
        .iter()
        .filter_map(|(name, spec)| {
            let o = obtained.get(name)?;
            Some((
                name.clone(),
                serde_json::json!({
                    "kind": spec.kind().kind(),
                    "spec": spec,
                    "hash": o.hash,
                    "value_sha256": o.value_sha256,
                    "obtained": o.obtained,
                    "rejected_cache": o.rejected,
                    "build_seconds": o.build_seconds,
                    "build_resumed_after_epoch": o.resumed_after.map(|r| r.epoch),
                    "build_resumed_after_steps": o.resumed_after.map(|r| r.steps),
                    "training_items": o.items,
                    "eval_answers_in_training": o.eval_answers,
                    "summary": values
                        .get(name)
                        .map(|v| spec.kind().summary(v))
                        .unwrap_or(serde_json::Value::Null),
                }),
            ))
        })
        .collect()
}

/// Whether a resource's recorded summary disagrees with a new one: every
/// field the record holds, at any depth, must be equal (a summary may gain
/// fields later); no record, no disagreement. Every number reads back from
/// `run.json` as it was written (serde_json's `float_roundtrip`), so the
/// record and the new summary compare as they are.
fn summary_differs(was: &serde_json::Value, is: &serde_json::Value) -> bool {
    !covered(was, is)
}

/// Whether `is` holds every field of `was` with the same value (objects by
/// key, arrays element by element, other values equal).
fn covered(was: &serde_json::Value, is: &serde_json::Value) -> bool {
    use serde_json::Value::*;
    match (was, is) {
        (Null, _) => true,
        (Object(a), Object(b)) => a
            .iter()
            .all(|(k, v)| b.get(k).is_some_and(|w| covered(v, w))),
        (Array(a), Array(b)) => a.len() == b.len() && a.iter().zip(b).all(|(v, w)| covered(v, w)),
        _ => was == is,
    }
}

/// Refuses to add cells to a run whose finished cells read other resource
/// values: the same spec hash rebuilt into a different value (a bridge
/// retrained after its cache was lost, on another machine or thread count).
/// A resource is the same when its value file's sha256 is; a run recorded
/// before value checksums compares the kind's summary (a bridge's training
/// curve) instead. A folder without finished cells takes any resources.
pub(crate) fn check_resources_unchanged(
    dir: &Path,
    now: &serde_json::Map<String, serde_json::Value>,
) -> Result<()> {
    if records::cell_files(dir)?.is_empty() {
        return Ok(());
    }
    let Some(before) = std::fs::read_to_string(dir.join("run.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
    else {
        return Ok(());
    };
    for (name, was) in before["resources"].as_object().into_iter().flatten() {
        let Some(is) = now.get(name) else { continue };
        let differs = match (was["value_sha256"].as_str(), is["value_sha256"].as_str()) {
            (Some(a), Some(b)) if !a.is_empty() && !b.is_empty() => (a != b)
                .then(|| format!("its value file's sha256 was {a}, is {b}")),
            _ if summary_differs(&was["summary"], &is["summary"]) => Some(format!(
                "the finished cells recorded no value checksum, and its summary differs (was {}, is {})",
                was["summary"], is["summary"]
            )),
            _ => None,
        };
        if let Some(why) = differs {
            return Err(DriverError::OutDir {
                dir: dir.display().to_string(),
                reason: format!(
                    "resource `{name}` is not the one its finished cells read: {why}; \
                     cells made with different resources cannot be merged (restore the \
                     resource cache, or run into another --out)"
                ),
            });
        }
    }
    Ok(())
}

/// The plan of a config, as `--dry-run` prints it: compiled against the
/// receiver's geometry (read from the model file's header, no weights),
/// with the items sampled (tokenizer only), resource hashes and cache
/// status, and an estimate of forward tokens and time.
pub fn dry_run(config_path: &Path, opts: &SweepOptions) -> Result<String> {
    let cfg = load_config(config_path, opts)?;
    let (mcfg, tokenizer, path) = header(&cfg.run.model)?;
    let plan = compile(&cfg, &mcfg, &cfg.run.model, &model_config_of)?;
    let split = split_options(&cfg, mcfg.context_length);
    let (sample, source, _) = sample_items(&cfg, &tokenizer, &split, plan.needs.partners)?;
    let mut out = format!(
        "sweep `{}` (config hash {}), receiver {} ({} layers, width {}, {} kv heads x {}), {}\n{} items from {source}\n",
        cfg.run.name,
        cfg.hash(),
        cfg.run.model,
        mcfg.n_layers,
        mcfg.d_model,
        mcfg.n_kv_heads,
        mcfg.head_dim,
        path.display(),
        sample.items.len()
    );
    let store = Store::new(
        opts.resource_root
            .clone()
            .unwrap_or_else(Store::default_root),
    );
    // Hashes need the training items (tokenizer only) and the model's
    // sha256 as verified on load (remembered beside a fetched file).
    let mut status = BTreeMap::new();
    let eval = eval_set(&sample.items);
    let train = TrainCx {
        tokenizer: &tokenizer,
        split: &split,
        data: &opts.data,
        eval: &eval,
        field: String::new(),
        receiver: &mcfg,
    };
    let sha = if path.is_dir() {
        Some(model_key(None, &path))
    } else {
        tolerable_fetch::provenance::recorded_sha256(&path)?
    };
    // A holder's sha256 as remembered beside its file (the receiver's own
    // id is the receiver's).
    let mut holder_sha = BTreeMap::new();
    for id in holder_ids(&plan.resources) {
        let known = if id == cfg.run.model {
            sha.clone()
        } else {
            let p = tolerable_fetch::resolve(&id)?.path;
            if p.is_dir() {
                Some(model_key(None, &p))
            } else {
                tolerable_fetch::provenance::recorded_sha256(&p)?
            }
        };
        match known {
            Some(s) => {
                holder_sha.insert(id, s);
            }
            None => {
                out.push_str(&format!(
                    "holder {id}: sha256 unknown until its file is verified, on its first load\n"
                ));
            }
        }
    }
    let holders_known = holder_ids(&plan.resources)
        .iter()
        .all(|id| holder_sha.contains_key(id));
    match sha.as_ref().filter(|_| holders_known) {
        Some(sha) => {
            for r in hash_all(
                &plan.resources,
                &train,
                sha,
                &cfg.run.precision,
                &holder_sha,
            )? {
                let cached = store.is_cached(r.spec.kind().kind(), &r.hash, sha);
                status.insert(
                    r.name.clone(),
                    format!(
                        "hash {} {} ({} training items)",
                        r.hash,
                        if cached { "cached" } else { "to build" },
                        r.items.len()
                    ),
                );
            }
        }
        None => {
            for (name, _) in &plan.resources {
                status.insert(
                    name.clone(),
                    "(hash unknown until the model file is verified, on its first load)".into(),
                );
            }
        }
    }
    out.push_str(&plan.describe(&status));
    // Estimate: passes read each context once (the shared prefix once),
    // partners once each, the question per arm; an arm with residual
    // injections also re-reads its context from its first injected position
    // through the layers from its lowest one (counted in whole-model tokens);
    // decoding is batched.
    let mut pass_tokens = 0usize;
    let mut question_tokens = 0usize;
    let mut restart_tokens = 0f64;
    for it in &sample.items {
        let p = it.pair();
        pass_tokens += p.alt_len() + p.base.len() + plan.needs.partners * p.alt_len();
        if !plan.needs.queries.is_empty() {
            question_tokens += p.suffix.len();
        }
        question_tokens += p.suffix.len() * plan.programs.len();
        let g = crate::passes::geometry(&p);
        for prog in &plan.programs {
            let start = prog
                .resid_steps
                .iter()
                .flat_map(|s| s.layers.iter().copied())
                .min();
            let p0 = prog
                .resid_steps
                .iter()
                .flat_map(|s| s.positions.resolve(&g))
                .min();
            if let (Some(start), Some(p0)) = (start, p0) {
                let depth = mcfg.n_layers.saturating_sub(start) as f64 / mcfg.n_layers as f64;
                restart_tokens += g.context_len.saturating_sub(p0) as f64 * depth;
            }
        }
    }
    let restart_tokens = restart_tokens.round() as usize;
    let decode_tokens = sample.items.len() * plan.programs.len() * cfg.run.new_tokens;
    // Rates fitted (least squares) to the wall time of four 0.5B sweeps on
    // this 2-core AVX2 machine (layer-budget, cosine-vs-consumability,
    // sparse-damage, act-augment: 45-150 minutes each; the fit is within
    // 10% of three and 23% over sparse-damage): about 107 prefill tokens/s and 22.5 decoded tokens/s per
    // arm-item, the latter including the per-arm costs that scale with it.
    // Scaled to other models by parameters.
    let scale = speed_relative_to_05b(&mcfg);
    let rate = PREFILL_TOKENS_PER_S_05B * scale;
    let decode_rate = DECODED_TOKENS_PER_S_05B * scale;
    // The rates were fitted to sweeps batching each item's arms by cache
    // layout; decoding arms one at a time is slower than they say.
    let (way, mut batching) = batching(&cfg);
    if way == Batching::OneAtATime {
        batching.push_str(": slower than the rate below, fitted to batched sweeps");
    }
    let secs = (pass_tokens + question_tokens + restart_tokens) as f64 / rate
        + decode_tokens as f64 / decode_rate;
    let res_tokens: usize = plan
        .resources
        .iter()
        .filter(|(n, _)| status.get(n).is_some_and(|s| s.contains("to build")))
        .map(|(_, s)| s.kind().estimate_tokens())
        .sum();
    out.push_str(&format!(
        "estimate: {pass_tokens} context tokens in passes, {restart_tokens} in residual restarts (whole-model equivalent), {question_tokens} question tokens, {decode_tokens} decoded tokens ({batching}), {res_tokens} tokens to build resources; about {:.0} min at ~{rate:.0} prefill and ~{decode_rate:.1} decoded tokens/s (rates fitted to this 2-core machine's 0.5B sweeps, scaled by parameters; rough)\n",
        (secs + res_tokens as f64 / rate) / 60.0
    ));
    Ok(out)
}

/// The cross-family holders (model ids) the resources of a plan read.
fn holder_ids(resources: &[(String, ResourceSpec)]) -> Vec<String> {
    let mut ids: Vec<String> = resources
        .iter()
        .flat_map(|(_, s)| s.kind().holders())
        .collect();
    ids.sort();
    ids.dedup();
    ids
}

/// Loads the cross-family holders of a plan's resources: the receiver's own
/// id reuses the receiver (the identity sanity projection).
fn load_holders(
    resources: &[(String, ResourceSpec)],
    receiver_id: &str,
    ck: &Checkpoint,
    precision: Precision,
) -> Result<BTreeMap<String, CrossHolder>> {
    let mut out = BTreeMap::new();
    for id in holder_ids(resources) {
        let h = if id == receiver_id {
            CrossHolder {
                id: id.clone(),
                model: ck.model.clone(),
                tokenizer: ck.tokenizer.clone(),
                sha256: model_key(ck.sha256.as_deref(), &ck.path),
            }
        } else {
            let t0 = Instant::now();
            let hk = tolerable_fetch::load(&id, precision, &candle_core::Device::Cpu)?;
            let c = hk.model.config();
            tracing::info!(
                "cross-family holder {id} loaded in {:.1} s: {} layers, width {}, {} kv heads x {} (sha256 {})",
                t0.elapsed().as_secs_f64(),
                c.n_layers,
                c.d_model,
                c.n_kv_heads,
                c.head_dim,
                hk.sha256.as_deref().unwrap_or("not hashed")
            );
            CrossHolder {
                id: id.clone(),
                sha256: model_key(hk.sha256.as_deref(), &hk.path),
                model: hk.model,
                tokenizer: hk.tokenizer,
            }
        };
        out.insert(id, h);
    }
    Ok(out)
}

fn eval_set(items: &[SplitItem]) -> EvalSet {
    EvalSet::of(items)
}

/// Runs (or resumes, or merges) a sweep.
pub fn run(config_path: &Path, opts: &SweepOptions) -> Result<SweepOutcome> {
    let cfg = load_config(config_path, opts)?;
    let dir = out_dir(&cfg, opts);
    let hash = cfg.hash();
    check_out_dir(&dir, &hash)?;
    let n_cells = cfg.data.n.div_ceil(cfg.run.cell_items);
    if opts.merge_only {
        let out = finish(&cfg, &dir, n_cells, 0)?;
        if !out.summary_written {
            let missing: Vec<String> = (0..n_cells)
                .filter(|&c| !cell_path(&dir, c).exists())
                .map(|c| c.to_string())
                .collect();
            return Err(DriverError::Records(format!(
                "--merge: {} of {n_cells} cells are missing in {} (cells {}); run the remaining shards first",
                missing.len(),
                dir.display(),
                missing.join(", ")
            )));
        }
        record_summary(&dir)?;
        return Ok(out);
    }
    if let Some((i, n)) = opts.shard {
        if n == 0 || i >= n {
            return Err(DriverError::Config(format!(
                "--shard {i}/{n}: need 0 <= i < n"
            )));
        }
    }
    let precision: Precision = cfg
        .run
        .precision
        .parse()
        .map_err(|e| DriverError::Config(format!("[run] precision: {e}")))?;
    // Every arm must compile, and the folder must be writable, before the model loads.
    let (mcfg, _, _) = header(&cfg.run.model)?;
    let plan = compile(&cfg, &mcfg, &cfg.run.model, &model_config_of)?;
    check_writable(&dir, bytes_needed(cfg.data.n, cfg.arms.len()))?;
    let t_load = Instant::now();
    let mut ck = tolerable_fetch::load(&cfg.run.model, precision, &candle_core::Device::Cpu)?;
    ck.model = ck.model.with_row_kernel(cfg.run.row_kernel);
    tracing::info!(
        "loaded {} in {:.1} s (sha256 {})",
        cfg.run.model,
        t_load.elapsed().as_secs_f64(),
        ck.sha256.as_deref().unwrap_or("not hashed")
    );
    let ctx = ck.model.config().context_length;
    if cfg.run.new_tokens >= ctx {
        return Err(DriverError::Config(format!(
            "[run] new_tokens {} leaves no room in a context of {ctx}",
            cfg.run.new_tokens
        )));
    }
    let split = split_options(&cfg, ctx);
    let (sample, source, set) = sample_items(&cfg, &ck.tokenizer, &split, plan.needs.partners)?;
    // Gates first: no record is written if one fails.
    let t_gates = Instant::now();
    let gates = crate::gates::run_all(&ck, false)?;
    tracing::info!(
        "gates {} in {:.1} s",
        if gates["passed"] == true {
            "passed"
        } else {
            "FAILED"
        },
        t_gates.elapsed().as_secs_f64()
    );
    if gates["passed"] != true {
        return Err(DriverError::Gate(format!(
            "{} failed the verification gates; nothing was written: {}",
            cfg.run.model,
            serde_json::to_string(&gates).unwrap_or_default()
        )));
    }
    // Resources after the gates: nothing is built for a receiver that fails one.
    let store = Store::new(
        opts.resource_root
            .clone()
            .unwrap_or_else(Store::default_root),
    );
    // Held-out senders, built from the receiver and gated before any eval
    // item (and before the resources: fitted maps read their keys).
    let gate_prompt = ck
        .tokenizer
        .encode(tolerable_runtime::gates::SQUAD_PROMPT)?;
    let mut senders = BTreeMap::new();
    let mut sender_reports = serde_json::Map::new();
    for (key, spec) in &plan.senders {
        let t0 = Instant::now();
        let (model, report) = crate::senders::build(&ck.model, spec, &gate_prompt)?;
        tracing::info!(
            "sender `{key}` built and gated in {:.1} s: weight cosine {:.5}, cache cosine {:.5} to the receiver, matrices {:?}",
            t0.elapsed().as_secs_f64(),
            report.weight_cosine,
            report.cache_cosine,
            report.matrix_types
        );
        sender_reports.insert(
            key.clone(),
            serde_json::to_value(&report).unwrap_or_default(),
        );
        senders.insert(key.clone(), model);
    }
    // Cross-family holders (other models read through a projection).
    let holders = load_holders(&plan.resources, &cfg.run.model, &ck, precision)?;
    let eval = eval_set(&sample.items);
    let (resources, obtained) = obtain_resources(
        &plan.resources,
        &ck,
        &cfg.run.precision,
        &TrainCx {
            tokenizer: &ck.tokenizer,
            split: &split,
            data: &opts.data,
            eval: &eval,
            field: String::new(),
            receiver: ck.model.config(),
        },
        &senders,
        &holders,
        &store,
        Some(&dir),
    )?;
    // Every invocation on this folder (first run, resumes, shards) is kept;
    // the top-level command, revision and threads are the latest's.
    let revision = git_revision();
    let previous: Option<serde_json::Value> = std::fs::read_to_string(dir.join("run.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    let mut invocations: Vec<serde_json::Value> = previous
        .as_ref()
        .and_then(|v| v["invocations"].as_array().cloned())
        .unwrap_or_default();
    // Earlier `--merge`s of the folder stay recorded.
    let summaries = previous.as_ref().and_then(|v| v.get("summaries").cloned());
    let (batching, batching_text) = batching(&cfg);
    invocations.push(crate::measure::invocation(
        &tolerable_runtime::matmul_backend(cfg.run.row_kernel),
        serde_json::json!({
            "shard": opts.shard.map(|(i, n)| format!("{i}/{n}")),
            "batching": batching_text,
        }),
    ));
    // Each resource was compared with the finished cells' record as it was
    // obtained (`obtain_resources`).
    let resources_meta = resources_meta(&plan.resources, &resources, &obtained);
    let mut meta = serde_json::json!({
        "name": cfg.run.name,
        "config_hash": hash,
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
        "git_revision": revision,
        "build_revision": crate::measure::build_revision(),
        "seeds": { "sample": cfg.run.seed, "pairing": cfg.run.seed, "perturbation": cfg.run.seed },
        "data": {
            "source": cfg.data.source.name(),
            "from": source,
            "n": sample.items.len(),
            "considered": sample.considered,
            "dropped": sample.dropped,
            "item_ids": sample.ids(),
        },
        "resources": resources_meta,
        "senders": sender_reports,
        "holders": holders
            .values()
            .map(|h| (h.id.clone(), serde_json::json!({
                "sha256": h.sha256,
                "config": h.model.config(),
            })))
            .collect::<serde_json::Map<String, serde_json::Value>>(),
        "template": cfg.run.template,
        "new_tokens": cfg.run.new_tokens,
        "max_prompt_tokens": split.max_prompt_tokens,
        "cell_items": cfg.run.cell_items,
        "cells": n_cells,
        "gates": gates,
        "threads": candle_core::utils::get_num_threads(),
        "matmul_backend": tolerable_runtime::matmul_backend(cfg.run.row_kernel),
        "batching": batching_text,
        "machine": tolerable_runtime::machine(),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "invocations": invocations,
    });
    if let Some(list) = summaries {
        meta["summaries"] = list;
    }
    write_json_atomic(&dir.join("run.json"), &meta)?;
    records::write_rows(
        sample_rows(&cfg.run.name, &set),
        &dir.join("sample.parquet"),
    )?;
    // What the resources report of their fitting (a bridge's training curve).
    let mut resource_rows = Vec::new();
    for (name, spec) in &plan.resources {
        if let Some(v) = resources.get(name) {
            for (epoch, metric, value) in spec.kind().report_rows(v) {
                resource_rows.push(records::ResourceRow {
                    run: cfg.run.name.clone(),
                    resource: name.clone(),
                    kind: spec.kind().kind().to_string(),
                    hash: obtained[name].hash.clone(),
                    epoch,
                    metric,
                    value,
                });
            }
        }
    }
    if !resource_rows.is_empty() {
        records::write_rows(resource_rows, &dir.join("resources.parquet"))?;
    }

    let mine: Vec<usize> = (0..n_cells)
        .filter(|c| opts.shard.is_none_or(|(i, n)| c % n == i))
        .collect();
    let todo: Vec<usize> = mine
        .iter()
        .copied()
        .filter(|&c| !cell_path(&dir, c).exists())
        .collect();
    let skipped = mine.len() - todo.len();
    if skipped > 0 {
        tracing::info!(
            "resuming: {skipped} of {} cells already finished in {}",
            mine.len(),
            dir.display()
        );
    }
    let n_items: usize = todo
        .iter()
        .map(|&c| (cfg.data.n - c * cfg.run.cell_items).min(cfg.run.cell_items))
        .sum();
    let bar = ProgressBar::new(n_items as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{prefix} {bar:30} {pos}/{len} items {per_sec} eta {eta} {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_prefix(format!("sweep {} ({} arms)", cfg.run.name, cfg.arms.len()));
    let headless = !std::io::stderr().is_terminal();
    let hashes: BTreeMap<String, String> = obtained
        .iter()
        .map(|(n, o)| (n.clone(), o.hash.clone()))
        .collect();
    let columns = arm_columns(&cfg, &plan, &hashes);
    let runner = Runner::new(
        &ck.model,
        &plan,
        &resources,
        cfg.run.new_tokens,
        cfg.run.seed,
    )
    .with_batching(batching)
    .with_senders(&senders)
    .with_cross_holders(&ck.tokenizer, &holders);
    let t_run = Instant::now();
    let setup_seconds = t_load.elapsed().as_secs_f64();
    let mut done = 0usize;
    let mut batches = 0usize;
    for (k, &c) in todo.iter().enumerate() {
        bar.set_message(format!("cell {c}"));
        let lo = c * cfg.run.cell_items;
        let hi = (lo + cfg.run.cell_items).min(set.items.len());
        let mut rows = Vec::new();
        let items: Vec<usize> = (lo..hi).collect();
        for chunk in items.chunks(cfg.run.item_batch) {
            let jobs: Vec<ItemJob> = chunk
                .iter()
                .map(|&i| ItemJob {
                    pair: &set.pairs[i],
                    index: i,
                    partners: set.partners_of(i),
                })
                .collect();
            let outs = runner.run_items_timed(&jobs)?;
            batches += outs.iter().map(|(_, t)| t.batches).sum::<usize>();
            for (&i, (outs, _)) in chunk.iter().zip(&outs) {
                rows.extend(item_rows(
                    &cfg,
                    &columns,
                    &ck,
                    &set.items[i],
                    i,
                    outs,
                    plan.native,
                )?);
            }
            bar.inc(chunk.len() as u64);
            done += chunk.len();
        }
        records::write_rows(rows, &cell_path(&dir, c))?;
        record_time(
            &mut meta,
            &dir,
            serde_json::json!({
                "setup_seconds": setup_seconds,
                "cells_computed": k + 1,
                "items_computed": done,
                "cell_seconds": t_run.elapsed().as_secs_f64(),
                "decode_batches": batches,
            }),
        )?;
        if headless {
            let rate = done as f64 / t_run.elapsed().as_secs_f64().max(1e-9);
            tracing::info!(
                "cell {c} written: {done}/{n_items} items this invocation, {rate:.2} items/s, eta {:.0} s",
                (n_items - done) as f64 / rate.max(1e-9)
            );
        }
    }
    bar.finish_and_clear();
    finish(&cfg, &dir, n_cells, todo.len()).map(|mut o| {
        o.skipped = skipped;
        o
    })
}

/// The arms' record columns: their fields, every injection as the plan
/// compiled it, and the hashes of the resources they read.
pub fn arm_columns(
    cfg: &SweepConfig,
    plan: &Plan,
    hashes: &BTreeMap<String, String>,
) -> Vec<ArmColumns> {
    cfg.arms
        .iter()
        .zip(&plan.programs)
        .map(|(pa, p)| {
            ArmColumns::of(
                &cfg.run.name,
                pa,
                p.steps().map(|s| s.describe()).collect(),
                p.resources
                    .iter()
                    .map(|r| format!("{r}={}", hashes.get(r).cloned().unwrap_or_default()))
                    .collect(),
            )
        })
        .collect()
}

fn sample_rows(run: &str, set: &ItemSet) -> Vec<SampleRow> {
    set.items
        .iter()
        .enumerate()
        .map(|(i, it)| SampleRow {
            run: run.to_string(),
            item_index: i as i64,
            item_id: it.item.id.clone(),
            title: it.item.title.clone(),
            question: it.item.question.clone(),
            answers: it.item.answers.clone(),
            passage: it.item.context.clone(),
            passage_start: it.prefix_ids.len() as i64,
            fact_positions: it.fact_positions().iter().map(|&p| p as u32).collect(),
            prompt_tokens: it.full_prompt().len() as i64,
            answer_spans: it.n_answer_spans as i64,
        })
        .collect()
}

fn item_rows(
    cfg: &SweepConfig,
    columns: &[ArmColumns],
    ck: &Checkpoint,
    it: &SplitItem,
    index: usize,
    outs: &[crate::runner::ArmOutcome],
    native: usize,
) -> Result<Vec<ItemRow>> {
    let texts: Vec<String> = outs
        .iter()
        .map(|o| ck.tokenizer.decode(&o.tokens))
        .collect::<std::result::Result<_, _>>()?;
    let native_correct = score(&texts[native], &it.item.answers, &it.item.context).correct;
    let mut rows = Vec::with_capacity(outs.len());
    for (a, o) in outs.iter().enumerate() {
        if o.bit_exact == Some(false) {
            return Err(DriverError::Gate(format!(
                "arm `{}` on item {} is not bit-exact to its anchor ({:?}); no record of this cell was written",
                cfg.arms[a].arm.name, it.item.id, cfg.arms[a].arm.expect
            )));
        }
        let sc = score(&texts[a], &it.item.answers, &it.item.context);
        rows.push(ItemRow {
            arm: columns[a].clone(),
            item_index: index as i64,
            item_id: it.item.id.clone(),
            prompt_tokens: it.full_prompt().len() as i64,
            fact_tokens: it.fact_region.len() as i64,
            n_sites: o.measures.n_sites as i64,
            continuation: texts[a].clone(),
            continuation_ids: o.tokens.clone(),
            correct: sc.correct,
            span_copy: sc.span_copy,
            native_correct,
            fidelity_cosine: o.measures.fidelity_cosine,
            achieved_cosine: o.measures.achieved_cosine,
            achieved_at: records::columns::PerSite(o.measures.achieved_at.clone()),
            logit_correlation: o.measures.logit_correlation,
            bit_exact: o.bit_exact,
            seconds: o.seconds,
        });
    }
    Ok(rows)
}

/// Writes the summary when every cell is finished.
fn finish(cfg: &SweepConfig, dir: &Path, n_cells: usize, computed: usize) -> Result<SweepOutcome> {
    let present = (0..n_cells).filter(|&c| cell_path(dir, c).exists()).count();
    let mut out = SweepOutcome {
        dir: dir.to_path_buf(),
        cells: n_cells,
        computed,
        skipped: 0,
        summary_written: false,
    };
    if present < n_cells {
        tracing::info!(
            "{present} of {n_cells} cells finished in {}; rerun without --shard (or with --merge) once all shards are done",
            dir.display()
        );
        return Ok(out);
    }
    let items = records::read_items(dir)?;
    let rows = summary_rows(cfg, &items)?;
    records::write_rows(rows, &dir.join("summary.parquet"))?;
    out.summary_written = true;
    Ok(out)
}

/// The per-arm summary of item rows, with the arms' columns as the cells
/// recorded them (resource hashes included); cells of shards that read
/// other resources do not merge.
fn summary_rows(cfg: &SweepConfig, items: &[ItemRow]) -> Result<Vec<records::SummaryRow>> {
    let mut columns = Vec::with_capacity(cfg.arms.len());
    for pa in &cfg.arms {
        let mut rows = items.iter().filter(|r| r.arm.arm == pa.arm.name);
        let first = rows.next().ok_or_else(|| {
            DriverError::Records(format!("no item rows for arm `{}`", pa.arm.name))
        })?;
        if let Some(other) = rows.find(|r| r.arm.resources != first.arm.resources) {
            return Err(DriverError::Records(format!(
                "arm `{}`: item {} read resources {:?}, item {} read {:?}; shards of one run must read the same resources",
                pa.arm.name, first.item_id, first.arm.resources, other.item_id, other.arm.resources
            )));
        }
        columns.push(first.arm.clone());
    }
    records::summarize(cfg, &columns, items)
}

/// How much of a sweep its finished cells cover (an interim summary's
/// extent).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SweepCoverage {
    /// Cells of the whole sweep.
    pub cells: usize,
    /// The finished cells, by number.
    pub finished: Vec<usize>,
    /// Items of the whole sweep's sample.
    pub n: usize,
    /// Items in the finished cells.
    pub items: usize,
}

impl SweepCoverage {
    /// Whether every cell is finished (the interim summary is then the
    /// run's own).
    pub fn complete(&self) -> bool {
        self.finished.len() == self.cells
    }
}

/// The summary of a sweep in progress over the cells it has finished,
/// read from the run folder alone: the expanded config recorded in
/// `run.json` (checked against its hash) and the cell files. Each cell
/// holds consecutive items of the seeded sample, so the finished items are
/// a seeded random subset of it; the anchors are re-read on the same
/// items. Nothing in the folder is written or changed.
pub fn interim_summary(dir: &Path) -> Result<(Vec<records::SummaryRow>, SweepCoverage)> {
    let meta_path = dir.join("run.json");
    let meta = crate::measure::read_json(&meta_path)?;
    let cfg: SweepConfig = serde_json::from_value(meta["config"].clone()).map_err(|e| {
        DriverError::Records(format!(
            "{}: its `config` is not a sweep config this build reads ({e})",
            meta_path.display()
        ))
    })?;
    let recorded = meta["config_hash"].as_str().unwrap_or("");
    if cfg.hash() != recorded {
        return Err(DriverError::Records(format!(
            "{}: the recorded config hashes to {}, not its recorded hash {recorded}; it was written by a build with another config schema",
            meta_path.display(),
            cfg.hash()
        )));
    }
    let n_cells = cfg.data.n.div_ceil(cfg.run.cell_items);
    let finished: Vec<usize> = (0..n_cells)
        .filter(|&c| cell_path(dir, c).exists())
        .collect();
    if finished.is_empty() {
        return Err(DriverError::Records(format!(
            "{}: no finished cells yet (none of its {n_cells} cell files under items/)",
            dir.display()
        )));
    }
    let items = records::read_items(dir)?;
    let n_items = items
        .iter()
        .map(|r| r.item_id.as_str())
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    let rows = summary_rows(&cfg, &items)?;
    Ok((
        rows,
        SweepCoverage {
            cells: n_cells,
            finished,
            n: cfg.data.n,
            items: n_items,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_is_not_resumed_with_other_matmul_kernels() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        std::fs::create_dir_all(run.join("items")).unwrap();
        let default = tolerable_runtime::MATMUL_BACKEND.to_string();
        let avx512 = format!("{default}{}", tolerable_runtime::AVX512_KERNELS);
        let meta = |b: &str| {
            serde_json::json!({
                "config_hash": "h",
                "matmul_backend": b,
                "invocations": [{ "matmul_backend": default.clone() }, { "matmul_backend": b }],
            })
        };
        // Kernels as recorded: fine; the other kernels: refused, naming both.
        check_kernels_unchanged(&run, &meta(&default), false).unwrap();
        let e = check_kernels_unchanged(&run, &meta(&default), true)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("AVX-512") && e.contains("cannot be merged"),
            "{e}"
        );
        // One invocation with AVX-512 among default ones: refused either way.
        for now in [false, true] {
            assert!(check_kernels_unchanged(&run, &meta(&avx512), now).is_err());
        }
        // Through the output-folder check: only once cells exist, and with
        // this build's own kernels.
        let other = if tolerable_runtime::avx512_kernels() {
            &default
        } else {
            &avx512
        };
        let other_meta = serde_json::json!({
            "config_hash": "h",
            "matmul_backend": other,
            "invocations": [{ "matmul_backend": other }],
        });
        std::fs::write(run.join("run.json"), other_meta.to_string()).unwrap();
        check_out_dir(&run, "h").unwrap();
        std::fs::write(run.join("items/cell-00000.parquet"), b"x").unwrap();
        let e = check_out_dir(&run, "h").unwrap_err().to_string();
        assert!(e.contains("round differently"), "{e}");
        let mine = tolerable_runtime::matmul_backend(false);
        let own = serde_json::json!({ "config_hash": "h", "matmul_backend": mine,
            "invocations": [{ "matmul_backend": mine }] });
        std::fs::write(run.join("run.json"), own.to_string()).unwrap();
        check_out_dir(&run, "h").unwrap();
    }

    #[test]
    fn an_output_folder_without_room_is_refused_before_any_work() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("run");
        check_writable(&out, bytes_needed(10, 3)).unwrap();
        let e = check_writable(&out, u64::MAX).unwrap_err().to_string();
        assert!(e.contains("MiB free") && e.contains("need about"), "{e}");
        let e = check_writable(&dir.path().join("run/items/x/\0"), 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot be created"), "{e}");
    }

    #[test]
    fn cells_made_with_other_resource_values_are_not_added_to() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path();
        let meta = |v: serde_json::Value| v.as_object().unwrap().clone();
        let write_run = |resources: serde_json::Value| {
            std::fs::write(
                run.join("run.json"),
                serde_json::json!({ "resources": resources }).to_string(),
            )
            .unwrap();
        };
        let bridge = |sha: &str, curve: f64| serde_json::json!({ "value_sha256": sha, "summary": { "curve": [curve] } });
        write_run(serde_json::json!({ "lora": bridge("aa", 0.5) }));
        let other = meta(serde_json::json!({ "lora": bridge("bb", 0.5) }));
        // No finished cells yet: any resources are taken.
        check_resources_unchanged(run, &other).unwrap();
        std::fs::create_dir_all(run.join("items")).unwrap();
        std::fs::write(run.join("items/cell-00000.parquet"), b"x").unwrap();
        // The same value again: fine. Another value of the same spec: refused,
        // naming the resource and both checksums.
        check_resources_unchanged(run, &meta(serde_json::json!({ "lora": bridge("aa", 0.5) })))
            .unwrap();
        let e = check_resources_unchanged(run, &other)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`lora`") && e.contains("aa") && e.contains("bb"),
            "{e}"
        );
        // A run recorded before value checksums: its summary decides.
        write_run(serde_json::json!({ "lora": { "summary": { "curve": [0.5] } } }));
        check_resources_unchanged(run, &other).unwrap();
        let e =
            check_resources_unchanged(run, &meta(serde_json::json!({ "lora": bridge("bb", 0.6) })))
                .unwrap_err()
                .to_string();
        assert!(e.contains("`lora`") && e.contains("summary differs"), "{e}");
        // Every float survives run.json exactly (serde_json's
        // `float_roundtrip`): values that its default parser read back one
        // unit off in the last digit (a gate's max |dlogit|, a sender's
        // cosine, a series of losses) read back as written, through a
        // record, and an identical retrain is not refused.
        let floats = [0.9934597781223033, 0.00009059906005859375]
            .into_iter()
            .chain((1..20_000u64).map(|i| 3.0 + i as f64 * 1.234_567_891_234_5e-7));
        for x in floats {
            let back: serde_json::Value =
                serde_json::from_str(&serde_json::json!({ "x": x }).to_string()).unwrap();
            assert_eq!(
                back["x"].as_f64().map(f64::to_bits),
                Some(x.to_bits()),
                "{x}"
            );
        }
        let x = 3.0 + 7.0 * 1.234_567_891_234_5e-7;
        write_run(serde_json::json!({ "lora": { "summary": { "curve": [{ "loss": x }] } } }));
        let now = serde_json::json!({ "lora": { "summary": { "curve": [{ "loss": x }] } } });
        check_resources_unchanged(run, &meta(now)).unwrap();
        write_run(serde_json::json!({ "lora": { "summary": { "curve": [0.5] } } }));
        // A field the record lacks (added to summaries later), at any depth,
        // is not compared.
        check_resources_unchanged(
            run,
            &meta(serde_json::json!({ "lora": { "summary": { "curve": [0.5] } } })),
        )
        .unwrap();
        check_resources_unchanged(
            run,
            &meta(serde_json::json!({ "lora": { "summary": { "curve": [0.5], "new": 1 } } })),
        )
        .unwrap();
        // A resource the new plan does not read is not compared.
        check_resources_unchanged(run, &meta(serde_json::json!({}))).unwrap();
    }
}
