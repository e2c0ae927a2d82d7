//! A sweep: the grid of arms over a sample of items, cut into cells of
//! items. Gates run first; each finished cell is written atomically; a
//! rerun skips finished cells, so a killed sweep resumes where it stopped
//! and shards of one sweep merge into one folder.

use crate::config::SweepConfig;
use crate::error::{io, DriverError, Result};
use crate::records::{self, ArmColumns, ItemRow};
use crate::runner::{Batching, Runner};
use indicatif::{ProgressBar, ProgressStyle};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tolerable_probe::score::score;
use tolerable_probe::{SplitItem, SplitOptions, Template};
use tolerable_runtime::{Checkpoint, ModelConfig, Precision};

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
    /// Batching of arms (batched unless measuring the baseline).
    pub one_at_a_time: bool,
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

/// Reads a sender's config (for shape checks) from a catalog id or a GGUF path.
pub fn model_config_of(id: &str) -> Result<ModelConfig> {
    let path = if Path::new(id).exists() {
        PathBuf::from(id)
    } else {
        tolerable_runtime::catalog::cached(id)?.ok_or_else(|| {
            DriverError::Config(format!(
                "model `{id}` is not cached; run `cargo xtask fetch-model {id}`"
            ))
        })?
    };
    let mut f = std::fs::File::open(&path).map_err(io(format!("opening {}", path.display())))?;
    let ct = candle_core::quantized::gguf_file::Content::read(&mut f)
        .map_err(|e| DriverError::Config(format!("reading {}: {e}", path.display())))?;
    Ok(ModelConfig::from_gguf(&ct)?)
}

fn git_revision() -> String {
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
            let dirty = run(&["status", "--porcelain", "--untracked-files=no"])
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

fn write_json_atomic(path: &Path, v: &serde_json::Value) -> Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(v).unwrap_or_default())
        .map_err(io(format!("writing {}", tmp.display())))?;
    std::fs::rename(&tmp, path).map_err(io(format!("renaming {}", tmp.display())))?;
    Ok(())
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
    } else if !records::cell_files(dir)?.is_empty() {
        return Err(DriverError::OutDir {
            dir: dir.display().to_string(),
            reason: "it holds item files but no run.json".into(),
        });
    }
    Ok(())
}

/// Runs (or resumes, or merges) a sweep.
pub fn run(config_path: &Path, opts: &SweepOptions) -> Result<SweepOutcome> {
    let cfg = load_config(config_path, opts)?;
    let dir = out_dir(&cfg, opts);
    let hash = cfg.hash();
    check_out_dir(&dir, &hash)?;
    let n_cells = cfg.data.n.div_ceil(cfg.run.cell_items);
    if opts.merge_only {
        return finish(&cfg, &dir, n_cells, 0);
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
    let t_load = Instant::now();
    let ck = Checkpoint::load(&cfg.run.model, precision, &candle_core::Device::Cpu)?;
    tracing::info!(
        "loaded {} in {:.1} s",
        cfg.run.model,
        t_load.elapsed().as_secs_f64()
    );
    // Every arm must apply before any work.
    cfg.validate(ck.model.config(), &cfg.run.model, &model_config_of)?;
    let ctx = ck.model.config().context_length;
    if cfg.run.new_tokens >= ctx {
        return Err(DriverError::Config(format!(
            "[run] new_tokens {} leaves no room in a context of {ctx}",
            cfg.run.new_tokens
        )));
    }
    let (items, source) = crate::data::load_items(&cfg.data, None, cfg.run.seed)?;
    let split = SplitOptions {
        template: if cfg.run.template == "chat" {
            Template::Chat
        } else {
            Template::Raw
        },
        max_prompt_tokens: cfg.run.max_prompt_tokens.min(ctx - cfg.run.new_tokens),
        ..SplitOptions::default()
    };
    let sample =
        tolerable_probe::sample::sample(&items, &ck.tokenizer, &split, cfg.data.n, cfg.run.seed)?;
    tracing::info!(
        "{} items from {source} (seed {}, {} considered, dropped {:?})",
        sample.items.len(),
        cfg.run.seed,
        sample.considered,
        sample.dropped
    );
    let floor = cfg.anchor(crate::arm::Base::Masked);
    let native = cfg.anchor(crate::arm::Base::Full);
    let runner = Runner::new(
        &ck.model,
        &cfg.arms,
        floor,
        native,
        cfg.run.new_tokens,
        cfg.run.seed,
    )?
    .with_batching(if opts.one_at_a_time {
        Batching::OneAtATime
    } else {
        Batching::Batched
    });
    let partners = if runner.needs_partner() {
        Some(crate::data::partners(&sample.items, cfg.run.seed)?)
    } else {
        None
    };
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
    std::fs::create_dir_all(dir.join("items"))
        .map_err(io(format!("creating {}", dir.display())))?;
    // Every invocation on this folder (first run, resumes, shards) is kept.
    let mut invocations: Vec<serde_json::Value> = std::fs::read_to_string(dir.join("run.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v["invocations"].as_array().cloned())
        .unwrap_or_default();
    invocations.push(serde_json::json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "git_revision": git_revision(),
        "shard": opts.shard.map(|(i, n)| format!("{i}/{n}")),
        "gates_passed": true,
        "unix_time": std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    }));
    let meta = serde_json::json!({
        "name": cfg.run.name,
        "config_hash": hash,
        "config_file": config_path.display().to_string(),
        "config": cfg,
        "model": {
            "id": cfg.run.model,
            "sha256": ck.sha256,
            "path": ck.path.display().to_string(),
            "precision": cfg.run.precision,
            "config": ck.model.config(),
        },
        "git_revision": git_revision(),
        "seeds": { "sample": cfg.run.seed, "pairing": cfg.run.seed, "perturbation": cfg.run.seed },
        "data": {
            "source": cfg.data.source.name(),
            "from": source,
            "n": sample.items.len(),
            "considered": sample.considered,
            "dropped": sample.dropped,
            "item_ids": sample.ids(),
        },
        "template": cfg.run.template,
        "new_tokens": cfg.run.new_tokens,
        "max_prompt_tokens": split.max_prompt_tokens,
        "cell_items": cfg.run.cell_items,
        "cells": n_cells,
        "gates": gates,
        "threads": candle_core::utils::get_num_threads(),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "invocations": invocations,
    });
    write_json_atomic(&dir.join("run.json"), &meta)?;

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
    let columns: Vec<ArmColumns> = cfg.arms.iter().map(ArmColumns::of).collect();
    for &c in &todo {
        bar.set_message(format!("cell {c}"));
        let lo = c * cfg.run.cell_items;
        let hi = (lo + cfg.run.cell_items).min(sample.items.len());
        let mut rows = Vec::new();
        for i in lo..hi {
            let it = &sample.items[i];
            let partner: Option<&SplitItem> = partners.as_ref().map(|p| &sample.items[p[i]]);
            let outs = runner.run_item(it, i, partner)?;
            rows.extend(item_rows(&cfg, &columns, &ck, it, i, &outs, native)?);
            bar.inc(1);
        }
        let mut df = records::items_frame(&cfg.run.name, &rows)?;
        records::write_parquet_atomic(&mut df, &cell_path(&dir, c))?;
    }
    bar.finish_and_clear();
    finish(&cfg, &dir, n_cells, todo.len()).map(|mut o| {
        o.skipped = skipped;
        o
    })
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
            n_sites: o.n_sites as i64,
            continuation: texts[a].clone(),
            continuation_ids: o
                .tokens
                .iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .join(" "),
            correct: sc.correct,
            span_copy: sc.span_copy,
            native_correct,
            fidelity_cosine: o.fidelity_cosine,
            achieved_cosine: o.achieved_cosine,
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
    let rows = records::summarize(cfg, &items)?;
    let mut df = records::summary_frame(&cfg.run.name, &rows)?;
    records::write_parquet_atomic(&mut df, &dir.join("summary.parquet"))?;
    out.summary_written = true;
    Ok(out)
}
