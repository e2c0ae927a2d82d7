//! sha256 verification with sidecars, on small files the tests write.

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tolerable_fetch::provenance::{
    recorded_sha256, sha256_cached, sha256_file, sidecar_path, verify_cached, Mtime, Sidecar,
};
use tolerable_fetch::FetchError;

/// sha256 of `b"hello world\n"`.
const HELLO_SHA: &str = "a948904f2f0f479b8f8197694b30184b0d2ed1c1cd2a1ec0fb85d299a192a447";
const HELLO: &[u8] = b"hello world\n";

fn set_mtime(p: &Path, t: SystemTime) {
    std::fs::File::options()
        .write(true)
        .open(p)
        .unwrap()
        .set_modified(t)
        .unwrap();
}

fn read_sidecar(p: &Path) -> Sidecar {
    serde_json::from_str(&std::fs::read_to_string(sidecar_path(p)).unwrap()).unwrap()
}

/// `HELLO` with its lowest bit flipped: same size, other hash.
fn flipped() -> Vec<u8> {
    let mut b = HELLO.to_vec();
    b[0] ^= 1;
    b
}

#[test]
fn hashes_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    std::fs::write(&p, HELLO).unwrap();
    assert_eq!(sha256_file(&p).unwrap(), HELLO_SHA);
    assert_eq!(sidecar_path(&p), dir.path().join("m.gguf.verified"));
}

#[test]
fn a_flipped_bit_is_refused_with_the_refetch_command() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    std::fs::write(&p, flipped()).unwrap();
    let e = verify_cached("fake-model", &p, HELLO.len() as u64, HELLO_SHA).unwrap_err();
    assert!(matches!(e, FetchError::Corrupt { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("{} is corrupt", p.display()))
            && msg.contains(HELLO_SHA)
            && msg.contains("delete it and run `cargo xtask fetch-model fake-model`"),
        "{msg}"
    );
    assert!(!msg.ends_with('.'), "{msg}");
    // A failed check leaves no sidecar that could vouch for the file.
    assert!(!sidecar_path(&p).exists());
}

#[test]
fn the_sidecar_is_written_then_trusted_until_the_mtime_changes() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    std::fs::write(&p, HELLO).unwrap();
    let t0 = UNIX_EPOCH + Duration::new(1_700_000_000, 123_456_789);
    set_mtime(&p, t0);

    // First check: hashes and writes the sidecar.
    assert_eq!(
        verify_cached("fake-model", &p, HELLO.len() as u64, HELLO_SHA).unwrap(),
        HELLO_SHA
    );
    let side = read_sidecar(&p);
    assert_eq!(side.sha256, HELLO_SHA);
    assert_eq!(side.size, HELLO.len() as u64);
    assert_eq!(
        side.mtime,
        Mtime {
            secs: 1_700_000_000,
            nanos: 123_456_789
        }
    );

    // Change the contents behind the sidecar's back, keeping size and mtime:
    // the second check trusts the sidecar and does not read the file (if it
    // did, it would see the flipped bit).
    std::fs::write(&p, flipped()).unwrap();
    set_mtime(&p, t0);
    assert_eq!(recorded_sha256(&p).unwrap().as_deref(), Some(HELLO_SHA));
    assert_eq!(
        verify_cached("fake-model", &p, HELLO.len() as u64, HELLO_SHA).unwrap(),
        HELLO_SHA
    );

    // A changed mtime makes the sidecar stale: the file is hashed again and
    // the flipped bit is found.
    set_mtime(&p, t0 + Duration::from_secs(1));
    assert_eq!(recorded_sha256(&p).unwrap(), None);
    let e = verify_cached("fake-model", &p, HELLO.len() as u64, HELLO_SHA).unwrap_err();
    assert!(e.to_string().contains("is corrupt"), "{e}");
}

#[test]
fn a_sidecar_that_disagrees_with_the_catalog_is_rechecked() {
    // A sidecar recording another hash for the file as it is (say, written
    // for a plain path) never fails a good file: the file is hashed again and
    // the sidecar rewritten.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    std::fs::write(&p, HELLO).unwrap();
    assert_eq!(sha256_cached(&p).unwrap(), HELLO_SHA);
    let mut side = read_sidecar(&p);
    side.sha256 = "0".repeat(64);
    std::fs::write(sidecar_path(&p), serde_json::to_string(&side).unwrap()).unwrap();
    assert_eq!(sha256_cached(&p).unwrap(), "0".repeat(64), "trusted as is");
    assert_eq!(
        verify_cached("fake-model", &p, HELLO.len() as u64, HELLO_SHA).unwrap(),
        HELLO_SHA
    );
    assert_eq!(read_sidecar(&p).sha256, HELLO_SHA);
    // A malformed sidecar counts as absent.
    std::fs::write(sidecar_path(&p), "{ not json").unwrap();
    assert_eq!(recorded_sha256(&p).unwrap(), None);
    assert_eq!(sha256_cached(&p).unwrap(), HELLO_SHA);
    assert_eq!(read_sidecar(&p).sha256, HELLO_SHA);
}

#[test]
fn a_size_change_makes_the_sidecar_stale() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    std::fs::write(&p, HELLO).unwrap();
    let t0 = UNIX_EPOCH + Duration::from_secs(1_600_000_000);
    set_mtime(&p, t0);
    assert_eq!(sha256_cached(&p).unwrap(), HELLO_SHA);
    std::fs::write(&p, b"hello world, longer\n").unwrap();
    set_mtime(&p, t0);
    assert_eq!(recorded_sha256(&p).unwrap(), None);
    let h = sha256_cached(&p).unwrap();
    assert_ne!(h, HELLO_SHA);
    assert_eq!(h, sha256_file(&p).unwrap());
}

#[test]
fn a_truncated_file_says_so_with_both_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    std::fs::write(&p, &HELLO[..5]).unwrap();
    let e = verify_cached("fake-model", &p, HELLO.len() as u64, HELLO_SHA)
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        format!(
            "{} is truncated (5 of 12 bytes): delete it or run `cargo xtask fetch-model fake-model`",
            p.display()
        )
    );
    std::fs::write(&p, b"hello world, and more\n").unwrap();
    let e = verify_cached("fake-model", &p, HELLO.len() as u64, HELLO_SHA)
        .unwrap_err()
        .to_string();
    assert!(e.contains("is too long (22 of 12 bytes)"), "{e}");
}

#[test]
fn a_missing_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("absent.gguf");
    let e = verify_cached("fake-model", &p, 12, HELLO_SHA).unwrap_err();
    assert_eq!(e.to_string(), format!("no such file: {}", p.display()));
    let e = sha256_cached(&p).unwrap_err();
    assert!(matches!(e, FetchError::NoSuchFile(_)), "{e:?}");
}
