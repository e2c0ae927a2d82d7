//! A trained arm across training seeds (`seeds.parquet`). A bridge trained
//! from another seed is another resource (`lora_q@seed=1`, from a resource
//! grid over `seed`), usually in another run over the same items; each row
//! here is one arm family at one grid point with one bridge family, over
//! every seed of the runs combined: each seed's accuracy, their mean and
//! sample standard deviation (`tolerable-stats`' spread of replicates), and
//! the zero-init gate's bit-exact count summed over seeds. Runs combine only
//! when they share the model (its sha256), the evaluation items and the
//! run settings that shape an answer (template, tokens, precision, seed),
//! and a bridge's seeds only when its spec is otherwise the same; how each
//! run batched its arms (which changes float rounding only) is recorded.

use super::SummaryRow;
use crate::error::{DriverError, Result};
use crate::record;
use std::collections::BTreeMap;
use tolerable_stats::spread;

record! {
    /// One arm family at one grid point with one bridge family, across the
    /// seeds its bridges were trained from.
    #[derive(Debug, Clone, PartialEq)]
    pub struct SeedRow {
        /// The arm's name before grid expansion (`bridged`).
        pub family: String,
        /// The bridge family: the resource the arm reads, without its `seed` grid axis (`lora_q`).
        pub bridge: String,
        /// The arm's grid point as JSON with typed values, the bridge resource left out.
        pub point: String,
        /// Number of seeds combined.
        pub n_seeds: i64,
        /// Each bridge's training seed (from its spec in run.json), ascending.
        pub seeds: Vec<i64>,
        /// The run each seed's figure comes from.
        pub runs: Vec<String>,
        /// The folder of that run, as given to the report.
        pub run_dirs: Vec<String>,
        /// The arm at each seed, with its grid point.
        pub arms: Vec<String>,
        /// How that run batched its arms (run.json's `batching`; float rounding differs between ways).
        pub batching: Vec<String>,
        /// Items scored at each seed.
        pub n_items: Vec<i64>,
        /// Accuracy at each seed.
        pub accuracy: Vec<f64>,
        /// Mean of the seeds' accuracies.
        pub accuracy_mean: f64,
        /// Their sample standard deviation (divisor seeds − 1); null for one seed.
        pub accuracy_sd: Option<f64>,
        /// Mean of the seeds' conditional accuracies, where every seed has one.
        pub cond_accuracy_mean: Option<f64>,
        /// Conditional accuracy (on the items the native reference answers) at each seed; empty unless every seed has one.
        pub cond_accuracy: Vec<f64>,
        /// Their sample standard deviation (divisor seeds − 1), where every seed has one; null for one seed.
        pub cond_accuracy_sd: Option<f64>,
        /// Items passing the arm's bit-exact gate, summed over seeds, where every seed has the gate.
        pub bit_exact_items: Option<i64>,
        /// Items scored, summed over seeds.
        pub n_items_total: i64,
    }
}

/// One run combined across seeds: its folder as given, its run.json and its
/// summary rows (final or interim).
#[derive(Debug, Clone, Copy)]
pub struct SeedRun<'a> {
    /// The run folder, as given.
    pub dir: &'a str,
    /// Its run.json.
    pub meta: &'a serde_json::Value,
    /// Its summary rows.
    pub rows: &'a [SummaryRow],
}

/// The bridge family of a resource name, its `seed` grid axis dropped:
/// `lora_q@seed=1` → `lora_q`, `lora@seed=1,targets=q` → `lora@targets=q`.
pub fn bridge_family(resource: &str) -> String {
    let Some((base, axes)) = resource.split_once('@') else {
        return resource.to_string();
    };
    let rest: Vec<&str> = axes
        .split(',')
        .filter(|a| !a.starts_with("seed="))
        .collect();
    if rest.is_empty() {
        base.to_string()
    } else {
        format!("{base}@{}", rest.join(","))
    }
}

/// Run settings that do not shape an answer: the name, the cell size, and
/// the ways of batching (float rounding only; recorded per seed instead).
const NOT_COMPARED: [&str; 6] = [
    "name",
    "cell_items",
    "batch_bridges",
    "item_batch",
    "one_at_a_time",
    "row_kernel",
];

/// A run's settings that must agree across the runs combined.
fn compared_settings(meta: &serde_json::Value) -> serde_json::Value {
    let mut run = meta["config"]["run"].clone();
    if let Some(m) = run.as_object_mut() {
        for k in NOT_COMPARED {
            m.remove(k);
        }
    }
    run
}

/// How a run batched its arms, over its invocations.
fn batching_of(meta: &serde_json::Value) -> String {
    let mut ways: Vec<String> = Vec::new();
    for i in meta["invocations"].as_array().into_iter().flatten() {
        if let Some(b) = i["batching"].as_str() {
            if !ways.iter().any(|w| w == b) {
                ways.push(b.to_string());
            }
        }
    }
    ways.join(" | ")
}

/// A bridge's spec without its seed.
fn spec_but_seed(spec: &serde_json::Value) -> serde_json::Value {
    let mut s = spec.clone();
    if let Some(m) = s.as_object_mut() {
        m.remove("seed");
    }
    s
}

/// One seed's figures of one arm.
struct Seeded<'a> {
    seed: i64,
    spec: serde_json::Value,
    run: &'a SeedRun<'a>,
    row: &'a SummaryRow,
}

/// Each trained arm of `runs` (an arm that reads a bridge resource) across
/// the seeds of its bridge; rows in the order their arms first appear. The
/// runs must share the model and the evaluation items; the same arm family,
/// grid point, bridge family and seed in two runs is an error.
pub fn seed_rows(runs: &[SeedRun]) -> Result<Vec<SeedRow>> {
    let Some(first) = runs.first() else {
        return Err(DriverError::Records(
            "combining seeds needs at least one run".into(),
        ));
    };
    for r in &runs[1..] {
        for (what, a, b) in [
            (
                "model (sha256)",
                &first.meta["model"]["sha256"],
                &r.meta["model"]["sha256"],
            ),
            (
                "evaluation items",
                &first.meta["data"]["item_ids"],
                &r.meta["data"]["item_ids"],
            ),
            (
                "run settings (template, tokens, precision, seed)",
                &compared_settings(first.meta),
                &compared_settings(r.meta),
            ),
        ] {
            if a != b || a.is_null() {
                return Err(DriverError::Records(format!(
                    "{} and {} do not share their {what}: a trained arm's seeds combine only over the same model and items",
                    first.dir, r.dir
                )));
            }
        }
    }
    let mut keys: Vec<(String, String, String)> = Vec::new();
    let mut groups: BTreeMap<(String, String, String), Vec<Seeded>> = BTreeMap::new();
    for run in runs {
        for row in run.rows {
            let arm: serde_json::Value = serde_json::from_str(&row.arm.arm_json).map_err(|e| {
                DriverError::Records(format!(
                    "{}: arm `{}` has unreadable arm_json ({e})",
                    run.dir, row.arm.arm
                ))
            })?;
            let Some(resource) = arm["bridge"]["resource"].as_str() else {
                continue;
            };
            let spec = &run.meta["resources"][resource]["spec"];
            let seed = spec["seed"].as_i64().ok_or_else(|| {
                DriverError::Records(format!(
                    "{}: arm `{}` reads bridge `{resource}`, whose spec in run.json has no seed",
                    run.dir, row.arm.arm
                ))
            })?;
            let mut point: BTreeMap<String, serde_json::Value> =
                serde_json::from_str(&row.arm.point).map_err(|e| {
                    DriverError::Records(format!(
                        "{}: arm `{}` has an unreadable grid point ({e})",
                        run.dir, row.arm.arm
                    ))
                })?;
            point.remove("bridge.resource");
            let key = (
                row.arm.family.clone(),
                bridge_family(resource),
                serde_json::to_string(&point).expect("a JSON map serialises"),
            );
            let group = groups.entry(key.clone()).or_default();
            if let Some(other) = group.iter().find(|s| s.seed == seed) {
                return Err(DriverError::Records(format!(
                    "arm `{}` of {} and arm `{}` of {} are the same trained arm at the same seed ({seed}): combine each seed once",
                    other.row.arm.arm, other.run.dir, row.arm.arm, run.dir
                )));
            }
            if let Some(other) = group.first() {
                if spec_but_seed(&other.spec) != spec_but_seed(spec) {
                    return Err(DriverError::Records(format!(
                        "arm `{}` of {} and arm `{}` of {} read bridges that differ in more than their seed: their specs must agree but for it",
                        other.row.arm.arm, other.run.dir, row.arm.arm, run.dir
                    )));
                }
            }
            if group.is_empty() {
                keys.push(key);
            }
            group.push(Seeded {
                seed,
                spec: spec.clone(),
                run,
                row,
            });
        }
    }
    let mut out = Vec::with_capacity(keys.len());
    for key in keys {
        let mut g = groups.remove(&key).expect("every key has its group");
        g.sort_by_key(|s| s.seed);
        let acc: Vec<f64> = g.iter().map(|s| s.row.accuracy).collect();
        let s = spread(&acc)?;
        let cond: Option<Vec<f64>> = g.iter().map(|s| s.row.cond_accuracy).collect();
        let cond_spread = cond.as_deref().map(spread).transpose()?;
        let gate: Option<Vec<i64>> = g.iter().map(|s| s.row.bit_exact_items).collect();
        let (family, bridge, point) = key;
        out.push(SeedRow {
            family,
            bridge,
            point,
            n_seeds: g.len() as i64,
            seeds: g.iter().map(|s| s.seed).collect(),
            runs: g.iter().map(|s| s.row.arm.run.clone()).collect(),
            run_dirs: g.iter().map(|s| s.run.dir.to_string()).collect(),
            arms: g.iter().map(|s| s.row.arm.arm.clone()).collect(),
            batching: g.iter().map(|s| batching_of(s.run.meta)).collect(),
            n_items: g.iter().map(|s| s.row.n_items).collect(),
            accuracy: acc,
            accuracy_mean: s.mean,
            accuracy_sd: s.sd,
            cond_accuracy_mean: cond_spread.as_ref().map(|c| c.mean),
            cond_accuracy_sd: cond_spread.and_then(|c| c.sd),
            cond_accuracy: cond.unwrap_or_default(),
            bit_exact_items: gate.map(|v| v.iter().sum()),
            n_items_total: g.iter().map(|s| s.row.n_items).sum(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::bridge_family;

    #[test]
    fn a_bridge_family_drops_the_seed_axis_only() {
        assert_eq!(bridge_family("lora_q"), "lora_q");
        assert_eq!(bridge_family("lora_q@seed=1"), "lora_q");
        assert_eq!(bridge_family("lora@seed=1,targets=q"), "lora@targets=q");
        assert_eq!(bridge_family("lora@alpha=8,seed=2"), "lora@alpha=8");
        assert_eq!(bridge_family("lora@alpha=8"), "lora@alpha=8");
    }
}
