//! The cost of hooks on a small random model: a forward with an empty
//! `HookSpec` (the no-hook path: the forward skips every hook check) against
//! the same forward capturing every layer's K, V and residual. Run with
//! `cargo bench -p tolerable-runtime --bench hooks`; both are measured in the
//! same run, so read them as a ratio.

use candle_core::Device;
use criterion::{criterion_group, criterion_main, Criterion};
use tolerable_runtime::{HookPoint, HookSpec, LogitsAt, Model, Precision};
use tolerable_testkit::tiny::{write_gguf, TinySpec};

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bench.gguf");
    let spec = TinySpec {
        n_layers: 6,
        d_model: 256,
        n_heads: 8,
        n_kv_heads: 2,
        d_ffn: 768,
        context_length: 512,
        ..TinySpec::default()
    };
    write_gguf(&spec, &path).unwrap();
    let m = Model::from_gguf(&path, Precision::F32, &Device::Cpu).unwrap();
    let ids: Vec<u32> = (0..192u32).map(|i| (i * 7) % 250).collect();
    let t = m.tokens(&[ids]).unwrap();
    let capture = HookSpec::new().capture_all(
        (0..spec.n_layers)
            .flat_map(|l| [HookPoint::RotK(l), HookPoint::V(l), HookPoint::ResidPre(l)]),
    );
    let mut g = c.benchmark_group("prefill_192_tokens");
    g.bench_function("hooks_off", |b| {
        b.iter(|| {
            m.forward(&t, &mut m.new_cache(1), &HookSpec::new(), LogitsAt::Last)
                .unwrap()
        })
    });
    g.bench_function("capture_k_v_resid_all_layers", |b| {
        b.iter(|| {
            m.forward(&t, &mut m.new_cache(1), &capture, LogitsAt::Last)
                .unwrap()
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
