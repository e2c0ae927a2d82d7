//! `cargo xtask anchors`: the first measurement of the split-context probe —
//! floor (receiver reads the answer-masked passage) and native reference
//! (receiver reads the full passage) on n SQuAD dev items, with binomial SE.
//! The sweep machinery of the driver supersedes this for experiments.

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;
use tolerable_probe::sample::sample;
use tolerable_probe::score::{conditional, score};
use tolerable_probe::{squad, synthetic, SplitOptions, Template};
use tolerable_runtime::{GreedyOptions, Precision};
use tolerable_stats::{difference, Proportion};

/// Options of the anchors command.
#[derive(clap::Args)]
pub struct AnchorArgs {
    /// Model id or path.
    #[arg(long, default_value = "qwen2.5-coder-0.5b-instruct")]
    pub model: String,
    /// Items.
    #[arg(long, default_value_t = 200)]
    pub n: usize,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Prompt template: raw or chat.
    #[arg(long, default_value = "raw", value_parser = parse_template)]
    pub template: Template,
    /// SQuAD dev JSON or parquet file, a folder holding squad-dev.json, or
    /// `hf` for rajpurkar/squad through hf-hub (default: $TOLERABLE_SQUAD_DIR).
    #[arg(long)]
    pub squad: Option<PathBuf>,
    /// Use the synthetic fact probe instead of SQuAD.
    #[arg(long)]
    pub synthetic: bool,
    /// Longest prompt kept, in tokens (also capped by the model's context).
    #[arg(long, default_value_t = 512)]
    pub max_prompt_tokens: usize,
    /// Greedy tokens per item.
    #[arg(long, default_value_t = 8)]
    pub new_tokens: usize,
    /// Write summary and per-item rows as JSON here (resumable: finished
    /// items are logged beside it as they complete).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

fn parse_template(s: &str) -> std::result::Result<Template, String> {
    match s {
        "raw" => Ok(Template::Raw),
        "chat" => Ok(Template::Chat),
        other => Err(format!("unknown template `{other}` (raw or chat)")),
    }
}

#[derive(Serialize, serde::Deserialize)]
struct Row {
    item_id: String,
    prompt_tokens: usize,
    fact_tokens: usize,
    floor: String,
    native: String,
    floor_correct: bool,
    native_correct: bool,
    floor_span_copy: bool,
    native_span_copy: bool,
}

#[derive(Serialize)]
struct Anchor {
    accuracy: f64,
    se: f64,
    ci95: [f64; 2],
    correct: usize,
    n: usize,
    span_copy_rate: f64,
}

fn anchor(outcomes: &[bool], copies: &[bool]) -> Result<Anchor> {
    let p = Proportion::from_outcomes(outcomes)?;
    let ci = p.normal_ci95();
    Ok(Anchor {
        accuracy: p.p(),
        se: p.se(),
        ci95: [ci.lo, ci.hi],
        correct: p.successes,
        n: p.n,
        span_copy_rate: copies.iter().filter(|&&c| c).count() as f64 / copies.len() as f64,
    })
}

pub fn run(a: AnchorArgs) -> Result<()> {
    let dev = candle_core::Device::Cpu;
    let ck = tolerable_fetch::load(&a.model, Precision::F32, &dev)?;
    let (items, source) = if a.synthetic {
        (
            synthetic::generate(a.n.max(1) * 2, a.seed),
            format!("synthetic(seed={})", a.seed),
        )
    } else {
        let path = squad::resolve_path(a.squad.as_deref(), squad::Split::Dev)?;
        (squad::load(&path)?, path.display().to_string())
    };
    // A prompt plus its continuation must fit the model's context.
    let ctx = ck.model.config().context_length;
    if a.new_tokens >= ctx {
        anyhow::bail!(
            "--new-tokens {} leaves no room in a context of {ctx}",
            a.new_tokens
        );
    }
    let opts = SplitOptions {
        template: a.template.clone(),
        max_prompt_tokens: a.max_prompt_tokens.min(ctx - a.new_tokens),
        ..SplitOptions::default()
    };
    let s = sample(&items, &ck.tokenizer, &opts, a.n, a.seed)?;
    tracing::info!(
        "{} items from {source} (seed {}, {} considered, dropped {:?})",
        s.items.len(),
        a.seed,
        s.considered,
        s.dropped
    );
    let bar = ProgressBar::new(s.items.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{prefix} {bar:30} {pos}/{len} {per_sec} eta {eta}").unwrap(),
    );
    bar.set_prefix(format!("anchors {} {}", a.model, a.template.name()));
    let m = &ck.model;
    let gen = GreedyOptions::tokens(a.new_tokens);
    // Finished items are appended to `<out>.partial.jsonl` as they complete,
    // keyed by the run's settings, so an interrupted run resumes where it stopped.
    let key = serde_json::json!({"model": a.model, "template": a.template, "seed": a.seed, "n": a.n,
        "new_tokens": a.new_tokens, "max_prompt_tokens": a.max_prompt_tokens, "synthetic": a.synthetic}).to_string();
    let partial = a.out.as_ref().map(|o| o.with_extension("partial.jsonl"));
    let mut done: std::collections::HashMap<String, Row> = std::collections::HashMap::new();
    if let Some(p) = partial.as_ref().filter(|p| p.exists()) {
        let text = std::fs::read_to_string(p)?;
        let mut lines = text.lines();
        if lines.next() == Some(key.as_str()) {
            for l in lines {
                // A line cut short by a kill is simply redone.
                if let Ok(r) = serde_json::from_str::<Row>(l) {
                    done.insert(r.item_id.clone(), r);
                }
            }
            tracing::info!(
                "resuming: {} of {} items already done in {}",
                done.len(),
                s.items.len(),
                p.display()
            );
        } else {
            tracing::warn!("{} belongs to other settings; starting afresh", p.display());
            std::fs::remove_file(p)?;
        }
    }
    let mut log = match &partial {
        Some(p) => {
            let fresh = !p.exists();
            if let Some(dir) = p.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)?;
            if fresh {
                writeln!(f, "{key}")?;
            }
            Some(f)
        }
        None => None,
    };
    let mut rows = Vec::with_capacity(s.items.len());
    for it in &s.items {
        if let Some(r) = done.remove(&it.item.id) {
            rows.push(r);
            bar.inc(1);
            continue;
        }
        // Masked and full prompts have equal length and share every token
        // before the first fact position: read that prefix once, then run
        // the two prompts' remainders as one batch of two.
        let (masked, full) = (it.masked_prompt(), it.full_prompt());
        let shared = it.common_prefix_len();
        let mut prefix = m.new_cache(1);
        m.forward(
            &m.tokens(&[full[..shared].to_vec()])?,
            &mut prefix,
            &tolerable_runtime::HookSpec::new(),
            tolerable_runtime::LogitsAt::None,
        )?;
        let mut cache = prefix.repeat(2)?;
        let g = m.generate(
            &[masked[shared..].to_vec(), full[shared..].to_vec()],
            &mut cache,
            &gen,
        )?;
        let floor = ck.tokenizer.decode(&g.tokens[0])?;
        let native = ck.tokenizer.decode(&g.tokens[1])?;
        let passage = &it.item.context;
        let (sf, sn) = (
            score(&floor, &it.item.answers, passage),
            score(&native, &it.item.answers, passage),
        );
        let row = Row {
            item_id: it.item.id.clone(),
            prompt_tokens: full.len(),
            fact_tokens: it.fact_region.len(),
            floor,
            native,
            floor_correct: sf.correct,
            native_correct: sn.correct,
            floor_span_copy: sf.span_copy,
            native_span_copy: sn.span_copy,
        };
        if let Some(f) = log.as_mut() {
            writeln!(f, "{}", serde_json::to_string(&row)?)?;
        }
        rows.push(row);
        bar.inc(1);
    }
    bar.finish();
    let fc: Vec<bool> = rows.iter().map(|r| r.floor_correct).collect();
    let nc: Vec<bool> = rows.iter().map(|r| r.native_correct).collect();
    let floor = anchor(
        &fc,
        &rows.iter().map(|r| r.floor_span_copy).collect::<Vec<_>>(),
    )?;
    let native = anchor(
        &nc,
        &rows.iter().map(|r| r.native_span_copy).collect::<Vec<_>>(),
    )?;
    let d = difference(
        Proportion::from_outcomes(&nc)?,
        Proportion::from_outcomes(&fc)?,
    );
    let cond = conditional(&fc, &nc)
        .map(|(h, e)| serde_json::json!({"correct": h, "n": e, "accuracy": h as f64 / e as f64}));
    let summary = serde_json::json!({
        "model": a.model,
        "sha256": ck.sha256,
        "precision": "f32",
        "template": a.template,
        "data": source,
        "n": rows.len(),
        "seed": a.seed,
        "new_tokens": a.new_tokens,
        "max_prompt_tokens": a.max_prompt_tokens,
        "dropped": s.dropped,
        "floor": floor,
        "native": native,
        "native_minus_floor": d,
        "floor_conditional_on_native_correct": cond,
        "threads": candle_core::utils::get_num_threads(),
        "machine": tolerable_runtime::machine(),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
    });
    println!("{}", serde_json::to_string_pretty(&summary)?);
    if let Some(out) = a.out {
        if let Some(dir) = out.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let body = serde_json::json!({ "summary": summary, "items": rows });
        let tmp = out.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_string_pretty(&body)?)
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &out)?;
        if let Some(p) = partial {
            let _ = std::fs::remove_file(p);
        }
        eprintln!("wrote {}", out.display());
    }
    Ok(())
}
