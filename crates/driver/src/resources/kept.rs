//! Shared work kept on disk across invocations: a bridge's training
//! examples (each training and slice item's prepared caches, and a
//! router's pool states), written as they are computed into the folder the
//! sweep names for their group ([`super::BuildCx::shared_dir`],
//! `shared-<hash>/` beside the resource cache) and read back by a later
//! invocation, so that a build cut short (a session's end, a killed
//! process) does not compute them again. The sweep removes the folder once
//! the last resource of the group is obtained.
//!
//! One file per example, named by a hash of its key; the file repeats the
//! key and a digest of its items (the item's and its partners' token ids
//! and gold answers), and an example is read back only when both match and
//! its caches fit the receiver. Anything else (a corrupt or foreign file)
//! is logged and the example computed again and written over it. Values
//! round-trip bit for bit (safetensors of the tensors' own dtype; floats
//! among the fields as their bits); the layout does not (a view comes back
//! as a contiguous tensor), which the sweep's tests show changes no
//! training bit.

use crate::error::Result;
use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tolerable_runtime::{KvCache, LayerKv, ModelConfig, Segment, SegmentKind};

/// An example's tensors by name, with its other fields as JSON.
pub(crate) type Parts = (Vec<(String, Tensor)>, serde_json::Value);

/// What an example read back is checked against: the receiver's
/// configuration and the device its tensors go to.
pub(crate) struct Fit<'a> {
    /// The receiver's configuration (layer count, cache entry shapes).
    pub cfg: &'a ModelConfig,
    /// Where the receiver's tensors live.
    pub device: &'a Device,
}

/// A value that can be kept on disk as tensors and JSON fields.
pub(crate) trait Keep: Sized {
    /// The value as named tensors and JSON fields.
    fn to_parts(&self) -> Result<Parts>;
    /// The value from its parts, or why they do not make one.
    fn from_parts(
        tensors: &mut HashMap<String, Tensor>,
        fields: &serde_json::Value,
        fit: &Fit,
    ) -> std::result::Result<Self, String>;
}

/// The file that keeps the value under `key` in `dir`.
pub(crate) fn file_of(dir: &Path, key: &str) -> PathBuf {
    dir.join(format!(
        "{}.safetensors",
        &super::files::hex_sha256(key.as_bytes())[..24]
    ))
}

/// The value under `key` kept in `dir`, if its file is there, names `key`
/// and `digest`, and makes a value that fits; a file that does not is
/// logged (why) and `None` returned, so that the caller computes it again.
pub(crate) fn read<E: Keep>(dir: &Path, key: &str, digest: &str, fit: &Fit) -> Option<E> {
    let path = file_of(dir, key);
    if !path.exists() {
        return None;
    }
    let got = (|| -> std::result::Result<E, String> {
        let mut map =
            candle_core::safetensors::load(&path, fit.device).map_err(|e| e.to_string())?;
        let fields = map.remove("fields").ok_or("no `fields` tensor")?;
        let fields: serde_json::Value =
            serde_json::from_str(&super::files::tensor_text(&fields, "fields")?)
                .map_err(|e| format!("`fields`: {e}"))?;
        if fields["key"] != key || fields["digest"] != digest {
            return Err("it was written for another example or other items".into());
        }
        E::from_parts(&mut map, &fields, fit)
    })();
    match got {
        Ok(e) => Some(e),
        Err(why) => {
            tracing::warn!(
                "{}: not used ({why}); computing the example again",
                path.display()
            );
            None
        }
    }
}

/// Keeps `value` under `key` in `dir` atomically (a temporary file, then a
/// rename; not synced: a machine that stops may leave a part, which a
/// reader sets aside).
pub(crate) fn write<E: Keep>(dir: &Path, key: &str, digest: &str, value: &E) -> Result<()> {
    let (tensors, mut fields) = value.to_parts()?;
    fields["key"] = key.into();
    fields["digest"] = digest.into();
    let mut map: HashMap<String, Tensor> = tensors.into_iter().collect();
    map.insert(
        "fields".into(),
        super::files::text_tensor(&fields.to_string())?,
    );
    super::files::save_atomic(&map, &file_of(dir, key), false)
}

/// A cache of one layout as tensors `{prefix}.k.{l}` / `{prefix}.v.{l}`
/// and fields (segments, next position).
/// An empty cache (a router whose first site is the first position) is a
/// field alone.
pub(crate) fn cache_parts(prefix: &str, cache: &KvCache) -> Result<Parts> {
    if cache.is_empty() {
        return Ok((
            Vec::new(),
            serde_json::json!({ "empty": true, "batch": cache.batch() }),
        ));
    }
    let mut tensors = Vec::with_capacity(2 * cache.n_layers());
    for l in 0..cache.n_layers() {
        let kv = cache.require_layer(l)?;
        tensors.push((format!("{prefix}.k.{l}"), kv.k.clone()));
        tensors.push((format!("{prefix}.v.{l}"), kv.v.clone()));
    }
    let segments: Vec<serde_json::Value> = cache
        .segments()
        .iter()
        .map(|s| {
            let kind = match s.kind {
                SegmentKind::Own => "own",
                SegmentKind::Appended => "appended",
            };
            serde_json::json!([kind, s.start, s.len])
        })
        .collect();
    Ok((
        tensors,
        serde_json::json!({ "segments": segments, "next_position": cache.next_position() }),
    ))
}

/// The cache [`cache_parts`] wrote under `prefix`.
pub(crate) fn cache_from(
    prefix: &str,
    tensors: &mut HashMap<String, Tensor>,
    fields: &serde_json::Value,
    fit: &Fit,
) -> std::result::Result<KvCache, String> {
    if fields["empty"] == true {
        return Ok(KvCache::new(fit.cfg, uint(fields, "batch")?, fit.device));
    }
    let segments = fields["segments"]
        .as_array()
        .ok_or_else(|| format!("`{prefix}`: no segments"))?
        .iter()
        .map(|s| {
            let kind = match s[0].as_str() {
                Some("own") => SegmentKind::Own,
                Some("appended") => SegmentKind::Appended,
                _ => return Err(format!("`{prefix}`: a segment of kind {}", s[0])),
            };
            let n = |i: usize| {
                s[i].as_u64()
                    .map(|v| v as usize)
                    .ok_or_else(|| format!("`{prefix}`: segment {s}"))
            };
            Ok(Segment {
                kind,
                start: n(1)?,
                len: n(2)?,
            })
        })
        .collect::<std::result::Result<Vec<_>, String>>()?;
    let next = uint(fields, "next_position")?;
    let layers = (0..fit.cfg.n_layers)
        .map(|l| {
            Ok(LayerKv {
                k: take(tensors, &format!("{prefix}.k.{l}"))?,
                v: take(tensors, &format!("{prefix}.v.{l}"))?,
            })
        })
        .collect::<std::result::Result<Vec<_>, String>>()?;
    KvCache::from_parts(fit.cfg, layers, segments, next).map_err(|e| format!("`{prefix}`: {e}"))
}

/// The tensor `name`, taken out of the file's map.
pub(crate) fn take(
    tensors: &mut HashMap<String, Tensor>,
    name: &str,
) -> std::result::Result<Tensor, String> {
    tensors
        .remove(name)
        .ok_or_else(|| format!("no tensor `{name}`"))
}

/// The unsigned integer field `name`.
pub(crate) fn uint(fields: &serde_json::Value, name: &str) -> std::result::Result<usize, String> {
    fields[name]
        .as_u64()
        .map(|v| v as usize)
        .ok_or_else(|| format!("no field `{name}`"))
}

/// The token-id list field `name`.
pub(crate) fn ids(fields: &serde_json::Value, name: &str) -> std::result::Result<Vec<u32>, String> {
    serde_json::from_value(fields[name].clone()).map_err(|e| format!("field `{name}`: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value of one tensor and one number.
    struct Pair(Tensor, usize);

    impl Keep for Pair {
        fn to_parts(&self) -> Result<Parts> {
            Ok((
                vec![("x".into(), self.0.clone())],
                serde_json::json!({ "n": self.1 }),
            ))
        }
        fn from_parts(
            tensors: &mut HashMap<String, Tensor>,
            fields: &serde_json::Value,
            _fit: &Fit,
        ) -> std::result::Result<Self, String> {
            Ok(Pair(take(tensors, "x")?, uint(fields, "n")?))
        }
    }

    /// A kept value reads back bit for bit under its key and digest only;
    /// a corrupt file, another key's or another digest's is not used; an
    /// empty cache round-trips.
    #[test]
    fn a_kept_value_reads_back_under_its_key_and_digest_only() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = ModelConfig {
            arch: tolerable_runtime::Arch::Qwen2,
            n_layers: 2,
            d_model: 8,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 4,
            d_ffn: 16,
            vocab_size: 32,
            rope_theta: 10000.0,
            rope_style: tolerable_runtime::RopeStyle::Half,
            rms_eps: 1e-6,
            context_length: 64,
        };
        let fit = Fit {
            cfg: &cfg,
            device: &Device::Cpu,
        };
        let x = Tensor::new(&[1.5f32, -0.0, f32::MIN_POSITIVE, 3.25], &Device::Cpu).unwrap();
        assert!(read::<Pair>(dir.path(), "a", "d1", &fit).is_none());
        write(dir.path(), "a", "d1", &Pair(x.clone(), 7)).unwrap();
        let back = read::<Pair>(dir.path(), "a", "d1", &fit).unwrap();
        let bits = |t: &Tensor| -> Vec<u32> {
            t.to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        assert_eq!((bits(&back.0), back.1), (bits(&x), 7));
        assert!(read::<Pair>(dir.path(), "a", "d2", &fit).is_none());
        // Another key's file renamed into this key's place.
        write(dir.path(), "b", "d1", &Pair(x.clone(), 8)).unwrap();
        std::fs::rename(file_of(dir.path(), "b"), file_of(dir.path(), "a")).unwrap();
        assert!(read::<Pair>(dir.path(), "a", "d1", &fit).is_none());
        std::fs::write(file_of(dir.path(), "a"), b"cut off").unwrap();
        assert!(read::<Pair>(dir.path(), "a", "d1", &fit).is_none());
        // Written over, it reads again; no temporary file is left.
        write(dir.path(), "a", "d1", &Pair(x, 9)).unwrap();
        assert_eq!(read::<Pair>(dir.path(), "a", "d1", &fit).unwrap().1, 9);
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            names.iter().all(|n| n.ends_with(".safetensors")),
            "{names:?}"
        );
        // An empty cache (a router's prefix before a first site at 0) is a
        // field alone and reads back empty, of its batch.
        let empty = KvCache::new(&cfg, 2, &Device::Cpu);
        let (tensors, fields) = cache_parts("prefix", &empty).unwrap();
        assert!(tensors.is_empty());
        let back = cache_from("prefix", &mut HashMap::new(), &fields, &fit).unwrap();
        assert!(back.is_empty() && back.batch() == 2 && back.next_position() == 0);
    }
}
