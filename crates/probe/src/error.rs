//! The probe's error type.

use std::path::PathBuf;

/// What can go wrong building items.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// A dataset file that cannot be read or parsed.
    #[error("dataset {path}: {reason}")]
    Dataset {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A dataset with no usable item.
    #[error("dataset {0} holds no answerable question")]
    EmptyDataset(PathBuf),
    /// More items asked for than the data holds after filtering.
    #[error("asked for {asked} items, but only {available} are available after filtering ({why})")]
    NotEnoughItems {
        /// Items asked for.
        asked: usize,
        /// Items available.
        available: usize,
        /// Which filters applied.
        why: String,
    },
    /// A configuration value that cannot be used.
    #[error("probe configuration: {0}")]
    Config(String),
    /// The tokenizer failed.
    #[error(transparent)]
    Runtime(#[from] tolerable_runtime::RuntimeError),
    /// A dataset file could not be fetched from the hub.
    #[error(transparent)]
    Fetch(#[from] tolerable_fetch::FetchError),
    /// A file operation failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// The probe's result type.
pub type Result<T> = std::result::Result<T, ProbeError>;
