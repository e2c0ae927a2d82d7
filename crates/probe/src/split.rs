//! Split-context items (PROTOCOL.md section 3): the passage split at every
//! case-insensitive occurrence of every gold answer, tokenized segment by
//! segment; each answer segment replaced in the masked passage by as many
//! filler tokens as it has, so full and masked passages align position by
//! position; the fact region is where their ids differ.

use crate::error::{ProbeError, Result};
use crate::item::QaItem;
use crate::pair::ContextPair;
use crate::prompt::Template;
use serde::{Deserialize, Serialize};
use tolerable_runtime::Tokenizer;

/// How split items are built.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SplitOptions {
    /// The prompt template.
    #[serde(default)]
    pub template: Template,
    /// Items whose full prompt has more tokens are dropped.
    #[serde(default = "default_max_prompt_tokens")]
    pub max_prompt_tokens: usize,
    /// The filler text; must be exactly one token.
    #[serde(default = "default_filler")]
    pub filler: String,
}

fn default_max_prompt_tokens() -> usize {
    512
}

fn default_filler() -> String {
    "_".into()
}

impl Default for SplitOptions {
    fn default() -> Self {
        Self {
            template: Template::Raw,
            max_prompt_tokens: default_max_prompt_tokens(),
            filler: default_filler(),
        }
    }
}

/// Why an item was not kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DropReason {
    /// The question contains a gold answer.
    QuestionContainsAnswer,
    /// The prompt is longer than `max_prompt_tokens`.
    TooLong,
    /// Masking changed no token.
    EmptyFactRegion,
    /// No gold answer occurs in the passage (a data error: the item cannot
    /// be masked), counted like the other drops rather than stopping the run.
    AnswerNotInPassage,
}

/// An item ready for the split-context probe: aligned token ids.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SplitItem {
    /// The source item.
    pub item: QaItem,
    /// Template tokens before the passage.
    pub prefix_ids: Vec<u32>,
    /// The full passage's tokens (with the whitespace that ends it, such as
    /// the newline before the question).
    pub full_passage: Vec<u32>,
    /// The answer-masked passage's tokens (same length).
    pub masked_passage: Vec<u32>,
    /// Template and question tokens after the passage.
    pub suffix_ids: Vec<u32>,
    /// Passage positions (0 = first passage token) whose ids differ.
    pub fact_region: Vec<usize>,
    /// Number of answer occurrences masked.
    pub n_answer_spans: usize,
}

impl SplitItem {
    /// The receiver's prompt on the full passage (native reference).
    pub fn full_prompt(&self) -> Vec<u32> {
        [&self.prefix_ids[..], &self.full_passage, &self.suffix_ids].concat()
    }

    /// The receiver's prompt on the masked passage (floor).
    pub fn masked_prompt(&self) -> Vec<u32> {
        [&self.prefix_ids[..], &self.masked_passage, &self.suffix_ids].concat()
    }

    /// Tokens before the question: template prefix and passage.
    pub fn context_len(&self) -> usize {
        self.prefix_ids.len() + self.full_passage.len()
    }

    /// The fact region as prompt positions.
    pub fn fact_positions(&self) -> Vec<usize> {
        self.fact_region
            .iter()
            .map(|p| p + self.prefix_ids.len())
            .collect()
    }

    /// Prompt positions before the first fact position: the fact-free
    /// common prefix of the full and masked prompts.
    pub fn common_prefix_len(&self) -> usize {
        self.prefix_ids.len()
            + self
                .fact_region
                .first()
                .copied()
                .unwrap_or(self.full_passage.len())
    }

    /// The passage text as the receiver reads it (after the template prefix).
    pub fn passage_text(&self) -> String {
        format!(" {}", self.item.context)
    }

    /// The item as the runner consumes it: the masked passage as the base
    /// context, the full passage as the alternative, the question as the
    /// suffix and the fact region as the positions of interest.
    pub fn pair(&self) -> ContextPair {
        let first = self
            .fact_region
            .first()
            .copied()
            .unwrap_or(self.full_passage.len());
        ContextPair {
            id: self.item.id.clone(),
            shared: [&self.prefix_ids[..], &self.full_passage[..first]].concat(),
            base: self.masked_passage[first..].to_vec(),
            alt: self.full_passage[first..].to_vec(),
            suffix: self.suffix_ids.clone(),
            span_start: self.prefix_ids.len(),
            focus: self.fact_positions(),
        }
    }
}

/// What building a split item gave.
#[derive(Debug, Clone)]
pub enum Built {
    /// The item, ready.
    Kept(Box<SplitItem>),
    /// The item was dropped, and why.
    Dropped(DropReason),
}

/// Byte spans of every case-insensitive occurrence of `needle` in `hay`.
fn find_all_ci(hay: &str, needle: &str) -> Vec<(usize, usize)> {
    let n: Vec<char> = needle.chars().flat_map(char::to_lowercase).collect();
    if n.is_empty() {
        return Vec::new();
    }
    let h: Vec<(usize, char)> = hay.char_indices().collect();
    let mut out = Vec::new();
    for start in 0..h.len() {
        // Match lower-cased characters one by one from `start`.
        let mut k = 0;
        let mut i = start;
        while i < h.len() && k < n.len() {
            let mut lc = h[i].1.to_lowercase();
            let mut ok = true;
            for c in lc.by_ref() {
                if k < n.len() && c == n[k] {
                    k += 1;
                } else {
                    ok = false;
                    break;
                }
            }
            if !ok {
                break;
            }
            i += 1;
        }
        if k == n.len() {
            let end = if i < h.len() { h[i].0 } else { hay.len() };
            out.push((h[start].0, end));
        }
    }
    out
}

/// Answer spans (byte ranges of `text`), merged where they overlap, each
/// extended over one preceding space.
pub fn answer_spans(text: &str, answers: &[String]) -> Vec<(usize, usize)> {
    let mut spans: Vec<(usize, usize)> =
        answers.iter().flat_map(|a| find_all_ci(text, a)).collect();
    spans.sort();
    let mut merged: Vec<(usize, usize)> = Vec::new();
    for (s, e) in spans {
        match merged.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    for span in merged.iter_mut() {
        if span.0 > 0 && text.as_bytes()[span.0 - 1] == b' ' {
            span.0 -= 1;
        }
    }
    // Extending may make neighbours touch; they stay separate segments.
    merged
}

fn contains_ci(hay: &str, needle: &str) -> bool {
    !find_all_ci(hay, needle).is_empty()
}

impl SplitItem {
    /// Builds the split item of `item`, or says why it is dropped (an item
    /// none of whose answers occurs in its passage is dropped too).
    pub fn build(item: &QaItem, tokenizer: &Tokenizer, opts: &SplitOptions) -> Result<Built> {
        let filler = tokenizer.encode_fragment(&opts.filler)?;
        let [filler_id] = filler[..] else {
            return Err(ProbeError::Config(format!(
                "filler `{}` is {} tokens; it must be exactly one",
                opts.filler,
                filler.len()
            )));
        };
        if item.answers.iter().any(|a| contains_ci(&item.question, a)) {
            return Ok(Built::Dropped(DropReason::QuestionContainsAnswer));
        }
        let passage = format!(" {}", item.context);
        let spans = answer_spans(&passage, &item.answers);
        if spans.is_empty() {
            return Ok(Built::Dropped(DropReason::AnswerNotInPassage));
        }
        let mut full = Vec::new();
        let mut masked = Vec::new();
        let mut at = 0;
        for &(s, e) in &spans {
            if s > at {
                let ids = tokenizer.encode_fragment(&passage[at..s])?;
                masked.extend_from_slice(&ids);
                full.extend(ids);
            }
            let ids = tokenizer.encode_fragment(&passage[s..e])?;
            masked.extend(std::iter::repeat_n(filler_id, ids.len()));
            full.extend(ids);
            at = e;
        }
        // Whitespace that opens the template's suffix ("\n" before
        // "Question:") is read with the passage's last segment, as running
        // text has it ("title.\n" is one token); it stays its own plain
        // segment after an answer at the passage end.
        let (pre, post) = opts.template.parts(&item.question, tokenizer)?;
        let lead = post.len() - post.trim_start().len();
        let (glue, post) = post.split_at(lead);
        if at < passage.len() {
            let ids = tokenizer.encode_fragment(&format!("{}{glue}", &passage[at..]))?;
            masked.extend_from_slice(&ids);
            full.extend(ids);
        } else if !glue.is_empty() {
            let ids = tokenizer.encode_fragment(glue)?;
            masked.extend_from_slice(&ids);
            full.extend(ids);
        }
        let fact_region: Vec<usize> = (0..full.len()).filter(|&i| full[i] != masked[i]).collect();
        if fact_region.is_empty() {
            return Ok(Built::Dropped(DropReason::EmptyFactRegion));
        }
        let prefix_ids = tokenizer.encode(&pre)?;
        let suffix_ids = tokenizer.encode_fragment(post)?;
        let out = SplitItem {
            item: item.clone(),
            prefix_ids,
            full_passage: full,
            masked_passage: masked,
            suffix_ids,
            fact_region,
            n_answer_spans: spans.len(),
        };
        if out.full_prompt().len() > opts.max_prompt_tokens {
            return Ok(Built::Dropped(DropReason::TooLong));
        }
        Ok(Built::Kept(Box::new(out)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_are_case_insensitive_merged_and_take_the_space() {
        let t = " Denver beat denver's rival; DENVER won.";
        let s = answer_spans(t, &["Denver".into()]);
        assert_eq!(s.len(), 3);
        assert_eq!(&t[s[0].0..s[0].1], " Denver");
        assert_eq!(&t[s[1].0..s[1].1], " denver");
        assert_eq!(&t[s[2].0..s[2].1], " DENVER");
        // Overlapping answers merge into one span.
        let s = answer_spans(
            " the Denver Broncos won",
            &["Denver Broncos".into(), "Broncos".into()],
        );
        assert_eq!(s, vec![(4, 19)]);
        // Non-ASCII text keeps byte offsets straight.
        let t = " Zürich and ZÜRICH";
        let s = answer_spans(t, &["zürich".into()]);
        assert_eq!(s.len(), 2);
        assert_eq!(&t[s[1].0..s[1].1], " ZÜRICH");
    }
}
