//! A model and its tokenizer, loaded from a catalog id, a hub id or a path.

use crate::catalog;
use crate::error::{Result, RuntimeError};
use crate::hub;
use crate::model::Model;
use crate::tokenizer::Tokenizer;
use crate::weights::Precision;
use candle_core::quantized::gguf_file;
use candle_core::Device;
use std::path::{Path, PathBuf};

/// A loaded checkpoint: weights, tokenizer and where they came from.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// The id it was loaded by (catalog id, `hf:org/repo`, or the path).
    pub id: String,
    /// The file or directory read.
    pub path: PathBuf,
    /// The catalog's sha256 of the file, where the catalog knows it.
    pub sha256: Option<String>,
    /// The model.
    pub model: Model,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
}

impl Checkpoint {
    /// Loads `id`: a catalog id (its cached file; fetch it first with
    /// `cargo xtask fetch-model <id>`), `hf:org/repo` (from the hub cache), a
    /// `.gguf` path, or a checkpoint directory (config.json, tokenizer.json,
    /// safetensors).
    pub fn load(id: &str, precision: Precision, device: &Device) -> Result<Self> {
        if let Some(repo) = id.strip_prefix("hf:") {
            if precision != Precision::F32 {
                return Err(RuntimeError::Fetch {
                    id: id.into(),
                    reason: "safetensors checkpoints load in f32 only".into(),
                });
            }
            let ck = hub::from_cache(repo, &hub::hub_cache_dir())?;
            return Self::load_dir(id, ck.dir(), device);
        }
        let as_path = Path::new(id);
        if as_path.exists() {
            if as_path.is_dir() {
                return Self::load_dir(id, as_path, device);
            }
            return Self::load_gguf(id, as_path, None, precision, device);
        }
        let spec = catalog::spec(id)?;
        let path = catalog::cached(id)?.ok_or_else(|| RuntimeError::ModelFile {
            path: catalog::model_path(&catalog::cache_root(), spec),
            reason: format!("not fetched; run `cargo xtask fetch-model {id}`"),
        })?;
        Self::load_gguf(id, &path, Some(spec.sha256.to_string()), precision, device)
    }

    /// Loads a GGUF file with the tokenizer from its metadata.
    pub fn load_gguf(
        id: &str,
        path: &Path,
        sha256: Option<String>,
        precision: Precision,
        device: &Device,
    ) -> Result<Self> {
        let model = Model::from_gguf(path, precision, device)?;
        let mut f = std::fs::File::open(path)?;
        let ct = gguf_file::Content::read(&mut f).map_err(|e| RuntimeError::ModelFile {
            path: path.into(),
            reason: e.to_string(),
        })?;
        let tokenizer = Tokenizer::from_gguf(&ct)?;
        Ok(Self {
            id: id.into(),
            path: path.into(),
            sha256,
            model,
            tokenizer,
        })
    }

    fn load_dir(id: &str, dir: &Path, device: &Device) -> Result<Self> {
        let model = Model::from_safetensors_dir(dir, device)?;
        let tokenizer = Tokenizer::from_json_file(&dir.join("tokenizer.json"))?;
        Ok(Self {
            id: id.into(),
            path: dir.into(),
            sha256: None,
            model,
            tokenizer,
        })
    }
}
