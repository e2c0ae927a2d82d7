//! Controls as item transformations: mis-source pairing, fact-free
//! positions for the position control, answer-disjoint splits, and distractor
//! pools with exactly one answer holder.

use crate::error::{ProbeError, Result};
use crate::item::QaItem;
use crate::rng::Rng;
use crate::score::normalize;
use crate::split::SplitItem;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;

/// Whether `passage` holds any of `answers` (normalised text).
pub fn holds_answer(passage: &str, answers: &[String]) -> bool {
    let p = normalize(passage);
    answers
        .iter()
        .map(|a| normalize(a))
        .any(|a| !a.is_empty() && p.contains(&a))
}

/// For each item, the index of another item whose passage serves as its
/// mis-source holder: from another article, and not holding the item's
/// answer. Seeded.
pub fn mis_source_pairs(items: &[QaItem], seed: u64) -> Result<Vec<usize>> {
    let mut rng = Rng::new(seed);
    let mut out = Vec::with_capacity(items.len());
    for (i, it) in items.iter().enumerate() {
        let mut cand: Vec<usize> = (0..items.len()).filter(|&j| j != i).collect();
        rng.shuffle(&mut cand);
        let j = cand
            .into_iter()
            .find(|&j| items[j].title != it.title && !holds_answer(&items[j].context, &it.answers))
            .ok_or_else(|| ProbeError::NotEnoughItems {
                asked: 1,
                available: 0,
                why: format!("no mis-source holder for item {} (every other item shares its article or answer)", it.id),
            })?;
        out.push(j);
    }
    Ok(out)
}

/// Prompt positions for the position control: as many positions as the
/// fact region has, taken from the fact-free common prefix of the passage
/// (the ones nearest the first fact position), fewer if the prefix is short.
pub fn position_control_sites(item: &SplitItem) -> Vec<usize> {
    let start = item.prefix_ids.len();
    let end = item.common_prefix_len();
    let k = item.fact_region.len().min(end - start);
    (end - k..end).collect()
}

/// The training items that share no normalised answer with the eval items.
pub fn answer_disjoint(train: &[QaItem], eval: &[QaItem]) -> Vec<QaItem> {
    let eval_answers: HashSet<String> = eval
        .iter()
        .flat_map(|e| e.answers.iter().map(|a| normalize(a)))
        .collect();
    train
        .iter()
        .filter(|t| {
            !t.answers
                .iter()
                .any(|a| eval_answers.contains(&normalize(a)))
        })
        .cloned()
        .collect()
}

/// A pool of holders for one item: exactly one read the answer passage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pool {
    /// Item indices of the holders, in pool order.
    pub members: Vec<usize>,
    /// The position in `members` of the answer holder.
    pub answer_holder: usize,
}

/// A pool of `n` holders for item `i`: `i` itself and `n − 1` distractors
/// whose passages hold none of `i`'s answers, in seeded order.
pub fn distractor_pool(items: &[QaItem], i: usize, n: usize, seed: u64) -> Result<Pool> {
    if n == 0 {
        return Err(ProbeError::Config(
            "a pool needs at least one holder".into(),
        ));
    }
    let mut rng = Rng::new(seed ^ (i as u64).wrapping_mul(0x9E37_79B9));
    let mut cand: Vec<usize> = (0..items.len())
        .filter(|&j| {
            j != i
                && items[j].context != items[i].context
                && !holds_answer(&items[j].context, &items[i].answers)
        })
        .collect();
    rng.shuffle(&mut cand);
    // One passage per distractor: skip repeats of a passage.
    let mut seen = HashSet::new();
    let mut members: Vec<usize> = cand
        .into_iter()
        .filter(|&j| seen.insert(items[j].context.clone()))
        .take(n - 1)
        .collect();
    if members.len() < n - 1 {
        return Err(ProbeError::NotEnoughItems {
            asked: n - 1,
            available: members.len(),
            why: format!("distractor passages for item {}", items[i].id),
        });
    }
    let at = rng.below(n);
    members.insert(at, i);
    Ok(Pool {
        members,
        answer_holder: at,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic;

    #[test]
    fn mis_source_never_holds_the_answer() {
        let items = synthetic::generate(40, 1);
        let pairs = mis_source_pairs(&items, 9).unwrap();
        for (i, &j) in pairs.iter().enumerate() {
            assert_ne!(i, j);
            assert!(!holds_answer(&items[j].context, &items[i].answers));
        }
        assert_eq!(pairs, mis_source_pairs(&items, 9).unwrap());
    }

    #[test]
    fn pools_have_one_answer_holder() {
        let items = synthetic::generate(30, 2);
        for n in [1, 2, 4, 8] {
            let p = distractor_pool(&items, 5, n, 1).unwrap();
            assert_eq!(p.members.len(), n);
            assert_eq!(p.members[p.answer_holder], 5);
            let holders = p
                .members
                .iter()
                .filter(|&&j| holds_answer(&items[j].context, &items[5].answers))
                .count();
            assert_eq!(holders, 1);
        }
        assert!(distractor_pool(&items[..3], 0, 8, 1).is_err());
    }

    #[test]
    fn answer_disjoint_split() {
        let eval = synthetic::generate(10, 5);
        let mut train = synthetic::generate(20, 6);
        train.push(QaItem {
            answers: vec![format!("  {}!", eval[0].answers[0].to_uppercase())],
            ..train[0].clone()
        });
        let injected = train.last().unwrap().clone();
        let kept = answer_disjoint(&train, &eval);
        assert!(!kept.contains(&injected));
        assert!(kept.len() >= 15, "{}", kept.len());
        let ev: HashSet<String> = eval
            .iter()
            .flat_map(|e| e.answers.iter().map(|a| normalize(a)))
            .collect();
        assert!(kept
            .iter()
            .all(|k| k.answers.iter().all(|a| !ev.contains(&normalize(a)))));
    }
}
