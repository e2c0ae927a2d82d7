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
pub use runner::{ArmOutcome, Batching, ItemJob, ItemTiming, Runner};
pub use sweep::{SweepOptions, SweepOutcome};

/// What the crate's unit tests share: a tiny random model written as a
/// real GGUF file and loaded as a checkpoint.
#[cfg(test)]
pub(crate) mod test_support {
    /// A tiny Qwen2-style checkpoint written into `dir`.
    pub fn tiny_checkpoint(dir: &std::path::Path) -> tolerable_runtime::Checkpoint {
        use tolerable_testkit::tiny::{write_gguf, TinySpec};
        let path = dir.join("tiny.gguf");
        write_gguf(
            &TinySpec {
                context_length: 1024,
                ..TinySpec::default()
            },
            &path,
        )
        .unwrap();
        tolerable_fetch::load(
            path.to_str().unwrap(),
            tolerable_runtime::Precision::F32,
            &candle_core::Device::Cpu,
        )
        .unwrap()
    }
}
