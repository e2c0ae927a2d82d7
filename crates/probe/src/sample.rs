//! Seeded sampling of split items: shuffle the items with the seed, build
//! them in that order, keep the first n that survive the filters.

use crate::error::{ProbeError, Result};
use crate::item::QaItem;
use crate::rng::Rng;
use crate::split::{Built, DropReason, SplitItem, SplitOptions};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tolerable_runtime::Tokenizer;

/// A seeded sample of split items and how it was drawn.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Sample {
    /// The kept items, in sampling order.
    pub items: Vec<SplitItem>,
    /// The seed of the shuffle.
    pub seed: u64,
    /// Items considered before n were kept.
    pub considered: usize,
    /// Items dropped, by reason.
    pub dropped: BTreeMap<String, usize>,
}

impl Sample {
    /// The ids of the kept items, in order (to record with results).
    pub fn ids(&self) -> Vec<String> {
        self.items.iter().map(|s| s.item.id.clone()).collect()
    }
}

fn reason_name(r: DropReason) -> String {
    serde_json::to_value(r)
        .ok()
        .and_then(|v| v.as_str().map(String::from))
        .unwrap_or_default()
}

/// Draws `n` split items from `items` with `seed`.
pub fn sample(
    items: &[QaItem],
    tokenizer: &Tokenizer,
    opts: &SplitOptions,
    n: usize,
    seed: u64,
) -> Result<Sample> {
    if items.is_empty() {
        return Err(ProbeError::NotEnoughItems {
            asked: n,
            available: 0,
            why: "the dataset is empty".into(),
        });
    }
    let mut order: Vec<usize> = (0..items.len()).collect();
    Rng::new(seed).shuffle(&mut order);
    let mut kept = Vec::with_capacity(n);
    let mut dropped: BTreeMap<String, usize> = BTreeMap::new();
    let mut considered = 0;
    for &i in &order {
        if kept.len() == n {
            break;
        }
        considered += 1;
        match SplitItem::build(&items[i], tokenizer, opts)? {
            Built::Kept(s) => kept.push(*s),
            Built::Dropped(r) => *dropped.entry(reason_name(r)).or_default() += 1,
        }
    }
    if kept.len() < n {
        return Err(ProbeError::NotEnoughItems {
            asked: n,
            available: kept.len(),
            why: format!("{} items, dropped {:?}", items.len(), dropped),
        });
    }
    Ok(Sample {
        items: kept,
        seed,
        considered,
        dropped,
    })
}
