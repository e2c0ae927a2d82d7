//! The runner: the per-item loop. For one item it computes the passes the
//! plan needs once (base and alternative contexts, the shared prefix read
//! once; partners; question queries), executes every arm's program on them,
//! and runs the question and decoding of arms whose caches share a layout as
//! one batch. Per-item bit-exact gates are checked here.

use crate::arm::Expect;
use crate::cross::{CrossHolder, ForeignCx};
use crate::error::Result;
use crate::exec::{prepare, ItemCx, Measures, Prepared};
use crate::passes::item_passes_with;
use crate::plan::Plan;
use crate::resources::Value;
use crate::transforms::Memo;
use candle_core::Tensor;
use std::collections::BTreeMap;
use std::time::Instant;
use tolerable_probe::ContextPair;
use tolerable_runtime::gates::bit_equal;
use tolerable_runtime::{GreedyOptions, KvCache, Model, Tokenizer};

/// What one arm produced on one item.
#[derive(Debug, Clone)]
pub struct ArmOutcome {
    /// Greedy continuation ids.
    pub tokens: Vec<u32>,
    /// Logits at the last question position, for the bit-exact gates.
    pub first_logits: Tensor,
    /// What the arm's injections measured.
    pub measures: Measures,
    /// Seconds spent on this arm: its own preparation plus its share of
    /// the batched question and decoding.
    pub seconds: f64,
    /// Outcome of the arm's `expect` gate, where it has one.
    pub bit_exact: Option<bool>,
}

/// Where one item's time went.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ItemTiming {
    /// The shared passes (base, alternative, partners, queries).
    pub passes_s: f64,
    /// Executing every arm's program (edits, residual restarts).
    pub prepare_s: f64,
    /// The question and decoding of every arm (batched or not).
    pub decode_s: f64,
}

/// How the runner batches arms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Batching {
    /// Arms whose caches share a layout run the question and decoding together.
    Batched,
    /// Each arm runs the question and decoding alone (the baseline).
    OneAtATime,
}

/// Runs a compiled plan on items with one receiver.
pub struct Runner<'a> {
    model: &'a Model,
    plan: &'a Plan,
    resources: &'a BTreeMap<String, Value>,
    senders: Option<&'a BTreeMap<String, Model>>,
    cross: Option<(&'a Tokenizer, &'a BTreeMap<String, CrossHolder>)>,
    greedy: GreedyOptions,
    seed: u64,
    batching: Batching,
    partner_passes: crate::passes::PartnerPasses,
}

impl<'a> Runner<'a> {
    /// A runner of `plan` on `model` with the run's built `resources`,
    /// decoding `new_tokens` greedily; `seed` seeds perturbations.
    pub fn new(
        model: &'a Model,
        plan: &'a Plan,
        resources: &'a BTreeMap<String, Value>,
        new_tokens: usize,
        seed: u64,
    ) -> Self {
        Self {
            model,
            plan,
            resources,
            senders: None,
            cross: None,
            greedy: GreedyOptions::tokens(new_tokens),
            seed,
            batching: Batching::Batched,
            partner_passes: Default::default(),
        }
    }

    /// The held-out senders the plan reads, by key.
    pub fn with_senders(mut self, senders: &'a BTreeMap<String, Model>) -> Self {
        self.senders = Some(senders);
        self
    }

    /// The cross-family holders the plan reads, by model id, and the
    /// receiver's tokenizer (they read the text its ids spell).
    pub fn with_cross_holders(
        mut self,
        tokenizer: &'a Tokenizer,
        holders: &'a BTreeMap<String, CrossHolder>,
    ) -> Self {
        self.cross = Some((tokenizer, holders));
        self
    }

    /// Sets how arms are batched.
    pub fn with_batching(mut self, batching: Batching) -> Self {
        self.batching = batching;
        self
    }

    /// Runs every arm on `pair` (its index `item_index` seeds
    /// perturbations); `partners` are its mis-source partners, as many as
    /// the plan reads (`plan.needs.partners`).
    pub fn run_item(
        &self,
        pair: &ContextPair,
        item_index: usize,
        partners: &[&ContextPair],
    ) -> Result<Vec<ArmOutcome>> {
        Ok(self.run_item_timed(pair, item_index, partners)?.0)
    }

    /// As [`Runner::run_item`], also saying where the time went.
    pub fn run_item_timed(
        &self,
        pair: &ContextPair,
        item_index: usize,
        partners: &[&ContextPair],
    ) -> Result<(Vec<ArmOutcome>, ItemTiming)> {
        let mut timing = ItemTiming::default();
        let t_passes = Instant::now();
        let none = BTreeMap::new();
        let foreign = self.cross.map(|(tokenizer, holders)| ForeignCx {
            tokenizer,
            holders,
            specs: &self.plan.foreign,
            resources: self.resources,
        });
        let passes = item_passes_with(
            self.model,
            pair,
            partners,
            &self.plan.needs,
            self.senders.unwrap_or(&none),
            foreign.as_ref(),
            Some(&self.partner_passes),
        )?;
        timing.passes_s = t_passes.elapsed().as_secs_f64();
        let memo = Memo::default();
        let cx = ItemCx {
            model: self.model,
            passes: &passes,
            index: item_index,
            seed: self.seed,
            resources: self.resources,
            memo: &memo,
        };
        let mut prepared: Vec<(Prepared, f64)> = Vec::with_capacity(self.plan.programs.len());
        for program in &self.plan.programs {
            let t0 = Instant::now();
            let p = prepare(program, &cx)?;
            prepared.push((p, t0.elapsed().as_secs_f64()));
        }
        timing.prepare_s = prepared.iter().map(|p| p.1).sum();
        // Group arms by cache layout and bridge; each group runs the question
        // and decoding as one batch.
        let mut groups: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (a, (p, _)) in prepared.iter().enumerate() {
            let key = match self.batching {
                Batching::Batched => format!(
                    "{}:{:?}:{}",
                    p.cache.len(),
                    p.cache.segments(),
                    p.question_key
                ),
                Batching::OneAtATime => format!("arm{a:06}"),
            };
            groups.entry(key).or_default().push(a);
        }
        let mut results: Vec<Option<(Vec<u32>, Tensor, f64)>> = vec![None; prepared.len()];
        for members in groups.values() {
            let t0 = Instant::now();
            let refs: Vec<&KvCache> = members.iter().map(|&a| &prepared[a].0.cache).collect();
            let mut cache = KvCache::stack(&refs)?;
            let prompt = vec![pair.suffix.clone(); members.len()];
            let spec = &prepared[members[0]].0.question;
            let greedy = self.greedy.clone().with_adapters(spec);
            let gen = self
                .model
                .generate_with(&prompt, &mut cache, spec, &greedy)?;
            let spent = t0.elapsed().as_secs_f64();
            timing.decode_s += spent;
            let share = spent / members.len() as f64;
            for (row, &a) in members.iter().enumerate() {
                results[a] = Some((
                    gen.tokens[row].clone(),
                    gen.first_logits.narrow(0, row, 1)?,
                    share,
                ));
            }
        }
        let mut out = Vec::with_capacity(prepared.len());
        for (a, (p, prep_s)) in prepared.into_iter().enumerate() {
            let (tokens, first_logits, share) = results[a].take().expect("every arm ran");
            out.push(ArmOutcome {
                tokens,
                first_logits,
                measures: p.measures,
                seconds: prep_s + share,
                bit_exact: None,
            });
        }
        // The per-item gates: arms that must equal an anchor bit for bit.
        for (a, program) in self.plan.programs.iter().enumerate() {
            if let Some(e) = &program.expect {
                let anchor = match e {
                    Expect::Floor => self.plan.floor,
                    Expect::Native => self.plan.native,
                    Expect::Arm(name) => self
                        .plan
                        .programs
                        .iter()
                        .find(|p| &p.name == name)
                        .map(|p| p.index)
                        .ok_or_else(|| {
                            crate::error::DriverError::Records(format!(
                                "arm `{}` is gated against `{name}`, which this plan does not run",
                                program.name
                            ))
                        })?,
                };
                // Programs are looked up by their arm's index: a plan may run
                // a subset of the config's arms.
                let r = self
                    .plan
                    .programs
                    .iter()
                    .position(|p| p.index == anchor)
                    .ok_or_else(|| {
                        crate::error::DriverError::Records(format!(
                            "arm `{}` is gated against an anchor this plan does not run",
                            program.name
                        ))
                    })?;
                let same = out[a].tokens == out[r].tokens
                    && bit_equal(&out[a].first_logits, &out[r].first_logits)?;
                out[a].bit_exact = Some(same);
            }
        }
        Ok((out, timing))
    }
}
