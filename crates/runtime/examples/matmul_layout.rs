//! Times x @ Wᵀ with W stored [out, in] (transposed view) against W stored
//! [in, out] (contiguous), for prefill and decode shapes.
use candle_core::{Device, Tensor};
use std::time::Instant;

fn time(f: impl Fn() -> candle_core::Result<Tensor>) -> f64 {
    f().unwrap();
    let s = Instant::now();
    for _ in 0..5 {
        f().unwrap();
    }
    s.elapsed().as_secs_f64() / 5.0
}

fn main() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    for (m, k, n) in [
        (300, 896, 9728),
        (1, 896, 9728),
        (16, 896, 9728),
        (16, 4864, 896),
        (1, 4864, 896),
        (300, 4864, 896),
    ] {
        let x = Tensor::randn(0f32, 1., (m, k), &dev)?;
        let w = Tensor::randn(0f32, 1., (n, k), &dev)?;
        let wt = w.t()?.contiguous()?;
        let a = time(|| x.matmul(&w.t()?));
        let b = time(|| x.matmul(&wt));
        let c = time(|| w.matmul(&x.t()?)?.t()?.contiguous());
        println!(
            "m={m:4} k={k:5} n={n:5}: view {:.4} s, contiguous [in,out] {:.4} s, (W xT)T {:.4} s",
            a, b, c
        );
    }
    Ok(())
}
