//! The on-disk cache of built resources, outside any run directory:
//! `<root>/<kind>-<hash>/value.safetensors` beside `meta.json` (the hash, the
//! spec, the receiver's sha256, the training item ids and the value file's
//! sha256). A folder is written under a temporary name and renamed, so a
//! folder that exists is complete; one whose metadata or checksum does not
//! match what the run expects is rebuilt, never used.

use super::{ResourceSpec, Value};
use crate::error::{io, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// What `meta.json` records of a cached resource.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// The content hash the folder is named by.
    pub hash: String,
    /// The resource's spec.
    pub spec: ResourceSpec,
    /// The receiver it was built on.
    pub model_sha256: String,
    /// The training items it was fitted on, in order.
    pub items: Vec<String>,
    /// sha256 of `value.safetensors`.
    pub value_sha256: String,
    /// Seconds the build took (in the invocation that finished it).
    pub build_seconds: f64,
    /// The epoch the build resumed after, from a progress file an earlier
    /// invocation left: `build_seconds` then leaves out the epochs before
    /// it. Absent in files written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_after_epoch: Option<usize>,
    /// The steps of the next epoch the build resumed after (0 at an
    /// epoch's end; absent where no resume, or in files written before
    /// steps inside an epoch were saved).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_after_steps: Option<usize>,
}

/// How a resource was obtained in this run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Obtained {
    /// Loaded from the cache.
    Cached,
    /// Built now (absent before).
    Built,
    /// Built now because the cached copy did not match (named in the log).
    Rebuilt,
}

/// The resource cache.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
}

/// sha256 of a file, hex.
pub fn file_sha256(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(io(format!("reading {}", path.display())))?;
    Ok(super::files::hex_sha256(&bytes))
}

impl Store {
    /// A cache rooted at `root` (usually `<tolerable cache>/resources`).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The default cache: `resources/` under the model cache root
    /// (`$TOLERABLE_CACHE`, else `~/.cache/tolerable`).
    pub fn default_root() -> PathBuf {
        tolerable_fetch::catalog::cache_root().join("resources")
    }

    /// The folder of a resource of `kind` and `hash`.
    pub fn folder(&self, kind: &str, hash: &str) -> PathBuf {
        self.root.join(format!("{kind}-{hash}"))
    }

    /// Where a resource of `kind` and `hash` that is being built keeps its
    /// training progress (beside its folder; removed once it is saved).
    pub fn progress_file(&self, kind: &str, hash: &str) -> PathBuf {
        self.root
            .join(format!("{kind}-{hash}.progress.safetensors"))
    }

    /// The folder that keeps a group's shared work between invocations
    /// (a bridge's training examples), `shared-<hash>/` beside the
    /// resources: one per `key`, which names everything the work depends on
    /// beyond its own keys (the group, the receiver, the precision, the
    /// matmul kernels, the resource kind's version).
    pub fn shared_dir(&self, key: &str) -> PathBuf {
        self.root.join(format!(
            "shared-{}",
            &super::files::hex_sha256(key.as_bytes())[..16]
        ))
    }

    /// The `shared-*` folders in the store: kept work of groups whose
    /// builds stopped.
    pub fn shared_dirs(&self) -> Vec<PathBuf> {
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut dirs: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.is_dir()
                    && p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("shared-"))
            })
            .collect();
        dirs.sort();
        dirs
    }

    /// Whether a copy with matching metadata (hash and model) exists; its
    /// checksum and layout are checked when it is loaded.
    pub fn is_cached(&self, kind: &str, hash: &str, model_sha256: &str) -> bool {
        let meta = self.folder(kind, hash).join("meta.json");
        std::fs::read_to_string(meta)
            .ok()
            .and_then(|t| serde_json::from_str::<Meta>(&t).ok())
            .is_some_and(|m| m.hash == hash && m.model_sha256 == model_sha256)
    }

    /// The cached value of `spec` with `hash`, or why it cannot be used
    /// (`Ok(Err(reason))`; absent folders give `Ok(Err("absent"))`).
    pub fn load(
        &self,
        spec: &ResourceSpec,
        hash: &str,
        model_sha256: &str,
        cfg: &tolerable_runtime::ModelConfig,
    ) -> Result<std::result::Result<(Value, Meta), String>> {
        let kind = spec.kind();
        let dir = self.folder(kind.kind(), hash);
        let meta_path = dir.join("meta.json");
        if !meta_path.exists() {
            return Ok(Err("absent".into()));
        }
        let meta: Meta = match std::fs::read_to_string(&meta_path)
            .map_err(|e| e.to_string())
            .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()))
        {
            Ok(m) => m,
            Err(e) => return Ok(Err(format!("{} is unreadable ({e})", meta_path.display()))),
        };
        if meta.hash != hash || &meta.spec != spec {
            return Ok(Err(format!(
                "{} records hash {} and another spec",
                meta_path.display(),
                meta.hash
            )));
        }
        if meta.model_sha256 != model_sha256 {
            return Ok(Err(format!(
                "{} was built for model {}, this receiver is {model_sha256}",
                meta_path.display(),
                meta.model_sha256
            )));
        }
        let value_path = dir.join("value.safetensors");
        let sum = match file_sha256(&value_path) {
            Ok(s) => s,
            Err(e) => return Ok(Err(e.to_string())),
        };
        if sum != meta.value_sha256 {
            return Ok(Err(format!(
                "{} does not match its recorded checksum",
                value_path.display()
            )));
        }
        match kind
            .load(&value_path)
            .and_then(|v| kind.check(&v, cfg).map(|_| v))
        {
            Ok(v) => {
                // A progress file left by a build killed after saving.
                remove_leftover(&self.progress_file(kind.kind(), hash));
                Ok(Ok((v, meta)))
            }
            Err(e) => Ok(Err(format!("{}: {e}", value_path.display()))),
        }
    }

    /// Saves a built value atomically (a temporary folder, then a rename)
    /// and returns the sha256 of its value file; its training progress, no
    /// longer needed, is removed. A failed save leaves no temporary folder;
    /// when another process (a shard) saved the same hash first, its copy is
    /// kept (and this value's checksum still returned).
    pub fn save(&self, value: &Value, meta: &Meta) -> Result<String> {
        let sha = self.write_value(value, meta)?;
        remove_leftover(&self.progress_file(meta.spec.kind().kind(), &meta.hash));
        Ok(sha)
    }

    /// Removes a group's kept shared work ([`Self::shared_dir`]) once the
    /// group's resources are obtained: true when it was there and is gone.
    pub fn remove_shared(&self, dir: &Path) -> bool {
        remove_leftover(dir)
    }

    /// [`Self::save`]'s atomic write of the value folder.
    fn write_value(&self, value: &Value, meta: &Meta) -> Result<String> {
        let kind = meta.spec.kind();
        let dir = self.folder(kind.kind(), &meta.hash);
        std::fs::create_dir_all(&self.root)
            .map_err(io(format!("creating {}", self.root.display())))?;
        let tmp = self.root.join(format!(
            ".{}-{}.tmp-{}",
            kind.kind(),
            meta.hash,
            std::process::id()
        ));
        let sha = std::cell::RefCell::new(String::new());
        let written = (|| -> Result<()> {
            if tmp.exists() {
                std::fs::remove_dir_all(&tmp).map_err(io(format!("removing {}", tmp.display())))?;
            }
            std::fs::create_dir_all(&tmp).map_err(io(format!("creating {}", tmp.display())))?;
            let value_path = tmp.join("value.safetensors");
            kind.save(value, &value_path)?;
            let mut meta = meta.clone();
            meta.value_sha256 = file_sha256(&value_path)?;
            *sha.borrow_mut() = meta.value_sha256.clone();
            let text = serde_json::to_string_pretty(&meta).unwrap_or_default();
            std::fs::write(tmp.join("meta.json"), text)
                .map_err(io(format!("writing {}", tmp.join("meta.json").display())))?;
            if dir.exists() {
                std::fs::remove_dir_all(&dir).map_err(io(format!("removing {}", dir.display())))?;
            }
            std::fs::rename(&tmp, &dir).map_err(io(format!(
                "renaming {} to {}",
                tmp.display(),
                dir.display()
            )))
        })();
        if written.is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
            // Another shard may have saved the same hash meanwhile: keep its
            // copy, and report the checksum of the value this process built
            // and reads (when it got as far as writing it).
            let ours = sha.borrow().clone();
            if !ours.is_empty() && self.is_cached(kind.kind(), &meta.hash, &meta.model_sha256) {
                return Ok(ours);
            }
        }
        written.map(|_| sha.into_inner())
    }
}

/// Removes a file or folder the store no longer needs (a saved build's
/// progress, a finished group's kept training examples): true when it was
/// there and is gone. A failure is a warning, not an error: what it served
/// is saved.
fn remove_leftover(path: &Path) -> bool {
    let removed = if path.is_dir() {
        std::fs::remove_dir_all(path)
    } else if path.exists() {
        std::fs::remove_file(path)
    } else {
        return false;
    };
    match removed {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!("removing {}: {e}", path.display());
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};
    use std::collections::HashMap;

    /// A value's checksum is what a resumed run compares: the file must be
    /// the same bytes for the same tensors, whatever order the map that
    /// holds them iterates in (each HashMap has its own random order).
    #[test]
    fn the_same_tensors_save_to_the_same_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let tensors = |k: usize| -> HashMap<String, Tensor> {
            (0..40)
                .map(|i| {
                    let j = (i * 7 + k) % 40;
                    (
                        format!("t.{j}.a"),
                        Tensor::arange(0f32, (j + 1) as f32, &Device::Cpu).unwrap(),
                    )
                })
                .collect()
        };
        let (a, b) = (
            dir.path().join("a.safetensors"),
            dir.path().join("b.safetensors"),
        );
        candle_core::safetensors::save(&tensors(0), &a).unwrap();
        candle_core::safetensors::save(&tensors(0), &b).unwrap();
        assert_eq!(
            super::file_sha256(&a).unwrap(),
            super::file_sha256(&b).unwrap()
        );
    }
}
