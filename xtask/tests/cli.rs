//! The command line on a tiny model the test writes.

use std::process::Command;
use tolerable_runtime::tiny::{write_gguf, TinySpec};

fn xtask() -> Command {
    Command::new(env!("CARGO_BIN_EXE_xtask"))
}

/// Runs `xtask generate --json` on a model and prompt file and parses its output.
fn generate_json(
    model: &std::path::Path,
    prompt: &std::path::Path,
    extra: &[&str],
) -> serde_json::Value {
    let out = xtask()
        .args([
            "generate",
            "--json",
            "--model",
            model.to_str().unwrap(),
            "--prompt-file",
            prompt.to_str().unwrap(),
        ])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(out.stdout.trim_ascii()).unwrap()
}

#[test]
fn generate_prints_the_documented_json() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny.gguf");
    write_gguf(&TinySpec::default(), &model).unwrap();
    let prompt = dir.path().join("prompt.txt");
    std::fs::write(&prompt, "the theory").unwrap();
    let v = generate_json(&model, &prompt, &["--tokens", "5"]);
    assert_eq!(v["continuation_ids"].as_array().unwrap().len(), 5);
    assert!(!v["prompt_ids"].as_array().unwrap().is_empty());
    assert!(v["continuation"].is_string());
    let top5 = v["top5"].as_array().unwrap();
    assert_eq!(top5.len(), 5);
    // The first continuation token is the top-1 id, and logits are sorted.
    assert_eq!(top5[0][0], v["continuation_ids"][0]);
    let l: Vec<f64> = top5.iter().map(|p| p[1].as_f64().unwrap()).collect();
    assert!(l.windows(2).all(|w| w[0] >= w[1]));
    // --chat wraps the prompt in the model's template.
    let c = generate_json(&model, &prompt, &["--tokens", "2", "--chat"]);
    assert!(c["prompt_ids"].as_array().unwrap().len() > v["prompt_ids"].as_array().unwrap().len());
}

#[test]
fn bad_model_ids_and_files_fail_with_their_names() {
    let out = xtask()
        .args(["fetch-model", "qwen9-giant"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown model id `qwen9-giant`"), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let prompt = dir.path().join("p.txt");
    std::fs::write(&prompt, "x").unwrap();
    let bad = dir.path().join("broken.gguf");
    std::fs::write(&bad, b"GGUF but not really").unwrap();
    let out = xtask()
        .args([
            "generate",
            "--model",
            bad.to_str().unwrap(),
            "--prompt-file",
            prompt.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("broken.gguf"));
}

#[test]
fn anchors_resume_from_a_partial_log_with_identical_rows() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny.gguf");
    write_gguf(
        &TinySpec {
            context_length: 1024,
            ..TinySpec::default()
        },
        &model,
    )
    .unwrap();
    let out = dir.path().join("a.json");
    let run = || {
        let o = xtask()
            .args([
                "anchors",
                "--model",
                model.to_str().unwrap(),
                "--synthetic",
                "--n",
                "4",
                "--seed",
                "3",
                "--out",
                out.to_str().unwrap(),
            ])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(&out).unwrap()).unwrap()
    };
    let first = run();
    let items = first["items"].as_array().unwrap().clone();
    assert_eq!(items.len(), 4);
    assert_eq!(first["summary"]["n"], 4);
    // A run killed after two items, mid-way through writing the third.
    let partial = dir.path().join("a.partial.jsonl");
    let key = serde_json::json!({"model": model.to_str().unwrap(), "template": {"kind": "raw"}, "seed": 3, "n": 4,
        "new_tokens": 8, "max_prompt_tokens": 512, "synthetic": true}).to_string();
    let third = items[2].to_string();
    let body = format!(
        "{key}\n{}\n{}\n{}",
        items[0],
        items[1],
        &third[..third.len() / 2]
    );
    std::fs::write(&partial, body).unwrap();
    std::fs::remove_file(&out).unwrap();
    let second = run();
    assert_eq!(second["items"], first["items"]);
    assert!(!partial.exists());
}
