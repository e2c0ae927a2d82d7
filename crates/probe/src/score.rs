//! SQuAD scoring of greedy continuations: normalisation, substring match on
//! the first line, span-copy, conditional accuracy.

use serde::{Deserialize, Serialize};

/// SQuAD normalisation: lower-case, drop ASCII punctuation, drop the articles
/// a/an/the, collapse whitespace.
pub fn normalize(s: &str) -> String {
    let lower = s.to_lowercase();
    let no_punct: String = lower
        .chars()
        .filter(|c| !c.is_ascii_punctuation())
        .collect();
    no_punct
        .split_whitespace()
        .filter(|w| !matches!(*w, "a" | "an" | "the"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The part of a continuation that is scored: its first non-empty line.
pub fn first_line(continuation: &str) -> &str {
    continuation
        .split('\n')
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
}

/// Whether the continuation's first line contains a normalised gold answer.
pub fn is_correct(continuation: &str, answers: &[String]) -> bool {
    let c = normalize(first_line(continuation));
    answers
        .iter()
        .map(|a| normalize(a))
        .any(|a| !a.is_empty() && contains_words(&c, &a))
}

/// Substring match on normalised text (PROTOCOL.md section 3: plain
/// substring, as the papers score; no word-boundary requirement).
fn contains_words(hay: &str, needle: &str) -> bool {
    hay.contains(needle)
}

/// Whether the continuation's first line (at least two words) is copied
/// from the holder's passage.
pub fn is_span_copy(continuation: &str, passage: &str) -> bool {
    let c = normalize(first_line(continuation));
    c.split_whitespace().count() >= 2 && contains_words(&normalize(passage), &c)
}

/// One scored continuation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Score {
    /// A gold answer is in the first line.
    pub correct: bool,
    /// The first line is a span of the holder's passage.
    pub span_copy: bool,
}

/// Scores a continuation against gold answers and the holder's passage.
pub fn score(continuation: &str, answers: &[String], holder_passage: &str) -> Score {
    Score {
        correct: is_correct(continuation, answers),
        span_copy: is_span_copy(continuation, holder_passage),
    }
}

/// Accuracy over the items whose native reference is correct: `(correct,
/// eligible)` counts; `None` when no native reference is correct.
pub fn conditional(correct: &[bool], native_correct: &[bool]) -> Option<(usize, usize)> {
    let eligible = native_correct.iter().filter(|&&c| c).count();
    if eligible == 0 {
        return None;
    }
    let hits = correct
        .iter()
        .zip(native_correct)
        .filter(|(&c, &n)| c && n)
        .count();
    Some((hits, eligible))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn squad_normalisation() {
        assert_eq!(normalize("The  Denver Broncos!"), "denver broncos");
        assert_eq!(normalize("An apple, a day"), "apple day");
        assert_eq!(normalize("  Théâtre\tNational "), "théâtre national");
    }

    #[test]
    fn first_line_is_scored() {
        let a = vec!["Denver Broncos".to_string()];
        assert!(is_correct(" Denver Broncos\nTo answer this question,", &a));
        assert!(is_correct("\n\nthe denver broncos.", &a));
        assert!(!is_correct(" Carolina\nDenver Broncos", &a));
        // Plain substring, as the protocol says.
        assert!(is_correct(" in 1990s", &["1990".to_string()]));
        // An answer that normalises to nothing never matches.
        assert!(!is_correct(" anything", &["The".to_string()]));
    }

    #[test]
    fn span_copy_needs_two_words() {
        let p = "The American Football Conference champion Denver Broncos defeated Carolina.";
        assert!(is_span_copy(" Denver Broncos defeated\nmore", p));
        assert!(!is_span_copy(" Denver\n", p));
        assert!(!is_span_copy(" Broncos Denver", p));
    }

    #[test]
    fn conditional_accuracy() {
        assert_eq!(
            conditional(&[true, false, true], &[true, true, false]),
            Some((1, 2))
        );
        assert_eq!(conditional(&[true], &[false]), None);
    }
}
