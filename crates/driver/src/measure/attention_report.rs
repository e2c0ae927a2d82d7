//! Reports of conditioning and quantization runs: `report.md` with paper
//! 1's appendix-E numbers beside ours, and figures (readout gain against
//! layer, on and off the manifold, with the analytic bound; gain against
//! magnitude).

use super::report::{line_chart, Series};
use super::{read_rows, MeasureRow};
use crate::error::{io, DriverError, Result};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn find<'a>(
    rows: &'a [MeasureRow],
    metric: &str,
    layer: Option<i64>,
    variant: Option<&str>,
    magnitude: Option<f64>,
) -> Option<&'a MeasureRow> {
    rows.iter().find(|r| {
        r.metric == metric
            && r.layer == layer
            && r.variant.as_deref() == variant
            && r.magnitude == magnitude
    })
}

fn val(r: Option<&MeasureRow>) -> String {
    r.map(|r| format!("{:.3}", r.value))
        .unwrap_or_else(|| "—".into())
}

/// A mean with its standard error over probes (`<metric>_se`) where the
/// summary has one.
fn val_se(
    rows: &[MeasureRow],
    metric: &str,
    layer: Option<i64>,
    variant: Option<&str>,
    magnitude: Option<f64>,
) -> String {
    let se = find(rows, &format!("{metric}_se"), layer, variant, magnitude);
    match (find(rows, metric, layer, variant, magnitude), se) {
        // Two significant digits where three decimals would show 0.000.
        (Some(m), Some(se)) if se.value.abs() < 5e-4 => {
            format!("{:.3} ± {:.1e}", m.value, se.value)
        }
        (Some(m), Some(se)) => format!("{:.3} ± {:.3}", m.value, se.value),
        (m, _) => val(m),
    }
}

fn by_layer(
    rows: &[MeasureRow],
    metric: &str,
    variant: Option<&str>,
    magnitude: Option<f64>,
) -> Vec<(f64, f64)> {
    rows.iter()
        .filter(|r| {
            r.metric == metric && r.variant.as_deref() == variant && r.magnitude == magnitude
        })
        .filter_map(|r| r.layer.map(|l| (l as f64, r.value)))
        .collect()
}

fn draw(
    dir: &Path,
    name: &str,
    title: &str,
    x: &str,
    y: &str,
    series: Vec<Series>,
    out: &mut Vec<PathBuf>,
) -> Result<()> {
    if series.iter().all(|s| s.points.is_empty()) {
        return Ok(());
    }
    let path = dir.join(name);
    line_chart(&path, title, x, y, &series, &[])
        .map_err(|e| DriverError::Records(format!("drawing {}: {e}", path.display())))?;
    out.push(path);
    Ok(())
}

/// Writes the report of the conditioning or quantization run in `run_dir`.
pub fn write(run_dir: &Path, meta: &serde_json::Value) -> Result<PathBuf> {
    let summary = run_dir.join("summary.parquet");
    if !summary.exists() {
        return Err(DriverError::Records(format!(
            "{} has no summary.parquet: the measurement has unfinished probes (rerun it)",
            run_dir.display()
        )));
    }
    let rows = read_rows(&summary)?;
    let name = meta["name"].as_str().unwrap_or("run");
    let model = meta["model"]["id"].as_str().unwrap_or("?");
    let probes = meta["probes"]["ids"]
        .as_array()
        .map(|a| a.len())
        .unwrap_or(0);
    let g = meta["group_size"].as_u64().unwrap_or(0);
    let dir = run_dir.join("plots");
    std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
    crate::report::register_font()?;
    let mut plots = Vec::new();
    let mut md = String::new();
    match meta["measurement"].as_str() {
        Some("conditioning") => {
            let _ = writeln!(md, "# Conditioning `{name}`\n");
            let _ = writeln!(
                md,
                "{model}, {probes} probes (SQuAD items read with their full passage), G = {g} query heads per kv head, bound constant sqrt(2G) = {:.3}. Readout of the decision query (last prompt position) over every slot; one fact-region slot displaced per seed; gains are |change| / |displacement| by finite differences (`tolerable_carrier::readout`). Means over probes, kv heads, seeds, directions and magnitudes unless a magnitude is named, ± their standard error over probes. Absolute gains are per unit of key displacement; relative gains divide the readout's relative change by the key's (`|dS| / |S_j|` over `|delta| / |k_j|` for the logits of the slot, `|dP| / |P|` over `|delta| / |k_j|` for the weights). The paper does not define its normalisation in the text we have, so its absolute values are not ours to match; the off/on ratio is unit-free in both.\n",
                (2.0 * g as f64).sqrt()
            );
            let _ = writeln!(
                md,
                "| stage | off-manifold | on-manifold | off / on | paper (off / on, ratio) |"
            );
            let _ = writeln!(md, "|---|---|---|---|---|");
            for (stage, metric, paper) in [
                (
                    "attention logits (absolute)",
                    "gain_logit",
                    "0.506 / 0.343, 1.475x",
                ),
                (
                    "softmax output (absolute)",
                    "gain_softmax",
                    "2.192 / 1.482, 1.479x",
                ),
                (
                    "attention logits (relative)",
                    "gain_logit_rel",
                    "0.506 / 0.343, 1.475x",
                ),
                (
                    "softmax output (relative)",
                    "gain_softmax_rel",
                    "2.192 / 1.482, 1.479x",
                ),
            ] {
                let _ = writeln!(
                    md,
                    "| {stage} | {} | {} | {} | {paper} |",
                    val_se(&rows, metric, None, Some("off_manifold"), None),
                    val_se(&rows, metric, None, Some("on_manifold"), None),
                    val(find(&rows, metric, None, Some("off_over_on"), None)),
                );
            }
            let smallest = rows
                .iter()
                .filter(|r| r.metric == "bound_correlation")
                .filter_map(|r| r.magnitude)
                .next();
            let _ = writeln!(md, "\nThe analytic per-slot bound against the measured softmax gain at the smallest magnitude ({}), across layers:\n", smallest.map(|m| format!("{m}")).unwrap_or_else(|| "—".into()));
            let _ = writeln!(
                md,
                "| direction | Pearson r (paper 0.999) | largest gain / bound |"
            );
            let _ = writeln!(md, "|---|---|---|");
            for v in ["on_manifold", "off_manifold"] {
                let _ = writeln!(
                    md,
                    "| {v} | {} | {} |",
                    val(find(&rows, "bound_correlation", None, Some(v), smallest)),
                    val(find(&rows, "gain_over_bound_max", None, Some(v), smallest)),
                );
            }
            let _ = writeln!(md, "\nPer layer (paper: gains rise from about 0.11 at layer 1 to about 0.72 by layer 6, no cliff):\n");
            let _ = writeln!(md, "| layer | logit off | logit on | softmax off | softmax on | off/on (softmax) | bound | slot weight |");
            let _ = writeln!(md, "|---|---|---|---|---|---|---|---|");
            let layers: Vec<i64> = rows
                .iter()
                .filter_map(|r| r.layer)
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            for &layer in &layers {
                let l = Some(layer);
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {} | {} | {} | {} |",
                    layer,
                    val(find(&rows, "gain_logit", l, Some("off_manifold"), None)),
                    val(find(&rows, "gain_logit", l, Some("on_manifold"), None)),
                    val(find(&rows, "gain_softmax", l, Some("off_manifold"), None)),
                    val(find(&rows, "gain_softmax", l, Some("on_manifold"), None)),
                    val(find(&rows, "gain_softmax", l, Some("off_over_on"), None)),
                    val(find(&rows, "bound_softmax", l, None, None)),
                    val(find(&rows, "slot_weight", l, None, None)),
                );
            }
            let mut series = Vec::new();
            for (metric, stage) in [("gain_logit", "logit"), ("gain_softmax", "softmax")] {
                for v in ["off_manifold", "on_manifold"] {
                    series.push(Series {
                        label: format!("{stage}, {v}"),
                        points: by_layer(&rows, metric, Some(v), None),
                    });
                }
            }
            draw(
                &dir,
                "gain_vs_layer.png",
                "Readout gain per layer",
                "layer",
                "gain (mean)",
                series,
                &mut plots,
            )?;
            let series = vec![
                Series {
                    label: "measured softmax gain, off-manifold (smallest magnitude)".into(),
                    points: by_layer(&rows, "gain_softmax", Some("off_manifold"), smallest),
                },
                Series {
                    label: "measured softmax gain, on-manifold (smallest magnitude)".into(),
                    points: by_layer(&rows, "gain_softmax", Some("on_manifold"), smallest),
                },
                Series {
                    label: "analytic bound, sqrt(2G) constant".into(),
                    points: by_layer(&rows, "bound_softmax", None, None),
                },
            ];
            draw(
                &dir,
                "bound_vs_layer.png",
                "Softmax gain and its analytic bound",
                "layer",
                "gain",
                series,
                &mut plots,
            )?;
            let mut mags: BTreeMap<u64, ()> = BTreeMap::new();
            for r in &rows {
                if let (Some(m), None) = (r.magnitude, r.layer) {
                    mags.insert(m.to_bits(), ());
                }
            }
            let mut series = Vec::new();
            for v in ["off_manifold", "on_manifold"] {
                let pts: Vec<(f64, f64)> = mags
                    .keys()
                    .filter_map(|m| {
                        let m = f64::from_bits(*m);
                        find(&rows, "gain_softmax", None, Some(v), Some(m))
                            .map(|r| (m.log10(), r.value))
                    })
                    .collect();
                series.push(Series {
                    label: format!("softmax, {v}"),
                    points: pts,
                });
            }
            draw(
                &dir,
                "gain_vs_magnitude.png",
                "Softmax gain against displacement",
                "log10 |delta| / |k|",
                "gain (mean)",
                series,
                &mut plots,
            )?;
        }
        _ => {
            let _ = writeln!(md, "# Quantization against noise `{name}`\n");
            let _ = writeln!(
                md,
                "{model}, {probes} probes. Symmetric per-slot integer round trips of the whole cache (keys and values) against Gaussian noise of the same displacement norm slot by slot; attention output of the decision query's G = {g} heads per kv head, relative error; the share of the key displacement in the question queries' principal subspace (isotropic share: {}). Means over probes, layers and kv heads, ± their standard error over probes.\n",
                val(find(&rows, "query_share_isotropic", None, None, None))
            );
            let _ = writeln!(md, "| displacement | norm | relative norm | attention-output error | query-subspace share |");
            let _ = writeln!(md, "|---|---|---|---|---|");
            let mut variants: Vec<(String, Option<f64>)> = rows
                .iter()
                .filter(|r| r.layer.is_none() && r.metric == "output_error")
                .filter_map(|r| r.variant.clone().map(|v| (v, r.magnitude)))
                .collect();
            variants.sort_by(|a, b| {
                a.1.map(f64::to_bits)
                    .cmp(&b.1.map(f64::to_bits))
                    .then(a.0.cmp(&b.0))
            });
            variants.dedup();
            for (v, m) in &variants {
                let _ = writeln!(
                    md,
                    "| {v} | {} | {} | {} | {} |",
                    m.map(|m| format!("fixed {m}"))
                        .unwrap_or_else(|| "own".into()),
                    val_se(&rows, "displacement", None, Some(v), *m),
                    val_se(&rows, "output_error", None, Some(v), *m),
                    val_se(&rows, "query_share", None, Some(v), *m),
                );
            }
            let _ = writeln!(md, "\nPaper 1 (appendix E, a six-probe pilot): at displacement norm 0.05, quantization's attention-output error 0.153 against noise's 0.129, query-subspace share 0.447 against 0.354; int8 displacement norm 0.0048.\n");
            let mut series = Vec::new();
            for (v, m) in &variants {
                series.push(Series {
                    label: format!(
                        "{v} ({})",
                        m.map(|m| format!("norm {m}"))
                            .unwrap_or_else(|| "own norm".into())
                    ),
                    points: by_layer(&rows, "output_error", Some(v), *m),
                });
            }
            draw(
                &dir,
                "output_error_vs_layer.png",
                "Attention-output error per layer",
                "layer",
                "relative error",
                series,
                &mut plots,
            )?;
        }
    }
    if !plots.is_empty() {
        let _ = writeln!(md, "\n## Figures\n");
        for p in &plots {
            if let Some(n) = p.file_name().and_then(|n| n.to_str()) {
                let _ = writeln!(md, "![{n}](plots/{n})");
            }
        }
    }
    let _ = writeln!(
        md,
        "\nProvenance: `run.json` (model sha256 {}, build {}, gates passed: {}).",
        meta["model"]["sha256"].as_str().unwrap_or("?"),
        meta["build_revision"].as_str().unwrap_or("?"),
        meta["gates"]["passed"]
    );
    let path = run_dir.join("report.md");
    std::fs::write(&path, md).map_err(io(format!("writing {}", path.display())))?;
    Ok(path)
}
