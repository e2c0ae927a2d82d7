//! The code-edit corpus for Mode D (PROTOCOL.md section 10): code contexts
//! written for the project ([`corpus`]), seven edit archetypes applied
//! programmatically ([`edit`]), and (original, edited) turned into the
//! runner's [`ContextPair`](crate::ContextPair) with the edit's metadata
//! beside it ([`pair`]).
//!
//! ```no_run
//! use tolerable_probe::code::{corpus, pair::build_all};
//! use tolerable_runtime::Tokenizer;
//!
//! let tk = Tokenizer::from_gguf_file(std::path::Path::new("qwen2.5-coder-0.5b-instruct.gguf"))?;
//! let edits = build_all(&corpus::builtin(), &tk, 0)?;
//! for p in &edits.pairs {
//!     println!("{}: edit at token {}, {} downstream", p.pair.id, p.pair.shared.len(), p.pair.focus.len());
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod corpus;
pub mod edit;
pub(crate) mod lex;
pub mod pair;

use serde::{Deserialize, Serialize};

pub use corpus::CodeContext;
pub use edit::{Archetype, Edit, NoSite};
pub use pair::{build_all, CodeEdits, CodePair, CodePairMeta, Skipped};

/// The language of a code context (JavaScript and TypeScript are one family).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Language {
    /// Python (`.py`).
    Python,
    /// Rust (`.rs`).
    Rust,
    /// JavaScript (`.js`).
    JavaScript,
    /// TypeScript (`.ts`).
    TypeScript,
    /// C (`.c`).
    C,
    /// Go (`.go`).
    Go,
}

impl Language {
    /// Every language, in a fixed order.
    pub const ALL: [Language; 6] = [
        Language::Python,
        Language::Rust,
        Language::JavaScript,
        Language::TypeScript,
        Language::C,
        Language::Go,
    ];

    /// The language of a file extension (`py`, `rs`, `js`, `ts`, `c`, `go`).
    pub fn from_extension(ext: &str) -> Option<Self> {
        Some(match ext {
            "py" => Language::Python,
            "rs" => Language::Rust,
            "js" => Language::JavaScript,
            "ts" => Language::TypeScript,
            "c" | "h" => Language::C,
            "go" => Language::Go,
            _ => return None,
        })
    }

    /// A short name (`python`, `rust`, `javascript`, `typescript`, `c`, `go`).
    pub fn name(self) -> &'static str {
        match self {
            Language::Python => "python",
            Language::Rust => "rust",
            Language::JavaScript => "javascript",
            Language::TypeScript => "typescript",
            Language::C => "c",
            Language::Go => "go",
        }
    }

    /// The language family: JavaScript and TypeScript share `js/ts`; every
    /// other language is its own family.
    pub fn family(self) -> &'static str {
        match self {
            Language::JavaScript | Language::TypeScript => "js/ts",
            other => other.name(),
        }
    }

    /// JavaScript or TypeScript.
    pub(crate) fn is_js(self) -> bool {
        matches!(self, Language::JavaScript | Language::TypeScript)
    }
}
