//! Statistics for transfer experiments (PROTOCOL.md section 8): binomial
//! standard errors, normal and Wilson intervals, differences of two
//! proportions (independent, or paired on the same items with the exact
//! McNemar test), control-subtracted lift against the strongest control, and
//! the fidelity and divergence measures of the carrier experiments.
//!
//! **Architecture invariant:** no tensor library, no model: plain numbers in,
//! plain numbers out.
#![warn(missing_docs)]

pub mod measures;
pub mod proportion;

pub use measures::{
    cosine, kl_divergence_logits, log_softmax, mean_standard_error, pearson, relative_l2, softmax,
    spread, Spread,
};
pub use proportion::{
    difference, lift, mcnemar_exact, paired, Difference, Interval, Lift, Paired, Proportion,
};

/// Errors of the statistics functions.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum StatsError {
    /// Two inputs that must have equal length do not.
    #[error("length mismatch: {0} against {1}")]
    LengthMismatch(usize, usize),
    /// An input that must not be empty is.
    #[error("empty input: {0}")]
    Empty(&'static str),
    /// A count larger than its total, or a zero total.
    #[error("invalid proportion: {successes} of {n}")]
    InvalidProportion {
        /// Successes.
        successes: usize,
        /// Trials.
        n: usize,
    },
    /// A lift asked for with no control to subtract.
    #[error("a lift needs at least one control")]
    NoControl,
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, StatsError>;
