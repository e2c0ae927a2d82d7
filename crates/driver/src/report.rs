//! Reports of a finished run: a Markdown file of tables (accuracy ± SE,
//! intervals, conditional accuracy, span-copy, fidelity, lifts over named
//! controls, anchors beside every number) and PNG plots of accuracy against
//! each numeric grid axis (layer, alpha, cosine, ...), with the floor and
//! native reference drawn as lines and 95% intervals as bars.

use crate::error::{io, DriverError, Result};
use crate::records::columns::rows as read_records;
use crate::records::pairs::{pair_rows, pairs_of, ArmPair, PairRow};
use crate::records::seeds::{seed_rows, SeedRow, SeedRun};
use crate::records::{read_parquet, write_rows, SummaryRow};
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn read_rows(run_dir: &Path) -> Result<Vec<SummaryRow>> {
    read_records(&read_parquet(&run_dir.join("summary.parquet"))?)
}

/// An arm's grid point with typed values.
fn point(r: &SummaryRow) -> BTreeMap<String, serde_json::Value> {
    serde_json::from_str(&r.arm.point).unwrap_or_default()
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map(|x| format!("{x:.digits$}"))
        .unwrap_or_else(|| "–".into())
}

/// Writes `report.md` and `plots/*.png` for the run in `run_dir`; returns
/// the report's path. A measurement run's folder gets its own report
/// ([`crate::measure::report::write`]). Pairs of arms a previous report
/// compared (`pairs.parquet`) are compared again ([`write_with_pairs`]);
/// what interim reports wrote is removed, superseded.
pub fn write(run_dir: &Path) -> Result<PathBuf> {
    write_with_pairs(run_dir, false, &[])
}

/// Writes `report-interim.md` and `plots-interim/*.png` for a run in
/// progress from what it has written so far, with a banner saying how much
/// of the run that is: a sweep's finished cells
/// ([`crate::sweep::interim_summary`]) or a Mode D measurement's units
/// ([`crate::measure::report::write_interim`]); a sweep's interim summary
/// rows also go to `summary-interim.parquet`. The finished run's
/// `report.md`, `summary.parquet` and `plots/` are not touched. Returns the
/// report's path.
pub fn write_interim(run_dir: &Path) -> Result<PathBuf> {
    write_with_pairs(run_dir, true, &[])
}

/// The report of a finished run (`interim` false, as [`write`]) or of one
/// in progress (as [`write_interim`]), with each arm of a pair's first
/// family compared with the second family's arm at the same grid point,
/// or one named arm with another ([`crate::records::pairs`]): a section of the report and
/// `pairs.parquet` (`pairs-interim.parquet` for an interim report). With no
/// pairs named, the pairs already in that file (or, for a finished run's
/// first report, in `pairs-interim.parquet`) are compared again, so a
/// report regenerated later keeps them; pairs named replace them (a
/// warning lists those dropped).
pub fn write_with_pairs(run_dir: &Path, interim: bool, pairs: &[ArmPair]) -> Result<PathBuf> {
    write_with(run_dir, interim, pairs, &[])
}

/// The report of [`write_with_pairs`], with the run's trained arms combined
/// across training seeds with the runs in `seed_runs` (the same bridges
/// trained from other seeds, over the same model and items;
/// [`crate::records::seeds`]): a section of the report and `seeds.parquet`
/// (`seeds-interim.parquet` for an interim report, where each run is read
/// as far as it has got). A finished run's report combines finished runs
/// only. With no runs named, the runs of an earlier report's seeds file are
/// combined again.
pub fn write_with(
    run_dir: &Path,
    interim: bool,
    pairs: &[ArmPair],
    seed_runs: &[PathBuf],
) -> Result<PathBuf> {
    let meta = crate::measure::read_json(&run_dir.join("run.json"))?;
    // Measurement runs (`[measure]` configs) have reports of their own.
    if meta["kind"] == "measure" {
        if !pairs.is_empty() || !seed_runs.is_empty() {
            return Err(DriverError::Records(format!(
                "{}: pairs of arms and seeds combine a sweep's arms; a measurement run has none",
                run_dir.display()
            )));
        }
        return if interim {
            crate::measure::report::write_interim(run_dir)
        } else {
            crate::measure::report::write(run_dir)
        };
    }
    let (rows, coverage) = if interim {
        let (rows, c) = crate::sweep::interim_summary(run_dir)?;
        (rows, Some(c))
    } else {
        if !run_dir.join("summary.parquet").exists() {
            return Err(DriverError::Records(format!(
                "{} has no summary.parquet: the sweep has unfinished cells (rerun it, or merge its shards; `report --interim` reads the cells finished so far)",
                run_dir.display()
            )));
        }
        (read_rows(run_dir)?, None)
    };
    let pairs = if pairs.is_empty() {
        remembered_pairs(run_dir, interim)?
    } else {
        // Named pairs replace the remembered ones: say which go.
        let dropped: Vec<String> = dropped_pairs(run_dir, interim, pairs)
            .iter()
            .map(|p| format!("`{p}`"))
            .collect();
        if !dropped.is_empty() {
            tracing::warn!(
                "{}: the pairs named replace those compared before; no longer compared: {} (name them again to keep them)",
                run_dir.display(),
                dropped.join(", ")
            );
        }
        pairs.to_vec()
    };
    let seed_runs = if seed_runs.is_empty() {
        remembered_seed_runs(run_dir, interim)?
    } else {
        seed_runs.to_vec()
    };
    let seeds = if seed_runs.is_empty() {
        Vec::new()
    } else {
        let seeds = combine_seeds(run_dir, &meta, &rows, &seed_runs, interim)?;
        write_rows(seeds.clone(), &seeds_file(run_dir, interim))?;
        seeds
    };
    let out = render(run_dir, &meta, rows, coverage.as_ref(), &pairs, &seeds)?;
    if !interim {
        remove_interim(run_dir)?;
    }
    Ok(out)
}

/// Removes what interim reports wrote (`report-interim.md`,
/// `plots-interim/`, `summary-interim.parquet`, `pairs-interim.parquet`,
/// `seeds-interim.parquet`)
/// once the finished run's report has replaced it; all of it is derived
/// from the cells, which stay.
fn remove_interim(run_dir: &Path) -> Result<()> {
    for f in [
        "report-interim.md",
        "summary-interim.parquet",
        "pairs-interim.parquet",
        "seeds-interim.parquet",
    ] {
        let p = run_dir.join(f);
        if p.exists() {
            std::fs::remove_file(&p).map_err(io(format!("removing {}", p.display())))?;
        }
    }
    let plots = run_dir.join("plots-interim");
    if plots.exists() {
        std::fs::remove_dir_all(&plots).map_err(io(format!("removing {}", plots.display())))?;
    }
    Ok(())
}

/// A table a report derives (`pairs`, `seeds`): `<stem>.parquet`, or
/// `<stem>-interim.parquet` for an interim report.
fn derived_file(run_dir: &Path, stem: &str, interim: bool) -> PathBuf {
    run_dir.join(derived_name(stem, interim))
}

/// The file name of [`derived_file`].
fn derived_name(stem: &str, interim: bool) -> String {
    if interim {
        format!("{stem}-interim.parquet")
    } else {
        format!("{stem}.parquet")
    }
}

/// The pairs file of a report.
fn pairs_file(run_dir: &Path, interim: bool) -> PathBuf {
    derived_file(run_dir, "pairs", interim)
}

/// The pairs of arms an earlier report compared: its own pairs file, else
/// (a finished run's first report) the interim one's.
fn remembered_pairs(run_dir: &Path, interim: bool) -> Result<Vec<ArmPair>> {
    let mut files = vec![pairs_file(run_dir, interim)];
    if !interim {
        files.push(pairs_file(run_dir, true));
    }
    for f in files {
        if f.exists() {
            return Ok(pairs_of(&read_records::<PairRow>(&read_parquet(&f)?)?));
        }
    }
    Ok(Vec::new())
}

/// The pairs an earlier report of the run compared (interim or finished, as
/// `interim`) that a report naming `named` no longer compares: named pairs
/// replace the remembered ones. None when no earlier pairs can be read.
pub fn dropped_pairs(run_dir: &Path, interim: bool, named: &[ArmPair]) -> Vec<ArmPair> {
    remembered_pairs(run_dir, interim)
        .unwrap_or_default()
        .into_iter()
        .filter(|p| !named.contains(p))
        .collect()
}

/// The seeds file of a report.
fn seeds_file(run_dir: &Path, interim: bool) -> PathBuf {
    derived_file(run_dir, "seeds", interim)
}

/// The other runs an earlier report of the same kind (interim or finished)
/// combined across seeds: the folders of its seeds file other than this
/// run's. (A finished run's first report does not take up the interim
/// file's runs: they may not have finished.)
fn remembered_seed_runs(run_dir: &Path, interim: bool) -> Result<Vec<PathBuf>> {
    let f = seeds_file(run_dir, interim);
    if !f.exists() {
        return Ok(Vec::new());
    }
    let here = run_dir
        .canonicalize()
        .map_err(io(format!("resolving {}", run_dir.display())))?;
    let mut out: Vec<PathBuf> = Vec::new();
    let mut seen = vec![here];
    for row in read_records::<SeedRow>(&read_parquet(&f)?)? {
        for d in row.run_dirs {
            let p = PathBuf::from(&d);
            let resolved = p.canonicalize().map_err(|e| {
                DriverError::Records(format!(
                    "{} combined seeds with the run in {d}, which cannot be read now ({e}); name the seed runs again with --seeds",
                    f.display()
                ))
            })?;
            if !seen.contains(&resolved) {
                seen.push(resolved);
                out.push(p);
            }
        }
    }
    Ok(out)
}

/// This run's trained arms across seeds with the runs in `others`: a
/// finished report reads each run's `summary.parquet` (and refuses a run
/// without one); an interim report reads the cells each has finished where
/// it has no summary yet.
fn combine_seeds(
    run_dir: &Path,
    meta: &serde_json::Value,
    rows: &[SummaryRow],
    others: &[PathBuf],
    interim: bool,
) -> Result<Vec<SeedRow>> {
    let mut loaded = Vec::with_capacity(others.len());
    for dir in others {
        let m = crate::measure::read_json(&dir.join("run.json"))?;
        let r = if dir.join("summary.parquet").exists() {
            read_rows(dir)?
        } else if interim {
            crate::sweep::interim_summary(dir)?.0
        } else {
            return Err(DriverError::Records(format!(
                "{} has no summary.parquet: a finished run's seeds combine finished runs only (`report --interim` combines the cells finished so far)",
                dir.display()
            )));
        };
        loaded.push((dir.display().to_string(), m, r));
    }
    let here = run_dir.display().to_string();
    let mut runs = vec![SeedRun {
        dir: &here,
        meta,
        rows,
    }];
    runs.extend(loaded.iter().map(|(d, m, r)| SeedRun {
        dir: d,
        meta: m,
        rows: r,
    }));
    seed_rows(&runs)
}

/// The report over summary rows: the finished run's, or an interim one's
/// with its coverage.
fn render(
    run_dir: &Path,
    meta: &serde_json::Value,
    rows: Vec<SummaryRow>,
    interim: Option<&crate::sweep::SweepCoverage>,
    pairs: &[ArmPair],
    seeds: &[SeedRow],
) -> Result<PathBuf> {
    let anchor = |name: &str| rows.iter().find(|r| r.arm.arm == name).cloned();
    let (floor, native) = (anchor("floor"), anchor("native"));
    let mut md = String::new();
    let name = meta["name"].as_str().unwrap_or("run");
    let _ = writeln!(md, "# Run `{name}`\n");
    if let Some(c) = interim {
        let _ = writeln!(
            md,
            "**Interim, not the run's result:** {} of {} cells finished ({} of {} items; cells {}). Each cell holds consecutive items of the seeded sample, so these are a random subset of it; every figure below, the anchors included, is over these items only.\n",
            c.finished.len(),
            c.cells,
            c.items,
            c.n,
            cell_ranges(&c.finished)
        );
    }
    let _ = writeln!(
        md,
        "- model: `{}` ({}), sha256 `{}`",
        meta["model"]["id"].as_str().unwrap_or("?"),
        meta["model"]["precision"].as_str().unwrap_or("?"),
        meta["model"]["sha256"].as_str().unwrap_or("unknown")
    );
    let _ = writeln!(
        md,
        "- data: {} from `{}`, n = {}, seed {}, template `{}`, {} new tokens",
        meta["data"]["source"].as_str().unwrap_or("?"),
        meta["data"]["from"].as_str().unwrap_or("?"),
        meta["data"]["n"],
        meta["seeds"]["sample"],
        meta["template"].as_str().unwrap_or("?"),
        meta["new_tokens"]
    );
    let _ = writeln!(
        md,
        "- gates: {} (parity max |Δlogit| {}, rebuild, identity); config hash `{}`; git `{}`",
        if meta["gates"]["passed"] == true {
            "passed"
        } else {
            "FAILED"
        },
        meta["gates"]["parity_f32"]["prompts"]
            .as_array()
            .map(|ps| ps
                .iter()
                .filter_map(|p| p["max_abs_logit_diff"].as_f64())
                .fold(0f64, f64::max))
            .map(|d| format!("{d:.1e}"))
            .unwrap_or_else(|| "?".into()),
        meta["config_hash"].as_str().unwrap_or("?"),
        meta["git_revision"].as_str().unwrap_or("?")
    );
    let _ = writeln!(
        md,
        "- command: `{}`\n",
        meta["command"].as_str().unwrap_or("?")
    );
    if let (Some(f), Some(n)) = (&floor, &native) {
        let _ = writeln!(
            md,
            "Anchors: floor {:.3} ± {:.3}, native reference {:.3} ± {:.3} (n = {}).\n",
            f.accuracy, f.se, n.accuracy, n.se, f.n_items
        );
    }
    if let Some(res) = meta["resources"].as_object().filter(|r| !r.is_empty()) {
        let _ = writeln!(
            md,
            "Resources (fitted on training items, cached by content hash):\n"
        );
        for (name, r) in res {
            // A build resumed from an earlier invocation's progress timed
            // only its own part.
            let field = |k: &str| r[k].as_u64().map(|v| v as usize);
            let resumed = crate::resources::ResumedAt::from_record(
                field("build_resumed_after_epoch"),
                field("build_resumed_after_steps"),
            )
            .map(|at| format!(" in its last invocation, resumed after {at}"))
            .unwrap_or_default();
            let _ = writeln!(
                md,
                "- `{name}`: {} hash `{}`, {} ({} training items, built in {:.1} s{resumed})",
                r["spec"]["kind"].as_str().unwrap_or("?"),
                r["hash"].as_str().unwrap_or("?"),
                r["obtained"].as_str().unwrap_or("?"),
                r["training_items"].as_array().map(|a| a.len()).unwrap_or(0),
                r["build_seconds"].as_f64().unwrap_or(0.0)
            );
        }
        let _ = writeln!(md);
    }
    // A summary written before the lift's paired columns has none to show.
    let paired = if rows.iter().any(|r| r.lift_gained.is_some()) {
        "; paired items gained/lost, McNemar p"
    } else {
        ""
    };
    let _ = writeln!(
        md,
        "| arm | n | accuracy ± SE | 95% CI | Wilson 95% | conditional (n) | span-copy | conditional − span-copy (z) | fidelity cos | achieved cos | logit corr | lift over strongest control [95% CI]{paired} | bit-exact |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let lift = match (r.lift, r.lift_lo, r.lift_hi, &r.strongest_control) {
            (Some(d), Some(lo), Some(hi), Some(c)) => {
                let paired = match (r.lift_gained, r.lift_lost, r.lift_mcnemar_p) {
                    (Some(g), Some(l), Some(p)) if p >= 1e-3 => {
                        format!("; +{g}/−{l} items, McNemar p {p:.3}")
                    }
                    (Some(g), Some(l), Some(p)) => {
                        format!("; +{g}/−{l} items, McNemar p {p:.1e}")
                    }
                    _ => String::new(),
                };
                format!("{d:+.3} [{lo:+.3}, {hi:+.3}] vs `{c}`{paired}")
            }
            _ => "–".into(),
        };
        let _ = writeln!(
            md,
            "| `{}` | {} | {:.3} ± {:.3} | [{:.3}, {:.3}] | [{:.3}, {:.3}] | {} ({}) | {:.3} | {} | {} | {} | {} | {} | {} |",
            r.arm.arm,
            r.n_items,
            r.accuracy,
            r.se,
            r.ci_lo,
            r.ci_hi,
            r.wilson_lo,
            r.wilson_hi,
            opt(r.cond_accuracy, 3),
            r.cond_n,
            r.span_copy_rate,
            match (r.cond_minus_span_copy, r.cond_minus_span_copy_z) {
                (Some(d), Some(z)) => format!("{d:+.3} ({z:.1})"),
                _ => "–".into(),
            },
            opt(r.mean_fidelity_cosine, 4),
            opt(r.mean_achieved_cosine, 4),
            opt(r.mean_logit_correlation, 3),
            lift,
            r.bit_exact_items.map(|k| format!("{k}/{}", r.n_items)).unwrap_or_else(|| "–".into())
        );
    }
    if !pairs.is_empty() {
        let paired = pair_rows(&crate::records::read_items(run_dir)?, pairs)?;
        paired_section(&mut md, &paired, interim.is_some());
        write_rows(paired, &pairs_file(run_dir, interim.is_some()))?;
    }
    if !seeds.is_empty() {
        seeds_section(&mut md, seeds, interim.is_some());
    }
    let notes = construction_notes(&rows, meta);
    if !notes.is_empty() {
        let _ = writeln!(md, "\n## Notes\n");
        for n in notes {
            let _ = writeln!(md, "- {n}");
        }
    }
    let (file, plot_dir) = match interim {
        Some(_) => ("report-interim.md", run_dir.join("plots-interim")),
        None => ("report.md", run_dir.join("plots")),
    };
    let mut plots = plot_axes(&plot_dir, &rows, floor.as_ref(), native.as_ref())?;
    plots.extend(resource_curves(run_dir, &plot_dir, &mut md)?);
    if !plots.is_empty() {
        let _ = writeln!(md, "\n## Plots\n");
        for p in plots {
            let rel = p.strip_prefix(run_dir).unwrap_or(&p).display().to_string();
            let _ = writeln!(md, "![{rel}]({rel})\n");
        }
    }
    if interim.is_some() {
        // The interim summary rows for readers of a run in progress.
        write_rows(rows.clone(), &run_dir.join("summary-interim.parquet"))?;
    }
    let out = run_dir.join(file);
    std::fs::write(&out, md).map_err(io(format!("writing {}", out.display())))?;
    Ok(out)
}

/// The report's section of pairs of arms: each compared arm beside the
/// other family's arm at its grid point.
fn paired_section(md: &mut String, rows: &[PairRow], interim: bool) {
    let _ = writeln!(
        md,
        "\n## Paired comparisons\n\nEach arm of a named family against the other family's arm at the same grid point (a pair that names two arms compares those two), over the items both scored (`{}`): the difference with its 95% interval (SE of two independent proportions, as the lift above), items gained / lost, exact McNemar p, and the items on which both decoded the same continuation.\n",
        derived_name("pairs", interim)
    );
    md.push_str(&pairs_table(rows));
}

/// Paired rows as a Markdown table: each arm beside the arm it is compared
/// against, their accuracies over the items both scored, the difference
/// with its 95% interval, items gained / lost, the exact McNemar p and the
/// items with the same continuation (– for a row read from a pairs file
/// written before it was counted).
pub fn pairs_table(rows: &[PairRow]) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "| arm | against | n | accuracy | against | difference [95% CI] | gained / lost | McNemar p | same continuation |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let p = if r.mcnemar_p >= 1e-3 {
            format!("{:.3}", r.mcnemar_p)
        } else {
            format!("{:.1e}", r.mcnemar_p)
        };
        let _ = writeln!(
            md,
            "| `{}` | `{}` | {} | {:.3} | {:.3} | {:+.3} [{:+.3}, {:+.3}] | {} / {} | {p} | {} |",
            r.arm,
            r.against,
            r.n_items,
            r.accuracy,
            r.against_accuracy,
            r.diff,
            r.diff_lo,
            r.diff_hi,
            r.gained,
            r.lost,
            r.same_continuation
                .map_or_else(|| "–".to_string(), |s| format!("{s} / {}", r.n_items))
        );
    }
    md
}

/// The report's section of trained arms across seeds.
fn seeds_section(md: &mut String, rows: &[SeedRow], interim: bool) {
    let _ = writeln!(
        md,
        "\n## Across seeds\n\nEach trained arm over the seeds its bridge was trained from, in this run and the runs combined with it (`{}`): the mean and sample SD of the seeds' accuracies, each seed's accuracy, the conditional accuracy (on the items the native reference answers) as mean ± SD with each seed's, where every seed has one, and the bit-exact gate summed over seeds.\n",
        derived_name("seeds", interim)
    );
    if interim {
        let _ = writeln!(
            md,
            "Interim: each run is read as far as it has got, so the seeds' figures may cover different items (n in brackets); the mean weighs the seeds equally.\n"
        );
    }
    let mut ways: Vec<&str> = rows
        .iter()
        .flat_map(|r| r.batching.iter().map(String::as_str))
        .collect();
    ways.sort_unstable();
    ways.dedup();
    if ways.len() > 1 {
        let _ = writeln!(
            md,
            "The runs batched their arms in different ways ({}; `batching` per seed in the file): the same arm rounds differently between them.\n",
            ways.iter()
                .map(|w| format!("`{w}`"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let _ = writeln!(
        md,
        "| family | bridge | point | seeds | accuracy mean ± SD | each seed (n) | conditional mean ± SD (each seed) | bit-exact |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|");
    for r in rows {
        let each: Vec<String> = r
            .seeds
            .iter()
            .zip(&r.accuracy)
            .zip(&r.n_items)
            .map(|((s, a), n)| format!("{s}: {a:.3} ({n})"))
            .collect();
        let _ = writeln!(
            md,
            "| `{}` | `{}` | {} | {} | {:.3} ± {} | {} | {} | {} |",
            r.family,
            r.bridge,
            if r.point == "{}" { "–" } else { &r.point },
            r.n_seeds,
            r.accuracy_mean,
            opt(r.accuracy_sd, 3),
            each.join("; "),
            conditional_over_seeds(r),
            r.bit_exact_items
                .map(|k| format!("{k}/{}", r.n_items_total))
                .unwrap_or_else(|| "–".into())
        );
    }
}

/// A trained arm's conditional accuracy over its seeds: mean ± SD (each
/// seed's), or a dash where a seed has none.
fn conditional_over_seeds(r: &SeedRow) -> String {
    match r.cond_accuracy_mean {
        None => "–".into(),
        Some(m) if r.cond_accuracy.len() < 2 => format!("{m:.3}"),
        Some(m) => {
            let each: Vec<String> = r.cond_accuracy.iter().map(|c| format!("{c:.3}")).collect();
            format!(
                "{m:.3} ± {} ({})",
                opt(r.cond_accuracy_sd, 3),
                each.join(", ")
            )
        }
    }
}

/// Cell numbers as ranges: `0-6, 9`.
fn cell_ranges(cells: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cells.len() {
        let mut j = i;
        while j + 1 < cells.len() && cells[j + 1] == cells[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            cells[i].to_string()
        } else {
            format!("{}-{}", cells[i], cells[j])
        });
        i = j + 1;
    }
    parts.join(", ")
}

/// The training curves of the run's resources (`resources.parquet`): a
/// table per resource in `md` and a loss plot each in `plot_dir`.
fn resource_curves(run_dir: &Path, plot_dir: &Path, md: &mut String) -> Result<Vec<PathBuf>> {
    let path = run_dir.join("resources.parquet");
    if !path.exists() {
        return Ok(Vec::new());
    }
    let rows: Vec<crate::records::ResourceRow> =
        crate::records::columns::rows(&crate::records::read_parquet(&path)?)?;
    let mut by: BTreeMap<String, BTreeMap<i64, BTreeMap<String, f64>>> = BTreeMap::new();
    for r in &rows {
        if let Some(e) = r.epoch {
            by.entry(format!("{} ({}, {})", r.resource, r.kind, r.hash))
                .or_default()
                .entry(e)
                .or_default()
                .insert(r.metric.clone(), r.value);
        }
    }
    let mut out = Vec::new();
    if by.is_empty() {
        return Ok(out);
    }
    let _ = writeln!(md, "\n## Trained resources\n");
    std::fs::create_dir_all(plot_dir).map_err(io(format!("creating {}", plot_dir.display())))?;
    for (name, epochs) in &by {
        let _ = writeln!(
            md,
            "`{name}`: epoch 0 is before any step; the kept epoch is marked.\n"
        );
        let _ = writeln!(
            md,
            "| epoch | training loss | slice loss | slice first-token accuracy | kept |"
        );
        let _ = writeln!(md, "|---|---|---|---|---|");
        let get = |m: &BTreeMap<String, f64>, k: &str| {
            m.get(k)
                .map(|v| format!("{v:.3}"))
                .unwrap_or_else(|| "–".into())
        };
        for (e, m) in epochs {
            let _ = writeln!(
                md,
                "| {e} | {} | {} | {} | {} |",
                get(m, "train_loss"),
                get(m, "slice_loss"),
                get(m, "slice_first_token_accuracy"),
                if m.get("kept") == Some(&1.0) {
                    "yes"
                } else {
                    ""
                }
            );
        }
        let _ = writeln!(md);
        let series = ["train_loss", "slice_loss"]
            .iter()
            .map(|k| crate::measure::report::Series {
                label: k.replace('_', " "),
                points: epochs
                    .iter()
                    .filter_map(|(e, m)| m.get(*k).map(|v| (*e as f64, *v)))
                    .collect(),
            })
            .collect::<Vec<_>>();
        let stem: String = name
            .split(' ')
            .next()
            .unwrap_or("resource")
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let p = plot_dir.join(format!("curve_{stem}.png"));
        register_font()?;
        crate::measure::report::line_chart(
            &p,
            &format!("training curve of {stem}"),
            "epoch",
            "cross-entropy",
            &series,
            &[],
        )
        .map_err(|e| DriverError::Records(format!("drawing {}: {e}", p.display())))?;
        out.push(p);
    }
    Ok(out)
}

/// The bytes of a TrueType font for plot text: `$TOLERABLE_FONT`, else
/// DejaVu Sans or Liberation Sans in the usual places.
fn font_bytes() -> Result<&'static [u8]> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("TOLERABLE_FONT") {
        candidates.push(p.into());
    }
    for p in [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
        "/usr/share/fonts/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
        "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
        "/System/Library/Fonts/Supplemental/Arial.ttf",
        "/Library/Fonts/Arial.ttf",
    ] {
        candidates.push(p.into());
    }
    for p in &candidates {
        if let Ok(b) = std::fs::read(p) {
            return Ok(Box::leak(b.into_boxed_slice()));
        }
    }
    Err(DriverError::Records(format!(
        "no TrueType font for plot text (tried {}); set TOLERABLE_FONT or install fonts-dejavu-core",
        candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )))
}

pub(crate) fn register_font() -> Result<()> {
    static ONCE: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    ONCE.get_or_init(|| {
        let bytes = font_bytes().map_err(|e| e.to_string())?;
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| "the font file could not be read as TrueType".to_string())
    })
    .clone()
    .map_err(DriverError::Records)
}

/// Series on one grid axis: series name to (axis value, summary row).
type Families<'a> = BTreeMap<String, Vec<(f64, &'a SummaryRow)>>;

/// What a reader must know to read some rows: controls that equal the floor
/// by construction.
fn construction_notes(rows: &[SummaryRow], meta: &serde_json::Value) -> Vec<String> {
    let own_holder = meta["config"]["arms"]
        .as_array()
        .map(|arms| arms.iter().all(|a| a["arm"]["holder"].is_null()))
        .unwrap_or(true);
    let fams: std::collections::BTreeSet<String> = rows
        .iter()
        .filter(|r| {
            let displaced = serde_json::from_str::<serde_json::Value>(&r.arm.arm_json)
                .ok()
                .and_then(|a| a["inject"][0].get("source_positions").cloned())
                .is_some();
            own_holder
                && r.arm.source.as_deref() == Some("holder")
                && matches!(
                    r.arm.positions.as_deref(),
                    Some("fact_free_prefix") | Some("common_prefix")
                )
                && !displaced
        })
        .map(|r| r.arm.family.clone())
        .collect();
    let mut notes: Vec<String> = fams.into_iter()
        .map(|f| format!(
            "`{f}` writes the holder's states at fact-free common-prefix positions; the holder here is the receiver itself, whose states there equal its own on the masked passage (causal attention), so this control equals the floor by construction. The displaced control (the holder's fact-region states written at fact-free positions, `source_positions = \"fact_region\"`) is the sharper one."
        ))
        .collect();
    // Arms that stopped short of their target cosine: a blend toward
    // another item reaches that item's own state (weight 1) first when the
    // two are already closer than the target.
    for r in rows {
        if let Some((target, got)) =
            short_of_target(&r.arm.arm_json, r.arm.target_cosine, r.mean_achieved_cosine)
        {
            let why = if r.arm.target_cosine.is_some() {
                "the perturbation did not reach it"
            } else {
                "a blend reaches its partner's own state (weight 1) first when the two are closer than the target"
            };
            notes.push(format!(
                "`{}` reached a mean achieved cosine of {got:.4} against its target {target}: on some items {why}; the item rows' `achieved_at_*` and `achieved_cosine` say where, and plots place the arm at the cosine reached.",
                r.arm.arm
            ));
        }
    }
    notes
}

/// A grid value as a position along a plot axis: numbers, numeric
/// strings, and layer sets of one number (`prefix:8` is 8 layers,
/// `suffix:12` starts at 12); `None` for a categorical value (a carrier).
fn axis_value(v: &serde_json::Value) -> Option<f64> {
    match v {
        serde_json::Value::Number(n) => n.as_f64(),
        serde_json::Value::String(s) => s.parse::<f64>().ok().or_else(|| {
            s.strip_prefix("prefix:")
                .or_else(|| s.strip_prefix("suffix:"))
                .and_then(|n| n.parse().ok())
        }),
        _ => None,
    }
}

/// The series of a point on a fidelity plot: its family, and the values
/// of its categorical grid axes (`noise @carrier=k`); numeric axes move the
/// point along x and do not split series.
fn categorical_series(family: &str, pt: &BTreeMap<String, serde_json::Value>) -> String {
    series_label(family, pt.iter().filter(|(_, v)| axis_value(v).is_none()))
}

/// A series label: the family, then `key=value` of the grid values given.
fn series_label<'a>(
    family: &str,
    values: impl Iterator<Item = (&'a String, &'a serde_json::Value)>,
) -> String {
    let parts: Vec<String> = values
        .map(|(k, v)| {
            format!(
                "{k}={}",
                v.as_str()
                    .map(String::from)
                    .unwrap_or_else(|| v.to_string())
            )
        })
        .collect();
    if parts.is_empty() {
        family.to_string()
    } else {
        format!("{family} @{}", parts.join(","))
    }
}

/// An arm's (target, achieved) cosine where the achieved one is more than
/// 0.005 above its target: a perturbation's `target_cosine`, or the first
/// injection's `blend.target_cosine` in its JSON.
fn short_of_target(
    arm_json: &str,
    perturb_target: Option<f64>,
    achieved: Option<f64>,
) -> Option<(f64, f64)> {
    let blend_target = serde_json::from_str::<serde_json::Value>(arm_json)
        .ok()
        .and_then(|a| a["inject"][0]["blend"]["target_cosine"].as_f64());
    let (target, got) = (perturb_target.or(blend_target)?, achieved?);
    (got - target > 0.005).then_some((target, got))
}

/// One plot per numeric grid axis (a series per family and per value of
/// the other axes), or, where the run has no numeric axis, one plot of
/// accuracy by arm; and fidelity plots (accuracy against mean fidelity
/// cosine, logit correlation and achieved cosine, a series per family)
/// where arms measured them.
fn plot_axes(
    dir: &Path,
    rows: &[SummaryRow],
    floor: Option<&SummaryRow>,
    native: Option<&SummaryRow>,
) -> Result<Vec<PathBuf>> {
    let mut axes: BTreeMap<String, Families> = BTreeMap::new();
    for r in rows {
        let pt = point(r);
        for (k, v) in &pt {
            // Numeric values are plotted along their axis.
            let Some(x) = axis_value(v) else { continue };
            let series = series_label(&r.arm.family, pt.iter().filter(|(o, _)| *o != k));
            axes.entry(k.clone())
                .or_default()
                .entry(series)
                .or_default()
                .push((x, r));
        }
    }
    let fidelity: Vec<&SummaryRow> = rows
        .iter()
        .filter(|r| r.mean_fidelity_cosine.is_some() && r.arm.n_injections > 0)
        .collect();
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    register_font()?;
    std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
    let mut out = Vec::new();
    // A run without a numeric grid axis (a set of named arms, such as the
    // substitution bound) gets one figure: every arm's accuracy with its
    // interval beside the anchors.
    if axes.is_empty() {
        let path = dir.join("accuracy_by_arm.png");
        draw_by_arm(&path, rows, floor, native)
            .map_err(|e| DriverError::Records(format!("drawing {}: {e}", path.display())))?;
        out.push(path);
    }
    for (axis, families) in &axes {
        let path = dir.join(format!("accuracy_vs_{}.png", axis.replace('.', "_")));
        draw(&path, axis, families, floor, native)
            .map_err(|e| DriverError::Records(format!("drawing {}: {e}", path.display())))?;
        out.push(path);
    }
    if fidelity.len() >= 3 {
        for (name, get) in [
            (
                "fidelity cosine",
                (|r: &SummaryRow| r.mean_fidelity_cosine) as fn(&SummaryRow) -> Option<f64>,
            ),
            ("attention-logit correlation", |r: &SummaryRow| {
                r.mean_logit_correlation
            }),
            // Perturbed and blended arms: accuracy against the cosine their
            // transform reached (noise and genuine interpolation on one axis).
            ("achieved cosine", |r: &SummaryRow| r.mean_achieved_cosine),
        ] {
            // A series per family and per value of its categorical grid
            // axes (the carrier): numeric axes (a target cosine, a layer)
            // are what moves a point along this x axis.
            let mut fams: Families = BTreeMap::new();
            for r in &fidelity {
                if let Some(x) = get(r) {
                    fams.entry(categorical_series(&r.arm.family, &point(r)))
                        .or_default()
                        .push((x, *r));
                }
            }
            if fams.values().map(|v| v.len()).sum::<usize>() < 3 {
                continue;
            }
            let path = dir.join(format!("accuracy_vs_{}.png", name.replace([' ', '-'], "_")));
            draw(&path, name, &fams, floor, native)
                .map_err(|e| DriverError::Records(format!("drawing {}: {e}", path.display())))?;
            out.push(path);
        }
    }
    Ok(out)
}

/// A figure's chart: two f64 axes drawn to a PNG file.
pub(crate) type Chart<'a, 'b> = ChartContext<
    'a,
    BitMapBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// Straight reference lines, each labelled in the legend: `ends` gives a
/// line's two ends for its value (across the x axis for a horizontal line,
/// along it for a vertical one).
pub(crate) fn reference_lines(
    chart: &mut Chart,
    lines: &[(String, f64, RGBColor)],
    ends: impl Fn(f64) -> [(f64, f64); 2],
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    for (label, value, color) in lines {
        let style = ShapeStyle::from(&color.mix(0.7)).stroke_width(2);
        chart
            .draw_series(LineSeries::new(ends(*value), style))?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], style));
    }
    Ok(())
}

/// The anchors of a run as reference lines: the floor in black, the native
/// reference in blue, each with its accuracy in the legend.
fn anchor_lines(
    floor: Option<&SummaryRow>,
    native: Option<&SummaryRow>,
) -> Vec<(String, f64, RGBColor)> {
    [(floor, BLACK, "floor"), (native, BLUE, "native reference")]
        .into_iter()
        .filter_map(|(row, color, label)| {
            row.map(|r| (format!("{label} {:.3}", r.accuracy), r.accuracy, color))
        })
        .collect()
}

/// The legend box every figure draws, at `position`.
pub(crate) fn legend<'a>(
    chart: &mut Chart<'a, 'a>,
    position: SeriesLabelPosition,
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()?;
    Ok(())
}

/// Every arm's accuracy with its 95% interval as horizontal bars, the
/// summary's first arm on top (arm names, however long, stay readable),
/// with the floor and the native reference as vertical lines.
fn draw_by_arm(
    path: &Path,
    rows: &[SummaryRow],
    floor: Option<&SummaryRow>,
    native: Option<&SummaryRow>,
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    let n = rows.len();
    let names: Vec<String> = rows.iter().map(|r| r.arm.arm.clone()).collect();
    let longest = names.iter().map(|s| s.chars().count()).max().unwrap_or(4) as u32;
    let label_area = (20 + 8 * longest).min(900);
    let height = (120 + 36 * n as u32).clamp(300, 4000);
    let root = BitMapBackend::new(path, (label_area + 700, height)).into_drawing_area();
    root.fill(&WHITE)?;
    // Row i of the summary sits at y = n - 1 - i.
    let y_of = |i: usize| (n - 1 - i) as f64;
    let y1 = n as f64 - 0.5;
    let mut chart = ChartBuilder::on(&root)
        .caption("accuracy by arm", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(label_area)
        .build_cartesian_2d(0f64..1f64, -0.5f64..y1)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(n + 1)
        .y_label_formatter(&|y: &f64| {
            let j = y.round();
            if (y - j).abs() < 1e-6 && j >= 0.0 && (j as usize) < n {
                names[n - 1 - j as usize].clone()
            } else {
                String::new()
            }
        })
        .x_desc("accuracy (95% CI)")
        .label_style(("sans-serif", 14))
        .draw()?;
    reference_lines(&mut chart, &anchor_lines(floor, native), |a| {
        [(a, -0.5), (a, y1)]
    })?;
    let color = Palette99::pick(1).to_rgba();
    chart.draw_series(rows.iter().enumerate().map(|(i, r)| {
        Rectangle::new(
            [(0.0, y_of(i) - 0.3), (r.accuracy, y_of(i) + 0.3)],
            color.mix(0.5).filled(),
        )
    }))?;
    chart.draw_series(rows.iter().enumerate().map(|(i, r)| {
        ErrorBar::new_horizontal(
            y_of(i),
            r.ci_lo.max(0.0),
            r.accuracy,
            r.ci_hi.min(1.0),
            BLACK.filled(),
            10,
        )
    }))?;
    legend(&mut chart, SeriesLabelPosition::LowerRight)?;
    root.present()?;
    Ok(())
}

fn draw(
    path: &Path,
    axis: &str,
    families: &Families,
    floor: Option<&SummaryRow>,
    native: Option<&SummaryRow>,
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    let xs: Vec<f64> = families.values().flatten().map(|(x, _)| *x).collect();
    let (mut x0, mut x1) = xs
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    let pad = ((x1 - x0) * 0.08)
        .max(0.5 * if x1 > x0 { 0.0 } else { 1.0 })
        .max(1e-3);
    x0 -= pad;
    x1 += pad;
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("accuracy against {axis}"), ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(x0..x1, 0f64..1f64)?;
    chart
        .configure_mesh()
        .x_desc(axis)
        .y_desc("accuracy (95% CI)")
        .label_style(("sans-serif", 14))
        .draw()?;
    reference_lines(&mut chart, &anchor_lines(floor, native), |a| {
        [(x0, a), (x1, a)]
    })?;
    for (i, (family, pts)) in families.iter().enumerate() {
        let color = Palette99::pick(i + 1).to_rgba();
        let mut pts = pts.clone();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let style = ShapeStyle::from(&color).stroke_width(2);
        chart
            .draw_series(LineSeries::new(
                pts.iter().map(|(x, r)| (*x, r.accuracy)),
                style,
            ))?
            .label(family.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], style));
        chart.draw_series(pts.iter().map(|(x, r)| {
            ErrorBar::new_vertical(
                *x,
                r.ci_lo.max(0.0),
                r.accuracy,
                r.ci_hi.min(1.0),
                color.filled(),
                8,
            )
        }))?;
    }
    legend(&mut chart, SeriesLabelPosition::MiddleRight)?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A seeds row whose conditional accuracies are `cond` (none: a seed
    /// without one).
    fn seed_row(cond: Option<Vec<f64>>) -> SeedRow {
        let (mean, sd) = match &cond {
            Some(c) => {
                let s = tolerable_stats::spread(c).unwrap();
                (Some(s.mean), s.sd)
            }
            None => (None, None),
        };
        SeedRow {
            family: "bridged".into(),
            bridge: "lora_q".into(),
            point: "{}".into(),
            n_seeds: 2,
            seeds: vec![0, 1],
            runs: vec!["a".into(), "b".into()],
            run_dirs: vec!["a".into(), "b".into()],
            arms: vec!["bridged".into(), "bridged".into()],
            batching: vec![String::new(), String::new()],
            n_items: vec![10, 10],
            accuracy: vec![0.5, 0.6],
            accuracy_mean: 0.55,
            accuracy_sd: Some(0.0707),
            cond_accuracy_mean: mean,
            cond_accuracy: cond.unwrap_or_default(),
            cond_accuracy_sd: sd,
            bit_exact_items: None,
            n_items_total: 20,
        }
    }

    #[test]
    fn a_conditional_accuracy_over_seeds_reads_mean_sd_and_each_seed() {
        assert_eq!(
            conditional_over_seeds(&seed_row(Some(vec![0.25, 0.5]))),
            "0.375 ± 0.177 (0.250, 0.500)"
        );
        // One seed: its value, no spread.
        assert_eq!(conditional_over_seeds(&seed_row(Some(vec![0.25]))), "0.250");
        // A seed without one: nothing.
        assert_eq!(conditional_over_seeds(&seed_row(None)), "–");
    }

    #[test]
    fn finished_cells_read_as_ranges() {
        assert_eq!(cell_ranges(&[0, 1, 2, 3, 4, 5, 6, 9]), "0-6, 9");
        assert_eq!(cell_ranges(&[2]), "2");
        assert_eq!(cell_ranges(&[0, 2, 3, 5]), "0, 2-3, 5");
    }

    #[test]
    fn fidelity_series_split_by_carrier_not_by_target() {
        let pt = |v: serde_json::Value| -> BTreeMap<String, serde_json::Value> {
            serde_json::from_value(v).unwrap()
        };
        let a = categorical_series(
            "noise",
            &pt(serde_json::json!({ "carrier": "k", "perturb.target_cosine": 0.99 })),
        );
        let b = categorical_series(
            "noise",
            &pt(serde_json::json!({ "carrier": "k", "perturb.target_cosine": 0.9 })),
        );
        let c = categorical_series(
            "noise",
            &pt(serde_json::json!({ "carrier": "kv", "perturb.target_cosine": 0.9 })),
        );
        assert_eq!(a, "noise @carrier=k");
        assert_eq!(a, b);
        assert_ne!(b, c);
        // Layer sets and numbers are positions, not series.
        assert_eq!(
            categorical_series("budget", &pt(serde_json::json!({ "layers": "prefix:3" }))),
            "budget"
        );
        assert_eq!(categorical_series("x", &BTreeMap::new()), "x");
        assert_eq!(axis_value(&serde_json::json!("suffix:12")), Some(12.0));
        assert_eq!(axis_value(&serde_json::json!("k")), None);
    }

    #[test]
    fn an_arm_short_of_its_target_cosine_is_named() {
        let blend = r#"{"inject":[{"blend":{"toward":"other_item","target_cosine":0.8}}]}"#;
        assert_eq!(short_of_target(blend, None, Some(0.86)), Some((0.8, 0.86)));
        assert_eq!(short_of_target(blend, None, Some(0.802)), None);
        assert_eq!(
            short_of_target("{}", Some(0.9), Some(0.95)),
            Some((0.9, 0.95))
        );
        assert_eq!(short_of_target("{}", None, Some(0.95)), None);
        assert_eq!(short_of_target(blend, None, None), None);
    }
}
