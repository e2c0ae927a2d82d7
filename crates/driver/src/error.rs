//! Errors of configs, validation, runs and records.

use thiserror::Error;

/// What went wrong in an experiment.
#[derive(Debug, Error)]
pub enum DriverError {
    /// The config file could not be read or parsed, or a field is wrong.
    #[error("config: {0}")]
    Config(String),
    /// An arm cannot apply to this model or this runner; names the field.
    #[error("arm `{arm}`: `{field}`: {reason}")]
    Inapplicable {
        /// The arm's name.
        arm: String,
        /// The config field at fault (e.g. `arms[3].inject[0].layers`).
        field: String,
        /// Why.
        reason: String,
    },
    /// A verification gate failed; nothing was written.
    #[error("gate failed: {0}")]
    Gate(String),
    /// The output folder belongs to another run.
    #[error("output folder {dir}: {reason}")]
    OutDir {
        /// The folder.
        dir: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// Reading or writing records.
    #[error("records: {0}")]
    Records(String),
    /// File system.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        source: std::io::Error,
    },
    /// From the runtime.
    #[error(transparent)]
    Runtime(#[from] tolerable_runtime::RuntimeError),
    /// From resolving, fetching or verifying a model.
    #[error(transparent)]
    Fetch(#[from] tolerable_fetch::FetchError),
    /// From carrier operations.
    #[error(transparent)]
    Carrier(#[from] tolerable_carrier::CarrierError),
    /// From the probe.
    #[error(transparent)]
    Probe(#[from] tolerable_probe::ProbeError),
    /// From statistics.
    #[error(transparent)]
    Stats(#[from] tolerable_stats::StatsError),
    /// From tensor code.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// From polars.
    #[error(transparent)]
    Polars(#[from] polars::error::PolarsError),
}

/// Result of driver operations.
pub type Result<T> = std::result::Result<T, DriverError>;

/// Wraps an I/O error with what was being done.
pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> DriverError {
    let context = context.into();
    move |source| DriverError::Io { context, source }
}
