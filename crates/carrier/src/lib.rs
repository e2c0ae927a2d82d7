//! Carriers — keys K, values V and the residual-stream activation h — and the
//! operations an arm performs on them: choosing sites (layers, positions,
//! heads), injecting a source by replacement, interpolation, addition or
//! appending as extra attendable segments, perturbing a carrier to a target
//! fidelity, and measuring that fidelity.
//!
//! Everything here works on the runtime's values ([`KvCache`] and residual
//! tensors `[batch, seq, d_model]`); which source fills a slot is the
//! driver's business.
//!
//! [`KvCache`]: tolerable_runtime::KvCache

pub mod error;
pub mod fidelity;
pub mod inject;
pub mod perturb;
pub mod sites;

pub use error::{CarrierError, Result};
pub use inject::{append_kv, edit_kv, edit_resid, KvSites};
pub use perturb::Perturbation;
pub use sites::{Carrier, Geometry, LayerSet, Mechanism, Positions};
