//! The manual-attention decoder: Qwen2 and Llama blocks written out, with a
//! hook point at every named site, an explicit KV cache, mid-stack starts and
//! logits only where they are asked for.
//!
//! Block l: `x = resid_pre; h = rms(x); q,k,v = h W + b; rope(q,k);
//! scores = q kᵀ/√d (+ causal mask); p = softmax(scores); z = p v;
//! x += z W_o; h = rms(x); x += W_down(silu(W_gate h) * W_up h)`.

use crate::config::{ModelConfig, RopeStyle};
use crate::error::{Result, RuntimeError};
use crate::fused::{CausalSoftmax, SiluMul};
use crate::hooks::{Adapter, HookCache, HookPoint, HookSpec, Projection};
use crate::kv_cache::{KvCache, LayerKv};
use crate::weights::{Precision, Proj, Source};
use candle_core::{DType, Device, Tensor, D};
use std::path::Path;
use std::sync::Arc;

/// Which tensor kernels the forward uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kernels {
    /// candle's fused CPU kernels for RMSNorm, RoPE and softmax: fastest, but
    /// they pass no gradient.
    #[default]
    Fused,
    /// The same functions written with plain tensor ops, through which
    /// gradients flow (for trained bridges).
    Differentiable,
}

/// Which positions of a forward call get logits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogitsAt {
    /// None (a pure prefill).
    None,
    /// The last position only.
    Last,
    /// Every position of the call.
    All,
    /// These positions of the call.
    Positions(Vec<usize>),
    /// One position per sequence: sequence `i` at position `p[i]` of the
    /// call (the last real token of each prompt in a padded batch); logits
    /// `[batch, 1, vocab]`.
    PerRow(Vec<usize>),
}

/// What a forward call returns beside the updated cache.
#[derive(Debug)]
pub struct ForwardOutput {
    /// Logits `[batch, positions, vocab]` at the positions asked for.
    pub logits: Option<Tensor>,
    /// Tensors captured by the hook spec.
    pub hooks: HookCache,
}

/// Projections of q, k and v: one fused matrix in f32, three in quantized form.
#[derive(Debug, Clone)]
enum Qkv {
    Fused {
        w: Proj,
        b: Option<Tensor>,
    },
    Split {
        q: Proj,
        k: Proj,
        v: Proj,
        b: Option<[Tensor; 3]>,
    },
}

/// Gate and up projections: fused in f32, split in quantized form.
#[derive(Debug, Clone)]
enum GateUp {
    Fused(Proj),
    Split(Proj, Proj),
}

#[derive(Debug, Clone)]
struct Block {
    attn_norm: Tensor,
    qkv: Qkv,
    o: Proj,
    ffn_norm: Tensor,
    gate_up: GateUp,
    down: Proj,
}

/// A loaded model: configuration, weights in one precision, RoPE tables.
#[derive(Debug, Clone)]
pub struct Model {
    cfg: ModelConfig,
    precision: Precision,
    kernels: Kernels,
    row_kernel: bool,
    embed: Tensor,
    blocks: Vec<Block>,
    final_norm: Tensor,
    lm_head: Proj,
    cos: Tensor,
    sin: Tensor,
    device: Device,
}

impl Model {
    /// Loads a GGUF file in the given precision.
    pub fn from_gguf(path: &Path, precision: Precision, device: &Device) -> Result<Self> {
        let (src, cfg) = Source::open_gguf(path)?;
        Self::load(&src, cfg, precision, device)
    }

    /// Loads a Hugging Face checkpoint directory (config.json + safetensors), in f32.
    pub fn from_safetensors_dir(dir: &Path, device: &Device) -> Result<Self> {
        let (src, cfg) = Source::open_safetensors(dir, device)?;
        Self::load(&src, cfg, Precision::F32, device)
    }

    fn load(src: &Source, cfg: ModelConfig, precision: Precision, device: &Device) -> Result<Self> {
        let d = cfg.d_model;
        let hd = cfg.head_dim;
        let (nq, nkv) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
        let embed = src.f32("token_embd.weight", &[cfg.vocab_size, d], device)?;
        let final_norm = src.f32("output_norm.weight", &[d], device)?;
        let lm_name = if src.has("output.weight") {
            "output.weight"
        } else {
            "token_embd.weight"
        };
        let lm_head = src.proj(lm_name, &[cfg.vocab_size, d], precision, device)?;
        let mut blocks = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let n = |s: &str| format!("blk.{l}.{s}");
            let bias = |s: &str, len: usize| -> Result<Option<Tensor>> {
                if cfg.qkv_bias() {
                    Ok(Some(src.f32(&n(s), &[len], device)?))
                } else {
                    Ok(None)
                }
            };
            let (bq, bk, bv) = (
                bias("attn_q.bias", nq)?,
                bias("attn_k.bias", nkv)?,
                bias("attn_v.bias", nkv)?,
            );
            let qkv = match precision {
                Precision::F32 => {
                    let w = Tensor::cat(
                        &[
                            &src.f32(&n("attn_q.weight"), &[nq, d], device)?,
                            &src.f32(&n("attn_k.weight"), &[nkv, d], device)?,
                            &src.f32(&n("attn_v.weight"), &[nkv, d], device)?,
                        ],
                        0,
                    )?;
                    let b = match (bq, bk, bv) {
                        (Some(a), Some(b), Some(c)) => Some(Tensor::cat(&[a, b, c], 0)?),
                        _ => None,
                    };
                    Qkv::Fused {
                        w: Proj::Dense(w),
                        b,
                    }
                }
                Precision::Quantized => Qkv::Split {
                    q: src.proj(&n("attn_q.weight"), &[nq, d], precision, device)?,
                    k: src.proj(&n("attn_k.weight"), &[nkv, d], precision, device)?,
                    v: src.proj(&n("attn_v.weight"), &[nkv, d], precision, device)?,
                    b: match (bq, bk, bv) {
                        (Some(a), Some(b), Some(c)) => Some([a, b, c]),
                        _ => None,
                    },
                },
            };
            let gate_up = match precision {
                Precision::F32 => GateUp::Fused(Proj::Dense(Tensor::cat(
                    &[
                        &src.f32(&n("ffn_gate.weight"), &[cfg.d_ffn, d], device)?,
                        &src.f32(&n("ffn_up.weight"), &[cfg.d_ffn, d], device)?,
                    ],
                    0,
                )?)),
                Precision::Quantized => GateUp::Split(
                    src.proj(&n("ffn_gate.weight"), &[cfg.d_ffn, d], precision, device)?,
                    src.proj(&n("ffn_up.weight"), &[cfg.d_ffn, d], precision, device)?,
                ),
            };
            blocks.push(Block {
                attn_norm: src.f32(&n("attn_norm.weight"), &[d], device)?,
                qkv,
                o: src.proj(&n("attn_output.weight"), &[d, nq], precision, device)?,
                ffn_norm: src.f32(&n("ffn_norm.weight"), &[d], device)?,
                gate_up,
                down: src.proj(&n("ffn_down.weight"), &[d, cfg.d_ffn], precision, device)?,
            });
        }
        let (cos, sin) = rope_tables(&cfg, device)?;
        Ok(Self {
            cfg,
            precision,
            kernels: Kernels::default(),
            row_kernel: false,
            embed,
            blocks,
            final_norm,
            lm_head,
            cos,
            sin,
            device: device.clone(),
        })
    }

    /// A model of the same architecture whose weight matrices are `f`
    /// applied to these (norms and biases are kept): held-out senders built
    /// from the receiver by re-quantization or calibrated weight noise.
    /// `f` gets each matrix's GGUF name (`token_embd`, `output`,
    /// `blk.{l}.attn_q`, `attn_k`, `attn_v`, `attn_output`, `ffn_gate`,
    /// `ffn_up`, `ffn_down`) and its f32 weights `[out, in]`; f32 models only.
    pub fn map_weights(&self, f: &mut dyn FnMut(&str, &Tensor) -> Result<Tensor>) -> Result<Model> {
        if self.precision != Precision::F32 {
            return Err(RuntimeError::BadIntervention {
                site: "map_weights".into(),
                reason: "weights are mapped on f32 models only".into(),
            });
        }
        let dense = |p: &Proj| p.dense();
        let mut out = self.clone();
        out.embed = f("token_embd", &self.embed)?;
        out.lm_head = Proj::Dense(f("output", &dense(&self.lm_head)?)?);
        let (nq, nkv) = (
            self.cfg.n_heads * self.cfg.head_dim,
            self.cfg.n_kv_heads * self.cfg.head_dim,
        );
        for (l, blk) in out.blocks.iter_mut().enumerate() {
            let n = |s: &str| format!("blk.{l}.{s}");
            if let Qkv::Fused { w, .. } = &mut blk.qkv {
                let full = w.dense()?;
                let q = f(&n("attn_q"), &full.narrow(0, 0, nq)?)?;
                let k = f(&n("attn_k"), &full.narrow(0, nq, nkv)?)?;
                let v = f(&n("attn_v"), &full.narrow(0, nq + nkv, nkv)?)?;
                *w = Proj::Dense(Tensor::cat(&[&q, &k, &v], 0)?);
            }
            blk.o = Proj::Dense(f(&n("attn_output"), &blk.o.dense()?)?);
            if let GateUp::Fused(w) = &mut blk.gate_up {
                let full = w.dense()?;
                let ff = self.cfg.d_ffn;
                let g = f(&n("ffn_gate"), &full.narrow(0, 0, ff)?)?;
                let u = f(&n("ffn_up"), &full.narrow(0, ff, ff)?)?;
                *w = Proj::Dense(Tensor::cat(&[&g, &u], 0)?);
            }
            blk.down = Proj::Dense(f(&n("ffn_down"), &blk.down.dense()?)?);
        }
        Ok(out)
    }

    /// The key projection of block `layer`: its weights `[n_kv_heads *
    /// head_dim, d_model]` (f32, dequantized when held quantized) and its
    /// bias `[n_kv_heads * head_dim]` when the architecture has one. The
    /// pre-RoPE key of a normed residual `h` is `h W^T + b`.
    pub fn key_projection(&self, layer: usize) -> Result<(Tensor, Option<Tensor>)> {
        let blk = self
            .blocks
            .get(layer)
            .ok_or_else(|| RuntimeError::LayerOutOfRange {
                site: "key_projection".into(),
                layer,
                n_layers: self.cfg.n_layers,
            })?;
        let (nq, nkv) = (
            self.cfg.n_heads * self.cfg.head_dim,
            self.cfg.n_kv_heads * self.cfg.head_dim,
        );
        Ok(match &blk.qkv {
            Qkv::Fused { w, b } => (
                w.dense()?.narrow(0, nq, nkv)?.contiguous()?,
                b.as_ref()
                    .map(|b| b.narrow(0, nq, nkv).and_then(|t| t.contiguous()))
                    .transpose()?,
            ),
            Qkv::Split { k, b, .. } => (k.dense()?, b.as_ref().map(|[_, bk, _]| bk.clone())),
        })
    }

    /// The architecture.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The precision the weights are held in.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The kernels the forward uses.
    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// Switches kernels (fused for speed, differentiable for training).
    pub fn with_kernels(mut self, kernels: Kernels) -> Self {
        self.kernels = kernels;
        self
    }

    /// Whether single-row products (batch-1 decoding, one position's
    /// logits) take the one-row kernel instead of candle's gemm (f32 on the
    /// CPU, fused kernels only). Off by default: its float rounding differs
    /// from gemm's, so it changes rows' bits, and a run records it.
    pub fn row_kernel(&self) -> bool {
        self.row_kernel
    }

    /// Turns the one-row kernel on or off (see [`Model::row_kernel`]).
    pub fn with_row_kernel(mut self, on: bool) -> Self {
        self.row_kernel = on;
        self
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// An empty cache for `batch` sequences.
    pub fn new_cache(&self, batch: usize) -> KvCache {
        KvCache::new(&self.cfg, batch, &self.device)
    }

    /// A `[batch, len]` token tensor from equal-length id lists.
    pub fn tokens(&self, ids: &[Vec<u32>]) -> Result<Tensor> {
        let len = ids.first().map(|v| v.len()).unwrap_or(0);
        if ids.iter().any(|v| v.len() != len) {
            return Err(RuntimeError::BadIntervention {
                site: "tokens".into(),
                reason: "sequences of a batch must have equal length".into(),
            });
        }
        let flat: Vec<u32> = ids.iter().flatten().copied().collect();
        Ok(Tensor::from_vec(flat, (ids.len(), len), &self.device)?)
    }

    /// Runs new tokens `[batch, seq]` on top of `cache`, which grows by them.
    pub fn forward(
        &self,
        tokens: &Tensor,
        cache: &mut KvCache,
        spec: &HookSpec,
        logits: LogitsAt,
    ) -> Result<ForwardOutput> {
        self.forward_rows(tokens, cache, spec, logits, None)
    }

    /// As [`Model::forward`] on a padded batch ([`KvCache::stack_padded`]):
    /// sequence `i`'s first `lens[i]` tokens are real and the rest padding,
    /// which no query attends to and which does not advance the sequence's
    /// positions (`None`: every token real). Hooks see every position of the
    /// call and every entry, padding included (captures hold padded rows).
    pub fn forward_rows(
        &self,
        tokens: &Tensor,
        cache: &mut KvCache,
        spec: &HookSpec,
        logits: LogitsAt,
        lens: Option<&[usize]>,
    ) -> Result<ForwardOutput> {
        let (b, s) = tokens.dims2()?;
        self.check_call(b, s, cache, spec)?;
        if let Some(lens) = lens {
            if lens.len() != b || lens.iter().any(|&n| n == 0 || n > s) {
                return Err(RuntimeError::BadIntervention {
                    site: "forward".into(),
                    reason: format!(
                        "real lengths {lens:?} do not fit a batch of {b} sequences of {s} tokens"
                    ),
                });
            }
            if cache.rows().is_none() && lens.iter().any(|&n| n != s) {
                return Err(RuntimeError::BadIntervention {
                    site: "forward".into(),
                    reason: "padded tokens need a padded cache (KvCache::stack_padded)".into(),
                });
            }
        }
        if let LogitsAt::PerRow(p) = &logits {
            // Checked before the cache grows: a refused call changes nothing.
            if p.len() != b || p.iter().any(|&i| i >= s) {
                return Err(RuntimeError::BadIntervention {
                    site: "logits".into(),
                    reason: format!(
                        "per-sequence positions {p:?} do not fit {b} sequences of {s} positions"
                    ),
                });
            }
        }
        if let Some(&bad) = tokens
            .flatten_all()?
            .to_vec1::<u32>()?
            .iter()
            .find(|&&t| t as usize >= self.cfg.vocab_size)
        {
            return Err(RuntimeError::BadIntervention {
                site: "tokens".into(),
                reason: format!(
                    "token id {bad} outside the vocabulary of {}",
                    self.cfg.vocab_size
                ),
            });
        }
        let mut hc = HookCache::default();
        let x = self
            .embed
            .index_select(&tokens.flatten_all()?, 0)?
            .reshape((b, s, self.cfg.d_model))?;
        let x = self.hook(spec, HookPoint::Embed, x, &mut hc)?;
        let x = self.run_layers(0, x, None, cache, spec, &mut hc, lens)?;
        let logits = self.head(&x, logits, spec, &mut hc)?;
        Ok(ForwardOutput { logits, hooks: hc })
    }

    /// Starts the forward at block `start_layer` from a supplied residual
    /// stream `resid_pre` `[batch, seq, d_model]` (the input of that block);
    /// blocks below are not recomputed. `lower` holds these positions' keys
    /// and values for the blocks below `start_layer` (e.g. a narrow of the
    /// pass that produced `resid_pre`); they are appended to `cache` as is.
    pub fn forward_from_layer(
        &self,
        start_layer: usize,
        resid_pre: &Tensor,
        lower: &KvCache,
        cache: &mut KvCache,
        spec: &HookSpec,
        logits: LogitsAt,
    ) -> Result<ForwardOutput> {
        let (b, s, d) = resid_pre.dims3()?;
        if start_layer >= self.cfg.n_layers {
            return Err(RuntimeError::LayerOutOfRange {
                site: "forward_from_layer".into(),
                layer: start_layer,
                n_layers: self.cfg.n_layers,
            });
        }
        if d != self.cfg.d_model {
            return Err(RuntimeError::BadIntervention {
                site: HookPoint::ResidPre(start_layer).to_string(),
                reason: format!("residual width {d}, model width {}", self.cfg.d_model),
            });
        }
        self.check_call(b, s, cache, spec)?;
        if cache.rows().is_some() || lower.rows().is_some() {
            return Err(RuntimeError::BadIntervention {
                site: "forward_from_layer".into(),
                reason: "a padded batch of sequences cannot restart mid-stack".into(),
            });
        }
        if start_layer > 0 && (lower.len() != s || lower.batch() != b) {
            return Err(RuntimeError::BadIntervention {
                site: "forward_from_layer".into(),
                reason: format!(
                    "lower-layer cache has batch {} x {} entries, the residual has {b} x {s} positions",
                    lower.batch(),
                    lower.len()
                ),
            });
        }
        let mut hc = HookCache::default();
        let x = self.run_layers(
            start_layer,
            resid_pre.clone(),
            Some(lower),
            cache,
            spec,
            &mut hc,
            None,
        )?;
        let logits = self.head(&x, logits, spec, &mut hc)?;
        Ok(ForwardOutput { logits, hooks: hc })
    }

    fn check_call(&self, b: usize, s: usize, cache: &KvCache, spec: &HookSpec) -> Result<()> {
        if s == 0 {
            return Err(RuntimeError::BadIntervention {
                site: "forward".into(),
                reason: "no tokens to run".into(),
            });
        }
        if b != cache.batch() {
            return Err(RuntimeError::BadIntervention {
                site: "forward".into(),
                reason: format!(
                    "batch {b} does not match the cache's batch {}",
                    cache.batch()
                ),
            });
        }
        if cache.n_layers() != self.cfg.n_layers {
            return Err(RuntimeError::BadIntervention {
                site: "forward".into(),
                reason: format!(
                    "cache has {} layers, the model {}",
                    cache.n_layers(),
                    self.cfg.n_layers
                ),
            });
        }
        let need = cache.next_position() + s;
        if need > self.cfg.context_length {
            return Err(RuntimeError::PromptTooLong {
                len: need,
                max: self.cfg.context_length,
            });
        }
        spec.validate(self.cfg.n_layers)
    }

    #[inline]
    fn hook(
        &self,
        spec: &HookSpec,
        point: HookPoint,
        t: Tensor,
        hc: &mut HookCache,
    ) -> Result<Tensor> {
        if spec.is_empty() {
            Ok(t)
        } else {
            spec.run(point, t, hc)
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn run_layers(
        &self,
        start: usize,
        mut x: Tensor,
        lower: Option<&KvCache>,
        cache: &mut KvCache,
        spec: &HookSpec,
        hc: &mut HookCache,
        lens: Option<&[usize]>,
    ) -> Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        let pos0 = cache.next_position();
        // A padded batch: which keys each sequence may attend to.
        let valid = cache.key_validity(s, lens).map(Arc::new);
        // The materialised mask only where a layer takes the written-out
        // attention (the fused softmax masks from the shape).
        let written_out = (start..self.cfg.n_layers).any(|l| !self.fused_softmax(l, spec));
        let mask = match &valid {
            Some(v) if written_out => Some(attention_mask(s, cache.len(), Some(v), &self.device)?),
            None if s > 1 && written_out => {
                Some(attention_mask(s, cache.len(), None, &self.device)?)
            }
            _ => None,
        };
        let (cos, sin) = match cache.row_positions(s) {
            Some(p) => {
                let idx = Tensor::from_vec(p, b * s, &self.device)?;
                let half = self.cfg.head_dim / 2;
                (
                    self.cos.index_select(&idx, 0)?.reshape((b, s, half))?,
                    self.sin.index_select(&idx, 0)?.reshape((b, s, half))?,
                )
            }
            None => (
                self.cos.narrow(0, pos0, s)?.contiguous()?,
                self.sin.narrow(0, pos0, s)?.contiguous()?,
            ),
        };
        if let Some(lower) = lower {
            for l in 0..start {
                let kv = lower.require_layer(l)?;
                cache.push_own(l, &kv.k, &kv.v)?;
            }
        }
        for l in start..self.cfg.n_layers {
            x = self.block(
                l,
                x,
                &cos,
                &sin,
                mask.as_ref(),
                valid.as_ref(),
                cache,
                spec,
                hc,
            )?;
        }
        cache.advance_own(s, lens);
        Ok(x)
    }

    fn rms(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let eps = self.cfg.rms_eps as f32;
        Ok(match self.kernels {
            Kernels::Fused => candle_nn::ops::rms_norm(x, w, eps)?,
            Kernels::Differentiable => candle_nn::ops::rms_norm_slow(x, w, eps)?,
        })
    }

    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        use candle_nn::rotary_emb as re;
        Ok(match (self.kernels, self.cfg.rope_style) {
            (Kernels::Fused, RopeStyle::Half) => re::rope(&x.contiguous()?, cos, sin)?,
            (Kernels::Fused, RopeStyle::Interleaved) => re::rope_i(&x.contiguous()?, cos, sin)?,
            // Per-sequence tables `[b, s, d/2]` (a padded batch).
            (Kernels::Differentiable, style) if cos.rank() == 3 => {
                rope_rows_slow(x, cos, sin, style)?
            }
            (Kernels::Differentiable, RopeStyle::Half) => re::rope_slow(x, cos, sin)?,
            (Kernels::Differentiable, RopeStyle::Interleaved) => re::rope_i_slow(x, cos, sin)?,
        })
    }

    /// Whether layer `l` takes the attention pattern from the one-pass CPU
    /// op (scale, causal mask, softmax): fused kernels on the CPU, and no hook
    /// reads or edits the scores between those steps.
    fn fused_softmax(&self, l: usize, spec: &HookSpec) -> bool {
        self.kernels == Kernels::Fused
            && self.device.is_cpu()
            && !spec.touches(HookPoint::AttnScores(l))
    }

    fn softmax(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self.kernels {
            Kernels::Fused => candle_nn::ops::softmax_last_dim(x)?,
            Kernels::Differentiable => candle_nn::ops::softmax(x, D::Minus1)?,
        })
    }

    /// The low-rank term of `ad` on the normed residual `h` `[b, s, d]`,
    /// head-major `[b, n, s, hd]` like the projection it adds to.
    fn adapter_delta(&self, ad: &Adapter, h: &Tensor, n: usize) -> Result<Tensor> {
        let (b, s, d) = h.dims3()?;
        let hd = self.cfg.head_dim;
        let bad = |reason: String| RuntimeError::BadIntervention {
            site: format!("adapter on blocks.{}.{:?}", ad.layer, ad.projection),
            reason,
        };
        let (ad_in, r) =
            ad.a.dims2()
                .map_err(|_| bad(format!("A is {:?}, not [d_model, rank]", ad.a.dims())))?;
        let (r2, out) =
            ad.b.dims2()
                .map_err(|_| bad(format!("B is {:?}, not [rank, out]", ad.b.dims())))?;
        if ad_in != d || r2 != r || out != n * hd {
            return Err(bad(format!(
                "A {:?} and B {:?} do not map width {d} to {n} heads x {hd}",
                ad.a.dims(),
                ad.b.dims()
            )));
        }
        // Only the sequences it applies to: the others get an exact zero.
        let (h, rows) = match &ad.rows {
            None => (h.clone(), None),
            Some(rows) => {
                if rows.is_empty() || rows.iter().any(|&r| r >= b) {
                    return Err(bad(format!("rows {rows:?} are not rows of a batch of {b}")));
                }
                let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
                let idx = Tensor::new(idx.as_slice(), h.device())?;
                (h.index_select(&idx, 0)?, Some(idx))
            }
        };
        let br = h.dim(0)?;
        let y = h
            .reshape((br * s, d))?
            .matmul(&ad.a)?
            .matmul(&ad.b)?
            .affine(ad.scale, 0.0)?;
        let y = y.reshape((br, s, n, hd))?.transpose(1, 2)?.contiguous()?;
        Ok(match rows {
            None => y,
            Some(idx) => {
                Tensor::zeros((b, n, s, hd), y.dtype(), y.device())?.index_add(&idx, &y, 0)?
            }
        })
    }

    /// A projection of the receiver's weights: under differentiable kernels
    /// its backward pass forms no weight gradient (the receiver is frozen).
    fn proj(&self, w: &Proj, x: &Tensor) -> Result<Tensor> {
        match self.kernels {
            Kernels::Differentiable => w.forward_frozen(x),
            Kernels::Fused if self.row_kernel => w.forward_row_kernel(x),
            Kernels::Fused => w.forward(x),
        }
    }

    /// q, k, v of a normed residual `[b, s, d]`, head-major, before RoPE.
    fn project_qkv(&self, blk: &Block, h: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, s, _) = h.dims3()?;
        let hd = self.cfg.head_dim;
        let (nh, nkv) = (self.cfg.n_heads, self.cfg.n_kv_heads);
        let (q, k, v) = match &blk.qkv {
            Qkv::Fused { w, b: bias } => {
                let mut y = self.proj(w, h)?;
                if let Some(bias) = bias {
                    y = y.broadcast_add(bias)?;
                }
                (
                    y.narrow(2, 0, nh * hd)?,
                    y.narrow(2, nh * hd, nkv * hd)?,
                    y.narrow(2, (nh + nkv) * hd, nkv * hd)?,
                )
            }
            Qkv::Split { q, k, v, b: bias } => {
                let (mut q, mut k, mut v) = (self.proj(q, h)?, self.proj(k, h)?, self.proj(v, h)?);
                if let Some([bq, bk, bv]) = bias {
                    q = q.broadcast_add(bq)?;
                    k = k.broadcast_add(bk)?;
                    v = v.broadcast_add(bv)?;
                }
                (q, k, v)
            }
        };
        let heads = |t: Tensor, n: usize| -> Result<Tensor> {
            Ok(t.reshape((b, s, n, hd))?.transpose(1, 2)?.contiguous()?)
        };
        Ok((heads(q, nh)?, heads(k, nkv)?, heads(v, nkv)?))
    }

    /// Keys (after RoPE) and values that block `layer` computes from its input
    /// residual `resid_pre` `[batch, seq, d_model]` at positions
    /// `first_position..`: the rebuild gate's recomputation.
    pub fn rebuild_kv(
        &self,
        layer: usize,
        resid_pre: &Tensor,
        first_position: usize,
    ) -> Result<LayerKv> {
        if layer >= self.cfg.n_layers {
            return Err(RuntimeError::LayerOutOfRange {
                site: "rebuild_kv".into(),
                layer,
                n_layers: self.cfg.n_layers,
            });
        }
        let s = resid_pre.dim(1)?;
        let blk = &self.blocks[layer];
        let h = self.rms(resid_pre, &blk.attn_norm)?;
        let (_q, k, v) = self.project_qkv(blk, &h)?;
        let cos = self.cos.narrow(0, first_position, s)?.contiguous()?;
        let sin = self.sin.narrow(0, first_position, s)?.contiguous()?;
        Ok(LayerKv {
            k: self.rope(&k, &cos, &sin)?,
            v,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn block(
        &self,
        l: usize,
        x: Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
        valid: Option<&Arc<Vec<bool>>>,
        cache: &mut KvCache,
        spec: &HookSpec,
        hc: &mut HookCache,
    ) -> Result<Tensor> {
        use HookPoint::*;
        let blk = &self.blocks[l];
        let (b, s, d) = x.dims3()?;
        let (nh, nkv, hd) = (self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim);
        let g = nh / nkv;
        let x = self.hook(spec, ResidPre(l), x, hc)?;
        let h = self.rms(&x, &blk.attn_norm)?;
        let (mut q, mut k, mut v) = self.project_qkv(blk, &h)?;
        for ad in spec.adapters().iter().filter(|a| a.layer == l) {
            let n = match ad.projection {
                Projection::Q => nh,
                Projection::K | Projection::V => nkv,
            };
            let delta = self.adapter_delta(ad, &h, n)?;
            match ad.projection {
                Projection::Q => q = (q + delta)?,
                Projection::K => k = (k + delta)?,
                Projection::V => v = (v + delta)?,
            }
        }
        let q = self.hook(spec, Q(l), q, hc)?;
        let k = self.hook(spec, K(l), k, hc)?;
        let v = self.hook(spec, V(l), v, hc)?;
        let q = self.rope(&q, cos, sin)?;
        let k = self.rope(&k, cos, sin)?;
        let q = self.hook(spec, RotQ(l), q, hc)?;
        let k = self.hook(spec, RotK(l), k, hc)?;
        let kv = cache.push_own(l, &k, &v)?;
        let t = kv.k.dim(2)?;
        // Grouped-query attention without repeating k/v: the G query heads of
        // one kv head are stacked along the query axis.
        let qg = q.reshape((b, nkv, g * s, hd))?;
        let raw = qg.matmul(&kv.k.t()?)?;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut p = if self.fused_softmax(l, spec) {
            raw.apply_op1_no_bwd(&CausalSoftmax {
                scale: scale as f32,
                s,
                valid: valid.cloned(),
            })?
        } else {
            let mut scores = (raw * scale)?;
            if s > 1 || valid.is_some() {
                let mask = mask.ok_or_else(|| RuntimeError::BadIntervention {
                    site: format!("blocks.{l}.attn"),
                    reason: "the causal mask is missing".into(),
                })?;
                scores = scores.reshape((b, nkv, g, s, t))?.broadcast_add(mask)?;
            }
            if spec.touches(AttnScores(l)) {
                let sc = scores.reshape((b, nh, s, t))?;
                scores = self.hook(spec, AttnScores(l), sc, hc)?;
            }
            let scores = scores.reshape((b, nkv, g * s, t))?;
            self.softmax(&scores)?
        };
        if spec.touches(Pattern(l)) {
            let pp = p.reshape((b, nh, s, t))?;
            p = self
                .hook(spec, Pattern(l), pp, hc)?
                .reshape((b, nkv, g * s, t))?;
        }
        let z = p.matmul(&kv.v)?.reshape((b, nh, s, hd))?.transpose(1, 2)?;
        let z = self.hook(spec, Z(l), z, hc)?;
        let attn_out = self.proj(&blk.o, &z.contiguous()?.reshape((b, s, nh * hd))?)?;
        let attn_out = self.hook(spec, AttnOut(l), attn_out, hc)?;
        let x = (x + attn_out)?;
        let x = self.hook(spec, ResidMid(l), x, hc)?;
        let h = self.rms(&x, &blk.ffn_norm)?;
        let post = match &blk.gate_up {
            // One pass over the fused projection's output where nothing
            // reads or edits the gate: the same arithmetic as silu, then
            // the product (bit for bit), without the strided halves.
            GateUp::Fused(w)
                if self.kernels == Kernels::Fused
                    && self.device.is_cpu()
                    && !spec.touches(MlpPre(l)) =>
            {
                let y = self.proj(w, &h)?;
                y.apply_op1_no_bwd(&SiluMul)?
            }
            gate_up => {
                let (gate, up) = match gate_up {
                    GateUp::Fused(w) => {
                        let y = self.proj(w, &h)?;
                        let f = self.cfg.d_ffn;
                        (y.narrow(2, 0, f)?, y.narrow(2, f, f)?)
                    }
                    GateUp::Split(gw, uw) => (self.proj(gw, &h)?, self.proj(uw, &h)?),
                };
                let gate = self.hook(spec, MlpPre(l), gate, hc)?;
                (gate.silu()? * up)?
            }
        };
        let post = self.hook(spec, MlpPost(l), post, hc)?;
        let mlp_out = self.proj(&blk.down, &post)?;
        let mlp_out = self.hook(spec, MlpOut(l), mlp_out, hc)?;
        let x = (x + mlp_out)?;
        debug_assert_eq!(x.dims(), &[b, s, d]);
        self.hook(spec, ResidPost(l), x, hc)
    }

    fn head(
        &self,
        x: &Tensor,
        at: LogitsAt,
        spec: &HookSpec,
        hc: &mut HookCache,
    ) -> Result<Option<Tensor>> {
        let (b, s, d) = x.dims3()?;
        let sel = match at {
            LogitsAt::None => return Ok(None),
            LogitsAt::Last => x.narrow(1, s - 1, 1)?,
            LogitsAt::All => x.clone(),
            LogitsAt::Positions(p) => {
                if let Some(&bad) = p.iter().find(|&&i| i >= s) {
                    return Err(RuntimeError::BadIntervention {
                        site: "logits".into(),
                        reason: format!("position {bad} outside a call of {s} positions"),
                    });
                }
                let idx = Tensor::from_vec(
                    p.iter().map(|&i| i as u32).collect::<Vec<_>>(),
                    p.len(),
                    &self.device,
                )?;
                x.index_select(&idx, 1)?
            }
            LogitsAt::PerRow(p) => {
                let rows = p
                    .iter()
                    .enumerate()
                    .map(|(i, &at)| x.narrow(0, i, 1)?.narrow(1, at, 1))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Tensor::cat(&rows, 0)?
            }
        };
        let sel = sel.contiguous()?;
        let n = sel.dim(1)?;
        let h = self.rms(&sel, &self.final_norm)?;
        let h = self.hook(spec, HookPoint::FinalNorm, h, hc)?;
        let logits = self.proj(&self.lm_head, &h.reshape((b * n, d))?)?;
        Ok(Some(logits.reshape((b, n, self.cfg.vocab_size))?))
    }

    /// Runs `prompt` (a batch of equal-length id lists) on top of `cache`, then
    /// greedily decodes up to `opts.max_new_tokens` tokens per sequence.
    pub fn generate(
        &self,
        prompt: &[Vec<u32>],
        cache: &mut KvCache,
        opts: &GreedyOptions,
    ) -> Result<Generation> {
        self.generate_with(prompt, cache, &HookSpec::new(), opts)
    }

    /// As [`Model::generate`], with the prompt run under `spec` (captures,
    /// interventions, adapters); decoding steps run `opts.adapters`.
    pub fn generate_with(
        &self,
        prompt: &[Vec<u32>],
        cache: &mut KvCache,
        spec: &HookSpec,
        opts: &GreedyOptions,
    ) -> Result<Generation> {
        let tokens = self.tokens(prompt)?;
        let out = self.forward(&tokens, cache, spec, LogitsAt::Last)?;
        let first_logits = out.logits.expect("asked for logits").squeeze(1)?;
        self.decode_from(&first_logits, cache, opts)
    }

    /// As [`Model::generate_with`] for prompts of any lengths on a cache of
    /// any layout ([`KvCache::stack_padded`]): prompts are padded at their
    /// end, the first logits are each prompt's last real position's, and
    /// every sequence decodes from its own next position. Prompts of one
    /// length on an unpadded cache run exactly as [`Model::generate_with`];
    /// prompts of different lengths on one turn it into a padded batch.
    pub fn generate_padded(
        &self,
        prompts: &[Vec<u32>],
        cache: &mut KvCache,
        spec: &HookSpec,
        opts: &GreedyOptions,
    ) -> Result<Generation> {
        let first_logits = self.prompt_logits_padded(prompts, cache, spec)?;
        self.decode_from(&first_logits, cache, opts)
    }

    /// The logits `[batch, vocab]` at each prompt's last real position, the
    /// prompts (any lengths) run under `spec` on top of `cache` (any layout,
    /// [`KvCache::stack_padded`]) and padded at their end; `cache` grows by
    /// the padded prompts. Differentiable under [`Kernels::Differentiable`]
    /// (a batch of training examples scored in one pass). Prompts of one
    /// length on an unpadded cache run unpadded; prompts of different
    /// lengths turn an unpadded cache into a padded batch.
    pub fn prompt_logits_padded(
        &self,
        prompts: &[Vec<u32>],
        cache: &mut KvCache,
        spec: &HookSpec,
    ) -> Result<Tensor> {
        let lens: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
        let longest = lens.iter().copied().max().unwrap_or(0);
        if lens.len() != cache.batch() {
            return Err(RuntimeError::BadIntervention {
                site: "prompt".into(),
                reason: format!(
                    "{} prompts for a batch of {} sequences",
                    lens.len(),
                    cache.batch()
                ),
            });
        }
        if cache.rows().is_none() && lens.iter().all(|&n| n == longest) {
            let out = self.forward(&self.tokens(prompts)?, cache, spec, LogitsAt::Last)?;
            return Ok(out.logits.expect("asked for logits").squeeze(1)?);
        }
        // One shared layout, prompts of different lengths: padding the
        // prompts is enough (undone if the call is refused).
        let shared = cache.rows().is_none();
        if shared {
            cache.share_layout_as_rows();
        }
        let padded: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| {
                let mut p = p.clone();
                p.resize(longest, 0);
                p
            })
            .collect();
        let tokens = self.tokens(&padded)?;
        let last: Vec<usize> = lens.iter().map(|&n| n.saturating_sub(1)).collect();
        match self.forward_rows(&tokens, cache, spec, LogitsAt::PerRow(last), Some(&lens)) {
            Ok(out) => Ok(out.logits.expect("asked for logits").squeeze(1)?),
            Err(e) => {
                if shared {
                    cache.unshare_layout();
                }
                Err(e)
            }
        }
    }

    /// Greedy decoding from the logits of the last prompt position `[batch, vocab]`.
    pub fn decode_from(
        &self,
        last_logits: &Tensor,
        cache: &mut KvCache,
        opts: &GreedyOptions,
    ) -> Result<Generation> {
        let b = last_logits.dim(0)?;
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); b];
        let mut done = vec![false; b];
        let mut logits = last_logits.clone();
        for step in 0..opts.max_new_tokens {
            let next: Vec<u32> = logits.argmax(D::Minus1)?.to_vec1()?;
            for (i, &t) in next.iter().enumerate() {
                if !done[i] {
                    out[i].push(t);
                    if opts.stop_tokens.contains(&t) {
                        done[i] = true;
                    }
                }
            }
            if step + 1 == opts.max_new_tokens || done.iter().all(|&d| d) {
                break;
            }
            let t = Tensor::from_vec(next, (b, 1), &self.device)?;
            let o = self.forward(&t, cache, &opts.adapters, LogitsAt::Last)?;
            logits = o.logits.expect("asked for logits").squeeze(1)?;
        }
        Ok(Generation {
            tokens: out,
            first_logits: last_logits.clone(),
        })
    }
}

/// Options of greedy decoding.
#[derive(Debug, Clone)]
pub struct GreedyOptions {
    /// How many new tokens at most.
    pub max_new_tokens: usize,
    /// Tokens that end a sequence early (kept in the output); empty = never stop early.
    pub stop_tokens: Vec<u32>,
    /// Low-rank adapters every decoding step runs with (a bridged arm's
    /// adapters; captures and interventions are ignored here).
    pub adapters: HookSpec,
}

impl GreedyOptions {
    /// Exactly `n` new tokens, no early stop.
    pub fn tokens(n: usize) -> Self {
        Self {
            max_new_tokens: n,
            stop_tokens: Vec::new(),
            adapters: HookSpec::new(),
        }
    }

    /// The same, decoding with the adapters of `spec`.
    pub fn with_adapters(mut self, spec: &HookSpec) -> Self {
        self.adapters = spec.adapters_only();
        self
    }
}

/// What greedy decoding produced.
#[derive(Debug, Clone)]
pub struct Generation {
    /// New token ids per sequence.
    pub tokens: Vec<Vec<u32>>,
    /// Logits at the last prompt position `[batch, vocab]`.
    pub first_logits: Tensor,
}

/// Additive attention mask: new token i sees every cached entry and new
/// tokens 0..=i, and of a padded batch (`valid`, `[batch * (past + s)]`,
/// sequence-major) only the entries that are its sequence's. Shape `[s,
/// past + s]`, or `[batch, 1, 1, s, past + s]` for a padded batch.
fn attention_mask(
    s: usize,
    past: usize,
    valid: Option<&[bool]>,
    device: &Device,
) -> Result<Tensor> {
    let t = past + s;
    let b = valid.map_or(1, |v| v.len() / t);
    let data: Vec<f32> = (0..b)
        .flat_map(|r| {
            (0..s).flat_map(move |i| {
                (0..t).map(move |j| {
                    if j <= past + i && valid.is_none_or(|v| v[r * t + j]) {
                        0.0
                    } else {
                        f32::MIN
                    }
                })
            })
        })
        .collect();
    Ok(match valid {
        Some(_) => Tensor::from_vec(data, (b, 1, 1, s, t), device)?,
        None => Tensor::from_vec(data, (s, t), device)?,
    })
}

/// RoPE from per-sequence tables `cos`, `sin` `[b, s, d/2]` on `x`
/// `[b, heads, s, d]`, differentiably (candle's slow path takes one table
/// for the whole batch).
fn rope_rows_slow(x: &Tensor, cos: &Tensor, sin: &Tensor, style: RopeStyle) -> Result<Tensor> {
    let (b, h, s, d) = x.dims4()?;
    Ok(match style {
        RopeStyle::Half => {
            let cos = Tensor::cat(&[cos, cos], D::Minus1)?.unsqueeze(1)?;
            let sin = Tensor::cat(&[sin, sin], D::Minus1)?.unsqueeze(1)?;
            let x1 = x.narrow(D::Minus1, 0, d / 2)?;
            let x2 = x.narrow(D::Minus1, d / 2, d / 2)?;
            let rot = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
            (x.broadcast_mul(&cos)? + rot.broadcast_mul(&sin)?)?
        }
        RopeStyle::Interleaved => {
            let cos = cos.unsqueeze(1)?.unsqueeze(D::Minus1)?;
            let sin = sin.unsqueeze(1)?.unsqueeze(D::Minus1)?;
            let x = x.reshape((b, h, s, d / 2, 2))?;
            let x0 = x.narrow(D::Minus1, 0, 1)?;
            let x1 = x.narrow(D::Minus1, 1, 1)?;
            let y0 = (x0.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
            let y1 = (x0.broadcast_mul(&sin)? + x1.broadcast_mul(&cos)?)?;
            Tensor::cat(&[&y0, &y1], D::Minus1)?.reshape((b, h, s, d))?
        }
    })
}

fn rope_tables(cfg: &ModelConfig, device: &Device) -> Result<(Tensor, Tensor)> {
    let hd = cfg.head_dim;
    let inv: Vec<f32> = (0..hd)
        .step_by(2)
        .map(|i| 1f32 / (cfg.rope_theta as f32).powf(i as f32 / hd as f32))
        .collect();
    let n = cfg.context_length;
    let inv = Tensor::from_vec(inv, (1, hd / 2), device)?;
    let pos = Tensor::arange(0u32, n as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((n, 1))?;
    let ang = pos.matmul(&inv)?;
    Ok((ang.cos()?, ang.sin()?))
}
