//! Named hook points (TransformerLens names) and what to do at them.
//!
//! A [`HookSpec`] declares captures and interventions as data; the forward
//! pass consults it at every hook point and does no extra work when it is
//! empty. Captured tensors come back in a [`HookCache`].
//!
//! Layouts: residual-stream hooks are `[batch, pos, d_model]`; q/k/v hooks are
//! head-major `[batch, heads, pos, head_dim]` (the KV cache's layout; k/v have
//! `n_kv_heads` heads, q has `n_heads`); `hook_z` is `[batch, pos, n_heads,
//! head_dim]`; scores and pattern are `[batch, n_heads, query_pos, key_pos]`;
//! MLP hooks are `[batch, pos, d_ffn]`. Positions are those of the current
//! forward call (0 = its first new token).

use crate::error::{Result, RuntimeError};
use candle_core::{DType, Tensor};
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::str::FromStr;

/// One named site in the forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HookPoint {
    /// `hook_embed`: token embeddings.
    Embed,
    /// `blocks.{l}.hook_resid_pre`: the input of block l (carrier h).
    ResidPre(usize),
    /// `blocks.{l}.attn.hook_q`: queries before RoPE.
    Q(usize),
    /// `blocks.{l}.attn.hook_k`: keys before RoPE.
    K(usize),
    /// `blocks.{l}.attn.hook_v`: values (carrier V).
    V(usize),
    /// `blocks.{l}.attn.hook_rot_q`: queries after RoPE.
    RotQ(usize),
    /// `blocks.{l}.attn.hook_rot_k`: keys after RoPE, what the cache holds (carrier K).
    RotK(usize),
    /// `blocks.{l}.attn.hook_attn_scores`: scaled, masked attention logits.
    AttnScores(usize),
    /// `blocks.{l}.attn.hook_pattern`: attention weights after softmax.
    Pattern(usize),
    /// `blocks.{l}.attn.hook_z`: per-head attention outputs before the output projection.
    Z(usize),
    /// `blocks.{l}.hook_attn_out`: the attention block's contribution to the residual.
    AttnOut(usize),
    /// `blocks.{l}.hook_resid_mid`: residual between attention and MLP.
    ResidMid(usize),
    /// `blocks.{l}.mlp.hook_pre`: gate projection before the nonlinearity.
    MlpPre(usize),
    /// `blocks.{l}.mlp.hook_post`: `silu(gate) * up`, the input of the down projection.
    MlpPost(usize),
    /// `blocks.{l}.hook_mlp_out`: the MLP's contribution to the residual.
    MlpOut(usize),
    /// `blocks.{l}.hook_resid_post`: the output of block l.
    ResidPost(usize),
    /// `ln_final.hook_normalized`: the final norm's output, at the positions whose logits are computed.
    FinalNorm,
}

impl HookPoint {
    /// The layer this hook belongs to, if any.
    pub fn layer(&self) -> Option<usize> {
        use HookPoint::*;
        match *self {
            Embed | FinalNorm => None,
            ResidPre(l) | Q(l) | K(l) | V(l) | RotQ(l) | RotK(l) | AttnScores(l) | Pattern(l)
            | Z(l) | AttnOut(l) | ResidMid(l) | MlpPre(l) | MlpPost(l) | MlpOut(l)
            | ResidPost(l) => Some(l),
        }
    }

    /// The axis that indexes positions in this hook's tensor.
    pub fn position_axis(&self) -> usize {
        use HookPoint::*;
        match self {
            Q(_) | K(_) | V(_) | RotQ(_) | RotK(_) | AttnScores(_) | Pattern(_) => 2,
            _ => 1,
        }
    }

    /// The axis that indexes heads, for head-resolved hooks.
    pub fn head_axis(&self) -> Option<usize> {
        use HookPoint::*;
        match self {
            Q(_) | K(_) | V(_) | RotQ(_) | RotK(_) | AttnScores(_) | Pattern(_) => Some(1),
            Z(_) => Some(2),
            _ => None,
        }
    }

    /// Whether this hook has key/value heads (`n_kv_heads`) rather than query heads.
    pub fn is_kv(&self) -> bool {
        matches!(self, HookPoint::K(_) | HookPoint::V(_) | HookPoint::RotK(_))
    }

    /// Every hook point of a model with `n_layers` blocks, in forward order.
    pub fn all(n_layers: usize) -> Vec<HookPoint> {
        use HookPoint::*;
        let mut v = vec![Embed];
        for l in 0..n_layers {
            v.extend([
                ResidPre(l),
                Q(l),
                K(l),
                V(l),
                RotQ(l),
                RotK(l),
                AttnScores(l),
                Pattern(l),
                Z(l),
                AttnOut(l),
                ResidMid(l),
                MlpPre(l),
                MlpPost(l),
                MlpOut(l),
                ResidPost(l),
            ]);
        }
        v.push(FinalNorm);
        v
    }

    /// Checks the layer against a model's layer count.
    pub fn check_layer(&self, n_layers: usize) -> Result<()> {
        match self.layer() {
            Some(l) if l >= n_layers => Err(RuntimeError::LayerOutOfRange {
                site: self.to_string(),
                layer: l,
                n_layers,
            }),
            _ => Ok(()),
        }
    }
}

impl fmt::Display for HookPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use HookPoint::*;
        match *self {
            Embed => write!(f, "hook_embed"),
            ResidPre(l) => write!(f, "blocks.{l}.hook_resid_pre"),
            Q(l) => write!(f, "blocks.{l}.attn.hook_q"),
            K(l) => write!(f, "blocks.{l}.attn.hook_k"),
            V(l) => write!(f, "blocks.{l}.attn.hook_v"),
            RotQ(l) => write!(f, "blocks.{l}.attn.hook_rot_q"),
            RotK(l) => write!(f, "blocks.{l}.attn.hook_rot_k"),
            AttnScores(l) => write!(f, "blocks.{l}.attn.hook_attn_scores"),
            Pattern(l) => write!(f, "blocks.{l}.attn.hook_pattern"),
            Z(l) => write!(f, "blocks.{l}.attn.hook_z"),
            AttnOut(l) => write!(f, "blocks.{l}.hook_attn_out"),
            ResidMid(l) => write!(f, "blocks.{l}.hook_resid_mid"),
            MlpPre(l) => write!(f, "blocks.{l}.mlp.hook_pre"),
            MlpPost(l) => write!(f, "blocks.{l}.mlp.hook_post"),
            MlpOut(l) => write!(f, "blocks.{l}.hook_mlp_out"),
            ResidPost(l) => write!(f, "blocks.{l}.hook_resid_post"),
            FinalNorm => write!(f, "ln_final.hook_normalized"),
        }
    }
}

impl FromStr for HookPoint {
    type Err = RuntimeError;

    fn from_str(s: &str) -> Result<Self> {
        use HookPoint::*;
        let unknown = || RuntimeError::UnknownHook(s.to_string());
        match s {
            "hook_embed" => return Ok(Embed),
            "ln_final.hook_normalized" => return Ok(FinalNorm),
            _ => {}
        }
        let rest = s.strip_prefix("blocks.").ok_or_else(unknown)?;
        let (layer, name) = rest.split_once('.').ok_or_else(unknown)?;
        if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
            return Err(unknown());
        }
        let l: usize = layer.parse().map_err(|_| unknown())?;
        Ok(match name {
            "hook_resid_pre" => ResidPre(l),
            "attn.hook_q" => Q(l),
            "attn.hook_k" => K(l),
            "attn.hook_v" => V(l),
            "attn.hook_rot_q" => RotQ(l),
            "attn.hook_rot_k" => RotK(l),
            "attn.hook_attn_scores" => AttnScores(l),
            "attn.hook_pattern" => Pattern(l),
            "attn.hook_z" => Z(l),
            "hook_attn_out" => AttnOut(l),
            "hook_resid_mid" => ResidMid(l),
            "mlp.hook_pre" => MlpPre(l),
            "mlp.hook_post" => MlpPost(l),
            "hook_mlp_out" => MlpOut(l),
            "hook_resid_post" => ResidPost(l),
            _ => return Err(unknown()),
        })
    }
}

impl serde::Serialize for HookPoint {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for HookPoint {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// What an intervention does to the activation at its sites.
#[derive(Debug, Clone)]
pub enum Edit {
    /// Put `source` in place of the activation.
    Replace(Tensor),
    /// Add `source` to the activation.
    Add(Tensor),
    /// `(1 - alpha) * own + alpha * source`.
    Interpolate {
        /// Weight of the source (0 keeps the own state, 1 replaces it).
        alpha: f64,
        /// The state to move toward.
        source: Tensor,
    },
    /// Multiply the activation by a factor.
    Scale(f64),
    /// Set the activation to zero (knock-out).
    Zero,
}

/// One intervention: an edit at a hook point, restricted to some positions and heads.
///
/// Source tensors have the hook's full shape for the current forward call
/// (batch may be 1 to broadcast over the batch); only the selected sites are
/// changed, everything else is passed through untouched (bit-exact).
#[derive(Debug, Clone)]
pub struct Intervention {
    /// Where to intervene.
    pub point: HookPoint,
    /// What to do there.
    pub edit: Edit,
    /// Positions (of the current forward call) to edit; `None` = all.
    pub positions: Option<Vec<usize>>,
    /// Heads to edit, for head-resolved hooks; `None` = all.
    pub heads: Option<Vec<usize>>,
}

impl Intervention {
    /// An intervention on every position and head.
    pub fn new(point: HookPoint, edit: Edit) -> Self {
        Self {
            point,
            edit,
            positions: None,
            heads: None,
        }
    }

    /// Restricts the intervention to these positions.
    pub fn at_positions(mut self, positions: impl Into<Vec<usize>>) -> Self {
        self.positions = Some(positions.into());
        self
    }

    /// Restricts the intervention to these heads.
    pub fn at_heads(mut self, heads: impl Into<Vec<usize>>) -> Self {
        self.heads = Some(heads.into());
        self
    }

    /// Applies the edit to `act`, returning the edited activation.
    pub fn apply(&self, act: &Tensor) -> Result<Tensor> {
        let site = || self.point.to_string();
        let bad = |reason: String| RuntimeError::BadIntervention {
            site: site(),
            reason,
        };
        let shaped = |src: &Tensor| -> Result<Tensor> {
            let src = src.to_dtype(act.dtype())?;
            if src.dims() == act.dims() {
                return Ok(src);
            }
            src.broadcast_as(act.shape()).map_err(|_| {
                bad(format!(
                    "source of shape {:?} does not fit the activation of shape {:?}",
                    src.dims(),
                    act.dims()
                ))
            })
        };
        let edited = match &self.edit {
            Edit::Replace(src) => shaped(src)?,
            Edit::Add(src) => (act + shaped(src)?)?,
            Edit::Interpolate { alpha, source } => {
                ((act * (1.0 - alpha))? + (shaped(source)? * *alpha)?)?
            }
            Edit::Scale(f) => (act * *f)?,
            Edit::Zero => act.zeros_like()?,
        };
        if self.positions.is_none() && self.heads.is_none() {
            return Ok(edited);
        }
        let mask = self.site_mask(act)?;
        Ok(mask.where_cond(&edited, act)?)
    }

    /// A u8 mask broadcast to `act`'s shape: 1 at the edited sites.
    fn site_mask(&self, act: &Tensor) -> Result<Tensor> {
        let head_axis = match &self.heads {
            Some(_) => {
                Some(
                    self.point
                        .head_axis()
                        .ok_or_else(|| RuntimeError::BadIntervention {
                            site: self.point.to_string(),
                            reason: "this hook has no head axis; heads cannot be selected".into(),
                        })?,
                )
            }
            None => None,
        };
        let mask = site_mask(
            act.dims(),
            self.positions
                .as_deref()
                .map(|p| (self.point.position_axis(), p)),
            self.heads.as_deref().zip(head_axis).map(|(h, a)| (a, h)),
            act.device(),
        )
        .map_err(|e| match e {
            RuntimeError::BadIntervention { reason, .. } => RuntimeError::BadIntervention {
                site: self.point.to_string(),
                reason: format!("{reason} in this forward"),
            },
            other => other,
        })?;
        Ok(mask.broadcast_as(act.dims())?.to_dtype(DType::U8)?)
    }
}

/// The sites of an activation of shape `dims` as a u8 mask: 1 at the
/// `positions` along their axis and the `heads` along theirs (each `None` =
/// every index), 0 elsewhere. The mask has size 1 on every other axis, so it
/// broadcasts over them. One builder serves hook interventions and the
/// carrier's site selections, so both mean the same sites.
pub fn site_mask(
    dims: &[usize],
    positions: Option<(usize, &[usize])>,
    heads: Option<(usize, &[usize])>,
    device: &candle_core::Device,
) -> Result<Tensor> {
    let mut shape = vec![1usize; dims.len()];
    let mut selected: Vec<(usize, Vec<bool>)> = Vec::new();
    for (what, sel) in [("position", positions), ("head", heads)] {
        let Some((axis, idx)) = sel else { continue };
        let n = *dims
            .get(axis)
            .ok_or_else(|| RuntimeError::BadIntervention {
                site: "site mask".into(),
                reason: format!("axis {axis} outside an activation of rank {}", dims.len()),
            })?;
        let mut keep = vec![false; n];
        for &i in idx {
            if i >= n {
                let unit = if what == "position" {
                    "positions"
                } else {
                    "heads"
                };
                return Err(RuntimeError::BadIntervention {
                    site: "site mask".into(),
                    reason: format!("{what} {i} is out of range for {n} {unit}"),
                });
            }
            keep[i] = true;
        }
        shape[axis] = n;
        selected.push((axis, keep));
    }
    // Outer product of the per-axis selections, laid out over `shape`.
    let total: usize = shape.iter().product();
    let mut data = vec![1u8; total];
    let strides: Vec<usize> = (0..shape.len())
        .map(|i| shape[i + 1..].iter().product())
        .collect();
    for (idx, cell) in data.iter_mut().enumerate() {
        for (axis, keep) in &selected {
            if !keep[(idx / strides[*axis]) % shape[*axis]] {
                *cell = 0;
            }
        }
    }
    Ok(Tensor::from_vec(data, shape, device)?)
}

/// The attention projection a low-rank adapter adds to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Projection {
    /// The query projection (`blocks.{l}.attn.hook_q` receives its output).
    Q,
    /// The key projection.
    K,
    /// The value projection.
    V,
}

/// A low-rank adapter (LoRA) on one attention projection of one layer: a
/// runtime edit computed from the projection's input, `h A B * scale`
/// added to the projection's output for every position of the call (before
/// the `hook_q` / `hook_k` / `hook_v` hooks and RoPE). The receiver's
/// weights stay untouched; `A` and `B` may be trainable variables, and
/// gradients flow through them on the differentiable kernels. With `B`
/// zero the forward is the unadapted one. An adapter may apply to some
/// sequences of a batch only (`rows`): arms with different bridges then
/// read their questions and decode as one batch, each with its own.
#[derive(Debug, Clone)]
pub struct Adapter {
    /// The layer.
    pub layer: usize,
    /// The projection adapted.
    pub projection: Projection,
    /// Down projection `[d_model, rank]`.
    pub a: Tensor,
    /// Up projection `[rank, heads * head_dim]` of the projection's output.
    pub b: Tensor,
    /// Scale of the low-rank term (LoRA's alpha / rank).
    pub scale: f64,
    /// The sequences of the batch it applies to (the others get an exact
    /// zero); every sequence when none.
    pub rows: Option<Vec<usize>>,
}

/// What to capture and where to intervene during one forward call.
#[derive(Debug, Clone, Default)]
pub struct HookSpec {
    captures: HashSet<HookPoint>,
    interventions: Vec<Intervention>,
    adapters: Vec<Adapter>,
}

impl HookSpec {
    /// No captures, no interventions: the forward does no hook work at all.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the spec asks for nothing.
    pub fn is_empty(&self) -> bool {
        self.captures.is_empty() && self.interventions.is_empty() && self.adapters.is_empty()
    }

    /// Adds a low-rank adapter; several on one projection add up.
    pub fn adapt(mut self, adapter: Adapter) -> Self {
        self.adapters.push(adapter);
        self
    }

    /// Adds several adapters.
    pub fn adapt_all(mut self, adapters: impl IntoIterator<Item = Adapter>) -> Self {
        self.adapters.extend(adapters);
        self
    }

    /// The adapters, in order.
    pub fn adapters(&self) -> &[Adapter] {
        &self.adapters
    }

    /// The same adapters with no captures or interventions (what decoding
    /// steps after the prompt run with).
    pub fn adapters_only(&self) -> HookSpec {
        HookSpec {
            adapters: self.adapters.clone(),
            ..HookSpec::default()
        }
    }

    /// One batch's hooks from each sequence's own (`specs[r]` for row `r`):
    /// every adapter of a row applies to that row only. Only adapters
    /// combine so: a spec with captures or interventions is refused, as is
    /// an adapter already limited to rows.
    pub fn per_row(specs: &[&HookSpec]) -> Result<HookSpec> {
        let mut out = HookSpec::new();
        for (row, spec) in specs.iter().enumerate() {
            if !spec.captures.is_empty() || !spec.interventions.is_empty() {
                return Err(RuntimeError::BadIntervention {
                    site: format!("batch row {row}"),
                    reason: "only adapters combine per row; this row's hooks capture or intervene"
                        .into(),
                });
            }
            for a in &spec.adapters {
                if a.rows.is_some() {
                    return Err(RuntimeError::BadIntervention {
                        site: format!("adapter on blocks.{}.{:?}", a.layer, a.projection),
                        reason: "already limited to rows of a batch".into(),
                    });
                }
                out.adapters.push(Adapter {
                    rows: Some(vec![row]),
                    ..a.clone()
                });
            }
        }
        Ok(out)
    }

    /// Adds a capture.
    pub fn capture(mut self, point: HookPoint) -> Self {
        self.captures.insert(point);
        self
    }

    /// Adds captures for several points.
    pub fn capture_all(mut self, points: impl IntoIterator<Item = HookPoint>) -> Self {
        self.captures.extend(points);
        self
    }

    /// Adds an intervention; several at one point apply in the order added.
    pub fn intervene(mut self, intervention: Intervention) -> Self {
        self.interventions.push(intervention);
        self
    }

    /// The points captured.
    pub fn captures(&self) -> &HashSet<HookPoint> {
        &self.captures
    }

    /// The interventions, in order.
    pub fn interventions(&self) -> &[Intervention] {
        &self.interventions
    }

    /// Checks every named layer against the model's layer count.
    pub fn validate(&self, n_layers: usize) -> Result<()> {
        for p in self.captures.iter() {
            p.check_layer(n_layers)?;
        }
        for i in &self.interventions {
            i.point.check_layer(n_layers)?;
        }
        for a in &self.adapters {
            HookPoint::Q(a.layer).check_layer(n_layers)?;
        }
        Ok(())
    }

    /// Whether anything at all happens at `point`.
    pub fn touches(&self, point: HookPoint) -> bool {
        self.captures.contains(&point) || self.interventions.iter().any(|i| i.point == point)
    }

    /// Runs the interventions at `point` on `act`, then captures the result if asked.
    pub(crate) fn run(
        &self,
        point: HookPoint,
        act: Tensor,
        cache: &mut HookCache,
    ) -> Result<Tensor> {
        let mut act = act;
        for i in self.interventions.iter().filter(|i| i.point == point) {
            act = i.apply(&act)?;
        }
        if self.captures.contains(&point) {
            cache.insert(point, act.clone());
        }
        Ok(act)
    }
}

/// The tensors captured during a forward call, by hook point.
#[derive(Debug, Clone, Default)]
pub struct HookCache {
    tensors: HashMap<HookPoint, Tensor>,
}

impl HookCache {
    /// The captured tensor at `point`, if it was captured.
    pub fn get(&self, point: HookPoint) -> Option<&Tensor> {
        self.tensors.get(&point)
    }

    /// The captured tensor at `point`, or an error naming the missing capture.
    pub fn require(&self, point: HookPoint) -> Result<&Tensor> {
        self.get(point)
            .ok_or_else(|| RuntimeError::BadIntervention {
                site: point.to_string(),
                reason: "was not captured in this forward".into(),
            })
    }

    /// Stores a tensor.
    pub fn insert(&mut self, point: HookPoint, t: Tensor) {
        self.tensors.insert(point, t);
    }

    /// Removes and returns a captured tensor.
    pub fn take(&mut self, point: HookPoint) -> Option<Tensor> {
        self.tensors.remove(&point)
    }

    /// How many tensors were captured.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether nothing was captured.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The captured points, sorted.
    pub fn points(&self) -> Vec<HookPoint> {
        let mut v: Vec<_> = self.tensors.keys().copied().collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn names_round_trip() {
        for p in HookPoint::all(3) {
            let s = p.to_string();
            assert_eq!(s.parse::<HookPoint>().unwrap(), p, "{s}");
        }
        assert_eq!(
            "blocks.12.attn.hook_rot_k".parse::<HookPoint>().unwrap(),
            HookPoint::RotK(12)
        );
    }

    #[test]
    fn bad_names_are_rejected_by_name() {
        for s in [
            "blocks.x.hook_resid_pre",
            "blocks.3.hook_nothing",
            "resid",
            "blocks..hook_q",
            "blocks.-1.hook_resid_pre",
        ] {
            let e = s.parse::<HookPoint>().unwrap_err();
            assert!(e.to_string().contains(s), "{e}");
        }
    }

    #[test]
    fn layer_out_of_range_names_the_hook() {
        let spec = HookSpec::new().capture(HookPoint::ResidPre(30));
        let e = spec.validate(24).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("blocks.30.hook_resid_pre") && msg.contains("24"),
            "{msg}"
        );
    }

    #[test]
    fn edits_touch_only_selected_sites() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        // [batch 1, heads 2, pos 3, dim 2]
        let act = Tensor::arange(0f32, 12., &dev)?.reshape((1, 2, 3, 2))?;
        let src = Tensor::full(100f32, (1, 2, 3, 2), &dev)?;
        let i = Intervention::new(HookPoint::RotK(0), Edit::Replace(src))
            .at_positions(vec![1])
            .at_heads(vec![1]);
        let out = i.apply(&act)?.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(
            out,
            vec![0., 1., 2., 3., 4., 5., 6., 7., 100., 100., 10., 11.]
        );
        let add = Intervention::new(
            HookPoint::ResidPre(0),
            Edit::Add(Tensor::ones((1, 1, 2), DType::F32, &dev)?),
        )
        .at_positions(vec![0]);
        let act2 = Tensor::zeros((1, 2, 2), DType::F32, &dev)?;
        let out = add.apply(&act2)?.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(out, vec![1., 1., 0., 0.]);
        let interp = Intervention::new(
            HookPoint::ResidPre(0),
            Edit::Interpolate {
                alpha: 0.25,
                source: Tensor::full(4f32, (1, 2, 2), &dev)?,
            },
        );
        assert_eq!(
            interp.apply(&act2)?.flatten_all()?.to_vec1::<f32>()?,
            vec![1.; 4]
        );
        Ok(())
    }

    #[test]
    fn out_of_range_sites_are_errors() {
        let dev = Device::Cpu;
        let act = Tensor::zeros((1, 2, 4), DType::F32, &dev).unwrap();
        let i = Intervention::new(HookPoint::ResidPre(0), Edit::Zero).at_positions(vec![5]);
        assert!(i
            .apply(&act)
            .unwrap_err()
            .to_string()
            .contains("position 5"));
        let j = Intervention::new(HookPoint::ResidPre(0), Edit::Zero).at_heads(vec![0]);
        assert!(j
            .apply(&act)
            .unwrap_err()
            .to_string()
            .contains("no head axis"));
    }
}
