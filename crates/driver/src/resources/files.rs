//! The file conventions resources share: safetensors files written
//! atomically, text carried as a byte tensor, hex digests.

use crate::error::{DriverError, Result};
use candle_core::{Device, Tensor};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::Path;

/// Writes `map` to `path` atomically: a temporary file beside it
/// (`.<name>.<pid>.tmp`, which `.gitignore` ignores under `results/`), then
/// a rename, so that a reader finds the previous file or the new one, never
/// a part. With `sync` the file and its folder reach the disk before and
/// after the rename, so that a machine that stops (not only a killed
/// process) leaves one or the other too. Creates the folder; a failed write
/// leaves no temporary file.
pub fn save_atomic(map: &HashMap<String, Tensor>, path: &Path, sync: bool) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)
        .map_err(|e| DriverError::Records(format!("creating {}: {e}", dir.display())))?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let written = candle_core::safetensors::save(map, &tmp)
        .map_err(DriverError::from)
        .and_then(|_| {
            if !sync {
                return Ok(());
            }
            std::fs::File::open(&tmp)
                .and_then(|f| f.sync_all())
                .map_err(|e| DriverError::Records(format!("syncing {}: {e}", tmp.display())))
        })
        .and_then(|_| {
            std::fs::rename(&tmp, path).map_err(|e| {
                DriverError::Records(format!(
                    "renaming {} to {}: {e}",
                    tmp.display(),
                    path.display()
                ))
            })
        });
    match written {
        Ok(()) => {
            if sync {
                if let Ok(d) = std::fs::File::open(dir) {
                    let _ = d.sync_all();
                }
            }
            Ok(())
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Text (a layout, JSON fields) as a tensor of its UTF-8 bytes, for a
/// safetensors file.
pub fn text_tensor(text: &str) -> Result<Tensor> {
    let bytes = text.as_bytes().to_vec();
    let n = bytes.len();
    Ok(Tensor::from_vec(bytes, n, &Device::Cpu)?)
}

/// The text [`text_tensor`] wrote, or why the tensor holds none (named
/// `name` in the message).
pub fn tensor_text(t: &Tensor, name: &str) -> std::result::Result<String, String> {
    let bytes = t.to_vec1::<u8>().map_err(|e| format!("`{name}`: {e}"))?;
    String::from_utf8(bytes).map_err(|e| format!("`{name}`: {e}"))
}

/// sha256 of `bytes`, hex (the first 16 characters name configs and
/// resources by content).
pub fn hex_sha256(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// Bytes (a digest) as lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
