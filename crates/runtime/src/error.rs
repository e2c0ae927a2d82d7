//! The runtime's error type: one enum, grouped by what went wrong.

use std::path::PathBuf;

/// Everything that can go wrong while loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A model file is missing, truncated or not a valid GGUF/safetensors file.
    #[error("model file {path}: {reason}")]
    ModelFile {
        /// The file that failed.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A metadata key the architecture needs is absent from the model file.
    #[error("model metadata is missing `{0}`")]
    MissingMetadata(String),
    /// A tensor the architecture needs is absent or has the wrong shape.
    #[error("model tensor `{name}`: {reason}")]
    Tensor {
        /// The tensor's name in the file.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The architecture named in the file is not one the runtime implements.
    #[error("unsupported architecture `{0}` (supported: qwen2, llama)")]
    UnsupportedArch(String),
    /// A prompt (plus cache) longer than the model's context.
    #[error("sequence of {len} positions exceeds the model's context of {max} positions")]
    PromptTooLong {
        /// Positions the forward would need.
        len: usize,
        /// The model's context length.
        max: usize,
    },
    /// A hook name that does not parse as a hook point.
    #[error("unknown hook point `{0}` (expected e.g. `blocks.3.hook_resid_pre` or `blocks.3.attn.hook_rot_k`)")]
    UnknownHook(String),
    /// A hook, carrier or forward naming a layer the model does not have.
    #[error("`{site}` names layer {layer}, but the model has {n_layers} layers")]
    LayerOutOfRange {
        /// The hook or site that names the layer.
        site: String,
        /// The layer asked for.
        layer: usize,
        /// The model's layer count.
        n_layers: usize,
    },
    /// An intervention or cache edit whose indices or shapes do not fit.
    #[error("`{site}`: {reason}")]
    BadIntervention {
        /// The hook or cache site.
        site: String,
        /// What does not fit.
        reason: String,
    },
    /// The tokenizer could not be built or failed on an input.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A file operation failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// The runtime's result type.
pub type Result<T> = std::result::Result<T, RuntimeError>;
