//! Records: one row per (run, arm, item) in per-cell Parquet files under
//! `items/`, one row per (run, arm) in `summary.parquet`, and one row per
//! sampled item in `sample.parquet`; measurement runs ([`crate::measure`])
//! write long-format [`MeasureRow`]s. Each row type is declared once
//! ([`record!`](crate::record)): the declaration writes, reads and
//! documents its columns.
//!
//! Files are zstd Parquet whose embedded Arrow schema uses plain large UTF-8
//! strings and lists (not the string-view types polars writes by default),
//! so pyarrow, pandas and polars all read and filter them.

pub mod columns;
pub mod compare;
pub mod measure;
pub mod pairs;
pub mod resource;
pub mod seeds;
pub mod summary;

use crate::config::PlannedArm;
use crate::error::{io, DriverError, Result};
use crate::record;
use columns::Columns;
use polars::prelude::*;
use std::path::{Path, PathBuf};

pub use measure::MeasureRow;
pub use pairs::{ArmPair, PairRow};
pub use resource::ResourceRow;
pub use seeds::{seed_rows, SeedRow};
pub use summary::{summarize, SummaryRow};

record! {
    /// An arm's fields as record columns, shared by item and summary rows.
    #[derive(Debug, Clone, PartialEq)]
    pub struct ArmColumns {
        /// Run name.
        pub run: String,
        /// Arm name, with its grid point (`act_replace@layers=12`).
        pub arm: String,
        /// The arm's name before grid expansion (`act_replace`).
        pub family: String,
        /// The whole arm (base, every injection, holder, bridge, controls, expect) as JSON.
        pub arm_json: String,
        /// Its grid point as JSON with typed values (`{"layers":12}`).
        pub point: String,
        /// The base pass: `masked` or `full`.
        pub base: String,
        /// Number of injections.
        pub n_injections: i64,
        /// Every injection in one line each: carrier, layers, positions, source, transforms, mechanism.
        pub injections: Vec<String>,
        /// Carrier of the first injection (`k`, `v`, `kv`, `h`), for filtering.
        pub carrier: Option<String>,
        /// Layer set of the first injection.
        pub layers: Option<String>,
        /// Lowest layer of the first injection (for plots against depth).
        pub layer: Option<i64>,
        /// Position set of the first injection.
        pub positions: Option<String>,
        /// Source of the first injection.
        pub source: Option<String>,
        /// Mechanism of the first injection.
        pub mechanism: Option<String>,
        /// Weight of interpolate / add of the first injection.
        pub alpha: Option<f64>,
        /// Perturbation kind of the first injection.
        pub perturb: Option<String>,
        /// Target cosine of the first injection's perturbation.
        pub target_cosine: Option<f64>,
        /// Resources the arm reads, as `name=content-hash`.
        pub resources: Vec<String>,
    }
}

impl ArmColumns {
    /// The columns of a planned arm in run `run`; `resources` maps the
    /// resources it reads to their content hashes.
    pub fn of(run: &str, pa: &PlannedArm, injections: Vec<String>, resources: Vec<String>) -> Self {
        let first = pa.arm.inject.first();
        Self {
            run: run.to_string(),
            arm: pa.arm.name.clone(),
            family: pa.family.clone(),
            arm_json: serde_json::to_string(&pa.arm).unwrap_or_default(),
            point: serde_json::to_string(&pa.point).unwrap_or_default(),
            base: pa.arm.base.name().into(),
            n_injections: pa.arm.inject.len() as i64,
            injections,
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
            resources,
        }
    }
}

record! {
    /// One (arm, item) record.
    #[derive(Debug, Clone, PartialEq)]
    pub struct ItemRow {
        /// The arm.
        pub arm: ArmColumns,
        /// Position of the item in the run's sample (joins `sample.parquet`).
        pub item_index: i64,
        /// The item's id (SQuAD question id, or `syn-<seed>-<k>`).
        pub item_id: String,
        /// Prompt length in tokens (full prompt).
        pub prompt_tokens: i64,
        /// Fact-region size in tokens.
        pub fact_tokens: i64,
        /// Positions injected per layer (the most of any injection).
        pub n_sites: i64,
        /// The greedy continuation.
        pub continuation: String,
        /// Its token ids.
        pub continuation_ids: Vec<u32>,
        /// A gold answer is in the continuation's first line (SQuAD normalisation).
        pub correct: bool,
        /// The continuation copies a span (two words or more) of the holder's passage.
        pub span_copy: bool,
        /// The native reference was correct on this item (for conditional accuracy).
        pub native_correct: bool,
        /// Mean per-vector cosine of the injected slots to the native state (over layers, heads, sites).
        pub fidelity_cosine: Option<f64>,
        /// Mean cosine of the transformed to the untransformed source at the sites (perturbations, bank and codebook substitutes).
        pub achieved_cosine: Option<f64>,
        /// The achieved cosine per injected layer and tensor (keys, values or residual), where a transform measured it.
        pub achieved_at: columns::PerSite,
        /// Mean attention-logit correlation: question queries (read over the native cache) against the injected versus the native keys at the sites.
        pub logit_correlation: Option<f64>,
        /// The arm's bit-exact gate on this item (null without one); a false value stops the sweep before the cell is written.
        pub bit_exact: Option<bool>,
        /// Wall seconds attributed to the arm on the item; the only column that differs between reruns.
        pub seconds: f64,
    }
}

record! {
    /// One sampled item: what the run asked and what counts as an answer.
    #[derive(Debug, Clone, PartialEq)]
    pub struct SampleRow {
        /// Run name.
        pub run: String,
        /// Position in the run's sample.
        pub item_index: i64,
        /// The item's id.
        pub item_id: String,
        /// The passage's article or topic.
        pub title: String,
        /// The question.
        pub question: String,
        /// The gold answers.
        pub answers: Vec<String>,
        /// The passage.
        pub passage: String,
        /// First prompt position of the passage.
        pub passage_start: i64,
        /// The fact region as prompt positions.
        pub fact_positions: Vec<u32>,
        /// Full prompt length in tokens.
        pub prompt_tokens: i64,
        /// Answer occurrences masked in the passage.
        pub answer_spans: i64,
    }
}

/// Writes rows as zstd Parquet atomically: a temporary file in the same
/// folder, then a rename, so a reader never sees a partial file. A failed
/// write (a full disk) names the file and removes the temporary.
pub fn write_rows<T: Columns>(rows: Vec<T>, path: &Path) -> Result<()> {
    let mut df = columns::frame(rows)?;
    write_parquet_atomic(&mut df, path)
}

/// Writes a table as zstd Parquet atomically (see [`write_rows`]).
pub fn write_parquet_atomic(df: &mut DataFrame, path: &Path) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("out");
    // The process id keeps concurrent shards' temporaries apart.
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    // The Arrow schema embedded for other readers: large strings and lists.
    let arrow = df.schema().to_arrow(CompatLevel::oldest());
    let key = polars_parquet::arrow::write::schema_to_metadata_key(&arrow);
    let meta = KeyValueMetadata::from_static(vec![(key.key, key.value.unwrap_or_default())]);
    let written = (|| -> Result<()> {
        let f = std::fs::File::create(&tmp).map_err(io(format!("creating {}", tmp.display())))?;
        ParquetWriter::new(f)
            .with_compression(ParquetCompression::Zstd(None))
            .with_key_value_metadata(Some(meta))
            .finish(df)
            .map_err(|e| DriverError::Records(format!("writing {}: {e}", path.display())))?;
        Ok(())
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io(format!("renaming {} to {}", tmp.display(), path.display()))(e)
    })?;
    Ok(())
}

/// Reads one Parquet file.
pub fn read_parquet(path: &Path) -> Result<DataFrame> {
    let f = std::fs::File::open(path).map_err(io(format!("opening {}", path.display())))?;
    ParquetReader::new(f)
        .finish()
        .map_err(|e| DriverError::Records(format!("reading {}: {e}", path.display())))
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

/// Every item row of a run folder (cells in order).
pub fn read_items(run_dir: &Path) -> Result<Vec<ItemRow>> {
    let files = cell_files(run_dir)?;
    if files.is_empty() {
        return Err(DriverError::Records(format!(
            "no item files under {}/items",
            run_dir.display()
        )));
    }
    let mut out = Vec::new();
    for f in files {
        out.extend(columns::rows::<ItemRow>(&read_parquet(&f)?)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_round_trip_through_parquet() {
        let dir = tempfile::tempdir().unwrap();
        let arm = ArmColumns {
            run: "r".into(),
            arm: "a@layers=4".into(),
            family: "a".into(),
            arm_json: "{}".into(),
            point: "{\"layers\":4}".into(),
            base: "masked".into(),
            n_injections: 1,
            injections: vec!["h".into()],
            carrier: Some("h".into()),
            layers: Some("4".into()),
            layer: Some(4),
            positions: Some("fact_region".into()),
            source: Some("holder".into()),
            mechanism: Some("replace".into()),
            alpha: None,
            perturb: None,
            target_cosine: None,
            resources: vec![],
        };
        let row = ItemRow {
            arm,
            item_index: 3,
            item_id: "x".into(),
            prompt_tokens: 90,
            fact_tokens: 2,
            n_sites: 2,
            continuation: " Denver".into(),
            continuation_ids: vec![4, 5, 151643],
            correct: true,
            span_copy: false,
            native_correct: true,
            fidelity_cosine: Some(0.5),
            achieved_cosine: Some(0.9),
            achieved_at: columns::PerSite(vec![
                ("blocks.4.attn.hook_rot_k".into(), 0.8),
                ("blocks.4.attn.hook_v".into(), 1.0),
            ]),
            logit_correlation: None,
            bit_exact: Some(true),
            seconds: 0.25,
        };
        let p = dir.path().join("x.parquet");
        write_rows(vec![row.clone(), row.clone()], &p).unwrap();
        let back: Vec<ItemRow> = columns::rows(&read_parquet(&p).unwrap()).unwrap();
        assert_eq!(back, vec![row.clone(), row.clone()]);
        // A table from before a nullable column existed reads it as nulls;
        // a missing column that holds no nulls is an error naming it.
        let older = read_parquet(&p)
            .unwrap()
            .drop("fidelity_cosine")
            .unwrap()
            .drop("achieved_at_sites")
            .unwrap()
            .drop("achieved_at_values")
            .unwrap();
        let back: Vec<ItemRow> = columns::rows(&older).unwrap();
        assert!(back.iter().all(|r| r.fidelity_cosine.is_none()));
        assert!(back.iter().all(|r| r.achieved_at.0.is_empty()));
        assert_eq!(back[0].item_id, "x");
        let broken = read_parquet(&p).unwrap().drop("item_id").unwrap();
        let e = columns::rows::<ItemRow>(&broken).unwrap_err().to_string();
        assert!(e.contains("item_id"), "{e}");
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(left, ["x.parquet"]);
        // A write that fails names the file and leaves nothing under its name.
        let tmp = dir
            .path()
            .join(format!(".y.parquet.tmp-{}", std::process::id()));
        std::fs::create_dir(&tmp).unwrap();
        let y = dir.path().join("y.parquet");
        let e = write_rows(vec![row], &y).unwrap_err().to_string();
        assert!(e.contains(".y.parquet.tmp"), "{e}");
        assert!(!y.exists());
    }
}
