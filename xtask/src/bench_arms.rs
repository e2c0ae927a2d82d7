//! The driver's speed figures in `cargo xtask bench`: the cost of one
//! cache-only arm as a fraction of a full passage prefill, and arm-items per
//! second for a 20-arm KV grid batched per item, against the same arms run
//! one at a time (each arm's question and decoding alone) and, when asked,
//! with every arm of several items padded into one batch; a few-arm
//! plan's items decoded per item against several items padded into one
//! batch; and bridged arms decoded as one batch against each bridge alone.

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use std::collections::BTreeMap;
use std::time::Instant;
use tolerable_driver::config::SweepConfig;
use tolerable_driver::plan::{compile, Plan};
use tolerable_driver::{Batching, ItemJob, Runner};
use tolerable_probe::{SplitItem, SplitOptions};
use tolerable_runtime::{Checkpoint, HookSpec, LogitsAt};

/// 20 KV-only arms: genuine interpolation toward the native cache at the
/// fact region, alpha 0.05 .. 1.0.
fn grid_config() -> Result<SweepConfig> {
    let alphas: Vec<String> = (1..=20)
        .map(|i| format!("{:.2}", i as f64 * 0.05))
        .collect();
    let text = format!(
        "[run]\nname = \"bench\"\n[data]\nsource = \"synthetic\"\nn = 1\n\
         [[arms]]\nname = \"kv_interp\"\n\
         inject = {{ carrier = \"kv\", positions = \"fact_region\", source = \"native\", mechanism = \"interpolate\", alpha = 0.5 }}\n\
         grid = {{ alpha = [{}] }}\n",
        alphas.join(", ")
    );
    Ok(SweepConfig::parse(&text)?)
}

/// The plan of `cfg` on `ck` without the anchors the config adds: only the
/// named arms are timed.
fn arms_only(cfg: &SweepConfig, ck: &Checkpoint) -> Result<Plan> {
    let mut plan = compile(cfg, ck.model.config(), &ck.id, &|_| unreachable!())?;
    plan.programs.retain(|p| !cfg.arms[p.index].arm.is_anchor());
    Ok(plan)
}

fn bar(n: usize, what: &str) -> ProgressBar {
    let b = ProgressBar::new(n as u64);
    b.set_style(
        ProgressStyle::with_template("{prefix} {bar:30} {pos}/{len} {per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    b.set_prefix(what.to_string());
    b
}

/// Runs the figures on `items` (batched over all of them, one at a time over
/// the first `baseline_n`; with `item_batch` above 1, also every arm of
/// `item_batch` items padded into one batch) and returns them as JSON.
pub fn run(
    ck: &Checkpoint,
    items: &[SplitItem],
    baseline_n: usize,
    new_tokens: usize,
    item_batch: usize,
) -> Result<serde_json::Value> {
    let cfg = grid_config()?;
    let plan = arms_only(&cfg, ck)?;
    let n_arms = plan.programs.len();
    let m = &ck.model;
    let none = BTreeMap::new();
    let batched = Runner::new(m, &plan, &none, new_tokens, 0);
    let single = Runner::new(m, &plan, &none, new_tokens, 0).with_batching(Batching::OneAtATime);

    // Full passage prefill, on the first items.
    let mut prefill_s = Vec::new();
    let timed = &items[..items.len().min(10)];
    let b = bar(timed.len(), "passage prefill");
    for it in timed {
        let ctx: Vec<u32> = [&it.prefix_ids[..], &it.full_passage].concat();
        let t = Instant::now();
        let mut c = m.new_cache(1);
        m.forward(&m.tokens(&[ctx])?, &mut c, &HookSpec::new(), LogitsAt::None)?;
        prefill_s.push(t.elapsed().as_secs_f64());
        b.inc(1);
    }
    b.finish_and_clear();
    let b = bar(items.len(), "20-arm grid, batched");
    let mut passes_s = Vec::new();
    let mut own_s = Vec::new();
    let t = Instant::now();
    let mut batched_tokens = Vec::new();
    for (i, it) in items.iter().enumerate() {
        let (outs, timing) = batched.run_item_timed(&it.pair(), i, &[])?;
        batched_tokens.push(outs.into_iter().map(|o| o.tokens).collect::<Vec<_>>());
        passes_s.push(timing.passes_s);
        own_s.push(timing.prepare_s + timing.decode_s);
        b.inc(1);
    }
    let batched_s = t.elapsed().as_secs_f64();
    b.finish_and_clear();
    let base = &items[..baseline_n.min(items.len())];
    let b = bar(base.len(), "20-arm grid, one at a time");
    let t = Instant::now();
    for (i, it) in base.iter().enumerate() {
        single.run_item(&it.pair(), i, &[])?;
        b.inc(1);
    }
    let single_s = t.elapsed().as_secs_f64();
    b.finish_and_clear();
    // The same grid with the arms of `item_batch` items as one padded batch.
    let padded = (item_batch > 1)
        .then(|| -> Result<(f64, Vec<f64>, usize)> {
            let runner =
                Runner::new(m, &plan, &none, new_tokens, 0).with_batching(Batching::Padded);
            let pairs: Vec<_> = items.iter().map(|it| it.pair()).collect();
            let jobs = ItemJob::without_partners(&pairs);
            let b = bar(
                jobs.len(),
                &format!("20-arm grid, {item_batch} items padded"),
            );
            let t = Instant::now();
            let mut own = Vec::new();
            let mut tokens = Vec::new();
            for chunk in jobs.chunks(item_batch) {
                for (outs, timing) in runner.run_items_timed(chunk)? {
                    own.push(timing.prepare_s + timing.decode_s);
                    tokens.push(outs.into_iter().map(|o| o.tokens).collect::<Vec<_>>());
                }
                b.inc(chunk.len() as u64);
            }
            let padded_s = t.elapsed().as_secs_f64();
            b.finish_and_clear();
            let agree = tokens
                .iter()
                .zip(&batched_tokens)
                .flat_map(|(p, q)| p.iter().zip(q).filter(|(x, y)| x == y))
                .count();
            Ok((padded_s, own, agree))
        })
        .transpose()?;

    let sum = |v: &[f64]| v.iter().sum::<f64>();
    let n = items.len() as f64;
    let nb = base.len() as f64;
    let batched_rate = n * n_arms as f64 / batched_s;
    let single_rate = nb * n_arms as f64 / single_s;
    let passes_per_item = sum(&passes_s) / n;
    let prefill_per_item = sum(&prefill_s) / prefill_s.len() as f64;
    let timed_tokens =
        timed.iter().map(|i| i.context_len()).sum::<usize>() as f64 / timed.len() as f64;
    // One arm's own work: its cache edit plus its share of the batched question
    // and decoding, on the same items as the prefill.
    let arm_s = sum(&own_s[..timed.len()]) / timed.len() as f64 / n_arms as f64;
    // Independent runs: every arm also recomputes the item's passes.
    let independent_rate = nb * n_arms as f64
        / (single_s + nb * n_arms as f64 * passes_per_item - nb * passes_per_item);
    let mean_tokens = items.iter().map(|i| i.context_len()).sum::<usize>() as f64 / n;
    eprintln!(
        "  20-arm KV grid: batched {batched_rate:.2} arm-items/s (n={}), one at a time {single_rate:.2} (n={}), speedup {:.2}x; independent runs {independent_rate:.2} ({:.2}x)",
        items.len(),
        base.len(),
        batched_rate / single_rate,
        batched_rate / independent_rate
    );
    eprintln!(
        "  one KV-only arm: {:.3} s against a {timed_tokens:.0}-token passage prefill of {prefill_per_item:.3} s ({:.1}%)",
        arm_s,
        100.0 * arm_s / prefill_per_item
    );
    let mut out = serde_json::json!({
        "arms": n_arms,
        "items_batched": items.len(),
        "items_one_at_a_time": base.len(),
        "mean_context_tokens": mean_tokens,
        "prefill_items": timed.len(),
        "prefill_mean_context_tokens": timed_tokens,
        "new_tokens": new_tokens,
        "passage_prefill_s": prefill_per_item,
        "shared_passes_s": passes_per_item,
        "kv_arm_s": arm_s,
        "kv_arm_fraction_of_prefill": arm_s / prefill_per_item,
        "kv_arm_share_of_prefill": arm_s / prefill_per_item,
        "arm_items_per_s_batched": batched_rate,
        "arm_items_per_s_one_at_a_time": single_rate,
        "arm_items_per_s_independent_runs": independent_rate,
        "kv_grid_speedup_vs_one_at_a_time": batched_rate / single_rate,
        "kv_grid_speedup_vs_independent_runs": batched_rate / independent_rate,
    });
    if let Some((padded_s, own, agree)) = padded {
        let padded_rate = n * n_arms as f64 / padded_s;
        let padded_arm_s = sum(&own[..timed.len()]) / timed.len() as f64 / n_arms as f64;
        eprintln!(
            "  20-arm KV grid, {item_batch} items padded: {padded_rate:.2} arm-items/s, {:.2}x one at a time; one KV-only arm {padded_arm_s:.3} s ({:.1}% of a prefill); {agree}/{} continuations agree with per-item batching",
            padded_rate / single_rate,
            100.0 * padded_arm_s / prefill_per_item,
            items.len() * n_arms
        );
        out["items_padded"] = serde_json::json!({
            "item_batch": item_batch,
            "arm_items_per_s": padded_rate,
            "kv_grid_speedup_vs_one_at_a_time": padded_rate / single_rate,
            "kv_grid_speedup_vs_per_item_batching": padded_rate / batched_rate,
            "kv_arm_s": padded_arm_s,
            "kv_arm_share_of_prefill": padded_arm_s / prefill_per_item,
            "continuations_agree_with_per_item_batching": agree,
            "continuations": items.len() * n_arms,
        });
    }
    Ok(out)
}

/// Items padded into one batch against each item's arms batched alone, on a
/// few-arm plan of three cache layouts (the floor, the native pass, KV
/// augmentation from the holder, keys under cosine noise): arm-items per
/// second both ways over the same items, `k` items a padded batch, and how
/// many continuations agree (padding changes float rounding only).
pub fn item_batching(
    ck: &Checkpoint,
    items: &[SplitItem],
    k: usize,
    new_tokens: usize,
) -> Result<serde_json::Value> {
    let text = "[run]\nname = \"bench-items\"\n[data]\nsource = \"synthetic\"\nn = 1\n\
         [[arms]]\nname = \"kv_augment\"\n\
         inject = { carrier = \"kv\", positions = \"passage\", source = \"holder\", mechanism = \"append\" }\n\
         [[arms]]\nname = \"k_noise\"\nbase = \"full\"\n\
         inject = { carrier = \"k\", positions = \"passage\", source = \"native\", perturb = { kind = \"cosine_noise\", target_cosine = 0.9 } }\n";
    let cfg = SweepConfig::parse(text)?;
    let plan = compile(&cfg, ck.model.config(), &ck.id, &|_| unreachable!())?;
    let n_arms = plan.programs.len();
    let none = BTreeMap::new();
    let m = &ck.model;
    let per_item = Runner::new(m, &plan, &none, new_tokens, 0);
    let padded = Runner::new(m, &plan, &none, new_tokens, 0).with_batching(Batching::Padded);
    let pairs: Vec<_> = items.iter().map(|it| it.pair()).collect();
    let jobs = ItemJob::without_partners(&pairs);
    // One untimed item first, so neither way pays the first call's warm-up.
    if let Some(first) = jobs.first() {
        per_item.run_items_timed(std::slice::from_ref(first))?;
    }
    let b = bar(jobs.len(), "few arms, per item");
    let t = Instant::now();
    let mut alone = Vec::new();
    for job in &jobs {
        alone.extend(per_item.run_items_timed(std::slice::from_ref(job))?);
        b.inc(1);
    }
    let per_item_s = t.elapsed().as_secs_f64();
    b.finish_and_clear();
    let b = bar(jobs.len(), &format!("few arms, {k} items padded"));
    let t = Instant::now();
    let mut together = Vec::new();
    for chunk in jobs.chunks(k.max(1)) {
        together.extend(padded.run_items_timed(chunk)?);
        b.inc(chunk.len() as u64);
    }
    let padded_s = t.elapsed().as_secs_f64();
    b.finish_and_clear();
    let agree = alone
        .iter()
        .zip(&together)
        .flat_map(|((a, _), (p, _))| a.iter().zip(p).map(|(x, y)| x.tokens == y.tokens))
        .filter(|&same| same)
        .count();
    let n = jobs.len() as f64 * n_arms as f64;
    eprintln!(
        "  {n_arms} arms: per item {:.2} arm-items/s, {k} items padded {:.2} ({:.2}x); {agree}/{n} continuations agree",
        n / per_item_s,
        n / padded_s,
        per_item_s / padded_s
    );
    Ok(serde_json::json!({
        "arms": n_arms,
        "items": jobs.len(),
        "item_batch": k,
        "new_tokens": new_tokens,
        "arm_items_per_s_per_item": n / per_item_s,
        "arm_items_per_s_padded": n / padded_s,
        "item_batch_speedup": per_item_s / padded_s,
        "continuations_agree": agree,
        "continuations": n as usize,
    }))
}

/// Where the benches' resources take training items: squad_train when a
/// SQuAD folder is known, else synthetic items.
pub fn training_source(squad: Option<&std::path::Path>) -> &'static str {
    if squad.is_some() || std::env::var_os("TOLERABLE_SQUAD_DIR").is_some() {
        "squad_train"
    } else {
        "synthetic"
    }
}

/// Builds resource `name` of `kind` from scratch on the receiver, as a
/// sweep would (training items drawn from squad_train at `squad`, else the
/// synthetic source the spec names; `eval` kept out), never from the cache.
/// Returns the training items, the value and the build's seconds (drawing
/// the items included).
pub fn build_fresh(
    ck: &Checkpoint,
    squad: Option<&std::path::Path>,
    name: &str,
    kind: &dyn tolerable_driver::resources::ResourceKind,
    eval: &[SplitItem],
) -> Result<(Vec<SplitItem>, tolerable_driver::resources::Value, f64)> {
    use tolerable_driver::resources::{BuildCx, EvalSet, TrainCx};
    let mut data = BTreeMap::new();
    if let Some(p) = squad {
        data.insert("squad_train".to_string(), p.to_path_buf());
    }
    let eval = EvalSet::of(eval);
    let split = SplitOptions::default();
    let deps = BTreeMap::new();
    let cx = BuildCx {
        train: TrainCx {
            tokenizer: &ck.tokenizer,
            split: &split,
            data: &data,
            eval: &eval,
            field: format!("[resources.{name}]"),
            receiver: ck.model.config(),
        },
        model: &ck.model,
        senders: &BTreeMap::new(),
        deps: &deps,
        holders: &BTreeMap::new(),
        scratch: &Default::default(),
        // A benchmark times whole builds: no resume, no examples kept.
        progress: None,
        shared_dir: None,
        resumed_after: Default::default(),
    };
    let t = Instant::now();
    let train = kind.training_items(&cx.train)?;
    let value = kind.build(&cx, &train)?;
    Ok((train, value, t.elapsed().as_secs_f64()))
}

/// SQuAD dev items for the figures (synthetic items where no SQuAD path is known).
pub fn items(ck: &Checkpoint, n: usize, squad: Option<&std::path::Path>) -> Result<Vec<SplitItem>> {
    let raw = match tolerable_probe::squad::resolve_path(squad, tolerable_probe::squad::Split::Dev)
    {
        Ok(p) => tolerable_probe::squad::load(&p)?,
        Err(e) => {
            eprintln!("  no SQuAD ({e}); using synthetic items");
            tolerable_probe::synthetic::generate(n * 2, 0)
        }
    };
    let s = tolerable_probe::sample::sample(&raw, &ck.tokenizer, &SplitOptions::default(), n, 0)?;
    Ok(s.items)
}

/// The key bank's figures: the time to build a bank (training passages read
/// and keys sampled; not from the cache) and the per-item cost of a bank arm
/// (every passage key of C* replaced by its nearest genuine key) against
/// the same substitution from the native cache itself (a KV-only arm), each
/// run alone: its cache edit, its question and its decoding.
pub fn bank(
    ck: &Checkpoint,
    items: &[SplitItem],
    squad: Option<&std::path::Path>,
    size: usize,
    contexts: usize,
    new_tokens: usize,
) -> Result<serde_json::Value> {
    use tolerable_driver::resources::KeyBankSpec;
    let data_source = training_source(squad);
    let text = format!(
        "[run]\nname = \"bench-bank\"\n[data]\nsource = \"synthetic\"\nn = 1\n\
         [resources.bank]\nkind = \"key_bank\"\nsize = {size}\ncontexts = {contexts}\ndata = \"{data_source}\"\n\
         [[arms]]\nname = \"kv_only\"\nbase = \"full\"\n\
         inject = {{ carrier = \"k\", positions = \"passage\", source = \"native\" }}\n\
         [[arms]]\nname = \"bank\"\nbase = \"full\"\n\
         inject = {{ carrier = \"k\", positions = \"passage\", source = {{ bank = {{ bank = \"bank\", neighbour = 1 }} }} }}\n"
    );
    let cfg = SweepConfig::parse(&text)?;
    let spec: KeyBankSpec = match &cfg.resources["bank"] {
        tolerable_driver::resources::ResourceSpec::KeyBank(s) => s.clone(),
        _ => unreachable!("declared as a key bank above"),
    };
    let (_, value, build_s) = build_fresh(ck, squad, "bank", &spec, items)?;
    let resources = BTreeMap::from([("bank".to_string(), value)]);
    eprintln!("  key bank of {size} keys from {contexts} passages built in {build_s:.1} s");
    let plan = arms_only(&cfg, ck)?;
    let mut per_arm = Vec::new();
    for program in &plan.programs {
        let mut one = plan.clone();
        one.programs = vec![program.clone()];
        let runner = Runner::new(&ck.model, &one, &resources, new_tokens, 0);
        let b = bar(items.len(), &format!("{} arm alone", program.name));
        let mut own = Vec::new();
        for (i, it) in items.iter().enumerate() {
            let (_, timing) = runner.run_item_timed(&it.pair(), i, &[])?;
            own.push(timing.prepare_s + timing.decode_s);
            b.inc(1);
        }
        b.finish_and_clear();
        per_arm.push(own.iter().sum::<f64>() / own.len() as f64);
    }
    let (kv_s, bank_s) = (per_arm[0], per_arm[1]);
    eprintln!(
        "  per item, alone: KV-only arm {kv_s:.3} s, bank arm {bank_s:.3} s ({:.2}x)",
        bank_s / kv_s
    );
    Ok(serde_json::json!({
        "bank_size": size,
        "bank_contexts": contexts,
        "bank_data": data_source,
        "bank_build_s": build_s,
        "items": items.len(),
        "kv_only_arm_s": kv_s,
        "bank_arm_s": bank_s,
        "bank_arm_vs_kv_only_arm": bank_s / kv_s,
    }))
}

/// Bridged arms decoded as one batch, each sequence with its own adapters
/// (`[run] batch_bridges`), against the same arms with each bridge's arms
/// decoding alone (the default), on the ladder's shape: the raw KV
/// augmentation arm, a q, a k+v and a q+k+v adapter on it, and their
/// zero-init gates. The adapters are built fresh (one training item, one
/// step: B is no longer zero; their values do not change the cost). Both
/// ways run the same items after one untimed item each: arm-items per
/// second, the decode batches each took, how many continuations agree, and
/// whether every zero-init gate held both ways.
pub fn bridge_batching(
    ck: &Checkpoint,
    items: &[SplitItem],
    squad: Option<&std::path::Path>,
    new_tokens: usize,
) -> Result<serde_json::Value> {
    let source = training_source(squad);
    let inject = "{ carrier = \"kv\", layers = \"all\", positions = \"passage\", source = \"holder\", mechanism = \"append\" }";
    let mut text =
        String::from("[run]\nname = \"bench-bridges\"\n[data]\nsource = \"synthetic\"\nn = 1\n");
    for t in ["q", "kv", "qkv"] {
        text += &format!(
            "[resources.b_{t}]\nkind = \"bridge\"\ntargets = \"{t}\"\ntrain_items = 1\nslice_items = 1\nepochs = 1\ndata = \"{source}\"\narm = {{ inject = [{inject}] }}\n"
        );
    }
    text += &format!("[[arms]]\nname = \"kv_augment\"\ninject = {inject}\n");
    let grid = "grid = { \"bridge.resource\" = [\"b_q\", \"b_kv\", \"b_qkv\"] }";
    text += &format!(
        "[[arms]]\nname = \"bridged\"\nbridge = {{ resource = \"b_q\" }}\ninject = {inject}\n{grid}\n"
    );
    text += &format!(
        "[[arms]]\nname = \"zero_init\"\nbridge = {{ resource = \"b_q\", init = true }}\nexpect = {{ arm = \"kv_augment\" }}\ninject = {inject}\n{grid}\n"
    );
    let cfg = SweepConfig::parse(&text)?;
    let plan = arms_only(&cfg, ck)?;
    let n_arms = plan.programs.len();
    let mut resources = BTreeMap::new();
    for (name, spec) in &plan.resources {
        let (_, value, _) = build_fresh(ck, squad, name, spec.kind(), items)?;
        resources.insert(name.clone(), value);
    }
    let m = &ck.model;
    // The same arms with `[run] batch_bridges = true`.
    let mut batched_cfg = cfg.clone();
    batched_cfg.run.batch_bridges = true;
    let batched_plan = arms_only(&batched_cfg, ck)?;
    let alone = Runner::new(m, &plan, &resources, new_tokens, 0);
    let together = Runner::new(m, &batched_plan, &resources, new_tokens, 0);
    let pairs: Vec<_> = items.iter().map(|it| it.pair()).collect();
    /// One way's seconds, decode batches, continuations (per item, per
    /// arm) and zero-init gates that held.
    struct Timed {
        seconds: f64,
        batches: usize,
        tokens: Vec<Vec<Vec<u32>>>,
        gated: usize,
    }
    let time = |runner: &Runner, what: &str| -> Result<Timed> {
        // One untimed item first: neither way pays the first call's warm-up.
        if let Some(first) = pairs.first() {
            runner.run_item(first, 0, &[])?;
        }
        let b = bar(pairs.len(), what);
        let (mut batches, mut tokens, mut gated) = (0, Vec::new(), 0);
        let t = Instant::now();
        for (i, pair) in pairs.iter().enumerate() {
            let (outs, timing) = runner.run_item_timed(pair, i, &[])?;
            batches += timing.batches;
            gated += outs.iter().filter(|o| o.bit_exact == Some(true)).count();
            tokens.push(outs.into_iter().map(|o| o.tokens).collect());
            b.inc(1);
        }
        let seconds = t.elapsed().as_secs_f64();
        b.finish_and_clear();
        Ok(Timed {
            seconds,
            batches,
            tokens,
            gated,
        })
    };
    let a = time(&alone, "bridges, each alone")?;
    let b = time(&together, "bridges, one batch")?;
    let (alone_s, alone_batches, alone_gated) = (a.seconds, a.batches, a.gated);
    let (together_s, together_batches, together_gated) = (b.seconds, b.batches, b.gated);
    let agree = a
        .tokens
        .iter()
        .zip(&b.tokens)
        .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| x == y))
        .filter(|&same| same)
        .count();
    let n = pairs.len() as f64 * n_arms as f64;
    let gates = 3 * pairs.len();
    eprintln!(
        "  {n_arms} arms, 3 bridges: each alone {:.2} arm-items/s ({alone_batches} decode batches), one batch {:.2} ({together_batches}; {:.2}x); {agree}/{n} continuations agree; zero-init gates {alone_gated}/{gates} and {together_gated}/{gates}",
        n / alone_s,
        n / together_s,
        alone_s / together_s
    );
    Ok(serde_json::json!({
        "arms": n_arms,
        "bridges": 3,
        "items": pairs.len(),
        "new_tokens": new_tokens,
        "arm_items_per_s_alone": n / alone_s,
        "arm_items_per_s_batched": n / together_s,
        "bridge_batching_speedup": alone_s / together_s,
        "decode_batches_alone": alone_batches,
        "decode_batches_batched": together_batches,
        "continuations_agree": agree,
        "continuations": n as usize,
        "zero_init_exact_alone": alone_gated,
        "zero_init_exact_batched": together_gated,
        "zero_init_gates": gates,
    }))
}
