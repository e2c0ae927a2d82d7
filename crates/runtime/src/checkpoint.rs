//! A model and its tokenizer, loaded from a path: a GGUF file or a Hugging
//! Face checkpoint directory. Resolving ids (catalog ids, `hf:org/repo`) and
//! verifying files is `tolerable-fetch`'s job; this module only reads.

use crate::error::{Result, RuntimeError};
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
    /// The sha256 (hex) of the file read, as its loader verified or computed
    /// it; `None` where the loader gave none (a safetensors directory, or a
    /// caller that passed none to [`Checkpoint::load_gguf`]).
    pub sha256: Option<String>,
    /// The model.
    pub model: Model,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
}

impl Checkpoint {
    /// Loads `path` under the name `id`: a GGUF file (see
    /// [`Checkpoint::load_gguf`], with no sha256) or a checkpoint directory
    /// (see [`Checkpoint::load_dir`]; f32 only).
    pub fn load_path(id: &str, path: &Path, precision: Precision, device: &Device) -> Result<Self> {
        if path.is_dir() {
            if precision != Precision::F32 {
                return Err(RuntimeError::ModelFile {
                    path: path.into(),
                    reason: format!("a safetensors checkpoint loads in f32 only, not {precision}"),
                });
            }
            return Self::load_dir(id, path, device);
        }
        Self::load_gguf(id, path, None, precision, device)
    }

    /// Loads a GGUF file with the tokenizer from its metadata. `sha256` is
    /// recorded as given: the caller vouches for it (tolerable-fetch passes
    /// the hash it verified).
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

    /// Loads a Hugging Face checkpoint directory (`config.json`,
    /// `tokenizer.json`, safetensors shards) in f32, with no sha256.
    pub fn load_dir(id: &str, dir: &Path, device: &Device) -> Result<Self> {
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
