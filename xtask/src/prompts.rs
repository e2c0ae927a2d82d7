//! The gate runner: every runtime gate on one model, as one JSON report
//! (the driver's gate set, which sweeps also run before writing records).

use anyhow::Result;
use tolerable_runtime::Checkpoint;

/// Runs parity (f32; optionally quantized), rebuild and identity on `ck` and
/// returns their reports with an overall `passed`.
pub fn run_gates(ck: &Checkpoint, quantized: bool) -> Result<serde_json::Value> {
    Ok(tolerable_driver::gates::run_all(ck, quantized)?)
}
