//! Sweeps end to end on a tiny model the test writes: gates, shared passes,
//! batched arms, per-item bit-exact gates, Parquet records read back with an
//! independent reader (the `parquet` crate), summaries and reports.

use parquet::file::reader::{FileReader, SerializedFileReader};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tolerable_driver::sweep::{self, SweepOptions};
use tolerable_testkit::tiny::{write_gguf, TinySpec};

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

/// Every row of a Parquet file as display texts, with the top-level column
/// names, read with the `parquet` crate (lists print as `[a, b]`).
fn rows(path: &Path) -> (Vec<String>, Vec<Vec<String>>) {
    let r = SerializedFileReader::new(std::fs::File::open(path).unwrap()).unwrap();
    let mut names = Vec::new();
    let mut out = Vec::new();
    for row in r.get_row_iter(None).unwrap() {
        let row = row.unwrap();
        names = row.get_column_iter().map(|(n, _)| n.clone()).collect();
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
    // The invocation says what its cells cost and on what machine.
    let inv = meta["invocations"].as_array().unwrap().last().unwrap();
    assert_eq!(inv["cells_computed"], 3);
    assert_eq!(inv["items_computed"], 5);
    assert!(inv["cell_seconds"].as_f64().unwrap() > 0.0);
    assert!(inv["setup_seconds"].as_f64().unwrap() >= 0.0);
    assert!(inv["machine"]["threads"].as_u64().unwrap() >= 1);

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
    // Every row carries its whole arm and every injection.
    let json = col(&names, &all, "arm_json");
    let k = arm.iter().position(|a| a == "v_interp").unwrap();
    assert!(json[k].contains("\"heads\":[0]"), "{}", json[k]);
    let injections = col(&names, &all, "injections");
    assert!(
        injections[k].contains("v at layers [1, 2]"),
        "{}",
        injections[k]
    );
    // The sample table holds the questions and gold answers.
    let (qn, qr) = rows(&out.join("sample.parquet"));
    assert_eq!(qr.len(), 5);
    assert!(col(&qn, &qr, "question").iter().all(|q| q.ends_with('?')));
    assert!(col(&qn, &qr, "answers").iter().all(|a| a.starts_with('[')));
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
    // ... at every layer's keys, logged per layer (hook names) and item.
    let sites = col(&names, &all, "achieved_at_sites");
    let values = col(&names, &all, "achieved_at_values");
    let n_layers = 3;
    for ((a, s), v) in arm.iter().zip(&sites).zip(&values) {
        if a != "k_noise" {
            continue;
        }
        for l in 0..n_layers {
            assert!(s.contains(&format!("blocks.{l}.attn.hook_rot_k")), "{s}");
        }
        assert!(!s.contains("hook_v"), "{s}");
        let xs: Vec<f64> = v
            .trim_matches(|c| c == '[' || c == ']')
            .split(',')
            .map(|x| x.trim().parse().unwrap())
            .collect();
        assert_eq!(xs.len(), n_layers, "{v}");
        assert!(xs.iter().all(|c| (c - 0.9).abs() < 1e-3), "{v}");
    }

    let (snames, srows) = rows(&out.join("summary.parquet"));
    for want in [
        "arm",
        "n_items",
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
    let sn = col(&snames, &srows, "n_items");
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
    // A grid axis has its own plot, so no plot by arm.
    assert!(!out.join("plots/accuracy_by_arm.png").exists());

    // Families compared point by point: each act_replace arm against each
    // of its controls' arms at the same layer, and kv_augment (no grid)
    // against its two controls. Where the other arm is the summary's strongest
    // control, the pair's statistics are the summary's lift. Two points of
    // one family, named as arms, are paired directly.
    let pairs: Vec<tolerable_driver::records::ArmPair> = [
        "act_replace:act_noop",
        "act_replace:act_position",
        "act_replace:act_mismatch",
        "kv_augment:floor",
        "kv_augment:kv_augment_mismatch",
        "act_replace@layers=2:act_replace@layers=1",
    ]
    .iter()
    .map(|p| p.parse().unwrap())
    .collect();
    let md = std::fs::read_to_string(
        tolerable_driver::report::write_with_pairs(&out, false, &pairs).unwrap(),
    )
    .unwrap();
    assert!(md.contains("## Paired comparisons"), "{md}");
    assert!(
        md.contains("| `act_replace@layers=2` | `act_mismatch@layers=2` | 5 |"),
        "{md}"
    );
    let read = |f: &str| -> Vec<tolerable_driver::records::PairRow> {
        tolerable_driver::records::columns::rows(
            &tolerable_driver::records::read_parquet(&out.join(f)).unwrap(),
        )
        .unwrap()
    };
    let paired = read("pairs.parquet");
    assert_eq!(paired.len(), 9);
    let across = paired
        .iter()
        .find(|r| r.family == "act_replace@layers=2")
        .unwrap();
    assert_eq!(
        (across.arm.as_str(), across.against.as_str(), across.n_items),
        ("act_replace@layers=2", "act_replace@layers=1", 5)
    );
    assert!(paired
        .iter()
        .filter(|r| r.family == "act_replace")
        .all(|r| r.arm.split_once('@').unwrap().1 == r.against.split_once('@').unwrap().1));
    let summary: Vec<tolerable_driver::records::SummaryRow> =
        tolerable_driver::records::columns::rows(
            &tolerable_driver::records::read_parquet(&out.join("summary.parquet")).unwrap(),
        )
        .unwrap();
    let mut checked = 0;
    for s in &summary {
        let Some(c) = &s.strongest_control else {
            continue;
        };
        let Some(r) = paired
            .iter()
            .find(|r| r.arm == s.arm.arm && &r.against == c)
        else {
            continue;
        };
        assert_eq!(
            (
                Some(r.gained),
                Some(r.lost),
                Some(r.mcnemar_p),
                Some(r.paired_se)
            ),
            (
                s.lift_gained,
                s.lift_lost,
                s.lift_mcnemar_p,
                s.lift_paired_se
            ),
            "{}",
            s.arm.arm
        );
        assert_eq!(
            (Some(r.diff), Some(r.diff_lo), Some(r.diff_hi)),
            (s.lift, s.lift_lo, s.lift_hi)
        );
        checked += 1;
    }
    assert_eq!(checked, 3, "act_replace at layers 1 and 2, kv_augment");
    // A report regenerated without naming pairs compares them again.
    let with_pairs = std::fs::read_to_string(out.join("report.md")).unwrap();
    let md = std::fs::read_to_string(tolerable_driver::report::write(&out).unwrap()).unwrap();
    assert_eq!(md, with_pairs);
    assert_eq!(read("pairs.parquet"), paired);
    // Naming pairs replaces the remembered ones: the report names those it
    // would drop (those not named again), none when all are named again.
    let kept: tolerable_driver::records::ArmPair = "kv_augment:floor".parse().unwrap();
    let dropped = tolerable_driver::report::dropped_pairs(&out, false, std::slice::from_ref(&kept));
    assert_eq!(dropped.len(), pairs.len() - 1);
    assert!(dropped.iter().all(|p| pairs.contains(p) && *p != kept));
    assert!(tolerable_driver::report::dropped_pairs(&out, false, &pairs).is_empty());
    // An unreadable pairs file is named, and the report left as it was.
    let good = std::fs::read(out.join("pairs.parquet")).unwrap();
    std::fs::write(out.join("pairs.parquet"), b"").unwrap();
    let e = tolerable_driver::report::write(&out)
        .unwrap_err()
        .to_string();
    assert!(e.contains("pairs.parquet"), "{e}");
    assert_eq!(
        std::fs::read_to_string(out.join("report.md")).unwrap(),
        with_pairs
    );
    std::fs::write(out.join("pairs.parquet"), good).unwrap();
    // A family the run lacks is named; the pairs file is left as it was.
    let e = tolerable_driver::report::write_with_pairs(
        &out,
        false,
        &["act_replace:act_nothing".parse().unwrap()],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("no arm or family `act_nothing`"), "{e}");
    assert_eq!(read("pairs.parquet"), paired);
    // Arms of two runs (here the run and itself, read twice from disk)
    // pair as within one: a family against its own arms changes nothing.
    let items = tolerable_driver::records::read_items(&out).unwrap();
    let across = tolerable_driver::records::pairs::pair_rows_across(
        &items,
        &items,
        &["act_replace:act_replace".parse().unwrap()],
    )
    .unwrap();
    assert_eq!(across.len(), 2, "act_replace at layers 1 and 2");
    assert!(across.iter().all(|r| r.arm == r.against
        && (r.n_items, r.gained, r.lost, r.same_continuation) == (5, 0, 0, Some(5))));

    // A summary written before the lift's paired columns (they read as
    // nulls) gets a header that does not promise them.
    let summary_file = out.join("summary.parquet");
    let kept = std::fs::read(&summary_file).unwrap();
    let mut old: Vec<tolerable_driver::records::SummaryRow> =
        tolerable_driver::records::columns::rows(
            &tolerable_driver::records::read_parquet(&summary_file).unwrap(),
        )
        .unwrap();
    for s in &mut old {
        (s.lift_gained, s.lift_lost) = (None, None);
        (s.lift_mcnemar_p, s.lift_paired_se) = (None, None);
    }
    let mut df = tolerable_driver::records::columns::frame(old).unwrap();
    tolerable_driver::records::write_parquet_atomic(&mut df, &summary_file).unwrap();
    let md = std::fs::read_to_string(tolerable_driver::report::write(&out).unwrap()).unwrap();
    assert!(
        md.contains("| lift over strongest control [95% CI] | bit-exact |")
            && !md.contains("paired items gained/lost")
            && !md.contains("items, McNemar p"),
        "{md}"
    );
    std::fs::write(&summary_file, kept).unwrap();
    let md = std::fs::read_to_string(tolerable_driver::report::write(&out).unwrap()).unwrap();
    assert_eq!(md, with_pairs);

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

    // The interim summary of a finished run is its summary, row for row.
    let (interim, cov) = sweep::interim_summary(&out).unwrap();
    assert!(cov.complete());
    assert_eq!((cov.cells, cov.items, cov.n), (3, 5, 5));
    let sacc = col(&snames, &srows, "accuracy");
    assert_eq!(interim.len(), srows.len());
    for (r, (a, acc)) in interim.iter().zip(sarm.iter().zip(&sacc)) {
        assert_eq!(&r.arm.arm, a);
        assert_eq!(r.accuracy, acc.parse::<f64>().unwrap(), "{a}");
    }
    // A run in progress: cells 0 and 2 of 3 (items 1-2 and 5), no summary.
    let part = dir.path().join("part");
    std::fs::create_dir_all(part.join("items")).unwrap();
    std::fs::copy(out.join("run.json"), part.join("run.json")).unwrap();
    assert!(tolerable_driver::report::write_interim(&part)
        .unwrap_err()
        .to_string()
        .contains("no finished cells yet"));
    for c in [0, 2] {
        std::fs::copy(sweep::cell_path(&out, c), sweep::cell_path(&part, c)).unwrap();
    }
    let (rows_part, cov) = sweep::interim_summary(&part).unwrap();
    assert_eq!((cov.finished.clone(), cov.items, cov.n), (vec![0, 2], 3, 5));
    assert!(!cov.complete());
    assert!(rows_part.iter().all(|r| r.n_items == 3));
    assert!(tolerable_driver::report::write(&part)
        .unwrap_err()
        .to_string()
        .contains("report --interim"));
    let md =
        std::fs::read_to_string(tolerable_driver::report::write_interim(&part).unwrap()).unwrap();
    assert!(
        md.contains(
            "**Interim, not the run's result:** 2 of 3 cells finished (3 of 5 items; cells 0, 2)"
        ),
        "{md}"
    );
    assert!(part.join("plots-interim/accuracy_vs_layers.png").exists());
    // ... and its summary rows, for readers of a run in progress.
    let interim_rows: Vec<tolerable_driver::records::SummaryRow> =
        tolerable_driver::records::columns::rows(
            &tolerable_driver::records::read_parquet(&part.join("summary-interim.parquet"))
                .unwrap(),
        )
        .unwrap();
    assert_eq!(interim_rows, rows_part);
    assert!(!part.join("report.md").exists() && !part.join("summary.parquet").exists());
    // A run.json whose config no longer matches its hash is refused.
    let mut meta = run_json(&part);
    meta["config"]["data"]["n"] = serde_json::json!(4);
    std::fs::write(part.join("run.json"), meta.to_string()).unwrap();
    assert!(sweep::interim_summary(&part)
        .unwrap_err()
        .to_string()
        .contains("not its recorded hash"));
    // A run that finishes: its report replaces what the interim reports
    // wrote, keeping the pairs of arms they compared.
    let done = dir.path().join("done");
    std::fs::create_dir_all(done.join("items")).unwrap();
    std::fs::copy(out.join("run.json"), done.join("run.json")).unwrap();
    for c in [0, 2] {
        std::fs::copy(sweep::cell_path(&out, c), sweep::cell_path(&done, c)).unwrap();
    }
    let pair = ["kv_augment:floor".parse().unwrap()];
    tolerable_driver::report::write_with_pairs(&done, true, &pair).unwrap();
    let interim_files = [
        "report-interim.md",
        "summary-interim.parquet",
        "pairs-interim.parquet",
        "plots-interim",
    ];
    assert!(interim_files.iter().all(|f| done.join(f).exists()));
    std::fs::copy(sweep::cell_path(&out, 1), sweep::cell_path(&done, 1)).unwrap();
    std::fs::copy(out.join("summary.parquet"), done.join("summary.parquet")).unwrap();
    let md = std::fs::read_to_string(tolerable_driver::report::write(&done).unwrap()).unwrap();
    assert!(md.contains("| `kv_augment` | `floor` | 5 |"), "{md}");
    assert!(done.join("pairs.parquet").exists());
    for f in interim_files {
        assert!(!done.join(f).exists(), "{f} is left");
    }
}

/// The config at `cfg` with one more `[run]` setting, written beside it as
/// `<name>.toml`.
fn with_run_setting(cfg: &Path, setting: &str, name: &str) -> PathBuf {
    let text = std::fs::read_to_string(cfg).unwrap().replacen(
        "[run]\n",
        &format!("[run]\n{setting}\n"),
        1,
    );
    let path = cfg.with_file_name(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// A sweep of `cfg` into the folder `<name>` beside it, which must succeed.
fn sweep_into(cfg: &Path, name: &str) -> PathBuf {
    let out = cfg.with_file_name(name);
    sweep::run(
        cfg,
        &SweepOptions {
            out: Some(out.clone()),
            ..Default::default()
        },
    )
    .unwrap();
    out
}

#[test]
fn batching_arms_does_not_change_continuations() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let cfg = config(dir.path(), &model, 3, 3);
    // The same sweep with one more `[run]` setting, as config `name`, into
    // folder `name`.
    let with_setting =
        |setting: &str, name: &str| sweep_into(&with_run_setting(&cfg, setting, name), name);
    let batched = sweep_into(&cfg, "batched");
    // Every arm of every item decoded as a batch of its own: the same rows
    // as the batched sweep, under another config hash.
    let single = with_setting("one_at_a_time = true", "single");
    let (n1, r1) = rows(&batched.join("items/cell-00000.parquet"));
    let (n2, r2) = rows(&single.join("items/cell-00000.parquet"));
    assert_eq!(n1, n2);
    assert_eq!(col(&n1, &r1, "arm"), col(&n2, &r2, "arm"));
    assert_eq!(
        col(&n1, &r1, "continuation_ids"),
        col(&n2, &r2, "continuation_ids")
    );
    assert_eq!(col(&n1, &r1, "correct"), col(&n2, &r2, "correct"));
    // Every arm of the three items as one padded batch: another config (its
    // own hash), the same continuations on this tiny model, and the
    // identity and no-op arms still equal their anchors bit for bit.
    let padded = with_setting("item_batch = 3", "padded");
    let (n3, r3) = rows(&padded.join("items/cell-00000.parquet"));
    assert_eq!(col(&n1, &r1, "arm"), col(&n3, &r3, "arm"));
    assert_eq!(
        col(&n1, &r1, "continuation_ids"),
        col(&n3, &r3, "continuation_ids")
    );
    let exact = col(&n3, &r3, "bit_exact");
    assert!(
        exact.iter().filter(|e| *e == "true").count() >= 3 * 3,
        "{exact:?}"
    );
    assert!(!exact.iter().any(|e| e == "false"), "{exact:?}");
    assert_ne!(
        run_json(&batched)["config_hash"],
        run_json(&padded)["config_hash"]
    );
    assert!(run_json(&padded)["config"]
        .to_string()
        .contains("item_batch"));
    assert_eq!(run_json(&padded)["batching"], "padded, 3 items a batch");
    assert_eq!(
        run_json(&padded)["invocations"][0]["batching"],
        "padded, 3 items a batch"
    );
    assert_eq!(run_json(&batched)["batching"], "per item, by cache layout");
    let m = run_json(&single);
    assert_eq!(m["batching"], "one arm at a time");
    let arms = col(&n2, &r2, "arm").len() as u64;
    assert_eq!(m["invocations"][0]["decode_batches"].as_u64(), Some(arms));
    assert!(
        run_json(&batched)["invocations"][0]["decode_batches"]
            .as_u64()
            .unwrap()
            < arms
    );
    assert_eq!(col(&n1, &r1, "bit_exact"), col(&n2, &r2, "bit_exact"));
    assert_ne!(run_json(&batched)["config_hash"], m["config_hash"]);
    assert!(m["config"].to_string().contains("one_at_a_time"));
}

#[test]
fn the_one_row_kernel_runs_gated_and_is_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let plain = config(dir.path(), &model, 2, 2);
    let a = sweep_into(&plain, "plain");
    let b = sweep_into(
        &with_run_setting(&plain, "row_kernel = true", "fast"),
        "fast",
    );
    let (ma, mb) = (run_json(&a), run_json(&b));
    assert_eq!(mb["gates"]["passed"], true);
    let backend = |m: &serde_json::Value| m["matmul_backend"].as_str().unwrap().to_string();
    assert!(backend(&mb).contains("one-row kernel"), "{}", backend(&mb));
    assert!(!backend(&ma).contains("one-row kernel"), "{}", backend(&ma));
    assert_eq!(
        mb["invocations"][0]["matmul_backend"].as_str().unwrap(),
        backend(&mb)
    );
    assert_ne!(ma["config_hash"], mb["config_hash"]);
    // Float rounding aside, the same continuations on this tiny model.
    let (n1, r1) = rows(&a.join("items/cell-00000.parquet"));
    let (n2, r2) = rows(&b.join("items/cell-00000.parquet"));
    assert_eq!(col(&n1, &r1, "arm"), col(&n2, &r2, "arm"));
    assert_eq!(
        col(&n1, &r1, "continuation_ids"),
        col(&n2, &r2, "continuation_ids")
    );
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

/// Sweep options writing to `<dir>/<out>` with resources cached in `cache`.
fn opts_in<'a>(dir: &'a Path, cache: &'a Path) -> impl Fn(&str) -> SweepOptions + 'a {
    move |out: &str| SweepOptions {
        out: Some(dir.join(out)),
        resource_root: Some(cache.to_path_buf()),
        ..Default::default()
    }
}

fn resource_config(dir: &Path, model: &Path, bank_size: usize) -> PathBuf {
    let text = format!(
        r#"
[run]
name = "tiny-bank"
model = "{}"
seed = 5
new_tokens = 3
cell_items = 2

[data]
source = "synthetic"
n = 3

[resources.bank]
kind = "key_bank"
size = {bank_size}
contexts = 6
data = "synthetic"

[resources.pca]
kind = "codebook"
bank = "bank"
construction = "pca"
size = 4

[[arms]]
name = "bank_interp"
base = "full"
inject = {{ carrier = "k", positions = "passage", source = {{ bank = {{ bank = "bank", neighbour = 1 }} }}, mechanism = "interpolate", alpha = 0.5 }}
grid = {{ alpha = [0.0, 1.0], "source.bank.neighbour" = [1, 3] }}

[[arms]]
name = "bank_gate"
base = "full"
expect = "native"
inject = {{ carrier = "k", positions = "passage", source = {{ bank = {{ bank = "bank", neighbour = 2 }} }}, mechanism = "interpolate", alpha = 0.0 }}

[[arms]]
name = "bank_cosine"
base = "full"
inject = {{ carrier = "k", layers = "prefix:2", positions = "passage", source = {{ bank = {{ bank = "bank", cosine = 0.5 }} }} }}

[[arms]]
name = "pca"
base = "full"
inject = {{ carrier = "k", positions = "passage", source = {{ codebook = {{ codebook = "pca", snapping = "l2" }} }} }}
grid = {{ "source.codebook.snapping" = ["l2", "cosine", "projection"] }}

[[arms]]
name = "act_displaced"
inject = {{ carrier = "h", layers = 1, positions = "fact_free_prefix", source_positions = "fact_region", source = "holder" }}

[[arms]]
name = "act_displaced_other"
inject = {{ carrier = "h", layers = 1, positions = "fact_free_prefix", source_positions = "fact_region", source = "other_item" }}

[[arms]]
name = "k_displaced_noise"
inject = {{ carrier = "k", layers = 1, heads = [1], positions = "fact_free_prefix", source_positions = "fact_region", source = "holder", perturb = {{ kind = "cosine_noise", target_cosine = 0.9 }} }}
"#,
        model.display()
    );
    let p = dir.join("bank.toml");
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn a_key_bank_and_codebooks_are_built_once_cached_and_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let cfg = resource_config(dir.path(), &model, 40);
    let cache = dir.path().join("resources");
    let opts = opts_in(dir.path(), &cache);
    sweep::run(&cfg, &opts("a")).unwrap();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("a/run.json")).unwrap())
            .unwrap();
    let bank = &meta["resources"]["bank"];
    assert_eq!(bank["obtained"], "built");
    let hash = bank["hash"].as_str().unwrap().to_string();
    assert_eq!(hash.len(), 16);
    assert_eq!(meta["resources"]["pca"]["obtained"], "built");
    // Training items are never evaluation items.
    let eval: Vec<&str> = meta["data"]["item_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(bank["training_items"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| !eval.contains(&t.as_str().unwrap())));
    // Rows name the resources they read, with the hash.
    let (names, all) = rows(&dir.path().join("a/items/cell-00000.parquet"));
    let arm = col(&names, &all, "arm");
    let res = col(&names, &all, "resources");
    let k = arm
        .iter()
        .position(|a| a.starts_with("bank_interp"))
        .unwrap();
    assert!(res[k].contains(&format!("bank={hash}")), "{}", res[k]);
    let k = arm.iter().position(|a| a == "floor").unwrap();
    assert_eq!(res[k], "[]");
    // The alpha = 0 cell is bit-exact to its base (the native reference).
    let exact = col(&names, &all, "bit_exact");
    for (a, e) in arm.iter().zip(&exact) {
        if a == "bank_gate" {
            assert_eq!(e, "true");
        }
    }
    let ach = col(&names, &all, "achieved_cosine");
    let corr = col(&names, &all, "logit_correlation");
    let k = arm
        .iter()
        .position(|a| a == "bank_interp@alpha=1.0,source.bank.neighbour=1")
        .unwrap();
    let c: f64 = ach[k].parse().unwrap();
    assert!(c > -1.0 && c < 1.0, "{c}");
    let r: f64 = corr[k].parse().unwrap();
    assert!(r > -1.0 && r < 1.0, "{r}");
    let d = arm.iter().position(|a| a == "act_displaced").unwrap();
    assert_ne!(col(&names, &all, "n_sites")[d], "0");
    // Noise on one head reaches its target where it was calibrated.
    let k = arm.iter().position(|a| a == "k_displaced_noise").unwrap();
    if ach[k] != "null" {
        let c: f64 = ach[k].parse().unwrap();
        assert!((c - 0.9).abs() < 1e-3, "{c}");
    }

    // A second run loads both from the cache.
    sweep::run(&cfg, &opts("b")).unwrap();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("b/run.json")).unwrap())
            .unwrap();
    assert_eq!(meta["resources"]["bank"]["obtained"], "cached");
    assert_eq!(meta["resources"]["bank"]["hash"], hash.as_str());
    let (n2, r2) = rows(&dir.path().join("b/items/cell-00000.parquet"));
    assert_eq!(
        col(&n2, &r2, "continuation_ids"),
        col(&names, &all, "continuation_ids")
    );

    // A cached bank recorded for another model is rebuilt, never used.
    let folder = cache.join(format!("key_bank-{hash}"));
    let mpath = folder.join("meta.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&mpath).unwrap()).unwrap();
    m["model_sha256"] = "0000".into();
    std::fs::write(&mpath, m.to_string()).unwrap();
    sweep::run(&cfg, &opts("c")).unwrap();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("c/run.json")).unwrap())
            .unwrap();
    assert_eq!(meta["resources"]["bank"]["obtained"], "rebuilt");
    // So is one whose value file was altered.
    let vpath = folder.join("value.safetensors");
    let mut bytes = std::fs::read(&vpath).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&vpath, bytes).unwrap();
    sweep::run(&cfg, &opts("d")).unwrap();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("d/run.json")).unwrap())
            .unwrap();
    assert_eq!(meta["resources"]["bank"]["obtained"], "rebuilt");
    let (n4, r4) = rows(&dir.path().join("d/items/cell-00000.parquet"));
    assert_eq!(
        col(&n4, &r4, "continuation_ids"),
        col(&names, &all, "continuation_ids")
    );
}

#[test]
fn a_bank_larger_than_the_keys_available_fails_before_any_record() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let cfg = resource_config(dir.path(), &model, 100_000);
    let out = dir.path().join("run");
    let e = sweep::run(
        &cfg,
        &SweepOptions {
            out: Some(out.clone()),
            resource_root: Some(dir.path().join("resources")),
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("100000") && e.contains("larger than"), "{e}");
    assert!(!out.join("run.json").exists());
    assert!(tolerable_driver::records::cell_files(&out)
        .unwrap()
        .is_empty());
}

/// Other readers: pyarrow reads a sweep's cells as one dataset and filters
/// them on a string column; pandas reads a cell and the sample table. Needs
/// python3 with pyarrow and pandas (`.ci/run` installs them); without them
/// the test fails unless `TOLERABLE_SKIP_PYARROW=1`.
#[test]
fn pyarrow_and_pandas_read_and_filter_the_records() {
    let probe = std::process::Command::new("python3")
        .args(["-c", "import pyarrow, pandas"])
        .output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        if std::env::var("TOLERABLE_SKIP_PYARROW").is_ok_and(|v| v == "1") {
            eprintln!("skipping: python3 with pyarrow and pandas is not available");
            return;
        }
        panic!("python3 with pyarrow and pandas is needed (pip install pyarrow pandas), or set TOLERABLE_SKIP_PYARROW=1");
    }
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let cfg = config(dir.path(), &model, 3, 2);
    let out = dir.path().join("run");
    sweep::run(
        &cfg,
        &SweepOptions {
            out: Some(out.clone()),
            ..Default::default()
        },
    )
    .unwrap();
    let script = r#"
import sys
import pyarrow.parquet as pq, pandas as pd
run = sys.argv[1]
t = pq.read_table(run + "/items", filters=[("arm", "=", "floor")])
assert t.num_rows == 3, t.num_rows
assert str(t.schema.field("continuation_ids").type).endswith("list<element: uint32>"), t.schema
s = pq.read_table(run + "/summary.parquet", filters=[("family", "=", "act_replace")])
assert s.num_rows == 2, s.num_rows
df = pd.read_parquet(run + "/items/cell-00000.parquet")
assert (df[df.arm == "noop"].bit_exact == True).all()
q = pd.read_parquet(run + "/sample.parquet")
assert len(q) == 3 and all(len(a) >= 1 for a in q.answers)
print("ok")
"#;
    let o = std::process::Command::new("python3")
        .args(["-c", script, out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Paper 1's perturbations on a tiny model: genuine interpolation toward
/// another item's cache at a target cosine, dense damage matched to sparse
/// damage, destroyed heads, and a layer budget whose untouched layers stay
/// bit-exact to the native cache.
#[test]
fn blends_matched_damage_and_layer_budgets_act_where_they_say() {
    use std::collections::BTreeMap;
    use tolerable_driver::config::SweepConfig;
    use tolerable_driver::exec::{prepare, ItemCx};
    use tolerable_driver::passes::item_passes;
    use tolerable_driver::transforms::Memo;
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let text = format!(
        r#"
[run]
name = "paper1"
model = "{}"
[data]
source = "synthetic"
n = 4

[[arms]]
name = "genuine"
base = "full"
inject = {{ carrier = "k", positions = "passage", source = "native", blend = {{ toward = "other_item", target_cosine = 0.99 }} }}

[[arms]]
name = "sparse"
base = "full"
inject = {{ carrier = "k", positions = "passage", source = "native", perturb = {{ kind = "sparse_damage", fraction = 0.05 }} }}

[[arms]]
name = "dense"
base = "full"
seed_as = "sparse"
inject = {{ carrier = "k", positions = "passage", source = "native", perturb = {{ kind = "dense_matched", fraction = 0.05 }} }}

[[arms]]
name = "head_gone"
base = "full"
inject = {{ carrier = "kv", heads = [0], positions = "passage", source = "native", perturb = {{ kind = "destroy" }} }}

[[arms]]
name = "budget"
base = "full"
inject = {{ carrier = "k", layers = "prefix:2", positions = "passage", source = "native", perturb = {{ kind = "cosine_noise", target_cosine = 0.8 }} }}

[[arms]]
name = "budget_genuine"
base = "full"
inject = {{ carrier = "k", layers = "prefix:2", positions = "passage", source = {{ bank = {{ bank = "bank", cosine = 0.8 }} }} }}

[resources.bank]
kind = "key_bank"
size = 16
contexts = 2
data = "synthetic"

[[arms]]
name = "pool_oracle"
inject = {{ carrier = "h", layers = 1, positions = "fact_region", source = {{ pool = {{ n = 3, router = "oracle" }} }}, mechanism = "add", alpha = 2.0 }}

[[arms]]
name = "pool_uniform"
inject = {{ carrier = "h", layers = 1, positions = "fact_region", source = {{ pool = {{ n = 3, router = "uniform" }} }}, mechanism = "add", alpha = 2.0 }}

[[arms]]
name = "holder_add"
inject = {{ carrier = "h", layers = 1, positions = "fact_region", source = "holder", mechanism = "add", alpha = 2.0 }}

[[arms]]
name = "sender_pool"
inject = {{ carrier = "kv", positions = "passage", source = {{ pool = {{ n = 3, router = "uniform" }} }}, mechanism = "append" }}
"#,
        model.display()
    );
    let cfg = SweepConfig::parse(&text).unwrap();
    let ck = tolerable_fetch::load(
        model.to_str().unwrap(),
        tolerable_runtime::Precision::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let plan =
        tolerable_driver::compile(&cfg, ck.model.config(), "tiny", &|_| unreachable!()).unwrap();
    assert_eq!(plan.needs.partners, 2);
    let items = tolerable_probe::sample::sample(
        &tolerable_probe::synthetic::generate(8, 3),
        &ck.tokenizer,
        &tolerable_probe::SplitOptions::default(),
        4,
        3,
    )
    .unwrap();
    let set = tolerable_driver::items::ItemSet::new(items.items, 2, 3).unwrap();
    // A bank of random keys stands in for the genuine one: only where the
    // layer budget writes is tested here (the bank's build is tested above).
    let cfgm = ck.model.config();
    let bank = tolerable_driver::resources::KeyBank {
        keys: (0..cfgm.n_layers)
            .map(|_| {
                (0..cfgm.n_kv_heads)
                    .map(|_| {
                        candle_core::Tensor::randn(
                            0f32,
                            1f32,
                            (16, cfgm.head_dim),
                            &candle_core::Device::Cpu,
                        )
                        .unwrap()
                    })
                    .collect()
            })
            .collect(),
    };
    let mut resources: BTreeMap<String, tolerable_driver::resources::Value> = BTreeMap::new();
    resources.insert("bank".into(), std::sync::Arc::new(bank));
    let memo = Memo::default();
    let passes = item_passes(
        &ck.model,
        &set.pairs[0],
        &set.partners_of(0),
        &plan.needs,
        &BTreeMap::new(),
    )
    .unwrap();
    let cx = ItemCx {
        model: &ck.model,
        passes: &passes,
        index: 0,
        seed: 0,
        resources: &resources,
        memo: &memo,
    };
    let by = |name: &str| {
        let p = plan.programs.iter().find(|p| p.name == name).unwrap();
        prepare(p, &cx).unwrap()
    };
    let bits = |t: &candle_core::Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let native = &passes.alt.cache;
    let genuine = by("genuine");
    let c = genuine.measures.achieved_cosine.unwrap();
    assert!((c - 0.99).abs() < 1e-3 || c > 0.99, "{c}");
    let (sparse, dense) = (by("sparse"), by("dense"));
    let (cs, cd) = (
        sparse.measures.achieved_cosine.unwrap(),
        dense.measures.achieved_cosine.unwrap(),
    );
    // Paired by `seed_as`: the dense damage matches the sparse arm's own draws.
    assert!((cs - cd).abs() < 1e-4, "sparse {cs}, dense {cd}");
    // Head 0 destroyed at the passage, head 1 untouched.
    let gone = by("head_gone");
    let ps = passes.geometry.passage_start;
    for l in 0..ck.model.config().n_layers {
        let k = &gone.cache.require_layer(l).unwrap().k;
        let h0 = bits(&k.narrow(1, 0, 1).unwrap().narrow(2, ps, 1).unwrap());
        assert!(h0.iter().all(|&v| v == 0.0));
        assert_eq!(
            bits(&k.narrow(1, 1, 1).unwrap()),
            bits(&native.require_layer(l).unwrap().k.narrow(1, 1, 1).unwrap())
        );
    }
    // A pool with an oracle router is the answer holder alone, bit for bit;
    // a uniform router mixes in the distractors.
    let cache_bits = |c: &tolerable_runtime::KvCache| -> Vec<Vec<f32>> {
        (0..c.n_layers())
            .map(|l| bits(&c.require_layer(l).unwrap().k))
            .collect()
    };
    let (oracle, uniform, holder) = (by("pool_oracle"), by("pool_uniform"), by("holder_add"));
    assert_eq!(cache_bits(&oracle.cache), cache_bits(&holder.cache));
    assert_ne!(cache_bits(&uniform.cache), cache_bits(&holder.cache));
    // A sender pool appends each member's passage after the masked cache:
    // the answer holder's (the full passage's) first, then each partner's.
    let pooled = by("sender_pool").cache;
    let base = &passes.base.cache;
    let span = |c: &tolerable_runtime::KvCache, g: &tolerable_carrier::Geometry| {
        c.narrow(g.passage_start, g.context_len - g.passage_start)
            .unwrap()
    };
    let mut want = vec![span(native, &passes.geometry)];
    for (p, g) in &passes.partners {
        want.push(span(&p.cache, g));
    }
    assert_eq!(want.len(), 2 + 1);
    assert_eq!(
        pooled.len(),
        base.len() + want.iter().map(|c| c.len()).sum::<usize>()
    );
    let mut at = base.len();
    for w in &want {
        assert_eq!(
            cache_bits(&pooled.narrow(at, w.len()).unwrap()),
            cache_bits(w)
        );
        at += w.len();
    }
    // The layer budget corrupts layers 0 and 1, off-manifold (noise) and
    // on-manifold (bank keys); every later layer is the native cache, bit for bit.
    for budget in [by("budget"), by("budget_genuine")] {
        for l in 0..ck.model.config().n_layers {
            let (a, b) = (
                budget.cache.require_layer(l).unwrap(),
                native.require_layer(l).unwrap(),
            );
            assert_eq!(bits(&a.v), bits(&b.v), "values of layer {l}");
            if l >= 2 {
                assert_eq!(bits(&a.k), bits(&b.k), "keys of layer {l}");
            } else {
                assert_ne!(bits(&a.k), bits(&b.k), "keys of layer {l}");
            }
        }
    }
}

/// Held-out senders: the receiver re-quantized, or moved by weight noise,
/// pass their gates before any item and read the passage for the holder
/// arms; their cache cosine to the receiver is recorded.
#[test]
fn held_out_senders_are_built_gated_and_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let text = format!(
        r#"
[run]
name = "senders"
model = "{}"
new_tokens = 3
[data]
source = "synthetic"
n = 2

[[arms]]
name = "kv_augment"
inject = {{ carrier = "kv", positions = "passage", source = "holder", mechanism = "append" }}

[[arms]]
name = "kv_augment_q8"
holder = {{ requantize = "Q8_0" }}
inject = {{ carrier = "kv", positions = "passage", source = "holder", mechanism = "append" }}

[[arms]]
name = "kv_augment_q4k"
holder = {{ requantize = "Q4_K" }}
inject = {{ carrier = "kv", positions = "passage", source = "holder", mechanism = "append" }}

[[arms]]
name = "act_noise_sender"
holder = {{ weight_cosine = 0.99 }}
inject = {{ carrier = "h", layers = 1, positions = "fact_region", source = "holder" }}
"#,
        model.display()
    );
    let cfg = dir.path().join("senders.toml");
    std::fs::write(&cfg, text).unwrap();
    let out = dir.path().join("run");
    sweep::run(
        &cfg,
        &SweepOptions {
            out: Some(out.clone()),
            ..Default::default()
        },
    )
    .unwrap();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("run.json")).unwrap()).unwrap();
    let senders = meta["senders"].as_object().unwrap();
    assert_eq!(senders.len(), 3, "{senders:?}");
    for (key, r) in senders {
        assert_eq!(r["passed"], true, "{key}");
        let c = r["cache_cosine"].as_f64().unwrap();
        assert!(c > 0.5 && c < 1.0, "{key}: {c}");
    }
    // Closer weights, closer caches.
    let cos = |k: &str| senders[k]["weight_cosine"].as_f64().unwrap();
    assert!(cos("requantize=Q8_0") > 0.9999 && cos("requantize=Q8_0") > cos("requantize=Q4_K"));
    // The tiny model's rows are 64 wide: Q4_K (blocks of 256) falls back to Q4_1.
    assert!(
        senders["requantize=Q4_K"]["matrix_types"]["Q4_1"]
            .as_u64()
            .unwrap()
            > 0
    );
    let (names, all) = rows(&out.join("items/cell-00000.parquet"));
    let arm = col(&names, &all, "arm");
    let fid = col(&names, &all, "fidelity_cosine");
    let inj = col(&names, &all, "injections");
    for (i, a) in arm.iter().enumerate() {
        if a == "kv_augment" {
            assert_eq!(fid[i].parse::<f64>().unwrap(), 1.0);
        }
        if a == "kv_augment_q8" {
            let f: f64 = fid[i].parse().unwrap();
            assert!(f < 1.0 && f > 0.9, "{f}");
            assert!(inj[i].contains("sender"), "{}", inj[i]);
        }
    }
    // Bad senders are refused before any work, naming the field.
    let bad = |holder: &str| {
        let t = format!(
            "[run]\nname = \"b\"\nmodel = \"{}\"\n[data]\nsource = \"synthetic\"\nn = 2\n[[arms]]\nname = \"a\"\nholder = {holder}\ninject = {{ carrier = \"kv\", positions = \"passage\", source = \"holder\", mechanism = \"append\" }}\n",
            model.display()
        );
        let p = dir.path().join("bad.toml");
        std::fs::write(&p, t).unwrap();
        sweep::run(
            &p,
            &SweepOptions {
                out: Some(dir.path().join("bad")),
                ..Default::default()
            },
        )
        .unwrap_err()
        .to_string()
    };
    let e = bad("{ requantize = \"Q7_0\" }");
    assert!(
        e.contains("arms[0].holder.requantize") && e.contains("Q7_0"),
        "{e}"
    );
    let e = bad("{ weight_cosine = 1.5 }");
    assert!(e.contains("arms[0].holder.weight_cosine"), "{e}");
    let e = bad("{ requantize = \"Q8_0\", weight_cosine = 0.9 }");
    assert!(e.contains("arms[0].holder"), "{e}");
    assert!(!dir.path().join("bad").exists());
}

/// A held-out sender that is not measurably distinct from its receiver, or
/// whose values are not finite, fails its gates with the gate named: a
/// receiver of zero weights re-quantizes exactly (zeros stay zeros), and one
/// output weight of 1e30 overflows Q8_0's f16 block scale.
#[test]
fn a_sender_that_is_not_distinct_or_not_finite_fails_its_gates() {
    use tolerable_driver::senders::{build, SenderSpec};
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let ck = tolerable_fetch::load(
        model.to_str().unwrap(),
        tolerable_runtime::Precision::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let prompt = [3u32, 1, 4, 1, 5, 9, 2, 6];
    let q8 = SenderSpec::Requantize("Q8_0".into());
    // The tiny receiver itself yields a sender that passes.
    let (_, report) = build(&ck.model, &q8, &prompt).unwrap();
    assert!(report.passed && report.distinct && report.finite);

    let zero = ck
        .model
        .map_weights(&mut |_, w| Ok(w.zeros_like()?))
        .unwrap();
    let e = build(&zero, &q8, &prompt).unwrap_err().to_string();
    assert!(
        e.contains("Q8_0")
            && e.contains("finite true, distinct false")
            && e.contains("no eval item runs"),
        "{e}"
    );

    let huge = ck
        .model
        .map_weights(&mut |name, w| {
            if name != "output" {
                return Ok(w.clone());
            }
            let mut v = w.flatten_all()?.to_vec1::<f32>()?;
            v[0] = 1e30;
            Ok(candle_core::Tensor::from_vec(v, w.dims(), w.device())?)
        })
        .unwrap();
    let e = build(&huge, &q8, &prompt).unwrap_err().to_string();
    assert!(e.contains("shape equal true, finite false"), "{e}");
}

fn fitted_config(dir: &Path, model: &Path) -> PathBuf {
    let text = format!(
        r#"
[run]
name = "tiny-fitted"
model = "{}"
seed = 5
new_tokens = 3
cell_items = 3

[data]
source = "synthetic"
n = 3

[resources.pairs]
kind = "key_pairs"
sender = {{ requantize = "Q4_0" }}
train_items = 5
data = "synthetic"
positions = "passage"

[resources.noisy]
kind = "key_pairs"
noise_cosine = 0.9
train_items = 5
data = "synthetic"
positions = "passage"

[resources.ls]
kind = "fitted_map"
pairs = "pairs"
method = "least_squares"

[resources.wk]
kind = "fitted_map"
pairs = "pairs"
method = "least_squares_wk"
rank = 4

[resources.mlp]
kind = "fitted_map"
pairs = "pairs"
method = "mlp"
hidden = 16
objective = "hinge"
margin = 0.999
steps = 20
lr = 0.01

[resources.noise_ls]
kind = "fitted_map"
pairs = "noisy"
method = "least_squares"

[[arms]]
name = "floor"
base = "masked"

[[arms]]
name = "native"
base = "full"

[[arms]]
name = "raw_sender"
base = "full"
holder = {{ requantize = "Q4_0" }}
inject = {{ carrier = "k", positions = "fact_region", source = "holder" }}

[[arms]]
name = "ls"
base = "full"
holder = {{ requantize = "q4_0" }}
inject = {{ carrier = "k", positions = "fact_region", source = "holder", map = "ls" }}

[[arms]]
name = "wk"
base = "full"
holder = {{ requantize = "Q4_0" }}
inject = {{ carrier = "k", positions = "fact_region", source = "holder", map = "wk" }}

[[arms]]
name = "mlp"
base = "full"
holder = {{ requantize = "Q4_0" }}
inject = {{ carrier = "k", positions = "fact_region", source = "holder", map = "mlp" }}

[[arms]]
name = "noise_ls"
base = "full"
inject = {{ carrier = "k", positions = "fact_region", source = "native", perturb = {{ kind = "cosine_noise", target_cosine = 0.9 }}, map = "noise_ls" }}
"#,
        model.display()
    );
    let p = dir.join("fitted.toml");
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn fitted_substitutes_are_built_once_cached_recorded_and_carry_fidelity() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let cfg = fitted_config(dir.path(), &model);
    let cache = dir.path().join("resources");
    let opts = opts_in(dir.path(), &cache);
    let read = |out: &str| -> serde_json::Value {
        serde_json::from_str(
            &std::fs::read_to_string(dir.path().join(out).join("run.json")).unwrap(),
        )
        .unwrap()
    };
    sweep::run(&cfg, &opts("a")).unwrap();
    let meta = read("a");
    for r in ["pairs", "noisy", "ls", "wk", "mlp", "noise_ls"] {
        assert_eq!(meta["resources"][r]["obtained"], "built", "{r}");
    }
    // One sender serves the arms and the key pairs (`q4_0` is `Q4_0`).
    assert!(
        meta["senders"]["requantize=Q4_0"].is_object(),
        "{}",
        meta["senders"]
    );
    // Training items are never evaluation items.
    let eval: Vec<&str> = meta["data"]["item_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(meta["resources"]["pairs"]["training_items"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| !eval.contains(&t.as_str().unwrap())));
    let (names, all) = rows(&dir.path().join("a/items/cell-00000.parquet"));
    let arm = col(&names, &all, "arm");
    let res = col(&names, &all, "resources");
    let fid = col(&names, &all, "fidelity_cosine");
    let corr = col(&names, &all, "logit_correlation");
    for name in ["raw_sender", "ls", "wk", "mlp", "noise_ls"] {
        let k = arm.iter().position(|a| a == name).unwrap();
        let f: f64 = fid[k]
            .parse()
            .unwrap_or_else(|_| panic!("{name}: {}", fid[k]));
        assert!(f > 0.0 && f <= 1.0 + 1e-9, "{name}: {f}");
        let c: f64 = corr[k]
            .parse()
            .unwrap_or_else(|_| panic!("{name}: {}", corr[k]));
        assert!((-1.0..=1.0 + 1e-9).contains(&c), "{name}: {c}");
        if name != "raw_sender" {
            let hash = meta["resources"][name]["hash"].as_str().unwrap();
            assert!(res[k].contains(&format!("{name}={hash}")), "{}", res[k]);
        }
    }
    // The arms differ from the raw sender's keys they were given.
    let at = |name: &str| arm.iter().position(|a| a == name).unwrap();
    for name in ["ls", "wk", "mlp"] {
        assert_ne!(fid[at(name)], fid[at("raw_sender")], "{name}");
    }

    // A second run loads every resource from the cache, and decodes the same.
    sweep::run(&cfg, &opts("b")).unwrap();
    let meta2 = read("b");
    for r in ["pairs", "noisy", "ls", "wk", "mlp", "noise_ls"] {
        assert_eq!(meta2["resources"][r]["obtained"], "cached", "{r}");
        assert_eq!(meta2["resources"][r]["hash"], meta["resources"][r]["hash"]);
    }
    let (n2, r2) = rows(&dir.path().join("b/items/cell-00000.parquet"));
    assert_eq!(
        col(&n2, &r2, "continuation_ids"),
        col(&names, &all, "continuation_ids")
    );
    assert_eq!(col(&n2, &r2, "fidelity_cosine"), fid);
}

/// The pre-RoPE frame of `least_squares_wk`: un-rotating the cache's keys
/// gives the keys `W_k` wrote (`hook_k`), for both RoPE layouts; the key
/// projection has the layer's shape, with a bias where the family has one.
#[test]
fn fitted_maps_see_the_pre_rope_keys_the_key_projection_wrote() {
    use tolerable_runtime::{Arch, HookPoint, HookSpec, LogitsAt, Model, Precision};
    let dir = tempfile::tempdir().unwrap();
    for arch in [Arch::Qwen2, Arch::Llama] {
        let p = dir.path().join(format!("{arch:?}.gguf"));
        write_gguf(
            &TinySpec {
                arch,
                ..TinySpec::default()
            },
            &p,
        )
        .unwrap();
        let m = Model::from_gguf(&p, Precision::F32, &candle_core::Device::Cpu).unwrap();
        let cfg = m.config().clone();
        let ids: Vec<u32> = (0..12)
            .map(|i| (i * 7 + 3) % cfg.vocab_size as u32)
            .collect();
        let mut cache = m.new_cache(1);
        let spec = HookSpec::new().capture(HookPoint::K(1));
        let out = m
            .forward(
                &m.tokens(std::slice::from_ref(&ids)).unwrap(),
                &mut cache,
                &spec,
                LogitsAt::None,
            )
            .unwrap();
        let pre = out.hooks.get(HookPoint::K(1)).unwrap(); // [1, nkv, T, hd]
        let rot = &cache.require_layer(1).unwrap().k;
        let pos: Vec<usize> = (0..ids.len()).collect();
        let (wk, bk) = m.key_projection(1).unwrap();
        for h in 0..cfg.n_kv_heads {
            let head = |t: &candle_core::Tensor| {
                t.narrow(1, h, 1)
                    .unwrap()
                    .squeeze(0)
                    .unwrap()
                    .squeeze(0)
                    .unwrap()
            };
            let back = tolerable_carrier::fit::rope_rotate(
                &head(rot),
                &pos,
                cfg.rope_theta,
                cfg.rope_style,
                true,
            )
            .unwrap();
            let diff = (&back - &head(pre))
                .unwrap()
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(diff < 1e-4, "{arch:?} head {h}: {diff}");
        }
        assert_eq!(wk.dims(), [cfg.n_kv_heads * cfg.head_dim, cfg.d_model]);
        assert_eq!(bk.is_some(), cfg.qkv_bias());
    }
}

fn bridge_config(dir: &Path, model: &Path, epochs: usize) -> PathBuf {
    let text = format!(
        r#"
[run]
name = "tiny-bridge"
model = "{}"
seed = 5
new_tokens = 3
cell_items = 2

[data]
source = "synthetic"
n = 3

[resources.qb]
kind = "bridge"
targets = "q"
rank = 4
train_items = 4
slice_items = 2
epochs = {epochs}
lr = 0.01
data = "synthetic"
arm = {{ inject = [{{ carrier = "kv", positions = "passage", source = "holder", mechanism = "append" }}] }}

[[arms]]
name = "kv_augment"
inject = {{ carrier = "kv", positions = "passage", source = "holder", mechanism = "append" }}

[[arms]]
name = "kv_bridge"
bridge = {{ resource = "qb" }}
inject = {{ carrier = "kv", positions = "passage", source = "holder", mechanism = "append" }}

[[arms]]
name = "kv_bridge_init"
bridge = {{ resource = "qb", init = true }}
expect = {{ arm = "kv_augment" }}
inject = {{ carrier = "kv", positions = "passage", source = "holder", mechanism = "append" }}

[[arms]]
name = "kv_bridge_mismatch"
bridge = {{ resource = "qb" }}
inject = {{ carrier = "kv", positions = "passage", source = "other_item", mechanism = "append" }}
"#,
        model.display()
    );
    let p = dir.join("bridge.toml");
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn a_bridge_is_trained_cached_recorded_and_bit_exact_at_zero_init() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let cfg = bridge_config(dir.path(), &model, 2);
    let cache = dir.path().join("resources");
    let opts = opts_in(dir.path(), &cache);
    let out = dir.path().join("a");
    sweep::run(&cfg, &opts("a")).unwrap();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("run.json")).unwrap()).unwrap();
    let qb = &meta["resources"]["qb"];
    assert_eq!(qb["obtained"], "built");
    let curve = qb["summary"]["curve"].as_array().unwrap();
    assert_eq!(curve.len(), 3, "{qb}");
    assert!(curve[0]["train_loss"].is_null());
    assert!(curve[1]["train_loss"].as_f64().unwrap().is_finite());
    assert!(qb["summary"]["best_epoch"].as_u64().unwrap() <= 2);
    // The curve as Parquet, one kept epoch.
    let (rnames, rrows) = rows(&out.join("resources.parquet"));
    let metric = col(&rnames, &rrows, "metric");
    let value = col(&rnames, &rrows, "value");
    let kept: Vec<usize> = (0..metric.len())
        .filter(|&i| metric[i] == "kept" && value[i].parse::<f64>().unwrap() == 1.0)
        .collect();
    assert_eq!(kept.len(), 1);
    assert_eq!(
        metric
            .iter()
            .filter(|m| *m == "slice_first_token_accuracy")
            .count(),
        3
    );
    // The zero-init arm equals the raw arm bit for bit on every item.
    let (names, rows) = rows(&out.join("items/cell-00000.parquet"));
    let arm = col(&names, &rows, "arm");
    let exact = col(&names, &rows, "bit_exact");
    let res = col(&names, &rows, "resources");
    for (i, a) in arm.iter().enumerate() {
        if a == "kv_bridge_init" {
            assert_eq!(exact[i], "true", "row {i}");
        }
        if a.starts_with("kv_bridge") {
            assert!(res[i].contains("qb="), "{}", res[i]);
        }
    }
    // The report shows the curve.
    let report = std::fs::read_to_string(tolerable_driver::report::write(&out).unwrap()).unwrap();
    assert!(
        report.contains("## Trained resources") && report.contains("| yes |"),
        "{report}"
    );
    assert!(out.join("plots/curve_qb.png").exists());
    // Named arms without a grid axis: one plot of accuracy by arm.
    assert!(
        std::fs::metadata(out.join("plots/accuracy_by_arm.png"))
            .unwrap()
            .len()
            > 1000
            && report.contains("plots/accuracy_by_arm.png"),
        "{report}"
    );
    // A second run loads it from the cache.
    sweep::run(&cfg, &opts("b")).unwrap();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("b/run.json")).unwrap())
            .unwrap();
    assert_eq!(meta["resources"]["qb"]["obtained"], "cached");
    assert_eq!(meta["resources"]["qb"]["summary"], qb["summary"]);
    // The cached value stores no initial adapters; the ones it derives
    // from the seed still give the raw arm bit for bit.
    let hash = qb["hash"].as_str().unwrap();
    let stored = candle_core::safetensors::load(
        cache.join(format!("bridge-{hash}/value.safetensors")),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    assert!(
        !stored.keys().any(|k| k.starts_with("init.")),
        "{:?}",
        stored.keys()
    );
    assert!(gated_rows_exact(&dir.path().join("b"), &["kv_bridge_init"]) > 0);
    // Bad input, named before any work: an unknown bridge, a bridge trained
    // on another item's states, the router, a gate against a missing arm, a
    // mini-batch of none or of more than the training items.
    for (from, to, want) in [
        ("bridge = {{ resource = \"qb\" }}", "bridge = {{ resource = \"nope\" }}", "bridge.resource"),
        ("arm = {{ inject = [{{ carrier = \"kv\", positions = \"passage\", source = \"holder\"", "arm = {{ inject = [{{ carrier = \"kv\", positions = \"passage\", source = \"other_item\"", "own passes"),
        ("targets = \"q\"", "targets = \"router\"", "router"),
        ("expect = {{ arm = \"kv_augment\" }}", "expect = {{ arm = \"nope\" }}", "expect.arm"),
        ("lr = 0.01", "lr = 0.01\nbatch = 0", "batch: 0 is outside 1..=4"),
        ("lr = 0.01", "lr = 0.01\nbatch = 5", "batch: 5 is outside 1..=4"),
    ] {
        let text = std::fs::read_to_string(&cfg).unwrap();
        let from = from.replace("{{", "{").replace("}}", "}");
        let to = to.replace("{{", "{").replace("}}", "}");
        assert!(text.contains(&from), "{from}");
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, text.replacen(&from, &to, 1)).unwrap();
        let e = sweep::run(&bad, &opts("bad")).unwrap_err().to_string();
        assert!(e.contains(want), "{want}: {e}");
        assert!(!dir.path().join("bad/run.json").exists());
    }
}

/// A bridge whose training was cut short resumes from the progress file
/// the sweep keeps beside the resource cache: a sweep that finds the
/// progress of a finished last epoch trains nothing more and keeps that
/// file's kept parameters; one saved three steps into an epoch is resumed
/// there, and run.json and the report say where; the file is removed once
/// the bridge is saved; a corrupt one is set aside and the bridge trained
/// from the start.
#[test]
fn a_bridge_build_resumes_from_its_progress_file() {
    use candle_core::{Device, Tensor};
    use tolerable_driver::resources::optim::AdamState;
    use tolerable_driver::resources::progress::Progress;
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let cfg = bridge_config(dir.path(), &model, 2);
    let cache = dir.path().join("resources");
    let opts = opts_in(dir.path(), &cache);
    sweep::run(&cfg, &opts("a")).unwrap();
    let meta = |out: &str| -> serde_json::Value {
        serde_json::from_str(
            &std::fs::read_to_string(dir.path().join(out).join("run.json")).unwrap(),
        )
        .unwrap()
    };
    let qb = meta("a")["resources"]["qb"].clone();
    assert!(qb["build_resumed_after_epoch"].is_null(), "{qb}");
    let hash = qb["hash"].as_str().unwrap().to_string();
    let folder = cache.join(format!("bridge-{hash}"));
    let progress = cache.join(format!("bridge-{hash}.progress.safetensors"));
    assert!(folder.join("meta.json").exists());
    assert!(!progress.exists(), "the progress outlived the saved bridge");
    // The trained value's A and B per layer, in training order.
    let value =
        candle_core::safetensors::load(folder.join("value.safetensors"), &Device::Cpu).unwrap();
    let mut layers: Vec<usize> = value
        .keys()
        .filter_map(|k| {
            k.strip_prefix("trained.")?
                .strip_suffix(".q.a")?
                .parse()
                .ok()
        })
        .collect();
    layers.sort();
    assert!(!layers.is_empty());
    // The training names its parameters by the value file's keys (a
    // progress file of other names would be set aside).
    let names: Vec<String> = layers
        .iter()
        .flat_map(|l| ["a", "b"].map(|w| format!("trained.{l}.q.{w}")))
        .collect();
    let trained: Vec<Tensor> = names.iter().map(|k| value[k].clone()).collect();
    // The progress of a training that finished its two epochs but was
    // killed before saving, with kept parameters of its own.
    let kept: Vec<Tensor> = trained.iter().map(|t| (t * 2.0).unwrap()).collect();
    let zeros: Vec<Tensor> = trained.iter().map(|t| t.zeros_like().unwrap()).collect();
    let curve = vec![
        [0.0, f64::NAN, 2.0, 0.0],
        [1.0, 1.5, 1.0, 0.5],
        [2.0, 1.2, 1.1, 0.5],
    ];
    let planted = Progress {
        epoch: 2,
        steps: 0,
        partial_loss: 0.0,
        names: names.clone(),
        params: trained.clone(),
        adam: AdamState {
            first: zeros.clone(),
            second: zeros,
            step_t: 8,
        },
        kept: Some(kept.clone()),
        curve: curve.clone(),
        best_epoch: 1,
    };
    std::fs::remove_dir_all(&folder).unwrap();
    planted.save(&progress).unwrap();
    sweep::run(&cfg, &opts("b")).unwrap();
    let b = meta("b")["resources"]["qb"].clone();
    assert_eq!(b["obtained"], "built");
    assert_eq!(b["summary"]["best_epoch"], 1);
    // run.json and the cached copy's meta.json say the build resumed, so
    // its build seconds are read as the last invocation's part.
    assert_eq!(b["build_resumed_after_epoch"], 2);
    assert_eq!(b["build_resumed_after_steps"], 0);
    let stored: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(folder.join("meta.json")).unwrap()).unwrap();
    assert_eq!(stored["resumed_after_epoch"], 2);
    assert_eq!(stored["resumed_after_steps"], 0);
    // The report says its build time is the last invocation's part.
    let md =
        std::fs::read_to_string(tolerable_driver::report::write(&dir.path().join("b")).unwrap())
            .unwrap();
    assert!(
        md.contains("in its last invocation, resumed after epoch 2"),
        "{md}"
    );
    // A later run loading it from the cache records the same.
    sweep::run(&cfg, &opts("b2")).unwrap();
    let b2 = meta("b2")["resources"]["qb"].clone();
    assert_eq!(b2["obtained"], "cached");
    assert_eq!(b2["build_resumed_after_epoch"], 2);
    assert!(!progress.exists(), "the progress outlived the saved bridge");
    let value =
        candle_core::safetensors::load(folder.join("value.safetensors"), &Device::Cpu).unwrap();
    let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for (key, want) in names.iter().zip(&kept) {
        assert_eq!(flat(&value[key]), flat(want), "{key}");
    }
    // Killed three steps into its second epoch (of four steps): the build
    // takes the last step and says where it resumed.
    // The first planted file's parameters, moments and kept epoch.
    let inside = Progress {
        epoch: 1,
        steps: 3,
        partial_loss: 4.5,
        adam: AdamState {
            step_t: 7,
            ..planted.adam
        },
        curve: curve[..2].to_vec(),
        ..planted
    };
    std::fs::remove_dir_all(&folder).unwrap();
    inside.save(&progress).unwrap();
    sweep::run(&cfg, &opts("d")).unwrap();
    let d = meta("d")["resources"]["qb"].clone();
    assert_eq!(d["obtained"], "built");
    assert_eq!(
        (
            &d["build_resumed_after_epoch"],
            &d["build_resumed_after_steps"]
        ),
        (&serde_json::json!(1), &serde_json::json!(3)),
        "{d}"
    );
    let md =
        std::fs::read_to_string(tolerable_driver::report::write(&dir.path().join("d")).unwrap())
            .unwrap();
    assert!(
        md.contains("resumed after epoch 1 and 3 steps of the next"),
        "{md}"
    );
    assert!(!progress.exists(), "the progress outlived the saved bridge");
    // A corrupt progress file: trained from the start, as the first run.
    std::fs::remove_dir_all(&folder).unwrap();
    std::fs::write(&progress, b"cut off mid-write").unwrap();
    sweep::run(&cfg, &opts("c")).unwrap();
    let c = meta("c")["resources"]["qb"].clone();
    assert_eq!(c["obtained"], "built");
    assert!(c["build_resumed_after_epoch"].is_null(), "{c}");
    assert_eq!(c["value_sha256"], qb["value_sha256"]);
    assert_eq!(c["summary"], qb["summary"]);
    assert!(!progress.exists());
}

/// The zero-init gate holds when the anchor shares its cache layout with a
/// third arm: a twin of the raw arm would batch with it (two rows, gemm's
/// path) while the zero-init arm, with its own question-side spec, runs
/// alone (one row, gemv's path, another summation order); the plan marks
/// gated arms and their anchors to decode alone. (On the real 0.5B this
/// happened when a mismatch partner's passage had the holder's length, on
/// one item after 110 had passed.)
#[test]
fn the_zero_init_gate_holds_when_the_anchor_shares_a_layout() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let cfg = bridge_config(dir.path(), &model, 1);
    let text = std::fs::read_to_string(&cfg).unwrap()
        + r#"
[[arms]]
name = "kv_augment_twin"
inject = { carrier = "kv", positions = "passage", source = "holder", mechanism = "append" }
"#;
    std::fs::write(&cfg, text).unwrap();
    let out = dir.path().join("twin");
    sweep::run(
        &cfg,
        &SweepOptions {
            out: Some(out.clone()),
            resource_root: Some(dir.path().join("resources")),
            ..Default::default()
        },
    )
    .unwrap();
    let (names, rows) = rows(&out.join("items/cell-00000.parquet"));
    let arm = col(&names, &rows, "arm");
    let exact = col(&names, &rows, "bit_exact");
    let cont = col(&names, &rows, "continuation_ids");
    let n = arm.iter().filter(|a| *a == "kv_bridge_init").count();
    assert!(n > 0);
    for (i, a) in arm.iter().enumerate() {
        if a == "kv_bridge_init" {
            assert_eq!(exact[i], "true", "row {i}");
        }
    }
    // The twin decodes what the raw arm decodes.
    let of = |name: &str| -> Vec<String> {
        (0..arm.len())
            .filter(|&i| arm[i] == name)
            .map(|i| cont[i].clone())
            .collect()
    };
    assert_eq!(of("kv_augment"), of("kv_augment_twin"));
}

/// A bridge trained in mini-batches (`batch = 2`: two examples a step, read
/// as one padded batch) is another resource than the one-item bridge (its
/// own spec and cache entry), trains to a finite curve, and still starts as
/// the raw arm bit for bit.
#[test]
fn a_bridge_trained_in_mini_batches_is_its_own_resource() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let one = bridge_config(dir.path(), &model, 1);
    let text = std::fs::read_to_string(&one).unwrap();
    let two = dir.path().join("batch2.toml");
    std::fs::write(&two, text.replacen("lr = 0.01", "lr = 0.01\nbatch = 2", 1)).unwrap();
    let cache = dir.path().join("resources");
    let opts = opts_in(dir.path(), &cache);
    sweep::run(&one, &opts("one")).unwrap();
    sweep::run(&two, &opts("two")).unwrap();
    let (m1, m2) = (
        run_json(&dir.path().join("one")),
        run_json(&dir.path().join("two")),
    );
    assert_ne!(m1["config_hash"], m2["config_hash"]);
    let qb = &m2["resources"]["qb"];
    assert_eq!(qb["obtained"], "built", "{qb}");
    assert_ne!(qb["hash"], m1["resources"]["qb"]["hash"]);
    assert_eq!(qb["spec"]["batch"], 2);
    assert!(m1["resources"]["qb"]["spec"].get("batch").is_none());
    let curve = qb["summary"]["curve"].as_array().unwrap();
    assert_eq!(curve.len(), 2, "{qb}");
    assert!(curve[1]["train_loss"].as_f64().unwrap().is_finite(), "{qb}");
    // Epoch 0 is before any step: the same slice scores as the one-item
    // bridge; the epoch of two steps of two is not the epoch of four steps.
    let curve1 = &m1["resources"]["qb"]["summary"]["curve"];
    assert_eq!(curve[0], curve1[0]);
    assert_ne!(curve[1]["train_loss"], curve1[1]["train_loss"], "{qb}");
    let (names, rows) = rows(&dir.path().join("two/items/cell-00000.parquet"));
    let arm = col(&names, &rows, "arm");
    let exact = col(&names, &rows, "bit_exact");
    let inits: Vec<usize> = (0..arm.len())
        .filter(|&i| arm[i] == "kv_bridge_init")
        .collect();
    assert!(!inits.is_empty());
    for i in inits {
        assert_eq!(exact[i], "true", "row {i}");
    }
}

/// `[run] batch_bridges`: the bridged arm, its zero-init gate and the raw
/// arm over the same cache read their question and decode as one batch,
/// each sequence with its own adapters: fewer batches, the gate still bit
/// for bit, the same continuations as each decoding alone (on this model;
/// a batch rounds in its own order), another config hash, and run.json
/// says how arms were batched.
#[test]
fn bridges_batched_decode_together_and_keep_their_gate() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let alone = bridge_config(dir.path(), &model, 1);
    let text = std::fs::read_to_string(&alone).unwrap();
    let together = dir.path().join("together.toml");
    std::fs::write(
        &together,
        text.replacen("cell_items = 2", "cell_items = 2\nbatch_bridges = true", 1),
    )
    .unwrap();
    let cache = dir.path().join("resources");
    let opts = opts_in(dir.path(), &cache);
    sweep::run(&alone, &opts("alone")).unwrap();
    sweep::run(&together, &opts("together")).unwrap();
    let (m1, m2) = (
        run_json(&dir.path().join("alone")),
        run_json(&dir.path().join("together")),
    );
    assert_ne!(m1["config_hash"], m2["config_hash"]);
    assert_eq!(m1["resources"]["qb"]["hash"], m2["resources"]["qb"]["hash"]);
    let inv = |m: &serde_json::Value| m["invocations"][0].clone();
    assert!(inv(&m2)["batching"]
        .as_str()
        .unwrap()
        .contains("bridges batched"));
    assert!(!inv(&m1)["batching"].as_str().unwrap().contains("bridges"));
    // Per item: the gated pair and the bridged arm alone make 3 batches
    // and the mismatch arm 1, where batched bridges make one batch of the
    // three over the holder's cache.
    let (b1, b2) = (
        inv(&m1)["decode_batches"].as_u64().unwrap(),
        inv(&m2)["decode_batches"].as_u64().unwrap(),
    );
    assert!(b2 + 2 * 3 <= b1, "{b2} batches against {b1}");
    for arm in [
        "kv_augment",
        "kv_bridge",
        "kv_bridge_init",
        "kv_bridge_mismatch",
    ] {
        let c = continuations(&dir.path().join("together"), arm);
        assert_eq!(c.len(), 3);
        assert_eq!(c, continuations(&dir.path().join("alone"), arm), "{arm}");
    }
    assert_eq!(
        gated_rows_exact(&dir.path().join("together"), &["kv_bridge_init"]),
        3
    );
}

/// A trained arm combines across runs of the same bridges trained from
/// other seeds: each seed's accuracy, their mean and SD, the zero-init gate
/// summed; a later report combines the same runs again. Refused: the same
/// seed twice, runs over other items, an unfinished run in a finished
/// report (an interim report reads its cells).
#[test]
fn a_trained_arm_combines_across_seed_runs() {
    use tolerable_driver::records::{
        columns::rows as read_rows, read_parquet, SeedRow, SummaryRow,
    };
    use tolerable_driver::report::write_with;
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let s0 = bridge_config(dir.path(), &model, 1);
    let text = std::fs::read_to_string(&s0).unwrap();
    // Seed 1 with its bridges batched: another way of batching, recorded.
    let s1 = dir.path().join("seed1.toml");
    std::fs::write(
        &s1,
        text.replacen("lr = 0.01", "lr = 0.01\nseed = 1", 1)
            .replacen("cell_items = 2", "cell_items = 2\nbatch_bridges = true", 1),
    )
    .unwrap();
    let other_items = dir.path().join("n2.toml");
    std::fs::write(&other_items, text.replacen("n = 3", "n = 2", 1)).unwrap();
    let other_tokens = dir.path().join("tokens.toml");
    std::fs::write(
        &other_tokens,
        text.replacen("new_tokens = 3", "new_tokens = 2", 1)
            .replacen("lr = 0.01", "lr = 0.01\nseed = 2", 1),
    )
    .unwrap();
    let other_rank = dir.path().join("rank.toml");
    std::fs::write(
        &other_rank,
        text.replacen("rank = 4", "rank = 2", 1)
            .replacen("lr = 0.01", "lr = 0.01\nseed = 2", 1),
    )
    .unwrap();
    let cache = dir.path().join("resources");
    let opts = opts_in(dir.path(), &cache);
    for (cfg, out) in [
        (&s0, "a"),
        (&s1, "b"),
        (&other_items, "c"),
        (&other_tokens, "d"),
        (&other_rank, "e"),
    ] {
        sweep::run(cfg, &opts(out)).unwrap();
    }
    let (a, b, c) = (
        dir.path().join("a"),
        dir.path().join("b"),
        dir.path().join("c"),
    );
    assert_eq!(run_json(&b)["resources"]["qb"]["spec"]["seed"], 1);
    assert_ne!(
        run_json(&a)["resources"]["qb"]["hash"],
        run_json(&b)["resources"]["qb"]["hash"]
    );
    let summary = |d: &Path| -> Vec<SummaryRow> {
        read_rows(&read_parquet(&d.join("summary.parquet")).unwrap()).unwrap()
    };
    let acc =
        |rows: &[SummaryRow], arm: &str| rows.iter().find(|r| r.arm.arm == arm).unwrap().accuracy;
    let (sa, sb) = (summary(&a), summary(&b));
    let seeds_of = |d: &Path, f: &str| -> Vec<SeedRow> {
        read_rows(&read_parquet(&d.join(f)).unwrap()).unwrap()
    };

    let md = std::fs::read_to_string(write_with(&a, false, &[], std::slice::from_ref(&b)).unwrap())
        .unwrap();
    assert!(md.contains("## Across seeds"), "{md}");
    let combined = seeds_of(&a, "seeds.parquet");
    // The three trained arms (the bridged arm, its zero-init gate, its
    // mis-source control); the untrained arm reads no bridge.
    let fams: Vec<&str> = combined.iter().map(|r| r.family.as_str()).collect();
    assert_eq!(fams, ["kv_bridge", "kv_bridge_init", "kv_bridge_mismatch"]);
    for r in &combined {
        assert_eq!(r.bridge, "qb");
        assert_eq!(r.point, "{}");
        assert_eq!((r.n_seeds, r.seeds.clone()), (2, vec![0, 1]));
        assert_eq!(r.n_items, vec![3, 3]);
        assert_eq!(r.n_items_total, 6);
        let (x, y) = (acc(&sa, &r.family), acc(&sb, &r.family));
        assert_eq!(r.accuracy, vec![x, y]);
        assert!((r.accuracy_mean - (x + y) / 2.0).abs() < 1e-12);
        assert!((r.accuracy_sd.unwrap() - (x - y).abs() / 2f64.sqrt()).abs() < 1e-12);
        // Conditional accuracies only where every seed has one (the native
        // reference answered an item); checked with values below.
        let cond = |rows: &[SummaryRow]| {
            rows.iter()
                .find(|q| q.arm.arm == r.family)
                .unwrap()
                .cond_accuracy
        };
        if cond(&sa).is_none() || cond(&sb).is_none() {
            assert!(r.cond_accuracy.is_empty());
            assert_eq!((r.cond_accuracy_mean, r.cond_accuracy_sd), (None, None));
        }
        assert_eq!(r.run_dirs[1], b.display().to_string());
        assert!(
            !r.batching[0].contains("bridges batched"),
            "{:?}",
            r.batching
        );
        assert!(
            r.batching[1].contains("bridges batched"),
            "{:?}",
            r.batching
        );
    }
    assert!(md.contains("batched their arms in different ways"), "{md}");
    assert_eq!(combined[1].bit_exact_items, Some(6));
    assert_eq!(combined[0].bit_exact_items, None);
    // Each seed's conditional accuracy, their mean and SD, when every seed
    // has one (the tiny model's native reference answers too little to
    // have them, so the summaries are given them).
    {
        use tolerable_driver::records::seeds::{seed_rows, SeedRun};
        let given = |rows: &[SummaryRow], c: Option<f64>| -> Vec<SummaryRow> {
            rows.iter()
                .cloned()
                .map(|mut q| {
                    q.cond_accuracy = c;
                    q
                })
                .collect()
        };
        let (ma, mb) = (run_json(&a), run_json(&b));
        let (ra, rb) = (given(&sa, Some(0.25)), given(&sb, Some(0.5)));
        fn run<'a>(
            dir: &'a Path,
            meta: &'a serde_json::Value,
            rows: &'a [SummaryRow],
        ) -> SeedRun<'a> {
            SeedRun {
                dir: dir.to_str().unwrap(),
                meta,
                rows,
            }
        }
        let both = seed_rows(&[run(&a, &ma, &ra), run(&b, &mb, &rb)]).unwrap();
        for r in &both {
            assert_eq!(r.cond_accuracy, vec![0.25, 0.5]);
            assert_eq!(r.cond_accuracy_mean, Some(0.375));
            assert!((r.cond_accuracy_sd.unwrap() - 0.25 / 2f64.sqrt()).abs() < 1e-12);
        }
        // One seed without it: none of the three.
        let rb = given(&sb, None);
        for r in seed_rows(&[run(&a, &ma, &ra), run(&b, &mb, &rb)]).unwrap() {
            assert!(r.cond_accuracy.is_empty());
            assert_eq!((r.cond_accuracy_mean, r.cond_accuracy_sd), (None, None));
        }
    }
    // An independent reader sees the lists.
    let (names, prow) = rows(&a.join("seeds.parquet"));
    assert_eq!(col(&names, &prow, "seeds")[0], "[0, 1]");

    // A later report combines the same runs again.
    let md = std::fs::read_to_string(tolerable_driver::report::write(&a).unwrap()).unwrap();
    assert!(md.contains("## Across seeds"), "{md}");
    assert_eq!(seeds_of(&a, "seeds.parquet"), combined);

    // Refused, with nothing written: the same seed twice, other items.
    let before = std::fs::read(a.join("seeds.parquet")).unwrap();
    let e = write_with(&a, false, &[], std::slice::from_ref(&a))
        .unwrap_err()
        .to_string();
    assert!(e.contains("same trained arm at the same seed (0)"), "{e}");
    let e = write_with(&a, false, &[], std::slice::from_ref(&c))
        .unwrap_err()
        .to_string();
    assert!(e.contains("do not share their evaluation items"), "{e}");
    let e = write_with(&a, false, &[], &[dir.path().join("d")])
        .unwrap_err()
        .to_string();
    assert!(e.contains("do not share their run settings"), "{e}");
    let e = write_with(&a, false, &[], &[dir.path().join("e")])
        .unwrap_err()
        .to_string();
    assert!(e.contains("differ in more than their seed"), "{e}");
    assert_eq!(std::fs::read(a.join("seeds.parquet")).unwrap(), before);

    // A run in progress: refused by a finished report, read as far as it
    // has got by an interim one, whose file the finished report removes.
    let part = dir.path().join("b-part");
    std::fs::create_dir_all(part.join("items")).unwrap();
    std::fs::copy(b.join("run.json"), part.join("run.json")).unwrap();
    std::fs::copy(
        b.join("items/cell-00000.parquet"),
        part.join("items/cell-00000.parquet"),
    )
    .unwrap();
    let e = write_with(&a, false, &[], std::slice::from_ref(&part))
        .unwrap_err()
        .to_string();
    assert!(e.contains("has no summary.parquet"), "{e}");
    write_with(&a, true, &[], std::slice::from_ref(&part)).unwrap();
    let interim = seeds_of(&a, "seeds-interim.parquet");
    assert_eq!(interim[0].n_items, vec![3, 2]);
    tolerable_driver::report::write(&a).unwrap();
    assert!(!a.join("seeds-interim.parquet").exists());
    assert_eq!(seeds_of(&a, "seeds.parquet"), combined);
}

/// Asserts that every row of the `gated` arms, over every cell of a run,
/// passed its bit-exact gate; returns how many rows were checked.
fn gated_rows_exact(out: &Path, gated: &[&str]) -> usize {
    let mut checked = 0;
    for cell in std::fs::read_dir(out.join("items")).unwrap() {
        let path = cell.unwrap().path();
        let (names, rows) = rows(&path);
        let arm = col(&names, &rows, "arm");
        let exact = col(&names, &rows, "bit_exact");
        for (i, a) in arm.iter().enumerate() {
            if gated.contains(&a.as_str()) {
                assert_eq!(exact[i], "true", "{}: {a}, row {i}", path.display());
                checked += 1;
            }
        }
    }
    checked
}

/// The continuations of `arm` per item, over every cell of a run.
fn continuations(out: &Path, arm: &str) -> BTreeMap<String, String> {
    let mut by_item = BTreeMap::new();
    for cell in std::fs::read_dir(out.join("items")).unwrap() {
        let (names, rows) = rows(&cell.unwrap().path());
        let arms = col(&names, &rows, "arm");
        let items = col(&names, &rows, "item_id");
        let conts = col(&names, &rows, "continuation");
        for i in 0..arms.len() {
            if arms[i] == arm {
                by_item.insert(items[i].clone(), conts[i].clone());
            }
        }
    }
    by_item
}

fn run_json(out: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("run.json")).unwrap()).unwrap()
}

/// A resumed run whose resources were lost and retrained differently is
/// refused as soon as the first differing resource is obtained, before the
/// next is trained; the finished cells and run.json are left as they were.
#[test]
fn a_resume_stops_at_the_first_resource_its_finished_cells_did_not_read() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let one = bridge_config(dir.path(), &model, 1);
    let text = std::fs::read_to_string(&one).unwrap();
    let second = r#"
[resources.qb2]
kind = "bridge"
targets = "q"
rank = 4
train_items = 4
slice_items = 2
epochs = 1
lr = 0.01
seed = 1
data = "synthetic"
arm = { inject = [{ carrier = "kv", positions = "passage", source = "holder", mechanism = "append" }] }

[[arms]]
name = "kv_bridge2"
bridge = { resource = "qb2" }
inject = { carrier = "kv", positions = "passage", source = "holder", mechanism = "append" }
"#;
    let cfg = dir.path().join("two.toml");
    std::fs::write(&cfg, format!("{text}{second}")).unwrap();
    let out = dir.path().join("run");
    let cache = dir.path().join("resources");
    let opts = SweepOptions {
        out: Some(out.clone()),
        resource_root: Some(cache.clone()),
        ..Default::default()
    };
    sweep::run(&cfg, &opts).unwrap();
    let folders = |d: &Path| -> usize {
        std::fs::read_dir(d)
            .map(|r| r.filter(|e| e.as_ref().unwrap().path().is_dir()).count())
            .unwrap_or(0)
    };
    assert_eq!(folders(&cache), 2);
    // Cell 1 of 2 unfinished; the cache lost; the record says both
    // resources were other values than a retrain gives.
    std::fs::remove_file(sweep::cell_path(&out, 1)).unwrap();
    std::fs::remove_file(out.join("summary.parquet")).unwrap();
    std::fs::remove_dir_all(&cache).unwrap();
    let mut meta = run_json(&out);
    for r in ["qb", "qb2"] {
        meta["resources"][r]["value_sha256"] = serde_json::json!("0000");
    }
    let recorded = serde_json::to_string_pretty(&meta).unwrap();
    std::fs::write(out.join("run.json"), &recorded).unwrap();
    let cell0 = std::fs::read(sweep::cell_path(&out, 0)).unwrap();
    let e = sweep::run(&cfg, &opts).unwrap_err().to_string();
    assert!(
        e.contains("is not the one its finished cells read") && e.contains("0000"),
        "{e}"
    );
    // Only the first resource was trained (and kept in the cache); the
    // folder is as it was.
    assert_eq!(folders(&cache), 1, "{e}");
    assert_eq!(
        std::fs::read_to_string(out.join("run.json")).unwrap(),
        recorded
    );
    assert_eq!(std::fs::read(sweep::cell_path(&out, 0)).unwrap(), cell0);
    assert!(!sweep::cell_path(&out, 1).exists());
    // With the record of what the retrain gives, the run resumes.
    for r in ["qb", "qb2"] {
        meta["resources"][r]
            .as_object_mut()
            .unwrap()
            .remove("value_sha256");
    }
    std::fs::write(out.join("run.json"), serde_json::to_string(&meta).unwrap()).unwrap();
    sweep::run(&cfg, &opts).unwrap();
    assert!(out.join("summary.parquet").exists());
}

#[test]
fn a_non_finite_loss_stops_training_and_an_adapter_that_does_not_fit_is_never_used() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let cfg = bridge_config(dir.path(), &model, 2);
    let text = std::fs::read_to_string(&cfg).unwrap();
    let cache = dir.path().join("resources");
    let opts = opts_in(dir.path(), &cache);
    let write = |name: &str, t: String| {
        let p = dir.path().join(name);
        std::fs::write(&p, t).unwrap();
        p
    };

    // A learning rate that blows the adapters up after the first step: the
    // second step's loss is not finite, training stops there and keeps
    // epoch 0 (B = 0), so the bridged arm is the raw arm on every item.
    assert!(text.contains("lr = 0.01"));
    let blown = write("blown.toml", text.replace("lr = 0.01", "lr = 1e38"));
    sweep::run(&blown, &opts("blown")).unwrap();
    let qb = &run_json(&dir.path().join("blown"))["resources"]["qb"];
    let stopped = &qb["summary"]["stopped"];
    assert_eq!(stopped["epoch"], 1, "{qb}");
    assert_eq!(stopped["step"], 2, "{qb}");
    assert_eq!(qb["summary"]["best_epoch"], 0, "{qb}");
    assert_eq!(qb["summary"]["curve"].as_array().unwrap().len(), 1, "{qb}");
    let raw = continuations(&dir.path().join("blown"), "kv_augment");
    assert_eq!(raw.len(), 3);
    assert_eq!(continuations(&dir.path().join("blown"), "kv_bridge"), raw);
    // The stop survives the cache.
    sweep::run(&blown, &opts("blown2")).unwrap();
    let again = &run_json(&dir.path().join("blown2"))["resources"]["qb"];
    assert_eq!(again["obtained"], "cached");
    assert_eq!(again["summary"], qb["summary"]);

    // A cached adapter of another rank (rank 2 copied over the rank-4
    // bridge's value, its checksum made to match) is refused by name and
    // rebuilt; so is one recorded for another model.
    let one = write("one.toml", text.replace("epochs = 2", "epochs = 1"));
    let two = write(
        "two.toml",
        text.replace("epochs = 2", "epochs = 1")
            .replace("rank = 4", "rank = 2"),
    );
    sweep::run(&one, &opts("one")).unwrap();
    sweep::run(&two, &opts("two")).unwrap();
    let folder = |out: &str| {
        let hash = run_json(&dir.path().join(out))["resources"]["qb"]["hash"]
            .as_str()
            .unwrap()
            .to_string();
        cache.join(format!("bridge-{hash}"))
    };
    let (f4, f2) = (folder("one"), folder("two"));
    assert_ne!(f4, f2);
    std::fs::copy(f2.join("value.safetensors"), f4.join("value.safetensors")).unwrap();
    let meta_path = f4.join("meta.json");
    let mut meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&meta_path).unwrap()).unwrap();
    meta["value_sha256"] =
        tolerable_driver::resources::store::file_sha256(&f4.join("value.safetensors"))
            .unwrap()
            .into();
    std::fs::write(&meta_path, meta.to_string()).unwrap();
    sweep::run(&one, &opts("rank")).unwrap();
    let qb = &run_json(&dir.path().join("rank"))["resources"]["qb"];
    assert_eq!(qb["obtained"], "rebuilt", "{qb}");
    let why = qb["rejected_cache"].as_str().unwrap();
    assert!(
        why.contains("the receiver needs") && why.contains(", 4]"),
        "{why}"
    );

    let mut meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&meta_path).unwrap()).unwrap();
    meta["model_sha256"] = "0".repeat(64).into();
    std::fs::write(&meta_path, meta.to_string()).unwrap();
    sweep::run(&one, &opts("model")).unwrap();
    let qb = &run_json(&dir.path().join("model"))["resources"]["qb"];
    assert_eq!(qb["obtained"], "rebuilt", "{qb}");
    assert!(
        qb["rejected_cache"]
            .as_str()
            .unwrap()
            .contains("was built for model"),
        "{qb}"
    );
    // The rebuilt copy is used from then on.
    sweep::run(&one, &opts("after")).unwrap();
    assert_eq!(
        run_json(&dir.path().join("after"))["resources"]["qb"]["obtained"],
        "cached"
    );
}

/// A SQuAD v1.1 file of `n` one-question articles (distinct passages and
/// answers), for runs that evaluate and train on the same split.
fn tiny_squad(dir: &Path, n: usize) -> PathBuf {
    let colours = [
        "red", "blue", "green", "amber", "violet", "grey", "white", "black", "olive", "teal",
    ];
    let data: Vec<serde_json::Value> = (0..n)
        .map(|i| {
            let answer = format!("{} {i}", colours[i % colours.len()]);
            serde_json::json!({
                "title": format!("Article {i}"),
                "paragraphs": [{
                    "context": format!("The door of house {i} was painted {answer} in spring. Nobody else on the street chose it."),
                    "qas": [{
                        "id": format!("q{i}"),
                        "question": format!("What colour was the door of house {i}?"),
                        "answers": [{ "text": answer, "answer_start": 0 }],
                    }],
                }],
            })
        })
        .collect();
    let p = dir.join("train-tiny.json");
    std::fs::write(
        &p,
        serde_json::json!({ "version": "1.1", "data": data }).to_string(),
    )
    .unwrap();
    p
}

#[test]
fn a_bridge_never_trains_on_an_evaluation_item_of_the_same_split() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let squad = tiny_squad(dir.path(), 8);
    let text = std::fs::read_to_string(bridge_config(dir.path(), &model, 1))
        .unwrap()
        .replace("source = \"synthetic\"", "source = \"squad_train\"")
        .replace("data = \"synthetic\"", "data = \"squad_train\"")
        .replace(
            "train_items = 4\nslice_items = 2",
            "train_items = 4\nslice_items = 1",
        );
    let cfg = dir.path().join("same-split.toml");
    std::fs::write(&cfg, &text).unwrap();
    let opts = |out: &str| SweepOptions {
        out: Some(dir.path().join(out)),
        resource_root: Some(dir.path().join("resources")),
        data: BTreeMap::from([("squad_train".to_string(), squad.clone())]),
        ..Default::default()
    };
    sweep::run(&cfg, &opts("a")).unwrap();
    let out = dir.path().join("a");
    let eval: std::collections::BTreeSet<String> =
        continuations(&out, "kv_augment").into_keys().collect();
    assert_eq!(eval.len(), 3);
    let trained: Vec<String> = run_json(&out)["resources"]["qb"]["training_items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    assert_eq!(trained.len(), 5);
    assert!(
        trained.iter().all(|id| !eval.contains(id)),
        "{trained:?} vs {eval:?}"
    );
    // Six training items asked of the five that are not evaluated: named,
    // before any record.
    let bad = dir.path().join("too-many.toml");
    std::fs::write(&bad, text.replace("train_items = 4\n", "train_items = 5\n")).unwrap();
    let e = sweep::run(&bad, &opts("b")).unwrap_err().to_string();
    assert!(
        e.contains("[resources.qb]") && e.contains("training items"),
        "{e}"
    );
    assert!(!dir.path().join("b/run.json").exists());
    // A bridge asked to train on the evaluation split itself: refused,
    // naming the field, before any record.
    let dev = dir.path().join("dev.toml");
    std::fs::write(
        &dev,
        text.replace("data = \"squad_train\"", "data = \"squad_dev\""),
    )
    .unwrap();
    let mut o = opts("c");
    o.data.insert("squad_dev".to_string(), squad.clone());
    let e = sweep::run(&dev, &o).unwrap_err().to_string();
    assert!(
        e.contains("[resources.qb].data") && e.contains("never on the evaluation split"),
        "{e}"
    );
    assert!(!dir.path().join("c/run.json").exists());
}

fn router_config(dir: &Path, model: &Path, extra: &str) -> PathBuf {
    let text = format!(
        r#"
[run]
name = "tiny-router"
model = "{}"
seed = 5
new_tokens = 3
cell_items = 3

[data]
source = "synthetic"
n = 6

[resources.router]
kind = "bridge"
targets = "router"
rank = 4
train_items = 6
slice_items = 2
epochs = 2
lr = 0.05
data = "synthetic"
{extra}
arm = {{ inject = [{{ carrier = "h", layers = 1, positions = "fact_region", source = {{ pool = {{ n = 3, router = "trained" }} }}, mechanism = "add", alpha = 2.0 }}] }}

[[arms]]
name = "pool_uniform"
inject = {{ carrier = "h", layers = 1, positions = "fact_region", source = {{ pool = {{ n = 3, router = "uniform" }} }}, mechanism = "add", alpha = 2.0 }}

[[arms]]
name = "routed"
bridge = {{ resource = "router" }}
inject = {{ carrier = "h", layers = 1, positions = "fact_region", source = {{ pool = {{ n = 3, router = "trained" }} }}, mechanism = "add", alpha = 2.0 }}

[[arms]]
name = "routed_init"
bridge = {{ resource = "router", init = true }}
expect = {{ arm = "pool_uniform" }}
inject = {{ carrier = "h", layers = 1, positions = "fact_region", source = {{ pool = {{ n = 3, router = "trained" }} }}, mechanism = "add", alpha = 2.0 }}

[[arms]]
name = "routed_mismatch"
bridge = {{ resource = "router" }}
inject = {{ carrier = "h", layers = 1, positions = "fact_region", source = {{ pool = {{ n = 3, router = "trained", members = "distractors_only" }} }}, mechanism = "add", alpha = 2.0 }}
"#,
        model.display()
    );
    let p = dir.join("router.toml");
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn a_trained_router_learns_its_pool_weights_and_starts_as_the_uniform_router() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let cfg = router_config(dir.path(), &model, "");
    let cache = dir.path().join("resources");
    let opts = opts_in(dir.path(), &cache);
    sweep::run(&cfg, &opts("a")).unwrap();
    let out = dir.path().join("a");
    let r = &run_json(&out)["resources"]["router"];
    assert_eq!(r["obtained"], "built", "{r}");
    let curve = r["summary"]["curve"].as_array().unwrap();
    assert_eq!(curve.len(), 3, "{r}");
    assert!(curve[1]["train_loss"].as_f64().unwrap().is_finite());
    // The zero-init gate: before any step the router is the uniform one,
    // bit for bit, on every item.
    assert!(gated_rows_exact(&out, &["routed_init"]) > 0);
    // The trained maps are not the initial ones (W_q moved off zero), and
    // they survive the cache: a second run loads them and writes the same
    // continuations.
    let folder = cache.join(format!("bridge-{}", r["hash"].as_str().unwrap()));
    let t =
        candle_core::safetensors::load(folder.join("value.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    let wq = t["router.trained.1.wq"]
        .abs()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    // The file keeps the trained maps only; the initial ones (query map
    // zero, key map from the seed) are derived on load, checked against
    // the initial key map's stored sum.
    assert!(!t.contains_key("router.init.1.wq"), "{:?}", t.keys());
    assert!(t.contains_key("router.init_sum.1.wk"), "{:?}", t.keys());
    // Training lowered the slice loss (first-token cross-entropy), and the
    // kept maps are those of a trained epoch.
    let best = r["summary"]["best_epoch"].as_u64().unwrap() as usize;
    assert!(best > 0, "{r}");
    assert!(
        curve[best]["slice_loss"].as_f64().unwrap() < curve[0]["slice_loss"].as_f64().unwrap(),
        "{r}"
    );
    assert!(wq > 0.0);
    sweep::run(&cfg, &opts("b")).unwrap();
    assert_eq!(
        run_json(&dir.path().join("b"))["resources"]["router"]["obtained"],
        "cached"
    );
    for a in ["routed", "routed_mismatch", "routed_init"] {
        assert_eq!(
            continuations(&out, a),
            continuations(&dir.path().join("b"), a),
            "{a}"
        );
    }
    // The zero-init gate holds on the derived initial maps too (this shows
    // the derived query map is zero; with it every key map gives the
    // uniform router, so the key map's derivation is the unit test's
    // sum check to guard).
    assert!(gated_rows_exact(&dir.path().join("b"), &["routed_init"]) > 0);

    // Bad input, named before any work.
    let text = std::fs::read_to_string(&cfg).unwrap();
    for (from, to, want) in [
        // A trained pool without its bridge.
        ("bridge = { resource = \"router\" }\ninject", "inject", "a trained router reads a bridge"),
        // A router bridge on the KV carrier.
        ("arm = { inject = [{ carrier = \"h\", layers = 1", "arm = { inject = [{ carrier = \"kv\", layers = 1", "activation carrier"),
        // A router in mini-batches.
        ("lr = 0.05", "lr = 0.05\nbatch = 2", "a router trains one example a step"),
        // A router at two layers.
        ("arm = { inject = [{ carrier = \"h\", layers = 1,", "arm = { inject = [{ carrier = \"h\", layers = [0, 1],", "one layer"),
        // A router bridge whose arm routes uniformly.
        ("source = { pool = { n = 3, router = \"trained\" } }, mechanism = \"add\", alpha = 2.0 }] }", "source = { pool = { n = 3, router = \"uniform\" } }, mechanism = \"add\", alpha = 2.0 }] }", "trains the pool's router"),
        // An evaluation arm at another layer than the router's.
        (
            "\ninject = { carrier = \"h\", layers = 1, positions = \"fact_region\", source = { pool = { n = 3, router = \"trained\" } }",
            "\ninject = { carrier = \"h\", layers = 0, positions = \"fact_region\", source = { pool = { n = 3, router = \"trained\" } }",
            "was trained at",
        ),
        // An evaluation arm that replaces where the router was trained adding.
        (
            "router = \"trained\" } }, mechanism = \"add\", alpha = 2.0 }\n",
            "router = \"trained\" } }, mechanism = \"replace\" }\n",
            "adding to the masked receiver",
        ),
        // A perturbed training injection.
        (
            "mechanism = \"add\", alpha = 2.0 }] }",
            "mechanism = \"add\", alpha = 2.0, perturb = { kind = \"cosine_noise\", target_cosine = 0.99 } }] }",
            "as they are",
        ),
        // Adapters where the pool wants a router.
        ("targets = \"router\"", "targets = \"q\"", "targets"),
    ] {
        assert!(text.contains(from), "{from}");
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, text.replacen(from, to, 1)).unwrap();
        let e = sweep::run(&bad, &opts("bad")).unwrap_err().to_string();
        assert!(e.contains(want), "{want}: {e}");
        assert!(!dir.path().join("bad/run.json").exists());
    }
}

fn sender_pool_config(dir: &Path, model: &Path) -> PathBuf {
    let pool = |n: usize, members: &str| {
        format!(
            "inject = {{ carrier = \"kv\", positions = \"passage\", source = {{ pool = {{ n = {n}, router = \"uniform\", members = \"{members}\" }} }}, mechanism = \"append\" }}"
        )
    };
    let train_arm = format!(
        "{}]",
        pool(4, "with_answer").replacen("inject = ", "inject = [", 1)
    );
    let text = format!(
        r#"
[run]
name = "tiny-sender-pool"
model = "{}"
seed = 5
new_tokens = 3
cell_items = 3

[data]
source = "synthetic"
n = 6

[resources.pool4]
kind = "bridge"
targets = "q"
rank = 4
train_items = 6
slice_items = 2
epochs = 1
lr = 0.01
data = "synthetic"
arm = {{ {} }}

[[arms]]
name = "kv_augment"
inject = {{ carrier = "kv", positions = "passage", source = "holder", mechanism = "append" }}

# A pool of one answer holder is the KV augmentation arm, bit for bit.
[[arms]]
name = "pool_one"
expect = {{ arm = "kv_augment" }}
{}

[[arms]]
name = "pool_raw"
{}
grid = {{ "source.pool.n" = [2, 4] }}

[[arms]]
name = "pool_bridged"
bridge = {{ resource = "pool4" }}
{}
grid = {{ "source.pool.n" = [1, 2, 4] }}

[[arms]]
name = "pool_bridged_init"
bridge = {{ resource = "pool4", init = true }}
expect = {{ arm = "pool_raw@source.pool.n=4" }}
{}

[[arms]]
name = "pool_bridged_masked"
bridge = {{ resource = "pool4" }}
{}

[[arms]]
name = "pool_bridged_distractors"
bridge = {{ resource = "pool4" }}
{}
"#,
        model.display(),
        train_arm,
        pool(1, "with_answer"),
        pool(2, "with_answer"),
        pool(1, "with_answer"),
        pool(4, "with_answer"),
        pool(4, "answer_masked"),
        pool(4, "distractors_only"),
    );
    let p = dir.join("sender-pool.toml");
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn a_sender_pool_appends_every_holder_and_its_bridge_trains_at_four() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let cfg = sender_pool_config(dir.path(), &model);
    let opts = |out: &str| SweepOptions {
        out: Some(dir.path().join(out)),
        resource_root: Some(dir.path().join("resources")),
        ..Default::default()
    };
    sweep::run(&cfg, &opts("a")).unwrap();
    let out = dir.path().join("a");
    let r = &run_json(&out)["resources"]["pool4"];
    assert_eq!(r["obtained"], "built", "{r}");
    // The gates: a pool of one is KV augmentation; the bridge before
    // training is the raw pool of four.
    assert_eq!(
        gated_rows_exact(&out, &["pool_one", "pool_bridged_init"]),
        12
    );
    // With bridges batched the gates hold too (a gated arm decodes in its
    // anchor's batch, or both alone where their layouts differ), with fewer
    // batches and the same continuations.
    let text = std::fs::read_to_string(&cfg).unwrap();
    let together = dir.path().join("together.toml");
    std::fs::write(
        &together,
        text.replacen("cell_items = 3", "cell_items = 3\nbatch_bridges = true", 1),
    )
    .unwrap();
    sweep::run(&together, &opts("b")).unwrap();
    let b = dir.path().join("b");
    assert_eq!(gated_rows_exact(&b, &["pool_one", "pool_bridged_init"]), 12);
    let batches = |d: &Path| {
        run_json(d)["invocations"][0]["decode_batches"]
            .as_u64()
            .unwrap()
    };
    assert!(
        batches(&b) < batches(&out),
        "{} against {}",
        batches(&b),
        batches(&out)
    );
    for a in [
        "pool_bridged@source.pool.n=4",
        "pool_one",
        "pool_bridged_init",
    ] {
        assert_eq!(continuations(&b, a), continuations(&out, a), "{a}");
    }
    for a in [
        "pool_raw@source.pool.n=4",
        "pool_bridged@source.pool.n=1",
        "pool_bridged@source.pool.n=4",
        "pool_bridged_masked",
        "pool_bridged_distractors",
    ] {
        assert_eq!(continuations(&out, a).len(), 6, "{a}");
    }
    // An appended pool is undirected and appends passages: other routers
    // and positions are named before any work.
    let text = std::fs::read_to_string(&cfg).unwrap();
    for (from, to, want) in [
        (
            "n = 1, router = \"uniform\"",
            "n = 1, router = \"oracle\"",
            "undirected",
        ),
        (
            "positions = \"passage\", source = { pool = { n = 1",
            "positions = \"fact_region\", source = { pool = { n = 1",
            "contiguous span",
        ),
        (
            "positions = \"passage\", source = { pool = { n = 1",
            "positions = \"all\", source = { pool = { n = 1",
            "every member's passage",
        ),
    ] {
        assert!(text.contains(from), "{from}");
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, text.replacen(from, to, 1)).unwrap();
        let e = sweep::run(&bad, &opts("bad")).unwrap_err().to_string();
        assert!(e.contains(want), "{want}: {e}");
        assert!(!dir.path().join("bad/run.json").exists());
    }
}

/// A cross-family config: a receiver (the tiny Qwen2-style model) and a
/// holder of another family, depth, width and kv geometry (a Llama-style
/// model of 5 layers, width 48, one kv head), each through a projection
/// fitted on synthetic training passages; the identity sanity projection
/// (the receiver fitted to itself) beside the unprojected receiver holder.
fn cross_config(dir: &Path, model: &Path, holder: &Path, train_items: usize) -> PathBuf {
    let text = format!(
        r#"
[run]
name = "tiny-cross"
model = "{m}"
seed = 5
new_tokens = 4
cell_items = 4

[data]
source = "synthetic"
n = 4

[resources.cross]
kind = "cross_projection"
holder = "{h}"
fit = "least_squares"
train_items = {train_items}
data = "synthetic"

[resources.cross_svd]
kind = "cross_projection"
holder = "{h}"
fit = "svd"
rank = 8
train_items = {train_items}
data = "synthetic"

[resources.itself]
kind = "cross_projection"
holder = "{m}"
fit = "least_squares"
ridge = 1e-7
train_items = {train_items}
data = "synthetic"

[[arms]]
name = "floor"
base = "masked"

[[arms]]
name = "native"
base = "full"

[[arms]]
name = "kv_augment"
inject = {{ carrier = "kv", positions = "passage", source = "holder", mechanism = "append" }}

[[arms]]
name = "kv_augment_cross"
controls = ["floor"]
holder = {{ model = "{h}", projection = "cross" }}
inject = {{ carrier = "kv", positions = "passage", source = "holder", mechanism = "append" }}

[[arms]]
name = "kv_augment_identity"
holder = {{ model = "{m}", projection = "itself" }}
inject = {{ carrier = "kv", positions = "passage", source = "holder", mechanism = "append" }}

[[arms]]
name = "act_replace"
inject = {{ carrier = "h", positions = "fact_region", source = "holder" }}
grid = {{ layers = [1, 2] }}

[[arms]]
name = "act_replace_cross"
controls = ["floor", "act_mismatch"]
holder = {{ model = "{h}", projection = "cross" }}
inject = {{ carrier = "h", positions = "fact_region", source = "holder" }}
grid = {{ layers = [1, 2] }}

[[arms]]
name = "act_replace_cross_svd"
holder = {{ model = "{h}", projection = "cross_svd" }}
inject = {{ carrier = "h", layers = 1, positions = "fact_region", source = "holder" }}

[[arms]]
name = "act_replace_identity"
holder = {{ model = "{m}", projection = "itself" }}
inject = {{ carrier = "h", positions = "fact_region", source = "holder" }}
grid = {{ layers = [1, 2] }}

[[arms]]
name = "act_mismatch"
inject = {{ carrier = "h", positions = "fact_region", source = "other_item" }}
grid = {{ layers = [1, 2] }}

[[arms]]
name = "act_mismatch_cross"
holder = {{ model = "{h}", projection = "cross" }}
inject = {{ carrier = "h", layers = 1, positions = "fact_region", source = "other_item" }}

[[arms]]
name = "kv_augment_mismatch_cross"
holder = {{ model = "{h}", projection = "cross" }}
inject = {{ carrier = "kv", positions = "passage", source = "other_item", mechanism = "append" }}
"#,
        m = model.display(),
        h = holder.display()
    );
    let p = dir.join("cross.toml");
    std::fs::write(&p, text).unwrap();
    p
}

fn foreign_holder(dir: &Path) -> PathBuf {
    let p = dir.join("holder.gguf");
    write_gguf(
        &TinySpec {
            arch: tolerable_runtime::Arch::Llama,
            n_layers: 5,
            d_model: 48,
            n_heads: 3,
            n_kv_heads: 1,
            d_ffn: 96,
            context_length: 1024,
            seed: 23,
            ..TinySpec::default()
        },
        &p,
    )
    .unwrap();
    p
}

#[test]
fn cross_family_holders_run_through_cached_projections_and_the_identity_reaches_its_reference() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let holder = foreign_holder(dir.path());
    let cfg = cross_config(dir.path(), &model, &holder, 6);
    let cache = dir.path().join("resources");
    let opts = opts_in(dir.path(), &cache);
    let read = |out: &str| -> serde_json::Value {
        serde_json::from_str(
            &std::fs::read_to_string(dir.path().join(out).join("run.json")).unwrap(),
        )
        .unwrap()
    };
    let plan = sweep::dry_run(&cfg, &opts("dry")).unwrap();
    assert!(plan.contains("cross_projection from"), "{plan}");
    sweep::run(&cfg, &opts("a")).unwrap();
    let meta = read("a");
    for r in ["cross", "cross_svd", "itself"] {
        assert_eq!(meta["resources"][r]["obtained"], "built", "{r}");
    }
    assert_eq!(
        meta["holders"][holder.to_str().unwrap()]["config"]["n_layers"],
        5
    );
    let (names, all) = rows(&dir.path().join("a/items/cell-00000.parquet"));
    let arm = col(&names, &all, "arm");
    let fid = col(&names, &all, "fidelity_cosine");
    let cont = col(&names, &all, "continuation_ids");
    let res = col(&names, &all, "resources");
    let of = |name: &str| -> Vec<usize> {
        arm.iter()
            .enumerate()
            .filter(|(_, a)| *a == name)
            .map(|(i, _)| i)
            .collect()
    };
    let f = |i: usize| -> f64 { fid[i].parse().unwrap_or_else(|_| panic!("{}", fid[i])) };
    for name in [
        "kv_augment_cross",
        "act_replace_cross@layers=1",
        "act_replace_cross_svd",
        "kv_augment_identity",
        "act_replace_identity@layers=2",
        "act_mismatch_cross",
    ] {
        let rows = of(name);
        assert_eq!(rows.len(), 4, "{name}");
        for &i in &rows {
            assert!(f(i).is_finite() && f(i) <= 1.0 + 1e-6, "{name}: {}", f(i));
            assert!(res[i].contains('='), "{name}: {}", res[i]);
        }
    }
    // The identity sanity arm: the receiver's own states through a
    // projection fitted to itself land on the native states, and decode as
    // the unprojected holder arm does.
    for (ident, reference) in [
        ("act_replace_identity@layers=1", "act_replace@layers=1"),
        ("act_replace_identity@layers=2", "act_replace@layers=2"),
        ("kv_augment_identity", "kv_augment"),
    ] {
        let (a, b) = (of(ident), of(reference));
        for (&i, &j) in a.iter().zip(&b) {
            assert!(f(i) > 0.999, "{ident}: fidelity {}", f(i));
            assert_eq!(cont[i], cont[j], "{ident} against {reference}");
        }
    }
    // Appended from another item's passage through the projection.
    let m = of("kv_augment_mismatch_cross");
    assert_eq!(m.len(), 4);
    assert!(
        m.iter().all(|&i| res[i].contains("cross=")),
        "{}",
        res[m[0]]
    );
    // The mismatch control through the cross holder reads another item's
    // passage: its injected states are further from the native ones.
    for (&i, &j) in of("act_mismatch_cross")
        .iter()
        .zip(&of("act_replace_cross@layers=1"))
    {
        assert!(f(i) < f(j), "mismatch {} against {}", f(i), f(j));
    }
    // The foreign holder's projected states are not the native ones.
    let mean = |name: &str| of(name).iter().map(|&i| f(i)).sum::<f64>() / 4.0;
    assert!(mean("act_replace_cross@layers=1") < 0.999);
    assert!(mean("act_replace_cross@layers=1") > mean("act_replace_cross_svd") - 1e-9);

    // A second run loads every projection from the cache and decodes the same.
    sweep::run(&cfg, &opts("b")).unwrap();
    let meta2 = read("b");
    for r in ["cross", "cross_svd", "itself"] {
        assert_eq!(meta2["resources"][r]["obtained"], "cached", "{r}");
        assert_eq!(meta2["resources"][r]["hash"], meta["resources"][r]["hash"]);
    }
    let (n2, r2) = rows(&dir.path().join("b/items/cell-00000.parquet"));
    assert_eq!(col(&n2, &r2, "continuation_ids"), cont);

    // In run `a` the SVD projection solved the least-squares one's normal
    // equations (shared within the invocation); fitted alone, from its own
    // reads of the passages, it maps every state to the same bits.
    let text = std::fs::read_to_string(&cfg).unwrap();
    let keep = [
        "[run]",
        "[data]",
        "[resources.cross_svd]",
        "name = \"floor\"",
        "name = \"native\"",
        "name = \"act_replace_cross_svd\"",
    ];
    let blocks: Vec<&str> = text
        .split("\n\n")
        .map(str::trim)
        .filter(|b| {
            keep.iter()
                .any(|k| b.starts_with(k) || b.contains(&format!("\n{k}\n")))
        })
        .collect();
    assert_eq!(blocks.len(), keep.len(), "{blocks:?}");
    let alone = dir.path().join("svd-alone.toml");
    std::fs::write(&alone, blocks.join("\n\n") + "\n").unwrap();
    let fresh = SweepOptions {
        out: Some(dir.path().join("svd-alone")),
        resource_root: Some(dir.path().join("resources-alone")),
        ..Default::default()
    };
    sweep::run(&alone, &fresh).unwrap();
    let meta3 = read("svd-alone");
    assert_eq!(meta3["resources"]["cross_svd"]["obtained"], "built");
    assert_eq!(
        meta3["resources"]["cross_svd"]["hash"],
        meta["resources"]["cross_svd"]["hash"]
    );
    let (n3, r3) = rows(&dir.path().join("svd-alone/items/cell-00000.parquet"));
    let (arm3, fid3, cont3) = (
        col(&n3, &r3, "arm"),
        col(&n3, &r3, "fidelity_cosine"),
        col(&n3, &r3, "continuation_ids"),
    );
    let alone_rows: Vec<usize> = (0..arm3.len())
        .filter(|&i| arm3[i] == "act_replace_cross_svd")
        .collect();
    let shared_rows = of("act_replace_cross_svd");
    assert_eq!(alone_rows.len(), shared_rows.len());
    for (&i, &j) in alone_rows.iter().zip(&shared_rows) {
        assert_eq!(fid3[i], fid[j], "fidelity, alone against shared");
        assert_eq!(cont3[i], cont[j], "continuation, alone against shared");
    }
}

#[test]
fn cross_family_bad_input_is_named_before_any_eval_item() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let holder = foreign_holder(dir.path());
    let run = |cfg: &Path, out: &str| {
        let e = sweep::run(
            cfg,
            &SweepOptions {
                out: Some(dir.path().join(out)),
                resource_root: Some(dir.path().join("resources")),
                ..Default::default()
            },
        )
        .unwrap_err()
        .to_string();
        // No record, no run.json: nothing of an eval item was written.
        assert!(!dir.path().join(out).join("run.json").exists(), "{e}");
        assert!(!sweep::cell_path(&dir.path().join(out), 0).exists(), "{e}");
        e
    };
    // A projection fitted on fewer rows than its rank (48: the holder's
    // width): the fact region of one training passage.
    let cfg = cross_config(dir.path(), &model, &holder, 1);
    let text = std::fs::read_to_string(&cfg).unwrap().replace(
        "train_items = 1\n",
        "train_items = 1\npositions = \"fact_region\"\n",
    );
    std::fs::write(&cfg, text).unwrap();
    let e = run(&cfg, "few");
    assert!(
        e.contains("[resources.cross].train_items") && e.contains("rank 48"),
        "{e}"
    );
    // The dry run says so too.
    let e = sweep::dry_run(
        &cfg,
        &SweepOptions {
            resource_root: Some(dir.path().join("resources")),
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("[resources.cross].train_items"), "{e}");
    // A holder whose cache shape differs, without a projection; a projection
    // fitted on another holder; a projection that is not declared.
    let write = |arm_holder: &str| {
        let t = format!(
            "[run]\nname = \"b\"\nmodel = \"{m}\"\n[data]\nsource = \"synthetic\"\nn = 2\n[resources.cross]\nkind = \"cross_projection\"\nholder = \"{h}\"\nfit = \"least_squares\"\ndata = \"synthetic\"\n[[arms]]\nname = \"a\"\nholder = {arm_holder}\ninject = {{ carrier = \"kv\", positions = \"passage\", source = \"holder\", mechanism = \"append\" }}\n",
            m = model.display(),
            h = holder.display()
        );
        let p = dir.path().join("bad.toml");
        std::fs::write(&p, t).unwrap();
        p
    };
    let e = run(
        &write(&format!("{{ model = \"{}\" }}", holder.display())),
        "shape",
    );
    assert!(
        e.contains("arms[0].holder.projection") && e.contains("5 layers"),
        "{e}"
    );
    let e = run(
        &write(&format!(
            "{{ model = \"{}\", projection = \"cross\" }}",
            model.display()
        )),
        "other",
    );
    assert!(
        e.contains("arms[0].holder.model") && e.contains("fitted on holder"),
        "{e}"
    );
    let e = run(
        &write(&format!(
            "{{ model = \"{}\", projection = \"nope\" }}",
            holder.display()
        )),
        "undeclared",
    );
    assert!(
        e.contains("arms[0].holder.projection") && e.contains("[resources.nope]"),
        "{e}"
    );
}

#[test]
fn an_answer_disjoint_bridge_trains_on_no_evaluation_answer() {
    use tolerable_driver::resources::{EvalSet, ResourceKind, TrainCx};
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let ck = tolerable_runtime::Checkpoint::load_gguf(
        "tiny",
        &model,
        None,
        tolerable_runtime::Precision::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let spec: tolerable_driver::resources::BridgeSpec = toml::from_str(
        "targets = \"q\"\ntrain_items = 6\nslice_items = 2\ndata = \"synthetic\"\nanswer_disjoint = true\narm = { inject = [] }\n",
    )
    .unwrap();
    // The evaluation answers: those of some of the synthetic training candidates.
    let candidates = tolerable_probe::synthetic::generate(8 * 4, 0x7EA1_0000_0000_0000);
    let mut eval = EvalSet::default();
    for c in candidates.iter().step_by(2) {
        eval.answers.extend(
            c.answers
                .iter()
                .map(|a| tolerable_probe::score::normalize(a)),
        );
    }
    let split = tolerable_probe::SplitOptions::default();
    let data = std::collections::BTreeMap::new();
    let cx = TrainCx {
        tokenizer: &ck.tokenizer,
        split: &split,
        data: &data,
        eval: &eval,
        field: "[resources.b]".into(),
        receiver: ck.model.config(),
    };
    let items = spec.training_items(&cx).unwrap();
    assert_eq!(items.len(), 8);
    for it in &items {
        for a in &it.item.answers {
            assert!(
                !eval.answers.contains(&tolerable_probe::score::normalize(a)),
                "{a}"
            );
        }
    }
    // Without the split the same sample may share answers; with it the
    // content hash's training items differ.
    let plain: tolerable_driver::resources::BridgeSpec =
        toml::from_str("targets = \"q\"\ntrain_items = 6\nslice_items = 2\ndata = \"synthetic\"\narm = { inject = [] }\n").unwrap();
    let p = plain.training_items(&cx).unwrap();
    assert!(p.iter().any(|it| it
        .item
        .answers
        .iter()
        .any(|a| eval.answers.contains(&tolerable_probe::score::normalize(a)))));
    // What run.json records of each: the disjoint set's gold answers miss
    // every evaluation answer, the plain one's do not; passages and
    // questions are counted where a whole-word answer occurs in them.
    let (m, mp) = (eval.answer_mentions(&items), eval.answer_mentions(&p));
    assert_eq!((m.items, m.gold), (8, 0));
    assert!(mp.gold > 0, "{mp:?}");
    let by_hand = |its: &[tolerable_probe::SplitItem]| {
        its.iter()
            .filter(|it| {
                let t = format!(" {} ", tolerable_probe::score::normalize(&it.item.context));
                eval.answers
                    .iter()
                    .any(|a| !a.is_empty() && t.contains(&format!(" {a} ")))
            })
            .count()
    };
    assert_eq!(m.passages, by_hand(&items));
    assert_eq!(mp.passages, by_hand(&p));
    assert!(mp.passages >= mp.gold.min(1), "{mp:?}");

    // The strict split (`answer_free`): let a word of one disjoint training
    // passage, absent from another's, be an evaluation answer too; the
    // disjoint set still holds a passage that mentions it, the answer-free
    // set holds none, nor any gold answer or question that does.
    let norm = |t: &str| tolerable_probe::score::normalize(t);
    let other = format!(" {} ", norm(&items[1].item.context));
    let word = norm(&items[0].item.context)
        .split(' ')
        .find(|w| !other.contains(&format!(" {w} ")))
        .expect("a word of one passage absent from another")
        .to_string();
    let mut eval2 = eval.clone();
    eval2.answers.insert(word.clone());
    let cx2 = TrainCx { eval: &eval2, ..cx };
    let strict: tolerable_driver::resources::BridgeSpec = toml::from_str(
        "targets = \"q\"\ntrain_items = 6\nslice_items = 2\ndata = \"synthetic\"\nanswer_disjoint = true\nanswer_free = true\narm = { inject = [] }\n",
    )
    .unwrap();
    let free = strict.training_items(&cx2).unwrap();
    assert_eq!(free.len(), 8);
    let mf = eval2.answer_mentions(&free);
    assert_eq!(
        (mf.gold, mf.passages, mf.questions),
        (0, 0, 0),
        "{mf:?} ({word})"
    );
    let reaches = eval2.reach_test();
    assert!(free.iter().all(|it| !reaches(&it.item)));
    let md = eval2.answer_mentions(&spec.training_items(&cx2).unwrap());
    assert!(md.passages >= 1, "{md:?} ({word})");
    // The strict flag is part of the spec, so of its content hash; a spec
    // without it serializes as before, so existing bridges keep their hashes.
    assert!(!serde_json::to_string(&spec)
        .unwrap()
        .contains("answer_free"));
    assert_ne!(
        serde_json::to_string(&strict).unwrap(),
        serde_json::to_string(&spec).unwrap()
    );
}

/// A bridge's training examples are kept on disk while its group is being
/// built, the adapter's and the router's alike: a sweep stopped after
/// computing them (here: a bridge could not be saved, a file stands where
/// its folder goes; for the adapters, the second of a group of two, so the
/// first is saved) leaves them in `shared-<hash>/` beside the resources;
/// the next invocation, its training's progress file removed, trains from
/// the examples read back (no file rewritten but one cut off, which is
/// computed again) and gives the first run's bridge bit for bit; the folder
/// is removed once the group's resources are obtained.
#[test]
fn a_stopped_build_leaves_its_training_examples_for_the_next() {
    use std::os::unix::fs::MetadataExt;
    for (which, name) in [("adapter", "qkv"), ("router", "router")] {
        let dir = tempfile::tempdir().unwrap();
        let model = tiny(dir.path());
        let cfg = match which {
            "adapter" => {
                // A second bridge of qb's group (same arm, items and seed),
                // built after it.
                let p = bridge_config(dir.path(), &model, 2);
                let text = std::fs::read_to_string(&p).unwrap();
                let qb =
                    &text[text.find("[resources.qb]").unwrap()..text.find("[[arms]]").unwrap()];
                let qkv = qb
                    .replace("[resources.qb]", "[resources.qkv]")
                    .replace("targets = \"q\"", "targets = \"qkv\"");
                let arm = "[[arms]]\nname = \"kv_bridge_qkv\"\nbridge = { resource = \"qkv\" }\ninject = { carrier = \"kv\", positions = \"passage\", source = \"holder\", mechanism = \"append\" }\n";
                std::fs::write(&p, format!("{text}\n{qkv}\n{arm}")).unwrap();
                p
            }
            _ => router_config(dir.path(), &model, ""),
        };
        let cache = dir.path().join("resources");
        let opts = opts_in(dir.path(), &cache);
        let store = tolerable_driver::resources::store::Store::new(&cache);
        let shared = || store.shared_dirs();
        // Per kept file, its inode and modification time (a rewrite
        // renames a new file in).
        let files = |d: &Path| -> BTreeMap<String, (u64, i64, i64)> {
            std::fs::read_dir(d)
                .unwrap()
                .map(|e| {
                    let e = e.unwrap();
                    let m = e.metadata().unwrap();
                    (
                        e.file_name().to_string_lossy().into_owned(),
                        (m.ino(), m.mtime(), m.mtime_nsec()),
                    )
                })
                .collect()
        };
        sweep::run(&cfg, &opts("a")).unwrap();
        assert!(shared().is_empty(), "{which}: {:?}", shared());
        let a = run_json(&dir.path().join("a"))["resources"][name].clone();
        let hash = a["hash"].as_str().unwrap();
        let folder = cache.join(format!("bridge-{hash}"));
        let progress = cache.join(format!("bridge-{hash}.progress.safetensors"));
        std::fs::remove_dir_all(&folder).unwrap();
        std::fs::write(&folder, b"in the way").unwrap();
        // The adapters' group: qb, built first, is taken out of the cache.
        let qb = (which == "adapter").then(|| {
            let qb = run_json(&dir.path().join("a"))["resources"]["qb"]["hash"].clone();
            let qb = format!("bridge-{}", qb.as_str().unwrap());
            std::fs::remove_dir_all(cache.join(&qb)).unwrap();
            qb
        });
        let e = sweep::run(&cfg, &opts("b")).unwrap_err().to_string();
        assert!(e.contains(&folder.display().to_string()), "{which}: {e}");
        if let Some(qb) = &qb {
            // The group's first bridge was saved; its examples stay for the
            // second's.
            let b = std::fs::read_to_string(dir.path().join("b/run.json"));
            assert!(b.is_err(), "{which}: a run.json after a failed resource");
            let saved: Vec<String> = std::fs::read_dir(&cache)
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| {
                    p.is_dir()
                        && p.file_name()
                            .unwrap()
                            .to_string_lossy()
                            .starts_with("bridge-")
                })
                .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
                .collect();
            assert_eq!(saved, std::slice::from_ref(qb), "{which}");
        }
        let kept = shared();
        assert_eq!(kept.len(), 1, "{which}");
        let before = files(&kept[0]);
        assert!(
            before.len() > 2 && before.keys().all(|n| n.ends_with(".safetensors")),
            "{which}: {before:?}"
        );
        // Stopped again, after training from scratch on the examples read
        // back but one cut off: only that one is written anew.
        assert!(progress.exists(), "{which}");
        std::fs::remove_file(&progress).unwrap();
        let cut = before.keys().next().unwrap().clone();
        std::fs::write(kept[0].join(&cut), b"cut off").unwrap();
        sweep::run(&cfg, &opts("c")).unwrap_err();
        let after = files(&kept[0]);
        assert_eq!(after.len(), before.len(), "{which}");
        for (n, id) in &after {
            assert_eq!(id == &before[n], n != &cut, "{which}: {n}");
        }
        // Unblocked, trained from scratch on the examples read back: the
        // first run's bridge; the folder goes.
        std::fs::remove_file(&progress).unwrap();
        std::fs::remove_file(&folder).unwrap();
        sweep::run(&cfg, &opts("d")).unwrap();
        let d = run_json(&dir.path().join("d"))["resources"][name].clone();
        assert_eq!(d["obtained"], "built", "{which}");
        assert!(d["build_resumed_after_epoch"].is_null(), "{which}: {d}");
        assert_eq!(d["value_sha256"], a["value_sha256"], "{which}");
        assert_eq!(d["summary"], a["summary"], "{which}");
        assert!(shared().is_empty(), "{which}: {:?}", shared());
    }
}
