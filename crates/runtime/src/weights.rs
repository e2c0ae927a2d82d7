//! Reading a checkpoint's tensors: GGUF (dequantized to f32, or kept as
//! quantized blocks for candle's QMatMul) and Hugging Face safetensors.

use crate::config::ModelConfig;
use crate::error::{Result, RuntimeError};
use candle_core::quantized::{gguf_file, QMatMul, QTensor};
use candle_core::{DType, Device, Tensor};
use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// The numeric form the weights are held in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Every weight dequantized to f32 at load: exact, deterministic,
    /// differentiable. The precision of every measurement.
    F32,
    /// Matrix weights kept in their GGUF blocks and multiplied by candle's
    /// QMatMul (activations rounded to 8 bits): faster and smaller, inference only.
    Quantized,
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Quantized => "quantized",
        })
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" => Ok(Precision::F32),
            "quantized" | "q" => Ok(Precision::Quantized),
            _ => Err(format!("unknown precision `{s}` (f32 or quantized)")),
        }
    }
}

/// The matrix-multiply backend of this build's f32 projections (recorded
/// in every run's `run.json` and in the bench).
pub const MATMUL_BACKEND: &str = "candle CPU matmul (gemm crate)";

/// The backend as a run records it: [`MATMUL_BACKEND`], whether gemm's
/// AVX-512 kernels do the products (see [`avx512_kernels`]), and whether
/// single-row products took the one-row kernel instead. The default build
/// on any CPU records [`MATMUL_BACKEND`] alone, as every run before the
/// AVX-512 option did.
pub fn matmul_backend(row_kernel: bool) -> String {
    let mut s = MATMUL_BACKEND.to_string();
    if avx512_kernels() {
        s.push_str(AVX512_KERNELS);
    }
    if row_kernel {
        s.push_str("; single rows by tolerable's one-row kernel");
    }
    s
}

/// What [`matmul_backend`] adds when gemm's AVX-512 kernels are in use; a
/// run whose records say it computed with other kernels than this build's
/// is not resumed by it (float rounding differs between the kernels).
pub const AVX512_KERNELS: &str = "; AVX-512 kernels (gemm x86-v4)";

/// Whether gemm's AVX-512 kernels do this process's f32 products: the
/// build has the `avx512` feature and the CPU offers avx512f (gemm chooses
/// its kernels by the CPU at run time; without the feature it uses its
/// AVX2/FMA kernels on every x86-64 CPU that has them).
pub fn avx512_kernels() -> bool {
    #[cfg(all(feature = "avx512", target_arch = "x86_64"))]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(all(feature = "avx512", target_arch = "x86_64")))]
    {
        false
    }
}

/// Up to this many rows, a dense projection multiplies as (W xᵀ)ᵀ.
const SMALL_BATCH_ROWS: usize = 32;

/// A matrix `[out, in]` that multiplies activations.
#[derive(Debug, Clone)]
pub enum Proj {
    /// f32 weights, `[out, in]`.
    Dense(Tensor),
    /// Quantized blocks.
    Quant(QMatMul),
}

impl Proj {
    /// `x @ Wᵀ` over the last axis of `x` (any leading shape).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        over_rows(x, |x2| {
            let rows = x2.dim(0)?;
            Ok(match self {
                // Few rows (decoding a batch): (W xᵀ)ᵀ keeps gemm on its long
                // axis, 20-45% faster than x Wᵀ at 16 rows on this machine.
                Proj::Dense(w) if (2..=SMALL_BATCH_ROWS).contains(&rows) => {
                    w.matmul(&x2.t()?)?.t()?.contiguous()?
                }
                Proj::Dense(w) => x2.matmul(&w.t()?)?,
                Proj::Quant(q) => x2.apply(q)?,
            })
        })
    }

    /// As [`Proj::forward`], except that a single f32 row on the CPU (batch-1
    /// decoding, one position's logits) is multiplied by the one-row kernel
    /// (parallel, at the memory bandwidth; its own float rounding).
    pub fn forward_row_kernel(&self, x: &Tensor) -> Result<Tensor> {
        let last = x.dims().last().copied().unwrap_or(0);
        match self {
            Proj::Dense(w)
                if x.dtype() == DType::F32
                    && x.device().is_cpu()
                    && w.device().is_cpu()
                    && last > 0
                    && x.elem_count() == last =>
            {
                over_rows(x, |x2| {
                    Ok(x2
                        .contiguous()?
                        .apply_op1(crate::matvec::RowMatvec { w: w.clone() })?)
                })
            }
            _ => self.forward(x),
        }
    }

    /// As [`Proj::forward`], for a frozen receiver under gradients: the
    /// same product, whose backward pass forms the gradient of `x` only.
    /// (candle's matmul backward also forms the weight's gradient, a
    /// weight-sized product per projection and step that frozen weights
    /// never use.) Quantized projections (which pass no gradient at all:
    /// bridges refuse them) and other devices take the plain path.
    pub fn forward_frozen(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Proj::Dense(w) if x.dtype() == DType::F32 && x.device().is_cpu() => {
                over_rows(x, |x2| {
                    Ok(x2.contiguous()?.apply_op1(FrozenMatmul { w: w.clone() })?)
                })
            }
            _ => self.forward(x),
        }
    }

    /// The f32 matrix, dequantizing if needed.
    pub fn dense(&self) -> Result<Tensor> {
        Ok(match self {
            Proj::Dense(w) => w.clone(),
            Proj::Quant(QMatMul::QTensor(q)) => q.dequantize(&q.device())?,
            Proj::Quant(QMatMul::Tensor(t)) => t.clone(),
            Proj::Quant(QMatMul::TensorF16(t)) => t.to_dtype(DType::F32)?,
        })
    }
}

/// Applies a product over the last axis of `x` to its rows: `x` flattened
/// to `[rows, in]`, the product formed, and the leading shape restored
/// with the product's width as the last axis.
fn over_rows(x: &Tensor, product: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let mut dims = x.dims().to_vec();
    let last = *dims.last().ok_or_else(|| RuntimeError::BadIntervention {
        site: "projection".into(),
        reason: "a scalar input (no last axis)".into(),
    })?;
    let rows: usize = dims[..dims.len() - 1].iter().product();
    let y = product(&x.reshape((rows, last))?)?;
    *dims.last_mut().unwrap() = y.dim(1)?;
    Ok(y.reshape(dims)?)
}

/// The f32 entries of a contiguous input of a CPU custom op (`op` names it
/// in the error for a strided one).
pub(crate) fn contiguous_f32<'s>(
    storage: &'s candle_core::CpuStorage,
    layout: &candle_core::Layout,
    op: &str,
) -> candle_core::Result<&'s [f32]> {
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(&storage.as_slice::<f32>()?[a..b]),
        None => candle_core::bail!("{op}: a strided input"),
    }
}

/// `x @ Wᵀ` (x `[rows, in]`, W `[out, in]`, f32) as one op whose backward
/// pass returns `grad @ W` for x and nothing for W. The forward product is
/// the one [`Proj::forward`] forms (the same arrangement for few rows).
struct FrozenMatmul {
    w: Tensor,
}

impl candle_core::CustomOp1 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-matmul"
    }

    fn cpu_fwd(
        &self,
        storage: &candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        // The input is made contiguous before the op.
        let x = Tensor::from_slice(
            contiguous_f32(storage, layout, "frozen-matmul")?,
            layout.shape(),
            &Device::Cpu,
        )?;
        let rows = x.dim(0)?;
        let y = if (2..=SMALL_BATCH_ROWS).contains(&rows) {
            self.w.matmul(&x.t()?)?.t()?.contiguous()?
        } else {
            x.matmul(&self.w.t()?)?
        };
        let shape = y.shape().clone();
        Ok((
            candle_core::CpuStorage::F32(y.flatten_all()?.to_vec1::<f32>()?),
            shape,
        ))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad_res.matmul(&self.w)?))
    }
}

/// Where tensors are read from; names are GGUF names (`blk.3.attn_q.weight`).
pub(crate) enum Source {
    Gguf {
        ct: gguf_file::Content,
        file: RefCell<File>,
        path: PathBuf,
    },
    Safetensors(HashMap<String, Tensor>),
}

impl Source {
    /// Opens a GGUF file and checks that every tensor's data lies inside it.
    pub(crate) fn open_gguf(path: &Path) -> Result<(Self, ModelConfig)> {
        let bad = |reason: String| RuntimeError::ModelFile {
            path: path.to_path_buf(),
            reason,
        };
        let mut file = File::open(path).map_err(|e| bad(format!("cannot open: {e}")))?;
        let file_len = file.metadata()?.len();
        let ct = gguf_file::Content::read(&mut file)
            .map_err(|e| bad(format!("not a readable GGUF file: {e}")))?;
        let mut needed = ct.tensor_data_offset;
        for (name, info) in ct.tensor_infos.iter() {
            let bytes = info.shape.elem_count() / info.ggml_dtype.block_size()
                * info.ggml_dtype.type_size();
            let end = ct.tensor_data_offset + info.offset + bytes as u64;
            if end > needed {
                needed = end;
            }
            if end > file_len {
                return Err(bad(format!(
                    "truncated: tensor `{name}` ends at byte {end}, the file has {file_len} bytes"
                )));
            }
        }
        let cfg = ModelConfig::from_gguf(&ct).map_err(|e| match e {
            RuntimeError::ModelFile { reason, .. } => bad(reason),
            other => other,
        })?;
        Ok((
            Source::Gguf {
                ct,
                file: RefCell::new(file),
                path: path.to_path_buf(),
            },
            cfg,
        ))
    }

    /// Opens a Hugging Face checkpoint directory (config.json + *.safetensors).
    pub(crate) fn open_safetensors(dir: &Path, device: &Device) -> Result<(Self, ModelConfig)> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| RuntimeError::ModelFile {
            path: cfg_path.clone(),
            reason: e.to_string(),
        })?;
        let cfg = ModelConfig::from_hf_json(&text)?;
        let mut shards: Vec<PathBuf> = std::fs::read_dir(dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        shards.sort();
        if shards.is_empty() {
            return Err(RuntimeError::ModelFile {
                path: dir.to_path_buf(),
                reason: "no *.safetensors shards".into(),
            });
        }
        let mut map = HashMap::new();
        for s in shards {
            let t = candle_core::safetensors::load(&s, device).map_err(|e| {
                RuntimeError::ModelFile {
                    path: s.clone(),
                    reason: e.to_string(),
                }
            })?;
            map.extend(t);
        }
        Ok((Source::Safetensors(map), cfg))
    }

    fn hf_name(name: &str) -> String {
        hf_name(name)
    }

    pub(crate) fn has(&self, name: &str) -> bool {
        match self {
            Source::Gguf { ct, .. } => ct.tensor_infos.contains_key(name),
            Source::Safetensors(m) => m.contains_key(&Self::hf_name(name)),
        }
    }

    fn missing(name: &str) -> RuntimeError {
        RuntimeError::Tensor {
            name: name.to_string(),
            reason: "absent from the model file".into(),
        }
    }

    fn qtensor(&self, name: &str, device: &Device) -> Result<QTensor> {
        match self {
            Source::Gguf { ct, file, path } => {
                if !ct.tensor_infos.contains_key(name) {
                    return Err(Self::missing(name));
                }
                let mut f = file.borrow_mut();
                ct.tensor(&mut *f, name, device)
                    .map_err(|e| RuntimeError::ModelFile {
                        path: path.clone(),
                        reason: format!("reading `{name}`: {e}"),
                    })
            }
            Source::Safetensors(_) => Err(RuntimeError::Tensor {
                name: name.into(),
                reason: "quantized weights need a GGUF file".into(),
            }),
        }
    }

    /// A tensor as f32, with the expected shape checked.
    pub(crate) fn f32(&self, name: &str, shape: &[usize], device: &Device) -> Result<Tensor> {
        let t = match self {
            Source::Gguf { .. } => self.qtensor(name, device)?.dequantize(device)?,
            Source::Safetensors(m) => m
                .get(&Self::hf_name(name))
                .ok_or_else(|| Self::missing(name))?
                .to_dtype(DType::F32)?,
        };
        if t.dims() != shape {
            return Err(RuntimeError::Tensor {
                name: name.into(),
                reason: format!("expected shape {shape:?}, found {:?}", t.dims()),
            });
        }
        Ok(t)
    }

    /// A matrix in the requested precision.
    pub(crate) fn proj(
        &self,
        name: &str,
        shape: &[usize],
        precision: Precision,
        device: &Device,
    ) -> Result<Proj> {
        match precision {
            Precision::F32 => Ok(Proj::Dense(self.f32(name, shape, device)?)),
            Precision::Quantized => {
                let q = self.qtensor(name, device)?;
                if q.shape().dims() != shape {
                    return Err(RuntimeError::Tensor {
                        name: name.into(),
                        reason: format!("expected shape {shape:?}, found {:?}", q.shape().dims()),
                    });
                }
                // Built directly (not via `from_qtensor`) so that the
                // CANDLE_DEQUANTIZE_ALL variable, which the parity reference
                // uses, never turns our quantized path into f32.
                use candle_core::quantized::GgmlDType;
                Ok(Proj::Quant(match q.dtype() {
                    GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => {
                        QMatMul::Tensor(q.dequantize(device)?)
                    }
                    _ => QMatMul::QTensor(std::sync::Arc::new(q)),
                }))
            }
        }
    }
}

/// The Hugging Face name of a GGUF tensor name (`blk.3.attn_q.weight` →
/// `model.layers.3.self_attn.q_proj.weight`).
pub fn hf_name(name: &str) -> String {
    if let Some(rest) = name.strip_prefix("blk.") {
        let (l, t) = rest.split_once('.').unwrap_or((rest, ""));
        let (base, kind) = t.rsplit_once('.').unwrap_or((t, "weight"));
        let hf = match base {
            "attn_norm" => "input_layernorm",
            "ffn_norm" => "post_attention_layernorm",
            "attn_q" => "self_attn.q_proj",
            "attn_k" => "self_attn.k_proj",
            "attn_v" => "self_attn.v_proj",
            "attn_output" => "self_attn.o_proj",
            "ffn_gate" => "mlp.gate_proj",
            "ffn_up" => "mlp.up_proj",
            "ffn_down" => "mlp.down_proj",
            other => other,
        };
        return format!("model.layers.{l}.{hf}.{kind}");
    }
    match name {
        "token_embd.weight" => "model.embed_tokens.weight".into(),
        "output_norm.weight" => "model.norm.weight".into(),
        "output.weight" => "lm_head.weight".into(),
        other => other.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    fn seeded(shape: (usize, usize), seed: u64) -> Tensor {
        let n = shape.0 * shape.1;
        let v: Vec<f32> = (0..n)
            .map(|i| (((i as u64 * 2654435761 + seed * 97) % 1000) as f32 / 500.0) - 1.0)
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    #[test]
    fn the_recorded_backend_names_the_kernels_the_build_and_cpu_choose() {
        let b = matmul_backend(false);
        assert!(b.starts_with(MATMUL_BACKEND), "{b}");
        // AVX-512 only with the feature and a CPU that has it.
        #[cfg(target_arch = "x86_64")]
        assert_eq!(
            avx512_kernels(),
            cfg!(feature = "avx512") && std::arch::is_x86_feature_detected!("avx512f")
        );
        assert_eq!(b.contains(AVX512_KERNELS), avx512_kernels(), "{b}");
        if !avx512_kernels() {
            // The default build records what every earlier run recorded.
            assert_eq!(b, MATMUL_BACKEND);
        }
        let r = matmul_backend(true);
        assert!(
            r.ends_with("single rows by tolerable's one-row kernel"),
            "{r}"
        );
        // Products agree with a plain sum to float rounding whichever
        // kernels run (here at a prefill's and a decoding batch's rows).
        for rows in [3, 40, 300] {
            let (k, n) = (96, 80);
            let x = seeded((rows, k), 3);
            let w = seeded((n, k), 4);
            let y = Proj::Dense(w.clone())
                .forward(&x.reshape((1, rows, k)).unwrap())
                .unwrap()
                .reshape((rows, n))
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let (xv, wv) = (x.to_vec2::<f32>().unwrap(), w.to_vec2::<f32>().unwrap());
            for i in [0, rows / 2, rows - 1] {
                for j in [0, n / 3, n - 1] {
                    let want: f64 = (0..k).map(|t| xv[i][t] as f64 * wv[j][t] as f64).sum();
                    assert!((y[i][j] as f64 - want).abs() < 1e-4, "{rows} rows: {i},{j}");
                }
            }
        }
    }

    #[test]
    fn a_frozen_projection_computes_the_same_product_and_no_weight_gradient() {
        let w = Var::from_tensor(&seeded((24, 16), 1)).unwrap();
        let proj = Proj::Dense(w.as_tensor().clone());
        // One row (the LM head at the last position), few rows (the
        // question), many rows (a context).
        for rows in [1, 5, 40] {
            let x =
                Var::from_tensor(&seeded((rows, 16), 2).reshape((1, rows, 16)).unwrap()).unwrap();
            let plain = proj.forward(x.as_tensor()).unwrap();
            let frozen = proj.forward_frozen(x.as_tensor()).unwrap();
            assert_eq!(plain.dims(), frozen.dims());
            let (p, f) = (
                plain.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                frozen.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            assert_eq!(p, f, "rows {rows}: the forward product differs");
            let gp = plain.sqr().unwrap().sum_all().unwrap().backward().unwrap();
            let gf = frozen.sqr().unwrap().sum_all().unwrap().backward().unwrap();
            assert!(gp.get(w.as_tensor()).is_some());
            assert!(
                gf.get(w.as_tensor()).is_none(),
                "rows {rows}: a weight gradient"
            );
            let d = (gp.get(x.as_tensor()).unwrap() - gf.get(x.as_tensor()).unwrap())
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(d < 1e-4, "rows {rows}: input gradients differ by {d}");
        }
    }
}
