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
    /// from (a partner's differs from the item's).
    fn provide(
        &self,
        passes: &ItemPasses,
        base: Base,
        carrier: Carrier,
        layers: &[usize],
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
