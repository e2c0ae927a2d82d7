//! The reference implementation the parity gate compares against:
//! candle-transformers' `quantized_qwen2` / `quantized_llama` on the same GGUF
//! file, in f32 (every weight dequantized, as `CANDLE_DEQUANTIZE_ALL=1` makes
//! it) or on the quantized blocks.

use crate::config::Arch;
use crate::error::{Result, RuntimeError};
use crate::weights::Precision;
use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor, D};
use candle_transformers::models::{quantized_llama, quantized_qwen2};
use std::path::Path;
use std::sync::Mutex;

/// Serialises reference loads: the dequantize switch is an environment
/// variable read once per thread.
static LOAD_LOCK: Mutex<()> = Mutex::new(());

enum Inner {
    Qwen2(quantized_qwen2::ModelWeights),
    Llama(quantized_llama::ModelWeights),
}

/// candle-transformers' model of a GGUF file.
pub struct Reference {
    inner: Inner,
    device: Device,
}

impl Reference {
    /// Loads the reference model of `path` in `precision`.
    pub fn load(path: &Path, precision: Precision, device: &Device) -> Result<Self> {
        let _guard = LOAD_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let path = path.to_path_buf();
        let dev = device.clone();
        // A fresh thread reads CANDLE_DEQUANTIZE_ALL when it first builds a
        // QMatMul; the variable is set only for the duration of the load.
        let dequantize = precision == Precision::F32;
        if dequantize {
            std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
        } else {
            std::env::remove_var("CANDLE_DEQUANTIZE_ALL");
        }
        let handle = std::thread::spawn(move || -> Result<Inner> {
            let bad = |e: candle_core::Error| RuntimeError::ModelFile {
                path: path.clone(),
                reason: format!("reference load: {e}"),
            };
            let mut f = std::fs::File::open(&path)?;
            let ct = gguf_file::Content::read(&mut f).map_err(bad)?;
            let arch = crate::config::ModelConfig::from_gguf(&ct)?.arch;
            Ok(match arch {
                Arch::Qwen2 => Inner::Qwen2(
                    quantized_qwen2::ModelWeights::from_gguf(ct, &mut f, &dev).map_err(bad)?,
                ),
                Arch::Llama => Inner::Llama(
                    quantized_llama::ModelWeights::from_gguf(ct, &mut f, &dev).map_err(bad)?,
                ),
            })
        });
        let inner = handle.join().expect("reference loader panicked");
        std::env::remove_var("CANDLE_DEQUANTIZE_ALL");
        Ok(Self {
            inner: inner?,
            device: device.clone(),
        })
    }

    fn step(&mut self, ids: &[u32], index_pos: usize) -> Result<Tensor> {
        let x = Tensor::new(ids, &self.device)?.unsqueeze(0)?;
        let out = match &mut self.inner {
            Inner::Qwen2(m) => m.forward(&x, index_pos)?,
            Inner::Llama(m) => m.forward(&x, index_pos)?,
        };
        Ok(out.squeeze(0)?)
    }

    /// Logits `[len, vocab]` at every position of `ids`, fed one token at a
    /// time through the reference's own KV cache.
    pub fn logits_per_position(&mut self, ids: &[u32]) -> Result<Tensor> {
        let mut rows = Vec::with_capacity(ids.len());
        for (i, id) in ids.iter().enumerate() {
            rows.push(self.step(&[*id], i)?);
        }
        Ok(Tensor::stack(&rows, 0)?)
    }

    /// Logits at the last position of a prompt run in one call (the
    /// reference's batched prefill), starting a fresh sequence.
    pub fn last_logits(&mut self, ids: &[u32]) -> Result<Tensor> {
        self.step(ids, 0)
    }

    /// The logits after one more token `id` at position `index_pos` of the
    /// sequence in the reference's own cache (a decoding step).
    pub fn next_logits(&mut self, id: u32, index_pos: usize) -> Result<Tensor> {
        self.step(&[id], index_pos)
    }

    /// Greedy continuation of `ids`: prefill in one call, then `n` tokens.
    pub fn greedy(&mut self, ids: &[u32], n: usize) -> Result<Vec<u32>> {
        let mut logits = self.step(ids, 0)?;
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let next = logits.argmax(D::Minus1)?.to_scalar::<u32>()?;
            out.push(next);
            if i + 1 < n {
                logits = self.step(&[next], ids.len() + i)?;
            }
        }
        Ok(out)
    }
}
