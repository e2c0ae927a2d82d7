//! Prompt templates around a passage and a question. The passage comes
//! first, so its cache is a prefix of the prompt's.

use crate::error::{ProbeError, Result};
use serde::{Deserialize, Serialize};
use tolerable_runtime::Tokenizer;

/// How the prompt is laid out around the passage.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Template {
    /// `Context: {passage}\nQuestion: {question}\nAnswer:` — the default: on
    /// these instruct models the answer span comes first and the line ends.
    #[default]
    Raw,
    /// The model's chat template around `Context: {passage}\nQuestion:
    /// {question}\nAnswer with a short span from the context.`
    Chat,
    /// Any text before the passage and after it; `{question}` in `suffix` is
    /// replaced by the question.
    Custom {
        /// Text before the passage (the passage follows after one space).
        prefix: String,
        /// Text after the passage.
        suffix: String,
    },
}

impl Template {
    /// A short name for records.
    pub fn name(&self) -> String {
        match self {
            Template::Raw => "raw".into(),
            Template::Chat => "chat".into(),
            Template::Custom { .. } => "custom".into(),
        }
    }

    /// The text before and after the passage for `question`. The passage is
    /// inserted after a single space (it belongs to the passage's first
    /// segment, as running text has it).
    pub fn parts(&self, question: &str, tokenizer: &Tokenizer) -> Result<(String, String)> {
        match self {
            Template::Raw => Ok((
                "Context:".into(),
                format!("\nQuestion: {question}\nAnswer:"),
            )),
            Template::Custom { prefix, suffix } => {
                Ok((prefix.clone(), suffix.replace("{question}", question)))
            }
            Template::Chat => {
                const SENTINEL: &str = "\u{0}PASSAGE\u{0}";
                let user = format!(
                    "Context:{SENTINEL}\nQuestion: {question}\nAnswer with a short span from the context."
                );
                let text = tokenizer.apply_chat_template(&user)?;
                let (pre, post) = text.split_once(SENTINEL).ok_or_else(|| {
                    ProbeError::Config("chat template lost the passage placeholder".into())
                })?;
                Ok((pre.to_string(), post.to_string()))
            }
        }
    }
}
