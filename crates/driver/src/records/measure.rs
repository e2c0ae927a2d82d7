//! Rows of measurement runs (`[measure]` configs, [`crate::measure`]): one
//! long-format table, one row per (measurement, pair or aggregate, layer,
//! tau, variant, metric). Unit files (`units/<context>.parquet`,
//! `oracle/<context>.parquet`) hold per-pair rows; `summary.parquet` holds
//! the aggregates (means over pairs, cross-context cosines, skip counts).
//!
//! Metric names, by `measurement` (layers `0..L-1` are
//! `blocks.{l}.hook_resid_pre`; layer `L` is the final residual stream,
//! `blocks.{L-1}.hook_resid_post`):
//!
//! - `geometry` (per pair): `tokens_original`, `tokens_edited`,
//!   `shared_prefix` (tokens before the first differing one),
//!   `edit_span_original`, `edit_span_edited` (tokens between the shared
//!   prefix and the common suffix), `downstream` (the common suffix: the
//!   positions Mode D serves).
//! - `dirtiness` (per pair, layer, tau): `dirtiness`, the fraction of
//!   downstream positions whose state moved by more than tau in relative L2;
//!   with tau null: `rel_l2_mean`, the mean relative L2 over them.
//! - `delta` (per pair, layer): `delta_norm` and `delta_rel` (|d| / |h_orig|)
//!   of the final-position delta (edited minus original, last position). In
//!   the summary: `delta_cosine` (per archetype and layer: mean cosine
//!   between the final-position deltas of different contexts; archetype null:
//!   pooled over archetypes) and `delta_cosine_cross_archetype` (different
//!   archetypes in different contexts, a control).
//! - `mode_d` (per pair, injection layer, variant `oracle`, `edit_site`,
//!   `archetype_mean` or `zero`): `agreement` (top-1 agreement with the full recompute
//!   over downstream positions), `kl_mode_d` (mean KL(full || Mode D), nats),
//!   `kl_mode_d_max`, `ties` (disagreements whose two tokens are within the
//!   tie tolerance in the full recompute's logits), `kl_reduction`
//!   (`kl_stale / kl_mode_d`; the summary's is the ratio of the means);
//!   `skipped` with a `note` where a variant has no delta (no other context
//!   holds a pair of the archetype).
//! - `stale` (per pair, variant `stale`): `agreement`, `kl_stale`,
//!   `kl_stale_max` of stale reuse (the original pass's logits at the same
//!   downstream positions).
//! - `compute` (per pair): `flops_full`, `flops_prefix_reuse`,
//!   `seconds_full`, `seconds_prefix_reuse`, `seconds_edit_span`,
//!   `saving_prefix_reuse_vs_full`, `seconds_saving_prefix_reuse_vs_full`;
//!   per injection layer and variant: `flops_mode_d`, `seconds_mode_d`,
//!   `seconds_delta` (extracting and injecting the delta alone),
//!   `saving_vs_prefix_reuse`, `saving_vs_full` (1 - Mode D's FLOPs over
//!   the strategy's), `seconds_saving_vs_prefix_reuse`,
//!   `seconds_saving_vs_full` (the same from measured wall time).
//! - `skip` (per context and archetype): `skipped` (value 1, the reason in
//!   `note`); in the summary the count.
//!
//! Conditioning and quantization runs ([`crate::measure::attention`]; `context`
//! is the probe's item id, null in the summary):
//!
//! - `conditioning` (per probe, layer, variant `on_manifold` /
//!   `off_manifold`, magnitude): `gain_logit`, `gain_softmax` (absolute
//!   readout gains), `gain_logit_rel`, `gain_softmax_rel` (relative); per
//!   probe and layer: `bound_softmax` (the analytic sqrt(2G) bound),
//!   `slot_weight` (the displaced slot's attention weight). Summary: means
//!   per layer and pooled (layer null), per magnitude and pooled (magnitude
//!   null), variant `off_over_on` ratios, `bound_correlation` (Pearson across
//!   layers, at the smallest magnitude) and `gain_over_bound_max`.
//! - `quantization` (per probe and layer, variant `int<b>` or
//!   `noise_int<b>`, magnitude null or a fixed norm): `output_error`,
//!   `query_share`, `displacement`; per probe and layer: `query_rank`,
//!   `query_share_isotropic`. Summary: means, and `int<b>_over_noise` ratios.

use crate::record;

record! {
    /// One measurement value, long format.
    #[derive(Debug, Clone, PartialEq)]
    pub struct MeasureRow {
        /// Run name.
        pub run: String,
        /// The measurement family: `geometry`, `dirtiness`, `delta`, `mode_d`, `stale`, `compute`, `skip` (Mode D); `conditioning`; `quantization`.
        pub measurement: String,
        /// The model id.
        pub model: String,
        /// The code context (file name), or the probe's item id (conditioning, quantization); null for aggregates.
        pub context: Option<String>,
        /// The context's language; null for aggregates.
        pub language: Option<String>,
        /// The edit archetype (`rename_identifier`, ...); null for aggregates over archetypes.
        pub archetype: Option<String>,
        /// The layer: residual layer 0..L-1 (`resid_pre`), L for the final residual; the injection layer for `mode_d` and Mode D `compute` rows.
        pub layer: Option<i64>,
        /// The relative-L2 threshold of a `dirtiness` value.
        pub tau: Option<f64>,
        /// The Mode D delta (`oracle`, `edit_site`, `archetype_mean`, `zero`) or `stale`; the conditioning direction (`on_manifold`, `off_manifold`, `off_over_on`); the quantization displacement (`int8`, `noise_int8`, `int8_over_noise`, ...).
        pub variant: Option<String>,
        /// The relative displacement (norm of delta over norm of k) of a conditioning value, or the fixed relative norm a quantization displacement was rescaled to (null: its own norm).
        pub magnitude: Option<f64>,
        /// What is measured (see the module documentation of `records::measure` and results/README.md).
        pub metric: String,
        /// The value.
        pub value: f64,
        /// Positions (per-pair rows) or pairs (aggregates) behind the value.
        pub n: i64,
        /// Why, for skips.
        pub note: Option<String>,
    }
}

impl MeasureRow {
    /// A row with the optional columns empty.
    pub fn new(
        run: &str,
        measurement: &str,
        model: &str,
        metric: &str,
        value: f64,
        n: usize,
    ) -> Self {
        Self {
            run: run.into(),
            measurement: measurement.into(),
            model: model.into(),
            context: None,
            language: None,
            archetype: None,
            layer: None,
            tau: None,
            variant: None,
            magnitude: None,
            metric: metric.into(),
            value,
            n: n as i64,
            note: None,
        }
    }

    /// With the context and its language.
    pub fn context(mut self, context: &str, language: &str) -> Self {
        self.context = Some(context.into());
        self.language = Some(language.into());
        self
    }

    /// With the archetype.
    pub fn archetype(mut self, archetype: &str) -> Self {
        self.archetype = Some(archetype.into());
        self
    }

    /// With the layer.
    pub fn layer(mut self, layer: usize) -> Self {
        self.layer = Some(layer as i64);
        self
    }

    /// With the tau.
    pub fn tau(mut self, tau: f64) -> Self {
        self.tau = Some(tau);
        self
    }

    /// With the variant.
    pub fn variant(mut self, variant: &str) -> Self {
        self.variant = Some(variant.into());
        self
    }

    /// With a note.
    pub fn note(mut self, note: impl Into<String>) -> Self {
        self.note = Some(note.into());
        self
    }
}
