//! `cargo xtask sweep` and `cargo xtask report`: the driver's sweeps and
//! reports on the command line.

use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::path::PathBuf;
use tolerable_driver::sweep::{self, SweepOptions};
use tolerable_fetch::catalog;

/// Options of the sweep command.
#[derive(clap::Args)]
pub struct SweepArgs {
    /// Sweep config (TOML).
    #[arg(long, default_value = "configs/quickstart.toml")]
    pub config: PathBuf,
    /// Output folder (default results/<run name>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Run one shard, `i/n`: cells c with c % n == i.
    #[arg(long, value_parser = parse_shard)]
    pub shard: Option<(usize, usize)>,
    /// Data path for a source, `squad_dev=PATH` (repeatable).
    #[arg(long, value_parser = parse_data)]
    pub data: Vec<(String, PathBuf)>,
    /// Number of items (overrides [data] n).
    #[arg(long)]
    pub n: Option<usize>,
    /// Only merge finished cells (e.g. of shards) into the summary.
    #[arg(long)]
    pub merge: bool,
    /// Print the plan (per-item passes, resources with their content hash
    /// and cache status, each arm's program, an estimate of forward tokens
    /// and time) and stop: no weights are loaded, nothing is written.
    #[arg(long)]
    pub dry_run: bool,
    /// Where fitted resources (key banks, codebooks) are cached (default
    /// `resources/` under the model cache, `$TOLERABLE_CACHE`).
    #[arg(long)]
    pub resources: Option<PathBuf>,
    /// Write the report (Markdown and plots) when the summary is written.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub report: bool,
}

fn parse_shard(s: &str) -> std::result::Result<(usize, usize), String> {
    let (i, n) = s
        .split_once('/')
        .ok_or_else(|| format!("`{s}`: write the shard as i/n"))?;
    let i: usize = i
        .trim()
        .parse()
        .map_err(|_| format!("`{s}`: `{i}` is not a number"))?;
    let n: usize = n
        .trim()
        .parse()
        .map_err(|_| format!("`{s}`: `{n}` is not a number"))?;
    if n == 0 || i >= n {
        return Err(format!("`{s}`: need 0 <= i < n"));
    }
    Ok((i, n))
}

pub fn parse_data(s: &str) -> std::result::Result<(String, PathBuf), String> {
    let (k, v) = s.split_once('=').ok_or_else(|| {
        format!("`{s}`: write the data path as source=PATH, e.g. squad_dev=../shared/data/squad")
    })?;
    Ok((k.trim().to_string(), PathBuf::from(v)))
}

pub fn run(a: SweepArgs) -> Result<()> {
    // A measurement config (`[measure]` instead of `[data]` and `[[arms]]`)
    // is run by `measure`; the sweep-only flags do not apply to it.
    if a.config.exists() && tolerable_driver::measure::is_measure_config(&a.config)? {
        if a.shard.is_some() || a.n.is_some() || a.merge {
            bail!(
                "{} is a measurement config: --shard, --n and --merge do not apply (see `cargo xtask measure --help`)",
                a.config.display()
            );
        }
        return crate::measure::run(crate::measure::MeasureArgs {
            config: a.config,
            out: a.out,
            contexts: None,
            layers: None,
            data: a.data,
            resources: a.resources,
            dry_run: a.dry_run,
            report: a.report,
        });
    }
    let opts = SweepOptions {
        out: a.out.clone(),
        shard: a.shard,
        data: a.data.iter().cloned().collect::<BTreeMap<_, _>>(),
        n: a.n,
        merge_only: a.merge,
        resource_root: a.resources.clone(),
    };
    if !a.config.exists() {
        bail!("config {} does not exist", a.config.display());
    }
    // A catalog model that is not cached yet is fetched first.
    let cfg = sweep::load_config(&a.config, &opts)?;
    if !a.merge
        && !a.dry_run
        && catalog::spec(&cfg.run.model).is_ok()
        && catalog::cached(&cfg.run.model)?.is_none()
    {
        tracing::info!("{} is not cached; fetching it", cfg.run.model);
        catalog::fetch(&cfg.run.model, &catalog::cache_root())
            .with_context(|| format!("fetching {}", cfg.run.model))?;
    }
    if a.dry_run {
        print!("{}", sweep::dry_run(&a.config, &opts)?);
        return Ok(());
    }
    let out = sweep::run(&a.config, &opts)?;
    eprintln!(
        "{}: {} cells, {} computed now, {} found finished{}",
        out.dir.display(),
        out.cells,
        out.computed,
        out.skipped,
        if out.summary_written {
            "; summary.parquet written"
        } else {
            ""
        }
    );
    if out.summary_written && a.report {
        let r = tolerable_driver::report::write(&out.dir)?;
        eprintln!("report: {}", r.display());
    }
    Ok(())
}

pub fn report(
    dir: PathBuf,
    interim: bool,
    pairs: Vec<tolerable_driver::records::ArmPair>,
    seeds: Vec<PathBuf>,
) -> Result<()> {
    let r = tolerable_driver::report::write_with(&dir, interim, &pairs, &seeds)?;
    println!("{}", std::fs::read_to_string(&r)?);
    eprintln!("wrote {}", r.display());
    Ok(())
}
