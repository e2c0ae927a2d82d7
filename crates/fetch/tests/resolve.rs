//! Model ids resolved to files and loaded with their provenance, on tiny
//! random models the tests write and on empty caches (no network).

use candle_core::Device;
use std::path::Path;
use tolerable_fetch::provenance::{sha256_file, sidecar_path};
use tolerable_fetch::{catalog, hub, resolve_in, FetchError, Origin};
use tolerable_runtime::{Checkpoint, Precision};
use tolerable_testkit::tiny::{write_gguf, write_hf_dir, TinySpec};

fn tiny_gguf(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("tiny.gguf");
    write_gguf(&TinySpec::default(), &path).unwrap();
    path
}

/// `resolve_in` with empty caches under `dir`.
fn resolve_empty(id: &str, dir: &Path) -> tolerable_fetch::Result<tolerable_fetch::ResolvedModel> {
    resolve_in(id, &dir.join("cache"), &dir.join("hub"))
}

#[test]
fn a_gguf_path_loads_with_its_real_sha256() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny_gguf(dir.path());
    let id = path.to_str().unwrap();
    let r = resolve_empty(id, dir.path()).unwrap();
    assert!(matches!(r.origin, Origin::File));
    assert_eq!(r.catalog_sha256(), None);
    let ck = tolerable_fetch::load(id, Precision::F32, &Device::Cpu).unwrap();
    let want = sha256_file(&path).unwrap();
    assert_eq!(ck.sha256.as_deref(), Some(want.as_str()));
    assert_eq!(ck.path, path);
    assert_eq!(ck.id, id);
    // The hash is remembered beside the file for the next load.
    assert!(sidecar_path(&path).exists());
    let again = r.load(Precision::Quantized, &Device::Cpu).unwrap();
    assert_eq!(again.sha256, ck.sha256);
}

#[test]
fn a_checkpoint_folder_loads_unhashed_in_f32_only() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec::default();
    let gguf = Checkpoint::load_gguf(
        "tiny",
        &tiny_gguf(dir.path()),
        None,
        Precision::F32,
        &Device::Cpu,
    )
    .unwrap();
    let hf = dir.path().join("hf");
    write_hf_dir(&spec, &hf, &gguf.tokenizer).unwrap();
    let r = resolve_empty(hf.to_str().unwrap(), dir.path()).unwrap();
    assert!(matches!(r.origin, Origin::Dir));
    let ck = r.load(Precision::F32, &Device::Cpu).unwrap();
    assert_eq!(ck.sha256, None);
    assert_eq!(ck.model.config().n_layers, spec.n_layers);
    let e = r.load(Precision::Quantized, &Device::Cpu).unwrap_err();
    assert!(e.to_string().contains("f32 only"), "{e}");
}

#[test]
fn hub_cache_layout_resolves_offline() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec::default();
    let gguf = Checkpoint::load_gguf(
        "tiny",
        &tiny_gguf(dir.path()),
        None,
        Precision::F32,
        &Device::Cpu,
    )
    .unwrap();
    let hub_dir = dir.path().join("hub");
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let snap = hub_dir
        .join("models--tolerable--tiny")
        .join("snapshots")
        .join(commit);
    write_hf_dir(&spec, &snap, &gguf.tokenizer).unwrap();
    std::fs::create_dir_all(hub_dir.join("models--tolerable--tiny").join("refs")).unwrap();
    std::fs::write(
        hub_dir
            .join("models--tolerable--tiny")
            .join("refs")
            .join("main"),
        commit,
    )
    .unwrap();
    let found = hub::fetch("tolerable/tiny", &hub_dir).unwrap();
    assert_eq!(found.dir(), snap.as_path());
    assert_eq!(found.shards.len(), 1);
    // Through the id resolution, as `load("hf:...")` does.
    let r = resolve_in("hf:tolerable/tiny", &dir.path().join("cache"), &hub_dir).unwrap();
    assert_eq!(r.path, snap);
    assert!(matches!(r.origin, Origin::Hub(_)));
    let ck = r.load(Precision::F32, &Device::Cpu).unwrap();
    assert_eq!(ck.model.config().d_model, spec.d_model);
    assert_eq!(ck.id, "hf:tolerable/tiny");
    // A repo that is not in the cache is a clear error offline.
    let e = hub::from_cache("tolerable/absent", &hub_dir)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("hf:tolerable/absent") && e.contains("config.json"),
        "{e}"
    );
}

#[test]
fn unknown_ids_and_missing_paths_are_told_apart() {
    let dir = tempfile::tempdir().unwrap();
    let e = resolve_empty("qwen9-giant", dir.path())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unknown model id `qwen9-giant`") && e.contains("qwen2.5-coder-0.5b-instruct"),
        "{e}"
    );
    for id in ["models/absent.gguf", "absent.gguf", "no/such/folder"] {
        let e = resolve_empty(id, dir.path()).unwrap_err();
        assert!(matches!(e, FetchError::NoSuchFile(_)), "{id}: {e:?}");
        assert_eq!(e.to_string(), format!("no such file: {id}"));
    }
}

#[test]
fn a_catalog_model_not_fetched_names_the_command() {
    let dir = tempfile::tempdir().unwrap();
    let id = "smollm2-135m-instruct";
    let e = resolve_empty(id, dir.path()).unwrap_err();
    assert!(matches!(e, FetchError::NotFetched { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("SmolLM2-135M-Instruct.Q4_1.gguf")
            && msg.contains(&format!("run `cargo xtask fetch-model {id}`")),
        "{msg}"
    );
}

#[test]
fn a_truncated_catalog_file_says_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("cache");
    let id = "smollm2-135m-instruct";
    let spec = catalog::spec(id).unwrap();
    let path = catalog::model_path(&root, spec);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, b"GGUF, the first bytes only").unwrap();
    let e = resolve_in(id, &root, &dir.path().join("hub"))
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        format!(
            "{} is truncated (26 of {} bytes): delete it or run `cargo xtask fetch-model {id}`",
            path.display(),
            spec.size
        )
    );
    // The catalog's own check says the same.
    let e = catalog::verify(&path, spec).unwrap_err().to_string();
    assert!(e.contains("is truncated (26 of"), "{e}");
}
