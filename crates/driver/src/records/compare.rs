//! Comparing the item rows of two runs of the same arms and items (a rerun
//! at a new revision against a committed run, possibly of an older schema),
//! or of a run that repeats part of another (some of its arms and items
//! under another setting): every (arm, item) row is matched and its outcome
//! columns compared value for value. Wall-clock seconds are not compared.

use super::cell_files;
use super::read_parquet;
use crate::error::{DriverError, Result};
use polars::prelude::*;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;

/// Outcome columns compared, as both schemas name them (a column only one
/// run has, such as a measure added later, is skipped).
pub const COMPARED: &[&str] = &[
    "continuation",
    "continuation_ids",
    "correct",
    "span_copy",
    "native_correct",
    "bit_exact",
    "n_sites",
    "prompt_tokens",
    "fact_tokens",
    "fidelity_cosine",
    "achieved_cosine",
    "logit_correlation",
];

/// What a comparison found.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    /// Rows of the first run.
    pub rows_a: usize,
    /// Rows of the second run.
    pub rows_b: usize,
    /// (arm, item) rows found in both.
    pub matched: usize,
    /// Rows of one run without a partner in the other (`only_a + only_b`,
    /// kept for the readers of comparisons written before those two).
    pub unmatched: usize,
    /// Rows of the first run without a partner in the second.
    pub only_a: usize,
    /// Rows of the second run without a partner in the first.
    pub only_b: usize,
    /// Per compared column, the rows whose values differ.
    pub differing: BTreeMap<String, usize>,
    /// Largest absolute difference of each floating column.
    pub max_abs_diff: BTreeMap<String, f64>,
    /// Up to 20 differing rows, described.
    pub examples: Vec<String>,
    /// Whether every row matched with equal values in every compared column.
    pub identical: bool,
}

impl Comparison {
    /// Whether the first run is a part of the second: every row of the
    /// first has its partner, with equal values in every compared column
    /// (a rerun of some arms or items of a larger run).
    pub fn a_within_b(&self) -> bool {
        self.only_a == 0 && self.differing.values().all(|&n| n == 0)
    }
}

/// A column's values as text (lists and numbers in one canonical form), by row.
fn texts(df: &DataFrame, name: &str) -> Result<Vec<Option<String>>> {
    let c = df
        .column(name)
        .map_err(|_| DriverError::Records(format!("no column `{name}`")))?;
    let s = c.as_materialized_series();
    let mut out = Vec::with_capacity(s.len());
    for i in 0..s.len() {
        let v = s.get(i).map_err(|e| DriverError::Records(e.to_string()))?;
        out.push(match v {
            AnyValue::Null => None,
            AnyValue::String(x) => Some(x.to_string()),
            AnyValue::StringOwned(x) => Some(x.to_string()),
            AnyValue::Boolean(b) => Some(b.to_string()),
            AnyValue::Int64(x) => Some(x.to_string()),
            AnyValue::Float64(x) => Some(format!("{:e}", x)),
            AnyValue::List(l) => Some(
                (0..l.len())
                    .map(|j| l.get(j).map(|v| v.to_string()).unwrap_or_default())
                    .collect::<Vec<_>>()
                    .join(" "),
            ),
            other => Some(other.to_string()),
        });
    }
    Ok(out)
}

type Keyed = BTreeMap<(String, String), BTreeMap<String, Option<String>>>;

fn load(dir: &Path) -> Result<(usize, Keyed)> {
    let mut out = Keyed::new();
    let mut n = 0;
    for f in cell_files(dir)? {
        let df = read_parquet(&f)?;
        let arm = texts(&df, "arm")?;
        let item = texts(&df, "item_id")?;
        let cols: Vec<(String, Vec<Option<String>>)> = COMPARED
            .iter()
            .filter(|c| df.column(c).is_ok())
            .map(|c| Ok((c.to_string(), texts(&df, c)?)))
            .collect::<Result<_>>()?;
        for i in 0..df.height() {
            n += 1;
            let key = (
                arm[i].clone().unwrap_or_default(),
                item[i].clone().unwrap_or_default(),
            );
            let values = cols
                .iter()
                .map(|(c, v)| (c.clone(), v[i].clone()))
                .collect();
            if out.insert(key.clone(), values).is_some() {
                return Err(DriverError::Records(format!(
                    "{}: arm `{}` on item `{}` has two rows (a run holds one per arm and item)",
                    f.display(),
                    key.0,
                    key.1
                )));
            }
        }
    }
    if n == 0 {
        return Err(DriverError::Records(format!(
            "no item rows under {}",
            dir.display()
        )));
    }
    Ok((n, out))
}

/// Compares the item rows of the runs in `a` and `b`.
pub fn compare_runs(a: &Path, b: &Path) -> Result<Comparison> {
    let (rows_a, ka) = load(a)?;
    let (rows_b, kb) = load(b)?;
    let mut differing: BTreeMap<String, usize> =
        COMPARED.iter().map(|c| (c.to_string(), 0)).collect();
    let mut max_abs: BTreeMap<String, f64> = BTreeMap::new();
    let mut examples = Vec::new();
    let mut matched = 0;
    for (key, va) in &ka {
        let Some(vb) = kb.get(key) else { continue };
        matched += 1;
        for c in COMPARED {
            let (Some(x), Some(y)) = (va.get(*c), vb.get(*c)) else {
                continue;
            };
            if let (Some(x), Some(y)) = (x, y) {
                if let (Ok(p), Ok(q)) = (x.parse::<f64>(), y.parse::<f64>()) {
                    if p.is_finite() && q.is_finite() && x.contains('e') {
                        let d = (p - q).abs();
                        let m = max_abs.entry(c.to_string()).or_insert(0.0);
                        *m = m.max(d);
                    }
                }
            }
            if x != y {
                *differing.get_mut(*c).unwrap() += 1;
                if examples.len() < 20 {
                    examples.push(format!(
                        "{} on {}: {c} {:?} against {:?}",
                        key.0, key.1, x, y
                    ));
                }
            }
        }
    }
    let (only_a, only_b) = (rows_a - matched, rows_b - matched);
    let unmatched = only_a + only_b;
    let identical = unmatched == 0 && differing.values().all(|&n| n == 0);
    Ok(Comparison {
        rows_a,
        rows_b,
        matched,
        unmatched,
        only_a,
        only_b,
        differing,
        max_abs_diff: max_abs,
        examples,
        identical,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::write_parquet_atomic;

    /// A run folder whose one cell holds these (arm, item, continuation, correct) rows.
    fn run(rows: &[(&str, &str, &str, bool)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let col = |f: fn(&(&str, &str, &str, bool)) -> String| -> Vec<String> {
            rows.iter().map(f).collect()
        };
        let mut df = df!(
            "arm" => col(|r| r.0.to_string()),
            "item_id" => col(|r| r.1.to_string()),
            "continuation" => col(|r| r.2.to_string()),
            "correct" => rows.iter().map(|r| r.3).collect::<Vec<_>>(),
            "seconds" => rows.iter().map(|_| 1.0f64).collect::<Vec<_>>(),
        )
        .unwrap();
        write_parquet_atomic(&mut df, &dir.path().join("items/cell-0000.parquet")).unwrap();
        dir
    }

    #[test]
    fn a_rerun_of_part_of_a_run_is_within_it_and_not_identical_to_it() {
        let whole = run(&[
            ("floor", "q1", "Paris", true),
            ("floor", "q2", "Rome", false),
            ("native", "q1", "Paris", true),
        ]);
        let part = run(&[
            ("floor", "q1", "Paris", true),
            ("native", "q1", "Paris", true),
        ]);
        let c = compare_runs(part.path(), whole.path()).unwrap();
        assert_eq!((c.matched, c.only_a, c.only_b, c.unmatched), (2, 0, 1, 1));
        assert!(c.a_within_b() && !c.identical);
        // The other way round the larger run is not a part of the smaller.
        let c = compare_runs(whole.path(), part.path()).unwrap();
        assert_eq!((c.only_a, c.only_b), (1, 0));
        assert!(!c.a_within_b());
        // A part that decodes another continuation is not within the whole.
        let other = run(&[("floor", "q1", "Lyon", false)]);
        let c = compare_runs(other.path(), whole.path()).unwrap();
        assert_eq!(
            (c.differing["continuation"], c.differing["correct"]),
            (1, 1)
        );
        assert!(!c.a_within_b());
        assert_eq!(c.examples.len(), 2);
        // A run compared with itself is identical (wall-clock seconds aside).
        let c = compare_runs(whole.path(), whole.path()).unwrap();
        assert!(c.identical && c.a_within_b());
        // Two rows of one arm and item are refused, not counted as unmatched.
        let twice = run(&[
            ("floor", "q1", "Paris", true),
            ("floor", "q1", "Paris", true),
        ]);
        let e = compare_runs(twice.path(), whole.path())
            .unwrap_err()
            .to_string();
        assert!(e.contains("arm `floor` on item `q1` has two rows"), "{e}");
    }
}
