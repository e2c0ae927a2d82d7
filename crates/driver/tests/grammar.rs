//! The arm grammar: every shipped config parses and round-trips through
//! TOML; every arm of PROTOCOL.md §5, 6, 7 and 10 can be written; bad
//! configs fail before any work with errors that name the field.

use tolerable_driver::config::SweepConfig;
use tolerable_driver::{Arm, DriverError};
use tolerable_runtime::ModelConfig;
use tolerable_testkit::tiny::TinySpec;

fn configs_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs")
}

fn round_trip(cfg: &SweepConfig) {
    for pa in &cfg.arms {
        let text = toml::to_string(&pa.arm).unwrap();
        let back: Arm = toml::from_str(&text).unwrap_or_else(|e| panic!("{text}\n{e}"));
        assert_eq!(back, pa.arm, "{text}");
    }
}

#[test]
fn shipped_configs_parse_expand_and_round_trip() {
    let mut seen = 0;
    let mut files = Vec::new();
    let mut dirs = vec![configs_dir()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "toml") {
                files.push(p);
            }
        }
    }
    for p in files {
        // Measurement configs (`[measure]`) have their own grammar; they
        // parse and round-trip through TOML too.
        if tolerable_driver::measure::is_measure_config(&p).unwrap() {
            let cfg = tolerable_driver::measure::MeasureConfig::from_file(&p).unwrap();
            let text = toml::to_string(&cfg).unwrap();
            let back = tolerable_driver::measure::MeasureConfig::parse(&text)
                .unwrap_or_else(|e| panic!("{text}\n{e}"));
            assert_eq!(back, cfg, "{text}");
            continue;
        }
        {
            let cfg = SweepConfig::from_file(&p).unwrap();
            assert_eq!(
                cfg.arms[cfg.anchor(tolerable_driver::Base::Masked)]
                    .arm
                    .name,
                "floor"
            );
            assert_eq!(
                cfg.arms[cfg.anchor(tolerable_driver::Base::Full)].arm.name,
                "native"
            );
            round_trip(&cfg);
            seen += 1;
        }
    }
    assert!(seen >= 5);
    let two = SweepConfig::from_file(&configs_dir().join("first-2x2.toml")).unwrap();
    let names: Vec<&str> = two.arms.iter().map(|a| a.arm.name.as_str()).collect();
    for want in [
        "floor",
        "native",
        "kv_augment",
        "act_replace@layers=4",
        "act_replace@layers=20",
        "act_noop@layers=12",
        "act_position@layers=8",
        "act_mismatch@layers=16",
    ] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
    // Controls resolve to the same grid point.
    let a = two
        .arms
        .iter()
        .find(|a| a.arm.name == "act_replace@layers=12")
        .unwrap();
    let c: Vec<&str> = two
        .controls_of(a)
        .unwrap()
        .iter()
        .map(|&i| two.arms[i].arm.name.as_str())
        .collect();
    assert_eq!(
        c,
        [
            "act_noop@layers=12",
            "act_position@layers=12",
            "act_mismatch@layers=12"
        ]
    );
}

/// Every arm of PROTOCOL.md sections 5, 6, 7 and 10, written in the grammar.
const PROTOCOL_ARMS: &str = r#"
[run]
name = "protocol"
[data]
source = "synthetic"
n = 4

# §5 the key bank and codebooks fitted on it are resources: fitted on
# training items, cached by content hash
[resources.bank]
kind = "key_bank"
size = 6000
contexts = 64
data = "squad_train"
[resources.kmeans]
kind = "codebook"
bank = "bank"
construction = "kmeans"
size = 32
# §6 a cross-family holder's states through a projection fitted on 40 train items
[resources.smol]
kind = "cross_projection"
holder = "smollm2-135m-instruct"
fit = "svd"
rank = 64
train_items = 40

# §5 cosine-calibrated noise on keys, per item and layer
[[arms]]
name = "k_noise"
inject = { carrier = "k", layers = "all", positions = "passage", source = "native", perturb = { kind = "cosine_noise", target_cosine = 0.95 } }
grid = { "perturb.target_cosine" = [0.99, 0.95, 0.9] }
# §5 genuine interpolation toward another item's cache at shared positions
[[arms]]
name = "k_interp_other"
inject = { carrier = "k", source = "other_item", positions = "passage", mechanism = "interpolate", alpha = 0.5 }
# §5 layer budget: a prefix of layers corrupted off- and on-manifold
[[arms]]
name = "budget_off"
inject = { carrier = "k", layers = "prefix:8", positions = "passage", source = "native", perturb = { kind = "cosine_noise", target_cosine = 0.9 } }
[[arms]]
name = "budget_on"
inject = { carrier = "k", layers = "prefix:8", positions = "passage", source = { bank = { bank = "bank", cosine = 0.9 } } }
# §5 key bank: k-th nearest neighbour, interpolated
[[arms]]
name = "bank"
inject = { carrier = "k", positions = "passage", source = { bank = { bank = "bank", neighbour = 3 } }, mechanism = "interpolate", alpha = 0.5 }
# §5 codebooks
[[arms]]
name = "codebook"
inject = { carrier = "k", positions = "passage", source = { codebook = { codebook = "kmeans", snapping = "cosine" } } }
# §5 sparse damage, whole heads, whole layers, quantization
[[arms]]
name = "sparse_v"
inject = { carrier = "v", positions = "passage", source = "native", perturb = { kind = "sparse_damage", fraction = 0.05 } }
[[arms]]
name = "head_knockout"
inject = { carrier = "kv", layers = [3], heads = [1], positions = "passage", source = "native", perturb = { kind = "destroy" } }
[[arms]]
name = "int4"
inject = { carrier = "kv", positions = "passage", source = "native", perturb = { kind = "quantize", bits = 4 } }
# §6 the 2x2: KV augmentation and activation replacement with controls
[[arms]]
name = "kv_augment"
inject = { carrier = "kv", positions = "passage", source = "holder", mechanism = "append" }
[[arms]]
name = "act_replace"
controls = ["act_noop"]
inject = { carrier = "h", positions = "fact_region", source = "holder" }
grid = { layers = [4, 8] }
[[arms]]
name = "act_noop"
expect = "floor"
inject = { carrier = "h", positions = "fact_region", source = "own" }
grid = { layers = [4, 8] }
# §6 the displaced control: the holder's fact-region states at fact-free positions
[[arms]]
name = "act_displaced"
inject = { carrier = "h", layers = 8, positions = "fact_free_prefix", source_positions = "fact_region", source = "holder" }
# §6 activation augmentation over a pool of 3 holders
[[arms]]
name = "act_augment"
inject = { carrier = "h", layers = 12, positions = "fact_region", source = { pool = { n = 3, router = "oracle" } }, mechanism = "add", alpha = 2.0 }
# §6 carrier ordering: suffix layers
[[arms]]
name = "v_suffix"
inject = { carrier = "v", layers = "suffix:12", positions = "fact_region", source = "holder" }
# §6 cross-family holder through a projection; held-out senders
[[arms]]
name = "cross_family"
holder = { model = "smollm2-135m-instruct", projection = "smol" }
inject = { carrier = "h", layers = 8, positions = "fact_region", source = "holder" }
[[arms]]
name = "held_out_q4"
holder = { requantize = "Q4_0" }
inject = { carrier = "kv", positions = "passage", source = "holder", mechanism = "append" }
# §7 bridges and pools
[[arms]]
name = "lora_q"
bridge = { resource = "q_lora" }
inject = { carrier = "kv", positions = "passage", source = "holder", mechanism = "append" }
[[arms]]
name = "pool_masked_control"
bridge = { resource = "pool_bridge" }
inject = { carrier = "kv", positions = "passage", source = { pool = { n = 4, router = "uniform", members = "answer_masked" } }, mechanism = "append" }
[[arms]]
name = "router"
bridge = { resource = "router" }
inject = { carrier = "h", layers = 12, positions = "fact_region", source = { pool = { n = 4, router = "trained" } }, mechanism = "add", alpha = 1.0 }
# §10 Mode D: cached downstream states plus a delta, layers l..L recomputed
[[arms]]
name = "mode_d"
inject = { carrier = "h", layers = 12, positions = "downstream", source = { delta = "archetype_mean" }, mechanism = "add", alpha = 1.0 }
"#;

#[test]
fn every_protocol_arm_can_be_written_and_round_trips() {
    let cfg = SweepConfig::parse(PROTOCOL_ARMS).unwrap();
    round_trip(&cfg);
    assert!(cfg
        .arms
        .iter()
        .any(|a| a.arm.name == "k_noise@perturb.target_cosine=0.9"));
    assert!(cfg.arms.len() > 20);
}

#[test]
fn malformed_configs_and_unknown_fields_name_the_problem() {
    let base = "[run]\nname = \"x\"\n[data]\nsource = \"synthetic\"\nn = 2\n";
    let err = |text: &str| SweepConfig::parse(text).unwrap_err().to_string();
    let e = err(&format!(
        "{base}[[arms]]\nname = \"a\"\ninject = {{ carrier = \"kv\", sorce = \"holder\" }}\n"
    ));
    assert!(e.contains("sorce") && e.contains("arms[0]"), "{e}");
    let e = err(&format!("{base}[[arms]]\nname = \"a\"\nlayer = 3\n"));
    assert!(e.contains("unknown field `layer`"), "{e}");
    let e = err("[run]\nname = \"x\"\n[data\n");
    assert!(e.contains("line"), "{e}");
    let e = err("[run]\nname = \"x\"\nseeds = 3\n[data]\nsource = \"synthetic\"\nn = 2\n");
    assert!(e.contains("seeds") && e.contains("[run]"), "{e}");
    let e = err(&format!(
        "{base}[[arms]]\nname = \"a\"\ninject = {{ carrier = \"q\", source = \"holder\" }}\n"
    ));
    assert!(e.contains("carrier") || e.contains("`q`"), "{e}");
    let e = err(&format!("{base}[[arms]]\nname = \"a\"\ninject = {{ carrier = \"h\", source = \"holder\", layers = \"sufix:3\" }}\n"));
    assert!(e.contains("sufix:3"), "{e}");
    let e = err(&format!(
        "{base}[[arms]]\nname = \"a\"\ncontrols = [\"nothing\"]\n"
    ));
    assert!(e.contains("nothing"), "{e}");
    let e = err(&format!(
        "{base}[[arms]]\nname = \"floor\"\nbase = \"full\"\n"
    ));
    assert!(e.contains("floor"), "{e}");
    let e = err(&format!(
        "{base}[[arms]]\nname = \"a\"\ngrid = {{ layers = [1] }}\n"
    ));
    assert!(e.contains("no `inject`"), "{e}");
    let e = err("[run]\nname = \"x\"\n[data]\nsource = \"squad_dev\"\nn = 0\n");
    assert!(e.contains("`n`"), "{e}");
    let e = err("[run]\nname = \"x\"\n[data]\nsource = \"wiki\"\nn = 3\n");
    assert!(e.contains("wiki"), "{e}");
}

#[test]
fn a_resource_grid_declares_one_resource_per_point_that_arms_name() {
    let text = r#"
[run]
name = "seeds"
[data]
source = "synthetic"
n = 2
[resources.lora_q]
kind = "bridge"
targets = "q"
data = "synthetic"
arm = { inject = [{ carrier = "kv", positions = "passage", source = "holder", mechanism = "append" }] }
grid = { seed = [0, 1, 2] }
[[arms]]
name = "bridged"
bridge = { resource = "lora_q@seed=0" }
inject = { carrier = "kv", positions = "passage", source = "holder", mechanism = "append" }
grid = { "bridge.resource" = ["lora_q@seed=0", "lora_q@seed=1", "lora_q@seed=2"] }
"#;
    let cfg = SweepConfig::parse(text).unwrap();
    let names: Vec<&String> = cfg.resources.keys().collect();
    assert_eq!(names, ["lora_q@seed=0", "lora_q@seed=1", "lora_q@seed=2"]);
    for (i, name) in names.iter().enumerate() {
        let json = serde_json::to_value(&cfg.resources[*name]).unwrap();
        assert_eq!(json["seed"], i as u64, "{json}");
        assert!(json.get("grid").is_none());
    }
    round_trip(&cfg);
    let plan =
        tolerable_driver::compile(&cfg, &receiver(), "receiver", &|_| unreachable!()).unwrap();
    assert_eq!(plan.resources.len(), 3);
    // A grid that is not a table of lists is named.
    let bad = text.replace("grid = { seed = [0, 1, 2] }", "grid = { seed = 1 }");
    let e = SweepConfig::parse(&bad).unwrap_err().to_string();
    assert!(
        e.contains("[resources.lora_q]") && e.contains("grid.seed"),
        "{e}"
    );
}

fn receiver() -> ModelConfig {
    let spec = TinySpec::default();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("r.gguf");
    tolerable_testkit::tiny::write_gguf(&spec, &p).unwrap();
    tolerable_driver::sweep::model_config_of(p.to_str().unwrap()).unwrap()
}

fn validate(arms: &str, holder: &dyn Fn(&str) -> tolerable_driver::Result<ModelConfig>) -> String {
    let text = format!(
        "[run]\nname = \"x\"\nmodel = \"receiver\"\n[data]\nsource = \"synthetic\"\nn = 2\n{arms}"
    );
    let cfg = SweepConfig::parse(&text).unwrap();
    match tolerable_driver::compile(&cfg, &receiver(), "receiver", holder) {
        Err(e @ DriverError::Inapplicable { .. })
        | Err(e @ DriverError::Carrier(_))
        | Err(e @ DriverError::Config(_)) => e.to_string(),
        other => panic!("expected an inapplicable arm, got {other:?}"),
    }
}

#[test]
fn arms_that_cannot_apply_fail_validation_naming_the_field() {
    let none = |_: &str| -> tolerable_driver::Result<ModelConfig> { unreachable!() };
    // The tiny receiver has 3 layers and 2 kv heads.
    let e = validate(
        "[[arms]]\nname = \"a\"\ninject = { carrier = \"h\", layers = 5, source = \"holder\" }\n",
        &none,
    );
    assert!(
        e.contains("arms[0].inject[0].layers") && e.contains("layer 5"),
        "{e}"
    );
    let e = validate(
        "[[arms]]\nname = \"a\"\ninject = { carrier = \"k\", heads = [2], source = \"holder\" }\n",
        &none,
    );
    assert!(e.contains("arms[0].inject[0].heads"), "{e}");
    let e = validate(
        "[[arms]]\nname = \"a\"\ninject = { carrier = \"k\", heads = [], source = \"holder\" }\n",
        &none,
    );
    assert!(
        e.contains("arms[0].inject[0].heads") && e.contains("empty"),
        "{e}"
    );
    let e = validate(
        "[[arms]]\nname = \"a\"\ninject = { carrier = \"kv\", heads = [0], positions = \"passage\", source = \"holder\", mechanism = \"append\" }\n",
        &none,
    );
    assert!(
        e.contains("arms[0].inject[0].heads") && e.contains("append"),
        "{e}"
    );
    let e = validate("[[arms]]\nname = \"a\"\ninject = { carrier = \"h\", source = \"holder\", mechanism = \"interpolate\" }\n", &none);
    assert!(e.contains("alpha"), "{e}");
    let e = validate("[[arms]]\nname = \"a\"\ninject = { carrier = \"h\", source = \"holder\", mechanism = \"append\" }\n", &none);
    assert!(e.contains("inject[0].carrier"), "{e}");
    // An arm that needs a resource the config does not define.
    let e = validate("[[arms]]\nname = \"a\"\ninject = { carrier = \"k\", source = { bank = { bank = \"keys\", neighbour = 2 } } }\n", &none);
    assert!(
        e.contains("inject[0].source.bank.bank") && e.contains("[resources.keys]"),
        "{e}"
    );
    let bank = "[resources.keys]\nkind = \"key_bank\"\nsize = 100\n";
    // A bank substitution on values, and a neighbour the bank cannot have.
    let e = validate(&format!("{bank}[[arms]]\nname = \"a\"\ninject = {{ carrier = \"v\", source = {{ bank = {{ bank = \"keys\", neighbour = 2 }} }} }}\n"), &none);
    assert!(e.contains("inject[0].carrier"), "{e}");
    let e = validate(&format!("{bank}[[arms]]\nname = \"a\"\ninject = {{ carrier = \"k\", source = {{ bank = {{ bank = \"keys\", neighbour = 101 }} }} }}\n"), &none);
    assert!(e.contains("neighbour 101"), "{e}");
    // Projection onto the span of as many entries as the key dimension is the identity.
    let e = validate(&format!("{bank}[resources.cb]\nkind = \"codebook\"\nbank = \"keys\"\nconstruction = \"kmeans\"\nsize = 16\n[[arms]]\nname = \"a\"\ninject = {{ carrier = \"k\", source = {{ codebook = {{ codebook = \"cb\", snapping = \"projection\" }} }} }}\n"), &none);
    assert!(e.contains("identity"), "{e}");
    let e = validate("[[arms]]\nname = \"a\"\ninject = { carrier = \"k\", source = \"native\", perturb = { kind = \"cosine_noise\", target_cosine = 1.5 } }\n", &none);
    assert!(e.contains("inject[0].perturb") && e.contains("1.5"), "{e}");
    // The lower bound: a target cosine of 0 or below, for noise, for
    // interpolation toward another item and for a bank's on-manifold pick.
    for c in ["0.0", "-0.5"] {
        let e = validate(&format!("[[arms]]\nname = \"a\"\ninject = {{ carrier = \"k\", source = \"native\", perturb = {{ kind = \"cosine_noise\", target_cosine = {c} }} }}\n"), &none);
        assert!(
            e.contains("inject[0].perturb") && e.contains("(0, 1]"),
            "{e}"
        );
        let e = validate(&format!("[[arms]]\nname = \"a\"\ninject = {{ carrier = \"k\", source = \"native\", blend = {{ toward = \"other_item\", target_cosine = {c} }} }}\n"), &none);
        assert!(
            e.contains("inject[0].blend.target_cosine") && e.contains("(0, 1]"),
            "{e}"
        );
        let e = validate(&format!("{bank}[[arms]]\nname = \"a\"\ninject = {{ carrier = \"k\", source = {{ bank = {{ bank = \"keys\", cosine = {c} }} }} }}\n"), &none);
        assert!(
            e.contains("inject[0].source.bank.cosine") && e.contains("(0, 1]"),
            "{e}"
        );
    }
    let e = validate("[[arms]]\nname = \"a\"\ninject = { carrier = \"k\", source = \"native\", perturb = { kind = \"sparse_damage\", fraction = 1.0 } }\n", &none);
    assert!(
        e.contains("inject[0].perturb") && e.contains("[0, 1)"),
        "{e}"
    );
    let e = validate("[[arms]]\nname = \"a\"\ninject = { carrier = \"k\", source = \"native\", blend = { toward = \"other_item\", target_cosine = 1.5 } }\n", &none);
    assert!(
        e.contains("inject[0].blend.target_cosine") && e.contains("1.5"),
        "{e}"
    );
    let e = validate("[[arms]]\nname = \"a\"\ninject = { carrier = \"k\", source = \"native\", blend = { toward = \"other_item\", alpha = 0.5, target_cosine = 0.9 } }\n", &none);
    assert!(
        e.contains("inject[0].blend") && e.contains("exactly one"),
        "{e}"
    );
    // A sender with another cache shape and no projection.
    let other = |_: &str| -> tolerable_driver::Result<ModelConfig> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.gguf");
        tolerable_testkit::tiny::write_gguf(
            &TinySpec {
                n_layers: 4,
                ..TinySpec::default()
            },
            &p,
        )
        .unwrap();
        tolerable_driver::sweep::model_config_of(p.to_str().unwrap())
    };
    let e = validate(
        "[[arms]]\nname = \"a\"\nholder = { model = \"sender\" }\ninject = { carrier = \"kv\", positions = \"passage\", source = \"holder\", mechanism = \"append\" }\n",
        &other,
    );
    assert!(
        e.contains("arms[0].holder.projection") && e.contains("4 layers"),
        "{e}"
    );
}

#[test]
fn resources_that_cannot_be_built_fail_before_any_work() {
    let none = |_: &str| -> tolerable_driver::Result<ModelConfig> { unreachable!() };
    // A codebook larger than its bank.
    let e = validate(
        "[resources.keys]\nkind = \"key_bank\"\nsize = 10\n[resources.cb]\nkind = \"codebook\"\nbank = \"keys\"\nconstruction = \"kmeans\"\nsize = 11\n[[arms]]\nname = \"a\"\ninject = { carrier = \"k\", source = { codebook = { codebook = \"cb\", snapping = \"l2\" } } }\n",
        &none,
    );
    assert!(
        e.contains("[resources.cb]") && e.contains("larger than its bank"),
        "{e}"
    );
    // A bank fitted on the evaluation split.
    let e = validate(
        "[resources.keys]\nkind = \"key_bank\"\ndata = \"squad_dev\"\n[[arms]]\nname = \"a\"\ninject = { carrier = \"k\", source = { bank = { bank = \"keys\", neighbour = 1 } } }\n",
        &none,
    );
    assert!(
        e.contains("[resources.keys]") && e.contains("squad_dev"),
        "{e}"
    );
    // A codebook on a resource that is not declared, and a dependency cycle, fail at parse time.
    let text = "[run]\nname = \"x\"\n[data]\nsource = \"synthetic\"\nn = 2\n[resources.cb]\nkind = \"codebook\"\nbank = \"nope\"\nconstruction = \"pca\"\nsize = 4\n";
    let e = SweepConfig::parse(text).unwrap_err().to_string();
    assert!(e.contains("nope") && e.contains("not declared"), "{e}");
    let text = "[run]\nname = \"x\"\n[data]\nsource = \"synthetic\"\nn = 2\n[resources.keys]\nkind = \"key_bank\"\nsise = 3\n";
    let e = SweepConfig::parse(text).unwrap_err().to_string();
    assert!(e.contains("[resources.keys]") && e.contains("sise"), "{e}");
}

#[test]
fn fitted_maps_that_cannot_be_fitted_or_applied_fail_before_any_work() {
    let none = |_: &str| -> tolerable_driver::Result<ModelConfig> { unreachable!() };
    let pairs = "[resources.p]\nkind = \"key_pairs\"\nsender = { requantize = \"Q4_0\" }\n";
    let arm = |map: &str| {
        format!("[[arms]]\nname = \"a\"\nbase = \"full\"\nholder = {{ requantize = \"Q4_0\" }}\ninject = {{ carrier = \"k\", source = \"holder\", map = \"{map}\" }}\n")
    };
    let check = |resources: &str, arms: &str, want: &[&str]| {
        let e = validate(&format!("{resources}{arms}"), &none);
        for w in want {
            assert!(e.contains(w), "{w} not in: {e}");
        }
    };
    // Zero training items; a sender that cannot be built; no input, or two.
    check(
        "[resources.p]\nkind = \"key_pairs\"\nsender = { requantize = \"Q4_0\" }\ntrain_items = 0\n[resources.m]\nkind = \"fitted_map\"\npairs = \"p\"\nmethod = \"least_squares\"\n",
        &arm("m"),
        &["[resources.p].train_items"],
    );
    check(
        "[resources.p]\nkind = \"key_pairs\"\nsender = { requantize = \"Q7_0\" }\n[resources.m]\nkind = \"fitted_map\"\npairs = \"p\"\nmethod = \"least_squares\"\n",
        &arm("m"),
        &["[resources.p].sender.requantize", "Q7_0"],
    );
    check(
        "[resources.p]\nkind = \"key_pairs\"\n[resources.m]\nkind = \"fitted_map\"\npairs = \"p\"\nmethod = \"least_squares\"\n",
        &arm("m"),
        &["[resources.p]", "exactly one"],
    );
    check(
        "[resources.p]\nkind = \"key_pairs\"\nsender = { weight_cosine = 0.99 }\nnoise_cosine = 0.9\n[resources.m]\nkind = \"fitted_map\"\npairs = \"p\"\nmethod = \"least_squares\"\n",
        &arm("m"),
        &["[resources.p]", "exactly one"],
    );
    check(
        "[resources.p]\nkind = \"key_pairs\"\nnoise_cosine = 1.5\n[resources.m]\nkind = \"fitted_map\"\npairs = \"p\"\nmethod = \"least_squares\"\n",
        &arm("m"),
        &["[resources.p].noise_cosine", "1.5"],
    );
    check(
        "[resources.p]\nkind = \"key_pairs\"\nnoise_cosine = 0.0\n[resources.m]\nkind = \"fitted_map\"\npairs = \"p\"\nmethod = \"least_squares\"\n",
        &arm("m"),
        &["[resources.p].noise_cosine", "(0, 1]"],
    );
    // Hidden size 0, a parameter of another method, a rank beyond head_dim (16).
    check(
        &format!("{pairs}[resources.m]\nkind = \"fitted_map\"\npairs = \"p\"\nmethod = \"mlp\"\nhidden = 0\n"),
        &arm("m"),
        &["[resources.m].hidden", "hidden size 0"],
    );
    check(
        &format!("{pairs}[resources.m]\nkind = \"fitted_map\"\npairs = \"p\"\nmethod = \"mlp\"\nridge = 0.1\n"),
        &arm("m"),
        &["[resources.m].ridge", "mlp"],
    );
    check(
        &format!("{pairs}[resources.m]\nkind = \"fitted_map\"\npairs = \"p\"\nmethod = \"least_squares_wk\"\nrank = 17\n"),
        &arm("m"),
        &["[resources.m].rank", "17"],
    );
    check(
        &format!("{pairs}[resources.m]\nkind = \"fitted_map\"\npairs = \"p\"\nmethod = \"mlp\"\nobjective = \"mse\"\nmargin = 0.9\n"),
        &arm("m"),
        &["[resources.m].margin", "hinge"],
    );
    check(
        &format!("{pairs}[resources.b]\nkind = \"key_bank\"\n[resources.m]\nkind = \"fitted_map\"\npairs = \"b\"\nmethod = \"least_squares\"\n"),
        &arm("m"),
        &["[resources.m].pairs", "not key pairs"],
    );
    let ls = format!(
        "{pairs}[resources.m]\nkind = \"fitted_map\"\npairs = \"p\"\nmethod = \"least_squares\"\n"
    );
    // The arm must feed the map what it was fitted on, to keys in their slots.
    check(
        &ls,
        "[[arms]]\nname = \"a\"\nbase = \"full\"\ninject = { carrier = \"k\", source = \"native\", map = \"m\" }\n",
        &["arms[0].inject[0].source", "requantize=Q4_0"],
    );
    check(
        &ls,
        "[[arms]]\nname = \"a\"\nbase = \"full\"\nholder = { requantize = \"Q8_0\" }\ninject = { carrier = \"k\", source = \"holder\", map = \"m\" }\n",
        &["arms[0].inject[0].source", "holder"],
    );
    check(
        &ls,
        "[[arms]]\nname = \"a\"\nbase = \"full\"\nholder = { requantize = \"Q4_0\" }\ninject = { carrier = \"kv\", source = \"holder\", map = \"m\" }\n",
        &["arms[0].inject[0].carrier"],
    );
    check(
        &ls,
        &arm("p"),
        &["arms[0].inject[0].map", "not a fitted map"],
    );
    check(
        &ls,
        &arm("absent"),
        &["arms[0].inject[0].map", "[resources.absent]"],
    );
    check(
        "[resources.p]\nkind = \"key_pairs\"\nnoise_cosine = 0.9\n[resources.m]\nkind = \"fitted_map\"\npairs = \"p\"\nmethod = \"least_squares\"\n",
        "[[arms]]\nname = \"a\"\nbase = \"full\"\ninject = { carrier = \"k\", source = \"native\", perturb = { kind = \"cosine_noise\", target_cosine = 0.8 }, map = \"m\" }\n",
        &["arms[0].inject[0].perturb", "0.9"],
    );
    // An unknown method fails at parse time, naming the value.
    let text = format!("[run]\nname = \"x\"\n[data]\nsource = \"synthetic\"\nn = 2\n{pairs}[resources.m]\nkind = \"fitted_map\"\npairs = \"p\"\nmethod = \"ridge\"\n");
    let e = SweepConfig::parse(&text).unwrap_err().to_string();
    assert!(e.contains("[resources.m]") && e.contains("ridge"), "{e}");
    // A sender needs the receiver's f32 weights.
    let text = format!("[run]\nname = \"x\"\nmodel = \"receiver\"\nprecision = \"quantized\"\n[data]\nsource = \"synthetic\"\nn = 2\n{ls}{}", arm("m"));
    let cfg = SweepConfig::parse(&text).unwrap();
    let e = tolerable_driver::compile(&cfg, &receiver(), "receiver", &none)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("[resources.p].sender") && e.contains("f32"),
        "{e}"
    );
}

#[test]
fn the_one_row_kernel_is_in_the_hash_only_when_on() {
    let base = r#"
[run]
name = "k"

[data]
source = "synthetic"
n = 2

[[arms]]
name = "native"
base = "full"
"#;
    let with = |line: &str| base.replace("name = \"k\"", &format!("name = \"k\"\n{line}"));
    let off = SweepConfig::parse(base).unwrap();
    let explicit_off = SweepConfig::parse(&with("row_kernel = false")).unwrap();
    let on = SweepConfig::parse(&with("row_kernel = true")).unwrap();
    assert!(!off.run.row_kernel && on.run.row_kernel);
    // Configs written before the option hash as they did: resumable.
    assert_eq!(off.hash(), explicit_off.hash());
    assert!(!serde_json::to_string(&off.run)
        .unwrap()
        .contains("row_kernel"));
    assert_ne!(off.hash(), on.hash());
    let e = SweepConfig::parse(&with("row_kernel = \"yes\""))
        .unwrap_err()
        .to_string();
    assert!(e.contains("[run] row_kernel: invalid type"), "{e}");
    // Item batching: 1 (each item's arms alone) hashes as before the
    // option; above 1 it is another config; 0 is refused by name.
    let one = SweepConfig::parse(&with("item_batch = 1")).unwrap();
    let four = SweepConfig::parse(&with("item_batch = 4")).unwrap();
    assert_eq!(off.run.item_batch, 1);
    assert_eq!(off.hash(), one.hash());
    assert!(!serde_json::to_string(&off.run)
        .unwrap()
        .contains("item_batch"));
    assert_ne!(off.hash(), four.hash());
    let e = SweepConfig::parse(&with("item_batch = 0"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("`item_batch` must be at least 1"), "{e}");
    // Each arm alone: off hashes as before the option, on is another
    // config, and it is refused beside the settings that batch arms.
    let alone = SweepConfig::parse(&with("one_at_a_time = true")).unwrap();
    assert!(alone.run.one_at_a_time && !off.run.one_at_a_time);
    assert!(!serde_json::to_string(&off.run)
        .unwrap()
        .contains("one_at_a_time"));
    assert_ne!(off.hash(), alone.hash());
    for other in ["item_batch = 2", "batch_bridges = true"] {
        let e = SweepConfig::parse(&with(&format!("one_at_a_time = true\n{other}")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`one_at_a_time` decodes every arm alone"), "{e}");
    }
    // A wrongly typed field is named in any table.
    let e = SweepConfig::parse(&base.replace("n = 2", "n = \"two\""))
        .unwrap_err()
        .to_string();
    assert!(e.contains("[data] n: invalid type"), "{e}");
}
