//! Records the git revision the driver is built from (`-dirty` when tracked
//! files outside `results/` differ from it), so a run records the code that
//! ran, not the working tree at the time it ran.

use std::path::Path;
use std::process::Command;

fn git(root: &Path, args: &[&str]) -> Option<String> {
    Command::new("git")
        .current_dir(root)
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

fn main() {
    // Read at run time: a build script binary cargo reuses from another
    // checkout of the same sources must look at this one.
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let root = Path::new(&manifest).join("../..");
    let revision = match git(&root, &["rev-parse", "HEAD"]) {
        Some(rev) => {
            let dirty = git(
                &root,
                &[
                    "status",
                    "--porcelain",
                    "--untracked-files=no",
                    "--",
                    ".",
                    ":(exclude)results",
                ],
            )
            .is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{rev}-dirty")
            } else {
                rev
            }
        }
        None => "unknown".into(),
    };
    println!("cargo:rustc-env=TOLERABLE_BUILD_REVISION={revision}");
    for p in [
        ".git/HEAD",
        ".git/index",
        "crates",
        "xtask",
        "Cargo.toml",
        "Cargo.lock",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(p).display());
    }
}
