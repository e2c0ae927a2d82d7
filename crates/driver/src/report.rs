//! Reports of a finished run: a Markdown file of tables (accuracy ± SE,
//! intervals, conditional accuracy, span-copy, fidelity, lifts over named
//! controls, anchors beside every number) and PNG plots of accuracy against
//! each numeric grid axis (layer, alpha, cosine, ...), with the floor and
//! native reference drawn as lines and 95% intervals as bars.

use crate::error::{io, DriverError, Result};
use crate::records::{opt_f64s as col_f64, opt_i64s as col_i64, opt_strs as col_str, read_parquet};
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// One summary row as the report reads it.
#[derive(Debug, Clone)]
struct Row {
    arm: String,
    family: String,
    point: BTreeMap<String, String>,
    n: i64,
    accuracy: f64,
    se: f64,
    ci: (f64, f64),
    wilson: (f64, f64),
    cond: Option<f64>,
    cond_n: i64,
    span_copy: f64,
    fidelity: Option<f64>,
    achieved: Option<f64>,
    lift: Option<(f64, f64, f64)>,
    strongest: Option<String>,
    bit_exact: Option<i64>,
}

fn read_rows(run_dir: &Path) -> Result<Vec<Row>> {
    let df = read_parquet(&run_dir.join("summary.parquet"))?;
    let arm = col_str(&df, "arm")?;
    let family = col_str(&df, "family")?;
    let point = col_str(&df, "point")?;
    let n = col_i64(&df, "n")?;
    let acc = col_f64(&df, "accuracy")?;
    let se = col_f64(&df, "se")?;
    let lo = col_f64(&df, "ci_lo")?;
    let hi = col_f64(&df, "ci_hi")?;
    let wlo = col_f64(&df, "wilson_lo")?;
    let whi = col_f64(&df, "wilson_hi")?;
    let cond = col_f64(&df, "cond_accuracy")?;
    let cond_n = col_i64(&df, "cond_n")?;
    let copy = col_f64(&df, "span_copy_rate")?;
    let fid = col_f64(&df, "fidelity_cosine")?;
    let ach = col_f64(&df, "achieved_cosine")?;
    let lift = col_f64(&df, "lift")?;
    let lift_lo = col_f64(&df, "lift_lo")?;
    let lift_hi = col_f64(&df, "lift_hi")?;
    let strongest = col_str(&df, "strongest_control")?;
    let exact = col_i64(&df, "bit_exact_items")?;
    Ok((0..df.height())
        .map(|i| Row {
            arm: arm[i].clone().unwrap_or_default(),
            family: family[i].clone().unwrap_or_default(),
            point: point[i]
                .as_deref()
                .and_then(|p| serde_json::from_str(p).ok())
                .unwrap_or_default(),
            n: n[i].unwrap_or(0),
            accuracy: acc[i].unwrap_or(f64::NAN),
            se: se[i].unwrap_or(f64::NAN),
            ci: (lo[i].unwrap_or(f64::NAN), hi[i].unwrap_or(f64::NAN)),
            wilson: (wlo[i].unwrap_or(f64::NAN), whi[i].unwrap_or(f64::NAN)),
            cond: cond[i],
            cond_n: cond_n[i].unwrap_or(0),
            span_copy: copy[i].unwrap_or(f64::NAN),
            fidelity: fid[i],
            achieved: ach[i],
            lift: match (lift[i], lift_lo[i], lift_hi[i]) {
                (Some(a), Some(b), Some(c)) => Some((a, b, c)),
                _ => None,
            },
            strongest: strongest[i].clone(),
            bit_exact: exact[i],
        })
        .collect())
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map(|x| format!("{x:.digits$}"))
        .unwrap_or_else(|| "–".into())
}

/// Writes `report.md` and `plots/*.png` for the run in `run_dir`; returns
/// the report's path.
pub fn write(run_dir: &Path) -> Result<PathBuf> {
    let meta_path = run_dir.join("run.json");
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&meta_path)
            .map_err(io(format!("reading {}", meta_path.display())))?,
    )
    .map_err(|e| DriverError::Records(format!("{}: {e}", meta_path.display())))?;
    if !run_dir.join("summary.parquet").exists() {
        return Err(DriverError::Records(format!(
            "{} has no summary.parquet: the sweep has unfinished cells (rerun it, or merge its shards)",
            run_dir.display()
        )));
    }
    let rows = read_rows(run_dir)?;
    let anchor = |name: &str| rows.iter().find(|r| r.arm == name).cloned();
    let (floor, native) = (anchor("floor"), anchor("native"));
    let mut md = String::new();
    let name = meta["name"].as_str().unwrap_or("run");
    let _ = writeln!(md, "# Run `{name}`\n");
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
            f.accuracy, f.se, n.accuracy, n.se, f.n
        );
    }
    let _ = writeln!(
        md,
        "| arm | n | accuracy ± SE | 95% CI | Wilson 95% | conditional (n) | span-copy | fidelity cos | achieved cos | lift over strongest control [95% CI] | bit-exact |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let lift = match (&r.lift, &r.strongest) {
            (Some((d, lo, hi)), Some(c)) => format!("{d:+.3} [{lo:+.3}, {hi:+.3}] vs `{c}`"),
            _ => "–".into(),
        };
        let _ =
            writeln!(
            md,
            "| `{}` | {} | {:.3} ± {:.3} | [{:.3}, {:.3}] | [{:.3}, {:.3}] | {} ({}) | {:.3} | {} | {} | {} | {} |",
            r.arm,
            r.n,
            r.accuracy,
            r.se,
            r.ci.0,
            r.ci.1,
            r.wilson.0,
            r.wilson.1,
            opt(r.cond, 3),
            r.cond_n,
            r.span_copy,
            opt(r.fidelity, 4),
            opt(r.achieved, 4),
            lift,
            r.bit_exact.map(|k| format!("{k}/{}", r.n)).unwrap_or_else(|| "–".into())
        );
    }
    let plots = plot_axes(run_dir, &rows, floor.as_ref(), native.as_ref())?;
    if !plots.is_empty() {
        let _ = writeln!(md, "\n## Plots\n");
        for p in plots {
            let rel = p.strip_prefix(run_dir).unwrap_or(&p).display().to_string();
            let _ = writeln!(md, "![{rel}]({rel})\n");
        }
    }
    let out = run_dir.join("report.md");
    std::fs::write(&out, md).map_err(io(format!("writing {}", out.display())))?;
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

fn register_font() -> Result<()> {
    static ONCE: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    ONCE.get_or_init(|| {
        let bytes = font_bytes().map_err(|e| e.to_string())?;
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| "the font file could not be read as TrueType".to_string())
    })
    .clone()
    .map_err(DriverError::Records)
}

/// Arm families on one grid axis: family name to (axis value, summary row).
type Families<'a> = BTreeMap<String, Vec<(f64, &'a Row)>>;

/// One plot per numeric grid axis: every family on that axis as a series.
fn plot_axes(
    run_dir: &Path,
    rows: &[Row],
    floor: Option<&Row>,
    native: Option<&Row>,
) -> Result<Vec<PathBuf>> {
    let mut axes: BTreeMap<String, Families> = BTreeMap::new();
    for r in rows {
        if r.point.len() != 1 {
            continue;
        }
        let (k, v) = r.point.iter().next().unwrap();
        if let Ok(x) = v.parse::<f64>() {
            axes.entry(k.clone())
                .or_default()
                .entry(r.family.clone())
                .or_default()
                .push((x, r));
        }
    }
    if axes.is_empty() {
        return Ok(Vec::new());
    }
    register_font()?;
    let dir = run_dir.join("plots");
    std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
    let mut out = Vec::new();
    for (axis, families) in &axes {
        let path = dir.join(format!("accuracy_vs_{}.png", axis.replace('.', "_")));
        draw(&path, axis, families, floor, native)
            .map_err(|e| DriverError::Records(format!("drawing {}: {e}", path.display())))?;
        out.push(path);
    }
    Ok(out)
}

fn draw(
    path: &Path,
    axis: &str,
    families: &Families,
    floor: Option<&Row>,
    native: Option<&Row>,
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
    for (row, color, label) in [(floor, BLACK, "floor"), (native, BLUE, "native reference")] {
        if let Some(r) = row {
            let style = ShapeStyle::from(&color.mix(0.7)).stroke_width(2);
            chart
                .draw_series(LineSeries::new([(x0, r.accuracy), (x1, r.accuracy)], style))?
                .label(format!("{label} {:.3}", r.accuracy))
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], style));
        }
    }
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
                r.ci.0.max(0.0),
                r.accuracy,
                r.ci.1.min(1.0),
                color.filled(),
                8,
            )
        }))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()?;
    root.present()?;
    Ok(())
}
