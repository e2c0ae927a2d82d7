//! Hugging Face checkpoints through hf-hub: `config.json`, `tokenizer.json`
//! and the safetensors shards of `org/repo`, taken from the local hub cache
//! when present there, else downloaded where the hub is reachable.

use crate::error::{FetchError, Result};
use hf_hub::{Cache, Repo, RepoType};
use std::path::{Path, PathBuf};

/// The local files of one Hugging Face checkpoint (one snapshot directory).
#[derive(Debug, Clone)]
pub struct HfCheckpoint {
    /// `org/repo`.
    pub repo: String,
    /// `config.json`.
    pub config: PathBuf,
    /// `tokenizer.json`.
    pub tokenizer: PathBuf,
    /// Safetensors shards, sorted.
    pub shards: Vec<PathBuf>,
}

impl HfCheckpoint {
    /// The snapshot directory holding the files.
    pub fn dir(&self) -> &Path {
        self.config.parent().expect("config.json has a parent")
    }
}

/// The hub cache directory: `$HF_HUB_CACHE`, `$HF_HOME/hub`, or `~/.cache/huggingface/hub`.
pub fn hub_cache_dir() -> PathBuf {
    Cache::from_env().path().clone()
}

fn fail(repo: &str, reason: impl Into<String>) -> FetchError {
    FetchError::Fetch {
        id: format!("hf:{repo}"),
        reason: reason.into(),
    }
}

/// Shard names of a checkpoint: from `model.safetensors.index.json` if it
/// exists, else the single `model.safetensors`.
fn shard_names(index: Option<&Path>) -> Result<Vec<String>> {
    let Some(index) = index else {
        return Ok(vec!["model.safetensors".into()]);
    };
    let text = std::fs::read_to_string(index)?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| FetchError::BadFile {
        path: index.to_path_buf(),
        reason: e.to_string(),
    })?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| FetchError::BadFile {
            path: index.to_path_buf(),
            reason: "no weight_map".into(),
        })?;
    let mut names: Vec<String> = map
        .values()
        .filter_map(|s| s.as_str().map(String::from))
        .collect();
    names.sort();
    names.dedup();
    Ok(names)
}

/// Resolves `repo` from the hub cache at `cache_dir` only (no network).
pub fn from_cache(repo: &str, cache_dir: &Path) -> Result<HfCheckpoint> {
    let cache = Cache::new(cache_dir.to_path_buf());
    let r = cache.repo(Repo::model(repo.to_string()));
    let need = |f: &str| {
        r.get(f).ok_or_else(|| {
            fail(
                repo,
                format!("`{f}` is not in the hub cache at {}", cache_dir.display()),
            )
        })
    };
    let config = need("config.json")?;
    let tokenizer = need("tokenizer.json")?;
    let index = r.get("model.safetensors.index.json");
    let shards = shard_names(index.as_deref())?
        .iter()
        .map(|s| need(s))
        .collect::<Result<Vec<_>>>()?;
    Ok(HfCheckpoint {
        repo: repo.into(),
        config,
        tokenizer,
        shards,
    })
}

/// Resolves `repo`: from the cache when complete there, else through the hub
/// API (which fills the same cache). Offline (`HF_HUB_OFFLINE=1`) it never
/// touches the network.
pub fn fetch(repo: &str, cache_dir: &Path) -> Result<HfCheckpoint> {
    if let Ok(c) = from_cache(repo, cache_dir) {
        return Ok(c);
    }
    if std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| v == "1") {
        return from_cache(repo, cache_dir);
    }
    let api = hf_hub::api::sync::ApiBuilder::new()
        .with_cache_dir(cache_dir.to_path_buf())
        .with_progress(true)
        .build()
        .map_err(|e| fail(repo, e.to_string()))?;
    let r = api.model(repo.to_string());
    let get = |f: &str| r.get(f).map_err(|e| fail(repo, format!("`{f}`: {e}")));
    let config = get("config.json")?;
    let tokenizer = get("tokenizer.json")?;
    let index = r.get("model.safetensors.index.json").ok();
    let shards = shard_names(index.as_deref())?
        .iter()
        .map(|s| get(s))
        .collect::<Result<Vec<_>>>()?;
    Ok(HfCheckpoint {
        repo: repo.into(),
        config,
        tokenizer,
        shards,
    })
}

/// One file of a Hugging Face *dataset* repository (e.g. `rajpurkar/squad`,
/// `plain_text/validation-00000-of-00001.parquet`): from the hub cache at
/// `cache_dir` when present, else downloaded where the hub is reachable
/// (never under `HF_HUB_OFFLINE=1`).
pub fn dataset_file(repo: &str, filename: &str, cache_dir: &Path) -> Result<PathBuf> {
    let cache = Cache::new(cache_dir.to_path_buf());
    if let Some(p) = cache
        .repo(Repo::new(repo.to_string(), RepoType::Dataset))
        .get(filename)
    {
        return Ok(p);
    }
    if std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| v == "1") {
        return Err(fail(
            repo,
            format!(
                "`{filename}` is not in the hub cache at {} (offline)",
                cache_dir.display()
            ),
        ));
    }
    let api = hf_hub::api::sync::ApiBuilder::new()
        .with_cache_dir(cache_dir.to_path_buf())
        .build()
        .map_err(|e| fail(repo, e.to_string()))?;
    api.repo(Repo::new(repo.to_string(), RepoType::Dataset))
        .get(filename)
        .map_err(|e| fail(repo, format!("`{filename}`: {e}")))
}
