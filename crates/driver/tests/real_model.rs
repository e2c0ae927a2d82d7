//! The runner on the real 0.5B and real SQuAD dev items: the anchors it
//! computes from shared passes equal plain generation on the prompts, the
//! identity and no-op arms pass their bit-exact gates, a residual restart at
//! layer 0 from the native state reproduces the native continuation, and
//! batching arms (per item, or every arm of several items padded into one
//! batch) does not change any continuation.
//!
//! The model must be cached (`cargo xtask fetch-model qwen2.5-coder-0.5b-instruct`);
//! a missing model fails unless `TOLERABLE_SKIP_REAL=1`.

use std::collections::BTreeMap;
use std::path::Path;
use tolerable_driver::config::SweepConfig;
use tolerable_driver::{compile, Base, Batching, ItemJob, Runner};
use tolerable_fetch::catalog;
use tolerable_probe::SplitOptions;
use tolerable_runtime::{GreedyOptions, Precision};

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
    let ck = tolerable_fetch::load(ID, Precision::F32, &candle_core::Device::Cpu).unwrap();
    let squad =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/squad/squad-dev.json");
    let raw = tolerable_probe::squad::load(&squad).unwrap();
    let sample =
        tolerable_probe::sample::sample(&raw, &ck.tokenizer, &SplitOptions::default(), 3, 0)
            .unwrap();
    let cfg = SweepConfig::parse(ARMS).unwrap();
    let plan = compile(&cfg, ck.model.config(), ID, &|_| unreachable!()).unwrap();
    let (floor, native) = (cfg.anchor(Base::Masked), cfg.anchor(Base::Full));
    let idx = |name: &str| cfg.arms.iter().position(|a| a.arm.name == name).unwrap();
    let none = BTreeMap::new();
    let batched = Runner::new(&ck.model, &plan, &none, 8, 0);
    let single = Runner::new(&ck.model, &plan, &none, 8, 0).with_batching(Batching::OneAtATime);
    // Every arm of the three items as one padded batch (passages, layouts
    // and questions of different lengths).
    let padded = Runner::new(&ck.model, &plan, &none, 8, 0).with_batching(Batching::Padded);
    let pairs: Vec<_> = sample.items.iter().map(|it| it.pair()).collect();
    let jobs = ItemJob::without_partners(&pairs);
    let together = padded.run_items_timed(&jobs).unwrap();
    for (i, it) in sample.items.iter().enumerate() {
        let b = batched.run_item(&it.pair(), i, &[]).unwrap();
        let p = &together[i].0;
        for (a, pa) in cfg.arms.iter().enumerate() {
            assert_eq!(
                b[a].tokens, p[a].tokens,
                "{} on {}: padding items into one batch changed the continuation",
                pa.arm.name, it.item.id
            );
            assert_eq!(b[a].bit_exact, p[a].bit_exact, "{}", pa.arm.name);
        }
        let s = single.run_item(&it.pair(), i, &[]).unwrap();
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
        assert!((b[idx("act_replace")].measures.fidelity_cosine.unwrap() - 1.0).abs() < 1e-9);
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

/// Every shipped config compiles against its receiver's real geometry (the
/// model file's header; configs of receivers not fetched here are skipped);
/// measurement configs are planned against it.
#[test]
fn shipped_configs_compile_against_their_receivers() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
    let mut dirs = vec![root];
    let mut compiled = 0;
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
                continue;
            }
            if p.extension().is_none_or(|x| x != "toml") {
                continue;
            }
            // Measurement configs (`[measure]`) plan against the model's
            // header and tokenizer: every field checked, every pair built.
            if tolerable_driver::measure::is_measure_config(&p).unwrap() {
                let cfg = tolerable_driver::measure::MeasureConfig::from_file(&p).unwrap();
                if tolerable_fetch::resolve(&cfg.run.model).is_err() {
                    eprintln!("skipping {}: {} is not fetched", p.display(), cfg.run.model);
                    continue;
                }
                // Conditioning and quantization probes are SQuAD items.
                let squad =
                    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/squad");
                let opts = tolerable_driver::measure::MeasureOptions {
                    data: [
                        ("squad_dev".to_string(), squad.clone()),
                        ("squad_train".to_string(), squad),
                    ]
                    .into_iter()
                    .collect(),
                    ..Default::default()
                };
                tolerable_driver::measure::dry_run(&p, &opts)
                    .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                compiled += 1;
                continue;
            }
            let cfg = SweepConfig::from_file(&p).unwrap();
            if tolerable_fetch::resolve(&cfg.run.model).is_err() {
                eprintln!("skipping {}: {} is not fetched", p.display(), cfg.run.model);
                continue;
            }
            let geometry = tolerable_driver::sweep::model_config_of(&cfg.run.model).unwrap();
            let plan = compile(
                &cfg,
                &geometry,
                &cfg.run.model,
                &tolerable_driver::sweep::model_config_of,
            )
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            assert_eq!(plan.programs.len(), cfg.arms.len());
            compiled += 1;
        }
    }
    assert!(compiled >= 5, "{compiled} configs compiled");
}
