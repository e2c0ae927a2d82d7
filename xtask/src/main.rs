//! `cargo xtask`: the project's command line.
//!
//! - `fetch-model <id>`: download, assemble, verify and cache a model (with
//!   its `.verified` sidecar).
//! - `generate --model <id> --prompt-file F --tokens N [--json] [--chat]`.
//! - `gates --model <id>`: run the parity, rebuild and identity gates.
//! - `bench [--model <id>] [--json]`: speed figures as ratios against candle-transformers.
//! - `sweep [--config F] [--out D] [--shard i/n] [--data squad_dev=P] [--n N]`: run a sweep.
//! - `measure [--config F] [--out D] [--contexts a,b] [--dry-run]`: a
//!   measurement run (`[measure]` configs: Mode D); `sweep --config F` on
//!   such a config runs it too.
//! - `report <run-dir> [--interim] [--pair family:against] [--seeds run-dir]`:
//!   Markdown tables and plots of a run, with families (or named arms)
//!   compared point by point and trained arms combined across seed runs.
//! - `compare <run-a> <run-b> [--pair a_side:b_side]`: item rows of two runs
//!   compared value for value, or arms of the two runs paired item by item.
#![allow(clippy::cloned_ref_to_slice_refs)] // `&[ids.clone()]` reads better as a batch of one

mod anchors;
mod bench;
mod bench_arms;
mod bench_train;
mod measure;
mod prompts;
mod sweep;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use tolerable_fetch::{catalog, hub};
use tolerable_runtime::{GreedyOptions, Precision};

#[derive(Parser)]
#[command(name = "xtask", about = "tolerable's tasks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Fetch a model into the cache (outside the repo) and print its path.
    FetchModel {
        /// A catalog id (qwen2.5-coder-0.5b-instruct, qwen2.5-coder-1.5b-instruct,
        /// smollm2-135m-instruct) or hf:<org>/<repo>.
        id: String,
    },
    /// Greedy continuation of a prompt.
    Generate {
        /// Model id or path.
        #[arg(long, default_value = "qwen2.5-coder-0.5b-instruct")]
        model: String,
        /// File holding the prompt text.
        #[arg(long)]
        prompt_file: PathBuf,
        /// New tokens.
        #[arg(long, default_value_t = 8)]
        tokens: usize,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Wrap the prompt in the model's chat template.
        #[arg(long)]
        chat: bool,
        /// f32 or quantized.
        #[arg(long, default_value = "f32")]
        precision: Precision,
    },
    /// Run the runtime's verification gates on a model and print their reports.
    Gates {
        /// Model id or path.
        #[arg(long, default_value = "qwen2.5-coder-0.5b-instruct")]
        model: String,
        /// Also compare the quantized path with candle-transformers' quantized model.
        #[arg(long)]
        quantized: bool,
    },
    /// Floor and native reference of the split-context probe on n items.
    Anchors(anchors::AnchorArgs),
    /// Run a sweep config (default configs/quickstart.toml): gates, then
    /// resumable cells of Parquet records, then the summary and report.
    Sweep(sweep::SweepArgs),
    /// Run a measurement config (default configs/mode-d.toml): gates, then
    /// resumable units of Parquet records (Mode D: the oracle gate first),
    /// then the summary and report.
    Measure(measure::MeasureArgs),
    /// Markdown tables and PNG plots of a finished run folder.
    Report {
        /// The run folder (holding run.json and summary.parquet).
        dir: PathBuf,
        /// A run in progress (a sweep, or a Mode D measurement):
        /// report-interim.md and plots-interim/ (and a sweep's
        /// summary-interim.parquet) from the cells or units written so far,
        /// marked as interim; nothing the run wrote is touched.
        #[arg(long)]
        interim: bool,
        /// Compare two arm families point by point, `family:against` (e.g.
        /// `holder_add:pool_distractors`), repeatable: each arm of the first
        /// against the second's arm at the same grid point, in the report
        /// and `pairs.parquet`. A side may name one arm with its point
        /// (`bridged@bridge.resource=lora_kv:bridged@bridge.resource=lora_q`):
        /// two named arms are compared directly. Two families whose grid
        /// axes differ on both sides are refused (name their arms). Without
        /// it, the pairs of an earlier report are compared again; with it,
        /// they are replaced.
        #[arg(long = "pair", value_name = "FAMILY:AGAINST")]
        pairs: Vec<tolerable_driver::records::ArmPair>,
        /// Another run of the same trained arms with bridges trained from
        /// other seeds (same model and items), repeatable: each trained arm
        /// across every seed, in the report and `seeds.parquet`. A finished
        /// run's report combines finished runs only; an interim one reads
        /// the cells each run has finished. Without it, the runs of an
        /// earlier report's seeds file are combined again.
        #[arg(long = "seeds", value_name = "RUN_DIR")]
        seeds: Vec<PathBuf>,
    },
    /// Speed figures, as ratios against candle-transformers in the same run,
    /// and the driver's arm figures.
    Bench(bench::BenchOptions),
    /// Compare the item rows of two run folders (a rerun against a committed
    /// run): every (arm, item) row's outcome columns, value for value. With
    /// `--pair`, pair arms of the two runs instead over the items both
    /// scored (the same adapter on two caches): a Markdown table of
    /// differences, items gained / lost, exact McNemar p and same
    /// continuations.
    Compare {
        /// The first run folder.
        a: PathBuf,
        /// The second run folder.
        b: PathBuf,
        /// Also write the comparison (or the paired rows) as JSON here.
        #[arg(long)]
        out: Option<PathBuf>,
        /// The first run is a part of the second (a rerun of some of its
        /// arms or items): every row of the first must have its partner
        /// with equal values; rows only the second has are allowed.
        #[arg(long, conflicts_with = "pairs")]
        subset: bool,
        /// Pair an arm or family of the first run with one of the second,
        /// `a_side:b_side` as `report --pair` takes them (families meet at
        /// agreeing grid points; two named arms directly), repeatable.
        #[arg(long = "pair", value_name = "A_SIDE:B_SIDE")]
        pairs: Vec<tolerable_driver::records::ArmPair>,
    },
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let dev = candle_core::Device::Cpu;
    match cli.cmd {
        Cmd::FetchModel { id } => {
            let path = if let Some(repo) = id.strip_prefix("hf:") {
                hub::fetch(repo, &hub::hub_cache_dir())?.dir().to_path_buf()
            } else {
                catalog::fetch(&id, &catalog::cache_root())?
            };
            println!("{}", path.display());
        }
        Cmd::Generate {
            model,
            prompt_file,
            tokens,
            json,
            chat,
            precision,
        } => {
            let text = std::fs::read_to_string(&prompt_file)
                .with_context(|| format!("reading prompt file {}", prompt_file.display()))?;
            let ck = tolerable_fetch::load(&model, precision, &dev)?;
            let prompt = if chat {
                ck.tokenizer.apply_chat_template(&text)?
            } else {
                text
            };
            let ids = ck.tokenizer.encode(&prompt)?;
            let mut cache = ck.model.new_cache(1);
            let g =
                ck.model
                    .generate(&[ids.clone()], &mut cache, &GreedyOptions::tokens(tokens))?;
            let cont = ck.tokenizer.decode(&g.tokens[0])?;
            if json {
                let row = g.first_logits.squeeze(0)?.to_vec1::<f32>()?;
                let mut idx: Vec<usize> = (0..row.len()).collect();
                idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
                let top5: Vec<(usize, f32)> = idx.iter().take(5).map(|&i| (i, row[i])).collect();
                println!(
                    "{}",
                    serde_json::json!({
                        "model": model,
                        "precision": precision.to_string(),
                        "prompt_ids": ids,
                        "continuation_ids": g.tokens[0],
                        "continuation": cont,
                        "top5": top5,
                    })
                );
            } else {
                println!("{cont}");
            }
        }
        Cmd::Gates { model, quantized } => {
            let ck = tolerable_fetch::load(&model, Precision::F32, &dev)?;
            let report = prompts::run_gates(&ck, quantized)?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            if !report["passed"].as_bool().unwrap_or(false) {
                anyhow::bail!("a gate failed on {model}");
            }
        }
        Cmd::Anchors(args) => anchors::run(args)?,
        Cmd::Sweep(args) => sweep::run(args)?,
        Cmd::Measure(args) => measure::run(args)?,
        Cmd::Report {
            dir,
            interim,
            pairs,
            seeds,
        } => sweep::report(dir, interim, pairs, seeds)?,
        Cmd::Bench(opts) => bench::run(opts)?,
        Cmd::Compare {
            a, b, out, pairs, ..
        } if !pairs.is_empty() => {
            let rows = tolerable_driver::records::pairs::pair_rows_across(
                &tolerable_driver::records::read_items(&a)?,
                &tolerable_driver::records::read_items(&b)?,
                &pairs,
            )?;
            println!(
                "Arms of {} (arm) paired with arms of {} (against) over the items both scored:\n",
                a.display(),
                b.display()
            );
            print!("{}", tolerable_driver::report::pairs_table(&rows));
            if let Some(p) = out {
                let text = serde_json::to_string_pretty(&serde_json::json!({
                    "a": a.display().to_string(),
                    "b": b.display().to_string(),
                    "pairs": rows,
                }))?;
                std::fs::write(&p, format!("{text}\n"))
                    .with_context(|| format!("writing {}", p.display()))?;
            }
        }
        Cmd::Compare {
            a, b, out, subset, ..
        } => {
            let c = tolerable_driver::records::compare::compare_runs(&a, &b)?;
            let text = serde_json::to_string_pretty(&serde_json::json!({
                "a": a.display().to_string(),
                "b": b.display().to_string(),
                "subset": subset,
                "a_within_b": c.a_within_b(),
                "comparison": c,
            }))?;
            println!("{text}");
            if let Some(p) = out {
                std::fs::write(&p, format!("{text}\n"))
                    .with_context(|| format!("writing {}", p.display()))?;
            }
            if subset && !c.a_within_b() {
                anyhow::bail!(
                    "{} is not a part of {} ({} of its rows without a partner; differing: {:?})",
                    a.display(),
                    b.display(),
                    c.only_a,
                    c.differing
                );
            }
            if !subset && !c.identical {
                anyhow::bail!(
                    "the runs differ ({} unmatched rows; differing: {:?})",
                    c.unmatched,
                    c.differing
                );
            }
        }
    }
    Ok(())
}
