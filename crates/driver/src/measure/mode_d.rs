//! Mode D: activation-delta caching for code edits (PROTOCOL.md §10, source
//! 000), measured against stale reuse, the full recompute and prefix KV
//! reuse.
//!
//! **Pairs.** The probe's edit pairs (`tolerable_probe::code::pair::build_all`
//! over the corpus, seeded by `[run] seed`): the original text (base) and
//! the edited text (alt) as token ids sharing a prefix of `s` tokens. The
//! last `c = common_suffix` tokens of both are the same ids: these are the
//! **downstream positions**, `D_b = T_b − c ..T_b` in the original and
//! `D_a = T_a − c ..T_a` in the edited text, aligned from the end (position
//! `D_b + i` ↔ `D_a + i`). Tokens `s..D_a` of the edited text are the edited
//! span. A pair with fewer than `[measure] min_downstream` downstream tokens
//! is skipped (recorded).
//!
//! **Passes.** The original and the edited context from an empty cache,
//! capturing `blocks.{l}.hook_resid_pre` at every layer `l < L` and the final
//! residual (`blocks.{L-1}.hook_resid_post`, "layer L"), with logits at the
//! downstream positions (`LogitsAt::Positions`: the positions before them
//! are never compared, and a 150k vocabulary at every position would cost
//! hundreds of MB per pass). The edited pass's logits are the **full
//! recompute**; the original pass's logits at the aligned positions are
//! **stale reuse**.
//!
//! **Dirtiness** at layer l and tau: the fraction of downstream positions
//! with `|h_edit − h_orig| / |h_orig| > tau`. **Deltas**: the final-position
//! delta `h_edit[T_a − 1] − h_orig[T_b − 1]` at every layer; the
//! cross-context cosine per archetype and layer is the mean cosine between
//! the deltas of different contexts.
//!
//! **Mode D at injection layer l** (`l < L`): the edited prefix cache is the
//! original pass's cache of the shared prefix (`0..s`, the same tokens)
//! extended by the edited span (`s..D_a`) run through every block, exactly
//! what a cache-keeping editor computes; then
//! `Model::forward_from_layer(l, h_orig_l[D_b..T_b] + delta, lower, prefix)`
//! runs blocks `l..L` for the downstream positions only, at the edited
//! context's positions `D_a..T_a`, attending over the edited prefix's keys
//! and values and their own. `lower` is the original pass's cache at the
//! downstream positions for the blocks below l: stale, as Mode D reuses
//! them (they enter the cache, not this call's outputs). The deltas:
//!
//! - `oracle`: the true per-position delta `h_edit_l[D_a + i] − h_orig_l[D_b + i]`;
//! - `edit_site`: the delta at the first differing position `s`,
//!   `h_edit_l[s] − h_orig_l[s]`, broadcast to every downstream position;
//! - `archetype_mean`: the mean final-position delta at layer l of the
//!   archetype's pairs in the *other* contexts (leave-one-out), broadcast;
//! - `zero` (optional, `[measure] variants`): no delta, the stale states
//!   through blocks `l..L` over the edited prefix — the control that tells
//!   what a delta adds to recomputing attention alone.
//!
//! Its logits at the downstream positions are compared with the full
//! recompute: top-1 agreement, mean KL(full || Mode D), and the reduction
//! `KL(full || stale) / KL(full || Mode D)`.
//!
//! **Oracle gate.** Phase 1 runs the oracle at every injection layer of every
//! pair before any approximate delta is read: it must reproduce the full
//! recompute — every top-1 prediction equal (a disagreement counts only if
//! the two tokens' logits in the full recompute differ by more than
//! [`TIE_TOLERANCE`]), mean KL below [`ORACLE_KL_TOLERANCE`] and the KL at
//! every position below [`ORACLE_POSITION_KL_TOLERANCE`], at every l.
//! Its outcome goes to `run.json`; a failure stops the run.
//!
//! **Compute** (see [`FlopModel`] for the formula), each strategy producing
//! the updated cache and the next-token logits at the last position:
//! the full recompute (tokens `0..T_a`, every block), prefix KV reuse (the
//! original's cache of `0..s` kept, tokens `s..T_a` through every block),
//! and Mode D at l (the edited span through every block, the downstream
//! tokens through blocks `l..L`, plus extracting and injecting the delta).
//! Wall time is measured on separate calls of exactly these (the fastest of
//! `[measure] timing_reps`), and the net saving is `1 − Mode D / strategy`.
//!
//! **Files.** Phase 1 writes `deltas/<context>.safetensors` (the final-position
//! deltas `[L + 1, d]` per archetype) and `oracle/<context>.parquet`;
//! phase 2 writes `units/<context>.parquet` (every other per-pair row, and
//! the context's skips), keeping each pair's rows in
//! `pairs/<context>.<archetype>.parquet` ([`pair_file_name`]) until its
//! context's unit is written (then they are removed); when every unit
//! exists, `summary.parquet` holds the aggregates. A rerun skips finished
//! files of either phase (where a context's oracle file exists without its
//! deltas, only the deltas are computed again: two forward passes a pair,
//! not the oracle at every layer), and in phase 2 the pairs already measured of an
//! unfinished context (their rows are read back, bit for bit the rows
//! written). Phase 2 takes
//! the languages in turn ([`languages_in_turn`]), so a run in progress has
//! measured some contexts of each; [`interim_summary`] reads it.

use super::{
    fraction_above, invocation, read_rows, relative_l2_rows, write_rows, write_tensors_atomic,
    Comparison, FlopModel, LogitReference, MeasureConfig, MeasureOptions, MeasureOutcome, RunDir,
};
use crate::error::{DriverError, Result};
use crate::records::MeasureRow;
use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::io::IsTerminal;
use std::path::Path;
use std::time::Instant;
use tolerable_carrier::LayerSet;
use tolerable_probe::code::pair::{build_all, pair_id};
use tolerable_probe::code::{corpus, Archetype, CodeContext, CodePair};
use tolerable_runtime::{
    HookPoint, HookSpec, KvCache, LogitsAt, Model, ModelConfig, Precision, Tokenizer,
};

/// The oracle gate's bound on the mean KL(full || oracle Mode D) of a pair
/// at one injection layer, in nats.
pub const ORACLE_KL_TOLERANCE: f64 = 1e-6;

/// The oracle gate's bound on the KL(full || oracle Mode D) at any one
/// downstream position, in nats: a mean at float precision could hide one
/// position the oracle does not reproduce (on the real 0.5B the largest
/// position KL over all 173 pairs at all 24 injection layers is 3.0e-10,
/// `results/mode-d-0.5b`).
pub const ORACLE_POSITION_KL_TOLERANCE: f64 = 1e-5;

/// Two next-token predictions whose logits in the reference differ by at
/// most this much are a tie: float noise may pick either (recorded as
/// `ties`, and not a failure of the oracle gate).
pub const TIE_TOLERANCE: f64 = 1e-3;

/// Every delta variant measured after the oracle, in report order (the
/// names of [`Variant`]).
pub const VARIANTS: [&str; 3] = ["edit_site", "archetype_mean", "zero"];

/// A delta that Mode D adds to the original's states at the downstream
/// positions (after the oracle gate).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Variant {
    /// The delta at the first differing position, `h_edit_l[s] − h_orig_l[s]`, broadcast.
    EditSite,
    /// The archetype's mean final-position delta at layer l over the other
    /// contexts (leave-one-out), broadcast.
    ArchetypeMean,
    /// No delta: the stale states themselves run through blocks l..L over
    /// the edited prefix (a control: what recomputing attention alone gives).
    Zero,
}

impl Variant {
    /// The name in records (`edit_site`, `archetype_mean`, `zero`).
    pub fn name(self) -> &'static str {
        match self {
            Variant::EditSite => "edit_site",
            Variant::ArchetypeMean => "archetype_mean",
            Variant::Zero => "zero",
        }
    }
}

/// The `[measure]` table of `kind = "mode_d"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModeDSpec {
    /// Dirtiness thresholds (relative L2), each in (0, inf).
    #[serde(default = "default_taus")]
    pub taus: Vec<f64>,
    /// Injection layers l of Mode D (`LayerSet` syntax: `"all"`, `4`,
    /// `[1, 2, 4]`, `"prefix:N"`, `"suffix:L"`), each below the model's
    /// block count.
    #[serde(default = "default_layers")]
    pub layers: LayerSet,
    /// `"builtin"` (the probe's corpus) or a folder of code files.
    #[serde(default = "default_contexts")]
    pub contexts: String,
    /// Only these contexts (file names of the corpus).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub select: Option<Vec<String>>,
    /// Only these archetypes (default all seven).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub archetypes: Option<Vec<Archetype>>,
    /// Pairs with fewer downstream (common-suffix) tokens are skipped.
    #[serde(default = "default_min_downstream")]
    pub min_downstream: usize,
    /// Timed calls are repeated this many times and the fastest kept.
    #[serde(default = "default_timing_reps")]
    pub timing_reps: usize,
    /// The delta variants (default `edit_site` and `archetype_mean`; `zero`
    /// adds the no-delta control).
    #[serde(default = "default_variants")]
    pub variants: Vec<Variant>,
}

fn default_taus() -> Vec<f64> {
    vec![0.05, 0.1, 0.2]
}
fn default_layers() -> LayerSet {
    LayerSet::All
}
fn default_contexts() -> String {
    "builtin".into()
}
fn default_min_downstream() -> usize {
    8
}
fn default_timing_reps() -> usize {
    1
}
fn default_variants() -> Vec<Variant> {
    vec![Variant::EditSite, Variant::ArchetypeMean]
}

fn cfg_err(msg: impl Into<String>) -> DriverError {
    DriverError::Config(msg.into())
}

/// A (context, archetype) that was not measured, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkipRecord {
    /// The context's file name.
    pub context: String,
    /// Its language.
    pub language: String,
    /// The archetype.
    pub archetype: String,
    /// Why (the archetype found no site, or too few downstream tokens).
    pub reason: String,
}

/// What a Mode D run measures, resolved against a model's geometry and
/// tokenizer before its weights load.
#[derive(Debug, Clone)]
pub struct ModeDPlan {
    /// Injection layers, sorted.
    pub layers: Vec<usize>,
    /// Where the contexts came from (`builtin` or the folder).
    pub source: String,
    /// The contexts, sorted by name.
    pub contexts: Vec<CodeContext>,
    /// The pairs measured, in context then archetype order.
    pub pairs: Vec<CodePair>,
    /// The (context, archetype) skipped.
    pub skips: Vec<SkipRecord>,
}

impl ModeDPlan {
    /// The pairs of one context.
    pub fn pairs_of<'a>(&'a self, context: &'a str) -> impl Iterator<Item = &'a CodePair> + 'a {
        self.pairs.iter().filter(move |p| p.meta.context == context)
    }
}

impl ModeDSpec {
    /// The checks that need no model: taus, `min_downstream`,
    /// `timing_reps`, `select`, `archetypes`.
    pub fn check(&self) -> Result<()> {
        if self.taus.is_empty() {
            return Err(cfg_err(
                "[measure] taus: empty; give at least one tau in (0, inf)",
            ));
        }
        for (i, t) in self.taus.iter().enumerate() {
            if !(t.is_finite() && *t > 0.0) {
                return Err(cfg_err(format!(
                    "[measure] taus[{i}] = {t}: a tau must be in (0, inf)"
                )));
            }
        }
        if self.min_downstream == 0 {
            return Err(cfg_err("[measure] min_downstream: must be at least 1"));
        }
        if self.timing_reps == 0 {
            return Err(cfg_err("[measure] timing_reps: must be at least 1"));
        }
        if self.select.as_ref().is_some_and(|s| s.is_empty()) {
            return Err(cfg_err(
                "[measure] select: an empty list (omit it for every context)",
            ));
        }
        if self.variants.is_empty() {
            return Err(cfg_err(
                "[measure] variants: empty; name at least one of edit_site, archetype_mean, zero",
            ));
        }
        if let Some(v) = self
            .variants
            .iter()
            .enumerate()
            .find(|(i, v)| self.variants[..*i].contains(v))
        {
            return Err(cfg_err(format!(
                "[measure] variants[{}]: `{}` is named twice",
                v.0,
                v.1.name()
            )));
        }
        if self.archetypes.as_ref().is_some_and(|s| s.is_empty()) {
            return Err(cfg_err(
                "[measure] archetypes: an empty list (omit it for all seven)",
            ));
        }
        Ok(())
    }

    /// The contexts: the corpus (`contexts`), restricted to `select`.
    pub fn corpus(&self) -> Result<(Vec<CodeContext>, String)> {
        let (all, source) = if self.contexts == "builtin" {
            (corpus::builtin(), "builtin".to_string())
        } else {
            let dir = Path::new(&self.contexts);
            if !dir.is_dir() {
                return Err(cfg_err(format!(
                    "[measure] contexts: `{}` is neither \"builtin\" nor a folder",
                    self.contexts
                )));
            }
            let c = corpus::load_dir(dir).map_err(|e| {
                cfg_err(format!(
                    "[measure] contexts: reading {}: {e}",
                    dir.display()
                ))
            })?;
            (c, dir.display().to_string())
        };
        if all.is_empty() {
            return Err(cfg_err(format!(
                "[measure] contexts: the corpus `{source}` holds no code context (files ending .py, .rs, .js, .ts, .c, .h, .go)"
            )));
        }
        let out = match &self.select {
            None => all,
            Some(names) => {
                let mut out = Vec::new();
                for n in names {
                    match all.iter().find(|c| &c.name == n) {
                        Some(c) if !out.iter().any(|o: &CodeContext| &o.name == n) => {
                            out.push(c.clone())
                        }
                        Some(_) => {}
                        None => {
                            return Err(cfg_err(format!(
                                "[measure] select: no context `{n}` in the corpus `{source}` ({} contexts: {})",
                                all.len(),
                                all.iter().map(|c| c.name.as_str()).collect::<Vec<_>>().join(", ")
                            )))
                        }
                    }
                }
                out.sort_by(|a, b| a.name.cmp(&b.name));
                out
            }
        };
        Ok((out, source))
    }

    /// Resolves the spec against a model: the injection layers (each below
    /// its block count), the contexts (each tokenized: longer than an edit
    /// with `min_downstream` downstream tokens needs, no longer than the
    /// model's context), the pairs and the skips. Errors name the field.
    pub fn plan(&self, mcfg: &ModelConfig, tk: &Tokenizer, seed: u64) -> Result<ModeDPlan> {
        self.check()?;
        let layers = self.layers.resolve(mcfg.n_layers, "[measure] layers")?;
        let (contexts, source) = self.corpus()?;
        // An edit needs a changed token and min_downstream tokens after it.
        let need = self.min_downstream + 2;
        for c in &contexts {
            let n = tk.encode(&c.text)?.len();
            if n < need {
                return Err(cfg_err(format!(
                    "[measure] contexts: `{}` has {n} tokens; an edit with [measure] min_downstream = {} downstream tokens needs at least {need}",
                    c.name, self.min_downstream
                )));
            }
            if n > mcfg.context_length {
                return Err(cfg_err(format!(
                    "[measure] contexts: `{}` has {n} tokens, more than the model's context of {}",
                    c.name, mcfg.context_length
                )));
            }
        }
        let edits = build_all(&contexts, tk, seed)?;
        let wanted = |a: Archetype| self.archetypes.as_ref().is_none_or(|v| v.contains(&a));
        let lang = |name: &str| {
            contexts
                .iter()
                .find(|c| c.name == name)
                .map(|c| c.language.name().to_string())
                .unwrap_or_default()
        };
        let mut skips: Vec<SkipRecord> = edits
            .skips
            .iter()
            .filter(|s| wanted(s.archetype))
            .map(|s| SkipRecord {
                context: s.context.clone(),
                language: lang(&s.context),
                archetype: s.archetype.name().into(),
                reason: format!("no site: {}", s.reason),
            })
            .collect();
        let mut pairs = Vec::new();
        for p in edits.pairs {
            if !wanted(p.meta.archetype) {
                continue;
            }
            if p.meta.edited_len > mcfg.context_length {
                return Err(cfg_err(format!(
                    "[measure] contexts: the {} edit of `{}` has {} tokens, more than the model's context of {}",
                    p.meta.archetype, p.meta.context, p.meta.edited_len, mcfg.context_length
                )));
            }
            if p.meta.common_suffix < self.min_downstream {
                skips.push(SkipRecord {
                    context: p.meta.context.clone(),
                    language: p.meta.language.name().into(),
                    archetype: p.meta.archetype.name().into(),
                    reason: format!(
                        "{} downstream (common-suffix) tokens, fewer than [measure] min_downstream = {}",
                        p.meta.common_suffix, self.min_downstream
                    ),
                });
                continue;
            }
            pairs.push(p);
        }
        skips.sort_by(|a, b| (&a.context, &a.archetype).cmp(&(&b.context, &b.archetype)));
        Ok(ModeDPlan {
            layers,
            source,
            contexts,
            pairs,
            skips,
        })
    }
}

/// Where the downstream positions of a pair lie.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairGeometry {
    /// Shared prefix: the first differing position.
    pub shared: usize,
    /// Tokens of the original.
    pub t_base: usize,
    /// Tokens of the edited text.
    pub t_alt: usize,
    /// First downstream position in the original.
    pub d_base: usize,
    /// First downstream position in the edited text.
    pub d_alt: usize,
    /// Downstream positions (the common suffix).
    pub downstream: usize,
}

impl PairGeometry {
    /// The geometry of a code pair.
    pub fn of(p: &CodePair) -> Self {
        let shared = p.pair.shared.len();
        let (t_base, t_alt) = (p.pair.base_len(), p.pair.alt_len());
        let c = p.meta.common_suffix;
        Self {
            shared,
            t_base,
            t_alt,
            d_base: t_base - c,
            d_alt: t_alt - c,
            downstream: c,
        }
    }
}

/// The original and edited passes of one pair.
#[derive(Debug)]
pub struct PairPasses {
    /// Where things are.
    pub geometry: PairGeometry,
    /// The edited context's tokens.
    pub alt_tokens: Vec<u32>,
    /// The original's residual stream, layers `0..=L` (L: the final
    /// residual), `[1, T_b, d]` each.
    pub orig: Vec<Tensor>,
    /// The edited context's, `[1, T_a, d]` each.
    pub edit: Vec<Tensor>,
    /// The original's cache (every position).
    pub orig_cache: KvCache,
    /// The full recompute's logits at the downstream positions `[1, c, V]`.
    pub full_logits: Tensor,
    /// The original's logits at the downstream positions (stale reuse), when asked for.
    pub stale_logits: Option<Tensor>,
}

fn capture_spec(n_layers: usize) -> HookSpec {
    HookSpec::new()
        .capture_all((0..n_layers).map(HookPoint::ResidPre))
        .capture(HookPoint::ResidPost(n_layers - 1))
}

fn residuals(out: &tolerable_runtime::ForwardOutput, n_layers: usize) -> Result<Vec<Tensor>> {
    let mut v = Vec::with_capacity(n_layers + 1);
    for l in 0..n_layers {
        v.push(out.hooks.require(HookPoint::ResidPre(l))?.clone());
    }
    v.push(
        out.hooks
            .require(HookPoint::ResidPost(n_layers - 1))?
            .clone(),
    );
    Ok(v)
}

/// Runs the original and the edited context of `pair` (see the module
/// documentation); the original's logits only when `stale` is set.
pub fn pair_passes(model: &Model, pair: &CodePair, stale: bool) -> Result<PairPasses> {
    let g = PairGeometry::of(pair);
    let n_layers = model.config().n_layers;
    let spec = capture_spec(n_layers);
    let base = pair.pair.base_context();
    let alt = pair.pair.alt_context();
    let mut orig_cache = model.new_cache(1);
    let o = model.forward(
        &model.tokens(&[base])?,
        &mut orig_cache,
        &spec,
        if stale {
            LogitsAt::Positions((g.d_base..g.t_base).collect())
        } else {
            LogitsAt::None
        },
    )?;
    let mut c = model.new_cache(1);
    let e = model.forward(
        &model.tokens(std::slice::from_ref(&alt))?,
        &mut c,
        &spec,
        LogitsAt::Positions((g.d_alt..g.t_alt).collect()),
    )?;
    Ok(PairPasses {
        geometry: g,
        orig: residuals(&o, n_layers)?,
        edit: residuals(&e, n_layers)?,
        alt_tokens: alt,
        orig_cache,
        full_logits: e.logits.expect("asked for logits"),
        stale_logits: o.logits,
    })
}

impl PairPasses {
    /// The edited prefix cache: the original's cache of the shared prefix,
    /// then the edited span `s..D_a` run through every block.
    pub fn edited_prefix(&self, model: &Model) -> Result<KvCache> {
        let g = self.geometry;
        let mut c = self.orig_cache.truncate(g.shared)?;
        self.run_edited(model, g.shared..g.d_alt, &mut c)?;
        Ok(c)
    }

    /// Runs the edited text's tokens `range` through every block on top of
    /// `cache` (nothing when the range is empty).
    pub fn run_edited(
        &self,
        model: &Model,
        range: std::ops::Range<usize>,
        cache: &mut KvCache,
    ) -> Result<()> {
        if !range.is_empty() {
            model.forward(
                &model.tokens(&[self.alt_tokens[range].to_vec()])?,
                cache,
                &HookSpec::new(),
                LogitsAt::None,
            )?;
        }
        Ok(())
    }

    /// The original's states at the downstream positions at layer `l`, `[1, c, d]`.
    pub fn orig_downstream(&self, l: usize) -> Result<Tensor> {
        let g = self.geometry;
        Ok(self.orig[l].narrow(1, g.d_base, g.downstream)?)
    }

    /// The edited context's states at the downstream positions at layer `l`.
    pub fn edit_downstream(&self, l: usize) -> Result<Tensor> {
        let g = self.geometry;
        Ok(self.edit[l].narrow(1, g.d_alt, g.downstream)?)
    }

    /// The true per-position delta at layer `l`, `[1, c, d]`.
    pub fn oracle_delta(&self, l: usize) -> Result<Tensor> {
        Ok((self.edit_downstream(l)? - self.orig_downstream(l)?)?)
    }

    /// The delta observed at the edit site at layer `l`, `[1, 1, d]`: the
    /// edited minus the original state at the first differing position. For
    /// a pure insertion the original's side is its first downstream token,
    /// for a pure deletion the edited side is (Mode D is charged for
    /// computing it through the blocks below `l`).
    pub fn edit_site_delta(&self, l: usize) -> Result<Tensor> {
        let s = self.geometry.shared;
        Ok((self.edit[l].narrow(1, s, 1)? - self.orig[l].narrow(1, s, 1)?)?)
    }

    /// The final-position delta at every layer `0..=L`, `[L + 1, d]`.
    pub fn final_deltas(&self) -> Result<Tensor> {
        let g = self.geometry;
        let rows: Vec<Tensor> = self
            .orig
            .iter()
            .zip(&self.edit)
            .map(|(o, e)| -> Result<Tensor> {
                Ok(
                    (e.narrow(1, g.t_alt - 1, 1)? - o.narrow(1, g.t_base - 1, 1)?)?
                        .flatten_all()?,
                )
            })
            .collect::<Result<_>>()?;
        Ok(Tensor::stack(&rows, 0)?)
    }

    /// The original's cache at the downstream positions (the stale entries
    /// Mode D keeps for the blocks below its injection layer).
    pub fn lower(&self) -> Result<KvCache> {
        let g = self.geometry;
        Ok(self.orig_cache.narrow(g.d_base, g.downstream)?)
    }
}

/// Mode D at injection layer `layer`: `states + delta` (`delta` broadcast
/// over positions) as the input of block `layer` at the downstream
/// positions, run through blocks `layer..L` over `prefix` (which is not
/// changed); `lower` fills the blocks below. Returns the logits asked for.
pub fn mode_d_logits(
    model: &Model,
    layer: usize,
    states: &Tensor,
    delta: &Tensor,
    lower: &KvCache,
    prefix: &KvCache,
    at: LogitsAt,
) -> Result<Option<Tensor>> {
    let resid = states.broadcast_add(delta)?;
    let mut c = prefix.clone();
    let out = model.forward_from_layer(layer, &resid, lower, &mut c, &HookSpec::new(), at)?;
    Ok(out.logits)
}

/// The fastest of `reps` runs of `f`, in seconds.
fn time_min(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t0 = Instant::now();
        f()?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// Row builder for one pair.
struct Rows<'a> {
    run: &'a str,
    model: &'a str,
    context: &'a str,
    language: &'a str,
    archetype: &'a str,
    out: Vec<MeasureRow>,
}

impl Rows<'_> {
    fn push(&mut self, measurement: &str, metric: &str, value: f64, n: usize) -> &mut MeasureRow {
        self.out.push(
            MeasureRow::new(self.run, measurement, self.model, metric, value, n)
                .context(self.context, self.language)
                .archetype(self.archetype),
        );
        self.out.last_mut().expect("just pushed")
    }

    fn comparison(&mut self, layer: usize, variant: &str, c: &Comparison, kl_stale: Option<f64>) {
        for (metric, v) in [
            ("agreement", c.agreement),
            ("kl_mode_d", c.kl_mean),
            ("kl_mode_d_max", c.kl_max),
            ("ties", c.ties as f64),
        ] {
            let r = self.push("mode_d", metric, v, c.n);
            r.layer = Some(layer as i64);
            r.variant = Some(variant.into());
        }
        if let Some(s) = kl_stale {
            let r = self.push(
                "mode_d",
                "kl_reduction",
                s / c.kl_mean.max(f64::MIN_POSITIVE),
                c.n,
            );
            r.layer = Some(layer as i64);
            r.variant = Some(variant.into());
        }
    }
}

/// The oracle's outcome on one pair.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OracleCheck {
    /// Pair id.
    pub pair: String,
    /// Injection layer.
    pub layer: usize,
    /// The comparison with the full recompute.
    pub comparison: Comparison,
    /// Whether it passed.
    pub passed: bool,
}

impl OracleCheck {
    /// The check in words: the pair, the layer and what it measured
    /// against the gate's tolerances (for refusals).
    pub fn describe(&self) -> String {
        let c = &self.comparison;
        format!(
            "{} at layer {}: agreement {:.4} over {} positions ({} ties), mean KL {:.3e} (tolerance {ORACLE_KL_TOLERANCE:e}), largest position KL {:.3e} (tolerance {ORACLE_POSITION_KL_TOLERANCE:e})",
            self.pair, self.layer, c.agreement, c.n, c.ties, c.kl_mean, c.kl_max
        )
    }
}

/// Whether an oracle comparison passes the gate.
pub fn oracle_passes(c: &Comparison) -> bool {
    let agree = (c.agreement * c.n as f64).round() as usize;
    agree + c.ties == c.n
        && c.kl_mean < ORACLE_KL_TOLERANCE
        && c.kl_max < ORACLE_POSITION_KL_TOLERANCE
}

/// The oracle checks that oracle files record, rebuilt from their rows
/// (agreement, mean and largest KL, ties, each with the number of positions
/// compared) and judged by [`oracle_passes`]: a resumed run holds the files
/// of earlier invocations to the same rule. `pairs` are the (context,
/// archetype) pairs the plan runs, named by their [`pair_id`], and
/// `layers` its injection layers: the
/// rows must hold every metric of every pair at every layer exactly once,
/// and nothing else, or the files are refused, named. Rows of other
/// variants than the oracle are not read.
pub fn oracle_checks_from_rows(
    rows: &[MeasureRow],
    pairs: &[(String, Archetype)],
    layers: &[usize],
) -> Result<Vec<OracleCheck>> {
    const METRICS: [&str; 4] = ["agreement", "kl_mode_d", "kl_mode_d_max", "ties"];
    type Key = (String, String, Option<i64>);
    let refused = |what: String| DriverError::Gate(format!("oracle files: {what}"));
    let mut parts: BTreeMap<Key, BTreeMap<String, (f64, i64)>> = BTreeMap::new();
    for r in rows
        .iter()
        .filter(|r| r.variant.as_deref() == Some("oracle"))
    {
        let key = (
            r.context.clone().unwrap_or_default(),
            r.archetype.clone().unwrap_or_default(),
            r.layer,
        );
        let name = || format!("code/{}/{} at layer {:?}", key.0, key.1, key.2);
        if !METRICS.contains(&r.metric.as_str()) {
            return Err(refused(format!(
                "an unknown metric `{}` for {}",
                r.metric,
                name()
            )));
        }
        if parts
            .entry(key.clone())
            .or_default()
            .insert(r.metric.clone(), (r.value, r.n))
            .is_some()
        {
            return Err(refused(format!("two `{}` rows for {}", r.metric, name())));
        }
    }
    let mut checks = Vec::with_capacity(pairs.len() * layers.len());
    for (context, archetype) in pairs {
        for &layer in layers {
            let pair = pair_id(context, *archetype);
            let m = parts
                .remove(&(
                    context.clone(),
                    archetype.name().to_string(),
                    Some(layer as i64),
                ))
                .ok_or_else(|| refused(format!("no oracle rows for {pair} at layer {layer}")))?;
            let get = |metric: &str| {
                m.get(metric).copied().ok_or_else(|| {
                    refused(format!("{pair} lacks its `{metric}` row at layer {layer}"))
                })
            };
            let (agreement, n) = get("agreement")?;
            let comparison = Comparison {
                n: n.max(0) as usize,
                agreement,
                kl_mean: get("kl_mode_d")?.0,
                kl_max: get("kl_mode_d_max")?.0,
                ties: get("ties")?.0.round().max(0.0) as usize,
            };
            checks.push(OracleCheck {
                pair,
                layer,
                passed: oracle_passes(&comparison),
                comparison,
            });
        }
    }
    if let Some(((context, archetype, layer), _)) = parts.into_iter().next() {
        return Err(refused(format!(
            "rows for code/{context}/{archetype} at layer {layer:?}, which this run does not measure"
        )));
    }
    Ok(checks)
}

/// Phase 1 on one pair: the final-position deltas `[L + 1, d]`, and the
/// oracle at every injection layer (rows, and each layer's check).
pub fn oracle_pair(
    model: &Model,
    pair: &CodePair,
    layers: &[usize],
) -> Result<(Tensor, Vec<OracleCheck>)> {
    let p = pair_passes(model, pair, false)?;
    let deltas = p.final_deltas()?;
    let reference = LogitReference::new(&p.full_logits)?;
    let prefix = p.edited_prefix(model)?;
    let lower = p.lower()?;
    let mut checks = Vec::with_capacity(layers.len());
    for &l in layers {
        let logits = mode_d_logits(
            model,
            l,
            &p.orig_downstream(l)?,
            &p.oracle_delta(l)?,
            &lower,
            &prefix,
            LogitsAt::All,
        )?
        .expect("asked for logits");
        let c = reference.compare(&logits, TIE_TOLERANCE)?;
        checks.push(OracleCheck {
            pair: pair.pair.id.clone(),
            layer: l,
            comparison: c,
            passed: oracle_passes(&c),
        });
    }
    Ok((deltas, checks))
}

/// The archetype-mean deltas: per (context, archetype), the final-position
/// deltas `[L + 1, d]` read from phase 1.
pub type DeltaTable = BTreeMap<(String, String), Tensor>;

/// The leave-one-out mean of the archetype's final-position deltas at
/// layer `l` over contexts other than `context`, `[1, 1, d]`, with the
/// number of contexts behind it; `None` when no other context has the archetype.
pub fn loo_mean(
    table: &DeltaTable,
    context: &str,
    archetype: &str,
    l: usize,
) -> Result<Option<(Tensor, usize)>> {
    let others: Vec<Tensor> = table
        .iter()
        .filter(|((c, a), _)| c != context && a == archetype)
        .map(|(_, t)| t.get(l))
        .collect::<std::result::Result<_, _>>()?;
    if others.is_empty() {
        return Ok(None);
    }
    let k = others.len();
    let m = Tensor::stack(&others, 0)?.mean(0)?;
    let d = m.dim(0)?;
    Ok(Some((m.reshape((1, 1, d))?, k)))
}

/// Phase 2 on one pair: every per-pair row but the oracle's.
#[allow(clippy::too_many_arguments)]
pub fn measure_pair(
    model: &Model,
    model_id: &str,
    run: &str,
    pair: &CodePair,
    spec: &ModeDSpec,
    layers: &[usize],
    table: &DeltaTable,
) -> Result<Vec<MeasureRow>> {
    let cfg = model.config();
    let n_layers = cfg.n_layers;
    let d = cfg.d_model;
    let f = FlopModel::of(cfg);
    let arch = pair.meta.archetype.name();
    let mut rows = Rows {
        run,
        model: model_id,
        context: &pair.meta.context,
        language: pair.meta.language.name(),
        archetype: arch,
        out: Vec::new(),
    };
    let p = pair_passes(model, pair, true)?;
    let g = p.geometry;
    let c = g.downstream;
    for (metric, v) in [
        ("tokens_original", g.t_base),
        ("tokens_edited", g.t_alt),
        ("shared_prefix", g.shared),
        ("edit_span_original", g.d_base - g.shared),
        ("edit_span_edited", g.d_alt - g.shared),
        ("downstream", c),
    ] {
        rows.push("geometry", metric, v as f64, 1);
    }
    // Dirtiness and deltas at every layer 0..=L.
    let finals = p.final_deltas()?;
    for l in 0..=n_layers {
        let rel = relative_l2_rows(&p.edit_downstream(l)?, &p.orig_downstream(l)?)?;
        for &tau in &spec.taus {
            let r = rows.push("dirtiness", "dirtiness", fraction_above(&rel, tau), c);
            r.layer = Some(l as i64);
            r.tau = Some(tau);
        }
        let mean = rel.iter().sum::<f64>() / rel.len().max(1) as f64;
        rows.push("dirtiness", "rel_l2_mean", mean, c).layer = Some(l as i64);
        let delta: Vec<f32> = finals.get(l)?.to_vec1()?;
        let h: Vec<f32> = p.orig[l]
            .narrow(1, g.t_base - 1, 1)?
            .flatten_all()?
            .to_vec1()?;
        let norm = delta
            .iter()
            .map(|x| (*x as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        let hn = h.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        rows.push("delta", "delta_norm", norm, 1).layer = Some(l as i64);
        rows.push(
            "delta",
            "delta_rel",
            if hn > 0.0 { norm / hn } else { 0.0 },
            1,
        )
        .layer = Some(l as i64);
    }
    // Stale reuse against the full recompute.
    let reference = LogitReference::new(&p.full_logits)?;
    let stale = reference.compare(
        p.stale_logits.as_ref().expect("asked for stale logits"),
        TIE_TOLERANCE,
    )?;
    for (metric, v) in [
        ("agreement", stale.agreement),
        ("kl_stale", stale.kl_mean),
        ("kl_stale_max", stale.kl_max),
    ] {
        rows.push("stale", metric, v, c).variant = Some("stale".into());
    }
    // Mode D, each variant at each layer.
    let prefix = p.edited_prefix(model)?;
    let lower = p.lower()?;
    let mut overhead: BTreeMap<(usize, &str), (f64, f64)> = BTreeMap::new();
    for &l in layers {
        let states = p.orig_downstream(l)?;
        for v in &spec.variants {
            let variant = v.name();
            let t0 = Instant::now();
            let (delta, flops_delta) = match v {
                // One subtraction, then one addition per downstream position.
                // A pure deletion leaves no edited token to observe: the edit
                // site is then the edited text's first downstream token, which
                // Mode D must compute through the blocks below `l` (charged
                // as such; timed as one token through every block, an upper
                // bound on that work).
                Variant::EditSite => {
                    let mut observe = (d + c * d) as f64;
                    if g.d_alt == g.shared && l > 0 {
                        p.run_edited(model, g.shared..g.shared + 1, &mut prefix.clone())?;
                        observe += f.tokens(g.shared, g.shared + 1, l);
                    }
                    (Some(p.edit_site_delta(l)?), observe)
                }
                Variant::Zero => (None, 0.0),
                // A mean over k contexts, then the additions.
                Variant::ArchetypeMean => match loo_mean(table, &pair.meta.context, arch, l)? {
                    Some((m, k)) => (Some(m), (k * d + c * d) as f64),
                    None => {
                        let r = rows.push("mode_d", "skipped", 1.0, 0);
                        r.layer = Some(l as i64);
                        r.variant = Some(variant.into());
                        r.note = Some(format!(
                            "no other context holds a {arch} pair: no leave-one-out mean"
                        ));
                        continue;
                    }
                },
            };
            let injected = match &delta {
                Some(delta) => states.broadcast_add(delta)?,
                None => states.clone(),
            };
            let secs_delta = t0.elapsed().as_secs_f64();
            overhead.insert((l, variant), (secs_delta, flops_delta));
            let mut cc = prefix.clone();
            let logits = model
                .forward_from_layer(
                    l,
                    &injected,
                    &lower,
                    &mut cc,
                    &HookSpec::new(),
                    LogitsAt::All,
                )?
                .logits
                .expect("asked for logits");
            let cmp = reference.compare(&logits, TIE_TOLERANCE)?;
            rows.comparison(l, variant, &cmp, Some(stale.kl_mean));
        }
    }
    // Compute: analytic FLOPs and timed calls, each strategy producing the
    // updated cache and the logits at the last position.
    let reps = spec.timing_reps;
    let alt = &p.alt_tokens;
    let secs_full = time_min(reps, || {
        let mut c0 = model.new_cache(1);
        model.forward(
            &model.tokens(std::slice::from_ref(alt))?,
            &mut c0,
            &HookSpec::new(),
            LogitsAt::Last,
        )?;
        Ok(())
    })?;
    let secs_prefix = time_min(reps, || {
        let mut c0 = p.orig_cache.truncate(g.shared)?;
        model.forward(
            &model.tokens(&[alt[g.shared..].to_vec()])?,
            &mut c0,
            &HookSpec::new(),
            LogitsAt::Last,
        )?;
        Ok(())
    })?;
    let secs_span = time_min(reps, || {
        p.edited_prefix(model)?;
        Ok(())
    })?;
    let flops_full = f.tokens(0, g.t_alt, n_layers) + f.head(1);
    let flops_prefix = f.tokens(g.shared, g.t_alt, n_layers) + f.head(1);
    for (metric, v) in [
        ("flops_full", flops_full),
        ("flops_prefix_reuse", flops_prefix),
        ("seconds_full", secs_full),
        ("seconds_prefix_reuse", secs_prefix),
        ("seconds_edit_span", secs_span),
        (
            "saving_prefix_reuse_vs_full",
            1.0 - flops_prefix / flops_full,
        ),
        (
            "seconds_saving_prefix_reuse_vs_full",
            1.0 - secs_prefix / secs_full,
        ),
    ] {
        rows.push("compute", metric, v, 1);
    }
    for &l in layers {
        let states = p.orig_downstream(l)?;
        let site = p.edit_site_delta(l)?;
        let secs_upper = time_min(reps, || {
            mode_d_logits(model, l, &states, &site, &lower, &prefix, LogitsAt::Last)?;
            Ok(())
        })?;
        let base_flops = f.tokens(g.shared, g.d_alt, n_layers)
            + f.tokens(g.d_alt, g.t_alt, n_layers - l)
            + f.head(1);
        for v in &spec.variants {
            let variant = v.name();
            let Some(&(secs_delta, flops_delta)) = overhead.get(&(l, variant)) else {
                continue;
            };
            let flops = base_flops + flops_delta;
            let secs = secs_span + secs_delta + secs_upper;
            for (metric, v) in [
                ("flops_mode_d", flops),
                ("seconds_mode_d", secs),
                ("seconds_delta", secs_delta),
                ("saving_vs_prefix_reuse", 1.0 - flops / flops_prefix),
                ("saving_vs_full", 1.0 - flops / flops_full),
                ("seconds_saving_vs_prefix_reuse", 1.0 - secs / secs_prefix),
                ("seconds_saving_vs_full", 1.0 - secs / secs_full),
            ] {
                let r = rows.push("compute", metric, v, 1);
                r.layer = Some(l as i64);
                r.variant = Some(variant.into());
            }
        }
    }
    Ok(rows.out)
}

/// Skip rows of a context.
fn skip_rows(run: &str, model: &str, skips: &[&SkipRecord]) -> Vec<MeasureRow> {
    skips
        .iter()
        .map(|s| {
            MeasureRow::new(run, "skip", model, "skipped", 1.0, 0)
                .context(&s.context, &s.language)
                .archetype(&s.archetype)
                .note(s.reason.clone())
        })
        .collect()
}

/// Reads the phase-1 delta files of the contexts that have pairs.
fn read_deltas(rd: &RunDir, plan: &ModeDPlan) -> Result<DeltaTable> {
    let mut table = DeltaTable::new();
    for ctx in &plan.contexts {
        let archetypes: Vec<&str> = plan
            .pairs_of(&ctx.name)
            .map(|p| p.meta.archetype.name())
            .collect();
        if !archetypes.is_empty() {
            read_context_deltas(
                &rd.unit("deltas", &ctx.name, "safetensors"),
                &ctx.name,
                &archetypes,
                &mut table,
            )?;
        }
    }
    Ok(table)
}

/// Adds one context's phase-1 deltas (its file at `path`) of the given
/// archetypes to `table`; a missing archetype is an error naming the file.
fn read_context_deltas(
    path: &Path,
    context: &str,
    archetypes: &[&str],
    table: &mut DeltaTable,
) -> Result<()> {
    let map = candle_core::safetensors::load(path, &candle_core::Device::Cpu)
        .map_err(|e| DriverError::Records(format!("reading {}: {e}", path.display())))?;
    for &a in archetypes {
        let t = map.get(a).ok_or_else(|| {
            DriverError::Records(format!("{} holds no delta for {a}", path.display()))
        })?;
        table.insert((context.to_string(), a.to_string()), t.clone());
    }
    Ok(())
}

/// Records a refused oracle gate in `run.json` (status "failed", the
/// outcome over `rows`, and what failed) and returns the error to stop
/// the run with; nothing else is written.
fn refuse_oracle(
    rd: &RunDir,
    meta: &mut serde_json::Value,
    rows: &[MeasureRow],
    plan: &ModeDPlan,
    failure: serde_json::Value,
    message: String,
) -> DriverError {
    let mut o = oracle_outcome(rows, plan.pairs.len(), &plan.layers, "failed");
    o["failure"] = failure;
    meta["oracle"] = o;
    match rd.write_meta(meta) {
        Ok(()) => DriverError::Gate(message),
        Err(e) => e,
    }
}

/// The oracle gate's outcome over every oracle file present, as `run.json` holds it.
fn oracle_outcome(
    rows: &[MeasureRow],
    pairs: usize,
    layers: &[usize],
    status: &str,
) -> serde_json::Value {
    fn get<'a>(
        rows: &'a [MeasureRow],
        metric: &'a str,
    ) -> impl Iterator<Item = &'a MeasureRow> + 'a {
        rows.iter().filter(move |r| r.metric == metric)
    }
    let worst_kl = get(rows, "kl_mode_d").map(|r| r.value).fold(0f64, f64::max);
    let worst_kl_max = get(rows, "kl_mode_d_max")
        .map(|r| r.value)
        .fold(0f64, f64::max);
    let min_agree = get(rows, "agreement").map(|r| r.value).fold(1f64, f64::min);
    let ties: f64 = get(rows, "ties").map(|r| r.value).sum();
    serde_json::json!({
        "status": status,
        "criterion": format!(
            "at every injection layer of every pair: every top-1 prediction of the oracle (the true per-position delta) equals the full recompute's, except ties (the two tokens' logits within {TIE_TOLERANCE} in the full recompute), the mean KL(full || oracle) < {ORACLE_KL_TOLERANCE:e} nats, and the KL at every downstream position < {ORACLE_POSITION_KL_TOLERANCE:e} nats"
        ),
        "kl_tolerance": ORACLE_KL_TOLERANCE,
        "position_kl_tolerance": ORACLE_POSITION_KL_TOLERANCE,
        "tie_tolerance_logits": TIE_TOLERANCE,
        "pairs_checked": rows.iter().filter_map(|r| r.context.clone().zip(r.archetype.clone())).collect::<BTreeSet<_>>().len(),
        "pairs": pairs,
        "layers": layers,
        "worst_mean_kl": worst_kl,
        "worst_position_kl": worst_kl_max,
        "min_agreement": min_agree,
        "ties": ties,
    })
}

/// What `cargo xtask measure --dry-run` prints for a Mode D config.
pub fn dry_run(cfg: &MeasureConfig, spec: &ModeDSpec, opts: &MeasureOptions) -> Result<String> {
    let (mcfg, tk, path) = crate::sweep::header(&cfg.run.model)?;
    let plan = spec.plan(&mcfg, &tk, cfg.run.seed)?;
    let f = FlopModel::of(&mcfg);
    let mut out = format!(
        "measurement `{}` (mode_d, config hash {}), model {} ({} layers, width {}, {}), out {}\n",
        cfg.run.name,
        cfg.hash(),
        cfg.run.model,
        mcfg.n_layers,
        mcfg.d_model,
        path.display(),
        super::out_dir(cfg, opts).display()
    );
    out.push_str(&format!(
        "{} contexts from {}, {} pairs, {} skipped; injection layers {:?}; taus {:?}\n",
        plan.contexts.len(),
        plan.source,
        plan.pairs.len(),
        plan.skips.len(),
        plan.layers,
        spec.taus
    ));
    for a in Archetype::ALL {
        let n = plan.pairs.iter().filter(|p| p.meta.archetype == a).count();
        let s = plan
            .skips
            .iter()
            .filter(|s| s.archetype == a.name())
            .count();
        if n + s > 0 {
            out.push_str(&format!("  {:<20} {n} pairs, {s} skipped\n", a.name()));
        }
    }
    for s in &plan.skips {
        out.push_str(&format!(
            "  skip {} / {}: {}\n",
            s.context, s.archetype, s.reason
        ));
    }
    // Work: the passes twice (phase 1 and 2), the edited span, the Mode D
    // calls (the oracle and each variant) per layer with logits at every
    // downstream position, the timed calls.
    let mut flops = 0f64;
    for p in &plan.pairs {
        let g = PairGeometry::of(p);
        let passes = f.tokens(0, g.t_base, mcfg.n_layers) + f.tokens(0, g.t_alt, mcfg.n_layers);
        let span = f.tokens(g.shared, g.d_alt, mcfg.n_layers);
        flops += 2.0 * (passes + span) + 3.0 * f.head(g.downstream);
        let calls = 1.0 + spec.variants.len() as f64; // the oracle, then each variant
        for &l in &plan.layers {
            let upper = f.tokens(g.d_alt, g.t_alt, mcfg.n_layers - l);
            flops += calls * (upper + f.head(g.downstream)) + upper;
        }
        flops += (f.tokens(0, g.t_alt, mcfg.n_layers)
            + f.tokens(g.shared, g.t_alt, mcfg.n_layers)
            + span)
            * spec.timing_reps as f64;
    }
    // About 8e10 FLOP/s: the 0.5B's fitted ~107 prefill tokens/s on this
    // 2-core machine (crate::sweep::PREFILL_TOKENS_PER_S_05B) at 0.73 GFLOP
    // a token (FlopModel's 218.9 GFLOP for a 300-token prefill of the 0.5B).
    let rate = crate::sweep::PREFILL_TOKENS_PER_S_05B * 0.73e9;
    out.push_str(&format!(
        "estimate: {:.1} TFLOP, about {:.0} min at ~{:.0} GFLOP/s (a rough figure for this 2-core machine)\n",
        flops / 1e12,
        flops / rate / 60.0,
        rate / 1e9
    ));
    Ok(out)
}

/// Runs (or resumes) a Mode D measurement.
pub fn run(
    config_path: &Path,
    cfg: &MeasureConfig,
    spec: &ModeDSpec,
    opts: &MeasureOptions,
) -> Result<MeasureOutcome> {
    let dir = super::out_dir(cfg, opts);
    let hash = cfg.hash();
    let rd = RunDir::open(&dir, &hash, &["deltas", "oracle", "pairs", "units"])?;
    let precision: Precision = cfg
        .run
        .precision
        .parse()
        .map_err(|e| cfg_err(format!("[run] precision: {e}")))?;
    // Every field is checked, and every pair built, before the model loads.
    let (mcfg, tk, _) = crate::sweep::header(&cfg.run.model)?;
    let plan = spec.plan(&mcfg, &tk, cfg.run.seed)?;
    let rows_per_pair = 40 + plan.layers.len() * 40 + (mcfg.n_layers + 1) * (spec.taus.len() + 3);
    let need = (plan.pairs.len() * rows_per_pair * 128) as u64
        + (plan.pairs.len() * (mcfg.n_layers + 1) * mcfg.d_model * 4) as u64
        + 16 * 1024 * 1024;
    crate::sweep::check_writable_in(&dir, "units", need)?;
    // Gates first: nothing is written if one fails.
    let (ck, gates) = super::load_gated(cfg, precision)?;
    let model = &ck.model;
    let run_name = cfg.run.name.as_str();
    let mut invocations = rd.invocations();
    invocations.push(invocation(
        &tolerable_runtime::matmul_backend(false),
        serde_json::json!({ "contexts": opts.contexts, "layers": opts.layers }),
    ));
    let pairs_meta: Vec<serde_json::Value> = plan
        .pairs
        .iter()
        .map(|p| {
            let g = PairGeometry::of(p);
            serde_json::json!({
                "id": p.pair.id,
                "context": p.meta.context,
                "language": p.meta.language.name(),
                "archetype": p.meta.archetype.name(),
                "description": p.meta.description,
                "line": p.meta.line,
                "before": p.meta.before,
                "after": p.meta.after,
                "geometry": g,
            })
        })
        .collect();
    let previous_oracle = super::read_json(&rd.meta_path())
        .ok()
        .map(|v| v["oracle"].clone())
        .filter(|v| !v.is_null());
    let mut meta = super::run_meta(cfg, config_path, &ck, &gates, invocations);
    super::extend_meta(
        &mut meta,
        serde_json::json!({
            "seeds": { "edits": cfg.run.seed },
            "corpus": {
                "source": plan.source,
                "contexts": plan.contexts.iter().map(|c| c.name.clone()).collect::<Vec<_>>(),
                "pairs": plan.pairs.len(),
            },
            "injection_layers": plan.layers,
            "pairs": pairs_meta,
            "skipped": plan.skips,
            "oracle": previous_oracle.unwrap_or_else(|| serde_json::json!({ "status": "pending" })),
            "flops": "see tolerable_driver::measure::FlopModel: per token at position p and block, 2·d·(n_h + 2·n_kv)·h_d + 2·n_h·h_d·d + 6·d·d_ffn + 4·n_h·h_d·(p + 1); the head 2·d·V per logit position (the last one)",
        }),
    );
    rd.write_meta(&meta)?;
    let headless = !std::io::stderr().is_terminal();
    let mut computed: BTreeSet<String> = BTreeSet::new();

    // Phase 1: final-position deltas and the oracle gate, every pair.
    let with_pairs: Vec<&CodeContext> = plan
        .contexts
        .iter()
        .filter(|c| plan.pairs_of(&c.name).next().is_some())
        .collect();
    let todo1: Vec<&CodeContext> = with_pairs
        .iter()
        .copied()
        .filter(|c| {
            !(rd.unit("oracle", &c.name, "parquet").exists()
                && rd.unit("deltas", &c.name, "safetensors").exists())
        })
        .collect();
    let n1: usize = todo1.iter().map(|c| plan.pairs_of(&c.name).count()).sum();
    let bar = super::progress(n1, format!("mode D oracle {run_name}"), "pairs");
    for ctx in &todo1 {
        bar.set_message(ctx.name.clone());
        let mut deltas = BTreeMap::new();
        if rd.unit("oracle", &ctx.name, "parquet").exists() {
            // The oracle file of an earlier invocation stands (it is checked
            // again below, by the same rule); only its deltas are missing
            // (they are not committed: a new machine has lost them), and
            // they are the same two passes phase 1 takes, without the oracle.
            for p in plan.pairs_of(&ctx.name) {
                deltas.insert(
                    p.meta.archetype.name().to_string(),
                    pair_passes(model, p, false)?.final_deltas()?,
                );
                bar.inc(1);
            }
            write_tensors_atomic(&deltas, &rd.unit("deltas", &ctx.name, "safetensors"))?;
            if headless {
                tracing::info!(
                    "deltas of {} recomputed ({} pairs; its oracle file kept)",
                    ctx.name,
                    deltas.len()
                );
            }
            continue;
        }
        let mut rows = Vec::new();
        for p in plan.pairs_of(&ctx.name) {
            let (d, checks) = oracle_pair(model, p, &plan.layers)?;
            deltas.insert(p.meta.archetype.name().to_string(), d);
            let mut pr = Rows {
                run: run_name,
                model: &cfg.run.model,
                context: &p.meta.context,
                language: p.meta.language.name(),
                archetype: p.meta.archetype.name(),
                out: Vec::new(),
            };
            for ch in &checks {
                pr.comparison(ch.layer, "oracle", &ch.comparison, None);
            }
            rows.extend(pr.out);
            if let Some(bad) = checks.iter().find(|c| !c.passed) {
                bar.finish_and_clear();
                return Err(refuse_oracle(
                    &rd,
                    &mut meta,
                    &rows,
                    &plan,
                    serde_json::to_value(bad).unwrap_or_default(),
                    format!(
                        "the Mode D oracle (the true per-position delta) does not reproduce the full recompute on {}; no approximate delta was measured",
                        bad.describe()
                    ),
                ));
            }
            bar.inc(1);
        }
        write_tensors_atomic(&deltas, &rd.unit("deltas", &ctx.name, "safetensors"))?;
        write_rows(rows, &rd.unit("oracle", &ctx.name, "parquet"))?;
        computed.insert(ctx.name.clone());
        if headless {
            tracing::info!("oracle of {} passed ({} pairs)", ctx.name, deltas.len());
        }
    }
    bar.finish_and_clear();
    let mut oracle_rows = Vec::new();
    for ctx in &with_pairs {
        oracle_rows.extend(read_rows(&rd.unit("oracle", &ctx.name, "parquet"))?);
    }
    // Files of an earlier invocation are checked again, by the same rule;
    // a refusal is recorded in run.json like a failure in phase 1.
    let expected: Vec<(String, Archetype)> = plan
        .pairs
        .iter()
        .map(|p| (p.meta.context.clone(), p.meta.archetype))
        .collect();
    let failure = match oracle_checks_from_rows(&oracle_rows, &expected, &plan.layers) {
        Err(DriverError::Gate(m)) => Some((serde_json::json!(m), m)),
        Err(other) => return Err(other),
        Ok(checks) => checks.into_iter().find(|c| !c.passed).map(|bad| {
            (
                serde_json::to_value(&bad).unwrap_or_default(),
                format!("oracle file of {} fails the gate", bad.describe()),
            )
        }),
    };
    if let Some((detail, message)) = failure {
        return Err(refuse_oracle(
            &rd,
            &mut meta,
            &oracle_rows,
            &plan,
            detail,
            message,
        ));
    }
    meta["oracle"] = oracle_outcome(&oracle_rows, plan.pairs.len(), &plan.layers, "passed");
    rd.write_meta(&meta)?;
    tracing::info!(
        "oracle gate passed on {} pairs x {} layers (worst mean KL {:.2e})",
        plan.pairs.len(),
        plan.layers.len(),
        meta["oracle"]["worst_mean_kl"].as_f64().unwrap_or(0.0)
    );

    // Phase 2: every other measurement, one unit per context, the languages
    // in turn (a run stopped early has measured some of each).
    let table = read_deltas(&rd, &plan)?;
    let todo2: Vec<&CodeContext> = languages_in_turn(&plan.contexts)
        .into_iter()
        .filter(|c| !rd.unit("units", &c.name, "parquet").exists())
        .collect();
    let skipped_units = plan.contexts.len() - todo2.len();
    if skipped_units > 0 {
        tracing::info!(
            "resuming: {skipped_units} of {} units already finished in {}",
            plan.contexts.len(),
            dir.display()
        );
    }
    // A pair measured before a stop is kept in `pairs/` until its context's
    // unit is written, and read back instead of measured again.
    let pair_file = |p: &CodePair| rd.unit("pairs", &pair_file_name(p), "parquet");
    let n2: usize = todo2
        .iter()
        .flat_map(|c| plan.pairs_of(&c.name))
        .filter(|p| !pair_file(p).exists())
        .count();
    let kept = todo2
        .iter()
        .map(|c| plan.pairs_of(&c.name).count())
        .sum::<usize>()
        - n2;
    if kept > 0 {
        tracing::info!("resuming: {kept} pairs of unfinished contexts already measured");
    }
    let bar = super::progress(n2, format!("mode D {run_name}"), "pairs");
    let t_run = Instant::now();
    let mut done = 0usize;
    for ctx in &todo2 {
        bar.set_message(ctx.name.clone());
        let skips: Vec<&SkipRecord> = plan
            .skips
            .iter()
            .filter(|s| s.context == ctx.name)
            .collect();
        let mut rows = skip_rows(run_name, &cfg.run.model, &skips);
        let mut parts = Vec::new();
        for p in plan.pairs_of(&ctx.name) {
            let part = pair_file(p);
            if part.exists() {
                rows.extend(read_rows(&part)?);
            } else {
                let pair_rows = measure_pair(
                    model,
                    &cfg.run.model,
                    run_name,
                    p,
                    spec,
                    &plan.layers,
                    &table,
                )?;
                write_rows(pair_rows.clone(), &part)?;
                rows.extend(pair_rows);
                bar.inc(1);
                done += 1;
            }
            parts.push(part);
        }
        write_rows(rows, &rd.unit("units", &ctx.name, "parquet"))?;
        for part in parts {
            if let Err(e) = std::fs::remove_file(&part) {
                tracing::warn!(
                    "could not remove {} ({e}); its context's unit is written",
                    part.display()
                );
            }
        }
        computed.insert(ctx.name.clone());
        if headless {
            let rate = done as f64 / t_run.elapsed().as_secs_f64().max(1e-9);
            tracing::info!(
                "unit {} written: {done}/{n2} pairs this invocation, {:.3} pairs/s, eta {:.0} s",
                ctx.name,
                rate,
                (n2 - done) as f64 / rate.max(1e-9)
            );
        }
    }
    bar.finish_and_clear();
    let mut out = MeasureOutcome {
        dir: dir.clone(),
        units: plan.contexts.len(),
        computed: computed.len(),
        skipped: skipped_units,
        summary_written: false,
    };
    let mut all = oracle_rows;
    for ctx in &plan.contexts {
        all.extend(read_rows(&rd.unit("units", &ctx.name, "parquet"))?);
    }
    let mut summary = summarize(run_name, &cfg.run.model, &all);
    summary.extend(delta_cosines(
        run_name,
        &cfg.run.model,
        &table,
        mcfg.n_layers,
    )?);
    write_rows(summary, &dir.join("summary.parquet"))?;
    out.summary_written = true;
    Ok(out)
}

/// The name of a phase-2 pair's own file under `pairs/` (`<context>.<archetype>`):
/// the rows of a pair measured in a context whose unit is not yet written.
pub fn pair_file_name(p: &CodePair) -> String {
    format!("{}.{}", p.meta.context, p.meta.archetype.name())
}

/// The contexts in phase 2's order: one of each language in turn (the
/// languages in the order they first appear, each language's contexts in
/// corpus order), so that the units a stopped run has written cover every
/// language about equally. Every context appears once.
pub fn languages_in_turn(contexts: &[CodeContext]) -> Vec<&CodeContext> {
    let mut groups: Vec<(tolerable_probe::code::Language, Vec<&CodeContext>)> = Vec::new();
    for c in contexts {
        match groups.iter_mut().find(|(l, _)| *l == c.language) {
            Some((_, g)) => g.push(c),
            None => groups.push((c.language, vec![c])),
        }
    }
    let longest = groups.iter().map(|(_, g)| g.len()).max().unwrap_or(0);
    (0..longest)
        .flat_map(|i| groups.iter().filter_map(move |(_, g)| g.get(i).copied()))
        .collect()
}

/// Aggregates per-pair rows: per (measurement, layer, tau, variant, metric)
/// the mean over pairs, per archetype and over all archetypes (archetype
/// null), with `n` the pairs behind it; `skipped` rows are counted;
/// `kl_reduction` is the ratio of the mean stale KL to the mean Mode D KL
/// over the same pairs.
pub fn summarize(run: &str, model: &str, rows: &[MeasureRow]) -> Vec<MeasureRow> {
    type Key = (
        String,
        Option<String>,
        Option<i64>,
        Option<u64>,
        Option<String>,
        String,
    );
    let mut groups: BTreeMap<Key, Vec<&MeasureRow>> = BTreeMap::new();
    for r in rows.iter().filter(|r| r.context.is_some()) {
        for arch in [r.archetype.clone(), None] {
            groups
                .entry((
                    r.measurement.clone(),
                    arch,
                    r.layer,
                    r.tau.map(f64::to_bits),
                    r.variant.clone(),
                    r.metric.clone(),
                ))
                .or_default()
                .push(r);
        }
    }
    let stale: BTreeMap<(Option<String>, Option<String>), f64> = rows
        .iter()
        .filter(|r| r.metric == "kl_stale" && r.context.is_some())
        .map(|r| ((r.context.clone(), r.archetype.clone()), r.value))
        .collect();
    let mut out = Vec::new();
    for ((measurement, arch, layer, tau, variant, metric), members) in &groups {
        let n = members.len();
        let value = match metric.as_str() {
            "skipped" => n as f64,
            "kl_reduction" => {
                // Ratio of means over the pairs with a Mode D KL here.
                let key = (
                    measurement.clone(),
                    arch.clone(),
                    *layer,
                    *tau,
                    variant.clone(),
                    "kl_mode_d".to_string(),
                );
                let md = groups.get(&key).map(|v| v.as_slice()).unwrap_or(&[]);
                let s: Vec<f64> = md
                    .iter()
                    .filter_map(|r| {
                        stale
                            .get(&(r.context.clone(), r.archetype.clone()))
                            .copied()
                    })
                    .collect();
                let mean_md = md.iter().map(|r| r.value).sum::<f64>() / md.len().max(1) as f64;
                let mean_s = s.iter().sum::<f64>() / s.len().max(1) as f64;
                mean_s / mean_md.max(f64::MIN_POSITIVE)
            }
            _ => members.iter().map(|r| r.value).sum::<f64>() / n as f64,
        };
        let mut r = MeasureRow::new(run, measurement, model, metric, value, n);
        r.archetype = arch.clone();
        r.layer = *layer;
        r.tau = tau.map(f64::from_bits);
        r.variant = variant.clone();
        out.push(r);
    }
    out
}

/// The cross-context cosines of final-position deltas: per archetype and
/// layer the mean over pairs of different contexts (`delta_cosine`), the
/// same pooled over archetypes (archetype null), and between different
/// archetypes in different contexts (`delta_cosine_cross_archetype`).
pub fn delta_cosines(
    run: &str,
    model: &str,
    table: &DeltaTable,
    n_layers: usize,
) -> Result<Vec<MeasureRow>> {
    // ((context, archetype), per-layer delta rows)
    type Entry<'a> = (&'a (String, String), Vec<Vec<f32>>);
    let entries: Vec<Entry> = table
        .iter()
        .map(|(k, t)| Ok((k, t.to_vec2::<f32>()?)))
        .collect::<Result<_>>()?;
    let mut out = Vec::new();
    for l in 0..=n_layers {
        let mut same: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
        let mut cross = Vec::new();
        for i in 0..entries.len() {
            for j in i + 1..entries.len() {
                let ((ci, ai), vi) = (entries[i].0, &entries[i].1);
                let ((cj, aj), vj) = (entries[j].0, &entries[j].1);
                if ci == cj {
                    continue;
                }
                let c = tolerable_stats::cosine(&vi[l], &vj[l])?;
                if ai == aj {
                    same.entry(ai.as_str()).or_default().push(c);
                } else {
                    cross.push(c);
                }
            }
        }
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let pooled: Vec<f64> = same.values().flatten().copied().collect();
        for (a, v) in &same {
            out.push(
                MeasureRow::new(run, "delta", model, "delta_cosine", mean(v), v.len())
                    .archetype(a)
                    .layer(l),
            );
        }
        if !pooled.is_empty() {
            out.push(
                MeasureRow::new(
                    run,
                    "delta",
                    model,
                    "delta_cosine",
                    mean(&pooled),
                    pooled.len(),
                )
                .layer(l),
            );
        }
        if !cross.is_empty() {
            out.push(
                MeasureRow::new(
                    run,
                    "delta",
                    model,
                    "delta_cosine_cross_archetype",
                    mean(&cross),
                    cross.len(),
                )
                .layer(l),
            );
        }
    }
    Ok(out)
}

/// Rows of a finished run (`summary.parquet`).
pub fn read_summary(dir: &Path) -> Result<Vec<MeasureRow>> {
    read_rows(&dir.join("summary.parquet"))
}

/// How much of a Mode D run an interim summary covers: what phase 1 and
/// phase 2 have written when it was read.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Coverage {
    /// The corpus's contexts.
    pub contexts: usize,
    /// Contexts with at least one edit pair.
    pub contexts_with_pairs: usize,
    /// Contexts whose phase-1 oracle file and deltas are both written.
    pub oracle_contexts: usize,
    /// Contexts whose phase-2 unit is written.
    pub unit_contexts: usize,
    /// Edit pairs of the plan.
    pub pairs: usize,
    /// Edit pairs inside the written phase-2 units.
    pub measured_pairs: usize,
    /// The oracle gate judged over the written oracle files by the run's
    /// rule, in `run.json`'s shape (status "passed so far" or "failed").
    pub oracle: serde_json::Value,
}

impl Coverage {
    /// Whether every unit of both phases is written (the interim summary is
    /// then the run's own summary).
    pub fn complete(&self) -> bool {
        self.oracle_contexts == self.contexts_with_pairs && self.unit_contexts == self.contexts
    }
}

/// The summary of a Mode D run folder over what it holds so far, for a look
/// at a run in progress: the same aggregation the finished run writes to
/// `summary.parquet` ([`summarize`] over the oracle rows and the phase-2
/// units, then [`delta_cosines`]), over the contexts whose files are
/// written. On a finished run it equals `summary.parquet`; on an
/// unfinished one its means are over the finished contexts only (phase 2
/// takes the languages in turn, [`languages_in_turn`]), not a random
/// sample of the corpus.
pub fn interim_summary(dir: &Path) -> Result<(Vec<MeasureRow>, Coverage)> {
    let meta = super::read_json(&dir.join("run.json"))?;
    if meta["measurement"] != "mode_d" {
        return Err(DriverError::Records(format!(
            "{} is not a Mode D run (measurement {})",
            dir.display(),
            meta["measurement"]
        )));
    }
    let missing =
        |what: &str| DriverError::Records(format!("{}/run.json lacks {what}", dir.display()));
    let run = meta["name"].as_str().ok_or_else(|| missing("name"))?;
    let model = meta["model"]["id"]
        .as_str()
        .ok_or_else(|| missing("model.id"))?;
    let n_layers = meta["model"]["config"]["n_layers"]
        .as_u64()
        .ok_or_else(|| missing("model.config.n_layers"))? as usize;
    let contexts: Vec<&str> = meta["corpus"]["contexts"]
        .as_array()
        .ok_or_else(|| missing("corpus.contexts"))?
        .iter()
        .filter_map(|c| c.as_str())
        .collect();
    let mut pairs: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for p in meta["pairs"].as_array().ok_or_else(|| missing("pairs"))? {
        let (Some(c), Some(a)) = (p["context"].as_str(), p["archetype"].as_str()) else {
            return Err(missing("a pair's context and archetype"));
        };
        pairs.entry(c).or_default().push(a);
    }
    let mut cov = Coverage {
        contexts: contexts.len(),
        contexts_with_pairs: pairs.len(),
        oracle_contexts: 0,
        unit_contexts: 0,
        pairs: pairs.values().map(Vec::len).sum(),
        measured_pairs: 0,
        oracle: serde_json::Value::Null,
    };
    let layers: Vec<usize> = meta["injection_layers"]
        .as_array()
        .ok_or_else(|| missing("injection_layers"))?
        .iter()
        .filter_map(|l| l.as_u64().map(|l| l as usize))
        .collect();
    let mut judged: Vec<(String, Archetype)> = Vec::new();
    // The finished run's order: oracle rows of the contexts with pairs,
    // then every context's unit, both in corpus order.
    let mut all = Vec::new();
    let mut table = DeltaTable::new();
    for &ctx in &contexts {
        let Some(archetypes) = pairs.get(ctx) else {
            continue;
        };
        let (oracle, deltas) = (
            super::unit_path(dir, "oracle", ctx, "parquet"),
            super::unit_path(dir, "deltas", ctx, "safetensors"),
        );
        if !(oracle.exists() && deltas.exists()) {
            continue;
        }
        all.extend(read_rows(&oracle)?);
        for &a in archetypes {
            let a = Archetype::from_name(a)
                .ok_or_else(|| missing(&format!("a known archetype (not `{a}`)")))?;
            judged.push((ctx.to_string(), a));
        }
        read_context_deltas(&deltas, ctx, archetypes, &mut table)?;
        cov.oracle_contexts += 1;
    }
    let status = match oracle_checks_from_rows(&all, &judged, &layers) {
        Ok(checks) if checks.iter().all(|c| c.passed) => "passed so far",
        _ => "failed",
    };
    cov.oracle = oracle_outcome(&all, cov.pairs, &layers, status);
    for &ctx in &contexts {
        let unit = super::unit_path(dir, "units", ctx, "parquet");
        if unit.exists() {
            all.extend(read_rows(&unit)?);
            cov.unit_contexts += 1;
            cov.measured_pairs += pairs.get(ctx).map_or(0, Vec::len);
        }
    }
    let mut summary = summarize(run, model, &all);
    summary.extend(delta_cosines(run, model, &table, n_layers)?);
    Ok((summary, cov))
}
