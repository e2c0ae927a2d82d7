//! Paired comparisons of two arm families point by point, or of two named
//! arms (`pairs.parquet`).
//! The summary pairs each arm only with its strongest declared control; a
//! researcher often wants one family against another at the same grid
//! point as well (the single holder against the distractors-only pool at
//! each layer and scale). Each row is one arm of the first family against
//! the arm of the second family whose grid point agrees with its own, over
//! the items both scored, with the statistics of the summary's lift
//! (`tolerable-stats`: the difference of two proportions with its 95%
//! interval, and the paired outcomes with the exact McNemar p), and the
//! items on which both decoded the same continuation. Two families whose
//! grid axes differ on both sides (one quantity under two names,
//! `blend.target_cosine` against `perturb.target_cosine`) are refused
//! rather than crossed on them.
//!
//! A side of a pair may also name one arm with its grid point (the arm's
//! name, `bridged@bridge.resource=lora_kv`): two points of one family
//! (a ladder's rungs, a bridge against its answer-disjoint twin) are then
//! compared directly, their points unmatched. An arm's grid value may
//! hold a colon (`h_suffix@layers=suffix:4`): the pair's text is split at
//! the one colon that leaves a known arm or family on both sides.

use super::ItemRow;
use crate::error::{DriverError, Result};
use crate::record;
use std::collections::{BTreeMap, HashMap};
use tolerable_stats::{difference, paired, Proportion};

/// Arms to compare, as the researcher names them: two arm families
/// compared point by point (each arm of `family` against the arms of
/// `against` at an agreeing grid point), or either side one arm named with
/// its grid point; two named arms are compared whatever their points.
/// Two pairs are the same when they read the same (`a:b`): a pair typed
/// with a colon inside a grid value is parsed at its first colon and
/// resolved against the run's names later, so its split may differ.
#[derive(Debug, Clone)]
pub struct ArmPair {
    /// The compared family (an arm's name before grid expansion), or one
    /// arm named with its grid point.
    pub family: String,
    /// The family (or arm) it is compared against.
    pub against: String,
}

impl std::str::FromStr for ArmPair {
    type Err = DriverError;

    /// `family:against`, e.g. `holder_add:pool_distractors`; either side
    /// may be one arm with its grid point. Split at the first colon; where
    /// a side's name holds a colon too, [`pair_rows`] moves the split to
    /// the one that names the run's arms or families.
    fn from_str(s: &str) -> Result<Self> {
        match s.split_once(':') {
            Some((a, b)) if !a.trim().is_empty() && !b.trim().is_empty() => {
                Ok(Self {
                    family: a.trim().to_string(),
                    against: b.trim().to_string(),
                })
            }
            _ => Err(DriverError::Records(format!(
                "`{s}` is not a pair of arms: write `family:against` (two arm families of the run, e.g. `holder_add:pool_distractors`, or arms with their grid points, `holder@layers=8:holder@layers=4`)"
            ))),
        }
    }
}

impl std::fmt::Display for ArmPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.family, self.against)
    }
}

impl PartialEq for ArmPair {
    fn eq(&self, other: &Self) -> bool {
        self.to_string() == other.to_string()
    }
}

impl Eq for ArmPair {}

record! {
    /// One arm against an arm of another family at an agreeing grid point
    /// (or against the arm the pair named), over the items both scored.
    #[derive(Debug, Clone, PartialEq, serde::Serialize)]
    pub struct PairRow {
        /// Run name.
        pub run: String,
        /// The compared family (an arm's name before grid expansion), or the arm as the pair named it.
        pub family: String,
        /// The family (or arm) it is compared against, as the pair named it.
        pub against_family: String,
        /// The compared arm, with its grid point.
        pub arm: String,
        /// The arm it is compared against, with its grid point (its point agrees with the compared arm's on every axis both have, unless the pair named both arms).
        pub against: String,
        /// The compared arm's grid point as JSON with typed values.
        pub point: String,
        /// Items both arms scored.
        pub n_items: i64,
        /// Accuracy of the compared arm over those items.
        pub accuracy: f64,
        /// Accuracy of the arm it is compared against over those items.
        pub against_accuracy: f64,
        /// accuracy − against_accuracy.
        pub diff: f64,
        /// Lower end of the difference's 95% interval, with the SE of two independent proportions (as the summary's lift).
        pub diff_lo: f64,
        /// Upper end of the difference's 95% interval.
        pub diff_hi: f64,
        /// Items the compared arm gets right and the other wrong.
        pub gained: i64,
        /// Items the compared arm gets wrong and the other right.
        pub lost: i64,
        /// The difference's paired standard error (as the summary's `lift_paired_se`).
        pub paired_se: f64,
        /// Exact two-sided McNemar p-value of gained against lost.
        pub mcnemar_p: f64,
        /// Items on which both arms decoded the same continuation text (null in a pairs file written before this column, 2026-12-07).
        pub same_continuation: Option<i64>,
    }
}

/// An arm's grid point, axis by axis, with typed values.
type Point = BTreeMap<String, serde_json::Value>;

/// Whether two grid points agree on every axis both have.
fn agree(a: &Point, b: &Point) -> bool {
    a.iter().all(|(k, v)| b.get(k).is_none_or(|w| w == v))
}

/// The axes each of two points has and the other lacks, when both have
/// some: matched on their shared axes only, the two families would cross
/// those (each arm meeting every value of the other's), which a pair of
/// differently named axes for one quantity does silently
/// (`blend.target_cosine` against `perturb.target_cosine`). One point
/// having axes the other lacks is a family meeting every point of a
/// coarser one, and no crossing.
fn crossing(a: &Point, b: &Point) -> Option<(Vec<String>, Vec<String>)> {
    let only = |x: &Point, y: &Point| {
        x.keys()
            .filter(|k| !y.contains_key(*k))
            .cloned()
            .collect::<Vec<_>>()
    };
    let (oa, ob) = (only(a, b), only(b, a));
    (!oa.is_empty() && !ob.is_empty()).then_some((oa, ob))
}

/// An arm's outcome on an item: whether it answered, and the continuation
/// it decoded.
type Outcome<'a> = (bool, &'a str);

/// An arm's outcomes by item id.
type ByItem<'a> = HashMap<&'a str, Outcome<'a>>;

/// One run's arms as a side of a pair: in the order its item rows first
/// name them, each with its first row (family), its grid point and its
/// outcome and continuation by item.
struct Arms<'a> {
    order: Vec<&'a str>,
    by_name: HashMap<&'a str, (&'a ItemRow, Point, ByItem<'a>)>,
    families: Vec<&'a str>,
}

impl<'a> Arms<'a> {
    fn new(items: &'a [ItemRow]) -> Self {
        let mut order: Vec<&str> = Vec::new();
        let mut families: Vec<&str> = Vec::new();
        let mut by_name: HashMap<&str, (&ItemRow, Point, ByItem)> = HashMap::new();
        for r in items {
            let e = by_name.entry(r.arm.arm.as_str()).or_insert_with(|| {
                order.push(r.arm.arm.as_str());
                if !families.contains(&r.arm.family.as_str()) {
                    families.push(r.arm.family.as_str());
                }
                let point = serde_json::from_str(&r.arm.point).unwrap_or_default();
                (r, point, HashMap::new())
            });
            e.2.insert(r.item_id.as_str(), (r.correct, r.continuation.as_str()));
        }
        Self {
            order,
            by_name,
            families,
        }
    }

    /// Whether `name` is one of these arms.
    fn names_arm(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// Whether `name` is one of these arms or families.
    fn knows(&self, name: &str) -> bool {
        self.names_arm(name) || self.families.contains(&name)
    }

    /// A side's arms: the arm it names, else its family's.
    fn side(&self, name: &str) -> Vec<&'a str> {
        if let Some((a, _)) = self.by_name.get_key_value(name) {
            return vec![*a];
        }
        self.order
            .iter()
            .copied()
            .filter(|a| self.by_name[a].0.arm.family == name)
            .collect()
    }

    /// The error for a side these arms lack (`who`: "the run", "run a"),
    /// listing the arms of its family where the name is a mistyped point,
    /// else the families.
    fn lacks(&self, pair: &ArmPair, who: &str, name: &str) -> DriverError {
        let family = name.split_once('@').map_or(name, |(f, _)| f);
        let listing = match self.side(family).as_slice() {
            [] => format!("its families: {}", self.families.join(", ")),
            arms => format!("the arms of `{family}`: {}", arms.join(", ")),
        };
        DriverError::Records(format!(
            "pair `{pair}`: {who} has no arm or family `{name}` ({listing})"
        ))
    }
}

/// The rows of `pairs` over a run's item rows: for each pair, each arm of
/// the first family (in the order the rows first name it) against each arm
/// of the second whose grid point agrees with its own (an arm without a
/// grid agrees with every point). A side that names an arm of the run is
/// that arm alone; a pair of two named arms is compared without matching
/// their points. A pair whose text holds more than one colon is split at
/// the colon that leaves an arm or family of the run on both sides. A
/// family or arm the run does not have, a pair with no agreeing points, or
/// two families whose points each have axes the other lacks (they would
/// cross on those), is an error naming it.
pub fn pair_rows(items: &[ItemRow], pairs: &[ArmPair]) -> Result<Vec<PairRow>> {
    let arms = Arms::new(items);
    pair_sides(&arms, &arms, ["the run", "the run"], pairs)
}

/// Arms of two runs paired over the items both scored (the same adapter on
/// two caches, a bridge against another run's): each pair's first side
/// names an arm or family of run `a`'s item rows, its second one of run
/// `b`'s, as in [`pair_rows`] (families meet at agreeing grid points, two
/// named arms directly; an arm may be paired with its namesake in the other
/// run). A row's `arm` and `family` are run `a`'s, its `against` and
/// `against_family` run `b`'s, its `run` run `a`'s name. A side a run lacks
/// is an error naming the run.
pub fn pair_rows_across(a: &[ItemRow], b: &[ItemRow], pairs: &[ArmPair]) -> Result<Vec<PairRow>> {
    pair_sides(&Arms::new(a), &Arms::new(b), ["run a", "run b"], pairs)
}

/// Each pair's first side read in `left`, its second in `right` (the same
/// arms for pairs within one run, where an arm is not paired with itself);
/// `who` names each side's run in errors.
fn pair_sides(
    left: &Arms,
    right: &Arms,
    who: [&str; 2],
    pairs: &[ArmPair],
) -> Result<Vec<PairRow>> {
    let one_run = std::ptr::eq(left, right);
    let mut out = Vec::new();
    for pair in pairs {
        let pair = &resolve(pair, |f| left.knows(f), |f| right.knows(f))?;
        let (mine, theirs) = (left.side(&pair.family), right.side(&pair.against));
        if mine.is_empty() {
            return Err(left.lacks(pair, who[0], &pair.family));
        }
        if theirs.is_empty() {
            return Err(right.lacks(pair, who[1], &pair.against));
        }
        let named = [left.names_arm(&pair.family), right.names_arm(&pair.against)];
        let before = out.len();
        for a in &mine {
            let (ra, pa, by_item_a) = &left.by_name[a];
            for b in &theirs {
                let (_, pb, by_item_b) = &right.by_name[b];
                if (one_run && a == b) || (named != [true, true] && !agree(pb, pa)) {
                    continue;
                }
                // Two families only: a named arm has one point to cross.
                if let Some((oa, ob)) = (named == [false, false])
                    .then(|| crossing(pa, pb))
                    .flatten()
                {
                    return Err(DriverError::Records(format!(
                        "pair `{pair}`: `{a}` has axes `{b}` lacks ({}) and `{b}` axes `{a}` lacks ({}); matched on their shared axes only, each arm would meet every point of the other on these. Name the arms to pair (`{a}:{b}`), or families whose axes match",
                        oa.join(", "),
                        ob.join(", "),
                    )));
                }
                if let Some(row) = compared(pair, (a, ra, by_item_a), (b, by_item_b))? {
                    out.push(row);
                }
            }
        }
        if out.len() == before && named == [true, true] {
            return Err(DriverError::Records(format!(
                "pair `{pair}`: the two arms scored no item in common"
            )));
        }
        if out.len() == before {
            return Err(DriverError::Records(format!(
                "pair `{pair}`: no arm of `{}` shares a grid point and scored items with an arm of `{}`",
                pair.family, pair.against
            )));
        }
    }
    Ok(out)
}

/// Arm `a` (its first row, its outcomes by item) against arm `b` over the
/// items both scored, as `pair` named them: the difference of the two
/// accuracies, the paired outcomes, the same continuations. None when they
/// share no item.
fn compared(
    pair: &ArmPair,
    (a, ra, by_item_a): (&str, &ItemRow, &ByItem),
    (b, by_item_b): (&str, &ByItem),
) -> Result<Option<PairRow>> {
    let both: Vec<(&Outcome, &Outcome)> = by_item_a
        .iter()
        .filter_map(|(id, x)| by_item_b.get(id).map(|y| (x, y)))
        .collect();
    if both.is_empty() {
        return Ok(None);
    }
    let (xa, xb): (Vec<bool>, Vec<bool>) = both.iter().map(|(x, y)| (x.0, y.0)).unzip();
    let same = both.iter().filter(|(x, y)| x.1 == y.1).count();
    let n = both.len();
    let count = |v: &[bool]| v.iter().filter(|&&x| x).count();
    let (p, q) = (
        Proportion::new(count(&xa), n)?,
        Proportion::new(count(&xb), n)?,
    );
    let d = difference(p, q);
    let pd = paired(&xa, &xb)?;
    Ok(Some(PairRow {
        run: ra.arm.run.clone(),
        family: pair.family.clone(),
        against_family: pair.against.clone(),
        arm: a.to_string(),
        against: b.to_string(),
        point: ra.arm.point.clone(),
        n_items: n as i64,
        accuracy: p.p(),
        against_accuracy: q.p(),
        diff: d.diff,
        diff_lo: d.ci95.lo,
        diff_hi: d.ci95.hi,
        gained: pd.gained as i64,
        lost: pd.lost as i64,
        paired_se: pd.se,
        mcnemar_p: pd.mcnemar_p,
        same_continuation: Some(same as i64),
    }))
}

/// `pair` split at the one colon of its text that leaves a name known to
/// the run on both sides (`known_left`, `known_right`). Several such colons
/// are an error; none leaves the pair as parsed, for the caller to name the
/// side it lacks.
fn resolve(
    pair: &ArmPair,
    known_left: impl Fn(&str) -> bool,
    known_right: impl Fn(&str) -> bool,
) -> Result<ArmPair> {
    let text = pair.to_string();
    let splits: Vec<ArmPair> = text
        .match_indices(':')
        .map(|(i, _)| ArmPair {
            family: text[..i].trim().to_string(),
            against: text[i + 1..].trim().to_string(),
        })
        .filter(|p| known_left(&p.family) && known_right(&p.against))
        .collect();
    match splits.as_slice() {
        [] => Ok(pair.clone()),
        [one] => Ok(one.clone()),
        several => Err(DriverError::Records(format!(
            "pair `{text}` can be read {} ways ({}): name a family or arm whose name has no colon",
            several.len(),
            several
                .iter()
                .map(|p| format!("`{}` against `{}`", p.family, p.against))
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// The pairs of arms a pairs file holds, in first-seen order (what a report
/// regenerated without naming pairs compares again).
pub fn pairs_of(rows: &[PairRow]) -> Vec<ArmPair> {
    let mut out: Vec<ArmPair> = Vec::new();
    for r in rows {
        let p = ArmPair {
            family: r.family.clone(),
            against: r.against_family.clone(),
        };
        if !out.contains(&p) {
            out.push(p);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::{columns, ArmColumns};

    fn row(family: &str, point: &str, item: usize, correct: bool) -> ItemRow {
        let pt: BTreeMap<String, serde_json::Value> = serde_json::from_str(point).unwrap();
        let arm = if pt.is_empty() {
            family.to_string()
        } else {
            let axes: Vec<String> = pt.iter().map(|(k, v)| format!("{k}={v}")).collect();
            format!("{family}@{}", axes.join(","))
        };
        ItemRow {
            arm: ArmColumns {
                run: "r".into(),
                arm,
                family: family.into(),
                arm_json: "{}".into(),
                point: point.into(),
                base: "masked".into(),
                n_injections: 0,
                injections: vec![],
                carrier: None,
                layers: None,
                layer: None,
                positions: None,
                source: None,
                mechanism: None,
                alpha: None,
                perturb: None,
                target_cosine: None,
                resources: vec![],
            },
            item_index: item as i64,
            item_id: format!("i{item}"),
            prompt_tokens: 10,
            fact_tokens: 1,
            n_sites: 0,
            // Right items answer alike; wrong ones with the arm's own text.
            continuation: if correct {
                "Denver".into()
            } else {
                family.into()
            },
            continuation_ids: vec![],
            correct,
            span_copy: false,
            native_correct: true,
            fidelity_cosine: None,
            achieved_cosine: None,
            achieved_at: columns::PerSite(vec![]),
            logit_correlation: None,
            bit_exact: None,
            seconds: 0.0,
        }
    }

    /// Ten items; `right` lists the ones the arm gets right.
    fn arm(family: &str, point: &str, right: &[usize]) -> Vec<ItemRow> {
        (0..10)
            .map(|i| row(family, point, i, right.contains(&i)))
            .collect()
    }

    #[test]
    fn families_pair_at_agreeing_points_with_the_summarys_statistics() {
        let mut items = Vec::new();
        items.extend(arm("floor", "{}", &[]));
        for l in [4, 8] {
            for a in [1.0, 2.0] {
                let pt = format!("{{\"alpha\":{a},\"layers\":{l}}}");
                // The holder gets items 0..6 right at layer 4, 0..3 at 8;
                // the pool gets 5..8 right everywhere.
                let right: Vec<usize> = (0..if l == 4 { 6 } else { 3 }).collect();
                items.extend(arm("holder", &pt, &right));
                items.extend(arm("pool", &pt, &[5, 6, 7]));
            }
        }
        let pair: ArmPair = "holder:pool".parse().unwrap();
        let rows = pair_rows(&items, std::slice::from_ref(&pair)).unwrap();
        // One row per holder point, each against the pool at the same point.
        assert_eq!(rows.len(), 4);
        for r in &rows {
            assert_eq!(
                r.arm.split_once('@').unwrap().1,
                r.against.split_once('@').unwrap().1
            );
        }
        let r = &rows[0];
        assert_eq!(r.arm, "holder@alpha=1,layers=4");
        // Holder right on 0..6, pool on 5..8: gained 0..5 (5), lost 6, 7 (2).
        assert_eq!((r.n_items, r.gained, r.lost), (10, 5, 2));
        // Both right on item 5: the same continuation there only.
        assert_eq!(r.same_continuation, Some(1));
        assert!((r.diff - 0.3).abs() < 1e-12);
        assert!((r.accuracy - 0.6).abs() < 1e-12 && (r.against_accuracy - 0.3).abs() < 1e-12);
        let d = difference(
            Proportion::new(6, 10).unwrap(),
            Proportion::new(3, 10).unwrap(),
        );
        assert_eq!((r.diff_lo, r.diff_hi), (d.ci95.lo, d.ci95.hi));
        let pd = paired(
            &(0..10).map(|i| i < 6).collect::<Vec<_>>(),
            &(0..10).map(|i| (5..8).contains(&i)).collect::<Vec<_>>(),
        )
        .unwrap();
        assert_eq!((r.paired_se, r.mcnemar_p), (pd.se, pd.mcnemar_p));
        assert!((r.mcnemar_p - tolerable_stats::mcnemar_exact(5, 2)).abs() < 1e-15);
        // At layer 8 the holder (0..3) and the pool (5..8) share no item.
        assert_eq!((rows[2].gained, rows[2].lost), (3, 3));
        assert_eq!(pairs_of(&rows), vec![pair]);

        // An arm without a grid agrees with every point.
        let rows = pair_rows(&items, &["holder:floor".parse().unwrap()]).unwrap();
        assert_eq!(rows.len(), 4);
        assert!(rows.iter().all(|r| r.against == "floor"));
        assert_eq!((rows[0].gained, rows[0].lost), (6, 0));
        let rows = pair_rows(&items, &["floor:pool".parse().unwrap()]).unwrap();
        assert_eq!(rows.len(), 4);

        // A family the run lacks is named, with the families it has.
        let e = pair_rows(&items, &["holder:pool_distractors".parse().unwrap()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`pool_distractors`") && e.contains("(its families: floor, holder, pool)"),
            "{e}"
        );
        // Points that never agree are an error too.
        let mut other = items.clone();
        other.extend(arm("narrow", "{\"layers\":12}", &[1]));
        let e = pair_rows(&other, &["narrow:holder".parse().unwrap()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("no arm of `narrow` shares a grid point"), "{e}");

        // Families whose axes differ on both sides would cross them (the
        // same quantity under two names): refused, naming the axes.
        let mut crossed = Vec::new();
        for t in [0.9, 0.99] {
            crossed.extend(arm(
                "genuine",
                &format!("{{\"blend.target_cosine\":{t},\"carrier\":\"k\"}}"),
                &[0],
            ));
            crossed.extend(arm(
                "noise",
                &format!("{{\"carrier\":\"k\",\"perturb.target_cosine\":{t}}}"),
                &[1],
            ));
        }
        let e = pair_rows(&crossed, &["genuine:noise".parse().unwrap()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("lacks (blend.target_cosine)")
                && e.contains("lacks (perturb.target_cosine)"),
            "{e}"
        );
        // Named, two such arms pair directly.
        let both = "genuine@blend.target_cosine=0.9,carrier=\"k\":noise@carrier=\"k\",perturb.target_cosine=0.9";
        let rows = pair_rows(&crossed, &[both.parse().unwrap()]).unwrap();
        assert_eq!((rows.len(), rows[0].gained, rows[0].lost), (1, 1, 1));
        // One named arm crosses nothing: it meets each agreeing arm of the family.
        let one = "genuine@blend.target_cosine=0.9,carrier=\"k\":noise";
        let rows = pair_rows(&crossed, &[one.parse().unwrap()]).unwrap();
        assert_eq!(rows.len(), 2);
    }

    #[test]
    fn a_side_may_name_one_arm_and_two_named_arms_pair_across_points() {
        let mut items = Vec::new();
        for l in [4, 8] {
            let pt = format!("{{\"alpha\":1.0,\"layers\":{l}}}");
            let right: Vec<usize> = (0..if l == 4 { 6 } else { 3 }).collect();
            items.extend(arm("holder", &pt, &right));
            items.extend(arm("pool", &pt, &[5, 6, 7]));
        }
        // Two points of one family: compared directly, points unmatched.
        let pair: ArmPair = "holder@alpha=1.0,layers=8:holder@alpha=1.0,layers=4"
            .parse()
            .unwrap();
        let rows = pair_rows(&items, std::slice::from_ref(&pair)).unwrap();
        assert_eq!(rows.len(), 1);
        let r = &rows[0];
        assert_eq!(
            (r.arm.as_str(), r.against.as_str()),
            ("holder@alpha=1.0,layers=8", "holder@alpha=1.0,layers=4")
        );
        // Right on 0..3 against 0..6: nothing gained, items 3, 4, 5 lost.
        assert_eq!((r.n_items, r.gained, r.lost), (10, 0, 3));
        assert!((r.diff + 0.3).abs() < 1e-12);
        assert!((r.mcnemar_p - tolerable_stats::mcnemar_exact(0, 3)).abs() < 1e-15);
        assert_eq!(pairs_of(&rows), vec![pair]);

        // A named arm against a family meets the family's agreeing point.
        let rows = pair_rows(&items, &["holder@alpha=1.0,layers=4:pool".parse().unwrap()]).unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].against, "pool@alpha=1.0,layers=4");

        // An arm the run lacks is named like a missing family.
        let e = pair_rows(
            &items,
            &["holder@alpha=1.0,layers=12:pool".parse().unwrap()],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("no arm or family `holder@alpha=1.0,layers=12`"),
            "{e}"
        );
    }

    #[test]
    fn a_pair_is_the_same_pair_whatever_its_split() {
        // Remembered split where the run's names are; typed, split at the
        // first colon: the same pair, so a report naming it again does not
        // drop it (`report::dropped_pairs` keeps those `named.contains`).
        let remembered = [
            ArmPair {
                family: "budget_noise@layers=prefix:1".into(),
                against: "native".into(),
            },
            "budget_genuine:budget_noise".parse().unwrap(),
        ];
        let typed: ArmPair = "budget_noise@layers=prefix:1:native".parse().unwrap();
        assert_ne!(
            (&typed.family, &typed.against),
            (&remembered[0].family, &remembered[0].against)
        );
        assert_eq!(typed, remembered[0]);
        let named = [typed];
        let dropped: Vec<&ArmPair> = remembered.iter().filter(|p| !named.contains(p)).collect();
        assert_eq!(dropped, vec![&remembered[1]]);
        // Another point is another pair.
        let other: ArmPair = "budget_noise@layers=prefix:2:native".parse().unwrap();
        assert!(!remembered.contains(&other));
    }

    #[test]
    fn a_pair_splits_at_the_colon_that_names_the_runs_arms() {
        let mut items = Vec::new();
        items.extend(arm("h_suffix", "{\"layers\":\"suffix:4\"}", &[0, 1, 2]));
        items.extend(arm("h_suffix", "{\"layers\":\"suffix:8\"}", &[0]));
        items.extend(arm("native", "{}", &[0, 1]));
        let (a4, a8) = (
            "h_suffix@layers=\"suffix:4\"",
            "h_suffix@layers=\"suffix:8\"",
        );
        let pair: ArmPair = format!("{a4}:{a8}").parse().unwrap();
        let rows = pair_rows(&items, std::slice::from_ref(&pair)).unwrap();
        assert_eq!(rows.len(), 1);
        let r = &rows[0];
        assert_eq!((r.family.as_str(), r.against_family.as_str()), (a4, a8));
        assert_eq!((r.arm.as_str(), r.against.as_str()), (a4, a8));
        assert_eq!((r.n_items, r.gained, r.lost), (10, 2, 0));
        // Resolved as written to pairs.parquet, so read back it pairs alike.
        assert_eq!(pair_rows(&items, &pairs_of(&rows)).unwrap(), rows);
        let rows = pair_rows(&items, &[format!("{a8}:native").parse().unwrap()]).unwrap();
        assert_eq!((rows[0].arm.as_str(), rows[0].lost), (a8, 1));

        // A mistyped point names its family's arms.
        let e = pair_rows(&items, &["h_suffix@layers=2:native".parse().unwrap()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("no arm or family `h_suffix@layers=2`"), "{e}");
        assert!(
            e.contains(&format!("the arms of `h_suffix`: {a4}, {a8}")),
            "{e}"
        );

        // Text two splits make sense of is refused, both readings named.
        let mut items = Vec::new();
        for (family, name) in [("p", "p"), ("p", "p:q"), ("q", "q:r"), ("r", "r")] {
            for mut r in arm(family, "{}", &[0]) {
                r.arm.arm = name.into();
                items.push(r);
            }
        }
        let e = pair_rows(&items, &["p:q:r".parse().unwrap()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("can be read 2 ways"), "{e}");
        assert!(e.contains("`p` against `q:r`, `p:q` against `r`"), "{e}");
    }

    #[test]
    fn two_named_arms_without_common_items_are_named_as_such() {
        let mut items = arm("holder", "{\"layers\":4}", &[0]);
        items.extend(
            arm("holder", "{\"layers\":8}", &[0])
                .into_iter()
                .map(|mut r| {
                    r.item_id = format!("other-{}", r.item_id);
                    r
                }),
        );
        let e = pair_rows(
            &items,
            &["holder@layers=8:holder@layers=4".parse().unwrap()],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("the two arms scored no item in common"), "{e}");
    }

    #[test]
    fn arms_of_two_runs_pair_over_the_items_both_scored() {
        // Run a: an adapter on the native cache at two points; run b: the
        // same adapters on the augmented cache, and an arm run a lacks.
        let mut a = arm(
            "native_bridged",
            "{\"bridge.resource\":\"q\"}",
            &[0, 1, 2, 3],
        );
        a.extend(arm("native_bridged", "{\"bridge.resource\":\"kv\"}", &[0]));
        let mut b = arm("bridged", "{\"bridge.resource\":\"q\"}", &[0, 1, 5]);
        b.extend(arm("bridged", "{\"bridge.resource\":\"kv\"}", &[0, 1]));
        b.extend(arm("native_bridged", "{\"bridge.resource\":\"q\"}", &[]));
        // Families meet at agreeing points, across the runs.
        let rows = pair_rows_across(&a, &b, &["native_bridged:bridged".parse().unwrap()]).unwrap();
        assert_eq!(rows.len(), 2);
        let q = &rows[0];
        assert_eq!(
            (
                q.arm.as_str(),
                q.against.as_str(),
                q.against_family.as_str()
            ),
            (
                "native_bridged@bridge.resource=\"q\"",
                "bridged@bridge.resource=\"q\"",
                "bridged"
            )
        );
        // Right on 0..4 against 0, 1, 5: gained 2, 3; lost 5.
        assert_eq!((q.n_items, q.gained, q.lost), (10, 2, 1));
        assert!((q.mcnemar_p - tolerable_stats::mcnemar_exact(2, 1)).abs() < 1e-15);
        assert_eq!((rows[1].gained, rows[1].lost), (0, 1));
        // Only the items both scored count: run b's arm on items 0..6 only.
        let short: Vec<ItemRow> = arm("bridged", "{\"bridge.resource\":\"q\"}", &[0, 1, 5])
            .into_iter()
            .take(6)
            .collect();
        let rows =
            pair_rows_across(&a, &short, &["native_bridged:bridged".parse().unwrap()]).unwrap();
        // Both right on 0, 1 (the same text); both wrong on 4, each with its own.
        assert_eq!(
            (rows.len(), rows[0].n_items, rows[0].gained, rows[0].lost),
            (1, 6, 2, 1)
        );
        assert_eq!(rows[0].same_continuation, Some(2));
        // A name both runs have is run a's on the left, run b's on the right.
        let rows = pair_rows_across(
            &a,
            &b,
            &["native_bridged@bridge.resource=\"q\":native_bridged@bridge.resource=\"q\""]
                .map(|p| p.parse().unwrap()),
        )
        .unwrap();
        assert_eq!((rows[0].gained, rows[0].lost), (4, 0));
        // A side a run lacks names that run.
        let e = pair_rows_across(&a, &b, &["bridged:native_bridged".parse().unwrap()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("run a has no arm or family `bridged` (its families: native_bridged)"),
            "{e}"
        );
    }

    #[test]
    fn a_pair_is_written_family_colon_family() {
        let p: ArmPair = " a : b ".parse().unwrap();
        assert_eq!((p.family.as_str(), p.against.as_str()), ("a", "b"));
        assert_eq!(p.to_string(), "a:b");
        for bad in ["ab", ":b", "a:"] {
            let e = bad.parse::<ArmPair>().unwrap_err().to_string();
            assert!(e.contains("family:against"), "{bad}: {e}");
        }
    }
}
