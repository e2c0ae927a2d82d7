//! The training figure of `cargo xtask bench`: the wall time of training one
//! bridge from scratch on the real receiver (PROTOCOL §7; the target
//! is a q-LoRA on the 0.5B, 200 items, 4 epochs, under 20 minutes), against
//! a passage prefill measured in the same run. The bridge is built by the
//! driver's own resource code (example caches, training steps, slice
//! scoring per epoch), never loaded from the cache.

use anyhow::{bail, Result};
use std::time::Instant;
use tolerable_driver::config::SweepConfig;
use tolerable_driver::resources::{ResourceKind, ResourceSpec};
use tolerable_runtime::{Checkpoint, HookSpec, LogitsAt};

/// What to train.
pub struct TrainBench<'a> {
    /// `q`, `kv`, `qkv` (adapters on the KV augmentation arm).
    pub targets: &'a str,
    /// Training items.
    pub items: usize,
    /// Slice items (keep-best).
    pub slice: usize,
    /// Epochs.
    pub epochs: usize,
    /// Training examples a step.
    pub batch: usize,
    /// AdamW learning rate.
    pub lr: f64,
}

/// Trains the bridge and returns its figures as JSON.
pub fn run(
    ck: &Checkpoint,
    squad: Option<&std::path::Path>,
    b: &TrainBench,
) -> Result<serde_json::Value> {
    let data_source = crate::bench_arms::training_source(squad);
    let text = format!(
        "[run]\nname = \"bench-train\"\n[data]\nsource = \"synthetic\"\nn = 1\n\
         [resources.bridge]\nkind = \"bridge\"\ntargets = \"{}\"\nrank = 16\nalpha = 16.0\n\
         train_items = {}\nslice_items = {}\nepochs = {}\nbatch = {}\nlr = {:?}\nseed = 0\ndata = \"{data_source}\"\n\
         arm = {{ inject = [{{ carrier = \"kv\", layers = \"all\", positions = \"passage\", source = \"holder\", mechanism = \"append\" }}] }}\n\
         [[arms]]\nname = \"floor\"\nbase = \"masked\"\n",
        b.targets, b.items, b.slice, b.epochs, b.batch, b.lr
    );
    let cfg = SweepConfig::parse(&text)?;
    let spec = match &cfg.resources["bridge"] {
        ResourceSpec::Bridge(s) => s.clone(),
        _ => bail!("internal: the bench's bridge is not a bridge"),
    };
    spec.validate("[resources.bridge]", ck.model.config(), &cfg.resources)?;
    eprintln!(
        "  training a {}-LoRA: {} items + {} slice, {} epochs, {} a step ({data_source})",
        b.targets, b.items, b.slice, b.epochs, b.batch
    );
    let (train, value, build_s) = crate::bench_arms::build_fresh(ck, squad, "bridge", &spec, &[])?;
    // The baseline: a full-passage prefill of the first training items.
    let m = &ck.model;
    let mut prefill = Vec::new();
    for it in train.iter().take(5) {
        let ctx: Vec<u32> = [&it.prefix_ids[..], &it.full_passage].concat();
        let t = Instant::now();
        m.forward(
            &m.tokens(&[ctx])?,
            &mut m.new_cache(1),
            &HookSpec::new(),
            LogitsAt::None,
        )?;
        prefill.push(t.elapsed().as_secs_f64());
    }
    let prefill_s = prefill.iter().sum::<f64>() / prefill.len().max(1) as f64;
    let summary = spec.summary(&value);
    eprintln!(
        "  built in {build_s:.1} s ({:.1} min; {:.0} passage prefills of {prefill_s:.2} s)",
        build_s / 60.0,
        build_s / prefill_s
    );
    Ok(serde_json::json!({
        "targets": b.targets,
        "train_items": b.items,
        "slice_items": b.slice,
        "epochs": b.epochs,
        "batch": b.batch,
        "lr": b.lr,
        "data": data_source,
        "build_s": build_s,
        "build_min": build_s / 60.0,
        "passage_prefill_s": prefill_s,
        "build_vs_passage_prefill": build_s / prefill_s,
        "summary": summary,
    }))
}
