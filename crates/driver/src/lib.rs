//! Experiments as sets of arms: the arm grammar, sweep configs and their
//! validation, the runner that shares each item's work across arms and
//! batches them, Parquet records with provenance, resumable sharded
//! sweeps, and reports.

pub mod arm;
pub mod config;
pub mod data;
pub mod error;
pub mod gates;
pub mod records;
pub mod report;
pub mod runner;
pub mod sweep;

pub use arm::{Arm, Base, Expect, Injection, Source};
pub use config::{PlannedArm, SweepConfig};
pub use error::{DriverError, Result};
pub use runner::{ArmOutcome, Batching, ItemTiming, Runner};
pub use sweep::{SweepOptions, SweepOutcome};
