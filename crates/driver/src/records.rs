//! Records: one row per (run, arm, item), one summary row per (run, arm),
//! written as Parquet (zstd). Item rows go to per-cell files under
//! `items/`, which read together as one table.

use crate::config::{PlannedArm, SweepConfig};
use crate::error::{io, DriverError, Result};
use polars::prelude::*;
use std::path::{Path, PathBuf};
use tolerable_stats::{lift, Proportion};

/// An arm's fields as record columns (from its first injection).
#[derive(Debug, Clone, PartialEq)]
pub struct ArmColumns {
    /// Arm name.
    pub arm: String,
    /// Name before grid expansion.
    pub family: String,
    /// `masked` or `full`.
    pub base: String,
    /// Carrier of the first injection.
    pub carrier: Option<String>,
    /// Layer set of the first injection.
    pub layers: Option<String>,
    /// Its lowest layer (for plots against depth).
    pub layer: Option<i64>,
    /// Position set.
    pub positions: Option<String>,
    /// Source.
    pub source: Option<String>,
    /// Mechanism.
    pub mechanism: Option<String>,
    /// Weight of interpolate / add.
    pub alpha: Option<f64>,
    /// Perturbation kind.
    pub perturb: Option<String>,
    /// Its target cosine.
    pub target_cosine: Option<f64>,
    /// Number of injections.
    pub n_injections: i64,
    /// Grid point as JSON.
    pub point: String,
}

impl ArmColumns {
    /// The columns of a planned arm.
    pub fn of(pa: &PlannedArm) -> Self {
        let first = pa.arm.inject.first();
        Self {
            arm: pa.arm.name.clone(),
            family: pa.family.clone(),
            base: pa.arm.base.name().into(),
            carrier: first.map(|i| i.carrier.name().into()),
            layers: first.map(|i| i.layers.to_string()),
            layer: first.and_then(|i| i.layers.first()).map(|l| l as i64),
            positions: first.map(|i| i.positions.name().into()),
            source: first.map(|i| i.source.name().into()),
            mechanism: first.map(|i| i.mechanism.name().into()),
            alpha: first.and_then(|i| i.alpha),
            perturb: first
                .and_then(|i| i.perturb.as_ref())
                .map(|p| p.name().into()),
            target_cosine: first
                .and_then(|i| i.perturb.as_ref())
                .and_then(|p| p.target_cosine()),
            n_injections: pa.arm.inject.len() as i64,
            point: serde_json::to_string(&pa.point).unwrap_or_default(),
        }
    }
}

/// One (arm, item) record.
#[derive(Debug, Clone, PartialEq)]
pub struct ItemRow {
    /// The arm.
    pub arm: ArmColumns,
    /// Position of the item in the run's sample.
    pub item_index: i64,
    /// SQuAD (or synthetic) id.
    pub item_id: String,
    /// Prompt length in tokens (full prompt).
    pub prompt_tokens: i64,
    /// Fact-region size.
    pub fact_tokens: i64,
    /// Positions injected per layer.
    pub n_sites: i64,
    /// Decoded continuation.
    pub continuation: String,
    /// Its token ids, space-separated.
    pub continuation_ids: String,
    /// A gold answer is in the continuation (SQuAD normalisation).
    pub correct: bool,
    /// The continuation copies a span of the holder's passage.
    pub span_copy: bool,
    /// The native reference was correct on this item (for conditional accuracy).
    pub native_correct: bool,
    /// Mean cosine of the injected slots to the native state.
    pub fidelity_cosine: Option<f64>,
    /// Cosine of perturbed to unperturbed source at the sites.
    pub achieved_cosine: Option<f64>,
    /// Outcome of the arm's bit-exact gate.
    pub bit_exact: Option<bool>,
    /// Wall seconds attributed to this arm on this item.
    pub seconds: f64,
}

fn s(name: &str, v: Vec<String>) -> Column {
    Column::new(name.into(), v)
}
fn os(name: &str, v: Vec<Option<String>>) -> Column {
    Column::new(name.into(), v)
}

fn arm_columns(arms: &[&ArmColumns]) -> Vec<Column> {
    vec![
        s("arm", arms.iter().map(|a| a.arm.clone()).collect()),
        s("family", arms.iter().map(|a| a.family.clone()).collect()),
        s("base", arms.iter().map(|a| a.base.clone()).collect()),
        os("carrier", arms.iter().map(|a| a.carrier.clone()).collect()),
        os("layers", arms.iter().map(|a| a.layers.clone()).collect()),
        Column::new(
            "layer".into(),
            arms.iter().map(|a| a.layer).collect::<Vec<_>>(),
        ),
        os(
            "positions",
            arms.iter().map(|a| a.positions.clone()).collect(),
        ),
        os("source", arms.iter().map(|a| a.source.clone()).collect()),
        os(
            "mechanism",
            arms.iter().map(|a| a.mechanism.clone()).collect(),
        ),
        Column::new(
            "alpha".into(),
            arms.iter().map(|a| a.alpha).collect::<Vec<_>>(),
        ),
        os("perturb", arms.iter().map(|a| a.perturb.clone()).collect()),
        Column::new(
            "target_cosine".into(),
            arms.iter().map(|a| a.target_cosine).collect::<Vec<_>>(),
        ),
        Column::new(
            "n_injections".into(),
            arms.iter().map(|a| a.n_injections).collect::<Vec<_>>(),
        ),
        s("point", arms.iter().map(|a| a.point.clone()).collect()),
    ]
}

/// The item rows as a table.
pub fn items_frame(run: &str, rows: &[ItemRow]) -> Result<DataFrame> {
    let n = rows.len();
    let mut cols = vec![s("run", vec![run.to_string(); n])];
    cols.extend(arm_columns(
        &rows.iter().map(|r| &r.arm).collect::<Vec<_>>(),
    ));
    cols.extend([
        Column::new(
            "item_index".into(),
            rows.iter().map(|r| r.item_index).collect::<Vec<_>>(),
        ),
        s("item_id", rows.iter().map(|r| r.item_id.clone()).collect()),
        Column::new(
            "prompt_tokens".into(),
            rows.iter().map(|r| r.prompt_tokens).collect::<Vec<_>>(),
        ),
        Column::new(
            "fact_tokens".into(),
            rows.iter().map(|r| r.fact_tokens).collect::<Vec<_>>(),
        ),
        Column::new(
            "n_sites".into(),
            rows.iter().map(|r| r.n_sites).collect::<Vec<_>>(),
        ),
        s(
            "continuation",
            rows.iter().map(|r| r.continuation.clone()).collect(),
        ),
        s(
            "continuation_ids",
            rows.iter().map(|r| r.continuation_ids.clone()).collect(),
        ),
        Column::new(
            "correct".into(),
            rows.iter().map(|r| r.correct).collect::<Vec<_>>(),
        ),
        Column::new(
            "span_copy".into(),
            rows.iter().map(|r| r.span_copy).collect::<Vec<_>>(),
        ),
        Column::new(
            "native_correct".into(),
            rows.iter().map(|r| r.native_correct).collect::<Vec<_>>(),
        ),
        Column::new(
            "fidelity_cosine".into(),
            rows.iter().map(|r| r.fidelity_cosine).collect::<Vec<_>>(),
        ),
        Column::new(
            "achieved_cosine".into(),
            rows.iter().map(|r| r.achieved_cosine).collect::<Vec<_>>(),
        ),
        Column::new(
            "bit_exact".into(),
            rows.iter().map(|r| r.bit_exact).collect::<Vec<_>>(),
        ),
        Column::new(
            "seconds".into(),
            rows.iter().map(|r| r.seconds).collect::<Vec<_>>(),
        ),
    ]);
    Ok(DataFrame::new(n, cols)?)
}

/// Writes a table as zstd Parquet atomically: a temporary file in the same
/// folder, then a rename, so a reader never sees a partial file.
pub fn write_parquet_atomic(df: &mut DataFrame, path: &Path) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("out");
    let tmp = dir.join(format!(".{name}.tmp"));
    {
        let f = std::fs::File::create(&tmp).map_err(io(format!("creating {}", tmp.display())))?;
        ParquetWriter::new(f)
            .with_compression(ParquetCompression::Zstd(None))
            .finish(df)?;
    }
    std::fs::rename(&tmp, path).map_err(io(format!(
        "renaming {} to {}",
        tmp.display(),
        path.display()
    )))?;
    Ok(())
}

/// Reads one Parquet file.
pub fn read_parquet(path: &Path) -> Result<DataFrame> {
    let f = std::fs::File::open(path).map_err(io(format!("opening {}", path.display())))?;
    Ok(ParquetReader::new(f).finish()?)
}

/// The finished cell files of a run folder, sorted.
pub fn cell_files(run_dir: &Path) -> Result<Vec<PathBuf>> {
    let dir = run_dir.join("items");
    if !dir.exists() {
        return Ok(Vec::new());
    }
    let mut out: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(io(format!("listing {}", dir.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension().is_some_and(|e| e == "parquet")
                && p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| !n.starts_with('.'))
        })
        .collect();
    out.sort();
    Ok(out)
}

/// Every item row of a run folder as one table (cells stacked in order).
pub fn read_items(run_dir: &Path) -> Result<DataFrame> {
    let files = cell_files(run_dir)?;
    let mut it = files.iter();
    let first = it.next().ok_or_else(|| {
        DriverError::Records(format!("no item files under {}/items", run_dir.display()))
    })?;
    let mut df = read_parquet(first)?;
    for f in it {
        df.vstack_mut_owned(read_parquet(f)?)?;
    }
    df.rechunk_mut();
    Ok(df)
}

/// Column readers shared by the summary and the report (nulls kept).
pub(crate) fn opt_strs(df: &DataFrame, name: &str) -> Result<Vec<Option<String>>> {
    Ok(df
        .column(name)?
        .str()?
        .iter()
        .map(|v| v.map(String::from))
        .collect())
}
pub(crate) fn opt_bools(df: &DataFrame, name: &str) -> Result<Vec<Option<bool>>> {
    Ok(df.column(name)?.bool()?.iter().collect())
}
pub(crate) fn opt_f64s(df: &DataFrame, name: &str) -> Result<Vec<Option<f64>>> {
    Ok(df.column(name)?.f64()?.iter().collect())
}
pub(crate) fn opt_i64s(df: &DataFrame, name: &str) -> Result<Vec<Option<i64>>> {
    Ok(df.column(name)?.i64()?.iter().collect())
}
fn strs(df: &DataFrame, name: &str) -> Result<Vec<String>> {
    Ok(opt_strs(df, name)?
        .into_iter()
        .map(Option::unwrap_or_default)
        .collect())
}
fn bools(df: &DataFrame, name: &str) -> Result<Vec<bool>> {
    Ok(opt_bools(df, name)?
        .into_iter()
        .map(|v| v.unwrap_or(false))
        .collect())
}

/// One summary row: an arm's accuracy with its error, interval,
/// conditional accuracy, span-copy rate, fidelity and lift over controls.
#[derive(Debug, Clone, PartialEq)]
pub struct SummaryRow {
    /// The arm.
    pub arm: ArmColumns,
    /// Items.
    pub n: i64,
    /// Correct items.
    pub correct: i64,
    /// Accuracy.
    pub accuracy: f64,
    /// Binomial SE.
    pub se: f64,
    /// 95% normal interval.
    pub ci: (f64, f64),
    /// 95% Wilson interval.
    pub wilson: (f64, f64),
    /// Items where the native reference is correct.
    pub cond_n: i64,
    /// Accuracy on those.
    pub cond_accuracy: Option<f64>,
    /// Span-copied items / n.
    pub span_copy_rate: f64,
    /// Span-copied among correct items.
    pub span_copy_rate_correct: Option<f64>,
    /// Mean fidelity cosine.
    pub fidelity_cosine: Option<f64>,
    /// Mean achieved cosine.
    pub achieved_cosine: Option<f64>,
    /// Items passing the bit-exact gate, where the arm has one.
    pub bit_exact_items: Option<i64>,
    /// The named controls.
    pub controls: String,
    /// The strongest control.
    pub strongest_control: Option<String>,
    /// Accuracy minus the strongest control, with its interval and z.
    pub lift: Option<(f64, f64, f64, f64)>,
    /// Floor accuracy of the run.
    pub floor_accuracy: f64,
    /// Native reference accuracy of the run.
    pub native_accuracy: f64,
    /// Mean seconds per item.
    pub seconds_per_item: f64,
}

/// Summarises the item table of a run per arm, in config order.
pub fn summarize(cfg: &SweepConfig, items: &DataFrame) -> Result<Vec<SummaryRow>> {
    let arm = strs(items, "arm")?;
    let correct = bools(items, "correct")?;
    let native = bools(items, "native_correct")?;
    let copy = bools(items, "span_copy")?;
    let fid = opt_f64s(items, "fidelity_cosine")?;
    let ach = opt_f64s(items, "achieved_cosine")?;
    let exact = opt_bools(items, "bit_exact")?;
    let secs = opt_f64s(items, "seconds")?;
    let rows_of =
        |name: &str| -> Vec<usize> { (0..arm.len()).filter(|&i| arm[i] == name).collect() };
    let prop = |rows: &[usize]| -> Result<Proportion> {
        Ok(Proportion::new(
            rows.iter().filter(|&&i| correct[i]).count(),
            rows.len(),
        )?)
    };
    let mean = |rows: &[usize], v: &[Option<f64>]| -> Option<f64> {
        let xs: Vec<f64> = rows.iter().filter_map(|&i| v[i]).collect();
        (!xs.is_empty()).then(|| xs.iter().sum::<f64>() / xs.len() as f64)
    };
    let floor_rows = rows_of(&cfg.arms[cfg.anchor(crate::arm::Base::Masked)].arm.name);
    let native_rows = rows_of(&cfg.arms[cfg.anchor(crate::arm::Base::Full)].arm.name);
    let floor_acc = prop(&floor_rows)?.p();
    let native_acc = prop(&native_rows)?.p();
    let mut out = Vec::new();
    for pa in &cfg.arms {
        let rows = rows_of(&pa.arm.name);
        if rows.is_empty() {
            return Err(DriverError::Records(format!(
                "no item rows for arm `{}`",
                pa.arm.name
            )));
        }
        let p = prop(&rows)?;
        let ci = p.normal_ci95();
        let w = p.wilson_ci95();
        let cond: Vec<usize> = rows.iter().copied().filter(|&i| native[i]).collect();
        let n_correct = rows.iter().filter(|&&i| correct[i]).count();
        let copies_correct = rows.iter().filter(|&&i| correct[i] && copy[i]).count();
        let controls = cfg.controls_of(pa)?;
        let mut ctrl_props = Vec::new();
        for &c in &controls {
            ctrl_props.push((
                cfg.arms[c].arm.name.clone(),
                prop(&rows_of(&cfg.arms[c].arm.name))?,
            ));
        }
        let lifted = if ctrl_props.is_empty() {
            None
        } else {
            let refs: Vec<(&str, Proportion)> =
                ctrl_props.iter().map(|(n, p)| (n.as_str(), *p)).collect();
            Some(lift(p, &refs)?)
        };
        out.push(SummaryRow {
            arm: ArmColumns::of(pa),
            n: p.n as i64,
            correct: p.successes as i64,
            accuracy: p.p(),
            se: p.se(),
            ci: (ci.lo, ci.hi),
            wilson: (w.lo, w.hi),
            cond_n: cond.len() as i64,
            cond_accuracy: (!cond.is_empty())
                .then(|| cond.iter().filter(|&&i| correct[i]).count() as f64 / cond.len() as f64),
            span_copy_rate: rows.iter().filter(|&&i| copy[i]).count() as f64 / rows.len() as f64,
            span_copy_rate_correct: (n_correct > 0)
                .then(|| copies_correct as f64 / n_correct as f64),
            fidelity_cosine: mean(&rows, &fid),
            achieved_cosine: mean(&rows, &ach),
            bit_exact_items: pa
                .arm
                .expect
                .map(|_| rows.iter().filter(|&&i| exact[i] == Some(true)).count() as i64),
            controls: controls
                .iter()
                .map(|&c| cfg.arms[c].arm.name.clone())
                .collect::<Vec<_>>()
                .join(","),
            strongest_control: lifted.as_ref().map(|l| l.control.clone()),
            lift: lifted.map(|l| {
                (
                    l.difference.diff,
                    l.difference.ci95.lo,
                    l.difference.ci95.hi,
                    l.difference.z,
                )
            }),
            floor_accuracy: floor_acc,
            native_accuracy: native_acc,
            seconds_per_item: mean(&rows, &secs).unwrap_or(0.0),
        });
    }
    Ok(out)
}

/// The summary rows as a table.
pub fn summary_frame(run: &str, rows: &[SummaryRow]) -> Result<DataFrame> {
    let n = rows.len();
    let mut cols = vec![s("run", vec![run.to_string(); n])];
    cols.extend(arm_columns(
        &rows.iter().map(|r| &r.arm).collect::<Vec<_>>(),
    ));
    let f = |name: &str, v: Vec<f64>| Column::new(name.into(), v);
    let of = |name: &str, v: Vec<Option<f64>>| Column::new(name.into(), v);
    cols.extend([
        Column::new("n".into(), rows.iter().map(|r| r.n).collect::<Vec<_>>()),
        Column::new(
            "correct".into(),
            rows.iter().map(|r| r.correct).collect::<Vec<_>>(),
        ),
        f("accuracy", rows.iter().map(|r| r.accuracy).collect()),
        f("se", rows.iter().map(|r| r.se).collect()),
        f("ci_lo", rows.iter().map(|r| r.ci.0).collect()),
        f("ci_hi", rows.iter().map(|r| r.ci.1).collect()),
        f("wilson_lo", rows.iter().map(|r| r.wilson.0).collect()),
        f("wilson_hi", rows.iter().map(|r| r.wilson.1).collect()),
        Column::new(
            "cond_n".into(),
            rows.iter().map(|r| r.cond_n).collect::<Vec<_>>(),
        ),
        of(
            "cond_accuracy",
            rows.iter().map(|r| r.cond_accuracy).collect(),
        ),
        f(
            "span_copy_rate",
            rows.iter().map(|r| r.span_copy_rate).collect(),
        ),
        of(
            "span_copy_rate_correct",
            rows.iter().map(|r| r.span_copy_rate_correct).collect(),
        ),
        of(
            "fidelity_cosine",
            rows.iter().map(|r| r.fidelity_cosine).collect(),
        ),
        of(
            "achieved_cosine",
            rows.iter().map(|r| r.achieved_cosine).collect(),
        ),
        Column::new(
            "bit_exact_items".into(),
            rows.iter().map(|r| r.bit_exact_items).collect::<Vec<_>>(),
        ),
        s(
            "controls",
            rows.iter().map(|r| r.controls.clone()).collect(),
        ),
        os(
            "strongest_control",
            rows.iter().map(|r| r.strongest_control.clone()).collect(),
        ),
        of("lift", rows.iter().map(|r| r.lift.map(|l| l.0)).collect()),
        of(
            "lift_lo",
            rows.iter().map(|r| r.lift.map(|l| l.1)).collect(),
        ),
        of(
            "lift_hi",
            rows.iter().map(|r| r.lift.map(|l| l.2)).collect(),
        ),
        of("lift_z", rows.iter().map(|r| r.lift.map(|l| l.3)).collect()),
        f(
            "floor_accuracy",
            rows.iter().map(|r| r.floor_accuracy).collect(),
        ),
        f(
            "native_accuracy",
            rows.iter().map(|r| r.native_accuracy).collect(),
        ),
        f(
            "seconds_per_item",
            rows.iter().map(|r| r.seconds_per_item).collect(),
        ),
    ]);
    Ok(DataFrame::new(n, cols)?)
}
