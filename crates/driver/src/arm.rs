//! The arm grammar: what fills each slot of the receiver's forward pass on
//! one item. Arms are plain data and round-trip through TOML.
//!
//! An arm has a base pass (the receiver on the masked or the full passage)
//! and zero or more injections. Each injection names a carrier (k, v, kv, h)
//! and its sites (layers, positions, heads), a source (own state, native
//! state, holder, another item, a bank or codebook selection, a pool of
//! holders, a cached delta), a mechanism (replace, interpolate, add, append)
//! and an optional perturbation of the source.

use serde::{Deserialize, Serialize};
use tolerable_carrier::codebook::Snapping;
use tolerable_carrier::{Carrier, LayerSet, Mechanism, Perturbation, Positions};

/// The receiver's own pass an arm starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Base {
    /// The answer-masked passage (the floor, with no injection).
    #[default]
    Masked,
    /// The full passage (the native reference, with no injection).
    Full,
}

impl Base {
    /// Short name used in records.
    pub fn name(self) -> &'static str {
        match self {
            Base::Masked => "masked",
            Base::Full => "full",
        }
    }
}

/// Where the injected object comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// The receiver's own state on the base pass (the no-op control).
    Own,
    /// The receiver's own state on the full passage, C* (the identity arm).
    Native,
    /// The holder's state on the full passage (the receiver's weights unless
    /// the arm names a holder model).
    Holder,
    /// The holder's state on another item's full passage (mismatch / mis-source).
    OtherItem,
    /// A selection from a bank of genuine states the receiver produced on
    /// other contexts (PROTOCOL §5, key bank).
    Bank(BankSpec),
    /// A codebook reconstruction (PROTOCOL §5, codebooks).
    Codebook(CodebookSpec),
    /// A routed combination over a pool of holders (PROTOCOL §6 activation
    /// augmentation, §7 sender pools).
    Pool(PoolSpec),
    /// A cached hidden-state delta (PROTOCOL §10, Mode D).
    Delta(DeltaSpec),
}

impl Source {
    /// Short name used in records.
    pub fn name(&self) -> &'static str {
        match self {
            Source::Own => "own",
            Source::Native => "native",
            Source::Holder => "holder",
            Source::OtherItem => "other_item",
            Source::Bank(_) => "bank",
            Source::Codebook(_) => "codebook",
            Source::Pool(_) => "pool",
            Source::Delta(_) => "delta",
        }
    }
}

/// A selection from a key bank (PROTOCOL §5): for each true key at the
/// sites, a genuine key the receiver produced on training contexts — the
/// k-th nearest by cosine, or the one whose cosine to the true key is
/// nearest a target (the on-manifold arm of the layer budget).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BankSpec {
    /// The `[resources.<name>]` entry holding the bank.
    pub bank: String,
    /// Take the k-th nearest (cosine) genuine key (1 = nearest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub neighbour: Option<usize>,
    /// Take the genuine key whose cosine to the true key is nearest this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cosine: Option<f64>,
}

/// A codebook reconstruction of the true keys (PROTOCOL §5): each key
/// snapped to a codebook fitted on a key bank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CodebookSpec {
    /// The `[resources.<name>]` entry holding the codebook.
    pub codebook: String,
    /// How a key is snapped to it.
    pub snapping: Snapping,
}

/// How a pool's holders are weighted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Router {
    /// Equal weights.
    Uniform,
    /// All weight on the answer holder.
    Oracle,
    /// A trained router (PROTOCOL §7).
    Trained,
}

/// Which passages a pool's holders read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolMembers {
    /// One holder read the answer passage, the others distractors.
    #[default]
    WithAnswer,
    /// As `WithAnswer`, but the answer holder also read the masked passage (control).
    AnswerMasked,
    /// Distractors only (control).
    DistractorsOnly,
}

/// A pool of holders combined by a router.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    /// Holders in the pool.
    pub n: usize,
    /// Weighting.
    pub router: Router,
    /// Which passages they read.
    #[serde(default)]
    pub members: PoolMembers,
}

/// Which cached delta Mode D adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeltaSpec {
    /// The delta observed at the edit site, broadcast downstream.
    EditSite,
    /// The archetype's mean delta from other contexts.
    ArchetypeMean,
}

/// One injection into the receiver's pass.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Injection {
    /// The carrier: k, v, kv or h.
    pub carrier: Carrier,
    /// Layers (default: all).
    #[serde(default = "all_layers")]
    pub layers: LayerSet,
    /// Positions (default: the fact region).
    #[serde(default)]
    pub positions: Positions,
    /// Where the source is read, when not at `positions` (the displaced
    /// control reads the holder's fact region and writes it at fact-free
    /// positions: right content, wrong place). Source sites are paired with
    /// destination sites in order; extra ones are ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_positions: Option<Positions>,
    /// KV heads (KV carriers only; default: all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heads: Option<Vec<usize>>,
    /// Where the injected object comes from.
    pub source: Source,
    /// How it enters (default: replace).
    #[serde(default = "replace")]
    pub mechanism: Mechanism,
    /// The weight of interpolate and add.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alpha: Option<f64>,
    /// A move of the source toward another state before injection (genuine
    /// interpolation), applied after any bank or codebook substitution and
    /// before `perturb`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blend: Option<Blend>,
    /// A perturbation of the source before injection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub perturb: Option<Perturbation>,
    /// A fitted map (`[resources.<name>] kind = "fitted_map"`) the source's
    /// keys go through last (fitted substitutes): the source must be the
    /// sender-side input the map was fitted on — `holder` with the map's
    /// sender as the arm's holder, or `native` with the map's noise as
    /// `perturb`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub map: Option<String>,
}

/// Genuine interpolation (PROTOCOL §5): the source moved toward another
/// pass's state at the sites both hold — by a weight, or by the weight that
/// brings its cosine to the source to a target (matched to cosine noise).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Blend {
    /// The state moved toward: `other_item` (another item's cache: the
    /// genuine cache of the paper), or `own`, `native`, `holder`.
    pub toward: Source,
    /// A fixed weight: source + alpha (toward - source).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alpha: Option<f64>,
    /// The cosine to the source the blend reaches, per item and layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_cosine: Option<f64>,
}

fn all_layers() -> LayerSet {
    LayerSet::All
}
fn replace() -> Mechanism {
    Mechanism::Replace
}

/// A holder other than the receiver's own weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Holder {
    /// Model id or path of the sender.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Build the sender by re-quantizing the receiver to this GGUF type (held-out senders).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requantize: Option<String>,
    /// Build the sender by moving every weight matrix of the receiver to
    /// this cosine with calibrated noise (held-out senders beyond what
    /// re-quantization reaches).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_cosine: Option<f64>,
    /// A cross-family holder: the `[resources.<name>] kind =
    /// "cross_projection"` that maps the states of `model` (reading the
    /// passage with its own tokenizer) into the receiver's space. Required
    /// for a model of another cache shape; with the receiver's own id as
    /// `model`, the identity sanity arm.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub projection: Option<String>,
}

/// Which projections a bridge adapts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BridgeTargets {
    /// The query projection.
    Q,
    /// Key and value projections.
    Kv,
    /// Query, key and value projections.
    Qkv,
    /// The router of a pool only.
    Router,
}

/// A trained bridge on an arm (PROTOCOL §7): the low-rank adapters of a
/// `bridge` resource (`[resources.<name>] kind = "bridge"`), run on the
/// question and decoding of the arm.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bridge {
    /// The bridge resource.
    pub resource: String,
    /// Use the adapters as initialised, before any training step (B = 0:
    /// the zero-init gate, bit-identical to the raw arm).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub init: bool,
}

/// A per-item gate an arm must pass: its continuation and first-step logits
/// equal another arm's bit for bit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Expect {
    /// Equal to the floor (the no-op control).
    Floor,
    /// Equal to the native reference (the identity arm).
    Native,
    /// Equal to the arm of this (expanded) name, e.g. a bridged arm at its
    /// zero-initialised adapters against the raw arm: `expect = { arm = "kv_augment" }`.
    Arm(String),
}

/// One arm: a base pass and the injections into it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Arm {
    /// Name in records (`floor`, `native`, `identity`, `noop`, ...). Grid
    /// points are appended as `name@key=value`.
    pub name: String,
    /// The base pass.
    #[serde(default)]
    pub base: Base,
    /// The injections, applied in order (residual first, then cache edits,
    /// then appended segments).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inject: Vec<Injection>,
    /// A sender other than the receiver's own weights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<Holder>,
    /// A trained bridge.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bridge: Option<Bridge>,
    /// Arms (or arm families) whose accuracy is this arm's control: the
    /// summary reports the lift over the strongest.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub controls: Vec<String>,
    /// A per-item bit-exact gate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expect: Option<Expect>,
    /// Draw random numbers as the arm of this name does (seeds mix the
    /// arm's name otherwise): paired arms, such as sparse damage and the
    /// dense damage matched to it, then see the same draws.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed_as: Option<String>,
}

impl Arm {
    /// The floor: the receiver on the masked passage.
    pub fn floor() -> Self {
        Self::plain("floor", Base::Masked)
    }

    /// The native reference: the receiver on the full passage.
    pub fn native() -> Self {
        Self::plain("native", Base::Full)
    }

    fn plain(name: &str, base: Base) -> Self {
        Self {
            name: name.into(),
            base,
            inject: Vec::new(),
            holder: None,
            bridge: None,
            controls: Vec::new(),
            expect: None,
            seed_as: None,
        }
    }

    /// Whether the arm is a bare base pass (floor or native).
    pub fn is_anchor(&self) -> bool {
        self.inject.is_empty() && self.holder.is_none() && self.bridge.is_none()
    }

    /// Whether any injection uses the residual carrier.
    pub fn touches_residual(&self) -> bool {
        self.inject.iter().any(|i| i.carrier == Carrier::H)
    }
}
