//! Split-context items on the real Qwen2.5 tokenizer and the real SQuAD dev subset.

use std::path::Path;
use tolerable_fetch::catalog;
use tolerable_probe::sample::sample;
use tolerable_probe::split::{Built, DropReason};
use tolerable_probe::*;
use tolerable_runtime::{gates::SQUAD_PROMPT, Tokenizer};

fn qwen_tokenizer() -> Option<Tokenizer> {
    let id = "qwen2.5-coder-0.5b-instruct";
    match catalog::cached(id).unwrap() {
        Some(p) => Some(Tokenizer::from_gguf_file(&p).unwrap()),
        None if std::env::var("TOLERABLE_SKIP_REAL").is_ok_and(|v| v == "1") => None,
        None => panic!("{id} is not in the cache; run `cargo xtask fetch-model {id}`"),
    }
}

fn squad_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/squad")
}

fn item(context: &str, question: &str, answers: &[&str]) -> QaItem {
    QaItem {
        id: "t".into(),
        title: "T".into(),
        context: context.into(),
        question: question.into(),
        answers: answers.iter().map(|s| s.to_string()).collect(),
    }
}

fn kept(b: Built) -> SplitItem {
    match b {
        Built::Kept(s) => *s,
        Built::Dropped(r) => panic!("dropped: {r:?}"),
    }
}

/// The invariants of every split item: equal lengths, differences exactly
/// at the fact region, filler tokens there.
fn check_alignment(s: &SplitItem, filler: u32) {
    assert_eq!(s.full_passage.len(), s.masked_passage.len());
    assert_eq!(s.full_prompt().len(), s.masked_prompt().len());
    for i in 0..s.full_passage.len() {
        let differs = s.full_passage[i] != s.masked_passage[i];
        assert_eq!(differs, s.fact_region.contains(&i), "position {i}");
        if differs {
            assert_eq!(s.masked_passage[i], filler);
        }
    }
    let (f, m) = (s.full_prompt(), s.masked_prompt());
    let fp = s.fact_positions();
    for i in 0..f.len() {
        assert_eq!(f[i] != m[i], fp.contains(&i));
    }
}

#[test]
fn segment_tokenization_matches_running_text() {
    // The first two sentences of the Super Bowl 50 passage: segment-by-segment
    // tokenization with the space kept in the answer segment gives exactly the
    // ids of the whole prompt tokenized at once (87 tokens).
    let Some(tk) = qwen_tokenizer() else { return };
    let ctx = SQUAD_PROMPT
        .strip_prefix("Context: ")
        .unwrap()
        .split("\nQuestion:")
        .next()
        .unwrap();
    let it = item(
        ctx,
        "Which NFL team represented the AFC at Super Bowl 50?",
        &["Denver Broncos"],
    );
    let s = kept(SplitItem::build(&it, &tk, &SplitOptions::default()).unwrap());
    assert_eq!(s.full_prompt(), tk.encode(SQUAD_PROMPT).unwrap());
    assert_eq!(s.full_prompt().len(), 87);
    let filler = tk.encode_fragment("_").unwrap()[0];
    check_alignment(&s, filler);
    assert_eq!(s.fact_region.len(), 2); // " Denver", " Broncos"
    assert_eq!(
        tk.decode(&s.full_passage[s.fact_region[0]..=s.fact_region[1]])
            .unwrap(),
        " Denver Broncos"
    );
}

#[test]
fn repeated_start_end_and_multi_token_answers() {
    let Some(tk) = qwen_tokenizer() else { return };
    let filler = tk.encode_fragment("_").unwrap()[0];
    let o = SplitOptions::default();
    // Repeated, in three cases.
    let s = kept(
        SplitItem::build(
            &item(
                "Denver won. Later, Denver lost to DENVER again.",
                "Who won?",
                &["Denver"],
            ),
            &tk,
            &o,
        )
        .unwrap(),
    );
    check_alignment(&s, filler);
    assert_eq!(s.n_answer_spans, 3);
    assert!(s.fact_region.len() >= 3); // " DENVER" may take two tokens
                                       // At passage start: the first passage token is masked.
    let s = kept(
        SplitItem::build(
            &item(
                "Marenholm is the capital of Veltra.",
                "What is the capital of Veltra?",
                &["Marenholm"],
            ),
            &tk,
            &o,
        )
        .unwrap(),
    );
    check_alignment(&s, filler);
    assert_eq!(s.fact_region[0], 0);
    assert_eq!(s.common_prefix_len(), s.prefix_ids.len());
    // At passage end (no final punctuation): the last passage tokens are masked.
    let s = kept(
        SplitItem::build(
            &item(
                "The capital of Veltra is Marenholm",
                "What is the capital of Veltra?",
                &["Marenholm"],
            ),
            &tk,
            &o,
        )
        .unwrap(),
    );
    check_alignment(&s, filler);
    // The passage ends with the answer, then the newline that opens the question.
    assert_eq!(
        tk.decode(&s.full_passage[s.full_passage.len() - 1..])
            .unwrap(),
        "\n"
    );
    assert_eq!(*s.fact_region.last().unwrap(), s.full_passage.len() - 2);
    // Multi-token answer, two gold answers overlapping.
    let s = kept(
        SplitItem::build(
            &item(
                "The Carolina Panthers lost 24–10 in Santa Clara, California.",
                "Who lost?",
                &["Carolina Panthers", "Panthers"],
            ),
            &tk,
            &o,
        )
        .unwrap(),
    );
    check_alignment(&s, filler);
    assert_eq!(s.n_answer_spans, 1);
    assert!(s.fact_region.len() >= 2);
    let st = s.fact_region[0];
    assert_eq!(
        s.fact_region,
        (st..st + s.fact_region.len()).collect::<Vec<_>>()
    );
}

#[test]
fn drops_and_errors() {
    let Some(tk) = qwen_tokenizer() else { return };
    let o = SplitOptions::default();
    let b = SplitItem::build(&item("Paris is big.", "Is Paris big?", &["Paris"]), &tk, &o).unwrap();
    assert!(matches!(
        b,
        Built::Dropped(DropReason::QuestionContainsAnswer)
    ));
    let short = SplitOptions {
        max_prompt_tokens: 10,
        ..SplitOptions::default()
    };
    let b = SplitItem::build(
        &item(
            "Paris is a big city in France, on the Seine.",
            "Where?",
            &["France"],
        ),
        &tk,
        &short,
    )
    .unwrap();
    assert!(matches!(b, Built::Dropped(DropReason::TooLong)));
    // An answer that is not in its passage drops the item, counted like the
    // other reasons; it does not stop a sample.
    let b = SplitItem::build(&item("Paris is big.", "Where?", &["Lyon"]), &tk, &o).unwrap();
    assert!(matches!(b, Built::Dropped(DropReason::AnswerNotInPassage)));
    let mut items = synthetic::generate(4, 2);
    items.insert(1, item("Paris is big.", "Where?", &["Lyon"]));
    let s = sample(&items, &tk, &o, 4, 2).unwrap();
    assert_eq!(s.items.len(), 4);
    assert_eq!(s.dropped.get("answer_not_in_passage"), Some(&1));
    let bad = SplitOptions {
        filler: "unbelievably".into(),
        ..SplitOptions::default()
    };
    let e = SplitItem::build(&item("Paris is big.", "Where?", &["Paris"]), &tk, &bad)
        .unwrap_err()
        .to_string();
    assert!(e.contains("must be exactly one"), "{e}");
    let items = synthetic::generate(5, 1);
    let e = sample(&items, &tk, &o, 10, 1).unwrap_err().to_string();
    assert!(e.contains("asked for 10 items, but only 5"), "{e}");
    let e = sample(&[], &tk, &o, 1, 1).unwrap_err().to_string();
    assert!(e.contains("empty"), "{e}");
}

#[test]
fn squad_dev_sample_is_aligned_and_seeded() {
    let Some(tk) = qwen_tokenizer() else { return };
    let items =
        squad::load(&squad::resolve_path(Some(&squad_dir()), squad::Split::Dev).unwrap()).unwrap();
    let o = SplitOptions::default();
    let a = sample(&items, &tk, &o, 40, 17).unwrap();
    assert_eq!(a.items.len(), 40);
    assert_eq!(a.ids(), sample(&items, &tk, &o, 40, 17).unwrap().ids());
    assert_ne!(a.ids(), sample(&items, &tk, &o, 40, 18).unwrap().ids());
    let filler = tk.encode_fragment("_").unwrap()[0];
    for s in &a.items {
        check_alignment(s, filler);
        assert!(s.full_prompt().len() <= o.max_prompt_tokens);
        // The passage is a prefix: the prompt starts with the template prefix and passage.
        assert_eq!(
            &s.full_prompt()[..s.context_len()],
            &[&s.prefix_ids[..], &s.full_passage].concat()[..]
        );
        let sites = controls::position_control_sites(s);
        assert!(sites
            .iter()
            .all(|&p| p >= s.prefix_ids.len() && p < s.common_prefix_len()));
    }
}

#[test]
fn chat_template_keeps_the_passage_a_prefix_region() {
    let Some(tk) = qwen_tokenizer() else { return };
    let o = SplitOptions {
        template: Template::Chat,
        ..SplitOptions::default()
    };
    let it = item(
        "Marenholm is the capital of Veltra.",
        "What is the capital of Veltra?",
        &["Marenholm"],
    );
    let s = kept(SplitItem::build(&it, &tk, &o).unwrap());
    let text = tk.decode(&s.full_prompt()).unwrap();
    assert!(text.starts_with("<|im_start|>system"), "{text}");
    assert!(text.contains("Context: Marenholm is the capital of Veltra.\nQuestion: What is the capital of Veltra?"), "{text}");
    assert!(text.ends_with("<|im_start|>assistant\n"), "{text}");
}
