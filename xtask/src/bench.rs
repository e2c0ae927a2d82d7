//! `cargo xtask bench`: prefill and decode speed of our forward against
//! candle-transformers' model of the same file, measured in the same run.

use anyhow::Result;
use std::time::Instant;
use tolerable_runtime::reference::Reference;
use tolerable_runtime::{Checkpoint, HookPoint, HookSpec, LogitsAt, Model, Precision};

/// Peak resident set size of this process, in MiB (Linux).
fn peak_rss_mib() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

fn median(mut t: Vec<f64>) -> f64 {
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// Median wall times of several contenders, run interleaved (A B C A B C
/// ...) after one warm-up each, so that drifting machine load hits all alike.
fn interleaved(reps: usize, fs: &mut [&mut dyn FnMut() -> Result<()>]) -> Result<Vec<f64>> {
    let mut times = vec![Vec::with_capacity(reps); fs.len()];
    for f in fs.iter_mut() {
        f()?;
    }
    for _ in 0..reps.max(1) {
        for (i, f) in fs.iter_mut().enumerate() {
            let s = Instant::now();
            f()?;
            times[i].push(s.elapsed().as_secs_f64());
        }
    }
    Ok(times.into_iter().map(median).collect())
}

/// A prompt of exactly `n` tokens cut from repeated prose.
fn prompt_ids(ck: &Checkpoint, n: usize) -> Result<Vec<u32>> {
    let text = tolerable_runtime::gates::SQUAD_PROMPT.repeat(n / 60 + 2);
    let ids = ck.tokenizer.encode(&text)?;
    Ok(ids[..n].to_vec())
}

fn prefill(m: &Model, ids: &[u32], spec: &HookSpec) -> Result<()> {
    let mut c = m.new_cache(1);
    m.forward(&m.tokens(&[ids.to_vec()])?, &mut c, spec, LogitsAt::Last)?;
    Ok(())
}

/// Decode tokens/s at `batch`: a 32-token prompt per sequence, then `steps` greedy steps timed.
fn decode_tps(m: &Model, ids: &[u32], batch: usize, steps: usize) -> Result<f64> {
    let prompt: Vec<Vec<u32>> = (0..batch).map(|_| ids[..32].to_vec()).collect();
    let mut c = m.new_cache(batch);
    let out = m.forward(
        &m.tokens(&prompt)?,
        &mut c,
        &HookSpec::new(),
        LogitsAt::Last,
    )?;
    let last = out.logits.expect("logits").squeeze(1)?;
    let opts = tolerable_runtime::GreedyOptions::tokens(steps + 1);
    let s = Instant::now();
    m.decode_from(&last, &mut c, &opts)?;
    Ok((batch * steps) as f64 / s.elapsed().as_secs_f64())
}

/// One section of figures computed on the loaded receiver.
type Figure<'a> = dyn Fn(&Checkpoint) -> Result<serde_json::Value> + 'a;

/// What `cargo xtask bench` measures.
#[derive(clap::Args)]
pub struct BenchOptions {
    /// Model id or path.
    #[arg(long, default_value = "qwen2.5-coder-0.5b-instruct")]
    pub model: String,
    /// Print the figures as one JSON object on the last line.
    #[arg(long)]
    pub json: bool,
    /// Prompt length in tokens for the prefill figures.
    #[arg(long, default_value_t = 300)]
    pub prompt_tokens: usize,
    /// Timed repetitions (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Skip the quantized figures (slow on the 0.5B's Q5_0 blocks).
    #[arg(long)]
    pub skip_quantized: bool,
    /// Only the driver's figures (KV-only arm cost, 20-arm grid batched vs one at a time).
    #[arg(long)]
    pub arms_only: bool,
    /// Skip the driver's figures.
    #[arg(long)]
    pub skip_arms: bool,
    /// Items of the batched 20-arm KV grid.
    #[arg(long, default_value_t = 50)]
    pub arms_n: usize,
    /// Items of its one-at-a-time baseline (a rate, so fewer items suffice).
    #[arg(long, default_value_t = 5)]
    pub arms_baseline_n: usize,
    /// Skip the 20-arm grid's figures (batched against one at a time, one
    /// KV-only arm against a prefill) in the driver's figures.
    #[arg(long)]
    pub skip_grid: bool,
    /// Items a padded batch holds in the item-batching figures (the 20-arm
    /// grid's and a few-arm plan's; 1, the default: they are skipped).
    #[arg(long, default_value_t = 1)]
    pub item_batch: usize,
    /// Items over which that figure is timed, both ways.
    #[arg(long, default_value_t = 12)]
    pub item_batch_items: usize,
    /// Items over which three bridges' arms decoding as one batch
    /// (`batch_bridges`) are timed against each bridge decoding alone, in
    /// the driver's figures (0, the default: skipped).
    #[arg(long, default_value_t = 0)]
    pub bridge_batching_items: usize,
    /// SQuAD dev file or folder for the arm figures (default $TOLERABLE_SQUAD_DIR; synthetic if none).
    #[arg(long)]
    pub squad: Option<std::path::PathBuf>,
    /// Skip the key bank's figures (bank build time, a bank arm against a KV-only arm).
    #[arg(long)]
    pub skip_bank: bool,
    /// Keys per layer and kv head of the benchmarked bank.
    #[arg(long, default_value_t = 6000)]
    pub bank_size: usize,
    /// Training passages the benchmarked bank reads.
    #[arg(long, default_value_t = 64)]
    pub bank_contexts: usize,
    /// Items over which the bank and KV-only arms are timed.
    #[arg(long, default_value_t = 10)]
    pub bank_items: usize,
    /// A second model whose f32 prefill (ours and candle-transformers') is
    /// timed too (the papers' geometry: qwen2.5-coder-1.5b-instruct).
    #[arg(long)]
    pub second_model: Option<String>,
    /// Only the training figure: one bridge trained from scratch on the
    /// KV augmentation arm (training items from squad_train at --squad).
    #[arg(long)]
    pub train_only: bool,
    /// The bridge's adapted projections (q, kv or qkv).
    #[arg(long, default_value = "q")]
    pub train_targets: String,
    /// Its training items.
    #[arg(long, default_value_t = 200)]
    pub train_items: usize,
    /// Its keep-best slice.
    #[arg(long, default_value_t = 32)]
    pub train_slice: usize,
    /// Its epochs.
    #[arg(long, default_value_t = 4)]
    pub train_epochs: usize,
    /// Its training examples a step (1: the one-item recipe; above 1, a
    /// mini-batch read as one padded batch).
    #[arg(long, default_value_t = 1)]
    pub train_batch: usize,
    /// Its AdamW learning rate (the configs' 0.0005 by default).
    #[arg(long, default_value_t = 0.0005)]
    pub train_lr: f64,
    /// Only the matmul figures: the f32 projection products of the model's
    /// forward (fused qkv, o, fused gate/up, down, LM head) at a prefill's,
    /// a decoding batch's and one row's sizes, in GFLOP/s, through the same
    /// code path as the forward (for choosing a matmul backend on a machine).
    #[arg(long)]
    pub matmul_only: bool,
    /// With `--matmul-only`: also time both orientations of each product
    /// at these row counts (comma-separated): `x Wᵀ` and `(W xᵀ)ᵀ`, the
    /// two ways gemm can be given the same product, interleaved (the
    /// forward takes the second up to 32 rows).
    #[arg(long, value_delimiter = ',')]
    pub matmul_rows: Vec<usize>,
}

/// GFLOP/s of the forward's projections at the model's shapes (random f32
/// weights and activations; the product as [`Proj::forward`] forms it).
///
/// [`Proj::forward`]: tolerable_runtime::Proj::forward
fn matmul_figures(
    ck: &Checkpoint,
    prompt_tokens: usize,
    reps: usize,
    orientation_rows: &[usize],
) -> Result<serde_json::Value> {
    let c = ck.model.config();
    let dev = candle_core::Device::Cpu;
    let qkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim;
    let shapes: [(&str, usize, usize); 5] = [
        ("qkv", c.d_model, qkv),
        ("o", c.n_heads * c.head_dim, c.d_model),
        ("gate_up", c.d_model, 2 * c.d_ffn),
        ("down", c.d_ffn, c.d_model),
        ("lm_head", c.d_model, c.vocab_size),
    ];
    let (mut out, mut orientations) = (Vec::new(), Vec::new());
    for (name, k, n) in shapes {
        let wt = candle_core::Tensor::randn(0f32, 1.0, (n, k), &dev)?;
        // The same weights for both arrangements' figures.
        orientation_figures(name, &wt, orientation_rows, reps, &mut orientations)?;
        let w = tolerable_runtime::Proj::Dense(wt);
        for rows in [prompt_tokens, 16, 1] {
            if name == "lm_head" && rows != 1 {
                continue; // the forward takes the LM head at the last position only
            }
            let x = candle_core::Tensor::randn(0f32, 1.0, (rows, k), &dev)?;
            let mut gemm = || -> Result<()> {
                w.forward(&x)?;
                Ok(())
            };
            // One row: the opt-in one-row kernel beside gemm, interleaved.
            let mut row = || -> Result<()> {
                w.forward_row_kernel(&x)?;
                Ok(())
            };
            let ts = if rows == 1 {
                interleaved(reps, &mut [&mut gemm, &mut row])?
            } else {
                interleaved(reps, &mut [&mut gemm])?
            };
            let t = ts[0];
            let gflops = 2.0 * (rows * k * n) as f64 / t / 1e9;
            eprintln!(
                "  {name} {rows}x{k}->{n}: {:.2} ms, {gflops:.1} GFLOP/s",
                t * 1e3
            );
            let mut fig = serde_json::json!({
                "product": name, "rows": rows, "in": k, "out": n,
                "seconds": t, "gflop_per_s": gflops,
            });
            if let Some(&tr) = ts.get(1) {
                eprintln!(
                    "  {name} 1x{k}->{n}, one-row kernel: {:.2} ms ({:.2}x gemm's time)",
                    tr * 1e3,
                    tr / t
                );
                fig["row_kernel_seconds"] = tr.into();
                fig["row_kernel_vs_gemm"] = (tr / t).into();
                fig["row_kernel_gb_per_s"] = ((n * k * 4) as f64 / tr / 1e9).into();
            }
            out.push(fig);
        }
    }
    Ok(serde_json::json!({
        "backend": tolerable_runtime::matmul_backend(false),
        "products": out,
        "orientations": orientations,
    }))
}

/// Both arrangements of the product by `w` `[out, in]` (the LM head's too:
/// a decoding batch forms every sequence's logits) at each of `rows`:
/// `x Wᵀ` and `(W xᵀ)ᵀ`, interleaved, in GFLOP/s, with the second's time
/// over the first's; appended to `out`.
fn orientation_figures(
    name: &str,
    w: &candle_core::Tensor,
    rows: &[usize],
    reps: usize,
    out: &mut Vec<serde_json::Value>,
) -> Result<()> {
    let dev = candle_core::Device::Cpu;
    let (n, k) = w.dims2()?;
    for &m in rows {
        let x = candle_core::Tensor::randn(0f32, 1.0, (m, k), &dev)?;
        let ts = interleaved(
            reps,
            &mut [
                &mut || {
                    x.matmul(&w.t()?)?;
                    Ok(())
                },
                &mut || {
                    w.matmul(&x.t()?)?.t()?.contiguous()?;
                    Ok(())
                },
            ],
        )?;
        let flop = 2.0 * (m * k * n) as f64;
        eprintln!(
            "  {name} {m}x{k}->{n}: x Wt {:.1} GFLOP/s, (W xt)t {:.1} GFLOP/s ({:.2}x the time)",
            flop / ts[0] / 1e9,
            flop / ts[1] / 1e9,
            ts[1] / ts[0]
        );
        out.push(serde_json::json!({
            "product": name, "rows": m, "in": k, "out": n,
            "x_wt_seconds": ts[0], "w_xt_t_seconds": ts[1],
            "x_wt_gflop_per_s": flop / ts[0] / 1e9,
            "w_xt_t_gflop_per_s": flop / ts[1] / 1e9,
            "w_xt_t_over_x_wt": ts[1] / ts[0],
        }));
    }
    Ok(())
}

/// The driver's figures: the 20-arm grid (unless skipped), item batching
/// and bridge batching (when asked for) and the key bank's (unless skipped).
fn driver_figures(ck: &Checkpoint, o: &BenchOptions) -> Result<serde_json::Value> {
    let items = crate::bench_arms::items(ck, o.arms_n, o.squad.as_deref())?;
    let mut arms = if o.skip_grid {
        serde_json::json!({})
    } else {
        crate::bench_arms::run(ck, &items, o.arms_baseline_n, 8, o.item_batch)?
    };
    if o.item_batch > 1 {
        let n = o.item_batch_items.min(items.len());
        arms["item_batching"] = crate::bench_arms::item_batching(ck, &items[..n], o.item_batch, 8)?;
    }
    if o.bridge_batching_items > 0 {
        let n = o.bridge_batching_items.min(items.len());
        arms["bridge_batching"] =
            crate::bench_arms::bridge_batching(ck, &items[..n], o.squad.as_deref(), 8)?;
    }
    if !o.skip_bank {
        let n = o.bank_items.min(items.len());
        arms["bank"] = crate::bench_arms::bank(
            ck,
            &items[..n],
            o.squad.as_deref(),
            o.bank_size,
            o.bank_contexts,
            8,
        )?;
    }
    Ok(arms)
}

pub fn run(o: BenchOptions) -> Result<()> {
    let (model, json, n, reps, skip_quantized) = (
        o.model.as_str(),
        o.json,
        o.prompt_tokens,
        o.reps,
        o.skip_quantized,
    );
    // The driver-only figures: one section beside the model and threads.
    let section: Option<(&str, &Figure)> = if o.matmul_only {
        Some(("matmul", &|ck: &Checkpoint| {
            matmul_figures(ck, o.prompt_tokens, o.reps, &o.matmul_rows)
        }))
    } else if o.train_only {
        Some(("bridge", &|ck: &Checkpoint| {
            crate::bench_train::run(
                ck,
                o.squad.as_deref(),
                &crate::bench_train::TrainBench {
                    targets: &o.train_targets,
                    items: o.train_items,
                    slice: o.train_slice,
                    epochs: o.train_epochs,
                    batch: o.train_batch,
                    lr: o.train_lr,
                },
            )
        }))
    } else if o.arms_only {
        Some(("arms", &|ck: &Checkpoint| driver_figures(ck, &o)))
    } else {
        None
    };
    if let Some((key, figure)) = section {
        let ck = tolerable_fetch::load(model, Precision::F32, &candle_core::Device::Cpu)?;
        let mut figures = serde_json::json!({ "model": model, "threads": candle_core::utils::get_num_threads(), "machine": tolerable_runtime::machine() });
        figures[key] = figure(&ck)?;
        figures["peak_rss_mib"] = peak_rss_mib().into();
        println!(
            "{}",
            if json {
                figures.to_string()
            } else {
                serde_json::to_string_pretty(&figures)?
            }
        );
        return Ok(());
    }
    let dev = candle_core::Device::Cpu;
    let threads = candle_core::utils::get_num_threads();
    eprintln!("bench: {model}, {n}-token prompt, {reps} reps (median), {threads} threads");
    let ck = tolerable_fetch::load(model, Precision::F32, &dev)?;
    let m = &ck.model;
    let ids = prompt_ids(&ck, n)?;
    let layers = m.config().n_layers;
    let capture_all = HookSpec::new().capture_all(
        (0..layers).flat_map(|l| [HookPoint::RotK(l), HookPoint::V(l), HookPoint::ResidPre(l)]),
    );

    let mut reference = Reference::load(&ck.path, Precision::F32, &dev)?;
    let t = interleaved(
        reps,
        &mut [
            &mut || prefill(m, &ids, &HookSpec::new()),
            &mut || prefill(m, &ids, &capture_all),
            &mut || reference.last_logits(&ids).map(|_| ()).map_err(Into::into),
        ],
    )?;
    // candle-transformers' batch-1 decoding on the same 32-token prompt.
    let cand_dec1 = {
        let prompt = &ids[..32];
        let logits = reference.last_logits(prompt)?;
        let mut next = logits.argmax(candle_core::D::Minus1)?.to_scalar::<u32>()?;
        let steps = 16;
        let s = Instant::now();
        for i in 0..steps {
            let l = reference.next_logits(next, prompt.len() + i)?;
            next = l.argmax(candle_core::D::Minus1)?.to_scalar::<u32>()?;
        }
        steps as f64 / s.elapsed().as_secs_f64()
    };
    drop(reference);
    let (ours_f32, ours_cap, cand_f32) = (t[0], t[1], t[2]);
    eprintln!(
        "  ours f32 prefill, hooks off: {ours_f32:.3} s ({:.1} tok/s)",
        n as f64 / ours_f32
    );
    eprintln!("  ours f32 prefill, capture K,V,resid all layers: {ours_cap:.3} s");
    eprintln!(
        "  candle-transformers f32 prefill: {cand_f32:.3} s ({:.1} tok/s)",
        n as f64 / cand_f32
    );
    let dec1 = decode_tps(m, &ids, 1, 16)?;
    let dec16 = decode_tps(m, &ids, 16, 16)?;
    let dec1_row = decode_tps(&m.clone().with_row_kernel(true), &ids, 1, 16)?;
    eprintln!("  ours f32 decode: batch 1 {dec1:.2} tok/s, batch 16 {dec16:.2} tok/s");
    eprintln!("  ours f32 decode, batch 1, one-row kernel (opt-in): {dec1_row:.2} tok/s");
    eprintln!("  candle-transformers f32 decode: batch 1 {cand_dec1:.2} tok/s");

    let mut figures = serde_json::json!({
        "model": model,
        "threads": threads,
        "prompt_tokens": n,
        "reps": reps,
        "prefill_s": { "ours_f32": ours_f32, "ours_f32_capture_all": ours_cap, "candle_f32": cand_f32 },
        "prefill_tok_per_s_ours_f32": n as f64 / ours_f32,
        "decode_tok_per_s": { "f32_batch1": dec1, "f32_batch16": dec16, "candle_f32_batch1": cand_dec1, "f32_batch1_row_kernel": dec1_row },
        "backend": tolerable_runtime::matmul_backend(false),
        "machine": tolerable_runtime::machine(),
        "hooks_off_vs_candle": ours_f32 / cand_f32,
        "prefill_vs_candle": ours_f32 / cand_f32,
        "decode_b1_vs_candle": cand_dec1 / dec1,
        "decode_b1_row_kernel_vs_candle": cand_dec1 / dec1_row,
        "capture_all_vs_hooks_off": ours_cap / ours_f32,
        "decode_batch16_speedup": dec16 / dec1,
    });
    if !skip_quantized {
        quantized(&ck, &ids, reps, &capture_all, &mut figures)?;
    }
    if let Some(second) = &o.second_model {
        figures["second_model"] = second_prefill(second, n, reps)?;
    }
    if !o.skip_arms {
        figures["arms"] = driver_figures(&ck, &o)?;
    }
    figures["peak_rss_mib"] = peak_rss_mib().into();
    if json {
        println!("{figures}");
    } else {
        println!("{}", serde_json::to_string_pretty(&figures)?);
    }
    Ok(())
}

/// Our f32 prefill against candle-transformers' on another model.
fn second_prefill(model: &str, n: usize, reps: usize) -> Result<serde_json::Value> {
    let dev = candle_core::Device::Cpu;
    let ck = tolerable_fetch::load(model, Precision::F32, &dev)?;
    let ids = prompt_ids(&ck, n)?;
    let mut reference = Reference::load(&ck.path, Precision::F32, &dev)?;
    let t = interleaved(
        reps,
        &mut [
            &mut || prefill(&ck.model, &ids, &HookSpec::new()),
            &mut || reference.last_logits(&ids).map(|_| ()).map_err(Into::into),
        ],
    )?;
    eprintln!(
        "  {model}: ours f32 prefill {:.3} s, candle-transformers {:.3} s",
        t[0], t[1]
    );
    Ok(serde_json::json!({
        "model": model,
        "prefill_s": { "ours_f32": t[0], "candle_f32": t[1] },
        "prefill_vs_candle": t[0] / t[1],
    }))
}

/// The quantized figures: our QMatMul path against candle-transformers' quantized model.
fn quantized(
    ck: &Checkpoint,
    ids: &[u32],
    reps: usize,
    capture_all: &HookSpec,
    figures: &mut serde_json::Value,
) -> Result<()> {
    let dev = candle_core::Device::Cpu;
    let q = Checkpoint::load_gguf(
        &ck.id,
        &ck.path,
        ck.sha256.clone(),
        Precision::Quantized,
        &dev,
    )?;
    let mut reference_q = Reference::load(&ck.path, Precision::Quantized, &dev)?;
    let t = interleaved(
        reps,
        &mut [
            &mut || prefill(&q.model, ids, &HookSpec::new()),
            &mut || prefill(&q.model, ids, capture_all),
            &mut || reference_q.last_logits(ids).map(|_| ()).map_err(Into::into),
        ],
    )?;
    drop(reference_q);
    let (ours_q, ours_q_cap, cand_q) = (t[0], t[1], t[2]);
    eprintln!("  quantized prefill: ours {ours_q:.3} s, capture-all {ours_q_cap:.3} s, candle-transformers {cand_q:.3} s");
    let dec1_q = decode_tps(&q.model, ids, 1, 16)?;
    eprintln!("  quantized decode batch 1: {dec1_q:.2} tok/s");

    figures["prefill_s"]["ours_quantized"] = ours_q.into();
    figures["prefill_s"]["ours_quantized_capture_all"] = ours_q_cap.into();
    figures["prefill_s"]["candle_quantized"] = cand_q.into();
    figures["decode_tok_per_s"]["quantized_batch1"] = dec1_q.into();
    figures["hooks_off_vs_candle_quantized"] = (ours_q / cand_q).into();
    figures["capture_all_vs_hooks_off_quantized"] = (ours_q_cap / ours_q).into();
    Ok(())
}
