//! The command line on a tiny model the test writes.

use std::process::Command;
use tolerable_testkit::tiny::{write_gguf, TinySpec};

fn xtask() -> Command {
    Command::new(env!("CARGO_BIN_EXE_xtask"))
}

/// A temporary folder holding a tiny random model with room for synthetic prompts.
fn tiny_model() -> (tempfile::TempDir, std::path::PathBuf) {
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
    (dir, model)
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
    // A path that names nothing is told apart from an unknown id.
    let absent = dir.path().join("absent.gguf");
    let out = xtask()
        .args([
            "generate",
            "--model",
            absent.to_str().unwrap(),
            "--prompt-file",
            prompt.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("no such file: {}", absent.display())),
        "{err}"
    );
}

#[test]
fn anchors_resume_from_a_partial_log_with_identical_rows() {
    let (dir, model) = tiny_model();
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

const SWEEP_ARMS: &str = r#"
[[arms]]
name = "identity"
expect = "native"
inject = { carrier = "kv", positions = "all", source = "native" }

[[arms]]
name = "kv_augment"
inject = { carrier = "kv", positions = "passage", source = "holder", mechanism = "append" }

[[arms]]
name = "act_replace"
controls = ["act_noop"]
inject = { carrier = "h", positions = "fact_region", source = "holder" }
grid = { layers = [0, 1, 2] }

[[arms]]
name = "act_noop"
expect = "floor"
inject = { carrier = "h", positions = "fact_region", source = "own" }
grid = { layers = [0, 1, 2] }
"#;

fn sweep_config(dir: &std::path::Path, model: &std::path::Path, n: usize) -> std::path::PathBuf {
    let text = format!(
        "[run]\nname = \"kill\"\nmodel = \"{}\"\nseed = 1\nnew_tokens = 6\ncell_items = 1\n\n[data]\nsource = \"synthetic\"\nn = {n}\n{SWEEP_ARMS}",
        model.display()
    );
    let p = dir.join("sweep.toml");
    std::fs::write(&p, text).unwrap();
    p
}

/// The rows of a Parquet file, read with the `parquet` crate, without the
/// wall-clock columns.
fn parquet_rows(path: &std::path::Path) -> Vec<String> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let r = SerializedFileReader::new(std::fs::File::open(path).unwrap()).unwrap();
    r.get_row_iter(None)
        .unwrap()
        .map(|row| {
            row.unwrap()
                .get_column_iter()
                .filter(|(name, _)| !matches!(name.as_str(), "seconds" | "seconds_per_item"))
                .map(|(name, f)| format!("{name}={f}"))
                .collect::<Vec<_>>()
                .join("|")
        })
        .collect()
}

#[test]
fn a_sweep_killed_mid_run_resumes_to_the_same_parquet() {
    let (dir, model) = tiny_model();
    let n = 16;
    let cfg = sweep_config(dir.path(), &model, n);
    // A sweep of `config` into `out` with extra flags, which must succeed.
    let sweep_of = |config: &std::path::Path, out: &std::path::Path, extra: &[&str]| {
        let o = xtask()
            .args([
                "sweep",
                "--config",
                config.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
            ])
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    let sweep_with = |out: &std::path::Path, extra: &[&str]| sweep_of(&cfg, out, extra);
    let sweep = |out: &std::path::Path| sweep_with(out, &[]);
    let whole = dir.path().join("whole");
    sweep(&whole);
    // The same sweep, killed with SIGKILL once its first cells are written.
    let killed = dir.path().join("killed");
    let mut child = xtask()
        .args([
            "sweep",
            "--config",
            cfg.to_str().unwrap(),
            "--out",
            killed.to_str().unwrap(),
        ])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let first = killed.join("items").join("cell-00001.parquet");
    let t0 = std::time::Instant::now();
    while !first.exists() {
        assert!(t0.elapsed().as_secs() < 300, "no cell written in 300 s");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let done = |d: &std::path::Path| tolerable_driver::records::cell_files(d).unwrap().len();
    assert!(done(&killed) < n, "the sweep finished before the kill");
    assert!(!killed.join("summary.parquet").exists());
    sweep(&killed);
    assert_eq!(done(&killed), n);
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(killed.join("run.json")).unwrap()).unwrap();
    assert_eq!(meta["invocations"].as_array().unwrap().len(), 2);
    for c in 0..n {
        let name = format!("items/cell-{c:05}.parquet");
        assert_eq!(
            parquet_rows(&whole.join(&name)),
            parquet_rows(&killed.join(&name)),
            "{name}"
        );
    }
    assert_eq!(
        parquet_rows(&whole.join("summary.parquet")),
        parquet_rows(&killed.join("summary.parquet"))
    );
    // No temporary files are left behind.
    for e in std::fs::read_dir(killed.join("items")).unwrap() {
        let name = e.unwrap().file_name().into_string().unwrap();
        assert!(
            name.starts_with("cell-") && name.ends_with(".parquet"),
            "{name}"
        );
    }
    // Shards merge: two shards into one folder, then --merge writes the summary.
    let sharded = dir.path().join("sharded");
    for s in ["0/2", "1/2"] {
        sweep_with(&sharded, &["--shard", s]);
    }
    sweep_with(&sharded, &["--merge"]);
    assert_eq!(
        parquet_rows(&whole.join("summary.parquet")),
        parquet_rows(&sharded.join("summary.parquet"))
    );
    // The merge is recorded beside the shards' invocations, not among them.
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(sharded.join("run.json")).unwrap()).unwrap();
    let summaries = meta["summaries"].as_array().unwrap();
    assert_eq!(summaries.len(), 1);
    assert!(summaries[0]["command"]
        .as_str()
        .unwrap()
        .contains("--merge"));
    assert!(meta["invocations"]
        .as_array()
        .unwrap()
        .iter()
        .all(|i| !i["command"].as_str().unwrap().contains("--merge")));
    // A later run on the folder keeps the record of the merge.
    let before = meta["invocations"].as_array().unwrap().len();
    sweep_with(&sharded, &[]);
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(sharded.join("run.json")).unwrap()).unwrap();
    assert_eq!(meta["invocations"].as_array().unwrap().len(), before + 1);
    assert_eq!(meta["summaries"].as_array().map(Vec::len), Some(1));

    // A run of one of the whole run's arms (with the anchors every run
    // has) on the same items is a part of it: `compare --subset` passes
    // (its floor and native share a decoding batch where the whole run's,
    // anchors of gated arms, decode alone: equal continuations across the
    // two ways of batching, which the tiny model gives and the batching
    // test checks on its own),
    // and says so in its JSON; the whole is not a part of it, and without
    // --subset the two runs differ.
    let part_cfg = dir.path().join("part.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    let arms_at = text.find("[[arms]]").unwrap();
    std::fs::write(
        &part_cfg,
        format!(
            "{}[[arms]]\nname = \"kv_augment\"\ninject = {{ carrier = \"kv\", positions = \"passage\", source = \"holder\", mechanism = \"append\" }}\n",
            &text[..arms_at]
        ),
    )
    .unwrap();
    let part = dir.path().join("part");
    sweep_of(&part_cfg, &part, &[]);
    let compare = |a: &std::path::Path, b: &std::path::Path, extra: &[&str]| {
        let json = dir.path().join("compare.json");
        let o = xtask()
            .args(["compare", a.to_str().unwrap(), b.to_str().unwrap()])
            .args(["--out", json.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).to_string(),
            v,
        )
    };
    let (ok, e, v) = compare(&part, &whole, &["--subset"]);
    assert!(ok, "{e}");
    assert_eq!(
        (v["subset"].as_bool(), v["a_within_b"].as_bool()),
        (Some(true), Some(true))
    );
    assert_eq!(v["comparison"]["only_a"], 0);
    assert!(v["comparison"]["only_b"].as_u64().unwrap() > 0);
    let (ok, e, v) = compare(&whole, &part, &["--subset"]);
    assert!(!ok && e.contains("is not a part of"), "{e}");
    assert_eq!(v["a_within_b"].as_bool(), Some(false));
    let (ok, e, _) = compare(&part, &whole, &[]);
    assert!(!ok && e.contains("the runs differ"), "{e}");
}

#[test]
fn bad_sweep_configs_fail_before_any_work_naming_the_field() {
    let (dir, model) = tiny_model();
    let out = dir.path().join("out");
    // A sweep of config `text` with extra flags and environment, which must
    // fail: what it says.
    let refused = |text: &str, extra: &[&str], env: &[(&str, &str)]| {
        let p = dir.path().join("bad.toml");
        std::fs::write(&p, text).unwrap();
        let o = xtask()
            .args([
                "sweep",
                "--config",
                p.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
            ])
            .args(extra)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        assert!(!o.status.success());
        String::from_utf8_lossy(&o.stderr).to_string()
    };
    let run = |text: &str| refused(text, &[], &[]);
    let head = format!(
        "[run]\nname = \"bad\"\nmodel = \"{}\"\n[data]\nsource = \"synthetic\"\nn = 2\n",
        model.display()
    );
    let e = run(&format!("{head}[[arms]]\nname = \"a\"\ninject = {{ carrier = \"h\", layers = 7, source = \"holder\" }}\n"));
    assert!(
        e.contains("arms[0].inject[0].layers") && e.contains("layer 7"),
        "{e}"
    );
    let e = run(&format!("{head}[[arms]]\nname = \"a\"\ninject = {{ carrier = \"h\", source = \"holder\", colour = 1 }}\n"));
    assert!(e.contains("colour"), "{e}");
    let e =
        run("[run]\nname = \"bad\"\n[data]\nsource = \"synthetic\"\nn = 2\n[[arms]]\nname = 3\n");
    assert!(e.contains("name"), "{e}");
    // A grid point out of range on an arm with controls names the layer, not
    // the control family that lacks that point.
    let e = run(&format!("{head}[[arms]]\nname = \"a\"\ncontrols = [\"c\"]\ninject = {{ carrier = \"h\", source = \"holder\" }}\ngrid = {{ layers = [1, 7] }}\n[[arms]]\nname = \"c\"\ninject = {{ carrier = \"h\", source = \"own\" }}\ngrid = {{ layers = [1] }}\n"));
    assert!(
        e.contains("arms[0].inject[0].layers") && e.contains("layer 7"),
        "{e}"
    );
    // A bridge with a progress interval the environment gives wrong is
    // refused with the plan, naming the variable and its value, before
    // any training example is computed or anything written.
    let resources = dir.path().join("resources");
    let e = refused(
        &format!("{head}[resources.qb]\nkind = \"bridge\"\ntargets = \"q\"\nrank = 2\ntrain_items = 2\nslice_items = 1\nepochs = 1\nlr = 0.01\ndata = \"synthetic\"\narm = {{ inject = [{{ carrier = \"kv\", positions = \"passage\", source = \"holder\", mechanism = \"append\" }}] }}\n[[arms]]\nname = \"b\"\nbridge = {{ resource = \"qb\" }}\ninject = {{ carrier = \"kv\", positions = \"passage\", source = \"holder\", mechanism = \"append\" }}\n"),
        &["--resources", resources.to_str().unwrap()],
        &[("TOLERABLE_PROGRESS_SECS", "soon")],
    );
    assert!(
        e.contains("TOLERABLE_PROGRESS_SECS") && e.contains("`soon`"),
        "{e}"
    );
    assert!(
        !resources.exists(),
        "a refused bridge wrote {}",
        resources.display()
    );
    assert!(!out.exists(), "a failed config wrote {}", out.display());
}

#[test]
fn a_dry_run_prints_the_plan_and_writes_nothing_and_merge_refuses_an_unfinished_run() {
    let (dir, model) = tiny_model();
    let cfg = sweep_config(dir.path(), &model, 4);
    let out = dir.path().join("dry");
    let o = xtask()
        .args([
            "sweep",
            "--config",
            cfg.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--dry-run",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let plan = String::from_utf8_lossy(&o.stdout);
    for want in [
        "per-item passes",
        "residual captured at {0, 1, 2}",
        "act_replace@layers=1: base masked",
        "h at layers [1], fact_region <- holder -> replace",
        "identity: base masked, expect Native",
        "estimate:",
        "decoded tokens (per item, by cache layout)",
    ] {
        assert!(plan.contains(want), "{want} missing from:\n{plan}");
    }
    // The residual arms' restarts are counted in the estimate.
    let restarts: usize = plan
        .split("context tokens in passes, ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no restart count in:\n{plan}"));
    assert!(restarts > 0, "no restart tokens counted:\n{plan}");
    assert!(!out.exists(), "a dry run wrote {}", out.display());
    // One shard of two, then --merge: the run is unfinished, and says which cells.
    let run = dir.path().join("half");
    let o = xtask()
        .args([
            "sweep",
            "--config",
            cfg.to_str().unwrap(),
            "--out",
            run.to_str().unwrap(),
            "--shard",
            "0/2",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = xtask()
        .args([
            "sweep",
            "--config",
            cfg.to_str().unwrap(),
            "--out",
            run.to_str().unwrap(),
            "--merge",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("2 of 4 cells are missing") && e.contains("cells 1, 3"),
        "{e}"
    );
    assert!(!run.join("summary.parquet").exists());
}

#[test]
fn an_unusable_output_folder_fails_before_the_model_loads_and_progress_is_logged_off_a_terminal() {
    let (dir, model) = tiny_model();
    let cfg = sweep_config(dir.path(), &model, 2);
    // An output folder that cannot be created (a file stands in the way).
    let blocker = dir.path().join("file");
    std::fs::write(&blocker, "x").unwrap();
    let out = blocker.join("run");
    let o = xtask()
        .args([
            "sweep",
            "--config",
            cfg.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("cannot be created") && e.contains("run"), "{e}");
    assert!(
        !e.contains("loaded") && !e.contains("gates"),
        "the model loaded first:\n{e}"
    );
    // Off a terminal, the gates and every finished cell log a line.
    let out = dir.path().join("ok");
    let o = xtask()
        .args([
            "sweep",
            "--config",
            cfg.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    for want in [
        "gates: parity prompt 1/",
        "gates: identity done",
        "cell 0 written",
        "cell 1 written: 2/2 items",
    ] {
        assert!(e.contains(want), "{want} missing from:\n{e}");
    }
}
