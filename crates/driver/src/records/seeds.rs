//! A trained arm across training seeds (`seeds.parquet`). A bridge trained
//! from another seed is another resource (`lora_q@seed=1`, from a resource
//! grid over `seed`), usually in another run over the same items; each row
//! here is one arm family at one grid point with one bridge family, over
//! every seed of the runs combined: each seed's accuracy, their mean and
//! sample standard deviation (`tolerable-stats`' spread of replicates), and
//! the zero-init gate's bit-exact count summed over seeds. Runs combine only
//! when they share the model (its sha256) and the evaluation items.

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
        /// The bridge family: the resource the arm reads, before any `@seed=` suffix (`lora_q`).
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

/// The bridge family of a resource name: `lora_q@seed=1` → `lora_q`.
pub fn bridge_family(resource: &str) -> &str {
    resource.split_once("@seed=").map_or(resource, |(b, _)| b)
}

/// One seed's figures of one arm.
struct Seeded<'a> {
    seed: i64,
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
            let seed = run.meta["resources"][resource]["spec"]["seed"]
                .as_i64()
                .ok_or_else(|| {
                    DriverError::Records(format!(
                        "{}: arm `{}` reads bridge `{resource}`, whose spec in run.json has no seed",
                        run.dir, row.arm.arm
                    ))
                })?;
            let mut point: BTreeMap<String, serde_json::Value> =
                serde_json::from_str(&row.arm.point).unwrap_or_default();
            point.remove("bridge.resource");
            let key = (
                row.arm.family.clone(),
                bridge_family(resource).to_string(),
                serde_json::to_string(&point).expect("a JSON map serialises"),
            );
            let group = groups.entry(key.clone()).or_default();
            if let Some(other) = group.iter().find(|s| s.seed == seed) {
                return Err(DriverError::Records(format!(
                    "arm `{}` of {} and arm `{}` of {} are the same trained arm at the same seed ({seed}): combine each seed once",
                    other.row.arm.arm, other.run.dir, row.arm.arm, run.dir
                )));
            }
            if group.is_empty() {
                keys.push(key);
            }
            group.push(Seeded { seed, run, row });
        }
    }
    let mut out = Vec::with_capacity(keys.len());
    for key in keys {
        let mut g = groups.remove(&key).expect("every key has its group");
        g.sort_by_key(|s| s.seed);
        let acc: Vec<f64> = g.iter().map(|s| s.row.accuracy).collect();
        let s = spread(&acc)?;
        let cond: Option<Vec<f64>> = g.iter().map(|s| s.row.cond_accuracy).collect();
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
            n_items: g.iter().map(|s| s.row.n_items).collect(),
            accuracy: acc,
            accuracy_mean: s.mean,
            accuracy_sd: s.sd,
            cond_accuracy_mean: match cond {
                Some(c) => Some(spread(&c)?.mean),
                None => None,
            },
            bit_exact_items: gate.map(|v| v.iter().sum()),
            n_items_total: g.iter().map(|s| s.row.n_items).sum(),
        });
    }
    Ok(out)
}
