//! Items for a sweep: loading the configured source, sampling split items
//! (the probe's `sample::sample`), turning them into context pairs, and
//! choosing mis-source partners — an item set the runner and later pools
//! draw on.

use crate::config::{DataSection, DataSource};
use crate::error::{DriverError, Result};
use std::path::Path;
use tolerable_probe::controls::holds_answer;
use tolerable_probe::rng::Rng;
use tolerable_probe::{squad, synthetic, ContextPair, QaItem, SplitItem};

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

/// The items of a run as the runner consumes them: context pairs, each with
/// its mis-source partners (indices into the same set, best first).
#[derive(Debug, Clone)]
pub struct ItemSet {
    /// The sampled split items (answers and passages, for scoring).
    pub items: Vec<SplitItem>,
    /// Their context pairs.
    pub pairs: Vec<ContextPair>,
    /// Per item, its mis-source partners in order (empty when no arm reads one).
    pub partners: Vec<Vec<usize>>,
}

impl ItemSet {
    /// An item set of `items` with `n_partners` mis-source partners each
    /// (seeded; see [`partners`]).
    pub fn new(items: Vec<SplitItem>, n_partners: usize, seed: u64) -> Result<Self> {
        let pairs = items.iter().map(SplitItem::pair).collect();
        let partners = if n_partners > 0 {
            partners(&items, n_partners, seed)?
        } else {
            vec![Vec::new(); items.len()]
        };
        Ok(Self {
            items,
            pairs,
            partners,
        })
    }

    /// The partner pairs of item `i`.
    pub fn partners_of(&self, i: usize) -> Vec<&ContextPair> {
        self.partners[i].iter().map(|&j| &self.pairs[j]).collect()
    }
}

/// For each item, `n` mis-source partners among the others: from another
/// article, with a passage that does not hold the item's answer, and a
/// context long enough to cover the item's fact region. Seeded; the first
/// partner does not depend on `n`.
pub fn partners(items: &[SplitItem], n: usize, seed: u64) -> Result<Vec<Vec<usize>>> {
    let mut rng = Rng::new(seed ^ 0x4D15_5011);
    let mut out = Vec::with_capacity(items.len());
    for (i, it) in items.iter().enumerate() {
        let need = it.fact_positions().last().copied().unwrap_or(0) + 1;
        let mut cand: Vec<usize> = (0..items.len()).filter(|&j| j != i).collect();
        rng.shuffle(&mut cand);
        let chosen: Vec<usize> = cand
            .into_iter()
            .filter(|&j| {
                let o = &items[j];
                o.item.title != it.item.title
                    && o.item.context != it.item.context
                    && !holds_answer(&o.item.context, &it.item.answers)
                    && o.context_len() >= need
            })
            .take(n)
            .collect();
        if chosen.len() < n {
            return Err(DriverError::Config(format!(
                "{} mis-source partner(s) for item {} among {} items, {} wanted (other article, answer-free, at least {need} context tokens)",
                chosen.len(),
                it.item.id,
                items.len(),
                n
            )));
        }
        out.push(chosen);
    }
    Ok(out)
}
