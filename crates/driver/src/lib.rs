//! Experiments as sets of arms. A sweep config (the arm grammar, [`arm`],
//! [`config`]) compiles into a [`plan`]: the passes each item needs, the
//! resources the arms read, and one program per arm — a source
//! ([`sources`]), a chain of transforms ([`transforms`]) and a mechanism per
//! injection. Resources ([`resources`]: the key bank, codebooks) are fitted
//! on training items and cached by content hash. The [`runner`] is the
//! per-item loop: shared passes ([`passes`]), programs ([`exec`]), batched
//! decoding. [`records`] writes Parquet declared once; [`sweep`] makes runs
//! resumable and sharded; [`report`] draws them. Measurements that are not
//! arms (Mode D's activation deltas for code edits) are [`measure`] runs,
//! recorded with the same provenance.
#![warn(missing_docs)]

pub mod arm;
pub mod config;
pub mod cross;
pub mod error;
pub mod exec;
pub mod gates;
pub mod items;
pub mod measure;
pub mod passes;
pub mod plan;
pub mod records;
pub mod report;
pub mod resources;
pub mod runner;
pub mod senders;
pub mod sources;
pub mod sweep;
pub mod transforms;

pub use arm::{Arm, Base, Expect, Injection, Source};
pub use config::{PlannedArm, SweepConfig};
pub use error::{DriverError, Result};
pub use plan::{compile, Plan};
pub use runner::{ArmOutcome, Batching, ItemTiming, Runner};
pub use sweep::{SweepOptions, SweepOutcome};
