//! The verification gates of PROTOCOL.md section 9 that concern the runtime:
//! parity with a reference implementation, rebuild of K/V from the residual
//! stream, and identity of the injection path. Each returns a report that is
//! stored with results; `passed` says whether the gate holds.

use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::hooks::{Edit, HookPoint, HookSpec, Intervention};
use crate::model::{LogitsAt, Model};
use crate::reference::Reference;
use crate::weights::Precision;
use serde::Serialize;

/// The SQuAD-style prompt whose greedy continuation an independent reference
/// (llama.cpp and transformers on the same GGUF) gives as
/// " Denver Broncos\nTo answer this question,".
pub const SQUAD_PROMPT: &str = "Context: Super Bowl 50 was an American football game to determine the champion of the National Football League (NFL) for the 2015 season. The American Football Conference (AFC) champion Denver Broncos defeated the National Football Conference (NFC) champion Carolina Panthers 24\u{2013}10 to earn their third Super Bowl title.\nQuestion: Which NFL team represented the AFC at Super Bowl 50?\nAnswer:";

/// Five parity prompts: SQuAD-style, code, chat-formatted, Unicode, plain prose.
pub fn parity_prompts() -> Vec<String> {
    vec![
        SQUAD_PROMPT.to_string(),
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n".to_string(),
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
            .to_string(),
        "Le café de la gare, près de Zürich — 東京から来た友達と話した。".to_string(),
        "The quick brown fox jumps over the lazy dog. The dog".to_string(),
    ]
}

/// Tolerance of the f32 parity gate: max |logit difference| at any position.
pub const PARITY_F32_TOL: f32 = 1e-3;
/// Tolerance of the rebuild gate: max |K or V deviation|.
pub const REBUILD_TOL: f32 = 1e-4;

/// Parity on one prompt.
#[derive(Debug, Clone, Serialize)]
pub struct PromptParity {
    /// Prompt tokens.
    pub n_prompt_tokens: usize,
    /// Max |ours − reference| over every position's logits.
    pub max_abs_logit_diff: f32,
    /// Positions whose argmax agrees, out of `n_prompt_tokens`.
    pub argmax_agree: usize,
    /// Our greedy continuation.
    pub ours: String,
    /// The reference's greedy continuation.
    pub reference: String,
    /// Whether the two continuations are the same string.
    pub continuation_equal: bool,
}

/// The parity gate's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct ParityReport {
    /// The precision compared (f32: exact gate; quantized: reported only).
    pub precision: Precision,
    /// Tolerance applied to the logits (f32 only).
    pub tolerance: f32,
    /// One entry per prompt.
    pub prompts: Vec<PromptParity>,
    /// Whether the gate holds: in f32, every prompt within tolerance and
    /// string-identical; in quantized form, continuations identical on at
    /// least all but one prompt (QMatMul's 8-bit activations may flip near-ties).
    pub passed: bool,
}

/// Compares `ck`'s forward with candle-transformers' model of the same GGUF
/// file on `prompts`, `n_new` greedy tokens each.
pub fn parity(ck: &Checkpoint, prompts: &[String], n_new: usize) -> Result<ParityReport> {
    parity_with_progress(ck, prompts, n_new, &mut |_, _| {})
}

/// As [`parity`], calling `done(k, n)` after each of the `n` prompts (for a
/// progress display: the gate takes about a minute on the 0.5B).
pub fn parity_with_progress(
    ck: &Checkpoint,
    prompts: &[String],
    n_new: usize,
    done: &mut dyn FnMut(usize, usize),
) -> Result<ParityReport> {
    let model = &ck.model;
    let mut reference = Reference::load(&ck.path, model.precision(), model.device())?;
    let mut out = Vec::new();
    for p in prompts {
        let ids = ck.tokenizer.encode(p)?;
        let mut cache = model.new_cache(1);
        let fwd = model.forward(
            &model.tokens(std::slice::from_ref(&ids))?,
            &mut cache,
            &HookSpec::new(),
            LogitsAt::All,
        )?;
        let ours_logits = fwd.logits.expect("logits").squeeze(0)?;
        let ref_logits = reference.logits_per_position(&ids)?;
        let diff = (&ours_logits - &ref_logits)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        let a: Vec<u32> = ours_logits.argmax(1)?.to_vec1()?;
        let b: Vec<u32> = ref_logits.argmax(1)?.to_vec1()?;
        let agree = a.iter().zip(&b).filter(|(x, y)| x == y).count();
        // Decode on from the cache the logit pass built: no second prefill.
        let last = ours_logits.narrow(0, ids.len() - 1, 1)?;
        let g = model.decode_from(&last, &mut cache, &crate::GreedyOptions::tokens(n_new))?;
        let ours = ck.tokenizer.decode(&g.tokens[0])?;
        let reference_ids = reference.greedy(&ids, n_new)?;
        let reference_text = ck.tokenizer.decode(&reference_ids)?;
        out.push(PromptParity {
            n_prompt_tokens: ids.len(),
            max_abs_logit_diff: diff,
            argmax_agree: agree,
            continuation_equal: ours == reference_text,
            ours,
            reference: reference_text,
        });
        done(out.len(), prompts.len());
    }
    let passed = match model.precision() {
        Precision::F32 => out
            .iter()
            .all(|p| p.max_abs_logit_diff <= PARITY_F32_TOL && p.continuation_equal),
        Precision::Quantized => out.iter().filter(|p| !p.continuation_equal).count() <= 1,
    };
    Ok(ParityReport {
        precision: model.precision(),
        tolerance: PARITY_F32_TOL,
        prompts: out,
        passed,
    })
}

/// The rebuild gate's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct RebuildReport {
    /// Max |K deviation| per layer.
    pub max_abs_k: Vec<f32>,
    /// Max |V deviation| per layer.
    pub max_abs_v: Vec<f32>,
    /// The tolerance.
    pub tolerance: f32,
    /// Whether every layer is within tolerance.
    pub passed: bool,
}

/// Whether two tensors hold the same f32 bit patterns.
pub fn bit_equal(a: &candle_core::Tensor, b: &candle_core::Tensor) -> Result<bool> {
    if a.dims() != b.dims() {
        return Ok(false);
    }
    let x = a.flatten_all()?.to_vec1::<f32>()?;
    let y = b.flatten_all()?.to_vec1::<f32>()?;
    Ok(x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()))
}

fn max_abs_diff(a: &candle_core::Tensor, b: &candle_core::Tensor) -> Result<f32> {
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

/// Recomputes every layer's keys and values from the captured residual
/// stream through that layer's own norm and projections, and compares them
/// with the cache the forward built.
pub fn rebuild(model: &Model, ids: &[u32]) -> Result<RebuildReport> {
    let n = model.config().n_layers;
    let spec = HookSpec::new().capture_all((0..n).map(HookPoint::ResidPre));
    let mut cache = model.new_cache(1);
    let out = model.forward(
        &model.tokens(&[ids.to_vec()])?,
        &mut cache,
        &spec,
        LogitsAt::None,
    )?;
    let (mut mk, mut mv) = (Vec::new(), Vec::new());
    for l in 0..n {
        let resid = out.hooks.require(HookPoint::ResidPre(l))?;
        let kv = model.rebuild_kv(l, resid, 0)?;
        let c = cache.require_layer(l)?;
        mk.push(max_abs_diff(&kv.k, &c.k)?);
        mv.push(max_abs_diff(&kv.v, &c.v)?);
    }
    let passed = mk.iter().chain(&mv).all(|&d| d <= REBUILD_TOL);
    Ok(RebuildReport {
        max_abs_k: mk,
        max_abs_v: mv,
        tolerance: REBUILD_TOL,
        passed,
    })
}

/// The identity gate's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct IdentityReport {
    /// Prefix (passage) tokens whose cache was captured and put back.
    pub n_prefix_tokens: usize,
    /// Suffix (question) tokens run on top.
    pub n_suffix_tokens: usize,
    /// Whether re-injecting the captured keys and values at every position
    /// through hook interventions rebuilt the cache bit-exactly.
    pub hook_injection_bit_exact: bool,
    /// Whether the suffix's logits on a cache assembled from the captured
    /// tensors (`KvCache::set_layer`) equal the native ones bit-exactly.
    pub cache_injection_bit_exact: bool,
    /// Max |difference| of the suffix logits (0 when bit-exact).
    pub max_abs_logit_diff: f32,
    /// Whether both paths are bit-exact.
    pub passed: bool,
}

/// Captures the full cache of `prefix`, feeds it back through the injection
/// paths (hook replacement during the prefill; cache assembly from captured
/// tensors), runs `suffix` on top and checks the logits bit for bit.
pub fn identity(model: &Model, prefix: &[u32], suffix: &[u32]) -> Result<IdentityReport> {
    let n = model.config().n_layers;
    let capture =
        HookSpec::new().capture_all((0..n).flat_map(|l| [HookPoint::RotK(l), HookPoint::V(l)]));
    let mut native = model.new_cache(1);
    let cap = model.forward(
        &model.tokens(&[prefix.to_vec()])?,
        &mut native,
        &capture,
        LogitsAt::None,
    )?;
    // Path 1: replace every layer's keys and values with the captured ones.
    let all: Vec<usize> = (0..prefix.len()).collect();
    let mut inject = HookSpec::new();
    for l in 0..n {
        for p in [HookPoint::RotK(l), HookPoint::V(l)] {
            inject = inject.intervene(
                Intervention::new(p, Edit::Replace(cap.hooks.require(p)?.clone()))
                    .at_positions(all.clone()),
            );
        }
    }
    let mut via_hooks = model.new_cache(1);
    model.forward(
        &model.tokens(&[prefix.to_vec()])?,
        &mut via_hooks,
        &inject,
        LogitsAt::None,
    )?;
    let mut hook_exact = true;
    for l in 0..n {
        let (a, b) = (native.require_layer(l)?, via_hooks.require_layer(l)?);
        hook_exact &= bit_equal(&a.k, &b.k)? && bit_equal(&a.v, &b.v)?;
    }
    // Path 2: a cache assembled from the captured tensors.
    let mut assembled = native.clone();
    for l in 0..n {
        assembled.set_layer(
            l,
            cap.hooks.require(HookPoint::RotK(l))?.clone(),
            cap.hooks.require(HookPoint::V(l))?.clone(),
        )?;
    }
    let q = model.tokens(&[suffix.to_vec()])?;
    let a = model
        .forward(&q, &mut native.clone(), &HookSpec::new(), LogitsAt::All)?
        .logits
        .expect("logits");
    let b = model
        .forward(&q, &mut assembled, &HookSpec::new(), LogitsAt::All)?
        .logits
        .expect("logits");
    let c = model
        .forward(&q, &mut via_hooks, &HookSpec::new(), LogitsAt::All)?
        .logits
        .expect("logits");
    let d_ab = max_abs_diff(&a, &b)?;
    let d_ac = max_abs_diff(&a, &c)?;
    let cache_exact = bit_equal(&a, &b)?;
    hook_exact &= bit_equal(&a, &c)?;
    Ok(IdentityReport {
        n_prefix_tokens: prefix.len(),
        n_suffix_tokens: suffix.len(),
        hook_injection_bit_exact: hook_exact,
        cache_injection_bit_exact: cache_exact,
        max_abs_logit_diff: d_ab.max(d_ac),
        passed: hook_exact && cache_exact,
    })
}
