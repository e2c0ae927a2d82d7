//! The verification gates run before any record is written (PROTOCOL §9):
//! parity against the reference implementation, rebuild of keys and values
//! from the residual stream, and identity through the injection paths.

use crate::error::Result;
use tolerable_runtime::gates::{self, parity_prompts, SQUAD_PROMPT};
use tolerable_runtime::{Checkpoint, Precision};

/// Runs parity (f32; optionally also quantized), rebuild and identity on
/// `ck` and returns their reports with an overall `passed`.
pub fn run_all(ck: &Checkpoint, quantized: bool) -> Result<serde_json::Value> {
    let prompts = parity_prompts();
    let parity = gates::parity(ck, &prompts, 8)?;
    let ids = ck.tokenizer.encode(SQUAD_PROMPT)?;
    let rebuild = gates::rebuild(&ck.model, &ids)?;
    let split = ids.len().saturating_sub(14).max(1);
    let identity = gates::identity(&ck.model, &ids[..split], &ids[split..])?;
    let mut passed = parity.passed && rebuild.passed && identity.passed;
    let mut out = serde_json::json!({
        "model": ck.id,
        "sha256": ck.sha256,
        "parity_f32": parity,
        "rebuild": rebuild,
        "identity": identity,
    });
    if quantized {
        let q = Checkpoint::load_gguf(
            &ck.id,
            &ck.path,
            ck.sha256.clone(),
            Precision::Quantized,
            ck.model.device(),
        )?;
        let pq = gates::parity(&q, &prompts, 8)?;
        passed &= pq.passed;
        out["parity_quantized"] = serde_json::to_value(pq).unwrap_or_default();
    }
    out["passed"] = passed.into();
    Ok(out)
}
