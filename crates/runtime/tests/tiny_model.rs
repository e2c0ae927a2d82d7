//! The runtime on tiny random models written as real GGUF / safetensors files.
#![allow(clippy::cloned_ref_to_slice_refs)] // `&[ids.clone()]` reads better as a batch of one

use candle_core::quantized::GgmlDType;
use candle_core::{Device, Tensor};
use tolerable_runtime::gates;
use tolerable_runtime::*;
use tolerable_testkit::tiny::{write_gguf, write_hf_dir, TinySpec};

fn tiny(spec: &TinySpec, precision: Precision) -> (tempfile::TempDir, Checkpoint) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_gguf(spec, &path).unwrap();
    let ck = Checkpoint::load_gguf("tiny", &path, None, precision, &Device::Cpu).unwrap();
    (dir, ck)
}

fn abs_sum(t: &Tensor) -> f32 {
    t.abs().unwrap().sum_all().unwrap().to_scalar().unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap()
}

const PROMPTS: [&str; 3] = [
    "Context: the theory of everything.\nQuestion: what is it?\nAnswer:",
    "fn main() { println!(\"hi\"); }",
    "Ünïcödé — 東京 and the rest",
];

#[test]
fn qwen2_parity_with_candle_transformers_f32() {
    let (_d, ck) = tiny(&TinySpec::default(), Precision::F32);
    let prompts: Vec<String> = PROMPTS.iter().map(|s| s.to_string()).collect();
    let r = gates::parity(&ck, &prompts, 6).unwrap();
    for p in &r.prompts {
        assert!(p.max_abs_logit_diff <= 1e-4, "{p:?}");
        assert!(p.continuation_equal, "{p:?}");
        assert_eq!(p.argmax_agree, p.n_prompt_tokens);
    }
    assert!(r.passed);
}

#[test]
fn llama_parity_with_candle_transformers_f32() {
    let spec = TinySpec {
        arch: Arch::Llama,
        own_output: false,
        seed: 11,
        ..TinySpec::default()
    };
    let (_d, ck) = tiny(&spec, Precision::F32);
    assert_eq!(ck.model.config().rope_style, RopeStyle::Interleaved);
    let prompts: Vec<String> = PROMPTS.iter().map(|s| s.to_string()).collect();
    let r = gates::parity(&ck, &prompts, 6).unwrap();
    assert!(r.passed, "{r:?}");
}

#[test]
fn quantized_path_matches_candle_quantized() {
    let spec = TinySpec {
        matrix_dtype: GgmlDType::Q8_0,
        seed: 3,
        ..TinySpec::default()
    };
    let (_d, ck) = tiny(&spec, Precision::Quantized);
    let prompts: Vec<String> = PROMPTS.iter().map(|s| s.to_string()).collect();
    let r = gates::parity(&ck, &prompts, 6).unwrap();
    // Same kernels on the same blocks: agreement is essentially exact.
    for p in &r.prompts {
        assert!(p.max_abs_logit_diff < 1e-3, "{p:?}");
    }
    assert!(r.passed, "{r:?}");
}

#[test]
fn rebuild_and_identity_gates_pass() {
    let (_d, ck) = tiny(&TinySpec::default(), Precision::F32);
    let ids = ck.tokenizer.encode(PROMPTS[0]).unwrap();
    let r = gates::rebuild(&ck.model, &ids).unwrap();
    assert!(r.passed, "{r:?}");
    let (p, q) = ids.split_at(20);
    let i = gates::identity(&ck.model, p, q).unwrap();
    assert!(i.passed, "{i:?}");
}

#[test]
fn identity_gate_detects_a_changed_cache() {
    // The gate must be able to fail: a cache with one edited key is not the native one.
    let (_d, ck) = tiny(&TinySpec::default(), Precision::F32);
    let m = &ck.model;
    let ids = ck.tokenizer.encode(PROMPTS[0]).unwrap();
    let mut c = m.new_cache(1);
    m.forward(
        &m.tokens(&[ids[..20].to_vec()]).unwrap(),
        &mut c,
        &HookSpec::new(),
        LogitsAt::None,
    )
    .unwrap();
    let mut edited = c.clone();
    let kv = edited.layer(1).unwrap().clone();
    edited.set_layer(1, (kv.k * 1.001).unwrap(), kv.v).unwrap();
    let q = m.tokens(&[ids[20..].to_vec()]).unwrap();
    let a = m
        .forward(&q, &mut c, &HookSpec::new(), LogitsAt::All)
        .unwrap()
        .logits
        .unwrap();
    let b = m
        .forward(&q, &mut edited, &HookSpec::new(), LogitsAt::All)
        .unwrap()
        .logits
        .unwrap();
    assert!(!gates::bit_equal(&a, &b).unwrap());
}

#[test]
fn prefix_cache_plus_suffix_equals_one_pass() {
    let (_d, ck) = tiny(&TinySpec::default(), Precision::F32);
    let m = &ck.model;
    let ids = ck.tokenizer.encode(PROMPTS[0]).unwrap();
    let mut whole = m.new_cache(1);
    let a = m
        .forward(
            &m.tokens(&[ids.clone()]).unwrap(),
            &mut whole,
            &HookSpec::new(),
            LogitsAt::All,
        )
        .unwrap()
        .logits
        .unwrap();
    let mut c = m.new_cache(1);
    m.forward(
        &m.tokens(&[ids[..15].to_vec()]).unwrap(),
        &mut c,
        &HookSpec::new(),
        LogitsAt::None,
    )
    .unwrap();
    let b = m
        .forward(
            &m.tokens(&[ids[15..].to_vec()]).unwrap(),
            &mut c,
            &HookSpec::new(),
            LogitsAt::All,
        )
        .unwrap()
        .logits
        .unwrap();
    let a_tail = a.narrow(1, 15, ids.len() - 15).unwrap();
    assert!(max_diff(&a_tail, &b) < 1e-4);
    assert_eq!(c.len(), ids.len());
    assert_eq!(c.next_position(), ids.len());
    // Logits only where asked: last position equals the All row.
    let mut c2 = m.new_cache(1);
    let last = m
        .forward(
            &m.tokens(&[ids.clone()]).unwrap(),
            &mut c2,
            &HookSpec::new(),
            LogitsAt::Last,
        )
        .unwrap()
        .logits
        .unwrap();
    assert_eq!(last.dims(), &[1, 1, m.config().vocab_size]);
    assert!(
        max_diff(
            &last.squeeze(1).unwrap(),
            &a.narrow(1, ids.len() - 1, 1).unwrap().squeeze(1).unwrap()
        ) < 1e-5
    );
}

#[test]
fn batched_forward_and_decoding_match_one_at_a_time() {
    let (_d, ck) = tiny(&TinySpec::default(), Precision::F32);
    let m = &ck.model;
    let seqs: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| ck.tokenizer.encode(p).unwrap()[..12].to_vec())
        .collect();
    let opts = GreedyOptions::tokens(8);
    let mut batch_cache = m.new_cache(3);
    let batched = m.generate(&seqs, &mut batch_cache, &opts).unwrap();
    for (i, s) in seqs.iter().enumerate() {
        let mut c = m.new_cache(1);
        let one = m.generate(&[s.clone()], &mut c, &opts).unwrap();
        assert_eq!(one.tokens[0], batched.tokens[i], "sequence {i}");
        let d = max_diff(
            &one.first_logits,
            &batched.first_logits.narrow(0, i, 1).unwrap(),
        );
        assert!(d < 1e-4, "{d}");
    }
    // Stacking single caches gives the batch cache's decoding too.
    let singles: Vec<KvCache> = seqs
        .iter()
        .map(|s| {
            let mut c = m.new_cache(1);
            m.forward(
                &m.tokens(&[s.clone()]).unwrap(),
                &mut c,
                &HookSpec::new(),
                LogitsAt::None,
            )
            .unwrap();
            c
        })
        .collect();
    let refs: Vec<&KvCache> = singles.iter().collect();
    let stacked = KvCache::stack(&refs).unwrap();
    assert_eq!(stacked.batch(), 3);
    let sel = stacked.select(2).unwrap();
    assert!(max_diff(&sel.layer(0).unwrap().k, &singles[2].layer(0).unwrap().k) == 0.0);
}

#[test]
fn the_one_row_kernel_is_opt_in_and_agrees_with_gemm() {
    let (_d, ck) = tiny(&TinySpec::default(), Precision::F32);
    let m = &ck.model;
    assert!(!m.row_kernel(), "the one-row kernel must be opt-in");
    let fast = m.clone().with_row_kernel(true);
    assert!(fast.row_kernel());
    let seq = ck.tokenizer.encode(PROMPTS[0]).unwrap()[..12].to_vec();
    let opts = GreedyOptions::tokens(8);
    let gen = |model: &Model| {
        let mut c = model.new_cache(1);
        model.generate(&[seq.clone()], &mut c, &opts).unwrap()
    };
    let (a, b) = (gen(m), gen(&fast));
    // One position's logits go through the kernel at batch 1; its rounding
    // differs from gemm's, within float tolerance.
    let d = max_diff(&a.first_logits, &b.first_logits);
    assert!(d < 1e-4, "{d}");
    assert!(d > 0.0, "the kernel was not used: gemm's bits exactly");
    assert_eq!(a.tokens, b.tokens);
    // Off means gemm's own bits.
    let again = gen(&m.clone().with_row_kernel(false));
    assert!(gates::bit_equal(&a.first_logits, &again.first_logits).unwrap());
    // Batches of rows, and every position's logits, never take it.
    let t = m.tokens(&[seq.clone()]).unwrap();
    let all = |model: &Model| {
        model
            .forward(&t, &mut model.new_cache(1), &HookSpec::new(), LogitsAt::All)
            .unwrap()
            .logits
            .unwrap()
    };
    assert!(gates::bit_equal(&all(m), &all(&fast)).unwrap());
}

#[test]
fn early_stop_only_when_asked() {
    let (_d, ck) = tiny(&TinySpec::default(), Precision::F32);
    let m = &ck.model;
    let ids = ck.tokenizer.encode(PROMPTS[1]).unwrap();
    let mut c = m.new_cache(1);
    let free = m
        .generate(&[ids.clone()], &mut c, &GreedyOptions::tokens(6))
        .unwrap();
    assert_eq!(free.tokens[0].len(), 6);
    let stop = free.tokens[0][2];
    let mut c = m.new_cache(1);
    let g = m
        .generate(
            &[ids],
            &mut c,
            &GreedyOptions {
                max_new_tokens: 6,
                stop_tokens: vec![stop],
                adapters: HookSpec::new(),
            },
        )
        .unwrap();
    let first = free.tokens[0].iter().position(|&t| t == stop).unwrap();
    assert_eq!(g.tokens[0], free.tokens[0][..=first].to_vec());
}

#[test]
fn mid_stack_start_reproduces_the_full_pass() {
    let (_d, ck) = tiny(&TinySpec::default(), Precision::F32);
    let m = &ck.model;
    let ids = ck.tokenizer.encode(PROMPTS[0]).unwrap();
    let l = 2;
    let spec = HookSpec::new().capture(HookPoint::ResidPre(l));
    let mut full = m.new_cache(1);
    let out = m
        .forward(
            &m.tokens(&[ids.clone()]).unwrap(),
            &mut full,
            &spec,
            LogitsAt::All,
        )
        .unwrap();
    let resid = out.hooks.get(HookPoint::ResidPre(l)).unwrap();
    // Restart at layer l from position 10 on, keeping the first 10 entries.
    let mut c = full.truncate(10).unwrap();
    let lower = full.narrow(10, ids.len() - 10).unwrap();
    let tail = resid.narrow(1, 10, ids.len() - 10).unwrap();
    let again = m
        .forward_from_layer(l, &tail, &lower, &mut c, &HookSpec::new(), LogitsAt::All)
        .unwrap();
    let want = out.logits.unwrap().narrow(1, 10, ids.len() - 10).unwrap();
    assert!(max_diff(&want, &again.logits.unwrap()) < 1e-4);
    for layer in 0..m.config().n_layers {
        assert!(max_diff(&full.layer(layer).unwrap().k, &c.layer(layer).unwrap().k) < 1e-4);
    }
    assert_eq!(c.next_position(), ids.len());
}

#[test]
fn appended_segments_are_attended_without_moving_positions() {
    let (_d, ck) = tiny(&TinySpec::default(), Precision::F32);
    let m = &ck.model;
    let a = ck.tokenizer.encode("the cat sat on the mat").unwrap();
    let b = ck.tokenizer.encode("in the theatre").unwrap();
    let q = ck.tokenizer.encode("where?").unwrap();
    let mut own = m.new_cache(1);
    m.forward(
        &m.tokens(&[a.clone()]).unwrap(),
        &mut own,
        &HookSpec::new(),
        LogitsAt::None,
    )
    .unwrap();
    let mut other = m.new_cache(1);
    m.forward(
        &m.tokens(&[b.clone()]).unwrap(),
        &mut other,
        &HookSpec::new(),
        LogitsAt::None,
    )
    .unwrap();
    let mut aug = own.clone();
    aug.append_segment(&other).unwrap();
    assert_eq!(aug.len(), a.len() + b.len());
    assert_eq!(aug.next_position(), a.len());
    assert_eq!(aug.segments().len(), 2);
    let spec = HookSpec::new()
        .capture(HookPoint::Pattern(0))
        .capture(HookPoint::RotK(0));
    let qa = m
        .forward(
            &m.tokens(&[q.clone()]).unwrap(),
            &mut aug,
            &spec,
            LogitsAt::Last,
        )
        .unwrap();
    let pat = qa.hooks.get(HookPoint::Pattern(0)).unwrap();
    assert_eq!(pat.dims(), &[1, 4, q.len(), a.len() + b.len() + q.len()]);
    // The appended entries carry attention weight.
    let w: f32 = pat
        .narrow(3, a.len(), b.len())
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar()
        .unwrap();
    assert!(w > 0.0);
    // The question's keys took positions right after the own passage.
    let mut plain = own.clone();
    let qp = m
        .forward(&m.tokens(&[q]).unwrap(), &mut plain, &spec, LogitsAt::Last)
        .unwrap();
    assert!(gates::bit_equal(
        qa.hooks.get(HookPoint::RotK(0)).unwrap(),
        qp.hooks.get(HookPoint::RotK(0)).unwrap()
    )
    .unwrap());
    assert!(max_diff(&qa.logits.unwrap(), &qp.logits.unwrap()) > 0.0);
    // A cache of another shape cannot be appended.
    let other_model = tiny(
        &TinySpec {
            n_kv_heads: 4,
            ..TinySpec::default()
        },
        Precision::F32,
    );
    let mut wrong = other_model.1.model.new_cache(1);
    other_model
        .1
        .model
        .forward(
            &m.tokens(&[b]).unwrap(),
            &mut wrong,
            &HookSpec::new(),
            LogitsAt::None,
        )
        .unwrap();
    let e = own.append_segment(&wrong).unwrap_err().to_string();
    assert!(e.contains("cache shapes differ"), "{e}");
}

/// A cache rebuilt from its parts (copied, as from a file) reads a
/// question as the original does, bit for bit, appended segment and
/// positions included; parts that disagree with the model or do not tile
/// the entries are refused by name.
#[test]
fn a_cache_rebuilt_from_its_parts_is_the_cache() {
    let (_d, ck) = tiny(&TinySpec::default(), Precision::F32);
    let m = &ck.model;
    let cfg = m.config();
    let none = HookSpec::new();
    let read = |ids: &[u32]| {
        let mut c = m.new_cache(1);
        m.forward(
            &m.tokens(&[ids.to_vec()]).unwrap(),
            &mut c,
            &none,
            LogitsAt::None,
        )
        .unwrap();
        c
    };
    let mut aug = read(&ck.tokenizer.encode("the cat sat on the mat").unwrap());
    aug.append_segment(&read(&ck.tokenizer.encode("in the theatre").unwrap()))
        .unwrap();
    let parts = |c: &KvCache| -> Vec<LayerKv> {
        (0..c.n_layers())
            .map(|l| {
                let kv = c.require_layer(l).unwrap();
                LayerKv {
                    k: kv.k.copy().unwrap(),
                    v: kv.v.copy().unwrap(),
                }
            })
            .collect()
    };
    let back = KvCache::from_parts(
        cfg,
        parts(&aug),
        aug.segments().to_vec(),
        aug.next_position(),
    )
    .unwrap();
    assert_eq!(cache_bits(&back), cache_bits(&aug));
    assert_eq!(
        (back.segments(), back.next_position(), back.batch()),
        (aug.segments(), aug.next_position(), aug.batch())
    );
    let q = m.tokens(&[ck.tokenizer.encode("where?").unwrap()]).unwrap();
    let logits = |mut c: KvCache| {
        m.forward(&q, &mut c, &none, LogitsAt::Last)
            .unwrap()
            .logits
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    assert_eq!(logits(back), logits(aug.clone()));
    // Refused: a layer short, segments with a gap, entries of another length.
    let segs = aug.segments().to_vec();
    let mut short = parts(&aug);
    short.pop();
    let mut gap = segs.clone();
    gap[1].start += 1;
    let mut long = segs.clone();
    long[1].len += 1;
    for (layers, segments, want) in [
        (short, segs.clone(), &["layers of keys and values"][..]),
        (parts(&aug), gap, &["do not tile"]),
        (
            parts(&aug),
            long,
            &["blocks.0.attn.hook_rot_k", "expected keys/values"],
        ),
    ] {
        let e = KvCache::from_parts(cfg, layers, segments, 6)
            .unwrap_err()
            .to_string();
        assert!(want.iter().all(|w| e.contains(w)), "{want:?}: {e}");
    }
}

#[test]
fn interventions_edit_only_their_sites() {
    let (_d, ck) = tiny(&TinySpec::default(), Precision::F32);
    let m = &ck.model;
    let ids = ck.tokenizer.encode(PROMPTS[0]).unwrap();
    let t = m.tokens(&[ids.clone()]).unwrap();
    let cap = HookSpec::new().capture(HookPoint::ResidPost(0));
    let base = m
        .forward(&t, &mut m.new_cache(1), &cap, LogitsAt::All)
        .unwrap();
    // Zero the residual at position 5 of block 1's input: positions before 5 are unchanged.
    let spec = HookSpec::new()
        .intervene(Intervention::new(HookPoint::ResidPre(1), Edit::Zero).at_positions(vec![5]));
    let ed = m
        .forward(&t, &mut m.new_cache(1), &spec, LogitsAt::All)
        .unwrap()
        .logits
        .unwrap();
    let bl = base.logits.unwrap();
    assert!(gates::bit_equal(&bl.narrow(1, 0, 5).unwrap(), &ed.narrow(1, 0, 5).unwrap()).unwrap());
    assert!(max_diff(&bl.narrow(1, 5, 1).unwrap(), &ed.narrow(1, 5, 1).unwrap()) > 0.0);
    // Adding zero changes nothing, bit for bit.
    let zero = Tensor::zeros(
        (1, ids.len(), m.config().d_model),
        candle_core::DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let spec = HookSpec::new().intervene(
        Intervention::new(HookPoint::ResidPre(1), Edit::Add(zero)).at_positions(vec![1, 2, 3]),
    );
    let same = m
        .forward(&t, &mut m.new_cache(1), &spec, LogitsAt::All)
        .unwrap()
        .logits
        .unwrap();
    assert!(gates::bit_equal(&bl, &same).unwrap());
    // Knocking out one kv head at one position.
    let spec = HookSpec::new().intervene(
        Intervention::new(HookPoint::V(0), Edit::Zero)
            .at_positions(vec![2])
            .at_heads(vec![1]),
    );
    let mut c = m.new_cache(1);
    m.forward(&t, &mut c, &spec, LogitsAt::None).unwrap();
    let v = c.layer(0).unwrap().v.clone();
    let site = |head: usize| abs_sum(&v.narrow(1, head, 1).unwrap().narrow(2, 2, 1).unwrap());
    assert_eq!(site(1), 0.0);
    let nz = site(0);
    assert!(nz > 0.0);
}

#[test]
fn differentiable_kernels_agree_and_pass_gradients() {
    let (_d, ck) = tiny(&TinySpec::default(), Precision::F32);
    let fused = ck.model.clone();
    let diff = ck.model.clone().with_kernels(Kernels::Differentiable);
    let ids = ck.tokenizer.encode(PROMPTS[0]).unwrap();
    let t = fused.tokens(&[ids.clone()]).unwrap();
    let a = fused
        .forward(&t, &mut fused.new_cache(1), &HookSpec::new(), LogitsAt::All)
        .unwrap()
        .logits
        .unwrap();
    let b = diff
        .forward(&t, &mut diff.new_cache(1), &HookSpec::new(), LogitsAt::All)
        .unwrap()
        .logits
        .unwrap();
    assert!(max_diff(&a, &b) < 1e-4);
    // A gradient reaches a residual injected at block 1.
    let src = candle_core::Var::from_tensor(
        &Tensor::ones(
            (1, ids.len(), diff.config().d_model),
            candle_core::DType::F32,
            &Device::Cpu,
        )
        .unwrap(),
    )
    .unwrap();
    let spec = HookSpec::new().intervene(
        Intervention::new(
            HookPoint::ResidPre(1),
            Edit::Replace(src.as_tensor().clone()),
        )
        .at_positions(vec![3]),
    );
    let out = diff
        .forward(&t, &mut diff.new_cache(1), &spec, LogitsAt::Last)
        .unwrap()
        .logits
        .unwrap();
    let loss = out.sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let g = grads
        .get(src.as_tensor())
        .expect("a gradient for the injected residual");
    assert!(abs_sum(g) > 0.0);
}

#[test]
fn safetensors_checkpoint_equals_gguf() {
    let spec = TinySpec::default();
    let (dir, ck) = tiny(&spec, Precision::F32);
    let hf = dir.path().join("hf");
    write_hf_dir(&spec, &hf, &ck.tokenizer).unwrap();
    let st = Checkpoint::load_path("tiny-hf", &hf, Precision::F32, &Device::Cpu).unwrap();
    assert_eq!(st.sha256, None);
    assert_eq!(st.model.config().n_layers, spec.n_layers);
    let ids = ck.tokenizer.encode(PROMPTS[2]).unwrap();
    assert_eq!(st.tokenizer.encode(PROMPTS[2]).unwrap(), ids);
    let t = ck.model.tokens(&[ids]).unwrap();
    let a = ck
        .model
        .forward(
            &t,
            &mut ck.model.new_cache(1),
            &HookSpec::new(),
            LogitsAt::All,
        )
        .unwrap()
        .logits
        .unwrap();
    let b = st
        .model
        .forward(
            &t,
            &mut st.model.new_cache(1),
            &HookSpec::new(),
            LogitsAt::All,
        )
        .unwrap()
        .logits
        .unwrap();
    assert!(max_diff(&a, &b) < 1e-5);
}

#[test]
fn tokenizer_round_trips_and_specials() {
    let (_d, ck) = tiny(&TinySpec::default(), Precision::F32);
    let tk = &ck.tokenizer;
    for s in [
        "The theory in the theatre.",
        "fn f(x: &[u8]) -> Option<u32> { x.get(0).map(|b| *b as u32) }\n\tindent",
        "naïve café — 東京 🚀 ∑",
    ] {
        let ids = tk.encode(s).unwrap();
        assert_eq!(tk.decode(&ids).unwrap(), s);
    }
    // Merges apply: " the" is one token (Ġ t → Ġt, h e → he, Ġt he → Ġthe).
    let ids = tk.encode(" the").unwrap();
    assert_eq!(ids.len(), 1);
    assert_eq!(tk.token(ids[0]).unwrap(), "Ġthe");
    let im = tk.token_id("<|im_start|>").unwrap();
    assert_eq!(tk.encode("<|im_start|>user").unwrap()[0], im);
    let chat = tk.apply_chat_template("hi").unwrap();
    assert_eq!(
        chat,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert!(tk.stop_ids().contains(&tk.token_id("<|im_end|>").unwrap()));
}

#[test]
fn bad_inputs_give_clear_errors() {
    let spec = TinySpec::default();
    let (dir, ck) = tiny(&spec, Precision::F32);
    let m = &ck.model;
    // Truncated file.
    let path = dir.path().join("tiny.gguf");
    let bytes = std::fs::read(&path).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() - 1000]).unwrap();
    let e = Model::from_gguf(&cut, Precision::F32, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("cut.gguf") && e.contains("truncated"), "{e}");
    // Not a GGUF at all.
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"definitely not a model").unwrap();
    let e = Model::from_gguf(&junk, Precision::F32, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("junk.gguf"), "{e}");
    // Missing file.
    let e = Model::from_gguf(&dir.path().join("nope.gguf"), Precision::F32, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("nope.gguf"), "{e}");
    // A safetensors folder does not load quantized.
    let e = Checkpoint::load_path("tiny", dir.path(), Precision::Quantized, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("f32 only"), "{e}");
    // Prompt longer than the context.
    let long = vec![5u32; spec.context_length + 1];
    let e = m
        .forward(
            &m.tokens(&[long]).unwrap(),
            &mut m.new_cache(1),
            &HookSpec::new(),
            LogitsAt::Last,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("exceeds the model's context of 256"), "{e}");
    // A cache plus new tokens past the context.
    let mut c = m.new_cache(1);
    m.forward(
        &m.tokens(&[vec![5u32; 200]]).unwrap(),
        &mut c,
        &HookSpec::new(),
        LogitsAt::None,
    )
    .unwrap();
    let e = m
        .forward(
            &m.tokens(&[vec![5u32; 57]]).unwrap(),
            &mut c,
            &HookSpec::new(),
            LogitsAt::None,
        )
        .unwrap_err();
    assert!(matches!(
        e,
        RuntimeError::PromptTooLong { len: 257, max: 256 }
    ));
    // Hook layer out of range and unknown hook names.
    let spec_bad = HookSpec::new().capture(HookPoint::RotK(9));
    let e = m
        .forward(
            &m.tokens(&[vec![5u32; 4]]).unwrap(),
            &mut m.new_cache(1),
            &spec_bad,
            LogitsAt::None,
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("blocks.9.attn.hook_rot_k") && e.contains("3 layers"),
        "{e}"
    );
    let e = "blocks.1.attn.hook_rotk"
        .parse::<HookPoint>()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unknown hook point `blocks.1.attn.hook_rotk`"),
        "{e}"
    );
    // Token ids outside the vocabulary.
    let e = m
        .forward(
            &m.tokens(&[vec![99_999u32]]).unwrap(),
            &mut m.new_cache(1),
            &HookSpec::new(),
            LogitsAt::Last,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("99999"), "{e}");
    // Cache edits of the wrong shape name the site.
    let mut c = m.new_cache(1);
    m.forward(
        &m.tokens(&[vec![5u32; 4]]).unwrap(),
        &mut c,
        &HookSpec::new(),
        LogitsAt::None,
    )
    .unwrap();
    let k = Tensor::zeros((1, 4, 4, 16), candle_core::DType::F32, &Device::Cpu).unwrap();
    let e = c.set_layer(0, k.clone(), k).unwrap_err().to_string();
    assert!(
        e.contains("blocks.0.attn.hook_rot_k") && e.contains("n_kv_heads"),
        "{e}"
    );
}

/// The keys and values of every layer, flattened, for bit comparisons.
fn cache_bits(c: &KvCache) -> Vec<Vec<f32>> {
    (0..c.n_layers())
        .flat_map(|l| {
            let kv = c.require_layer(l).unwrap();
            [
                kv.k.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                kv.v.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            ]
        })
        .collect()
}

#[test]
fn decoding_in_place_leaves_clones_and_narrows_untouched() {
    let (_d, ck) = tiny(&TinySpec::default(), Precision::F32);
    let m = &ck.model;
    let none = HookSpec::new();
    let step = |c: &mut KvCache, ids: &[u32]| -> Tensor {
        m.forward(
            &m.tokens(&[ids.to_vec()]).unwrap(),
            c,
            &none,
            LogitsAt::Last,
        )
        .unwrap()
        .logits
        .unwrap()
    };
    // A prefill, then a question: the second call reserves spare capacity.
    let mut a = m.new_cache(1);
    step(&mut a, &[5, 6, 7, 8, 9, 10, 11]);
    step(&mut a, &[12, 13, 14]);
    let b = a.clone();
    let n = a.narrow(0, a.len()).unwrap();
    let (b0, n0) = (cache_bits(&b), cache_bits(&n));
    // `a` grows in place; its clone and its narrow keep their entries.
    let la: Vec<Tensor> = [15u32, 16, 17]
        .iter()
        .map(|&t| step(&mut a, &[t]))
        .collect();
    assert_eq!(cache_bits(&b), b0);
    assert_eq!(cache_bits(&n), n0);
    // The clone grows on its own, and `a` keeps what it wrote.
    let a1 = cache_bits(&a);
    let mut b = b;
    step(&mut b, &[40]);
    step(&mut b, &[41]);
    assert_eq!(cache_bits(&a), a1);
    // The same calls on a cache that was never cloned give the same bits.
    let mut fresh = m.new_cache(1);
    step(&mut fresh, &[5, 6, 7, 8, 9, 10, 11]);
    step(&mut fresh, &[12, 13, 14]);
    for (&t, want) in [15u32, 16, 17].iter().zip(&la) {
        let got = step(&mut fresh, &[t]);
        assert_eq!(
            got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            want.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
    }
    assert_eq!(cache_bits(&fresh), a1);
    // Growing past the spare capacity copies and goes on.
    let long: Vec<u32> = (20..100).collect();
    step(&mut fresh, &long);
    assert_eq!(fresh.len(), 7 + 3 + 3 + 80);
}

/// A seeded tensor of small values (no rand dependency in the tests).
fn seeded(shape: (usize, usize), seed: u64, scale: f32) -> Tensor {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let data: Vec<f32> = (0..shape.0 * shape.1)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

#[test]
fn low_rank_adapters_start_as_the_identity_act_as_a_weight_edit_and_train() {
    use tolerable_runtime::{Adapter, Projection};
    let (_d, ck) = tiny(&TinySpec::default(), Precision::F32);
    let cfg = ck.model.config().clone();
    let (d, hd, nh, nkv) = (cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads);
    let ids = ck.tokenizer.encode(PROMPTS[0]).unwrap();
    let m = ck.model.clone();
    let t = m.tokens(&[ids.clone()]).unwrap();
    let plain = m
        .forward(&t, &mut m.new_cache(1), &HookSpec::new(), LogitsAt::All)
        .unwrap()
        .logits
        .unwrap();
    // B = 0: bit-identical logits, on every projection.
    let zero = HookSpec::new().adapt_all([Projection::Q, Projection::K, Projection::V].map(|p| {
        let out = if p == Projection::Q {
            nh * hd
        } else {
            nkv * hd
        };
        Adapter {
            layer: 1,
            projection: p,
            a: seeded((d, 4), 1, 0.2),
            b: Tensor::zeros((4, out), candle_core::DType::F32, &Device::Cpu).unwrap(),
            scale: 2.0,
            rows: None,
        }
    }));
    let z = m
        .forward(&t, &mut m.new_cache(1), &zero, LogitsAt::All)
        .unwrap()
        .logits
        .unwrap();
    assert_eq!(max_diff(&plain, &z), 0.0);
    // A non-zero adapter on K moves the keys hook_k sees, and the logits.
    let ad = Adapter {
        layer: 0,
        projection: Projection::K,
        a: seeded((d, 4), 2, 0.5),
        b: seeded((4, nkv * hd), 3, 0.5),
        scale: 0.5,
        rows: None,
    };
    let cap = HookSpec::new().capture(HookPoint::K(0));
    let o1 = m
        .forward(&t, &mut m.new_cache(1), &cap, LogitsAt::All)
        .unwrap();
    let o2 = m
        .forward(
            &t,
            &mut m.new_cache(1),
            &cap.clone().adapt(ad.clone()),
            LogitsAt::All,
        )
        .unwrap();
    let k1 = o1.hooks.require(HookPoint::K(0)).unwrap();
    let k2 = o2.hooks.require(HookPoint::K(0)).unwrap();
    assert!(max_diff(k1, k2) > 1e-3, "the adapter moved nothing");
    assert!(max_diff(o1.logits.as_ref().unwrap(), o2.logits.as_ref().unwrap()) > 0.0);
    // Wrong shapes name the adapter.
    let bad = HookSpec::new().adapt(Adapter {
        b: seeded((4, nh * hd + 1), 4, 0.5),
        ..ad.clone()
    });
    let e = m
        .forward(&t, &mut m.new_cache(1), &bad, LogitsAt::Last)
        .unwrap_err()
        .to_string();
    assert!(e.contains("adapter"), "{e}");
    // Gradients reach A and B through the differentiable kernels; one
    // AdamW step on a cross-entropy lowers it.
    let diff = m.clone().with_kernels(Kernels::Differentiable);
    let a = candle_core::Var::from_tensor(&seeded((d, 4), 5, 0.2)).unwrap();
    let b = candle_core::Var::from_tensor(
        &Tensor::zeros((4, nh * hd), candle_core::DType::F32, &Device::Cpu).unwrap(),
    )
    .unwrap();
    let target = Tensor::new(&[7u32], &Device::Cpu).unwrap();
    let loss_of = |a: &Tensor, b: &Tensor| {
        let spec = HookSpec::new().adapt(Adapter {
            layer: 1,
            projection: Projection::Q,
            a: a.clone(),
            b: b.clone(),
            scale: 1.0,
            rows: None,
        });
        let logits = diff
            .forward(&t, &mut diff.new_cache(1), &spec, LogitsAt::Last)
            .unwrap()
            .logits
            .unwrap()
            .squeeze(1)
            .unwrap();
        candle_nn::loss::cross_entropy(&logits, &target).unwrap()
    };
    let l0 = loss_of(a.as_tensor(), b.as_tensor());
    let grads = l0.backward().unwrap();
    // With B = 0 the gradient reaches B (A's waits for B to move).
    assert!(abs_sum(grads.get(b.as_tensor()).unwrap()) > 0.0);
    use candle_nn::Optimizer;
    let mut opt = candle_nn::AdamW::new(
        vec![a.clone(), b.clone()],
        candle_nn::ParamsAdamW {
            lr: 1e-2,
            weight_decay: 0.0,
            ..Default::default()
        },
    )
    .unwrap();
    for _ in 0..5 {
        let l = loss_of(a.as_tensor(), b.as_tensor());
        opt.backward_step(&l).unwrap();
    }
    let l1 = loss_of(a.as_tensor(), b.as_tensor());
    let (l0, l1) = (
        l0.to_scalar::<f32>().unwrap(),
        l1.to_scalar::<f32>().unwrap(),
    );
    assert!(l1 < l0, "{l1} !< {l0}");
    // Decoding runs the adapters at every step: with the trained adapter
    // the continuation's logits differ from the plain decode's.
    let spec = HookSpec::new().adapt(Adapter {
        layer: 1,
        projection: Projection::Q,
        a: a.as_tensor().clone(),
        b: b.as_tensor().clone(),
        scale: 1.0,
        rows: None,
    });
    let mut c1 = m.new_cache(1);
    let first = m
        .forward(&t, &mut c1, &spec, LogitsAt::Last)
        .unwrap()
        .logits
        .unwrap()
        .squeeze(1)
        .unwrap();
    let mut c2 = c1.clone();
    let g_ad = m
        .decode_from(
            &first,
            &mut c1,
            &GreedyOptions::tokens(3).with_adapters(&spec),
        )
        .unwrap();
    let g_plain = m
        .decode_from(&first, &mut c2, &GreedyOptions::tokens(3))
        .unwrap();
    assert_eq!(g_ad.tokens[0].len(), 3);
    assert_eq!(g_plain.tokens[0][0], g_ad.tokens[0][0]);
}

/// Adapters limited to rows of a batch (`HookSpec::per_row`): each
/// sequence reads its prompt and decodes with its own adapters, as it would
/// alone (to float rounding: a batch sums in another order than one row);
/// a row with no adapter, or with B = 0, is bit-identical to the same row
/// of the unadapted batch. Hooks that cannot combine per row are refused.
#[test]
fn adapters_apply_to_their_own_rows_of_a_batch() {
    let (_d, ck) = tiny(&TinySpec::default(), Precision::F32);
    let cfg = ck.model.config().clone();
    let (d, hd, nh, nkv) = (cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads);
    let m = ck.model.clone();
    let ids = ck.tokenizer.encode(PROMPTS[0]).unwrap();
    let out_of = |p: Projection| {
        if p == Projection::Q {
            nh * hd
        } else {
            nkv * hd
        }
    };
    let adapter = |p: Projection, seed: u64, zero_b: bool| Adapter {
        layer: 1,
        projection: p,
        a: seeded((d, 4), seed, 0.5),
        b: if zero_b {
            Tensor::zeros((4, out_of(p)), candle_core::DType::F32, &Device::Cpu).unwrap()
        } else {
            seeded((4, out_of(p)), seed + 1, 0.5)
        },
        scale: 1.0,
        rows: None,
    };
    let trained = HookSpec::new()
        .adapt(adapter(Projection::Q, 10, false))
        .adapt(adapter(Projection::V, 12, false));
    let none = HookSpec::new();
    let zero = HookSpec::new()
        .adapt_all([Projection::Q, Projection::K, Projection::V].map(|p| adapter(p, 20, true)));
    let batch = HookSpec::per_row(&[&trained, &none, &zero]).unwrap();
    assert!(batch
        .adapters()
        .iter()
        .all(|a| a.rows.as_ref().unwrap().len() == 1));
    let t3 = m.tokens(&[ids.clone(), ids.clone(), ids.clone()]).unwrap();
    let logits = |spec: &HookSpec, t: &Tensor, b: usize| {
        m.forward(t, &mut m.new_cache(b), spec, LogitsAt::All)
            .unwrap()
            .logits
            .unwrap()
    };
    let row = |x: &Tensor, r: usize| -> Vec<f32> {
        x.narrow(0, r, 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let mixed = logits(&batch, &t3, 3);
    let plain = logits(&HookSpec::new(), &t3, 3);
    // Rows without a (non-zero) adapter: the unadapted batch's, bit for bit.
    assert_eq!(row(&mixed, 1), row(&plain, 1));
    assert_eq!(row(&mixed, 2), row(&plain, 2));
    // The adapted row: its own adapters, as alone, and not the plain row.
    let alone = logits(&trained, &m.tokens(&[ids.clone()]).unwrap(), 1);
    let (a, b) = (row(&mixed, 0), row(&alone, 0));
    let diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(diff < 1e-4, "{diff}");
    let moved = a
        .iter()
        .zip(row(&plain, 0))
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(moved > 1e-3, "the adapter moved nothing: {moved}");
    // Decoding keeps each row's adapters: the same tokens as alone.
    let mut c3 = m.new_cache(3);
    let g3 = m
        .generate_with(
            &[ids.clone(), ids.clone(), ids.clone()],
            &mut c3,
            &batch,
            &GreedyOptions::tokens(4).with_adapters(&batch),
        )
        .unwrap();
    let g1 = m
        .generate_with(
            &[ids.clone()],
            &mut m.new_cache(1),
            &trained,
            &GreedyOptions::tokens(4).with_adapters(&trained),
        )
        .unwrap();
    let gp = m
        .generate_with(
            &[ids.clone(), ids.clone(), ids.clone()],
            &mut m.new_cache(3),
            &HookSpec::new(),
            &GreedyOptions::tokens(4),
        )
        .unwrap();
    assert_eq!(g3.tokens[0], g1.tokens[0]);
    assert_eq!(g3.tokens[1..], gp.tokens[1..]);
    // Refused: a row's captures or interventions, an adapter already
    // limited to rows, rows outside the batch.
    let e = HookSpec::per_row(&[&none, &HookSpec::new().capture(HookPoint::K(0))])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("batch row 1") && e.contains("only adapters"),
        "{e}"
    );
    let e = HookSpec::per_row(&[&batch]).unwrap_err().to_string();
    assert!(e.contains("already limited to rows"), "{e}");
    let outside = HookSpec::new().adapt(Adapter {
        rows: Some(vec![3]),
        ..adapter(Projection::Q, 30, false)
    });
    let e = m
        .forward(&t3, &mut m.new_cache(3), &outside, LogitsAt::Last)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not rows of a batch of 3"), "{e}");
}

/// Character offsets: a text encoded at once and ids encoded segment by
/// segment both spell their text back, each token's span covering exactly
/// its bytes (multi-byte characters and special tokens included).
#[test]
fn token_offsets_spell_the_text_the_ids_were_read_from() {
    let (_d, ck) = tiny(&TinySpec::default(), Precision::F32);
    let t = &ck.tokenizer;
    for text in PROMPTS
        .iter()
        .copied()
        .chain(["<|im_start|>user\nthe theatre<|im_end|>"])
    {
        let (ids, spans) = t.encode_with_offsets(text).unwrap();
        assert_eq!(ids, t.encode(text).unwrap());
        assert_eq!(spans.len(), ids.len());
        let (back, own) = t.token_spans(&ids).unwrap();
        assert_eq!(back, text);
        // Each span holds its token's bytes; spans tile the text in order.
        let mut at = 0;
        for (i, &(s, e)) in own.iter().enumerate() {
            assert_eq!(s, at, "{text:?} token {i}");
            at = e;
        }
        assert_eq!(at, text.len());
        // The tokenizer's own offsets agree wherever a token is whole characters.
        for (i, (&a, &b)) in spans.iter().zip(&own).enumerate() {
            if text.is_char_boundary(b.0) && text.is_char_boundary(b.1) {
                assert_eq!(a, b, "{text:?} token {i}");
            }
        }
    }
    // Segment-by-segment ids (as the probe tokenizes passages) spell their text.
    let segs = [" the cat", " sat on", " the mat.\n"];
    let ids: Vec<u32> = segs
        .iter()
        .flat_map(|s| t.encode_fragment(s).unwrap())
        .collect();
    let (text, spans) = t.token_spans(&ids).unwrap();
    assert_eq!(text, segs.concat());
    assert_eq!(spans.last().unwrap().1, text.len());
}

#[test]
fn the_fused_mlp_activation_is_bit_identical_to_silu_times_up() {
    let (_d, ck) = tiny(&TinySpec::default(), Precision::F32);
    let m = &ck.model;
    let ids = ck.tokenizer.encode(PROMPTS[0]).unwrap();
    let t = m.tokens(&[ids]).unwrap();
    // Capturing the gate at every layer takes the unfused path everywhere.
    let n = m.config().n_layers;
    let unfused = HookSpec::new().capture_all((0..n).map(HookPoint::MlpPre));
    let run = |spec: &HookSpec| {
        let out = m
            .forward(&t, &mut m.new_cache(1), spec, LogitsAt::All)
            .unwrap();
        out.logits
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    assert_eq!(run(&HookSpec::new()), run(&unfused));
    // The MLP's post-activation captured both ways, bit for bit.
    let post = |extra: bool| {
        let mut spec = HookSpec::new().capture(HookPoint::MlpPost(1));
        if extra {
            spec = spec.capture(HookPoint::MlpPre(1));
        }
        let out = m
            .forward(&t, &mut m.new_cache(1), &spec, LogitsAt::None)
            .unwrap();
        out.hooks
            .require(HookPoint::MlpPost(1))
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    assert_eq!(post(false), post(true));
}

#[test]
fn the_one_pass_causal_softmax_is_bit_identical_to_scale_mask_softmax() {
    // Capturing the scores at every layer takes the written-out path (scale,
    // materialised mask, softmax) everywhere; without hooks every layer takes
    // the one-pass op. Both a power-of-two scale (head_dim 16) and another
    // (head_dim 18); a prefill from empty, one over a cached prefix, a batch
    // of two, and decoding (one new position).
    for spec in [
        TinySpec::default(),
        TinySpec {
            d_model: 72,
            arch: Arch::Llama,
            ..TinySpec::default()
        },
    ] {
        let (_d, ck) = tiny(&spec, Precision::F32);
        let m = &ck.model;
        let n = m.config().n_layers;
        let written = HookSpec::new().capture_all((0..n).map(HookPoint::AttnScores));
        let ids = ck.tokenizer.encode(PROMPTS[0]).unwrap();
        let other = ck.tokenizer.encode(PROMPTS[1]).unwrap();
        let len = ids.len().min(other.len());
        let run = |hooks: &HookSpec| {
            let mut out = Vec::new();
            let mut cache = m.new_cache(2);
            let pattern = |spec: HookSpec, ids: &[Vec<u32>], cache: &mut KvCache| {
                let spec = spec.capture(HookPoint::Pattern(1));
                let o = m
                    .forward(&m.tokens(ids).unwrap(), cache, &spec, LogitsAt::All)
                    .unwrap();
                let mut v = o
                    .logits
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                v.extend(
                    o.hooks
                        .require(HookPoint::Pattern(1))
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap(),
                );
                v
            };
            let split = len / 2;
            let rows = |a: usize, b: usize| vec![ids[a..b].to_vec(), other[a..b].to_vec()];
            out.push(pattern(hooks.clone(), &rows(0, split), &mut cache));
            out.push(pattern(hooks.clone(), &rows(split, len - 1), &mut cache));
            out.push(pattern(hooks.clone(), &rows(len - 1, len), &mut cache));
            out
        };
        let (fused, unfused) = (run(&HookSpec::new()), run(&written));
        for (step, (a, b)) in fused.iter().zip(&unfused).enumerate() {
            assert_eq!(a.len(), b.len());
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{:?}: step {step} differs", spec.arch);
        }
    }
}

#[test]
fn gradients_pass_through_every_cache_growth() {
    // A prefix read without gradient, a context whose residual carries one
    // (a router's training step), then the question: the question's own keys
    // and values must stay on the gradient's path whether or not the cache
    // has spare capacity (a clone drops it).
    let (_d, ck) = tiny(&TinySpec::default(), Precision::F32);
    let diff = ck.model.clone().with_kernels(Kernels::Differentiable);
    let ids = ck.tokenizer.encode(PROMPTS[0]).unwrap();
    let (pre, ctx, q) = (&ids[..4], &ids[4..12], &ids[12..]);
    let d = diff.config().d_model;
    let grad_of = |clone_before_question: bool| {
        let mut c = diff.new_cache(1);
        diff.forward(
            &diff.tokens(&[pre.to_vec()]).unwrap(),
            &mut c,
            &HookSpec::new(),
            LogitsAt::None,
        )
        .unwrap();
        let mut c = c.clone();
        let src = candle_core::Var::from_tensor(
            &Tensor::ones((1, ctx.len(), d), candle_core::DType::F32, &Device::Cpu).unwrap(),
        )
        .unwrap();
        let spec = HookSpec::new().intervene(
            Intervention::new(HookPoint::ResidPre(1), Edit::Add(src.as_tensor().clone()))
                .at_positions(vec![2, 3]),
        );
        diff.forward(
            &diff.tokens(&[ctx.to_vec()]).unwrap(),
            &mut c,
            &spec,
            LogitsAt::None,
        )
        .unwrap();
        let mut c = if clone_before_question { c.clone() } else { c };
        let out = diff
            .forward(
                &diff.tokens(&[q.to_vec()]).unwrap(),
                &mut c,
                &HookSpec::new(),
                LogitsAt::Last,
            )
            .unwrap()
            .logits
            .unwrap();
        let grads = out.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        grads
            .get(src.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    let (grown, cloned) = (grad_of(false), grad_of(true));
    assert!(grown.iter().any(|&g| g != 0.0));
    let worst = grown
        .iter()
        .zip(&cloned)
        .map(|(a, b)| (a - b).abs() / (1e-6 + b.abs()))
        .fold(0f32, f32::max);
    assert!(worst < 1e-3, "gradients differ by up to {worst} (relative)");
}

/// A batch-1 cache of `ids` read by `m`.
fn read(m: &Model, ids: &[u32]) -> KvCache {
    let mut c = m.new_cache(1);
    m.forward(
        &m.tokens(&[ids.to_vec()]).unwrap(),
        &mut c,
        &HookSpec::new(),
        LogitsAt::None,
    )
    .unwrap();
    c
}

/// Caches of three lengths and two layouts (one with an appended segment)
/// and questions of three lengths, decoded as one padded batch, give each
/// sequence's own decoding: the same tokens, first logits within float
/// rounding (padding changes the summation lengths, not the terms).
fn padded_batch_matches_one_at_a_time(spec: &TinySpec, kernels: Kernels) {
    let (_d, ck) = tiny(spec, Precision::F32);
    let m = ck.model.clone().with_kernels(kernels);
    let enc = |s: &str| ck.tokenizer.encode(s).unwrap();
    let mut with_segment = read(&m, &enc("the cat sat on the mat"));
    with_segment
        .append_segment(&read(&m, &enc("in the theatre of war")))
        .unwrap();
    let caches = [
        read(&m, &enc(PROMPTS[0])),
        read(&m, &enc("fn main() {}")),
        with_segment,
    ];
    let questions = [enc("where?"), enc("what is it, and why?"), enc("who")];
    assert!(questions.iter().any(|q| q.len() != questions[0].len()));
    let opts = GreedyOptions::tokens(6);
    let refs: Vec<&KvCache> = caches.iter().collect();
    let mut padded = KvCache::stack_padded(&refs).unwrap();
    let rows = padded.rows().expect("different layouts are padded");
    assert_eq!(
        rows.lens(),
        caches.iter().map(|c| c.len()).collect::<Vec<_>>()
    );
    assert_eq!(
        rows.next_positions(),
        caches.iter().map(|c| c.next_position()).collect::<Vec<_>>()
    );
    let batched = m
        .generate_padded(&questions, &mut padded, &HookSpec::new(), &opts)
        .unwrap();
    for (i, (c, q)) in caches.iter().zip(&questions).enumerate() {
        let mut own = c.clone();
        let one = m
            .generate_with(&[q.clone()], &mut own, &HookSpec::new(), &opts)
            .unwrap();
        assert_eq!(one.tokens[0], batched.tokens[i], "sequence {i}");
        let d = max_diff(
            &one.first_logits,
            &batched.first_logits.narrow(0, i, 1).unwrap(),
        );
        assert!(d < 1e-4, "sequence {i}: first logits differ by {d}");
        // Its positions advanced by its real tokens only.
        let sel = padded.select(i).unwrap();
        assert_eq!(sel.next_position(), own.next_position(), "sequence {i}");
        assert_eq!(sel.rows().unwrap().lens()[0], own.len(), "sequence {i}");
        // Its real entries (question and decoded tokens, with their RoPE
        // positions) are its own cache's, pads left out.
        let keep: Vec<u32> = sel.rows().unwrap().valid()[0]
            .iter()
            .enumerate()
            .filter(|(_, &v)| v)
            .map(|(j, _)| j as u32)
            .collect();
        let idx = Tensor::new(keep.as_slice(), &Device::Cpu).unwrap();
        for l in 0..m.config().n_layers {
            let got = sel
                .layer(l)
                .unwrap()
                .k
                .contiguous()
                .unwrap()
                .index_select(&idx, 2)
                .unwrap();
            let want = &own.layer(l).unwrap().k;
            let d = max_diff(&got, want);
            assert!(d < 1e-4, "sequence {i}, layer {l}: keys differ by {d}");
        }
    }
}

#[test]
fn a_padded_batch_decodes_each_sequence_as_alone() {
    padded_batch_matches_one_at_a_time(&TinySpec::default(), Kernels::Fused);
    padded_batch_matches_one_at_a_time(&TinySpec::default(), Kernels::Differentiable);
    let llama = TinySpec {
        arch: Arch::Llama,
        own_output: false,
        seed: 11,
        ..TinySpec::default()
    };
    padded_batch_matches_one_at_a_time(&llama, Kernels::Fused);
    padded_batch_matches_one_at_a_time(&llama, Kernels::Differentiable);
}

#[test]
fn padding_is_only_for_reading_questions_and_decoding() {
    let (_d, ck) = tiny(&TinySpec::default(), Precision::F32);
    let m = &ck.model;
    let enc = |s: &str| ck.tokenizer.encode(s).unwrap();
    let a = read(m, &enc("the cat sat on the mat"));
    let b = read(m, &enc("fn main() {}"));
    // One layout: stacked as `stack` stacks, without padding, bit for bit.
    let same = KvCache::stack_padded(&[&a, &a]).unwrap();
    assert!(same.rows().is_none());
    let plain = KvCache::stack(&[&a, &a]).unwrap();
    assert_eq!(cache_bits(&same), cache_bits(&plain));
    let mut padded = KvCache::stack_padded(&[&a, &b]).unwrap();
    let msg = |e: RuntimeError| e.to_string();
    assert!(msg(padded.narrow(0, 2).unwrap_err()).contains("padded"));
    assert!(msg(KvCache::stack(&[&padded, &padded]).unwrap_err()).contains("padded"));
    assert!(msg(padded.clone().append_segment(&a).unwrap_err()).contains("padded"));
    assert!(msg(KvCache::stack_padded(&[&padded, &a]).unwrap_err()).contains("padded"));
    assert!(msg(padded
        .set_layer(
            0,
            a.layer(0).unwrap().k.clone(),
            a.layer(0).unwrap().v.clone()
        )
        .unwrap_err())
    .contains("padded"));
    // Real lengths must fit the call.
    let t = m.tokens(&[enc("ab"), enc("ab")]).unwrap();
    let n = t.dim(1).unwrap();
    let err = m
        .forward_rows(
            &t,
            &mut padded,
            &HookSpec::new(),
            LogitsAt::None,
            Some(&[n + 1, 1]),
        )
        .unwrap_err();
    assert!(msg(err).contains("do not fit"));
    let before = padded.len();
    let err = m
        .forward_rows(
            &t,
            &mut padded,
            &HookSpec::new(),
            LogitsAt::PerRow(vec![0]),
            None,
        )
        .unwrap_err();
    assert!(msg(err).contains("per-sequence positions"));
    assert_eq!(
        padded.len(),
        before,
        "a refused call leaves the cache as it was"
    );
}

/// Each sequence of `batch` (with `questions`, under `spec`) decodes as
/// `alone[i]` does by itself.
fn assert_decodes_as_alone(
    m: &Model,
    mut batch: KvCache,
    alone: &[KvCache],
    questions: &[Vec<u32>],
    spec: &HookSpec,
) {
    let opts = GreedyOptions::tokens(5);
    let together = m
        .generate_padded(questions, &mut batch, spec, &opts)
        .unwrap();
    for (i, (c, q)) in alone.iter().zip(questions).enumerate() {
        let one = m
            .generate_with(&[q.clone()], &mut c.clone(), spec, &opts)
            .unwrap();
        assert_eq!(one.tokens[0], together.tokens[i], "sequence {i}");
        let d = max_diff(
            &one.first_logits,
            &together.first_logits.narrow(0, i, 1).unwrap(),
        );
        assert!(d < 1e-4, "sequence {i}: first logits differ by {d}");
    }
}

#[test]
fn padded_questions_on_shared_layouts_batches_of_batches_and_written_out_layers() {
    let (_d, ck) = tiny(&TinySpec::default(), Precision::F32);
    let m = &ck.model;
    let enc = |s: &str| ck.tokenizer.encode(s).unwrap();
    let a = read(m, &enc("the cat sat on the mat"));
    let b = read(m, &enc("fn main() {}"));
    let (short, long) = (enc("who"), enc("what is it, and why?"));
    // Caches of one layout with questions of different lengths: the shared
    // layout becomes a padded batch.
    let same = KvCache::stack_padded(&[&a, &a]).unwrap();
    assert!(same.rows().is_none());
    let none = HookSpec::new();
    assert_decodes_as_alone(
        m,
        same,
        &[a.clone(), a.clone()],
        &[short.clone(), long.clone()],
        &none,
    );
    // A batch-2 cache padded beside a batch-1 cache of another length.
    let two = a.repeat(2).unwrap();
    let mixed = KvCache::stack_padded(&[&two, &b]).unwrap();
    assert_eq!(mixed.batch(), 3);
    let qs = [short.clone(), long.clone(), enc("where?")];
    let alone = [a.clone(), a.clone(), b.clone()];
    assert_decodes_as_alone(m, mixed.clone(), &alone, &qs, &none);
    // A hook on one layer's scores: that layer takes the written-out
    // attention with the materialised mask, the others the one-pass softmax.
    let scores = HookSpec::new().capture(HookPoint::AttnScores(1));
    assert_decodes_as_alone(m, mixed, &alone, &qs, &scores);
}

/// The first logits of padded prompts are each prompt's own last logits
/// read alone, and a refused call leaves a shared-layout cache as it was
/// (not turned into a padded batch).
#[test]
fn padded_prompt_logits_are_each_prompts_own_and_a_refusal_changes_nothing() {
    let (_d, ck) = tiny(&TinySpec::default(), Precision::F32);
    let m = &ck.model;
    let enc = |s: &str| ck.tokenizer.encode(s).unwrap();
    let a = read(m, &enc("the cat sat on the mat"));
    let qs = [enc("who"), enc("what is it, and why?")];
    let mut both = KvCache::stack_padded(&[&a, &a]).unwrap();
    let logits = m
        .prompt_logits_padded(&qs, &mut both, &HookSpec::new())
        .unwrap();
    assert_eq!(logits.dims(), &[2, m.config().vocab_size]);
    for (i, q) in qs.iter().enumerate() {
        let alone = m
            .forward(
                &m.tokens(&[q.clone()]).unwrap(),
                &mut a.clone(),
                &HookSpec::new(),
                LogitsAt::Last,
            )
            .unwrap()
            .logits
            .unwrap()
            .squeeze(1)
            .unwrap();
        let d = max_diff(&logits.narrow(0, i, 1).unwrap(), &alone);
        assert!(d < 1e-4, "prompt {i}: {d}");
    }
    // A token outside the vocabulary: refused, and the cache is untouched.
    let mut shared = KvCache::stack_padded(&[&a, &a]).unwrap();
    let before = cache_bits(&shared);
    let bad = [qs[0].clone(), vec![m.config().vocab_size as u32 + 5, 1]];
    let e = m
        .prompt_logits_padded(&bad, &mut shared, &HookSpec::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("outside the vocabulary"), "{e}");
    assert!(shared.rows().is_none());
    assert_eq!(cache_bits(&shared), before);
    assert!(shared.narrow(0, 2).is_ok(), "still an ordinary cache");
}
