//! Mode D measurement runs on a tiny model the test writes (its tokenizer
//! is byte-level, so it reads the probe's code corpus): the oracle gate,
//! Mode D's injection path at layer 0 and over the original's own prefix,
//! dirtiness, errors naming the field, recorded skips, records read back,
//! resuming, and the report.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use tolerable_driver::measure::mode_d::{
    self, mode_d_logits, pair_passes, ModeDSpec, PairGeometry, ORACLE_KL_TOLERANCE,
    ORACLE_POSITION_KL_TOLERANCE,
};
use tolerable_driver::measure::{self, Comparison, LogitReference, MeasureConfig, MeasureOptions};
use tolerable_driver::records::{columns, read_parquet, MeasureRow};
use tolerable_probe::code::{pair::CodePairMeta, Archetype, CodePair, Language};
use tolerable_probe::ContextPair;
use tolerable_runtime::{Checkpoint, LogitsAt, Precision};
use tolerable_testkit::tiny::{write_gguf, TinySpec};

fn tiny(dir: &Path) -> PathBuf {
    let p = dir.join("tiny.gguf");
    write_gguf(
        &TinySpec {
            context_length: 2048,
            ..TinySpec::default()
        },
        &p,
    )
    .unwrap();
    p
}

fn config(dir: &Path, model: &Path, measure: &str) -> PathBuf {
    let p = dir.join("mode-d.toml");
    std::fs::write(
        &p,
        format!(
            "[run]\nname = \"tiny-mode-d\"\nmodel = \"{}\"\nseed = 3\n\n[measure]\nkind = \"mode_d\"\n{measure}\n",
            model.display()
        ),
    )
    .unwrap();
    p
}

fn opts(out: &Path) -> MeasureOptions {
    MeasureOptions {
        out: Some(out.to_path_buf()),
        contexts: None,
        layers: None,
        ..MeasureOptions::default()
    }
}

fn rows(path: &Path) -> Vec<MeasureRow> {
    columns::rows(&read_parquet(path).unwrap()).unwrap()
}

fn unit_rows(out: &Path, sub: &str) -> Vec<MeasureRow> {
    let mut v = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(out.join(sub))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .collect();
    files.sort();
    for f in files {
        v.extend(rows(&f));
    }
    v
}

const CALC_PY: &str = "def scale(values, factor):
    result = []
    for value in values:
        result.append(value * factor)
    return result


def total(values):
    acc = 0
    for value in values:
        acc += value
    return acc


def main():
    data = [1, 2, 3, 4]
    scaled = scale(data, 2)
    if total(scaled) > 10:
        print(total(scaled))
    count = len(data)
    count = count + 1
    print(count)


main()
";

// No numeric literal and no arithmetic operator: two archetypes find no site.
const WORDS_PY: &str = "def shout(word):
    loud = word.upper()
    return loud


def greet(name):
    text = shout(name)
    if text:
        print(text)
    return text


def main():
    names = [\"ada\", \"bob\"]
    for name in names:
        greet(name)
    greet(\"eve\")
    print(names)


main()
";

fn corpus_dir(dir: &Path, files: &[(&str, &str)]) -> PathBuf {
    let d = dir.join("corpus");
    std::fs::create_dir_all(&d).unwrap();
    for (name, text) in files {
        std::fs::write(d.join(name), text).unwrap();
    }
    d
}

#[test]
fn mode_d_on_two_corpus_contexts_passes_the_oracle_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let cfg = config(
        dir.path(),
        &model,
        "taus = [0.05, 0.2]\nlayers = \"all\"\ncontexts = \"builtin\"\nselect = [\"py_matrix.py\", \"go_queue.go\"]\nvariants = [\"edit_site\", \"archetype_mean\", \"zero\"]",
    );
    let out = dir.path().join("run");
    let t0 = std::time::Instant::now();
    let o = measure::run(&cfg, &opts(&out)).unwrap();
    eprintln!(
        "tiny Mode D on 2 contexts: {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    assert_eq!((o.units, o.computed, o.skipped), (2, 2, 0));
    assert!(o.summary_written);

    // Provenance.
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("run.json")).unwrap()).unwrap();
    assert_eq!(meta["kind"], "measure");
    assert_eq!(meta["measurement"], "mode_d");
    assert_eq!(meta["gates"]["passed"], true);
    assert!(meta["model"]["sha256"]
        .as_str()
        .is_some_and(|s| s.len() == 64));
    assert_eq!(meta["model"]["config"]["n_layers"], 3);
    assert_eq!(meta["oracle"]["status"], "passed");
    assert_eq!(meta["oracle"]["kl_tolerance"], ORACLE_KL_TOLERANCE);
    assert_eq!(
        meta["oracle"]["position_kl_tolerance"],
        ORACLE_POSITION_KL_TOLERANCE
    );
    assert_eq!(meta["invocations"].as_array().unwrap().len(), 1);
    let n_pairs = meta["corpus"]["pairs"].as_u64().unwrap() as usize;
    assert!(n_pairs >= 8, "{n_pairs} pairs");

    // The oracle gate: agreement 1 and KL at float precision, every pair and layer.
    let oracle = unit_rows(&out, "oracle");
    let pairs: BTreeSet<(String, String)> = oracle
        .iter()
        .map(|r| (r.context.clone().unwrap(), r.archetype.clone().unwrap()))
        .collect();
    assert_eq!(pairs.len(), n_pairs);
    for r in &oracle {
        assert_eq!(r.variant.as_deref(), Some("oracle"));
        match r.metric.as_str() {
            "agreement" => assert_eq!(r.value, 1.0, "{r:?}"),
            "kl_mode_d" | "kl_mode_d_max" => assert!(r.value < ORACLE_KL_TOLERANCE, "{r:?}"),
            "ties" => assert_eq!(r.value, 0.0),
            m => panic!("unexpected oracle metric {m}"),
        }
    }
    assert_eq!(
        oracle.iter().filter(|r| r.metric == "agreement").count(),
        n_pairs * 3
    );

    // Per-pair rows.
    let units = unit_rows(&out, "units");
    for r in units.iter().filter(|r| r.metric == "dirtiness") {
        assert!((0.0..=1.0).contains(&r.value), "{r:?}");
        // Layer 0 is the embedding: the downstream tokens are the same ids.
        if r.layer == Some(0) {
            assert_eq!(r.value, 0.0, "{r:?}");
        }
    }
    assert!(units
        .iter()
        .any(|r| r.metric == "dirtiness" && r.layer == Some(3) && r.value > 0.0));
    for r in units.iter().filter(|r| r.metric == "kl_stale") {
        assert!(r.value > 0.0, "{r:?}");
    }
    for variant in ["edit_site", "archetype_mean"] {
        let n = units
            .iter()
            .filter(|r| r.metric == "agreement" && r.variant.as_deref() == Some(variant))
            .count();
        let skipped = units
            .iter()
            .filter(|r| r.metric == "skipped" && r.variant.as_deref() == Some(variant))
            .count();
        assert_eq!(n + skipped, n_pairs * 3, "{variant}");
    }
    for r in units
        .iter()
        .filter(|r| r.metric == "saving_vs_prefix_reuse")
    {
        // Mode D skips blocks below l for the downstream tokens only.
        assert!(r.value < 1.0, "{r:?}");
        if r.layer == Some(0) {
            assert!(r.value <= 0.0, "{r:?}");
        }
    }
    // The edit-site delta costs one subtraction and one addition per
    // downstream position over the zero variant; where a pure deletion
    // leaves no edited token, also the edited text's first downstream token
    // through the blocks below l.
    let d_model = meta["model"]["config"]["d_model"].as_f64().unwrap();
    let key = |r: &MeasureRow| (r.context.clone().unwrap(), r.archetype.clone().unwrap());
    let geometry = |k: &(String, String), metric: &str| {
        units
            .iter()
            .find(|r| r.measurement == "geometry" && r.metric == metric && key(r) == *k)
            .unwrap()
            .value
    };
    let mut deletions_charged = 0;
    for r in units
        .iter()
        .filter(|r| r.metric == "flops_mode_d" && r.variant.as_deref() == Some("edit_site"))
    {
        let k = key(r);
        let zero = units
            .iter()
            .find(|z| {
                z.metric == "flops_mode_d"
                    && z.variant.as_deref() == Some("zero")
                    && z.layer == r.layer
                    && key(z) == k
            })
            .unwrap();
        let observe = d_model + geometry(&k, "downstream") * d_model;
        let extra = r.value - zero.value;
        if geometry(&k, "edit_span_edited") == 0.0 && r.layer != Some(0) {
            assert!(extra > observe, "{r:?}");
            deletions_charged += 1;
        } else {
            assert_eq!(extra, observe, "{r:?}");
        }
    }
    assert!(deletions_charged > 0, "no pair without an edited token");
    assert_eq!(
        meta["skipped"].as_array().unwrap().len(),
        units.iter().filter(|r| r.measurement == "skip").count()
    );

    // The summary: means, cosines.
    let summary = rows(&out.join("summary.parquet"));
    assert!(summary
        .iter()
        .any(|r| r.metric == "delta_cosine" && r.layer == Some(3) && r.archetype.is_some()));
    assert!(summary
        .iter()
        .any(|r| r.metric == "kl_reduction" && r.archetype.is_none()));

    // Records round-trip.
    let p = dir.path().join("again.parquet");
    measure::write_rows(units.clone(), &p).unwrap();
    assert_eq!(rows(&p), units);

    // The report and its figures.
    let report = tolerable_driver::report::write(&out).unwrap();
    let md = std::fs::read_to_string(&report).unwrap();
    assert!(md.contains("source 000") && md.contains("0.99"), "{md}");
    for f in [
        "dirtiness_vs_layer.png",
        "agreement_vs_layer.png",
        "kl_reduction_vs_layer.png",
        "saving_vs_layer.png",
    ] {
        assert!(out.join("plots").join(f).exists(), "{f}");
    }

    // The interim summary of a finished run is its summary, row for row.
    let (interim, cov) = tolerable_driver::measure::mode_d::interim_summary(&out).unwrap();
    assert!(cov.complete(), "{cov:?}");
    assert_eq!((cov.unit_contexts, cov.measured_pairs), (2, n_pairs));
    assert_eq!(interim, summary);
    // With one context's unit gone (a run stopped in phase 2), it covers the
    // other context alone, says so, and its report is written beside the
    // finished one's, marked interim, without touching it.
    let part = dir.path().join("part");
    for sub in ["oracle", "deltas", "units"] {
        std::fs::create_dir_all(part.join(sub)).unwrap();
        for e in std::fs::read_dir(out.join(sub)).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), part.join(sub).join(e.file_name())).unwrap();
        }
    }
    std::fs::copy(out.join("run.json"), part.join("run.json")).unwrap();
    let gone = part.join("units").join("py_matrix.py.parquet");
    let gone_pairs = meta["pairs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["context"] == "py_matrix.py")
        .count();
    assert!(gone_pairs > 0);
    std::fs::remove_file(&gone).unwrap();
    let (rows_part, cov) = tolerable_driver::measure::mode_d::interim_summary(&part).unwrap();
    assert!(!cov.complete());
    assert_eq!(cov.oracle["status"], "passed so far", "{}", cov.oracle);
    assert_eq!(cov.oracle["pairs_checked"], n_pairs);
    assert_eq!(
        (cov.contexts, cov.unit_contexts, cov.oracle_contexts),
        (2, 1, 2)
    );
    assert_eq!(cov.measured_pairs, n_pairs - gone_pairs);
    let kept_pairs = rows_part
        .iter()
        .find(|r| r.measurement == "stale" && r.metric == "agreement" && r.archetype.is_none())
        .unwrap()
        .n;
    assert_eq!(kept_pairs as usize, n_pairs - gone_pairs);
    assert!(tolerable_driver::report::write(&part)
        .unwrap_err()
        .to_string()
        .contains("--interim"));
    let r = tolerable_driver::measure::report::write_interim(&part).unwrap();
    assert_eq!(r, part.join("report-interim.md"));
    let md = std::fs::read_to_string(&r).unwrap();
    assert!(
        md.contains(&format!(
            "1 of 2 contexts measured ({} of {n_pairs} edit pairs)",
            n_pairs - gone_pairs
        )),
        "{md}"
    );
    assert!(md.contains("oracle gate: passed so far"), "{md}");
    assert!(part
        .join("plots-interim")
        .join("dirtiness_vs_layer.png")
        .exists());
    assert!(!part.join("report.md").exists() && !part.join("plots").exists());

    // A rerun redoes no unit.
    let o2 = measure::run(&cfg, &opts(&out)).unwrap();
    assert_eq!((o2.computed, o2.skipped), (0, 2));
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("run.json")).unwrap()).unwrap();
    assert_eq!(meta["invocations"].as_array().unwrap().len(), 2);
    assert_eq!(rows(&out.join("summary.parquet")), summary);

    // A new machine has the committed files but not the deltas (ignored by
    // git): a rerun computes only the deltas again (bit for bit the first
    // run's), keeps the oracle files as they were, measures no unit again,
    // and writes the same summary (its cosines read the deltas).
    let lost = dir.path().join("lost");
    for sub in ["oracle", "units"] {
        std::fs::create_dir_all(lost.join(sub)).unwrap();
        for e in std::fs::read_dir(out.join(sub)).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), lost.join(sub).join(e.file_name())).unwrap();
        }
    }
    std::fs::copy(out.join("run.json"), lost.join("run.json")).unwrap();
    let bytes_of = |d: &Path| -> BTreeMap<std::ffi::OsString, Vec<u8>> {
        std::fs::read_dir(d)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (e.file_name(), std::fs::read(e.path()).unwrap())
            })
            .collect()
    };
    // One oracle row marked (a smaller KL, still inside the gate): a rerun
    // that ran the oracle again would write the true value back.
    let marked = lost.join("oracle").join("go_queue.go.parquet");
    let mut oracle_rows = rows(&marked);
    let k = oracle_rows
        .iter()
        .position(|r| r.metric == "kl_mode_d")
        .unwrap();
    oracle_rows[k].value *= 0.5;
    measure::write_rows(oracle_rows.clone(), &marked).unwrap();
    let oracle_files = bytes_of(&lost.join("oracle"));
    let o3 = measure::run(&cfg, &opts(&lost)).unwrap();
    assert_eq!((o3.computed, o3.skipped), (0, 2));
    assert_eq!(bytes_of(&lost.join("oracle")), oracle_files);
    assert_eq!(rows(&marked), oracle_rows);
    let tensors = |p: &Path| -> BTreeMap<String, Vec<f32>> {
        candle_core::safetensors::load(p, &candle_core::Device::Cpu)
            .unwrap()
            .into_iter()
            .map(|(k, t)| (k, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
            .collect()
    };
    let delta_files = bytes_of(&out.join("deltas"));
    assert_eq!(delta_files.len(), 2);
    for name in delta_files.keys() {
        let (a, b) = (
            tensors(&out.join("deltas").join(name)),
            tensors(&lost.join("deltas").join(name)),
        );
        assert!(!a.is_empty());
        assert_eq!(a, b, "{name:?}");
    }
    let cosines = |rows: Vec<MeasureRow>| -> Vec<MeasureRow> {
        rows.into_iter()
            .filter(|r| r.metric == "delta_cosine")
            .collect()
    };
    let cos = cosines(summary.clone());
    assert!(!cos.is_empty());
    assert_eq!(cosines(rows(&lost.join("summary.parquet"))), cos);

    // An oracle file that records one disagreement that is not a tie, or a
    // mean KL above the tolerance (here written over by hand), is refused on
    // the next invocation by the gate's own rule: the gate is recorded as
    // failed and nothing already written is touched.
    let oracle_dir = out.join("oracle");
    let first = std::fs::read_dir(&oracle_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .min()
        .unwrap();
    let original = rows(&first);
    let summary_before = std::fs::read(out.join("summary.parquet")).unwrap();
    let refused = |tamper: &dyn Fn(&mut MeasureRow), metric: &str| {
        let mut bad = original.clone();
        let k = bad.iter().position(|r| r.metric == metric).unwrap();
        tamper(&mut bad[k]);
        measure::write_rows(bad, &first).unwrap();
        let e = measure::run(&cfg, &opts(&out)).unwrap_err().to_string();
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("run.json")).unwrap()).unwrap();
        assert_eq!(meta["oracle"]["status"], "failed");
        assert!(!meta["oracle"]["failure"].is_null(), "{}", meta["oracle"]);
        assert_eq!(
            std::fs::read(out.join("summary.parquet")).unwrap(),
            summary_before
        );
        assert_eq!(unit_rows(&out, "units"), units);
        e
    };
    let e = refused(&|r| r.value = (r.n as f64 - 1.0) / r.n as f64, "agreement");
    assert!(
        e.contains("fails the gate") && e.contains("(0 ties)"),
        "{e}"
    );
    let e = refused(&|r| r.value = 0.5, "kl_mode_d");
    assert!(
        e.contains("fails the gate") && e.contains("5.000e-1"),
        "{e}"
    );
    // A file that lost a row is refused the same way, and says which.
    let mut short = original.clone();
    let k = short.iter().position(|r| r.metric == "ties").unwrap();
    let lost = short.remove(k);
    measure::write_rows(short, &first).unwrap();
    let e = measure::run(&cfg, &opts(&out)).unwrap_err().to_string();
    assert!(
        e.contains(&format!(
            "lacks its `ties` row at layer {}",
            lost.layer.unwrap()
        )),
        "{e}"
    );
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("run.json")).unwrap()).unwrap();
    assert_eq!(meta["oracle"]["status"], "failed");
    assert!(meta["oracle"]["failure"]
        .as_str()
        .is_some_and(|f| f.contains("lacks its `ties` row")));
    // Restored, the files pass again and nothing is recomputed.
    measure::write_rows(original, &first).unwrap();
    let o3 = measure::run(&cfg, &opts(&out)).unwrap();
    assert_eq!((o3.computed, o3.skipped), (0, 2));

    // A run stopped inside a context keeps the pairs it measured: here the
    // first pair of py_matrix.py has its file in pairs/ (with one value
    // marked, so that a recomputation would show) and the context's unit is
    // gone. The rerun reads that pair back instead of measuring it, measures
    // the others, writes the unit in the same row order and removes the
    // pair's file.
    let unit = out.join("units").join("py_matrix.py.parquet");
    let before = rows(&unit);
    let first_arch = meta["pairs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["context"] == "py_matrix.py")
        .unwrap()["archetype"]
        .as_str()
        .unwrap()
        .to_string();
    let is_pair = |r: &MeasureRow| {
        r.measurement != "skip" && r.archetype.as_deref() == Some(first_arch.as_str())
    };
    let mut kept: Vec<MeasureRow> = before.iter().filter(|r| is_pair(r)).cloned().collect();
    assert!(kept.len() > 10);
    let mark = kept.iter().position(|r| r.metric == "kl_stale").unwrap();
    kept[mark].value = 12345.0;
    std::fs::create_dir_all(out.join("pairs")).unwrap();
    let part_file = out
        .join("pairs")
        .join(format!("py_matrix.py.{first_arch}.parquet"));
    measure::write_rows(kept.clone(), &part_file).unwrap();
    std::fs::remove_file(&unit).unwrap();
    std::fs::remove_file(out.join("summary.parquet")).unwrap();
    let o4 = measure::run(&cfg, &opts(&out)).unwrap();
    assert_eq!((o4.computed, o4.skipped), (1, 1));
    assert!(!part_file.exists());
    assert_eq!(std::fs::read_dir(out.join("pairs")).unwrap().count(), 0);
    let after = rows(&unit);
    assert_eq!(after.len(), before.len());
    let timed = |r: &MeasureRow| r.metric.contains("seconds");
    for (a, b) in after.iter().zip(&before) {
        if is_pair(b) {
            continue;
        }
        if timed(b) {
            assert_eq!(
                (&a.metric, a.layer, &a.variant),
                (&b.metric, b.layer, &b.variant)
            );
        } else {
            assert_eq!(a, b);
        }
    }
    let read_back: Vec<MeasureRow> = after.iter().filter(|r| is_pair(r)).cloned().collect();
    assert_eq!(read_back, kept);
}

/// The oracle gate's rule: every top-1 prediction agrees with the full
/// recompute (ties aside) and the mean KL stays under the tolerance; a
/// single disagreement or a KL at the tolerance fails it.
#[test]
fn the_oracle_gate_fails_on_one_disagreement_or_a_kl_at_the_tolerance() {
    use tolerable_driver::measure::mode_d::oracle_passes;
    let ok = Comparison {
        n: 10,
        agreement: 1.0,
        ties: 0,
        kl_mean: 1e-9,
        kl_max: 1e-8,
    };
    assert!(oracle_passes(&ok));
    assert!(oracle_passes(&Comparison {
        agreement: 0.9,
        ties: 1,
        ..ok
    }));
    assert!(!oracle_passes(&Comparison {
        agreement: 0.9,
        ..ok
    }));
    assert!(!oracle_passes(&Comparison {
        kl_mean: ORACLE_KL_TOLERANCE,
        ..ok
    }));
    // One position the oracle misses fails the gate however small the mean.
    assert!(!oracle_passes(&Comparison {
        kl_max: ORACLE_POSITION_KL_TOLERANCE,
        ..ok
    }));

    // The rule applied to files' rows: one check per (pair, layer) the plan
    // runs, the comparison rebuilt with its position count, ties counted,
    // other variants' rows not read, and files that miss, repeat or add a
    // row refused, named.
    use tolerable_driver::measure::mode_d::oracle_checks_from_rows;
    let row = |arch: &str, layer: i64, variant: &str, metric: &str, value: f64| {
        let mut r = MeasureRow::new("r", "mode_d", "m", metric, value, 10)
            .context("ctx.py", "python")
            .archetype(arch);
        r.layer = Some(layer);
        r.variant = Some(variant.into());
        r
    };
    let file = |agreement: f64, ties: f64| {
        let mut v = Vec::new();
        for arch in ["rename_identifier", "change_literal"] {
            for l in [1, 2] {
                let last = arch == "change_literal" && l == 2;
                let a = if last { agreement } else { 1.0 };
                let t = if last { ties } else { 0.0 };
                v.extend([
                    row(arch, l, "oracle", "agreement", a),
                    row(arch, l, "oracle", "kl_mode_d", 1e-9),
                    row(arch, l, "oracle", "kl_mode_d_max", 1e-8),
                    row(arch, l, "oracle", "ties", t),
                    // An approximate delta's rows fail the rule and are not read.
                    row(arch, l, "edit_site", "agreement", 0.5),
                    row(arch, l, "edit_site", "kl_mode_d", 0.3),
                ]);
            }
        }
        v
    };
    let pairs: Vec<(String, Archetype)> = ["rename_identifier", "change_literal"]
        .iter()
        .map(|a| ("ctx.py".to_string(), Archetype::from_name(a).unwrap()))
        .collect();
    let checks = oracle_checks_from_rows(&file(0.9, 1.0), &pairs, &[1, 2]).unwrap();
    assert_eq!(checks.len(), 4);
    assert!(checks.iter().all(|c| c.passed && c.comparison.n == 10));
    let checks = oracle_checks_from_rows(&file(0.9, 0.0), &pairs, &[1, 2]).unwrap();
    assert_eq!(
        checks
            .iter()
            .map(|c| (c.pair.as_str(), c.layer, c.passed))
            .collect::<Vec<_>>(),
        vec![
            ("code/ctx.py/rename_identifier", 1, true),
            ("code/ctx.py/rename_identifier", 2, true),
            ("code/ctx.py/change_literal", 1, true),
            ("code/ctx.py/change_literal", 2, false),
        ]
    );
    let refused = |rows: &[MeasureRow], layers: &[usize]| {
        oracle_checks_from_rows(rows, &pairs, layers)
            .unwrap_err()
            .to_string()
    };
    let mut partial = file(1.0, 0.0);
    partial.retain(|r| !(r.metric == "ties" && r.layer == Some(2)));
    let e = refused(&partial, &[1, 2]);
    assert!(e.contains("lacks its `ties` row at layer 2"), "{e}");
    let e = refused(&file(1.0, 0.0), &[1, 2, 3]);
    assert!(
        e.contains("no oracle rows for code/ctx.py/rename_identifier at layer 3"),
        "{e}"
    );
    let e = refused(&file(1.0, 0.0), &[1]);
    assert!(e.contains("which this run does not measure"), "{e}");
    let mut twice = file(1.0, 0.0);
    twice.push(row("change_literal", 1, "oracle", "kl_mode_d", 1e-9));
    let e = refused(&twice, &[1, 2]);
    assert!(e.contains("two `kl_mode_d` rows"), "{e}");
    assert!(oracle_checks_from_rows(&[], &pairs, &[1])
        .unwrap_err()
        .to_string()
        .contains("no oracle rows"));
}

fn checkpoint(model: &Path) -> Checkpoint {
    tolerable_fetch::load(
        model.to_str().unwrap(),
        Precision::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap()
}

fn spec(dir: &Path) -> ModeDSpec {
    let text = format!(
        "[run]\nname = \"x\"\n[measure]\nkind = \"mode_d\"\ncontexts = \"{}\"\n",
        dir.display()
    );
    match MeasureConfig::parse(&text).unwrap().measure {
        measure::MeasureSpec::ModeD(s) => s,
        other => panic!("parsed as {}", other.kind()),
    }
}

#[test]
fn mode_d_injection_reproduces_the_full_and_the_stale_pass() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let ck = checkpoint(&model);
    let corpus = corpus_dir(dir.path(), &[("calc.py", CALC_PY)]);
    let plan = spec(&corpus)
        .plan(ck.model.config(), &ck.tokenizer, 0)
        .unwrap();
    assert!(plan.pairs.len() >= 4, "{} pairs", plan.pairs.len());
    let m = &ck.model;
    for pair in &plan.pairs {
        let p = pair_passes(m, pair, true).unwrap();
        let g = p.geometry;
        let at = LogitsAt::Positions((0..g.downstream).collect());
        let full = LogitReference::new(&p.full_logits).unwrap();
        let stale = LogitReference::new(p.stale_logits.as_ref().unwrap()).unwrap();
        let lower = p.lower().unwrap();
        // At layer 0 the true delta of the downstream tokens is exactly zero
        // (same ids, same embeddings), and Mode D is the full recompute.
        let d0 = p.oracle_delta(0).unwrap();
        assert_eq!(
            d0.abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
            0.0
        );
        let zero = d0.zeros_like().unwrap();
        let prefix = p.edited_prefix(m).unwrap();
        let l0 = mode_d_logits(
            m,
            0,
            &p.orig_downstream(0).unwrap(),
            &zero,
            &lower,
            &prefix,
            at.clone(),
        )
        .unwrap()
        .unwrap();
        let c = full.compare(&l0, 1e-3).unwrap();
        assert!(
            c.agreement == 1.0 && c.kl_mean < 1e-9,
            "{}: {c:?}",
            pair.pair.id
        );
        // Over the original's own prefix, a zero delta at any layer gives
        // back the stale states: the original pass's logits.
        let own = p.orig_cache.truncate(g.d_base).unwrap();
        for l in 0..m.config().n_layers {
            let logits = mode_d_logits(
                m,
                l,
                &p.orig_downstream(l).unwrap(),
                &zero,
                &lower,
                &own,
                at.clone(),
            )
            .unwrap()
            .unwrap();
            let c = stale.compare(&logits, 1e-3).unwrap();
            assert!(
                c.agreement == 1.0 && c.kl_mean < 1e-9,
                "{} l={l}: {c:?}",
                pair.pair.id
            );
        }
        // The oracle at every layer is the full recompute.
        let (deltas, checks) = mode_d::oracle_pair(m, pair, &[0, 1, 2]).unwrap();
        assert_eq!(deltas.dims(), &[4, m.config().d_model]);
        assert!(checks.iter().all(|c| c.passed), "{checks:?}");
    }
}

#[test]
fn dirtiness_is_zero_when_the_edit_changes_nothing_downstream() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let ck = checkpoint(&model);
    let ids = ck.tokenizer.encode(CALC_PY).unwrap();
    let (k, n) = (40, ids.len());
    // A pair whose two contexts are the same tokens: nothing moves.
    let pair = CodePair {
        pair: ContextPair {
            id: "code/calc.py/identity".into(),
            shared: ids[..k].to_vec(),
            base: ids[k..].to_vec(),
            alt: ids[k..].to_vec(),
            suffix: vec![],
            span_start: 0,
            focus: (k..n).collect(),
        },
        meta: CodePairMeta {
            context: "calc.py".into(),
            language: Language::Python,
            archetype: Archetype::ChangeLiteral,
            seed: 0,
            offset: 0,
            line: 1,
            before: String::new(),
            after: String::new(),
            sites: 0,
            description: "identity".into(),
            original_len: n,
            edited_len: n,
            text_prefix_tokens: k,
            retokenized: 0,
            common_suffix: n - k,
        },
    };
    assert_eq!(PairGeometry::of(&pair).downstream, n - k);
    let s = spec(dir.path());
    let rows = mode_d::measure_pair(
        &ck.model,
        "tiny",
        "r",
        &pair,
        &s,
        &[0, 1, 2],
        &BTreeMap::new(),
    )
    .unwrap();
    let get = |metric: &'static str| rows.iter().filter(move |r| r.metric == metric);
    assert_eq!(get("dirtiness").count(), 4 * s.taus.len());
    assert!(get("dirtiness").all(|r| r.value == 0.0));
    assert!(get("rel_l2_mean").all(|r| r.value == 0.0));
    assert!(get("kl_stale").all(|r| r.value < 1e-12));
    assert!(get("agreement").all(|r| r.value == 1.0));
    // The edit-site delta is zero: Mode D is the full recompute at every layer.
    assert!(get("kl_mode_d").all(|r| r.value < 1e-9));
    // No other context: the archetype mean is skipped, with a reason.
    assert_eq!(
        rows.iter()
            .filter(|r| r.metric == "skipped" && r.variant.as_deref() == Some("archetype_mean"))
            .count(),
        3
    );
}

#[test]
fn bad_input_is_refused_before_any_work_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let ok_corpus = corpus_dir(dir.path(), &[("calc.py", CALC_PY)]);
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let short = dir.path().join("short");
    std::fs::create_dir_all(&short).unwrap();
    std::fs::write(short.join("short.py"), "x = 1\n").unwrap();
    let c = |s: &Path| format!("contexts = \"{}\"", s.display());
    let cases = [
        (
            format!("taus = [0.1, 0.0]\n{}", c(&ok_corpus)),
            "[measure] taus[1]",
        ),
        (
            format!("taus = [-1.0]\n{}", c(&ok_corpus)),
            "[measure] taus[0]",
        ),
        (format!("taus = [inf]\n{}", c(&ok_corpus)), "(0, inf)"),
        (format!("taus = []\n{}", c(&ok_corpus)), "[measure] taus"),
        (
            format!("layers = [1, 7]\n{}", c(&ok_corpus)),
            "[measure] layers",
        ),
        (
            format!("layers = \"suffix:3\"\n{}", c(&ok_corpus)),
            "[measure] layers",
        ),
        (c(&empty), "[measure] contexts"),
        (c(&short), "`short.py` has"),
        (c(&dir.path().join("nowhere")), "[measure] contexts"),
        (
            format!("select = [\"nope.py\"]\n{}", c(&ok_corpus)),
            "[measure] select",
        ),
        (
            format!("min_downstream = 0\n{}", c(&ok_corpus)),
            "[measure] min_downstream",
        ),
        (
            format!("archetypes = [\"reformat\"]\n{}", c(&ok_corpus)),
            "[measure]",
        ),
        (
            format!("tau = 0.1\n{}", c(&ok_corpus)),
            "unknown field `tau`",
        ),
        (
            format!("variants = []\n{}", c(&ok_corpus)),
            "[measure] variants",
        ),
        (
            format!("variants = [\"zero\", \"zero\"]\n{}", c(&ok_corpus)),
            "[measure] variants[1]",
        ),
        (
            format!("variants = [\"half\"]\n{}", c(&ok_corpus)),
            "unknown variant `half`",
        ),
    ];
    for (i, (measure, want)) in cases.iter().enumerate() {
        let cfg = config(dir.path(), &model, measure);
        let out = dir.path().join(format!("run{i}"));
        let e = measure::run(&cfg, &opts(&out)).unwrap_err().to_string();
        assert!(e.contains(want), "case {i} ({measure}): {e}");
        assert!(!out.join("run.json").exists(), "case {i} wrote run.json");
    }
    // The short context is also named with what it needs.
    let cfg = config(dir.path(), &model, &c(&short));
    let e = measure::run(&cfg, &opts(&dir.path().join("s")))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("[measure] contexts") && e.contains("min_downstream"),
        "{e}"
    );
    // An unknown kind, a sweep table in a measurement config.
    let p = dir.path().join("k.toml");
    std::fs::write(&p, "[run]\nname = \"x\"\n[measure]\nkind = \"mode_e\"\n").unwrap();
    let e = measure::run(&p, &opts(&dir.path().join("k")))
        .unwrap_err()
        .to_string();
    assert!(e.contains("[measure] kind"), "{e}");
    std::fs::write(
        &p,
        "[run]\nname = \"x\"\n[data]\nn = 1\n[measure]\nkind = \"mode_d\"\n",
    )
    .unwrap();
    let e = measure::run(&p, &opts(&dir.path().join("k")))
        .unwrap_err()
        .to_string();
    assert!(e.contains("`data`"), "{e}");
    assert!(measure::is_measure_config(&p).unwrap());
}

#[test]
fn a_skipped_archetype_is_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let corpus = corpus_dir(dir.path(), &[("calc.py", CALC_PY), ("words.py", WORDS_PY)]);
    let cfg = config(
        dir.path(),
        &model,
        &format!(
            "taus = [0.1]\nlayers = [0, 2]\nvariants = [\"edit_site\", \"archetype_mean\", \"zero\"]\ncontexts = \"{}\"",
            corpus.display()
        ),
    );
    let out = dir.path().join("run");
    let o = measure::run(&cfg, &opts(&out)).unwrap();
    assert!(o.summary_written);
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("run.json")).unwrap()).unwrap();
    let skipped: Vec<(String, String, String)> = meta["skipped"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["context"].as_str().unwrap().to_string(),
                s["archetype"].as_str().unwrap().to_string(),
                s["reason"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    for a in ["change_literal", "change_operator"] {
        assert!(
            skipped
                .iter()
                .any(|(c, arch, why)| c == "words.py" && arch == a && why.contains("no site")),
            "{skipped:?}"
        );
    }
    let units = unit_rows(&out, "units");
    let skip_rows: Vec<&MeasureRow> = units.iter().filter(|r| r.measurement == "skip").collect();
    assert_eq!(skip_rows.len(), skipped.len());
    assert!(skip_rows
        .iter()
        .all(|r| r.metric == "skipped" && r.note.as_deref().is_some_and(|n| !n.is_empty())));
    let summary = rows(&out.join("summary.parquet"));
    let lit = summary
        .iter()
        .find(|r| r.measurement == "skip" && r.archetype.as_deref() == Some("change_literal"))
        .unwrap();
    assert_eq!(lit.value, 1.0);
    // Archetypes of both contexts have a leave-one-out mean.
    assert!(units
        .iter()
        .any(|r| r.metric == "agreement" && r.variant.as_deref() == Some("archetype_mean")));
    // The no-delta control at layer 0 is the full recompute (the downstream
    // tokens' true delta is zero there), and it costs no delta.
    let zero: Vec<&MeasureRow> = units
        .iter()
        .filter(|r| r.variant.as_deref() == Some("zero"))
        .collect();
    assert!(!zero.is_empty());
    for r in zero.iter().filter(|r| r.layer == Some(0)) {
        match r.metric.as_str() {
            "agreement" => assert_eq!(r.value, 1.0),
            "kl_mode_d" => assert!(r.value < ORACLE_KL_TOLERANCE),
            _ => {}
        }
    }
    let report = std::fs::read_to_string(tolerable_driver::report::write(&out).unwrap()).unwrap();
    assert!(report.contains("agreement zero"), "{report}");
    // Each delta variant is read against the zero delta at its layer: a
    // column per variant in the per-layer table, a headline row.
    for v in ["edit_site", "archetype_mean"] {
        assert!(report.contains(&format!("KL zero / KL {v}")), "{report}");
    }
    assert!(report.contains("the delta's own gain"), "{report}");
    assert!(!report.contains("KL zero / KL zero"), "{report}");
}

#[test]
fn a_pair_with_too_few_downstream_tokens_is_a_recorded_skip() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let corpus = corpus_dir(dir.path(), &[("calc.py", CALC_PY)]);
    let measure = |m: usize| {
        format!(
            "taus = [0.1]\nlayers = [1]\nvariants = [\"zero\"]\nmin_downstream = {m}\ncontexts = \"{}\"",
            corpus.display()
        )
    };
    let meta = |out: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(out.join("run.json")).unwrap()).unwrap()
    };
    // Every pair measured, for their downstream lengths.
    let all = dir.path().join("all");
    measure::run(&config(dir.path(), &model, &measure(1)), &opts(&all)).unwrap();
    let lens: Vec<(String, u64)> = meta(&all)["pairs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["archetype"].as_str().unwrap().to_string(),
                p["geometry"]["downstream"].as_u64().unwrap(),
            )
        })
        .collect();
    let longest = lens.iter().map(|(_, n)| *n).max().unwrap();
    let shortest = lens.iter().map(|(_, n)| *n).min().unwrap();
    assert!(shortest < longest, "{lens:?}");
    // The longest pair's length as the threshold: the shorter pairs are
    // skipped with their count and the threshold named, the longest measured.
    let m = longest as usize;
    let some = dir.path().join("some");
    let o = measure::run(&config(dir.path(), &model, &measure(m)), &opts(&some)).unwrap();
    assert!(o.summary_written);
    let run = meta(&some);
    let kept: Vec<&str> = run["pairs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["archetype"].as_str().unwrap())
        .collect();
    let skipped = run["skipped"].as_array().unwrap();
    for (arch, n) in &lens {
        let skip = skipped
            .iter()
            .find(|s| s["archetype"] == arch.as_str() && s["context"] == "calc.py");
        if (*n as usize) < m {
            let why = skip.unwrap_or_else(|| panic!("{arch} ({n} < {m}) not in {skipped:?}"))
                ["reason"]
                .as_str()
                .unwrap();
            assert!(
                why.contains(&format!("{n} downstream"))
                    && why.contains(&format!("min_downstream = {m}")),
                "{why}"
            );
            assert!(!kept.contains(&arch.as_str()), "{arch} measured");
        } else {
            assert!(skip.is_none(), "{arch} skipped: {skip:?}");
            assert!(kept.contains(&arch.as_str()), "{arch} not measured");
        }
    }
    // Each skip is a row of the context's unit too.
    let units = unit_rows(&some, "units");
    let skip_rows = units.iter().filter(|r| r.measurement == "skip").count();
    assert_eq!(skip_rows, skipped.len());
    assert!(skip_rows > 0);
}

/// Mode D on the real 0.5B, two contexts, four injection layers (minutes on
/// two cores): `cargo test -p tolerable-driver --test mode_d -- --ignored`.
#[test]
#[ignore]
fn mode_d_on_the_real_0_5b() {
    let id = "qwen2.5-coder-0.5b-instruct";
    if tolerable_fetch::catalog::cached(id).unwrap().is_none() {
        eprintln!("skipped: {id} is not cached");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.toml");
    std::fs::write(
        &p,
        format!("[run]\nname = \"real\"\nmodel = \"{id}\"\n[measure]\nkind = \"mode_d\"\nlayers = [0, 1, 12, 23]\nselect = [\"py_matrix.py\", \"go_queue.go\"]\n"),
    )
    .unwrap();
    let out = dir.path().join("run");
    let o = measure::run(&p, &opts(&out)).unwrap();
    assert!(o.summary_written);
    let oracle = unit_rows(&out, "oracle");
    assert!(oracle
        .iter()
        .filter(|r| r.metric == "kl_mode_d")
        .all(|r| r.value < ORACLE_KL_TOLERANCE));
    let summary = rows(&out.join("summary.parquet"));
    let agree = summary
        .iter()
        .find(|r| {
            r.metric == "agreement"
                && r.variant.as_deref() == Some("edit_site")
                && r.layer == Some(1)
                && r.archetype.is_none()
        })
        .unwrap();
    assert!((0.0..=1.0).contains(&agree.value));
    tolerable_driver::report::write(&out).unwrap();
}

/// Phase 2 takes the languages in turn: the builtin corpus's first six
/// units are six languages, every context comes once, and each language's
/// contexts keep their corpus order.
#[test]
fn phase_two_takes_the_languages_in_turn() {
    let corpus = tolerable_probe::code::corpus::builtin();
    let order = tolerable_driver::measure::mode_d::languages_in_turn(&corpus);
    let names: Vec<&str> = order.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names.len(), corpus.len());
    assert_eq!(
        names.iter().collect::<BTreeSet<_>>().len(),
        corpus.len(),
        "{names:?}"
    );
    let languages: BTreeSet<Language> = corpus.iter().map(|c| c.language).collect();
    let first: BTreeSet<Language> = order[..languages.len()]
        .iter()
        .map(|c| c.language)
        .collect();
    assert_eq!(first, languages, "{names:?}");
    for l in &languages {
        let in_order: Vec<&str> = order
            .iter()
            .filter(|c| c.language == *l)
            .map(|c| c.name.as_str())
            .collect();
        let in_corpus: Vec<&str> = corpus
            .iter()
            .filter(|c| c.language == *l)
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(in_order, in_corpus);
    }
}
