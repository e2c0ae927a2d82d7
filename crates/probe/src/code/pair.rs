//! (original, edited) as the runner's [`ContextPair`]: the token ids both
//! texts share from the start, then each text's remaining tokens; the
//! positions of interest are the base context's downstream positions (from
//! the first differing token to the end). Nothing is read after the context
//! (Mode D needs no cue), so the suffix is empty.

use super::edit::{Archetype, Edit, NoSite};
use super::{CodeContext, Language};
use crate::{ContextPair, ProbeError, Result};
use serde::{Deserialize, Serialize};
use tolerable_runtime::Tokenizer;

/// What a code pair is beside its token ids: the context, the edit, and how
/// the edit's byte offset maps onto tokens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CodePairMeta {
    /// The context's file name.
    pub context: String,
    /// The context's language.
    pub language: Language,
    /// The archetype applied.
    pub archetype: Archetype,
    /// The seed the archetype picked its site with.
    pub seed: u64,
    /// The first byte where the two texts differ.
    pub offset: usize,
    /// The edited line, 1-based.
    pub line: usize,
    /// That line before the edit.
    pub before: String,
    /// That line after the edit.
    pub after: String,
    /// Places changed (see [`Edit::sites`]).
    pub sites: usize,
    /// The edit in words.
    pub description: String,
    /// Tokens of the original (whole context).
    pub original_len: usize,
    /// Tokens of the edited text (whole context).
    pub edited_len: usize,
    /// Tokens of the original that end at or before `offset`: the prefix a
    /// text-level cache could keep.
    pub text_prefix_tokens: usize,
    /// How many of those the edited text tokenizes differently (a token
    /// merged across the edit boundary): `text_prefix_tokens - shared`.
    pub retokenized: usize,
    /// Length of the longest common token suffix of `base` and `alt`: the
    /// last `common_suffix` downstream tokens are the same ids in both
    /// contexts, shifted by `alt.len() - base.len()` positions.
    pub common_suffix: usize,
}

/// A code edit as a context pair, with its metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CodePair {
    /// The pair: `shared` is the common token prefix of original and edited
    /// text, `base` the original's remaining tokens, `alt` the edited text's
    /// (lengths may differ), `suffix` empty, `span_start` 0, `focus` the
    /// base context's positions from the first differing token to its end.
    pub pair: ContextPair,
    /// The edit and its token geometry.
    pub meta: CodePairMeta,
}

/// The id of a code pair: `code/<file>/<archetype>`.
pub fn pair_id(context: &str, archetype: Archetype) -> String {
    format!("code/{context}/{}", archetype.name())
}

/// The seed an archetype picks its site with in one context: a name-keyed
/// mix of the run's seed, the file name and the archetype (FNV-1a), so that
/// adding a context or an archetype changes no other pick.
pub fn edit_seed(seed: u64, context: &str, archetype: Archetype) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let bytes = seed.to_le_bytes();
    let parts: [&[u8]; 5] = [
        &bytes,
        b"/",
        context.as_bytes(),
        b"/",
        archetype.name().as_bytes(),
    ];
    for b in parts.iter().flat_map(|p| p.iter()) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

impl CodePair {
    /// Tokenizes the original and the edited text and splits them at their
    /// longest common token prefix. Errors if the tokens do not decode back
    /// to the texts, if the common prefix reaches past the edit's offset, or
    /// if no token differs.
    pub fn build(ctx: &CodeContext, edit: &Edit, seed: u64, tk: &Tokenizer) -> Result<Self> {
        let id = pair_id(&ctx.name, edit.archetype);
        let bad = |why: String| ProbeError::Config(format!("code pair {id}: {why}"));
        let orig = tk.encode(&ctx.text)?;
        let edited = tk.encode(&edit.edited)?;
        let shared = orig.iter().zip(&edited).take_while(|(a, b)| a == b).count();
        if shared == orig.len() && shared == edited.len() {
            return Err(bad("the edit changes no token".into()));
        }
        let ends = token_ends(tk, &orig, &ctx.text)?;
        token_ends(tk, &edited, &edit.edited)?;
        let text_prefix_tokens = ends.partition_point(|&e| e <= edit.offset);
        // The shared tokens decode to a common prefix of both texts, so they
        // end at or before the first differing byte.
        if shared > text_prefix_tokens {
            return Err(bad(format!(
                "{shared} shared tokens reach past the edit at byte {} ({text_prefix_tokens} tokens before it)",
                edit.offset
            )));
        }
        let base = orig[shared..].to_vec();
        let alt = edited[shared..].to_vec();
        let common_suffix = base
            .iter()
            .rev()
            .zip(alt.iter().rev())
            .take_while(|(a, b)| a == b)
            .count();
        let pair = ContextPair {
            id,
            shared: orig[..shared].to_vec(),
            base,
            alt,
            suffix: Vec::new(),
            span_start: 0,
            focus: (shared..orig.len()).collect(),
        };
        let meta = CodePairMeta {
            context: ctx.name.clone(),
            language: ctx.language,
            archetype: edit.archetype,
            seed,
            offset: edit.offset,
            line: edit.line,
            before: edit.before.clone(),
            after: edit.after.clone(),
            sites: edit.sites,
            description: edit.description.clone(),
            original_len: orig.len(),
            edited_len: edited.len(),
            text_prefix_tokens,
            retokenized: text_prefix_tokens - shared,
            common_suffix,
        };
        Ok(Self { pair, meta })
    }
}

/// The end byte of each token in `text`; errors when the tokens do not
/// decode back to `text`.
fn token_ends(tk: &Tokenizer, ids: &[u32], text: &str) -> Result<Vec<usize>> {
    let mut ends = Vec::with_capacity(ids.len());
    let mut at = 0;
    for id in ids {
        at += tk.decode(&[*id])?.len();
        ends.push(at);
    }
    if at == text.len() && tk.decode(ids)? == text {
        return Ok(ends);
    }
    // Multi-byte characters split across tokens: decode prefixes.
    let mut ends = Vec::with_capacity(ids.len());
    for i in 1..=ids.len() {
        ends.push(tk.decode(&ids[..i])?.len());
    }
    if ends.last().copied().unwrap_or(0) != text.len() {
        return Err(ProbeError::Config(
            "code pair: the tokens do not decode back to the text".into(),
        ));
    }
    Ok(ends)
}

/// A (context, archetype) where the archetype found nothing to edit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Skipped {
    /// The context's file name.
    pub context: String,
    /// The archetype.
    pub archetype: Archetype,
    /// Why.
    pub reason: NoSite,
}

/// Every archetype applied to every context: the pairs, and the skips.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CodeEdits {
    /// One pair per (context, archetype) that applied, in context then
    /// archetype order.
    pub pairs: Vec<CodePair>,
    /// One entry per (context, archetype) that found no site.
    pub skips: Vec<Skipped>,
}

impl CodeEdits {
    /// Per archetype: (archetype, pairs built, skips).
    pub fn applicability(&self) -> Vec<(Archetype, usize, usize)> {
        Archetype::ALL
            .iter()
            .map(|&a| {
                let n = self.pairs.iter().filter(|p| p.meta.archetype == a).count();
                let s = self.skips.iter().filter(|s| s.archetype == a).count();
                (a, n, s)
            })
            .collect()
    }
}

/// Applies every archetype to every context (each with its
/// [`edit_seed`]) and builds the pairs; an archetype without a site is
/// recorded in [`CodeEdits::skips`].
pub fn build_all(contexts: &[CodeContext], tk: &Tokenizer, seed: u64) -> Result<CodeEdits> {
    let mut out = CodeEdits {
        pairs: Vec::new(),
        skips: Vec::new(),
    };
    for ctx in contexts {
        for a in Archetype::ALL {
            let s = edit_seed(seed, &ctx.name, a);
            match a.apply(&ctx.text, ctx.language, s) {
                Ok(edit) => out.pairs.push(CodePair::build(ctx, &edit, s, tk)?),
                Err(reason) => out.skips.push(Skipped {
                    context: ctx.name.clone(),
                    archetype: a,
                    reason,
                }),
            }
        }
    }
    tracing::debug!(
        pairs = out.pairs.len(),
        skips = out.skips.len(),
        "code edits built"
    );
    Ok(out)
}
