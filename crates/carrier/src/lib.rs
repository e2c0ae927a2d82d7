//! Carriers — keys K, values V and the residual-stream activation h — and the
//! operations an arm performs on them: choosing sites (layers, positions,
//! heads), injecting a source by replacement, interpolation, addition or
//! appending as extra attendable segments, perturbing a carrier to a target
//! fidelity, and measuring that fidelity. For the on-manifold arms, key
//! banks of genuine keys ([`bank`]: nearest genuine neighbours) and codebooks
//! fitted on them ([`codebook`]: k-means, PCA and random-subset codebooks,
//! and snapping to them). How attention reads a key slot ([`readout`]:
//! readout gains, their analytic bound, quantization against noise). The
//! per-token router over a pool of holders ([`router`]), whose maps a
//! bridge trains.
//!
//! Everything here works on the runtime's values ([`KvCache`] and residual
//! tensors `[batch, seq, d_model]`); which source fills a slot is the
//! driver's business.
//!
//! [`KvCache`]: tolerable_runtime::KvCache
#![warn(missing_docs)]

pub mod bank;
pub mod codebook;
pub mod error;
pub mod fidelity;
pub mod fit;
pub mod inject;
pub mod perturb;
pub mod readout;
mod rng;
pub mod router;
pub mod sites;

pub use bank::{at_target_cosine, gather_rows, sample_rows, top_k_cosine, Neighbours};
pub use codebook::{Codebook, Construction, Snapping};
pub use error::{CarrierError, Result};
pub use fidelity::{kv_fidelity, logit_correlation, mean_vector_cosine, site_cosine};
pub use inject::{append_kv, edit_kv, edit_resid, KvSites};
pub use perturb::Perturbation;
pub use rng::uniform_symmetric;
pub use router::RouterLayer;
pub use sites::{Carrier, Geometry, LayerSet, Mechanism, Positions};
