//! The fixed prompts the gates run on, and the gate runner.

use anyhow::Result;
use tolerable_runtime::{gates, Checkpoint, Precision};

/// The SQuAD-style prompt whose greedy continuation an independent reference
/// (llama.cpp and transformers on the same GGUF) gives as
/// " Denver Broncos\nTo answer this question,".
pub const SQUAD_PROMPT: &str = "Context: Super Bowl 50 was an American football game to determine the champion of the National Football League (NFL) for the 2015 season. The American Football Conference (AFC) champion Denver Broncos defeated the National Football Conference (NFC) champion Carolina Panthers 24\u{2013}10 to earn their third Super Bowl title.\nQuestion: Which NFL team represented the AFC at Super Bowl 50?\nAnswer:";

/// Five parity prompts: SQuAD-style, code, chat-formatted, Unicode, plain prose.
pub fn parity_prompts() -> Vec<String> {
    vec![
        SQUAD_PROMPT.to_string(),
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n".to_string(),
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n".to_string(),
        "Le café de la gare, près de Zürich — 東京から来た友達と話した。".to_string(),
        "The quick brown fox jumps over the lazy dog. The dog".to_string(),
    ]
}

/// Runs parity (f32; optionally quantized), rebuild and identity on `ck` and
/// returns their reports with an overall `passed`.
pub fn run_gates(ck: &Checkpoint, quantized: bool) -> Result<serde_json::Value> {
    let prompts = parity_prompts();
    let parity = gates::parity(ck, &prompts, 8)?;
    let ids = ck.tokenizer.encode(SQUAD_PROMPT)?;
    let rebuild = gates::rebuild(&ck.model, &ids)?;
    let split = ids.len() - 14;
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
        let q = Checkpoint::load_gguf(&ck.id, &ck.path, ck.sha256.clone(), Precision::Quantized, ck.model.device())?;
        let pq = gates::parity(&q, &prompts, 8)?;
        passed &= pq.passed;
        out["parity_quantized"] = serde_json::to_value(pq)?;
    }
    out["passed"] = passed.into();
    Ok(out)
}
