//! The code contexts: small, self-contained source files written for the
//! project, kept in `crates/probe/corpus/code/` (one file per context, the
//! language read from the extension) and compiled into the crate, so a
//! sweep needs no path to find them.

use super::Language;
use crate::{ProbeError, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// One code context: a source file of the corpus.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CodeContext {
    /// The file name (`py_inventory.py`), the context's id.
    pub name: String,
    /// The language, from the extension.
    pub language: Language,
    /// The source text.
    pub text: String,
}

impl CodeContext {
    /// A context from a file name and its text; the language comes from the
    /// extension.
    pub fn new(name: &str, text: &str) -> Result<Self> {
        let ext = Path::new(name)
            .extension()
            .and_then(|e| e.to_str())
            .unwrap_or("");
        let language = Language::from_extension(ext).ok_or_else(|| {
            ProbeError::Config(format!("code context {name}: unknown extension {ext:?}"))
        })?;
        Ok(Self {
            name: name.into(),
            language,
            text: text.into(),
        })
    }
}

macro_rules! builtin_files {
    ($($name:literal),* $(,)?) => {
        /// The file names of the built-in corpus, sorted.
        pub const BUILTIN_FILES: &[&str] = &[$($name),*];
        const BUILTIN_TEXTS: &[&str] = &[$(include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/corpus/code/", $name))),*];
    };
}

builtin_files![
    "c_bitset.c",
    "c_histogram.c",
    "c_matrix.c",
    "c_ringbuf.c",
    "c_tokenizer.c",
    "go_cache.go",
    "go_ledger.go",
    "go_queue.go",
    "go_ratelimit.go",
    "go_wordfreq.go",
    "js_cart.js",
    "js_debounce.js",
    "js_pager.js",
    "py_bank.py",
    "py_grades.py",
    "py_inventory.py",
    "py_matrix.py",
    "py_scheduler.py",
    "rs_graph.rs",
    "rs_parser.rs",
    "rs_stack.rs",
    "rs_stats.rs",
    "rs_tokenizer.rs",
    "ts_router.ts",
    "ts_store.ts",
    "ts_validator.ts",
];

/// The built-in corpus (the files of `crates/probe/corpus/code/`, compiled
/// in), sorted by name.
pub fn builtin() -> Vec<CodeContext> {
    BUILTIN_FILES
        .iter()
        .zip(BUILTIN_TEXTS)
        .map(|(name, text)| {
            CodeContext::new(name, text).expect("built-in corpus file with a known extension")
        })
        .collect()
}

/// Where the built-in corpus lives in the source tree.
pub fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/code")
}

/// Every file of `dir` with a known extension, as contexts sorted by name.
pub fn load_dir(dir: &Path) -> Result<Vec<CodeContext>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let known = path
            .extension()
            .and_then(|e| e.to_str())
            .and_then(Language::from_extension);
        if path.is_file() && known.is_some() {
            out.push(CodeContext::new(name, &std::fs::read_to_string(&path)?)?);
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_list_is_the_directory() {
        assert_eq!(builtin(), load_dir(&corpus_dir()).unwrap());
    }
}
