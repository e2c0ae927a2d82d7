//! Tiny models with seeded random weights, written as real GGUF (and Hugging
//! Face safetensors) files, for tests that need a model but not a real one.

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::Path;
use tolerable_runtime::{Arch, Result, Tokenizer};

/// The shape and encoding of a tiny test model.
#[derive(Debug, Clone)]
pub struct TinySpec {
    /// Decoder family.
    pub arch: Arch,
    /// Blocks.
    pub n_layers: usize,
    /// Residual width.
    pub d_model: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// MLP width.
    pub d_ffn: usize,
    /// Context length.
    pub context_length: usize,
    /// Block type of the matrices (`F32`, or e.g. `Q8_0` to exercise the quantized path).
    pub matrix_dtype: GgmlDType,
    /// Whether the file has its own `output.weight` (else tied to the embedding).
    pub own_output: bool,
    /// Seed of the weights.
    pub seed: u64,
}

impl Default for TinySpec {
    fn default() -> Self {
        Self {
            arch: Arch::Qwen2,
            n_layers: 3,
            d_model: 64,
            n_heads: 4,
            n_kv_heads: 2,
            d_ffn: 128,
            context_length: 256,
            matrix_dtype: GgmlDType::F32,
            own_output: true,
            seed: 7,
        }
    }
}

/// GPT-2's byte-to-character map of byte-level BPE.
pub fn byte_chars() -> Vec<char> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut out = vec![' '; 256];
    for (b, c) in bs.iter().zip(cs) {
        out[*b as usize] = char::from_u32(c).unwrap();
    }
    out
}

/// The tiny vocabulary: 256 byte tokens, a few merges, three specials.
pub fn tiny_vocab() -> (Vec<String>, Vec<String>, Vec<i32>) {
    let mut tokens: Vec<String> = byte_chars().iter().map(|c| c.to_string()).collect();
    let mut types = vec![1i32; 256];
    let merges: Vec<(&str, &str)> = vec![
        ("Ġ", "t"),
        ("h", "e"),
        ("Ġt", "he"),
        ("i", "n"),
        ("Ġ", "a"),
        ("e", "r"),
        ("o", "n"),
        ("Ġ", "s"),
    ];
    let mut merge_lines = Vec::new();
    for (a, b) in merges {
        merge_lines.push(format!("{a} {b}"));
        tokens.push(format!("{a}{b}"));
        types.push(1);
    }
    for s in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] {
        tokens.push(s.to_string());
        types.push(3);
    }
    (tokens, merge_lines, types)
}

const CHATML: &str = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    }
    fn normal(&mut self) -> f32 {
        let u1 = ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let u2 = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
}

/// The tiny model's tensors by GGUF name, f32, `[out, in]` for matrices.
pub fn tiny_tensors(spec: &TinySpec) -> Result<Vec<(String, Tensor)>> {
    let dev = Device::Cpu;
    let mut rng = Rng(spec.seed);
    let (vocab, _, _) = tiny_vocab();
    let v = vocab.len();
    let hd = spec.d_model / spec.n_heads;
    let mut mat = |rows: usize, cols: usize, scale: f32| -> Result<Tensor> {
        let data: Vec<f32> = (0..rows * cols).map(|_| rng.normal() * scale).collect();
        Ok(Tensor::from_vec(data, (rows, cols), &dev)?)
    };
    let mut out = Vec::new();
    let d = spec.d_model;
    out.push(("token_embd.weight".to_string(), mat(v, d, 1.0)?));
    let s = 1.0 / (d as f32).sqrt();
    for l in 0..spec.n_layers {
        let n = |x: &str| format!("blk.{l}.{x}");
        out.push((n("attn_norm.weight"), (mat(1, d, 0.1)?.squeeze(0)? + 1.0)?));
        out.push((n("attn_q.weight"), mat(spec.n_heads * hd, d, s)?));
        out.push((n("attn_k.weight"), mat(spec.n_kv_heads * hd, d, s)?));
        out.push((n("attn_v.weight"), mat(spec.n_kv_heads * hd, d, s)?));
        if spec.arch == Arch::Qwen2 {
            out.push((
                n("attn_q.bias"),
                mat(1, spec.n_heads * hd, 0.1)?.squeeze(0)?,
            ));
            out.push((
                n("attn_k.bias"),
                mat(1, spec.n_kv_heads * hd, 0.1)?.squeeze(0)?,
            ));
            out.push((
                n("attn_v.bias"),
                mat(1, spec.n_kv_heads * hd, 0.1)?.squeeze(0)?,
            ));
        }
        out.push((n("attn_output.weight"), mat(d, spec.n_heads * hd, s)?));
        out.push((n("ffn_norm.weight"), (mat(1, d, 0.1)?.squeeze(0)? + 1.0)?));
        out.push((n("ffn_gate.weight"), mat(spec.d_ffn, d, s)?));
        out.push((n("ffn_up.weight"), mat(spec.d_ffn, d, s)?));
        out.push((
            n("ffn_down.weight"),
            mat(d, spec.d_ffn, 1.0 / (spec.d_ffn as f32).sqrt())?,
        ));
    }
    out.push((
        "output_norm.weight".to_string(),
        (mat(1, d, 0.1)?.squeeze(0)? + 1.0)?,
    ));
    if spec.own_output {
        out.push(("output.weight".to_string(), mat(v, d, s)?));
    }
    Ok(out)
}

/// Writes the tiny model as a GGUF file with its tokenizer in the metadata.
pub fn write_gguf(spec: &TinySpec, path: &Path) -> Result<()> {
    let arch = spec.arch.to_string();
    let (tokens, merges, types) = tiny_vocab();
    let k = |s: &str| format!("{arch}.{s}");
    let strings = |v: &[String]| Value::Array(v.iter().map(|s| Value::String(s.clone())).collect());
    let md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.clone())),
        (
            "general.name".into(),
            Value::String("tolerable tiny test model".into()),
        ),
        (k("block_count"), Value::U32(spec.n_layers as u32)),
        (k("context_length"), Value::U32(spec.context_length as u32)),
        (k("embedding_length"), Value::U32(spec.d_model as u32)),
        (k("feed_forward_length"), Value::U32(spec.d_ffn as u32)),
        (k("attention.head_count"), Value::U32(spec.n_heads as u32)),
        (
            k("attention.head_count_kv"),
            Value::U32(spec.n_kv_heads as u32),
        ),
        (k("rope.freq_base"), Value::F32(10000.0)),
        (
            k("rope.dimension_count"),
            Value::U32((spec.d_model / spec.n_heads) as u32),
        ),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(1e-6)),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("qwen2".into())),
        ("tokenizer.ggml.tokens".into(), strings(&tokens)),
        ("tokenizer.ggml.merges".into(), strings(&merges)),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(types.iter().map(|t| Value::I32(*t)).collect()),
        ),
        (
            "tokenizer.ggml.eos_token_id".into(),
            Value::U32((tokens.len() - 1) as u32),
        ),
        (
            "tokenizer.ggml.bos_token_id".into(),
            Value::U32((tokens.len() - 3) as u32),
        ),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
        (
            "tokenizer.chat_template".into(),
            Value::String(CHATML.into()),
        ),
    ];
    let tensors = tiny_tensors(spec)?;
    let mut q = Vec::new();
    for (name, t) in &tensors {
        let dt = if t.rank() == 2 && name != "token_embd.weight" {
            spec.matrix_dtype
        } else {
            GgmlDType::F32
        };
        q.push((name.clone(), QTensor::quantize(t, dt)?));
    }
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = q.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path)?;
    gguf_file::write(&mut f, &md_refs, &t_refs)?;
    Ok(())
}

/// Writes the tiny model (f32 matrices) as a Hugging Face checkpoint directory:
/// config.json, model.safetensors, tokenizer.json.
pub fn write_hf_dir(spec: &TinySpec, dir: &Path, tokenizer: &Tokenizer) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let (tokens, _, _) = tiny_vocab();
    let cfg = serde_json::json!({
        "architectures": [if spec.arch == Arch::Qwen2 { "Qwen2ForCausalLM" } else { "LlamaForCausalLM" }],
        "model_type": spec.arch.to_string(),
        "num_hidden_layers": spec.n_layers,
        "hidden_size": spec.d_model,
        "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.n_kv_heads,
        "intermediate_size": spec.d_ffn,
        "vocab_size": tokens.len(),
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": spec.context_length,
        "tie_word_embeddings": !spec.own_output,
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&cfg).unwrap(),
    )?;
    let mut map = HashMap::new();
    for (name, t) in tiny_tensors(spec)? {
        let hf = tolerable_runtime::weights::hf_name(&name);
        map.insert(hf, t);
    }
    candle_core::safetensors::save(&map, dir.join("model.safetensors"))?;
    tokenizer.save_json(&dir.join("tokenizer.json"))?;
    Ok(())
}
