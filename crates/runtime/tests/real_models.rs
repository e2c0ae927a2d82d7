//! Integration tests on the real checkpoints (PROTOCOL.md, "Models").
//!
//! The models must be in the cache (`cargo xtask fetch-model <id>`; `.ci/run`
//! fetches the 0.5B and SmolLM2). A missing model fails the test with the
//! command to run, unless `TOLERABLE_SKIP_REAL=1` says to skip on purpose.
//! The 1.5B test is `#[ignore]`d: run it with
//! `cargo test -p tolerable-runtime --test real_models -- --ignored`.
#![allow(clippy::cloned_ref_to_slice_refs)] // `&[ids.clone()]` reads better as a batch of one

use candle_core::Device;
use std::sync::OnceLock;
use tolerable_fetch::catalog;
use tolerable_runtime::gates::{self, parity_prompts, SQUAD_PROMPT};
use tolerable_runtime::{Checkpoint, GreedyOptions, HookSpec, LogitsAt, Precision};

/// The 0.5B in f32, loaded once and shared by the tests of this binary.
static QWEN05: OnceLock<Option<Checkpoint>> = OnceLock::new();

fn qwen05() -> Option<&'static Checkpoint> {
    QWEN05
        .get_or_init(|| load("qwen2.5-coder-0.5b-instruct", Precision::F32))
        .as_ref()
}

fn load(id: &str, precision: Precision) -> Option<Checkpoint> {
    if catalog::cached(id).unwrap().is_none() {
        if std::env::var("TOLERABLE_SKIP_REAL").is_ok_and(|v| v == "1") {
            eprintln!("skipping: {id} is not fetched and TOLERABLE_SKIP_REAL=1");
            return None;
        }
        panic!("{id} is not in the cache; run `cargo xtask fetch-model {id}` (or set TOLERABLE_SKIP_REAL=1)");
    }
    let ck = tolerable_fetch::load(id, precision, &Device::Cpu).unwrap();
    // Loaded through the catalog: the file was verified, and the record holds its hash.
    assert_eq!(
        ck.sha256.as_deref(),
        Some(catalog::spec(id).unwrap().sha256)
    );
    Some(ck)
}

/// Each string encodes to its pinned ids and decodes back to itself.
fn check_pinned(tk: &tolerable_runtime::Tokenizer, cases: &[(&str, &[u32])]) {
    for &(s, want) in cases {
        let ids = tk.encode(s).unwrap();
        assert_eq!(ids, want, "{s:?}");
        assert_eq!(tk.decode(&ids).unwrap(), s);
    }
}

fn all_gates(ck: &Checkpoint) {
    let r = gates::parity(ck, &parity_prompts(), 8).unwrap();
    for p in &r.prompts {
        eprintln!(
            "parity {}: {:?} / {:?}, max |dlogit| {:.2e}, argmax {}/{}",
            ck.id, p.ours, p.reference, p.max_abs_logit_diff, p.argmax_agree, p.n_prompt_tokens
        );
    }
    assert!(r.passed, "parity gate failed on {}: {r:?}", ck.id);
    let ids = ck.tokenizer.encode(SQUAD_PROMPT).unwrap();
    let rb = gates::rebuild(&ck.model, &ids).unwrap();
    assert!(rb.passed, "rebuild gate failed on {}: {rb:?}", ck.id);
    let split = ids.len() - 14;
    let id = gates::identity(&ck.model, &ids[..split], &ids[split..]).unwrap();
    assert!(id.passed, "identity gate failed on {}: {id:?}", ck.id);
}

#[test]
fn qwen05_gates_f32() {
    let Some(ck) = qwen05() else { return };
    all_gates(ck);
}

#[test]
fn qwen05_squad_prompt_matches_the_independent_reference() {
    // llama.cpp and transformers on the same GGUF: 87 prompt tokens,
    // continuation " Denver Broncos\nTo answer this question,".
    let Some(ck) = qwen05() else { return };
    let ids = ck.tokenizer.encode(SQUAD_PROMPT).unwrap();
    assert_eq!(ids.len(), 87);
    let mut c = ck.model.new_cache(1);
    let g = ck
        .model
        .generate(&[ids], &mut c, &GreedyOptions::tokens(8))
        .unwrap();
    assert_eq!(
        ck.tokenizer.decode(&g.tokens[0]).unwrap(),
        " Denver Broncos\nTo answer this question,"
    );
}

#[test]
fn qwen05_tokenizer_ids_pinned_from_tiktoken() {
    // Generated independently with tiktoken over the GGUF's own vocabulary
    // (ranks = ids of the byte-level tokens, Qwen2 split pattern, NFC):
    //   enc = tiktoken.Encoding("qwen2", pat_str=QWEN2_PATTERN, mergeable_ranks=ranks, special_tokens=special)
    //   enc.encode(unicodedata.normalize("NFC", s), allowed_special="all")
    let Some(ck) = qwen05() else { return };
    let cases: [(&str, &[u32]); 5] = [
        ("Hello, world!", &[9707, 11, 1879, 0]),
        (
            "def add(a, b):\n    return a + b\n",
            &[750, 912, 2877, 11, 293, 982, 262, 470, 264, 488, 293, 198],
        ),
        (
            "naïve café — 東京 🚀",
            &[
                3376, 37572, 586, 51950, 1959, 60596, 109, 46553, 11162, 248, 222,
            ],
        ),
        (
            "Super Bowl 50 in 2015: 24–10",
            &[
                19284, 20288, 220, 20, 15, 304, 220, 17, 15, 16, 20, 25, 220, 17, 19, 4142, 16, 15,
            ],
        ),
        (
            "<|im_start|>user\nhi<|im_end|>",
            &[151644, 872, 198, 6023, 151645],
        ),
    ];
    check_pinned(&ck.tokenizer, &cases);
    let chat = ck.tokenizer.apply_chat_template("hi").unwrap();
    assert!(
        chat.starts_with("<|im_start|>system\n")
            && chat.ends_with("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"),
        "{chat:?}"
    );
}

#[test]
fn qwen05_quantized_path_against_candle_quantized() {
    let Some(ck) = load("qwen2.5-coder-0.5b-instruct", Precision::Quantized) else {
        return;
    };
    let r = gates::parity(&ck, &parity_prompts(), 8).unwrap();
    for p in &r.prompts {
        eprintln!(
            "quantized parity: {:?} / {:?}, max |dlogit| {:.2e}, argmax {}/{}",
            p.ours, p.reference, p.max_abs_logit_diff, p.argmax_agree, p.n_prompt_tokens
        );
    }
    assert!(r.passed, "{r:?}");
}

#[test]
fn qwen05_batch_of_arms_matches_single_runs() {
    // Three sequences sharing one read of the weights decode as they do alone.
    let Some(ck) = qwen05() else { return };
    let m = &ck.model;
    let ids = ck.tokenizer.encode(SQUAD_PROMPT).unwrap();
    let (passage, question) = ids.split_at(ids.len() - 14);
    let mut pc = m.new_cache(1);
    m.forward(
        &m.tokens(&[passage.to_vec()]).unwrap(),
        &mut pc,
        &HookSpec::new(),
        LogitsAt::None,
    )
    .unwrap();
    let mut batch = pc.repeat(3).unwrap();
    let g = m
        .generate(
            &vec![question.to_vec(); 3],
            &mut batch,
            &GreedyOptions::tokens(6),
        )
        .unwrap();
    let mut one = pc.clone();
    let g1 = m
        .generate(&[question.to_vec()], &mut one, &GreedyOptions::tokens(6))
        .unwrap();
    for t in &g.tokens {
        assert_eq!(t, &g1.tokens[0]);
    }
}

#[test]
fn qwen05_prompt_too_long_is_an_error() {
    let Some(ck) = qwen05() else { return };
    let m = &ck.model;
    let mut c = m.new_cache(1);
    let n = m.config().context_length + 1;
    // The check happens before any work, so this costs nothing.
    let e = m
        .forward(
            &m.tokens(&[vec![0u32; n]]).unwrap(),
            &mut c,
            &HookSpec::new(),
            LogitsAt::Last,
        )
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("exceeds the model's context of 32768"),
        "{e}"
    );
}

#[test]
fn smollm2_gates_f32() {
    let Some(ck) = load("smollm2-135m-instruct", Precision::F32) else {
        return;
    };
    assert_eq!(ck.model.config().n_layers, 30);
    assert_eq!(ck.model.config().n_kv_heads, 3);
    all_gates(&ck);
}

#[test]
#[ignore = "1.5B: about 7 GB in f32 and several minutes; run with --ignored"]
fn qwen15_gates_f32() {
    let Some(ck) = load("qwen2.5-coder-1.5b-instruct", Precision::F32) else {
        return;
    };
    assert_eq!(ck.model.config().n_layers, 28);
    assert_eq!(ck.model.config().head_dim, 128);
    all_gates(&ck);
}

#[test]
fn smollm2_tokenizer_ids_pinned_from_tiktoken() {
    // tiktoken over the GGUF's own vocabulary (ranks = ids), the GPT-2 split
    // pattern with single digits first (`\p{N}|'s|'t|...`), as SmolLM2 splits.
    let id = "smollm2-135m-instruct";
    let Some(path) = catalog::cached(id).unwrap() else {
        assert!(
            std::env::var("TOLERABLE_SKIP_REAL").is_ok_and(|v| v == "1"),
            "{id} is not fetched"
        );
        return;
    };
    let tk = tolerable_runtime::Tokenizer::from_gguf_file(&path).unwrap();
    let cases: [(&str, &[u32]); 5] = [
        ("Hello, world!", &[19556, 28, 905, 17]),
        (
            "def add(a, b):\n    return a + b\n",
            &[
                1604, 803, 24, 81, 28, 278, 727, 472, 1003, 253, 1232, 278, 198,
            ],
        ),
        (
            "naïve café — 東京 🚀",
            &[
                3546, 46494, 37366, 1841, 17097, 247, 126, 16736, 122, 15107, 244, 218,
            ],
        ),
        (
            "Super Bowl 50 in 2015: 24–10",
            &[
                22959, 33926, 216, 37, 32, 281, 216, 34, 32, 33, 37, 42, 216, 34, 36, 1494, 33, 32,
            ],
        ),
        ("<|im_start|>user\nhi<|im_end|>", &[1, 4093, 198, 6004, 2]),
    ];
    check_pinned(&tk, &cases);
}
