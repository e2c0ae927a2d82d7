//! Test fixtures for tolerable: tiny models with seeded random weights,
//! written as real GGUF files (tokenizer in the metadata) and Hugging Face
//! checkpoint directories, for tests and benches that need a model but not a
//! real one.
//!
//! **Architecture invariant:** only tests and benches use this crate (it is a
//! dev-dependency everywhere and is never published); nothing in the
//! project's library or command-line code may depend on it.
#![warn(missing_docs)]

pub mod tiny;

pub use tiny::{write_gguf, write_hf_dir, TinySpec};
