//! Items for a sweep: loading the configured source and choosing mis-source
//! partners (sampling is the probe's `sample::sample`).

use crate::config::{DataSection, DataSource};
use crate::error::{DriverError, Result};
use std::path::Path;
use tolerable_probe::controls::holds_answer;
use tolerable_probe::rng::Rng;
use tolerable_probe::{squad, synthetic, QaItem, SplitItem};

/// Loads the configured items; `path_override` replaces the config's path.
/// Returns the items and a description of where they came from.
pub fn load_items(
    data: &DataSection,
    path_override: Option<&Path>,
    seed: u64,
) -> Result<(Vec<QaItem>, String)> {
    let explicit = path_override.or(data.path.as_deref());
    Ok(match data.source {
        DataSource::Synthetic => (
            synthetic::generate(data.n.max(1) * 2, seed),
            format!("synthetic(seed={seed})"),
        ),
        DataSource::SquadDev | DataSource::SquadTrain => {
            let split = if data.source == DataSource::SquadDev {
                squad::Split::Dev
            } else {
                squad::Split::Train
            };
            let path = squad::resolve_path(explicit, split)?;
            let items = squad::load(&path)?;
            (items, path.display().to_string())
        }
    })
}

/// For each item, a mis-source partner among the others: another article,
/// a passage that does not hold the item's answer, and a context long
/// enough to cover the item's fact region. Seeded.
pub fn partners(items: &[SplitItem], seed: u64) -> Result<Vec<usize>> {
    let mut rng = Rng::new(seed ^ 0x4D15_5011);
    let mut out = Vec::with_capacity(items.len());
    for (i, it) in items.iter().enumerate() {
        let need = it.fact_positions().last().copied().unwrap_or(0) + 1;
        let mut cand: Vec<usize> = (0..items.len()).filter(|&j| j != i).collect();
        rng.shuffle(&mut cand);
        let j = cand
            .into_iter()
            .find(|&j| {
                let o = &items[j];
                o.item.title != it.item.title
                    && o.item.context != it.item.context
                    && !holds_answer(&o.item.context, &it.item.answers)
                    && o.context_len() >= need
            })
            .ok_or_else(|| {
                DriverError::Config(format!(
                    "no mis-source partner for item {} among {} items (other article, answer-free, at least {need} context tokens)",
                    it.item.id,
                    items.len()
                ))
            })?;
        out.push(j);
    }
    Ok(out)
}
