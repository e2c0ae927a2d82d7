//! Errors of carrier operations.

use thiserror::Error;

/// What went wrong choosing sites or editing a carrier.
#[derive(Debug, Error)]
pub enum CarrierError {
    /// A layer set names a layer the model does not have.
    #[error("layer {layer} is out of range for a model of {n_layers} layers (in `{field}`)")]
    LayerOutOfRange {
        /// The field that named it.
        field: String,
        /// The layer asked for.
        layer: usize,
        /// Layers the model has.
        n_layers: usize,
    },
    /// A layer set, position set or head set could not be read or applied.
    #[error("bad `{field}`: {reason}")]
    BadSites {
        /// The field at fault.
        field: String,
        /// Why.
        reason: String,
    },
    /// Two carriers that must have the same shape do not.
    #[error("shape mismatch in {what}: {reason}")]
    Shape {
        /// What was being combined.
        what: String,
        /// The shapes.
        reason: String,
    },
    /// A perturbation's parameters are out of range.
    #[error("bad perturbation: {0}")]
    BadPerturbation(String),
    /// A key bank, or a search in one, cannot be built as asked.
    #[error("key bank: {0}")]
    BadBank(String),
    /// A codebook cannot be fitted or used as asked.
    #[error("codebook: {0}")]
    BadCodebook(String),
    /// A measurement parameter outside its range.
    #[error("{field}: {reason}")]
    BadParameter {
        /// The parameter.
        field: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// A fitted substitute cannot be fitted or used as asked.
    #[error("fitted map: {0}")]
    BadFit(String),
    /// From the runtime.
    #[error(transparent)]
    Runtime(#[from] tolerable_runtime::RuntimeError),
    /// From tensor code.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Result of carrier operations.
pub type Result<T> = std::result::Result<T, CarrierError>;
