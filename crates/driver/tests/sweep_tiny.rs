//! Sweeps end to end on a tiny model the test writes: gates, shared passes,
//! batched arms, per-item bit-exact gates, Parquet records read back with an
//! independent reader (the `parquet` crate), summaries and reports.

use parquet::file::reader::{FileReader, SerializedFileReader};
use std::path::{Path, PathBuf};
use tolerable_driver::sweep::{self, SweepOptions};
use tolerable_runtime::tiny::{write_gguf, TinySpec};

fn tiny(dir: &Path) -> PathBuf {
    let p = dir.join("tiny.gguf");
    write_gguf(
        &TinySpec {
            context_length: 1024,
            ..TinySpec::default()
        },
        &p,
    )
    .unwrap();
    p
}

fn config(dir: &Path, model: &Path, n: usize, cell_items: usize) -> PathBuf {
    let text = format!(
        r#"
[run]
name = "tiny"
model = "{}"
seed = 5
new_tokens = 4
cell_items = {cell_items}

[data]
source = "synthetic"
n = {n}

[[arms]]
name = "identity"
expect = "native"
inject = {{ carrier = "kv", positions = "all", source = "native" }}

[[arms]]
name = "noop"
expect = "floor"
inject = {{ carrier = "kv", positions = "all", source = "own" }}

[[arms]]
name = "kv_augment"
controls = ["floor", "kv_augment_mismatch"]
inject = {{ carrier = "kv", positions = "passage", source = "holder", mechanism = "append" }}

[[arms]]
name = "kv_augment_mismatch"
inject = {{ carrier = "kv", positions = "passage", source = "other_item", mechanism = "append" }}

[[arms]]
name = "act_replace"
controls = ["act_noop", "act_position", "act_mismatch"]
inject = {{ carrier = "h", positions = "fact_region", source = "holder" }}
grid = {{ layers = [1, 2] }}

[[arms]]
name = "act_noop"
expect = "floor"
inject = {{ carrier = "h", positions = "fact_region", source = "own" }}
grid = {{ layers = [1, 2] }}

[[arms]]
name = "act_position"
inject = {{ carrier = "h", positions = "fact_free_prefix", source = "holder" }}
grid = {{ layers = [1, 2] }}

[[arms]]
name = "act_mismatch"
inject = {{ carrier = "h", positions = "fact_region", source = "other_item" }}
grid = {{ layers = [1, 2] }}

[[arms]]
name = "k_noise"
inject = {{ carrier = "k", positions = "passage", source = "native", perturb = {{ kind = "cosine_noise", target_cosine = 0.9 }} }}

[[arms]]
name = "v_interp"
inject = {{ carrier = "v", layers = "suffix:1", positions = "fact_region", heads = [0], source = "native", mechanism = "interpolate", alpha = 0.5 }}

[[arms]]
name = "h_suffix_add"
inject = {{ carrier = "h", layers = "suffix:1", positions = "fact_region", source = "holder", mechanism = "add", alpha = 0.5 }}
"#,
        model.display()
    );
    let p = dir.join("tiny.toml");
    std::fs::write(&p, text).unwrap();
    p
}

/// Every row of a Parquet file as (column name -> display text) maps, read with the `parquet` crate.
fn rows(path: &Path) -> (Vec<String>, Vec<Vec<String>>) {
    let r = SerializedFileReader::new(std::fs::File::open(path).unwrap()).unwrap();
    let schema = r.metadata().file_metadata().schema_descr();
    let names: Vec<String> = schema
        .columns()
        .iter()
        .map(|c| c.name().to_string())
        .collect();
    let mut out = Vec::new();
    for row in r.get_row_iter(None).unwrap() {
        let row = row.unwrap();
        out.push(
            row.get_column_iter()
                .map(|(_, f)| match f {
                    parquet::record::Field::Str(s) => s.clone(),
                    other => other.to_string(),
                })
                .collect(),
        );
    }
    (names, out)
}

fn col(names: &[String], rows: &[Vec<String>], name: &str) -> Vec<String> {
    let i = names
        .iter()
        .position(|n| n == name)
        .unwrap_or_else(|| panic!("no column {name}"));
    rows.iter().map(|r| r[i].clone()).collect()
}

#[test]
fn a_tiny_sweep_writes_records_that_an_independent_reader_reads() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let cfg = config(dir.path(), &model, 5, 2);
    let out = dir.path().join("run");
    let o = sweep::run(
        &cfg,
        &SweepOptions {
            out: Some(out.clone()),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!((o.cells, o.computed), (3, 3));
    assert!(o.summary_written);
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("run.json")).unwrap()).unwrap();
    assert_eq!(meta["gates"]["passed"], true);
    assert_eq!(meta["data"]["item_ids"].as_array().unwrap().len(), 5);
    assert!(meta["config_hash"].as_str().unwrap().len() == 16);

    let cells = tolerable_driver::records::cell_files(&out).unwrap();
    assert_eq!(cells.len(), 3);
    let mut all = Vec::new();
    let mut names = Vec::new();
    for c in &cells {
        let (n, r) = rows(c);
        names = n;
        all.extend(r);
    }
    for want in [
        "arm",
        "item_id",
        "continuation",
        "correct",
        "span_copy",
        "fidelity_cosine",
        "achieved_cosine",
        "bit_exact",
        "layer",
        "seconds",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "{want} missing from {names:?}"
        );
    }
    let n_arms = 2 + 4 + 4 * 2 + 3;
    assert_eq!(all.len(), 5 * n_arms);
    // Per-item gates: identity and no-op arms are bit-exact on every item.
    let arm = col(&names, &all, "arm");
    let exact = col(&names, &all, "bit_exact");
    let mut gated = 0;
    for (a, e) in arm.iter().zip(&exact) {
        if a == "identity" || a == "noop" || a.starts_with("act_noop") {
            assert_eq!(e, "true", "{a}");
            gated += 1;
        } else {
            assert_eq!(e, "null", "{a}");
        }
    }
    assert_eq!(gated, 5 * 4);
    // Continuations of identity equal native, of no-op equal floor, item by item.
    let cont = col(&names, &all, "continuation_ids");
    let item = col(&names, &all, "item_id");
    let of = |arm_name: &str| -> Vec<(String, String)> {
        arm.iter()
            .zip(&item)
            .zip(&cont)
            .filter(|((a, _), _)| *a == arm_name)
            .map(|((_, i), c)| (i.clone(), c.clone()))
            .collect()
    };
    assert_eq!(of("identity"), of("native"));
    assert_eq!(of("act_noop@layers=2"), of("floor"));
    // Cosine noise reaches its target on the sites.
    let ach = col(&names, &all, "achieved_cosine");
    let noisy: Vec<f64> = arm
        .iter()
        .zip(&ach)
        .filter(|(a, _)| *a == "k_noise")
        .map(|(_, c)| c.parse().unwrap())
        .collect();
    assert_eq!(noisy.len(), 5);
    assert!(noisy.iter().all(|c| (c - 0.9).abs() < 1e-3), "{noisy:?}");

    let (snames, srows) = rows(&out.join("summary.parquet"));
    for want in [
        "arm",
        "n",
        "accuracy",
        "se",
        "ci_lo",
        "cond_accuracy",
        "lift",
        "strongest_control",
        "floor_accuracy",
        "native_accuracy",
    ] {
        assert!(
            snames.iter().any(|n| n == want),
            "{want} missing from {snames:?}"
        );
    }
    assert_eq!(srows.len(), n_arms);
    let sarm = col(&snames, &srows, "arm");
    let sn = col(&snames, &srows, "n");
    assert!(sn.iter().all(|n| n == "5"));
    let strongest = col(&snames, &srows, "strongest_control");
    let k = sarm
        .iter()
        .position(|a| a == "act_replace@layers=1")
        .unwrap();
    assert!(strongest[k].starts_with("act_"), "{}", strongest[k]);

    // The report: Markdown with every arm, and a plot against layer.
    let report = tolerable_driver::report::write(&out).unwrap();
    let md = std::fs::read_to_string(report).unwrap();
    assert!(md.contains("`act_replace@layers=2`") && md.contains("Anchors: floor"));
    let png = out.join("plots").join("accuracy_vs_layers.png");
    assert!(std::fs::metadata(&png).unwrap().len() > 1000);

    // A rerun finds every cell finished and computes nothing.
    let again = sweep::run(
        &cfg,
        &SweepOptions {
            out: Some(out.clone()),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!((again.computed, again.skipped), (0, 3));
}

#[test]
fn batching_arms_does_not_change_continuations() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let cfg = config(dir.path(), &model, 3, 3);
    let batched = dir.path().join("batched");
    let single = dir.path().join("single");
    sweep::run(
        &cfg,
        &SweepOptions {
            out: Some(batched.clone()),
            ..Default::default()
        },
    )
    .unwrap();
    sweep::run(
        &cfg,
        &SweepOptions {
            out: Some(single.clone()),
            one_at_a_time: true,
            ..Default::default()
        },
    )
    .unwrap();
    let (n1, r1) = rows(&batched.join("items/cell-00000.parquet"));
    let (n2, r2) = rows(&single.join("items/cell-00000.parquet"));
    assert_eq!(n1, n2);
    assert_eq!(col(&n1, &r1, "arm"), col(&n2, &r2, "arm"));
    assert_eq!(
        col(&n1, &r1, "continuation_ids"),
        col(&n2, &r2, "continuation_ids")
    );
    assert_eq!(col(&n1, &r1, "correct"), col(&n2, &r2, "correct"));
}

#[test]
fn an_output_folder_of_another_config_is_refused_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let cfg = config(dir.path(), &model, 2, 2);
    let out = dir.path().join("run");
    sweep::run(
        &cfg,
        &SweepOptions {
            out: Some(out.clone()),
            ..Default::default()
        },
    )
    .unwrap();
    let before = std::fs::read(out.join("items/cell-00000.parquet")).unwrap();
    let e = sweep::run(
        &cfg,
        &SweepOptions {
            out: Some(out.clone()),
            n: Some(3),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("another config"), "{e}");
    assert_eq!(
        std::fs::read(out.join("items/cell-00000.parquet")).unwrap(),
        before
    );
}
