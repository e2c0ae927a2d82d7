//! A question-answering item: passage, question, gold answers.

use serde::{Deserialize, Serialize};

/// One answerable question about one passage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QaItem {
    /// Stable id (SQuAD's question id, or `syn-<seed>-<k>`).
    pub id: String,
    /// The article or topic the passage comes from (for mis-source pairing).
    pub title: String,
    /// The passage.
    pub context: String,
    /// The question.
    pub question: String,
    /// Gold answers (deduplicated, in the dataset's order).
    pub answers: Vec<String>,
}
