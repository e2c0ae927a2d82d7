//! `cargo xtask measure`: measurement runs (`[measure]` configs, e.g. Mode
//! D), also reached through `cargo xtask sweep --config` on such a config.

use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use tolerable_driver::measure::{self, MeasureOptions};
use tolerable_fetch::catalog;

/// Options of the measure command.
#[derive(clap::Args)]
pub struct MeasureArgs {
    /// Measurement config (TOML with a `[measure]` table).
    #[arg(long, default_value = "configs/mode-d.toml")]
    pub config: PathBuf,
    /// Output folder (default results/<run name>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Only these contexts, comma-separated file names (replaces
    /// `[measure] select`; the config hash changes, so use another --out).
    #[arg(long, value_delimiter = ',')]
    pub contexts: Option<Vec<String>>,
    /// Injection layers, LayerSet syntax (`0,1,12,23`, `prefix:4`, `all`):
    /// replaces `[measure] layers` (the config hash changes too).
    #[arg(long)]
    pub layers: Option<String>,
    /// Data path for a source, `squad_dev=PATH` (repeatable; conditioning
    /// and quantization probes, and the bank's `squad_train`).
    #[arg(long, value_parser = crate::sweep::parse_data)]
    pub data: Vec<(String, PathBuf)>,
    /// Where fitted resources (key banks) are cached (default `resources/`
    /// under the model cache, `$TOLERABLE_CACHE`).
    #[arg(long)]
    pub resources: Option<PathBuf>,
    /// Print the pairs, skips and an estimate of the work, and stop: no
    /// weights are loaded, nothing is written.
    #[arg(long)]
    pub dry_run: bool,
    /// Write the report (Markdown and plots) when the summary is written.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub report: bool,
}

pub fn run(a: MeasureArgs) -> Result<()> {
    if !a.config.exists() {
        bail!("config {} does not exist", a.config.display());
    }
    let opts = MeasureOptions {
        out: a.out.clone(),
        contexts: a.contexts.clone(),
        layers: a.layers.clone(),
        data: a.data.iter().cloned().collect(),
        resource_root: a.resources.clone(),
    };
    let cfg = measure::load_config(&a.config, &opts)?;
    if a.dry_run {
        print!("{}", measure::dry_run(&a.config, &opts)?);
        return Ok(());
    }
    if catalog::spec(&cfg.run.model).is_ok() && catalog::cached(&cfg.run.model)?.is_none() {
        tracing::info!("{} is not cached; fetching it", cfg.run.model);
        catalog::fetch(&cfg.run.model, &catalog::cache_root())
            .with_context(|| format!("fetching {}", cfg.run.model))?;
    }
    let t0 = std::time::Instant::now();
    let out = measure::run(&a.config, &opts)?;
    eprintln!(
        "{}: {} units, {} computed now, {} found finished{} ({:.1} s)",
        out.dir.display(),
        out.units,
        out.computed,
        out.skipped,
        if out.summary_written {
            "; summary.parquet written"
        } else {
            ""
        },
        t0.elapsed().as_secs_f64()
    );
    if out.summary_written && a.report {
        let r = tolerable_driver::report::write(&out.dir)?;
        eprintln!("report: {}", r.display());
    }
    Ok(())
}
