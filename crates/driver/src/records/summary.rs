//! The summary of a run: per arm, accuracy with its binomial error and
//! intervals, conditional accuracy, span-copy rates, mean fidelity measures,
//! the bit-exact gate count, and the lift over the strongest named control.

use super::{ArmColumns, ItemRow};
use crate::config::SweepConfig;
use crate::error::{DriverError, Result};
use crate::record;
use tolerable_stats::{difference, lift, paired, Proportion};

record! {
    /// One (run, arm) summary row. Column names differ from item rows'
    /// where the meaning differs (`n_correct` counts, `mean_*` average).
    #[derive(Debug, Clone, PartialEq)]
    pub struct SummaryRow {
        /// The arm.
        pub arm: ArmColumns,
        /// Items scored.
        pub n_items: i64,
        /// Items answered correctly.
        pub n_correct: i64,
        /// Accuracy (transfer): n_correct / n_items.
        pub accuracy: f64,
        /// Binomial standard error sqrt(p(1-p)/n).
        pub se: f64,
        /// Lower end of the 95% normal interval.
        pub ci_lo: f64,
        /// Upper end of the 95% normal interval.
        pub ci_hi: f64,
        /// Lower end of the 95% Wilson interval.
        pub wilson_lo: f64,
        /// Upper end of the 95% Wilson interval.
        pub wilson_hi: f64,
        /// Items where the native reference is correct.
        pub cond_n: i64,
        /// Accuracy on those items (conditional accuracy).
        pub cond_accuracy: Option<f64>,
        /// Span-copied items / n_items.
        pub span_copy_rate: f64,
        /// Span-copied items among the correct ones.
        pub span_copy_rate_correct: Option<f64>,
        /// The copying statistic: conditional accuracy minus the span-copy rate (transfer is credited when it is wide).
        pub cond_minus_span_copy: Option<f64>,
        /// Its z (the difference over the SE of the two proportions).
        pub cond_minus_span_copy_z: Option<f64>,
        /// Mean of the items' fidelity_cosine.
        pub mean_fidelity_cosine: Option<f64>,
        /// Mean of the items' achieved_cosine.
        pub mean_achieved_cosine: Option<f64>,
        /// Mean of the items' logit_correlation.
        pub mean_logit_correlation: Option<f64>,
        /// Items passing the arm's bit-exact gate, where it has one.
        pub bit_exact_items: Option<i64>,
        /// The arms named as controls, resolved at this arm's grid point.
        pub controls: Vec<String>,
        /// The control with the highest accuracy.
        pub strongest_control: Option<String>,
        /// Accuracy minus the strongest control's.
        pub lift: Option<f64>,
        /// Lower end of the lift's 95% interval (difference SE).
        pub lift_lo: Option<f64>,
        /// Upper end of the lift's 95% interval.
        pub lift_hi: Option<f64>,
        /// The lift's z (difference over its SE).
        pub lift_z: Option<f64>,
        /// Items where this arm is right and the strongest control wrong (paired items).
        pub lift_gained: Option<i64>,
        /// Items where this arm is wrong and the strongest control right.
        pub lift_lost: Option<i64>,
        /// The lift's paired standard error (over the items both scored).
        pub lift_paired_se: Option<f64>,
        /// Exact two-sided McNemar p-value of the lift (paired items).
        pub lift_mcnemar_p: Option<f64>,
        /// The run's floor accuracy.
        pub floor_accuracy: f64,
        /// The run's native reference accuracy.
        pub native_accuracy: f64,
        /// Mean wall seconds per item.
        pub seconds_per_item: f64,
    }
}

fn mean(xs: impl Iterator<Item = f64>) -> Option<f64> {
    let v: Vec<f64> = xs.collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// Summarises a run's item rows per arm, in config order; `columns` are the
/// arms' columns in the same order.
pub fn summarize(
    cfg: &SweepConfig,
    columns: &[ArmColumns],
    items: &[ItemRow],
) -> Result<Vec<SummaryRow>> {
    let rows_of =
        |name: &str| -> Vec<&ItemRow> { items.iter().filter(|r| r.arm.arm == name).collect() };
    let prop = |rows: &[&ItemRow]| -> Result<Proportion> {
        Ok(Proportion::new(
            rows.iter().filter(|r| r.correct).count(),
            rows.len(),
        )?)
    };
    let floor_acc = prop(&rows_of(
        &cfg.arms[cfg.anchor(crate::arm::Base::Masked)].arm.name,
    ))?
    .p();
    let native_acc = prop(&rows_of(
        &cfg.arms[cfg.anchor(crate::arm::Base::Full)].arm.name,
    ))?
    .p();
    let mut out = Vec::new();
    for (pa, cols) in cfg.arms.iter().zip(columns) {
        let rows = rows_of(&pa.arm.name);
        if rows.is_empty() {
            return Err(DriverError::Records(format!(
                "no item rows for arm `{}`",
                pa.arm.name
            )));
        }
        let p = prop(&rows)?;
        let ci = p.normal_ci95();
        let w = p.wilson_ci95();
        let cond: Vec<&&ItemRow> = rows.iter().filter(|r| r.native_correct).collect();
        let n_correct = rows.iter().filter(|r| r.correct).count();
        let copies_correct = rows.iter().filter(|r| r.correct && r.span_copy).count();
        // Conditional accuracy against the span-copy rate, as two proportions.
        let copying = if cond.is_empty() {
            None
        } else {
            let c = Proportion::new(cond.iter().filter(|r| r.correct).count(), cond.len())?;
            let sc = Proportion::new(rows.iter().filter(|r| r.span_copy).count(), rows.len())?;
            Some(difference(c, sc))
        };
        let controls = cfg.controls_of(pa)?;
        let mut ctrl = Vec::new();
        for &c in &controls {
            ctrl.push((
                cfg.arms[c].arm.name.clone(),
                prop(&rows_of(&cfg.arms[c].arm.name))?,
            ));
        }
        let lifted = if ctrl.is_empty() {
            None
        } else {
            let refs: Vec<(&str, Proportion)> =
                ctrl.iter().map(|(n, p)| (n.as_str(), *p)).collect();
            Some(lift(p, &refs)?)
        };
        // The lift again as paired outcomes over the items both scored.
        let paired_lift = match &lifted {
            Some(l) => {
                let ctrl_rows = rows_of(&l.control);
                let ctrl: std::collections::HashMap<&str, bool> = ctrl_rows
                    .iter()
                    .map(|r| (r.item_id.as_str(), r.correct))
                    .collect();
                let (a, b): (Vec<bool>, Vec<bool>) = rows
                    .iter()
                    .filter_map(|r| ctrl.get(r.item_id.as_str()).map(|&c| (r.correct, c)))
                    .unzip();
                (!a.is_empty()).then(|| paired(&a, &b)).transpose()?
            }
            None => None,
        };
        out.push(SummaryRow {
            arm: cols.clone(),
            n_items: p.n as i64,
            n_correct: p.successes as i64,
            accuracy: p.p(),
            se: p.se(),
            ci_lo: ci.lo,
            ci_hi: ci.hi,
            wilson_lo: w.lo,
            wilson_hi: w.hi,
            cond_n: cond.len() as i64,
            cond_accuracy: (!cond.is_empty())
                .then(|| cond.iter().filter(|r| r.correct).count() as f64 / cond.len() as f64),
            span_copy_rate: rows.iter().filter(|r| r.span_copy).count() as f64 / rows.len() as f64,
            span_copy_rate_correct: (n_correct > 0)
                .then(|| copies_correct as f64 / n_correct as f64),
            cond_minus_span_copy: copying.map(|d| d.diff),
            cond_minus_span_copy_z: copying.map(|d| d.z),
            mean_fidelity_cosine: mean(rows.iter().filter_map(|r| r.fidelity_cosine)),
            mean_achieved_cosine: mean(rows.iter().filter_map(|r| r.achieved_cosine)),
            mean_logit_correlation: mean(rows.iter().filter_map(|r| r.logit_correlation)),
            bit_exact_items: pa
                .arm
                .expect
                .as_ref()
                .map(|_| rows.iter().filter(|r| r.bit_exact == Some(true)).count() as i64),
            controls: controls
                .iter()
                .map(|&c| cfg.arms[c].arm.name.clone())
                .collect(),
            strongest_control: lifted.as_ref().map(|l| l.control.clone()),
            lift: lifted.as_ref().map(|l| l.difference.diff),
            lift_lo: lifted.as_ref().map(|l| l.difference.ci95.lo),
            lift_hi: lifted.as_ref().map(|l| l.difference.ci95.hi),
            lift_z: lifted.as_ref().map(|l| l.difference.z),
            lift_gained: paired_lift.map(|d| d.gained as i64),
            lift_lost: paired_lift.map(|d| d.lost as i64),
            lift_paired_se: paired_lift.map(|d| d.se),
            lift_mcnemar_p: paired_lift.map(|d| d.mcnemar_p),
            floor_accuracy: floor_acc,
            native_accuracy: native_acc,
            seconds_per_item: mean(rows.iter().map(|r| r.seconds)).unwrap_or(0.0),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-made item rows for a four-arm config, and the summary's values
    /// checked against figures worked out by hand.
    #[test]
    fn the_summary_statistics_have_their_worked_values() {
        let cfg = SweepConfig::parse(
            r#"
[run]
name = "s"
model = "m"
[data]
source = "synthetic"
n = 10
[[arms]]
name = "floor"
base = "masked"
[[arms]]
name = "native"
base = "full"
[[arms]]
name = "treat"
controls = ["ctrl", "floor"]
inject = { carrier = "h", layers = 1, source = "holder" }
[[arms]]
name = "ctrl"
inject = { carrier = "h", layers = 1, source = "own" }
"#,
        )
        .unwrap();
        let columns: Vec<ArmColumns> = cfg
            .arms
            .iter()
            .map(|pa| ArmColumns::of("s", pa, vec![], vec![]))
            .collect();
        // Ten items. native right on 0..5; treat right on 0..6; ctrl right
        // on 4..9; floor on none. treat copies a span on items 0 and 7.
        let right = |arm: &str, i: usize| match arm {
            "native" => i < 5,
            "treat" => i < 6,
            "ctrl" => (4..9).contains(&i),
            _ => false,
        };
        let mut items = Vec::new();
        for (pa, cols) in cfg.arms.iter().zip(&columns) {
            let name = pa.arm.name.as_str();
            // Rows in a scrambled item order: pairing goes by item id.
            for i in (0..10).rev() {
                items.push(ItemRow {
                    arm: cols.clone(),
                    item_index: i as i64,
                    item_id: format!("q{i}"),
                    prompt_tokens: 10,
                    fact_tokens: 2,
                    n_sites: 2,
                    continuation: String::new(),
                    continuation_ids: vec![],
                    correct: right(name, i),
                    span_copy: name == "treat" && (i == 0 || i == 7),
                    native_correct: i < 5,
                    fidelity_cosine: None,
                    achieved_cosine: None,
                    achieved_at: Default::default(),
                    logit_correlation: None,
                    bit_exact: None,
                    seconds: 1.0,
                });
            }
        }
        let out = summarize(&cfg, &columns, &items).unwrap();
        let row = |name: &str| out.iter().find(|r| r.arm.arm == name).unwrap();
        let t = row("treat");
        assert_eq!((t.n_items, t.n_correct), (10, 6));
        assert!((t.se - (0.6f64 * 0.4 / 10.0).sqrt()).abs() < 1e-12);
        assert_eq!((row("floor").accuracy, row("native").accuracy), (0.0, 0.5));
        assert_eq!((t.floor_accuracy, t.native_accuracy), (0.0, 0.5));
        // Conditional on native's 5 items: treat right on all 5.
        assert_eq!((t.cond_n, t.cond_accuracy), (5, Some(1.0)));
        // Span copies: 2 of 10 items, 1 of the 6 correct.
        assert_eq!(t.span_copy_rate, 0.2);
        assert!((t.span_copy_rate_correct.unwrap() - 1.0 / 6.0).abs() < 1e-12);
        // Conditional minus span-copy: 1.0 - 0.2, over sqrt(0 + .2 * .8 / 10).
        assert!((t.cond_minus_span_copy.unwrap() - 0.8).abs() < 1e-12);
        let z = 0.8 / (0.2f64 * 0.8 / 10.0).sqrt();
        assert!((t.cond_minus_span_copy_z.unwrap() - z).abs() < 1e-9);
        // The strongest control is ctrl (0.5 > 0.0): lift 0.1, unpaired SE
        // sqrt(.24/10 + .25/10).
        assert_eq!(t.strongest_control.as_deref(), Some("ctrl"));
        assert!((t.lift.unwrap() - 0.1).abs() < 1e-12);
        let se = (0.024f64 + 0.025).sqrt();
        assert!((t.lift_z.unwrap() - 0.1 / se).abs() < 1e-9);
        assert!((t.lift_lo.unwrap() - (0.1 - 1.959_963_984_540_054 * se)).abs() < 1e-9);
        // Paired: treat alone on items 0..4 (4 gained), ctrl alone on 6..9
        // (3 lost); McNemar 2 P(X <= 3), X ~ Bin(7, 1/2) = 2 * 64/128 = 1.
        assert_eq!((t.lift_gained, t.lift_lost), (Some(4), Some(3)));
        assert!((t.lift_paired_se.unwrap() - (7.0f64 - 0.1).sqrt() / 10.0).abs() < 1e-12);
        assert!((t.lift_mcnemar_p.unwrap() - 1.0).abs() < 1e-12);
        // An arm without controls has no lift.
        assert_eq!(row("ctrl").lift, None);
        assert_eq!(row("ctrl").lift_mcnemar_p, None);
    }
}
