//! The runner on the real 0.5B and real SQuAD dev items: the anchors it
//! computes from shared passes equal plain generation on the prompts, the
//! identity and no-op arms pass their bit-exact gates, a residual restart at
//! layer 0 from the native state reproduces the native continuation, and
//! batching arms does not change any continuation.
//!
//! The model must be cached (`cargo xtask fetch-model qwen2.5-coder-0.5b-instruct`);
//! a missing model fails unless `TOLERABLE_SKIP_REAL=1`.

use std::path::Path;
use tolerable_driver::config::SweepConfig;
use tolerable_driver::{Base, Batching, Runner};
use tolerable_probe::SplitOptions;
use tolerable_runtime::{catalog, Checkpoint, GreedyOptions, Precision};

const ID: &str = "qwen2.5-coder-0.5b-instruct";

const ARMS: &str = r#"
[run]
name = "real"
[data]
source = "squad_dev"
n = 3

[[arms]]
name = "identity"
expect = "native"
inject = { carrier = "kv", positions = "all", source = "native" }

[[arms]]
name = "noop_resid"
expect = "floor"
inject = { carrier = "h", layers = 12, positions = "fact_region", source = "own" }

[[arms]]
name = "h_identity"
inject = { carrier = "h", layers = 0, positions = "all", source = "native" }

[[arms]]
name = "kv_augment"
inject = { carrier = "kv", positions = "passage", source = "holder", mechanism = "append" }

[[arms]]
name = "act_replace"
inject = { carrier = "h", layers = 8, positions = "fact_region", source = "holder" }
"#;

#[test]
fn runner_on_the_real_model_matches_plain_generation_and_passes_its_gates() {
    if catalog::cached(ID).unwrap().is_none() {
        if std::env::var("TOLERABLE_SKIP_REAL").is_ok_and(|v| v == "1") {
            eprintln!("skipping: {ID} is not fetched and TOLERABLE_SKIP_REAL=1");
            return;
        }
        panic!("{ID} is not in the cache; run `cargo xtask fetch-model {ID}` (or set TOLERABLE_SKIP_REAL=1)");
    }
    let ck = Checkpoint::load(ID, Precision::F32, &candle_core::Device::Cpu).unwrap();
    let squad =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/squad/squad-dev.json");
    let raw = tolerable_probe::squad::load(&squad).unwrap();
    let sample =
        tolerable_probe::sample::sample(&raw, &ck.tokenizer, &SplitOptions::default(), 3, 0)
            .unwrap();
    let cfg = SweepConfig::parse(ARMS).unwrap();
    cfg.validate(ck.model.config(), ID, &|_| unreachable!())
        .unwrap();
    let (floor, native) = (cfg.anchor(Base::Masked), cfg.anchor(Base::Full));
    let idx = |name: &str| cfg.arms.iter().position(|a| a.arm.name == name).unwrap();
    let batched = Runner::new(&ck.model, &cfg.arms, floor, native, 8, 0).unwrap();
    let single = Runner::new(&ck.model, &cfg.arms, floor, native, 8, 0)
        .unwrap()
        .with_batching(Batching::OneAtATime);
    for (i, it) in sample.items.iter().enumerate() {
        let b = batched.run_item(it, i, None).unwrap();
        let s = single.run_item(it, i, None).unwrap();
        for (a, pa) in cfg.arms.iter().enumerate() {
            assert_eq!(
                b[a].tokens, s[a].tokens,
                "{} on {}: batching changed the continuation",
                pa.arm.name, it.item.id
            );
        }
        assert_eq!(b[idx("identity")].bit_exact, Some(true));
        assert_eq!(b[idx("noop_resid")].bit_exact, Some(true));
        assert_eq!(b[idx("h_identity")].tokens, b[native].tokens);
        assert!((b[idx("act_replace")].fidelity_cosine.unwrap() - 1.0).abs() < 1e-9);
        // The anchors from shared passes equal plain generation on the whole prompts.
        for (prompt, arm) in [(it.masked_prompt(), floor), (it.full_prompt(), native)] {
            let mut c = ck.model.new_cache(1);
            let g = ck
                .model
                .generate(&[prompt], &mut c, &GreedyOptions::tokens(8))
                .unwrap();
            assert_eq!(
                ck.tokenizer.decode(&g.tokens[0]).unwrap(),
                ck.tokenizer.decode(&b[arm].tokens).unwrap(),
                "{} on {}",
                cfg.arms[arm].arm.name,
                it.item.id
            );
        }
    }
}
