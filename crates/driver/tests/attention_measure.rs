//! Conditioning and quantization measurements (paper 1, appendix E) end to
//! end on a tiny model the test writes, with synthetic probes and a
//! synthetic key bank: units, summary, the bank as a cached resource,
//! resuming, the report, and bad input named before any work.

use std::path::{Path, PathBuf};
use tolerable_driver::measure::{self, MeasureConfig, MeasureOptions};
use tolerable_driver::records::{columns, read_parquet, MeasureRow};
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

fn config(dir: &Path, model: &Path, name: &str, measure: &str) -> PathBuf {
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(
        &p,
        format!(
            "[run]\nname = \"{name}\"\nmodel = \"{}\"\nseed = 2\n\n[measure]\n{measure}\n",
            model.display()
        ),
    )
    .unwrap();
    p
}

fn opts(dir: &Path, out: &Path) -> MeasureOptions {
    MeasureOptions {
        out: Some(out.to_path_buf()),
        resource_root: Some(dir.join("resources")),
        ..MeasureOptions::default()
    }
}

fn rows(path: &Path) -> Vec<MeasureRow> {
    columns::rows(&read_parquet(path).unwrap()).unwrap()
}

fn units(out: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(out.join("units"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    v.sort();
    v
}

const CONDITIONING: &str = "kind = \"conditioning\"\nprobes = 2\ndata = \"synthetic\"\nlayers = \"all\"\nmagnitudes = [0.001, 0.1]\ndirections = 2\nseeds = 2\n[measure.bank]\nsize = 40\ncontexts = 3\ndata = \"synthetic\"\n";

#[test]
fn conditioning_measures_gains_under_their_bound_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let cfg = config(dir.path(), &model, "cond", CONDITIONING);
    let out = dir.path().join("out");
    let o = measure::run(&cfg, &opts(dir.path(), &out)).unwrap();
    assert_eq!((o.units, o.computed, o.skipped), (2, 2, 0));
    assert!(o.summary_written);
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("run.json")).unwrap()).unwrap();
    assert_eq!(meta["measurement"], "conditioning");
    assert_eq!(meta["resources"]["bank"]["obtained"], "built");
    assert_eq!(
        meta["resources"]["bank"]["hash"].as_str().unwrap().len(),
        16
    );
    let g = meta["group_size"].as_f64().unwrap();
    assert!((meta["bound_constant"].as_f64().unwrap() - (2.0 * g).sqrt()).abs() < 1e-12);
    let files = units(&out);
    assert_eq!(files.len(), 2);
    let unit = rows(&files[0]);
    let n_layers = meta["model"]["config"]["n_layers"].as_u64().unwrap() as usize;
    // Every layer has both manifolds at both magnitudes, and the bound.
    for l in 0..n_layers as i64 {
        for v in ["on_manifold", "off_manifold"] {
            for m in [0.001, 0.1] {
                let r = unit
                    .iter()
                    .find(|r| {
                        r.layer == Some(l)
                            && r.variant.as_deref() == Some(v)
                            && r.magnitude == Some(m)
                            && r.metric == "gain_softmax"
                    })
                    .unwrap_or_else(|| panic!("no softmax gain at layer {l}, {v}, {m}"));
                assert!(r.value.is_finite() && r.value >= 0.0);
                // kv heads x seeds x directions
                assert_eq!(r.n as u64 % 4, 0, "{r:?}");
            }
        }
        let bound = unit
            .iter()
            .find(|r| r.layer == Some(l) && r.metric == "bound_softmax")
            .unwrap();
        // At the smallest magnitude the first-order bound holds (on means).
        for v in ["on_manifold", "off_manifold"] {
            let gain = unit
                .iter()
                .find(|r| {
                    r.layer == Some(l)
                        && r.variant.as_deref() == Some(v)
                        && r.magnitude == Some(0.001)
                        && r.metric == "gain_softmax"
                })
                .unwrap();
            assert!(
                gain.value <= bound.value * 1.01 + 1e-9,
                "layer {l} {v}: gain {} above the bound {}",
                gain.value,
                bound.value
            );
        }
    }
    let summary = rows(&out.join("summary.parquet"));
    for metric in ["gain_logit", "gain_softmax"] {
        assert!(summary.iter().any(|r| r.metric == metric
            && r.layer.is_none()
            && r.magnitude.is_none()
            && r.variant.as_deref() == Some("off_over_on")));
    }
    assert!(summary
        .iter()
        .any(|r| r.metric == "bound_correlation" && r.variant.as_deref() == Some("off_manifold")));
    // The pooled gain's standard error over the two probes: the per-probe
    // means' standard deviation over sqrt(2), i.e. half their difference.
    let probe_mean = |f: &PathBuf| {
        let v: Vec<f64> = rows(f)
            .iter()
            .filter(|r| r.metric == "gain_logit" && r.variant.as_deref() == Some("off_manifold"))
            .map(|r| r.value)
            .collect();
        v.iter().sum::<f64>() / v.len() as f64
    };
    let (m0, m1) = (probe_mean(&files[0]), probe_mean(&files[1]));
    let se = summary
        .iter()
        .find(|r| {
            r.metric == "gain_logit_se"
                && r.layer.is_none()
                && r.magnitude.is_none()
                && r.variant.as_deref() == Some("off_manifold")
        })
        .expect("a standard error beside the pooled gain");
    assert_eq!(se.n, 2);
    assert!(
        m0 != m1 && (se.value - (m0 - m1).abs() / 2.0).abs() < 1e-9 * m0.abs().max(1.0),
        "{se:?} {m0} {m1}"
    );
    // Resuming computes nothing and loads the bank from the cache.
    let o = measure::run(&cfg, &opts(dir.path(), &out)).unwrap();
    assert_eq!((o.computed, o.skipped), (0, 2));
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("run.json")).unwrap()).unwrap();
    assert_eq!(meta["resources"]["bank"]["obtained"], "cached");
    assert_eq!(meta["invocations"].as_array().unwrap().len(), 2);
    // A report with its figures.
    let report = tolerable_driver::report::write(&out).unwrap();
    let text = std::fs::read_to_string(report).unwrap();
    assert!(
        text.contains("# Conditioning") && text.contains("sqrt(2G)") && text.contains(" ± "),
        "{text}"
    );
    assert!(out.join("plots/gain_vs_layer.png").exists());
    // Another config in the same folder is refused.
    let other = config(
        dir.path(),
        &model,
        "cond",
        &CONDITIONING.replace("seeds = 2", "seeds = 1"),
    );
    let e = measure::run(&other, &opts(dir.path(), &out))
        .unwrap_err()
        .to_string();
    assert!(e.contains("another config"), "{e}");
}

#[test]
fn quantization_compares_round_trips_with_matched_noise() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let cfg = config(
        dir.path(),
        &model,
        "quant",
        "kind = \"quantization\"\nprobes = 2\ndata = \"synthetic\"\nlayers = [0, 1]\nbits = [8, 4]\nfixed_norms = [0.05]\nnoise_seeds = 2\n",
    );
    let out = dir.path().join("out");
    let o = measure::run(&cfg, &opts(dir.path(), &out)).unwrap();
    assert_eq!((o.units, o.computed), (2, 2));
    let summary = rows(&out.join("summary.parquet"));
    let get = |v: &str, m: Option<f64>, metric: &str| {
        summary
            .iter()
            .find(|r| {
                r.layer.is_none()
                    && r.variant.as_deref() == Some(v)
                    && r.magnitude == m
                    && r.metric == metric
            })
            .unwrap_or_else(|| panic!("no {metric} for {v} {m:?}"))
            .value
    };
    // Noise has the round trip's displacement norm; int4 moves more than int8.
    for b in ["int8", "int4"] {
        let (q, n) = (
            get(b, None, "displacement"),
            get(&format!("noise_{b}"), None, "displacement"),
        );
        assert!((q - n).abs() <= 1e-4 * q.max(1e-9), "{b}: {q} vs {n}");
        assert!((get(b, Some(0.05), "displacement") - 0.05).abs() < 1e-4);
        let share = get(b, None, "query_share");
        assert!((0.0..=1.0).contains(&share));
        assert!(get(b, None, "output_error") >= 0.0);
    }
    assert!(get("int4", None, "displacement") > get("int8", None, "displacement"));
    assert!(summary
        .iter()
        .any(|r| r.variant.as_deref() == Some("int8_over_noise")));
    assert!(summary.iter().any(|r| r.metric == "output_error_se"
        && r.variant.as_deref() == Some("int4")
        && r.n == 2));
    let report = tolerable_driver::report::write(&out).unwrap();
    let text = std::fs::read_to_string(report).unwrap();
    assert!(
        text.contains("Quantization against noise") && text.contains(" ± "),
        "{text}"
    );
}

#[test]
fn bad_measurement_parameters_are_named_before_any_work() {
    let bad = [
        ("magnitudes = [0.0, 0.1]", "magnitudes"),
        ("magnitudes = []", "magnitudes"),
        ("directions = 0", "directions"),
        ("seeds = 0", "seeds"),
        ("probes = 0", "probes"),
        ("data = \"squad_train\"", "data"),
        ("sise = 3", "sise"),
    ];
    for (line, field) in bad {
        let text = format!("[run]\nname = \"x\"\n[measure]\nkind = \"conditioning\"\n{line}\n");
        let e = MeasureConfig::parse(&text).unwrap_err().to_string();
        assert!(e.contains(field), "{line}: {e}");
    }
    let e = MeasureConfig::parse(
        "[run]\nname = \"x\"\n[measure]\nkind = \"conditioning\"\ndirections = 8\nseeds = 3\n[measure.bank]\nsize = 10\n",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("[measure.bank] size") && e.contains("24"), "{e}");
    for (line, field) in [
        ("bits = [1]", "bits"),
        ("bits = [16]", "bits"),
        ("fixed_norms = [0.0]", "fixed_norms"),
        ("query_energy = 1.5", "query_energy"),
        ("noise_seeds = 0", "noise_seeds"),
    ] {
        let text = format!("[run]\nname = \"x\"\n[measure]\nkind = \"quantization\"\n{line}\n");
        let e = MeasureConfig::parse(&text).unwrap_err().to_string();
        assert!(e.contains(field), "{line}: {e}");
    }
    // A layer out of range is named before the weights load (nothing written).
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let cfg = config(
        dir.path(),
        &model,
        "q",
        "kind = \"quantization\"\nprobes = 1\ndata = \"synthetic\"\nlayers = [99]\n",
    );
    let out = dir.path().join("out");
    let e = measure::run(&cfg, &opts(dir.path(), &out))
        .unwrap_err()
        .to_string();
    assert!(e.contains("layers") && e.contains("99"), "{e}");
    assert!(!out.join("run.json").exists());
}
