//! The one-row kernel: `x Wᵀ` for a single activation row (batch-1
//! decoding, and the LM head at one position), where candle's gemm runs a
//! matrix-vector product on one core at about half the memory bandwidth.
//! Output rows are split across the thread pool in blocks; each output is a
//! dot product summed in [`LANES`] interleaved partial sums, reduced
//! pairwise. The order of every addition is fixed by the code, not by the
//! vector width (no fused multiply-add, no reassociation), so the result is
//! the same bit for bit on any x86-64 or other CPU; it differs from gemm's
//! in float rounding, which is why the kernel is opt-in
//! ([`crate::Model::with_row_kernel`]) and recorded with every run.

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::weights::contiguous_f32;

/// Interleaved partial sums per dot product (four AVX2 registers).
const LANES: usize = 32;

/// Output rows per parallel task.
const ROW_BLOCK: usize = 128;

/// `Σ a_i b_i` in [`LANES`] partial sums (lane j takes i ≡ j mod LANES),
/// the remainder summed in order, then the lanes reduced pairwise and the
/// remainder added last.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let ca = a.chunks_exact(LANES);
    let cb = b.chunks_exact(LANES);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..LANES {
            acc[j] += x[j] * y[j];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for j in 0..width {
            acc[j] += acc[j + width];
        }
    }
    acc[0] + tail
}

/// [`dot`] over consecutive rows of `w` (`k` columns each) into `out`.
#[inline(always)]
fn rows(w: &[f32], k: usize, x: &[f32], out: &mut [f32]) {
    for (y, row) in out.iter_mut().zip(w.chunks_exact(k)) {
        *y = dot(row, x);
    }
}

/// [`rows`] in AVX2 registers: the same additions in the same order. The
/// [`LANES`] partial sums live in four 8-wide registers (lane j in register
/// j / 8), products and sums are separate instructions (no fused
/// multiply-add), and the pairwise reduction folds registers, then halves,
/// exactly as [`dot`] folds its array. (The compiler vectorizes [`dot`]
/// itself only two lanes wide, which is why this is written out.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn rows_avx2(w: &[f32], k: usize, x: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    debug_assert_eq!(LANES, 32);
    let whole = k / LANES * LANES;
    for (y, row) in out.iter_mut().zip(w.chunks_exact(k)) {
        let (rp, xp) = (row.as_ptr(), x.as_ptr());
        let mut a = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i < whole {
            for (r, acc) in a.iter_mut().enumerate() {
                // SAFETY: i + 8r + 8 <= whole <= k = row.len() = x.len().
                let p = unsafe {
                    _mm256_mul_ps(
                        _mm256_loadu_ps(rp.add(i + 8 * r)),
                        _mm256_loadu_ps(xp.add(i + 8 * r)),
                    )
                };
                *acc = _mm256_add_ps(*acc, p);
            }
            i += LANES;
        }
        let mut tail = 0f32;
        for (p, q) in row[whole..].iter().zip(&x[whole..]) {
            tail += p * q;
        }
        // Width 16, then 8: registers fold onto registers.
        let lo = _mm256_add_ps(a[0], a[2]);
        let hi = _mm256_add_ps(a[1], a[3]);
        let r8 = _mm256_add_ps(lo, hi);
        // Width 4: the upper half onto the lower.
        let r4 = _mm_add_ps(_mm256_castps256_ps128(r8), _mm256_extractf128_ps(r8, 1));
        // Width 2 and 1.
        let r2 = _mm_add_ps(r4, _mm_movehl_ps(r4, r4));
        let r1 = _mm_add_ss(r2, _mm_shuffle_ps(r2, r2, 1));
        *y = _mm_cvtss_f32(r1) + tail;
    }
}

/// `out[o] = Σ_i w[o, i] x[i]` for W `[out.len(), x.len()]` row-major,
/// parallel over blocks of output rows; `simd` chooses the AVX2 build of
/// the same arithmetic (the caller checks the CPU has it).
fn matvec_into(w: &[f32], x: &[f32], out: &mut [f32], simd: bool) {
    let k = x.len();
    debug_assert_eq!(w.len(), k * out.len());
    out.par_chunks_mut(ROW_BLOCK)
        .enumerate()
        .for_each(|(bi, o)| {
            let first = bi * ROW_BLOCK;
            let w = &w[first * k..(first + o.len()) * k];
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: `simd` is set only when the CPU reports AVX2.
                unsafe { rows_avx2(w, k, x, o) };
                return;
            }
            let _ = simd;
            rows(w, k, x, o);
        });
}

/// Whether this CPU runs the AVX2 build of the kernel.
fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `x Wᵀ` for x `[1, in]` (f32, CPU) and W `[out, in]` as a custom op
/// (forward only: the kernel is for inference, never for training).
pub(crate) struct RowMatvec {
    /// The weights, `[out, in]`, contiguous f32 on the CPU.
    pub w: Tensor,
}

impl CustomOp1 for RowMatvec {
    fn name(&self) -> &'static str {
        "row-matvec"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(storage, layout, "row-matvec")?;
        let (n_out, k) = self.w.dims2()?;
        if x.len() != k {
            candle_core::bail!(
                "row-matvec: an input of {} values for weights of {k} columns",
                x.len()
            );
        }
        let (ws, wl) = self.w.storage_and_layout();
        let w = match &*ws {
            candle_core::Storage::Cpu(s) => contiguous_f32(s, wl, "row-matvec weights")?,
            _ => candle_core::bail!("row-matvec: weights off the CPU"),
        };
        let mut out = vec![0f32; n_out];
        matvec_into(w, x, &mut out, has_avx2());
        Ok((CpuStorage::F32(out), Shape::from((1, n_out))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn lcg(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    /// The largest absolute entry of `t`.
    fn max_abs(t: &Tensor) -> f32 {
        t.abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    #[test]
    fn matches_the_order_it_documents_and_gemm_to_rounding() {
        // Widths that exercise whole lanes, a remainder, and a short row.
        for &(n_out, k) in &[(300, 896), (257, 101), (5, 7), (1, 64)] {
            let w = lcg(n_out * k, 1 + k as u64);
            let x = lcg(k, 7);
            let mut out = vec![0f32; n_out];
            matvec_into(&w, &x, &mut out, false);
            for (o, &y) in out.iter().enumerate() {
                // The documented order, written out.
                let row = &w[o * k..(o + 1) * k];
                let mut acc = [0f32; LANES];
                let whole = k / LANES * LANES;
                for i in 0..whole {
                    acc[i % LANES] += row[i] * x[i];
                }
                let mut tail = 0f32;
                for i in whole..k {
                    tail += row[i] * x[i];
                }
                let mut width = LANES;
                while width > 1 {
                    width /= 2;
                    for j in 0..width {
                        acc[j] += acc[j + width];
                    }
                }
                assert_eq!(
                    y.to_bits(),
                    (acc[0] + tail).to_bits(),
                    "row {o} of {n_out}x{k}"
                );
            }
            let wt = Tensor::from_vec(w.clone(), (n_out, k), &Device::Cpu).unwrap();
            let xt = Tensor::from_vec(x.clone(), (1, k), &Device::Cpu).unwrap();
            let ours = xt.apply_op1(RowMatvec { w: wt.clone() }).unwrap();
            let gemm = xt.matmul(&wt.t().unwrap()).unwrap();
            assert_eq!(ours.dims(), gemm.dims());
            let d = max_abs(&(ours - &gemm).unwrap());
            let scale = max_abs(&gemm);
            assert!(d <= 1e-5 * scale.max(1.0), "{n_out}x{k}: max diff {d}");
            assert_eq!(gemm.dtype(), DType::F32);
        }
    }

    #[test]
    fn the_simd_build_is_the_portable_one_bit_for_bit() {
        if !has_avx2() {
            return;
        }
        // Whole lanes only, a remainder, and rows shorter than the lanes.
        for &(n_out, k) in &[(1000, 4864), (257, 101), (3, 7)] {
            let w = lcg(n_out * k, 3);
            let x = lcg(k, 5);
            let (mut a, mut b) = (vec![0f32; n_out], vec![0f32; n_out]);
            matvec_into(&w, &x, &mut a, false);
            matvec_into(&w, &x, &mut b, true);
            assert!(
                a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()),
                "{n_out}x{k}"
            );
        }
    }

    #[test]
    fn refuses_a_mismatched_width() {
        let w = Tensor::zeros((4, 8), DType::F32, &Device::Cpu).unwrap();
        let x = Tensor::zeros((1, 6), DType::F32, &Device::Cpu).unwrap();
        let e = x.apply_op1(RowMatvec { w }).unwrap_err().to_string();
        assert!(e.contains("6 values") && e.contains("8 columns"), "{e}");
    }
}
