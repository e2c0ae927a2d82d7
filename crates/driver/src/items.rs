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
/// partner does not depend on `n`. An item with fewer is an error naming it
/// (see [`with_partners`] for a set that replaces such items).
pub fn partners(items: &[SplitItem], n: usize, seed: u64) -> Result<Vec<Vec<usize>>> {
    let (chosen, short) = choose_partners(items, n, seed);
    if let Some(&i) = short.first() {
        let it = &items[i];
        return Err(DriverError::Config(format!(
            "{} mis-source partner(s) for item {} among {} items, {} wanted (other article, answer-free, at least {} context tokens)",
            chosen[i].len(),
            it.item.id,
            items.len(),
            n,
            cover_of(it)
        )));
    }
    Ok(chosen)
}

/// Context tokens a partner needs to cover `it`'s fact region.
fn cover_of(it: &SplitItem) -> usize {
    it.fact_positions().last().copied().unwrap_or(0) + 1
}

/// The partners [`partners`] chooses, and the items that get fewer than `n`.
fn choose_partners(items: &[SplitItem], n: usize, seed: u64) -> (Vec<Vec<usize>>, Vec<usize>) {
    let mut rng = Rng::new(seed ^ 0x4D15_5011);
    let mut out = Vec::with_capacity(items.len());
    let mut short = Vec::new();
    for (i, it) in items.iter().enumerate() {
        let need = cover_of(it);
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
            short.push(i);
        }
        out.push(chosen);
    }
    (out, short)
}

/// Items that cannot get the partners a plan reads (an item whose fact
/// region ends late has few passages long enough to cover it) are dropped
/// from a run and counted under this reason, never silently.
pub const TOO_FEW_PARTNERS: &str = "too_few_partners";

/// An item set of `n` items, each with `n_partners` mis-source partners.
/// `draw(k)` gives the first `k` items of a seeded sample (a prefix of
/// every longer draw); items that get too few partners are dropped and the
/// next drawn items take their places, until every item has its partners.
/// Returns the set and the ids dropped, in the order they were found.
pub fn with_partners(
    draw: &mut dyn FnMut(usize) -> Result<Vec<SplitItem>>,
    n: usize,
    n_partners: usize,
    seed: u64,
) -> Result<(ItemSet, Vec<String>)> {
    let mut dropped: Vec<String> = Vec::new();
    loop {
        let items: Vec<SplitItem> = draw(n + dropped.len())?
            .into_iter()
            .filter(|it| !dropped.contains(&it.item.id))
            .collect();
        if items.len() < n {
            return Err(DriverError::Config(format!(
                "{} items with {n_partners} mis-source partners each asked, {} drawn after dropping {} with too few",
                n,
                items.len(),
                dropped.len()
            )));
        }
        if n_partners == 0 {
            return Ok((ItemSet::new(items, 0, seed)?, dropped));
        }
        let (partners, short) = choose_partners(&items, n_partners, seed);
        if short.is_empty() {
            let pairs = items.iter().map(SplitItem::pair).collect();
            let set = ItemSet {
                items,
                pairs,
                partners,
            };
            return Ok((set, dropped));
        }
        dropped.extend(short.into_iter().map(|i| items[i].item.id.clone()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tolerable_probe::sample::sample;
    use tolerable_probe::SplitOptions;

    #[test]
    fn items_without_enough_partners_are_replaced_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let ck = crate::test_support::tiny_checkpoint(dir.path());
        let mut raw = tolerable_probe::synthetic::generate(16, 5);
        let split = SplitOptions {
            max_prompt_tokens: 4096,
            ..SplitOptions::default()
        };
        // The first drawn item's fact region is pushed far later than any
        // other passage reaches: no other item covers it.
        let id = sample(&raw, &ck.tokenizer, &split, 1, 1).unwrap().items[0]
            .item
            .id
            .clone();
        let filler = "The committee met again to discuss the budget. ".repeat(12);
        let padded = raw.iter_mut().find(|it| it.id == id).unwrap();
        padded.context = format!("{filler}{}", padded.context);
        let first = sample(&raw, &ck.tokenizer, &split, 6, 1).unwrap();
        let late = first
            .items
            .iter()
            .position(|it| it.item.id == id)
            .expect("the padded item is still drawn first");
        assert!(partners(&first.items, 2, 9).is_err());
        let mut draw = |k: usize| Ok(sample(&raw, &ck.tokenizer, &split, k, 1)?.items);
        let (set, dropped) = with_partners(&mut draw, 6, 2, 9).unwrap();
        assert!(dropped.contains(&first.items[late].item.id));
        assert_eq!(set.items.len(), 6);
        assert!(set.items.iter().all(|it| !dropped.contains(&it.item.id)));
        // The kept items keep their drawn order; every one has its partners,
        // the ones `partners` chooses on the final set.
        let kept: Vec<&str> = first
            .items
            .iter()
            .map(|it| it.item.id.as_str())
            .filter(|id| !dropped.iter().any(|d| d == id))
            .collect();
        let ids: Vec<&str> = set.items.iter().map(|it| it.item.id.as_str()).collect();
        assert_eq!(&ids[..kept.len()], &kept[..]);
        assert_eq!(set.partners, partners(&set.items, 2, 9).unwrap());
        assert!(set.partners.iter().all(|p| p.len() == 2));
        // Without partners nothing is dropped: the plain first draw.
        let (plain, none) = with_partners(&mut draw, 6, 0, 9).unwrap();
        assert!(none.is_empty());
        let plain_ids: Vec<&str> = plain.items.iter().map(|it| it.item.id.as_str()).collect();
        let first_ids: Vec<&str> = first.items.iter().map(|it| it.item.id.as_str()).collect();
        assert_eq!(plain_ids, first_ids);
        // Too few items in the whole source: an error, not a short set.
        let err = with_partners(&mut draw, 16, 2, 9).unwrap_err().to_string();
        assert!(err.contains("items"), "{err}");
    }
}
