//! What a checkpoint's architecture is: layer count, widths, heads, RoPE, norms.
//!
//! Read from GGUF metadata (`{arch}.block_count`, ...) or from a Hugging Face
//! `config.json`.

use crate::error::{Result, RuntimeError};
use candle_core::quantized::gguf_file;
use serde::{Deserialize, Serialize};

/// The decoder families the runtime implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Qwen2 / Qwen2.5: q, k and v projections carry biases.
    Qwen2,
    /// Llama (SmolLM2 and friends): no attention biases.
    Llama,
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Arch::Qwen2 => "qwen2",
            Arch::Llama => "llama",
        })
    }
}

/// How rotary position embedding pairs the coordinates of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeStyle {
    /// Coordinate i pairs with i + head_dim/2 (GPT-NeoX / Hugging Face layout).
    Half,
    /// Coordinate 2i pairs with 2i+1 (original Llama / GGML layout of llama GGUFs).
    Interleaved,
}

/// The architecture of one checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Decoder family.
    pub arch: Arch,
    /// Number of transformer blocks (L).
    pub n_layers: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Number of query heads.
    pub n_heads: usize,
    /// Number of key/value heads (grouped-query attention).
    pub n_kv_heads: usize,
    /// Width of one attention head.
    pub head_dim: usize,
    /// Hidden width of the SwiGLU MLP.
    pub d_ffn: usize,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// RoPE pairing layout.
    pub rope_style: RopeStyle,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// Longest sequence (positions) the model supports.
    pub context_length: usize,
}

impl ModelConfig {
    /// Query heads per key/value head (G).
    pub fn group_size(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    /// Whether q, k and v projections have biases.
    pub fn qkv_bias(&self) -> bool {
        self.arch == Arch::Qwen2
    }

    /// Reads the architecture from a GGUF file's metadata; `vocab_size` comes
    /// from the embedding tensor's shape.
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self> {
        let arch_name = md_string(ct, "general.architecture")?;
        let arch = match arch_name.as_str() {
            "qwen2" => Arch::Qwen2,
            "llama" => Arch::Llama,
            other => return Err(RuntimeError::UnsupportedArch(other.to_string())),
        };
        let key = |k: &str| format!("{arch_name}.{k}");
        let n_layers = md_u32(ct, &key("block_count"))? as usize;
        let d_model = md_u32(ct, &key("embedding_length"))? as usize;
        let n_heads = md_u32(ct, &key("attention.head_count"))? as usize;
        let n_kv_heads = md_u32(ct, &key("attention.head_count_kv"))
            .map(|v| v as usize)
            .unwrap_or(n_heads);
        let d_ffn = md_u32(ct, &key("feed_forward_length"))? as usize;
        let context_length = md_u32(ct, &key("context_length"))? as usize;
        let rms_eps = md_f32(ct, &key("attention.layer_norm_rms_epsilon"))? as f64;
        let rope_theta = md_f32(ct, &key("rope.freq_base")).unwrap_or(10_000.0) as f64;
        let head_dim = match md_u32(ct, &key("rope.dimension_count")) {
            Ok(d) => d as usize,
            Err(_) => d_model / n_heads,
        };
        let embd =
            ct.tensor_infos
                .get("token_embd.weight")
                .ok_or_else(|| RuntimeError::Tensor {
                    name: "token_embd.weight".into(),
                    reason: "absent".into(),
                })?;
        let vocab_size = embd.shape.dims()[0];
        // llama.cpp permutes llama q/k weights into the interleaved RoPE
        // layout when writing GGUF; qwen2 is written in the NeoX layout.
        let rope_style = match arch {
            Arch::Llama => RopeStyle::Interleaved,
            Arch::Qwen2 => RopeStyle::Half,
        };
        let cfg = Self {
            arch,
            n_layers,
            d_model,
            n_heads,
            n_kv_heads,
            head_dim,
            d_ffn,
            vocab_size,
            rope_theta,
            rope_style,
            rms_eps,
            context_length,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads the architecture from a Hugging Face `config.json`.
    pub fn from_hf_json(text: &str) -> Result<Self> {
        #[derive(Deserialize)]
        struct Hf {
            #[serde(default)]
            model_type: Option<String>,
            #[serde(default)]
            architectures: Vec<String>,
            num_hidden_layers: usize,
            hidden_size: usize,
            num_attention_heads: usize,
            num_key_value_heads: Option<usize>,
            head_dim: Option<usize>,
            intermediate_size: usize,
            vocab_size: usize,
            rope_theta: Option<f64>,
            rms_norm_eps: f64,
            max_position_embeddings: usize,
        }
        let hf: Hf = serde_json::from_str(text).map_err(|e| RuntimeError::ModelFile {
            path: "config.json".into(),
            reason: e.to_string(),
        })?;
        let name = hf
            .model_type
            .clone()
            .or_else(|| hf.architectures.first().cloned())
            .unwrap_or_default()
            .to_lowercase();
        let arch = if name.starts_with("qwen2") {
            Arch::Qwen2
        } else if name.starts_with("llama") {
            Arch::Llama
        } else {
            return Err(RuntimeError::UnsupportedArch(name));
        };
        let cfg = Self {
            arch,
            n_layers: hf.num_hidden_layers,
            d_model: hf.hidden_size,
            n_heads: hf.num_attention_heads,
            n_kv_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            head_dim: hf
                .head_dim
                .unwrap_or(hf.hidden_size / hf.num_attention_heads),
            d_ffn: hf.intermediate_size,
            vocab_size: hf.vocab_size,
            rope_theta: hf.rope_theta.unwrap_or(10_000.0),
            rope_style: RopeStyle::Half,
            rms_eps: hf.rms_norm_eps,
            context_length: hf.max_position_embeddings,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<()> {
        let bad = |reason: String| RuntimeError::ModelFile {
            path: "<metadata>".into(),
            reason,
        };
        if self.n_layers == 0 || self.n_heads == 0 || self.n_kv_heads == 0 {
            return Err(bad("layer or head count is zero".into()));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(bad(format!(
                "{} query heads are not a multiple of {} key/value heads",
                self.n_heads, self.n_kv_heads
            )));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(bad(format!("head_dim {} is odd", self.head_dim)));
        }
        Ok(())
    }
}

fn md<'a>(ct: &'a gguf_file::Content, key: &str) -> Result<&'a gguf_file::Value> {
    ct.metadata
        .get(key)
        .ok_or_else(|| RuntimeError::MissingMetadata(key.to_string()))
}

fn md_err(key: &str, e: candle_core::Error) -> RuntimeError {
    RuntimeError::ModelFile {
        path: "<metadata>".into(),
        reason: format!("`{key}`: {e}"),
    }
}

pub(crate) fn md_u32(ct: &gguf_file::Content, key: &str) -> Result<u32> {
    md(ct, key)?.to_u32().map_err(|e| md_err(key, e))
}

pub(crate) fn md_f32(ct: &gguf_file::Content, key: &str) -> Result<f32> {
    md(ct, key)?.to_f32().map_err(|e| md_err(key, e))
}

pub(crate) fn md_string(ct: &gguf_file::Content, key: &str) -> Result<String> {
    md(ct, key)?
        .to_string()
        .cloned()
        .map_err(|e| md_err(key, e))
}

pub(crate) fn md_value<'a>(ct: &'a gguf_file::Content, key: &str) -> Result<&'a gguf_file::Value> {
    md(ct, key)
}
