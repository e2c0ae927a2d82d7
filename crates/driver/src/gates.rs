//! The verification gates run before any record is written (PROTOCOL §9):
//! parity against the reference implementation, rebuild of keys and values
//! from the residual stream, and identity through the injection paths.

use crate::error::Result;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use tolerable_runtime::gates::{self, parity_prompts, SQUAD_PROMPT};
use tolerable_runtime::{Checkpoint, Precision};

/// Runs parity (f32; optionally also quantized), rebuild and identity on
/// `ck` and returns their reports with an overall `passed`.
pub fn run_all(ck: &Checkpoint, quantized: bool) -> Result<serde_json::Value> {
    let prompts = parity_prompts();
    // Parity prompts, then rebuild and identity: a step each.
    let bar = ProgressBar::new(prompts.len() as u64 + 2);
    bar.set_style(
        ProgressStyle::with_template("gates {bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let headless = !std::io::stderr().is_terminal();
    let step = |what: String| {
        bar.inc(1);
        if headless {
            tracing::info!("gates: {what}");
        }
        bar.set_message(what);
    };
    tracing::info!(
        "gates: parity against candle-transformers on {} prompts, then rebuild and identity",
        prompts.len()
    );
    let parity = gates::parity_with_progress(ck, &prompts, 8, &mut |k, n| {
        step(format!("parity prompt {k}/{n} done"))
    })?;
    let ids = ck.tokenizer.encode(SQUAD_PROMPT)?;
    let rebuild = gates::rebuild(&ck.model, &ids)?;
    step("rebuild done".into());
    let split = ids.len().saturating_sub(14).max(1);
    let identity = gates::identity(&ck.model, &ids[..split], &ids[split..])?;
    step("identity done".into());
    bar.finish_and_clear();
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
