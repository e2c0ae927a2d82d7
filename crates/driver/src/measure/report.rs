//! The report of a Mode D measurement run: `report.md` with source 000's
//! four headline numbers beside ours (filled from `summary.parquet`), the
//! per-layer tables, and PNG figures: dirtiness against layer (a line per
//! tau), top-1 agreement and the KL reduction against the injection layer
//! (a line per delta variant, the 0.99 line drawn), and the compute saved
//! against the injection layer with prefix KV reuse as a horizontal line.

use super::mode_d::{
    interim_summary, read_summary, Coverage, ORACLE_KL_TOLERANCE, ORACLE_POSITION_KL_TOLERANCE,
    VARIANTS,
};
use super::read_json;
use crate::error::{io, DriverError, Result};
use crate::records::MeasureRow;
use plotters::prelude::*;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Source 000's line: top-1 agreement below it is unusable for code generation.
pub const AGREEMENT_LINE: f64 = 0.99;

/// Aggregates (archetype null) of a metric by layer, for a variant and tau.
fn by_layer(
    rows: &[MeasureRow],
    measurement: &str,
    metric: &str,
    variant: Option<&str>,
    tau: Option<f64>,
) -> BTreeMap<i64, (f64, i64)> {
    rows.iter()
        .filter(|r| {
            r.measurement == measurement
                && r.metric == metric
                && r.archetype.is_none()
                && r.variant.as_deref() == variant
                && r.tau == tau
        })
        .filter_map(|r| r.layer.map(|l| (l, (r.value, r.n))))
        .collect()
}

/// The one aggregate (archetype null, no layer) of a metric.
fn scalar(rows: &[MeasureRow], measurement: &str, metric: &str) -> Option<f64> {
    rows.iter()
        .find(|r| {
            r.measurement == measurement
                && r.metric == metric
                && r.archetype.is_none()
                && r.layer.is_none()
        })
        .map(|r| r.value)
}

fn range(v: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    v.fold(None, |acc, x| match acc {
        None => Some((x, x)),
        Some((a, b)) => Some((a.min(x), b.max(x))),
    })
}

/// One variant's range of a figure over layers, `"{v} lo to hi"` (or
/// `"{v} x"` when the ends agree), each end formatted by `f`; none when no
/// layer has the figure.
fn range_cell(
    v: &str,
    values: impl Iterator<Item = f64>,
    f: impl Fn(f64) -> String,
) -> Option<String> {
    range(values).map(|(lo, hi)| {
        if lo == hi {
            format!("{v} {}", f(lo))
        } else {
            format!("{v} {} to {}", f(lo), f(hi))
        }
    })
}

/// Cells joined by "; ", or a dash when there are none.
fn cells_or_dash(cells: &[String]) -> String {
    if cells.is_empty() {
        "–".into()
    } else {
        cells.join("; ")
    }
}

fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

/// A KL ratio: two decimals in the usual range, else scientific (a Mode D
/// KL at float precision makes the ratio astronomical).
fn ratio(x: f64) -> String {
    if (0.01..1e4).contains(&x) {
        format!("{x:.2}x")
    } else {
        format!("{x:.1e}x")
    }
}

/// Writes `report.md` and `plots/*.png` for the Mode D run in `run_dir`;
/// returns the report's path.
pub fn write(run_dir: &Path) -> Result<PathBuf> {
    let meta = read_json(&run_dir.join("run.json"))?;
    if matches!(
        meta["measurement"].as_str(),
        Some("conditioning" | "quantization")
    ) {
        return super::attention_report::write(run_dir, &meta);
    }
    if !run_dir.join("summary.parquet").exists() {
        return Err(DriverError::Records(format!(
            "{} has no summary.parquet: the measurement has unfinished units (rerun it; `report --interim` reads a Mode D run in progress)",
            run_dir.display()
        )));
    }
    let rows = read_summary(run_dir)?;
    render(run_dir, &meta, &rows, None)
}

/// Writes `report-interim.md` and `plots-interim/*.png` for a Mode D run
/// in progress, from the units it has written so far
/// ([`interim_summary`]), with a banner saying how much of the run they
/// are; the finished run's `report.md` and `plots/` are not touched.
/// Returns the report's path.
pub fn write_interim(run_dir: &Path) -> Result<PathBuf> {
    let meta = read_json(&run_dir.join("run.json"))?;
    let (rows, coverage) = interim_summary(run_dir)?;
    render(run_dir, &meta, &rows, Some(&coverage))
}

/// The Mode D report over summary rows: the finished run's, or an interim
/// one's with its coverage.
fn render(
    run_dir: &Path,
    meta: &serde_json::Value,
    rows: &[MeasureRow],
    interim: Option<&Coverage>,
) -> Result<PathBuf> {
    // The delta variants the run measured, in report order.
    let variants: Vec<&str> = VARIANTS
        .iter()
        .copied()
        .filter(|v| {
            rows.iter()
                .any(|r| r.measurement == "mode_d" && r.variant.as_deref() == Some(*v))
        })
        .collect();
    let n_layers = meta["model"]["config"]["n_layers"].as_i64().unwrap_or(0);
    let taus: Vec<f64> = rows
        .iter()
        .filter_map(|r| r.tau.map(f64::to_bits))
        .collect::<BTreeSet<u64>>()
        .into_iter()
        .map(f64::from_bits)
        .collect();
    let mut md = String::new();
    let name = meta["name"].as_str().unwrap_or("run");
    let _ = writeln!(md, "# Mode D measurement `{name}`\n");
    if let Some(c) = interim {
        let _ = writeln!(
            md,
            "**Interim, not the run's result:** {} of {} contexts measured ({} of {} edit pairs), phase 1 (oracle gate, deltas) written for {} of {} contexts with pairs. Means below are over the finished contexts only (phase 2 takes the languages in turn), not a random sample of the corpus; the delta cosines are over the contexts with deltas.\n",
            c.unit_contexts,
            c.contexts,
            c.measured_pairs,
            c.pairs,
            c.oracle_contexts,
            c.contexts_with_pairs
        );
    }
    let _ = writeln!(
        md,
        "- model: `{}` ({}), sha256 `{}`, {} layers",
        meta["model"]["id"].as_str().unwrap_or("?"),
        meta["model"]["precision"].as_str().unwrap_or("?"),
        meta["model"]["sha256"].as_str().unwrap_or("unknown"),
        n_layers
    );
    let skipped = meta["skipped"].as_array().map(|a| a.len()).unwrap_or(0);
    let _ = writeln!(
        md,
        "- corpus: {} contexts from `{}`, {} edit pairs, {} (context, archetype) skipped; edit seed {}",
        meta["corpus"]["contexts"].as_array().map(|a| a.len()).unwrap_or(0),
        meta["corpus"]["source"].as_str().unwrap_or("?"),
        meta["corpus"]["pairs"],
        skipped,
        meta["seeds"]["edits"]
    );
    let o = match interim {
        Some(c) => &c.oracle,
        None => &meta["oracle"],
    };
    let _ = writeln!(
        md,
        "- gates: {}; oracle gate: {} ({} pairs x {} injection layers; worst mean KL {:.2e} nats, tolerance {:e}; worst position KL {:.2e} nats, tolerance {:e}; min agreement {}, ties {})",
        if meta["gates"]["passed"] == true { "passed" } else { "FAILED" },
        o["status"].as_str().unwrap_or("?"),
        o["pairs_checked"],
        o["layers"].as_array().map(|a| a.len()).unwrap_or(0),
        o["worst_mean_kl"].as_f64().unwrap_or(f64::NAN),
        ORACLE_KL_TOLERANCE,
        o["worst_position_kl"].as_f64().unwrap_or(f64::NAN),
        ORACLE_POSITION_KL_TOLERANCE,
        o["min_agreement"],
        o["ties"]
    );
    let _ = writeln!(
        md,
        "- config hash `{}`; git `{}`; command `{}`\n",
        meta["config_hash"].as_str().unwrap_or("?"),
        meta["git_revision"].as_str().unwrap_or("?"),
        meta["command"].as_str().unwrap_or("?")
    );

    // Headline numbers.
    let _ = writeln!(md, "## Source 000's headline numbers beside ours\n");
    let _ = writeln!(md, "| finding | source 000 | ours |");
    let _ = writeln!(md, "|---|---|---|");
    let dirt: Vec<String> = taus
        .iter()
        .map(|&t| {
            let by = by_layer(rows, "dirtiness", "dirtiness", None, Some(t));
            let first = by.iter().find(|(_, (v, _))| *v >= 0.9).map(|(l, _)| *l);
            match first {
                Some(l) => format!("tau {t}: layer {l} of {n_layers}"),
                None => format!(
                    "tau {t}: never (at most {})",
                    pct(by.values().map(|v| v.0).fold(0.0, f64::max))
                ),
            }
        })
        .collect();
    let _ = writeln!(
        md,
        "| dirtiness passes 90% of downstream positions | by layers 12-15 | {} |",
        cells_or_dash(&dirt)
    );
    let final_cos: Vec<(String, f64)> = rows
        .iter()
        .filter(|r| r.metric == "delta_cosine" && r.layer == Some(n_layers))
        .filter_map(|r| r.archetype.clone().map(|a| (a, r.value)))
        .collect();
    let pooled = rows
        .iter()
        .find(|r| r.metric == "delta_cosine" && r.layer == Some(n_layers) && r.archetype.is_none())
        .map(|r| r.value);
    let cross = rows
        .iter()
        .find(|r| r.metric == "delta_cosine_cross_archetype" && r.layer == Some(n_layers))
        .map(|r| r.value);
    let _ = writeln!(
        md,
        "| cross-context cosine of final-position deltas (final residual) | .06-.13 | {} |",
        match range(final_cos.iter().map(|x| x.1)) {
            Some((a, b)) => format!(
                "{a:.3} to {b:.3} over {} archetypes; pooled {}; different archetypes {}",
                final_cos.len(),
                pooled.map(|p| format!("{p:.3}")).unwrap_or("–".into()),
                cross.map(|p| format!("{p:.3}")).unwrap_or("–".into())
            ),
            None => "– (no archetype with two contexts)".into(),
        }
    );
    let inj: BTreeSet<i64> = rows
        .iter()
        .filter(|r| r.measurement == "mode_d")
        .filter_map(|r| r.layer)
        .collect();
    // Early layers: the first quarter of the stack, from layer 1 (at layer 0
    // the downstream tokens' true delta is exactly zero: Mode D there is
    // the full recompute of them, saving nothing).
    let early_end = (n_layers / 4).max(2);
    let early: Vec<i64> = inj
        .iter()
        .copied()
        .filter(|&l| (1..early_end).contains(&l))
        .collect();
    let mut agree_cells = Vec::new();
    let mut red_cells = Vec::new();
    for &v in &variants {
        let a = by_layer(rows, "mode_d", "agreement", Some(v), None);
        let k = by_layer(rows, "mode_d", "kl_reduction", Some(v), None);
        agree_cells.extend(range_cell(
            v,
            early.iter().filter_map(|l| a.get(l).map(|x| x.0)),
            |x| format!("{x:.3}"),
        ));
        red_cells.extend(range_cell(
            v,
            early.iter().filter_map(|l| k.get(l).map(|x| x.0)),
            ratio,
        ));
    }
    let stale_agree = scalar(rows, "stale", "agreement");
    let _ = writeln!(
        md,
        "| top-1 agreement with the full recompute, early layers (measured l in 1..{early_end}: {}) | .91-.98 (below the 0.99 line) | {}; stale reuse {} |",
        early.iter().map(|l| l.to_string()).collect::<Vec<_>>().join(", "),
        cells_or_dash(&agree_cells),
        stale_agree.map(|a| format!("{a:.3}")).unwrap_or("–".into())
    );
    let _ = writeln!(
        md,
        "| KL(full ‖ stale) / KL(full ‖ Mode D), early layers | 4-27x | {} |",
        cells_or_dash(&red_cells)
    );
    // The delta's own share of the reduction: stale reuse's KL is the same
    // at every l, so KL(stale) / KL(Mode D) also credits the recompute of
    // blocks l..L; the zero delta (no edit information, the same recompute)
    // isolates what the delta adds.
    let zero_kl = by_layer(rows, "mode_d", "kl_mode_d", Some("zero"), None);
    let mut over_zero_cells = Vec::new();
    if !zero_kl.is_empty() {
        for &v in variants.iter().filter(|&&v| v != "zero") {
            let k = by_layer(rows, "mode_d", "kl_mode_d", Some(v), None);
            over_zero_cells.extend(range_cell(
                v,
                early
                    .iter()
                    .filter_map(|l| Some(zero_kl.get(l)?.0 / k.get(l)?.0)),
                ratio,
            ));
        }
        let _ = writeln!(
            md,
            "| KL(full ‖ Mode D, zero delta) / KL(full ‖ Mode D), early layers: the delta's own gain over recomputing blocks l..L without it | – (not reported) | {} |",
            cells_or_dash(&over_zero_cells)
        );
    }
    let mut save_cells = Vec::new();
    for &v in &variants {
        let f = by_layer(rows, "compute", "saving_vs_prefix_reuse", Some(v), None);
        let s = by_layer(
            rows,
            "compute",
            "seconds_saving_vs_prefix_reuse",
            Some(v),
            None,
        );
        if let (Some(f), Some(s)) = (f.get(&1), s.get(&1)) {
            save_cells.push(format!(
                "{v}: {} of FLOPs, {} of wall time",
                pct(f.0),
                pct(s.0)
            ));
        }
    }
    let _ = writeln!(
        md,
        "| net compute saved at layer 1 against prefix KV reuse | 3-4% | {} |",
        if save_cells.is_empty() {
            "– (layer 1 not measured)".into()
        } else {
            save_cells.join("; ")
        }
    );
    let _ = writeln!(md);
    for &v in &variants {
        let a = by_layer(rows, "mode_d", "agreement", Some(v), None);
        let above: Vec<String> = a
            .iter()
            .filter(|(_, x)| x.0 >= AGREEMENT_LINE)
            .map(|(l, _)| l.to_string())
            .collect();
        let _ = writeln!(
            md,
            "Against the {AGREEMENT_LINE} line, `{v}`: {}.",
            if above.is_empty() {
                "below it at every injection layer".to_string()
            } else {
                format!("at or above it at layers {}", above.join(", "))
            }
        );
    }
    let _ = writeln!(
        md,
        "\nMeans over pairs (archetype null rows of {}); the KL reduction is the ratio of the mean KLs. Compute is each strategy's cost of the updated cache and the next-token logits at the last position: the full recompute of the edited context, prefix KV reuse (the original's cache before the edit kept, every token from the edit on through every block), and Mode D (the edited span through every block, the downstream tokens through blocks l..L, the delta extracted and injected); wall times are from this machine (shared, noisy). Definitions: downstream positions are the common suffix after the last changed token (tokens between changed sites, as in a rename or an argument added at several calls, belong to the edited span, which every strategy recomputes); the edit-site delta is the edited minus the original state at the first differing position (for a pure insertion the original's side is its first downstream token; for a pure deletion the edited side is, and Mode D is charged for computing it through the blocks below l); the archetype mean is the mean final-position delta of the archetype's pairs in other contexts, zero at layer 0 (the last token is the same id), where it and the zero variant are the full recompute of the downstream tokens.\n",
        if interim.is_some() {
            "the interim summary"
        } else {
            "`summary.parquet`"
        }

    );

    // Per-layer table.
    let _ = writeln!(md, "## By injection layer\n");
    let mut head = String::from("| l |");
    let mut sep = String::from("|---|");
    for &v in &variants {
        head.push_str(&format!(
            " agreement {v} | KL {v} | KL reduction {v} | FLOPs saved vs prefix ({v}) | time saved vs prefix ({v}) |"
        ));
        sep.push_str("---|---|---|---|---|");
        if v != "zero" && !zero_kl.is_empty() {
            head.push_str(&format!(" KL zero / KL {v} |"));
            sep.push_str("---|");
        }
    }
    head.push_str(" oracle KL |");
    sep.push_str("---|");
    let _ = writeln!(md, "{head}\n{sep}");
    let tables: Vec<[BTreeMap<i64, (f64, i64)>; 5]> = variants
        .iter()
        .map(|v| {
            [
                by_layer(rows, "mode_d", "agreement", Some(v), None),
                by_layer(rows, "mode_d", "kl_mode_d", Some(v), None),
                by_layer(rows, "mode_d", "kl_reduction", Some(v), None),
                by_layer(rows, "compute", "saving_vs_prefix_reuse", Some(v), None),
                by_layer(
                    rows,
                    "compute",
                    "seconds_saving_vs_prefix_reuse",
                    Some(v),
                    None,
                ),
            ]
        })
        .collect();
    let oracle = by_layer(rows, "mode_d", "kl_mode_d", Some("oracle"), None);
    let cell = |m: &BTreeMap<i64, (f64, i64)>, l: i64, f: &dyn Fn(f64) -> String| {
        m.get(&l).map(|x| f(x.0)).unwrap_or_else(|| "–".into())
    };
    for &l in &inj {
        let mut line = format!("| {l} |");
        for (t, &v) in tables.iter().zip(&variants) {
            line.push_str(&format!(
                " {} | {} | {} | {} | {} |",
                cell(&t[0], l, &|x| format!("{x:.3}")),
                cell(&t[1], l, &|x| format!("{x:.3e}")),
                cell(&t[2], l, &ratio),
                cell(&t[3], l, &|x| pct(x)),
                cell(&t[4], l, &|x| pct(x)),
            ));
            if v != "zero" && !zero_kl.is_empty() {
                let r = zero_kl.get(&l).zip(t[1].get(&l)).map(|(z, k)| z.0 / k.0);
                line.push_str(&format!(
                    " {} |",
                    r.map(ratio).unwrap_or_else(|| "–".into())
                ));
            }
        }
        line.push_str(&format!(" {} |", cell(&oracle, l, &|x| format!("{x:.1e}"))));
        let _ = writeln!(md, "{line}");
    }
    let _ = writeln!(
        md,
        "\nStale reuse: agreement {}, mean KL {}. Prefix KV reuse saves {} of the full recompute's FLOPs ({} of its wall time).\n",
        stale_agree.map(|a| format!("{a:.3}")).unwrap_or("–".into()),
        scalar(rows, "stale", "kl_stale").map(|a| format!("{a:.3e}")).unwrap_or("–".into()),
        scalar(rows, "compute", "saving_prefix_reuse_vs_full").map(pct).unwrap_or("–".into()),
        scalar(rows, "compute", "seconds_saving_prefix_reuse_vs_full").map(pct).unwrap_or("–".into()),
    );

    // Dirtiness table.
    let _ = writeln!(md, "## Dirtiness by layer\n");
    let _ = writeln!(
        md,
        "Fraction of downstream positions whose state moved by more than tau (relative L2); layer {n_layers} is the final residual.\n"
    );
    let mut head = String::from("| layer |");
    let mut sep = String::from("|---|");
    for t in &taus {
        head.push_str(&format!(" tau {t} |"));
        sep.push_str("---|");
    }
    head.push_str(" mean relative L2 |");
    sep.push_str("---|");
    let _ = writeln!(md, "{head}\n{sep}");
    let dts: Vec<_> = taus
        .iter()
        .map(|&t| by_layer(rows, "dirtiness", "dirtiness", None, Some(t)))
        .collect();
    let rel = by_layer(rows, "dirtiness", "rel_l2_mean", None, None);
    for l in 0..=n_layers {
        let mut line = format!("| {l} |");
        for d in &dts {
            line.push_str(&format!(" {} |", cell(d, l, &|x| format!("{x:.3}"))));
        }
        line.push_str(&format!(" {} |", cell(&rel, l, &|x| format!("{x:.3}"))));
        let _ = writeln!(md, "{line}");
    }

    // Delta cosines per archetype at the final residual, and skips.
    if !final_cos.is_empty() {
        let _ = writeln!(
            md,
            "\n## Cross-context delta cosine by archetype (final residual)\n"
        );
        let _ = writeln!(md, "| archetype | mean cosine | context pairs |");
        let _ = writeln!(md, "|---|---|---|");
        for r in rows.iter().filter(|r| {
            r.metric == "delta_cosine" && r.layer == Some(n_layers) && r.archetype.is_some()
        }) {
            let _ = writeln!(
                md,
                "| {} | {:.3} | {} |",
                r.archetype.as_deref().unwrap_or("?"),
                r.value,
                r.n
            );
        }
    }
    let _ = writeln!(md, "\n## Skips\n");
    let skip_rows: Vec<&MeasureRow> = rows
        .iter()
        .filter(|r| r.metric == "skipped" && r.archetype.is_some() && r.layer.is_none())
        .collect();
    if skip_rows.is_empty() {
        let _ = writeln!(md, "None.");
    } else {
        for r in skip_rows {
            let _ = writeln!(
                md,
                "- `{}`: {} (context, archetype) skipped",
                r.archetype.as_deref().unwrap_or("?"),
                r.value
            );
        }
        let _ = writeln!(md, "\nReasons per context: `run.json` (`skipped`) and the `skip` rows of `units/*.parquet`.");
    }

    let (file, plot_dir) = match interim {
        Some(_) => ("report-interim.md", "plots-interim"),
        None => ("report.md", "plots"),
    };
    let plots = plots(run_dir, plot_dir, rows, &variants, &taus, n_layers, &inj)?;
    let _ = writeln!(md, "\n## Figures\n");
    for p in plots {
        let rel = p.strip_prefix(run_dir).unwrap_or(&p).display().to_string();
        let _ = writeln!(md, "![{rel}]({rel})\n");
    }
    let out = run_dir.join(file);
    std::fs::write(&out, md).map_err(io(format!("writing {}", out.display())))?;
    Ok(out)
}

/// A line of a chart.
pub(crate) struct Series {
    /// Legend text.
    pub(crate) label: String,
    /// (x, y) points.
    pub(crate) points: Vec<(f64, f64)>,
}

fn plots(
    run_dir: &Path,
    plot_dir: &str,
    rows: &[MeasureRow],
    variants: &[&str],
    taus: &[f64],
    n_layers: i64,
    inj: &BTreeSet<i64>,
) -> Result<Vec<PathBuf>> {
    crate::report::register_font()?;
    let dir = run_dir.join(plot_dir);
    std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
    let pts = |m: &BTreeMap<i64, (f64, i64)>| -> Vec<(f64, f64)> {
        m.iter().map(|(l, v)| (*l as f64, v.0)).collect()
    };
    let mut out = Vec::new();
    let draw_to = |name: &str,
                   title: &str,
                   x_desc: &str,
                   y_desc: &str,
                   series: Vec<Series>,
                   hlines: Vec<(String, f64)>,
                   out: &mut Vec<PathBuf>|
     -> Result<()> {
        if series.iter().all(|s| s.points.is_empty()) {
            return Ok(());
        }
        let path = dir.join(name);
        line_chart(&path, title, x_desc, y_desc, &series, &hlines)
            .map_err(|e| DriverError::Records(format!("drawing {}: {e}", path.display())))?;
        out.push(path);
        Ok(())
    };
    draw_to(
        "dirtiness_vs_layer.png",
        "dirtiness of downstream positions",
        &format!("layer (resid_pre; {n_layers} = final residual)"),
        "fraction moved by more than tau",
        taus.iter()
            .map(|&t| Series {
                label: format!("tau {t}"),
                points: pts(&by_layer(rows, "dirtiness", "dirtiness", None, Some(t))),
            })
            .collect(),
        vec![("90%".into(), 0.9)],
        &mut out,
    )?;
    let mut agree: Vec<Series> = variants
        .iter()
        .map(|v| Series {
            label: (*v).into(),
            points: pts(&by_layer(rows, "mode_d", "agreement", Some(v), None)),
        })
        .collect();
    agree.push(Series {
        label: "oracle".into(),
        points: pts(&by_layer(rows, "mode_d", "agreement", Some("oracle"), None)),
    });
    let mut h = vec![(
        format!("{AGREEMENT_LINE} (source 000's line)"),
        AGREEMENT_LINE,
    )];
    if let Some(s) = scalar(rows, "stale", "agreement") {
        h.push((format!("stale reuse {s:.3}"), s));
    }
    draw_to(
        "agreement_vs_layer.png",
        "Mode D top-1 agreement with the full recompute",
        "injection layer l",
        "top-1 agreement over downstream positions",
        agree,
        h,
        &mut out,
    )?;
    draw_to(
        "kl_reduction_vs_layer.png",
        "KL(full || stale) / KL(full || Mode D)",
        "injection layer l",
        "log10 of the KL reduction",
        variants
            .iter()
            .map(|v| Series {
                label: (*v).into(),
                points: by_layer(rows, "mode_d", "kl_reduction", Some(v), None)
                    .iter()
                    .filter(|(_, x)| x.0 > 0.0 && x.0.is_finite())
                    .map(|(l, x)| (*l as f64, x.0.log10()))
                    .collect(),
            })
            .collect(),
        vec![("no reduction (1x)".into(), 0.0)],
        &mut out,
    )?;
    let mut save = Vec::new();
    for &v in variants {
        save.push(Series {
            label: format!("Mode D {v}, FLOPs"),
            points: pts(&by_layer(rows, "compute", "saving_vs_full", Some(v), None)),
        });
        save.push(Series {
            label: format!("Mode D {v}, wall time"),
            points: pts(&by_layer(
                rows,
                "compute",
                "seconds_saving_vs_full",
                Some(v),
                None,
            )),
        });
    }
    let mut h = Vec::new();
    if let Some(s) = scalar(rows, "compute", "saving_prefix_reuse_vs_full") {
        h.push((format!("prefix KV reuse, FLOPs {}", pct(s)), s));
    }
    if let Some(s) = scalar(rows, "compute", "seconds_saving_prefix_reuse_vs_full") {
        h.push((format!("prefix KV reuse, wall time {}", pct(s)), s));
    }
    if !inj.is_empty() {
        draw_to(
            "saving_vs_layer.png",
            "compute saved against the full recompute",
            "injection layer l",
            "1 - cost / full recompute's cost",
            save,
            h,
            &mut out,
        )?;
    }
    Ok(out)
}

pub(crate) fn line_chart(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[Series],
    hlines: &[(String, f64)],
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    let xs = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let (mut x0, mut x1) = range(xs).unwrap_or((0.0, 1.0));
    let ys = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .chain(hlines.iter().map(|h| h.1))
        .filter(|y| y.is_finite());
    let (mut y0, mut y1) = range(ys).unwrap_or((0.0, 1.0));
    let xpad = ((x1 - x0) * 0.04).max(0.5);
    x0 -= xpad;
    x1 += xpad;
    let ypad = ((y1 - y0) * 0.06).max(1e-3);
    y0 -= ypad;
    y1 += ypad;
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1, y0..y1)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .label_style(("sans-serif", 14))
        .draw()?;
    // The first line black, the others blue.
    let lines: Vec<(String, f64, RGBColor)> = hlines
        .iter()
        .enumerate()
        .map(|(i, (label, y))| (label.clone(), *y, if i == 0 { BLACK } else { BLUE }))
        .collect();
    crate::report::reference_lines(&mut chart, &lines, |y| [(x0, y), (x1, y)])?;
    for (i, s) in series.iter().enumerate() {
        if s.points.is_empty() {
            continue;
        }
        let color = Palette99::pick(i + 1).to_rgba();
        let style = ShapeStyle::from(&color).stroke_width(2);
        let mut p = s.points.clone();
        p.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(p.iter().copied(), style))?
            .label(s.label.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], style));
        chart.draw_series(
            p.iter()
                .map(|&(x, y)| Circle::new((x, y), 3, color.filled())),
        )?;
    }
    crate::report::legend(&mut chart, SeriesLabelPosition::MiddleRight)?;
    root.present()?;
    Ok(())
}
