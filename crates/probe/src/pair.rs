//! Context pairs: the neutral unit the runner consumes. Two contexts share a
//! prefix, then differ in one span (the answer-masked against the full
//! passage; later, original against edited code), and are read before a
//! common suffix (the question). The positions of interest are where the two
//! differ (the fact region). The runner needs nothing else of an item:
//! answers and passages stay with the probe, which scores continuations.

use serde::{Deserialize, Serialize};

/// Two aligned contexts and the suffix read after them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContextPair {
    /// Stable id of the item the pair comes from.
    pub id: String,
    /// Token ids both contexts start with (the template prefix and the
    /// passage up to its first difference).
    pub shared: Vec<u32>,
    /// The base context after the shared prefix: the answer-masked passage
    /// (the floor's context).
    pub base: Vec<u32>,
    /// The alternative context after the shared prefix: the full passage
    /// (the native reference's and the holder's context).
    pub alt: Vec<u32>,
    /// Tokens read after the context (the question and the answer cue).
    pub suffix: Vec<u32>,
    /// Position of the first token of the readable span (the passage), after
    /// the template prefix.
    pub span_start: usize,
    /// Positions of interest, sorted: where base and alternative differ
    /// (the fact region), as context positions.
    pub focus: Vec<usize>,
}

impl ContextPair {
    /// The base context: shared prefix then base span.
    pub fn base_context(&self) -> Vec<u32> {
        [&self.shared[..], &self.base].concat()
    }

    /// The alternative context: shared prefix then alternative span.
    pub fn alt_context(&self) -> Vec<u32> {
        [&self.shared[..], &self.alt].concat()
    }

    /// Length of the base context.
    pub fn base_len(&self) -> usize {
        self.shared.len() + self.base.len()
    }

    /// Length of the alternative context.
    pub fn alt_len(&self) -> usize {
        self.shared.len() + self.alt.len()
    }

    /// Whether both contexts have the same length, so positions align one
    /// to one (true of every split-context item).
    pub fn aligned(&self) -> bool {
        self.base.len() == self.alt.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contexts_are_the_shared_prefix_then_each_span() {
        let p = ContextPair {
            id: "x".into(),
            shared: vec![1, 2, 3],
            base: vec![9, 9, 5],
            alt: vec![7, 8, 5],
            suffix: vec![4],
            span_start: 1,
            focus: vec![3, 4],
        };
        assert_eq!(p.base_context(), vec![1, 2, 3, 9, 9, 5]);
        assert_eq!(p.alt_context(), vec![1, 2, 3, 7, 8, 5]);
        assert_eq!((p.base_len(), p.alt_len()), (6, 6));
        assert!(p.aligned());
    }
}
