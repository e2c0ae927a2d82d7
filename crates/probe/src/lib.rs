//! Split-context probes (PROTOCOL.md section 3): question-answering items
//! from SQuAD or a seeded synthetic generator, the answer-masked passage
//! aligned token for token with the full one, its fact region, the prompt
//! around it, SQuAD scoring, and controls as item transformations; and the
//! code-edit corpus of Mode D (PROTOCOL.md section 10: code contexts, edit
//! archetypes, original and edited code as context pairs).
//!
//! **Architecture invariant:** this crate knows the tokenizer, not the
//! forward pass: it turns text into aligned token ids and continuations into
//! scores. Running models is the driver's job.
#![warn(missing_docs)]

pub mod code;
pub mod controls;
pub mod error;
pub mod item;
pub mod pair;
pub mod prompt;
pub mod rng;
pub mod sample;
pub mod score;
pub mod split;
pub mod squad;
pub mod synthetic;

pub use error::{ProbeError, Result};
pub use item::QaItem;
pub use pair::ContextPair;
pub use prompt::Template;
pub use split::{SplitItem, SplitOptions};
