//! Sources: where an injected carrier comes from. A source provider returns
//! a carrier value — keys and values of every layer, or the residual stream
//! at the layers an injection needs — from one of the item's passes.
//! Transforms (perturbations, snapping to a bank or codebook, displacement)
//! act on that value next; the mechanism puts it into the receiver's slots.
//!
//! Every source of the runner today reads a pass of the receiver's own
//! weights: its base pass (own state, the no-op), the alternative context's
//! pass (native state C\*, or the holder's state when the holder is the
//! receiver), or a mis-source partner's alternative pass (another item).

use crate::arm::Base;
use crate::error::{DriverError, Result};
use crate::passes::{ItemPasses, Pass, PassNeeds};
use crate::resources::Value;
use candle_core::Tensor;
use std::collections::BTreeMap;
use std::fmt;
use tolerable_carrier::{Carrier, Geometry};
use tolerable_runtime::KvCache;

/// A carrier's value from one pass: what transforms edit and mechanisms inject.
#[derive(Debug, Clone)]
pub enum CarrierValue {
    /// Keys and values of every layer (K, V and K+V carriers).
    Kv(KvCache),
    /// `blocks.{l}.hook_resid_pre` at the layers the injection names,
    /// `[1, positions, d_model]` each (the h carrier).
    Resid(BTreeMap<usize, Tensor>),
}

impl CarrierValue {
    /// The keys and values, for KV carriers.
    pub fn kv(&self) -> Result<&KvCache> {
        match self {
            CarrierValue::Kv(c) => Ok(c),
            CarrierValue::Resid(_) => Err(DriverError::Records(
                "internal: a residual value where keys and values were expected".into(),
            )),
        }
    }

    /// The residual stream at layer `l`, for the h carrier.
    pub fn resid(&self, l: usize) -> Result<&Tensor> {
        match self {
            CarrierValue::Resid(m) => m
                .get(&l)
                .ok_or_else(|| DriverError::Records(format!("internal: no residual at layer {l}"))),
            CarrierValue::Kv(_) => Err(DriverError::Records(
                "internal: keys and values where a residual was expected".into(),
            )),
        }
    }
}

/// Which of an item's passes a source reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PassRef {
    /// The arm's own base pass (masked or full, as the arm says).
    ArmBase,
    /// The alternative (full-passage) context's pass.
    Alt,
    /// The `r`-th mis-source partner's alternative pass.
    Partner(usize),
}

/// A provider of an injected carrier.
pub trait Source: fmt::Debug + Send + Sync {
    /// Name in records and plans (`own`, `native`, `holder`, `other_item`).
    fn name(&self) -> &'static str;
    /// Declares the passes and captures it reads for an injection of
    /// `carrier` at `layers` into an arm of base `base`.
    fn needs(&self, base: Base, carrier: Carrier, layers: &[usize], needs: &mut PassNeeds);
    /// The value at `layers`, and the geometry of the context it was read
    /// from (a partner's differs from the item's); `resources` are the
    /// run's (a trained router reads its bridge there).
    fn provide(
        &self,
        passes: &ItemPasses,
        base: Base,
        carrier: Carrier,
        layers: &[usize],
        resources: &BTreeMap<String, Value>,
    ) -> Result<(CarrierValue, Geometry)>;
}

/// A source that reads one pass of the receiver's own weights.
#[derive(Debug, Clone, Copy)]
pub struct PassSource {
    /// Record name.
    pub name: &'static str,
    /// The pass.
    pub pass: PassRef,
}

impl PassSource {
    /// The receiver's own state on the arm's base pass (the no-op control).
    pub fn own() -> Self {
        Self {
            name: "own",
            pass: PassRef::ArmBase,
        }
    }
    /// The receiver's own full-passage state C\* (the identity arm).
    pub fn native() -> Self {
        Self {
            name: "native",
            pass: PassRef::Alt,
        }
    }
    /// The holder's full-passage state (the receiver's weights as holder).
    pub fn holder() -> Self {
        Self {
            name: "holder",
            pass: PassRef::Alt,
        }
    }
    /// Another item's full-passage state (the mismatch control).
    pub fn other_item() -> Self {
        Self {
            name: "other_item",
            pass: PassRef::Partner(0),
        }
    }

    fn resolve(&self, base: Base) -> PassRef {
        match (self.pass, base) {
            (PassRef::ArmBase, Base::Full) => PassRef::Alt,
            (p, _) => p,
        }
    }
}

impl Source for PassSource {
    fn name(&self) -> &'static str {
        self.name
    }

    fn needs(&self, base: Base, carrier: Carrier, layers: &[usize], needs: &mut PassNeeds) {
        let pass = self.resolve(base);
        if let PassRef::Partner(r) = pass {
            needs.partners = needs.partners.max(r + 1);
        }
        if carrier == Carrier::H {
            needs.resid_of(pass).extend(layers.iter().copied());
        }
    }

    fn provide(
        &self,
        passes: &ItemPasses,
        base: Base,
        carrier: Carrier,
        layers: &[usize],
        _resources: &BTreeMap<String, Value>,
    ) -> Result<(CarrierValue, Geometry)> {
        let (pass, geometry): (&Pass, Geometry) = match self.resolve(base) {
            PassRef::ArmBase => (&passes.base, passes.geometry.clone()),
            PassRef::Alt => (&passes.alt, passes.geometry.clone()),
            PassRef::Partner(r) => {
                let p = passes.partners.get(r).ok_or_else(|| {
                    DriverError::Records(format!("internal: mis-source partner {r} missing"))
                })?;
                (&p.0, p.1.clone())
            }
        };
        let value = if carrier == Carrier::H {
            let mut m = BTreeMap::new();
            for &l in layers {
                m.insert(l, pass.resid(l)?.clone());
            }
            CarrierValue::Resid(m)
        } else {
            CarrierValue::Kv(pass.cache.clone())
        };
        Ok((value, geometry))
    }
}

/// A routed combination over a pool of holders (PROTOCOL §6, activation
/// augmentation): the answer holder (the item's full passage; or its masked
/// passage, a control) and distractor holders (mis-source partners'
/// passages), weighted by a router: `sum_i w_i h_i`. With a mechanism
/// `add` and weight a, the receiver gets `h + a sum_i w_i h_i` at the sites.
/// A trained router (PROTOCOL §7) weighs the holders per position from the
/// receiver's own state ([`tolerable_carrier::RouterLayer`]), with the maps
/// of a `bridge` resource of `targets = "router"`.
#[derive(Debug, Clone)]
pub struct PoolSource {
    /// The members' passes, the answer holder first (when there is one).
    pub members: Vec<PassRef>,
    /// Their weights (fixed routers; uniform where the router is trained).
    pub weights: Vec<f64>,
    /// The trained router: its bridge resource, and whether its initial
    /// (uniform) maps are used.
    pub trained: Option<(String, bool)>,
    /// A sender pool for KV augmentation (PROTOCOL §7): every member's
    /// passage keys and values, one after another, appended for the
    /// receiver's own attention to read (undirected; no weights).
    pub append: bool,
}

impl PoolSource {
    /// A pool of `n` holders of `kind` weighted by `router`; a trained
    /// router reads the bridge `trained` names. `Err` with the reason when
    /// the combination does not exist.
    pub fn new(
        n: usize,
        router: crate::arm::Router,
        kind: crate::arm::PoolMembers,
        trained: Option<(String, bool)>,
    ) -> std::result::Result<Self, String> {
        use crate::arm::{PoolMembers, Router};
        if n == 0 {
            return Err("a pool needs at least one holder".into());
        }
        let members: Vec<PassRef> = match kind {
            PoolMembers::WithAnswer => std::iter::once(PassRef::Alt)
                .chain((0..n - 1).map(PassRef::Partner))
                .collect(),
            // The answer holder read the masked passage: the base pass of an
            // arm on the masked passage.
            PoolMembers::AnswerMasked => std::iter::once(PassRef::ArmBase)
                .chain((0..n - 1).map(PassRef::Partner))
                .collect(),
            PoolMembers::DistractorsOnly => (0..n).map(PassRef::Partner).collect(),
        };
        let weights = match router {
            Router::Uniform | Router::Trained => vec![1.0 / n as f64; n],
            Router::Oracle => {
                if kind == PoolMembers::DistractorsOnly {
                    return Err("an oracle router needs an answer holder in the pool".into());
                }
                let mut w = vec![0.0; n];
                w[0] = 1.0;
                w
            }
        };
        let trained = match (router, trained) {
            (Router::Trained, Some(t)) => Some(t),
            (Router::Trained, None) => {
                return Err(
                    "a trained router reads a bridge: give the arm `bridge = { resource = \"<name>\" }` naming a bridge of targets = \"router\"".into(),
                )
            }
            (_, _) => None,
        };
        Ok(Self {
            members,
            weights,
            trained,
            append: false,
        })
    }

    /// The same pool as a sender pool: its members' passages appended.
    pub fn appended(self) -> Self {
        Self {
            append: true,
            ..self
        }
    }

    /// A member's pass and the geometry of the context it read.
    fn member(passes: &ItemPasses, m: PassRef) -> Result<(&Pass, &Geometry)> {
        Ok(match m {
            PassRef::Partner(r) => {
                let p = passes.partners.get(r).ok_or_else(|| {
                    DriverError::Records(format!("internal: pool partner {r} missing"))
                })?;
                (&p.0, &p.1)
            }
            other => (Self::pass_of(passes, other)?, &passes.geometry),
        })
    }

    fn pass_of(passes: &ItemPasses, m: PassRef) -> Result<&Pass> {
        Ok(match m {
            PassRef::ArmBase => &passes.base,
            PassRef::Alt => &passes.alt,
            PassRef::Partner(r) => {
                &passes
                    .partners
                    .get(r)
                    .ok_or_else(|| {
                        DriverError::Records(format!("internal: pool partner {r} missing"))
                    })?
                    .0
            }
        })
    }

    /// The members' residual streams at layer `l`, each brought to the
    /// item's length (positions a shorter member lacks take the item's own
    /// masked state there), the answer holder first.
    pub fn member_resids(&self, passes: &ItemPasses, l: usize) -> Result<Vec<Tensor>> {
        let own = passes.base.resid(l)?;
        self.members
            .iter()
            .map(|&m| {
                Ok(tolerable_carrier::inject::fit_positions(
                    Self::pass_of(passes, m)?.resid(l)?,
                    own,
                    1,
                )?)
            })
            .collect()
    }
}

impl Source for PoolSource {
    fn name(&self) -> &'static str {
        "pool"
    }

    fn needs(&self, base: Base, carrier: Carrier, layers: &[usize], needs: &mut PassNeeds) {
        for &m in &self.members {
            // The masked answer holder is the base pass, whatever the arm's base.
            let _ = base;
            if let PassRef::Partner(r) = m {
                needs.partners = needs.partners.max(r + 1);
            }
            if carrier == Carrier::H {
                needs.resid_of(m).extend(layers.iter().copied());
            }
        }
        // A trained router reads the receiver's own masked state.
        if self.trained.is_some() && carrier == Carrier::H {
            needs
                .resid_of(PassRef::ArmBase)
                .extend(layers.iter().copied());
        }
    }

    fn provide(
        &self,
        passes: &ItemPasses,
        _base: Base,
        carrier: Carrier,
        layers: &[usize],
        resources: &BTreeMap<String, Value>,
    ) -> Result<(CarrierValue, Geometry)> {
        if let Some((name, init)) = &self.trained {
            if carrier != Carrier::H {
                return Err(DriverError::Records(
                    "internal: a trained router routes the residual stream only".into(),
                ));
            }
            let v = resources.get(name).ok_or_else(|| {
                DriverError::Records(format!("internal: bridge `{name}` was not built"))
            })?;
            let b: &crate::resources::BridgeValue = crate::resources::bank::downcast(v, "bridge")?;
            let mut m = BTreeMap::new();
            for &l in layers {
                let router = b.router(l, *init)?;
                let members = self.member_resids(passes, l)?;
                m.insert(l, router.route(passes.base.resid(l)?, &members)?);
            }
            return Ok((CarrierValue::Resid(m), passes.geometry.clone()));
        }
        if self.append {
            // Each member's passage span, in member order (attention reads
            // a set: the order of appended entries does not matter, each
            // key keeps the RoPE of its own position).
            let mut pooled: Option<KvCache> = None;
            for &m in &self.members {
                let (pass, g) = Self::member(passes, m)?;
                let span = pass
                    .cache
                    .narrow(g.passage_start, g.context_len - g.passage_start)?;
                pooled = Some(match pooled {
                    None => span,
                    Some(mut acc) => {
                        acc.append_segment(&span)?;
                        acc
                    }
                });
            }
            let pooled =
                pooled.ok_or_else(|| DriverError::Records("internal: an empty pool".into()))?;
            let geometry = Geometry {
                passage_start: 0,
                context_len: pooled.len(),
                fact: Vec::new(),
            };
            return Ok((CarrierValue::Kv(pooled), geometry));
        }
        let pass_of = |m: PassRef| Self::pass_of(passes, m);
        // Every member is brought to the item's length (positions a shorter
        // member lacks take the item's own masked state there, weighted alike).
        let sum = |get: &dyn Fn(&Pass) -> Result<Tensor>, axis: usize| -> Result<Tensor> {
            let own = get(&passes.base)?;
            let mut acc: Option<Tensor> = None;
            for (&m, &w) in self.members.iter().zip(&self.weights) {
                let t = tolerable_carrier::inject::fit_positions(&get(pass_of(m)?)?, &own, axis)?;
                let t = (t * w)?;
                acc = Some(match acc {
                    None => t,
                    Some(a) => (a + t)?,
                });
            }
            acc.ok_or_else(|| DriverError::Records("internal: an empty pool".into()))
        };
        let value = if carrier == Carrier::H {
            let mut m = BTreeMap::new();
            for &l in layers {
                m.insert(l, sum(&|p: &Pass| Ok(p.resid(l)?.clone()), 1)?);
            }
            CarrierValue::Resid(m)
        } else {
            let mut c = passes.base.cache.clone();
            for l in 0..c.n_layers() {
                let k = sum(&|p: &Pass| Ok(p.cache.require_layer(l)?.k.clone()), 2)?;
                let v = sum(&|p: &Pass| Ok(p.cache.require_layer(l)?.v.clone()), 2)?;
                c.set_layer(l, k, v)?;
            }
            CarrierValue::Kv(c)
        };
        Ok((value, passes.geometry.clone()))
    }
}

/// A held-out sender's state (PROTOCOL §6): the sender, a model of the
/// receiver's geometry with other weights, reading the full passage; or a
/// cross-family holder's, projected into the receiver's geometry (reading
/// the item's passage, or a mis-source partner's: the mismatch control).
#[derive(Debug, Clone)]
pub struct SenderSource {
    /// The sender's key (`requantize=Q4_0`, `holder=<id>|projection=<name>`).
    pub key: String,
    /// The mis-source partner whose passage it reads, if not the item's.
    pub partner: Option<usize>,
}

impl Source for SenderSource {
    fn name(&self) -> &'static str {
        "sender"
    }

    fn needs(&self, _base: Base, carrier: Carrier, layers: &[usize], needs: &mut PassNeeds) {
        if let Some(r) = self.partner {
            needs.partners = needs.partners.max(r + 1);
        }
        let set = needs.senders.entry(self.key.clone()).or_default();
        if carrier == Carrier::H {
            set.extend(layers.iter().copied());
        }
    }

    fn provide(
        &self,
        passes: &ItemPasses,
        _base: Base,
        carrier: Carrier,
        layers: &[usize],
        _resources: &BTreeMap<String, Value>,
    ) -> Result<(CarrierValue, Geometry)> {
        let pass = passes.senders.get(&self.key).ok_or_else(|| {
            DriverError::Records(format!(
                "internal: the pass of sender `{}` is missing",
                self.key
            ))
        })?;
        let value = if carrier == Carrier::H {
            let mut m = BTreeMap::new();
            for &l in layers {
                m.insert(l, pass.resid(l)?.clone());
            }
            CarrierValue::Resid(m)
        } else {
            CarrierValue::Kv(pass.cache.clone())
        };
        let geometry = match self.partner {
            Some(r) => passes
                .partners
                .get(r)
                .ok_or_else(|| {
                    DriverError::Records(format!("internal: mis-source partner {r} missing"))
                })?
                .1
                .clone(),
            None => passes.geometry.clone(),
        };
        Ok((value, geometry))
    }
}
