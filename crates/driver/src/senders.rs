//! Held-out senders (PROTOCOL §6): holders of the receiver's exact geometry
//! and tokenizer with other weights, built from the receiver — its f32
//! weights re-quantized to another GGUF type through candle's quantizer and
//! read back, or perturbed by calibrated weight noise — since no checkpoint
//! of the receivers' geometry with other weights exists on the registries.
//! Each passes three gates before use: the exact cache shape, finite values,
//! measurable distinctness; its cache cosine to the receiver's is recorded.

use crate::error::{DriverError, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tolerable_runtime::{HookSpec, KvCache, LogitsAt, Model};

/// How a held-out sender is made from the receiver.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SenderSpec {
    /// Every weight matrix quantized to this GGUF type and read back.
    Requantize(String),
    /// Every weight matrix moved by isotropic Gaussian noise to this cosine
    /// to the original (per matrix, seeded by the matrix's name).
    WeightCosine(f64),
}

impl SenderSpec {
    /// A short key naming the sender in plans and records (`requantize=Q4_0`).
    pub fn key(&self) -> String {
        match self {
            SenderSpec::Requantize(t) => format!("requantize={t}"),
            SenderSpec::WeightCosine(c) => format!("weight_cosine={c}"),
        }
    }
}

/// The GGUF types a sender can be re-quantized to.
pub fn ggml_type(name: &str) -> Option<GgmlDType> {
    Some(match name.to_ascii_uppercase().replace('_', "").as_str() {
        "Q80" => GgmlDType::Q8_0,
        "Q51" => GgmlDType::Q5_1,
        "Q50" => GgmlDType::Q5_0,
        "Q41" => GgmlDType::Q4_1,
        "Q40" => GgmlDType::Q4_0,
        "Q6K" => GgmlDType::Q6K,
        "Q5K" => GgmlDType::Q5K,
        "Q4K" => GgmlDType::Q4K,
        "Q3K" => GgmlDType::Q3K,
        "Q2K" => GgmlDType::Q2K,
        _ => return None,
    })
}

/// The 32-wide block type a k-quant falls back to on a matrix whose rows are
/// not a multiple of 256 (as llama.cpp's converter does): the nearest in bits.
fn fallback(t: GgmlDType) -> GgmlDType {
    match t {
        GgmlDType::Q6K => GgmlDType::Q5_1,
        GgmlDType::Q5K => GgmlDType::Q5_0,
        GgmlDType::Q4K => GgmlDType::Q4_1,
        GgmlDType::Q3K | GgmlDType::Q2K => GgmlDType::Q4_0,
        other => other,
    }
}

/// What building and gating a sender found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SenderReport {
    /// Matrices by the GGUF type they were quantized to (falls back named).
    pub matrix_types: BTreeMap<String, usize>,
    /// Mean cosine of weight matrices to the receiver's.
    pub weight_cosine: f64,
    /// Mean per-vector cosine of its keys and values to the receiver's on
    /// the gate prompt (every layer and position).
    pub cache_cosine: f64,
    /// Largest |logit difference| to the receiver at the gate prompt's last position.
    pub max_abs_logit_diff: f32,
    /// The gates: cache shape equal, values finite, measurably distinct.
    pub shape_equal: bool,
    /// Every cache value and logit finite.
    pub finite: bool,
    /// Its logits differ from the receiver's.
    pub distinct: bool,
    /// All three gates hold.
    pub passed: bool,
}

fn flat(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_vec1()?)
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    tolerable_carrier::fidelity::vector_cosine(a, b)
}

/// Builds the sender of `spec` from `receiver` and gates it on `prompt`.
pub fn build(receiver: &Model, spec: &SenderSpec, prompt: &[u32]) -> Result<(Model, SenderReport)> {
    let mut report = SenderReport::default();
    let mut cosines = Vec::new();
    let sender = receiver.map_weights(&mut |name, w| {
        let out = match spec {
            SenderSpec::Requantize(t) => {
                let want = ggml_type(t).ok_or_else(|| {
                    tolerable_runtime::RuntimeError::BadIntervention {
                        site: "requantize".into(),
                        reason: format!("unknown GGUF type `{t}`"),
                    }
                })?;
                let cols = w.dims()[w.rank() - 1];
                let used = if cols % want.block_size() == 0 {
                    want
                } else {
                    fallback(want)
                };
                *report.matrix_types.entry(format!("{used:?}")).or_default() += 1;
                // A fresh tensor: candle's quantizer reads the storage from
                // its start, so a narrowed matrix (the fused q/k/v rows, at an
                // offset) would be read in the wrong place.
                let own =
                    Tensor::from_vec(w.flatten_all()?.to_vec1::<f32>()?, w.dims(), w.device())?;
                QTensor::quantize(&own, used)?.dequantize(w.device())?
            }
            SenderSpec::WeightCosine(c) => {
                let seed = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                    (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
                });
                tolerable_carrier::Perturbation::CosineNoise { target_cosine: *c }
                    .apply(w, None, seed)
                    .map_err(|e| tolerable_runtime::RuntimeError::BadIntervention {
                        site: "weight noise".into(),
                        reason: e.to_string(),
                    })?
            }
        };
        let (a, b) = (
            w.flatten_all()?.to_vec1::<f32>()?,
            out.flatten_all()?.to_vec1::<f32>()?,
        );
        cosines.push(cosine(&a, &b));
        Ok(out)
    })?;
    report.weight_cosine = cosines.iter().sum::<f64>() / cosines.len().max(1) as f64;
    // The gates on one prompt: shape, finiteness, distinctness, cache cosine.
    let run = |m: &Model| -> Result<(KvCache, Tensor)> {
        let mut c = m.new_cache(1);
        let out = m.forward(
            &m.tokens(&[prompt.to_vec()])?,
            &mut c,
            &HookSpec::new(),
            LogitsAt::Last,
        )?;
        Ok((c, out.logits.expect("logits asked for")))
    };
    let (rc, rl) = run(receiver)?;
    let (sc, sl) = run(&sender)?;
    report.shape_equal = rc.n_layers() == sc.n_layers()
        && rc.len() == sc.len()
        && (0..rc.n_layers()).all(|l| {
            matches!((rc.layer(l), sc.layer(l)), (Some(a), Some(b)) if a.k.dims() == b.k.dims() && a.v.dims() == b.v.dims())
        });
    let mut finite = flat(&sl)?.iter().all(|x| x.is_finite());
    let mut cos = Vec::new();
    for l in 0..sc.n_layers() {
        let (a, b) = (rc.require_layer(l)?, sc.require_layer(l)?);
        for (x, y) in [(&a.k, &b.k), (&a.v, &b.v)] {
            let yv = flat(y)?;
            finite &= yv.iter().all(|v| v.is_finite());
            cos.push(tolerable_carrier::fidelity::mean_vector_cosine(
                y, x, 2, None,
            )?);
        }
    }
    report.finite = finite;
    report.cache_cosine = cos.iter().sum::<f64>() / cos.len().max(1) as f64;
    report.max_abs_logit_diff = (&sl - &rl)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?;
    report.distinct = report.max_abs_logit_diff > 0.0;
    report.passed = report.shape_equal && report.finite && report.distinct;
    if !report.passed {
        return Err(DriverError::Gate(format!(
            "sender `{}` fails its gates (shape equal {}, finite {}, distinct {}): no eval item runs",
            spec.key(),
            report.shape_equal,
            report.finite,
            report.distinct
        )));
    }
    Ok((sender, report))
}
