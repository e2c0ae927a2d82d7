//! Whether a file is the file it should be: its sha256, computed once and
//! remembered beside it.
//!
//! Hashing a 1.1 GB model takes seconds, so the hash of a file is recorded in
//! a sidecar, `<file>.verified` (JSON: `sha256`, `size`, `mtime` as seconds
//! and nanoseconds since the epoch). A later check trusts the recorded hash
//! while the file's size and modification time are still those recorded, and
//! hashes the file again (rewriting the sidecar) as soon as either differs.
//! A sidecar that is absent, unreadable or malformed counts as absent; one
//! that cannot be written (a read-only folder) is skipped with a warning.
//!
//! What the sidecar cannot see: a change that keeps both the size and the
//! modification time (a deliberate `touch -d`, or a rewrite within the file
//! system's timestamp resolution). Delete the sidecar to force a rehash.

use crate::error::{FetchError, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

/// The suffix appended to a file's name to name its sidecar.
pub const SIDECAR_SUFFIX: &str = ".verified";

/// What a sidecar records: a file's sha256 and the size and modification
/// time the file had when it was hashed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sidecar {
    /// sha256 of the file's contents (hex).
    pub sha256: String,
    /// The file's size in bytes when hashed.
    pub size: u64,
    /// The file's modification time when hashed.
    pub mtime: Mtime,
}

/// A modification time as whole seconds and nanoseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mtime {
    /// Whole seconds since 1970-01-01T00:00:00Z.
    pub secs: u64,
    /// Nanoseconds past `secs`.
    pub nanos: u32,
}

/// The sidecar path of `file`: `<file>.verified`, in the same folder.
pub fn sidecar_path(file: &Path) -> PathBuf {
    let mut name = file.file_name().unwrap_or_default().to_os_string();
    name.push(SIDECAR_SUFFIX);
    file.with_file_name(name)
}

/// sha256 of a file's contents (hex), always read in full.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(|e| open_err(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn open_err(path: &Path, e: std::io::Error) -> FetchError {
    if e.kind() == std::io::ErrorKind::NotFound {
        FetchError::NoSuchFile(path.to_path_buf())
    } else {
        FetchError::BadFile {
            path: path.to_path_buf(),
            reason: format!("cannot read: {e}"),
        }
    }
}

/// The file's size and modification time now, or `None` for a modification
/// time the sidecar cannot record (before the epoch, or not kept by the
/// file system): such a file is always hashed.
fn stamp(path: &Path) -> Result<(u64, Option<Mtime>)> {
    let meta = std::fs::metadata(path).map_err(|e| open_err(path, e))?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| Mtime {
            secs: d.as_secs(),
            nanos: d.subsec_nanos(),
        });
    Ok((meta.len(), mtime))
}

/// The sha256 that `file`'s sidecar records, if the sidecar exists, parses,
/// and records the size and modification time the file has now; else `None`.
pub fn recorded_sha256(file: &Path) -> Result<Option<String>> {
    let (size, mtime) = stamp(file)?;
    let Some(mtime) = mtime else {
        return Ok(None);
    };
    let Ok(text) = std::fs::read_to_string(sidecar_path(file)) else {
        return Ok(None);
    };
    Ok(serde_json::from_str::<Sidecar>(&text)
        .ok()
        .filter(|s| s.size == size && s.mtime == mtime)
        .map(|s| s.sha256))
}

/// Records `sha256` as the hash of `file` as it is now (its size and
/// modification time), replacing any sidecar atomically. The caller vouches
/// that `sha256` is the hash of the file's present contents.
///
/// A sidecar that cannot be written is skipped with a warning: it only
/// saves time.
pub fn record_sha256(file: &Path, sha256: &str) -> Result<()> {
    let (size, mtime) = stamp(file)?;
    write_sidecar(file, sha256, size, mtime);
    Ok(())
}

fn write_sidecar(file: &Path, sha256: &str, size: u64, mtime: Option<Mtime>) {
    let Some(mtime) = mtime else {
        return;
    };
    let side = Sidecar {
        sha256: sha256.to_string(),
        size,
        mtime,
    };
    let dest = sidecar_path(file);
    let write = || -> std::io::Result<()> {
        let dir = dest.parent().filter(|d| !d.as_os_str().is_empty());
        let mut tmp = tempfile::NamedTempFile::new_in(dir.unwrap_or(Path::new(".")))?;
        tmp.write_all(serde_json::to_string_pretty(&side)?.as_bytes())?;
        tmp.write_all(b"\n")?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            tmp.as_file()
                .set_permissions(std::fs::Permissions::from_mode(0o644))?;
        }
        tmp.persist(&dest).map_err(|e| e.error)?;
        Ok(())
    };
    if let Err(e) = write() {
        tracing::warn!("cannot write {}: {e}", dest.display());
    }
}

/// Hashes `file`; returns the hash with the stamp the file had before and
/// after (equal unless the file changed while it was read).
fn hash_stamped(file: &Path) -> Result<(String, u64, Option<Mtime>, bool)> {
    let before = stamp(file)?;
    let h = sha256_file(file)?;
    let after = stamp(file)?;
    Ok((h, before.0, before.1, before == after))
}

/// sha256 of `file` (hex): the sidecar's when it still describes the file
/// (see the module docs), else computed and recorded in a new sidecar.
pub fn sha256_cached(file: &Path) -> Result<String> {
    if let Some(h) = recorded_sha256(file)? {
        return Ok(h);
    }
    let (h, size, mtime, steady) = hash_stamped(file)?;
    if steady {
        write_sidecar(file, &h, size, mtime);
    }
    Ok(h)
}

/// Checks that `file` is `id`'s file: `size` bytes with sha256 `sha256`
/// (hex); returns the verified hash.
///
/// The sidecar is trusted when it still describes the file and records the
/// expected hash; otherwise the file is hashed, and the sidecar is rewritten
/// only when the hash is the expected one. Errors name the file and say how
/// to get a good copy (`cargo xtask fetch-model <id>`):
/// [`FetchError::NoSuchFile`], [`FetchError::WrongSize`],
/// [`FetchError::Corrupt`].
pub fn verify_cached(id: &str, file: &Path, size: u64, sha256: &str) -> Result<String> {
    let (actual_size, _) = stamp(file)?;
    if actual_size != size {
        return Err(FetchError::WrongSize {
            id: id.to_string(),
            path: file.to_path_buf(),
            size: actual_size,
            expected: size,
        });
    }
    if recorded_sha256(file)?.is_some_and(|h| h == sha256) {
        return Ok(sha256.to_string());
    }
    tracing::info!("verifying the sha256 of {}", file.display());
    let (actual, size_now, mtime, steady) = hash_stamped(file)?;
    if actual != sha256 {
        return Err(FetchError::Corrupt {
            id: id.to_string(),
            path: file.to_path_buf(),
            expected: sha256.to_string(),
            actual,
        });
    }
    if steady {
        write_sidecar(file, &actual, size_now, mtime);
    }
    Ok(actual)
}
