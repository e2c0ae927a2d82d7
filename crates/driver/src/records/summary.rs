//! The summary of a run: per arm, accuracy with its binomial error and
//! intervals, conditional accuracy, span-copy rates, mean fidelity measures,
//! the bit-exact gate count, and the lift over the strongest named control.

use super::{ArmColumns, ItemRow};
use crate::config::SweepConfig;
use crate::error::{DriverError, Result};
use crate::record;
use tolerable_stats::{difference, lift, Proportion};

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
            floor_accuracy: floor_acc,
            native_accuracy: native_acc,
            seconds_per_item: mean(rows.iter().map(|r| r.seconds)).unwrap_or(0.0),
        });
    }
    Ok(out)
}
