//! The Mode D code-edit corpus on the real Qwen2.5 tokenizer: context
//! lengths, edits that leave the tokens before them unchanged, archetype
//! applicability, typed skips and determinism.

use std::collections::BTreeMap;
use tolerable_fetch::catalog;
use tolerable_probe::code::{
    build_all, corpus, pair::edit_seed, Archetype, CodeEdits, Language, NoSite,
};
use tolerable_runtime::Tokenizer;

fn qwen_tokenizer() -> Option<Tokenizer> {
    let id = "qwen2.5-coder-0.5b-instruct";
    match catalog::cached(id).unwrap() {
        Some(p) => Some(Tokenizer::from_gguf_file(&p).unwrap()),
        None if std::env::var("TOLERABLE_SKIP_REAL").is_ok_and(|v| v == "1") => {
            eprintln!("skipped: {id} is not in the cache and TOLERABLE_SKIP_REAL=1");
            None
        }
        None => panic!("{id} is not in the cache; run `cargo xtask fetch-model {id}`"),
    }
}

fn edits(tk: &Tokenizer) -> CodeEdits {
    build_all(&corpus::builtin(), tk, 0).unwrap()
}

#[test]
fn contexts_are_150_to_500_tokens_in_five_families() {
    let Some(tk) = qwen_tokenizer() else { return };
    let contexts = corpus::builtin();
    assert!(contexts.len() >= 24, "{} contexts", contexts.len());
    let mut families: BTreeMap<&str, usize> = BTreeMap::new();
    let mut lens = Vec::new();
    for c in &contexts {
        assert!(c.text.is_ascii(), "{} is not ASCII", c.name);
        let n = tk.encode(&c.text).unwrap().len();
        assert!((150..=500).contains(&n), "{}: {n} tokens", c.name);
        *families.entry(c.language.family()).or_default() += 1;
        lens.push((n, c.name.as_str()));
    }
    for lang in Language::ALL {
        let fam = lang.family();
        assert!(
            families.get(fam).copied().unwrap_or(0) >= 4,
            "family {fam}: {families:?}"
        );
    }
    lens.sort();
    eprintln!("context tokens (families {families:?}): {lens:?}");
}

#[test]
fn edits_leave_the_tokens_before_them_unchanged() {
    let Some(tk) = qwen_tokenizer() else { return };
    let contexts: BTreeMap<String, _> = corpus::builtin()
        .into_iter()
        .map(|c| (c.name.clone(), c))
        .collect();
    let e = edits(&tk);
    let mut max_retok = 0;
    for cp in &e.pairs {
        let (p, m) = (&cp.pair, &cp.meta);
        let ctx = &contexts[&m.context];
        assert_eq!(p.id, format!("code/{}/{}", m.context, m.archetype.name()));
        let edit = m.archetype.apply(&ctx.text, ctx.language, m.seed).unwrap();
        // Text: everything before the offset is unchanged, the byte at it differs.
        assert_eq!(ctx.text[..m.offset], edit.edited[..m.offset], "{}", p.id);
        assert_ne!(
            ctx.text.as_bytes().get(m.offset),
            edit.edited.as_bytes().get(m.offset),
            "{}",
            p.id
        );
        // Tokens: the pair is the two tokenizations split at their common prefix.
        let orig = tk.encode(&ctx.text).unwrap();
        let edited = tk.encode(&edit.edited).unwrap();
        assert_eq!(p.base_context(), orig, "{}", p.id);
        assert_eq!(p.alt_context(), edited, "{}", p.id);
        let s = p.shared.len();
        assert_eq!(orig[..s], edited[..s]);
        assert_ne!(
            orig.get(s),
            edited.get(s),
            "{}: no token differs at {s}",
            p.id
        );
        assert!(!p.base.is_empty() || !p.alt.is_empty());
        // The shared tokens lie before the edit.
        let shared_text = tk.decode(&p.shared).unwrap();
        assert!(shared_text.len() <= m.offset, "{}", p.id);
        assert!(ctx.text.starts_with(&shared_text) && edit.edited.starts_with(&shared_text));
        assert_eq!(m.retokenized, m.text_prefix_tokens - s);
        max_retok = max_retok.max(m.retokenized);
        // The unit's fixed fields.
        assert!(p.suffix.is_empty());
        assert_eq!(p.span_start, 0);
        assert_eq!(p.focus, (s..orig.len()).collect::<Vec<_>>());
        assert_eq!((m.original_len, m.edited_len), (orig.len(), edited.len()));
        let cs = m.common_suffix;
        assert_eq!(p.base[p.base.len() - cs..], p.alt[p.alt.len() - cs..]);
        assert!(cs < p.base.len().min(p.alt.len()) + 1);
    }
    eprintln!(
        "{} pairs; at most {max_retok} token(s) before an edit retokenized; mean downstream {:.0} tokens",
        e.pairs.len(),
        e.pairs.iter().map(|p| p.pair.focus.len()).sum::<usize>() as f64 / e.pairs.len() as f64
    );
    assert!(
        max_retok <= 2,
        "an edit retokenized {max_retok} tokens before it"
    );
}

#[test]
fn every_archetype_applies_to_at_least_12_contexts() {
    let Some(tk) = qwen_tokenizer() else { return };
    let e = edits(&tk);
    let n_ctx = corpus::builtin().len();
    for (a, applied, skipped) in e.applicability() {
        eprintln!(
            "{:<20} applied {applied:>2}, skipped {skipped:>2}",
            a.name()
        );
        assert_eq!(applied + skipped, n_ctx);
        assert!(applied >= 12, "{a}: applies to {applied} contexts");
    }
    for s in &e.skips {
        eprintln!("skip {} / {}: {}", s.context, s.archetype, s.reason);
        assert_eq!(s.reason, s.archetype.no_site());
    }
    // `TOLERABLE_CODE_EDITS_DUMP=<dir>` writes every edited text (to check
    // them with the languages' own tools).
    if let Ok(dir) = std::env::var("TOLERABLE_CODE_EDITS_DUMP") {
        let contexts = corpus::builtin();
        for p in &e.pairs {
            let m = &p.meta;
            let ctx = contexts.iter().find(|c| c.name == m.context).unwrap();
            let edit = m.archetype.apply(&ctx.text, ctx.language, m.seed).unwrap();
            let d = std::path::Path::new(&dir).join(m.archetype.name());
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join(&m.context), edit.edited).unwrap();
        }
    }
    for p in &e.pairs {
        eprintln!(
            "{:<45} line {:>3}: {}",
            p.pair.id, p.meta.line, p.meta.description
        );
    }
}

#[test]
fn edits_are_deterministic() {
    let Some(tk) = qwen_tokenizer() else { return };
    assert_eq!(edits(&tk), edits(&tk));
    // A different run seed picks other sites somewhere, with the same applicability.
    let other = build_all(&corpus::builtin(), &tk, 1).unwrap();
    let e = edits(&tk);
    assert_eq!(e.applicability(), other.applicability());
    assert_ne!(e.pairs, other.pairs);
    assert_ne!(
        edit_seed(0, "a.py", Archetype::ChangeLiteral),
        edit_seed(0, "b.py", Archetype::ChangeLiteral)
    );
}

#[test]
fn an_archetype_without_a_site_is_a_typed_skip() {
    // Tiny contexts, each missing what one archetype needs.
    let cases: [(Archetype, &str, Language); 7] = [
        (
            Archetype::RenameIdentifier,
            "x = 1\nprint(x)\n",
            Language::Python,
        ),
        (
            Archetype::AddArgument,
            "fn unused(a: u32) -> u32 {\n    a\n}\n",
            Language::Rust,
        ),
        (
            Archetype::ChangeConditional,
            "int f(int a) {\n    return a;\n}\n",
            Language::C,
        ),
        (
            Archetype::ChangeLiteral,
            "const f = (a) => a;\n",
            Language::JavaScript,
        ),
        (
            Archetype::ChangeOperator,
            "func f(a int) int {\n\treturn -a\n}\n",
            Language::Go,
        ),
        (
            Archetype::InsertStatement,
            "def f(a):\n    return a\n",
            Language::Python,
        ),
        (
            Archetype::DeleteStatement,
            "function f(a: number): number {\n  return a;\n}\n",
            Language::TypeScript,
        ),
    ];
    for (a, src, lang) in cases {
        assert_eq!(a.apply(src, lang, 0), Err(a.no_site()), "{a} on {src:?}");
        assert_eq!(a.apply(src, lang, 99), Err(a.no_site()), "{a} on {src:?}");
    }
    assert_eq!(
        Archetype::ChangeOperator.no_site(),
        NoSite::NoArithmeticOperator
    );
    for a in Archetype::ALL {
        assert_eq!(Archetype::from_name(a.name()), Some(a));
    }
}
