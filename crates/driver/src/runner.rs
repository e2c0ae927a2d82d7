//! The runner: the per-item loop. For one item it computes the passes the
//! plan needs once (base and alternative contexts, the shared prefix read
//! once; partners; question queries), executes every arm's program on them,
//! and runs the question and decoding of arms whose caches share a layout as
//! one batch (or, padded, of every arm of several items). Per-item bit-exact
//! gates are checked here.

use crate::arm::Expect;
use crate::cross::{CrossHolder, ForeignCx};
use crate::error::Result;
use crate::exec::{prepare, ItemCx, Measures, Prepared};
use crate::passes::item_passes_with;
use crate::plan::{ArmProgram, Plan};
use crate::resources::Value;
use crate::transforms::Memo;
use candle_core::Tensor;
use std::collections::BTreeMap;
use std::time::Instant;
use tolerable_probe::ContextPair;
use tolerable_runtime::gates::bit_equal;
use tolerable_runtime::{GreedyOptions, HookSpec, KvCache, Model, Tokenizer};

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
    /// Question-and-decoding batches its arms ran in (a batch shared with
    /// other items counts for each).
    pub batches: usize,
}

/// Batch keys with every gate kept comparable: an anchor and the arms
/// gated against it (`gated`, by position) keep their keys where all share
/// the anchor's, and each take their own `alone` key where one does not
/// (bit-equality needs both sides computed on the same path).
fn keep_gates_together(
    keys: &mut [String],
    gated: &BTreeMap<usize, Vec<usize>>,
    alone: impl Fn(usize) -> String,
) {
    // Until nothing moves: an arm both gated and an anchor (a chain of
    // gates) may be taken out after its own anchor was checked.
    loop {
        let mut moved = false;
        for (&x, arms) in gated {
            if arms.iter().any(|&g| keys[g] != keys[x]) {
                tracing::debug!(
                    "arm {x} and the arms gated against it decode alone: their layouts differ"
                );
                for &a in arms.iter().chain([&x]) {
                    if keys[a] != alone(a) {
                        keys[a] = alone(a);
                        moved = true;
                    }
                }
            }
        }
        if !moved {
            return;
        }
    }
}

/// How the runner batches arms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Batching {
    /// Arms whose caches share a layout run the question and decoding together.
    Batched,
    /// Each arm runs the question and decoding alone (the baseline).
    OneAtATime,
    /// The arms of every item in one call whose question hooks are equal
    /// run the question and decoding together, their caches and questions
    /// padded to one length ([`KvCache::stack_padded`]); the padding changes
    /// float rounding (summation lengths), not what any sequence attends to.
    Padded,
}

/// What one arm's question and decoding gave: its tokens, its first logits
/// and its share of the batch's seconds.
type Decoded = (Vec<u32>, Tensor, f64);

/// One item for [`Runner::run_items_timed`].
#[derive(Debug, Clone)]
pub struct ItemJob<'p> {
    /// The item's contexts and question.
    pub pair: &'p ContextPair,
    /// Its index in the run's sample (seeds perturbations).
    pub index: usize,
    /// Its mis-source partners, as many as the plan reads.
    pub partners: Vec<&'p ContextPair>,
}

impl<'p> ItemJob<'p> {
    /// One job per pair, indexed in order, without mis-source partners (for
    /// plans that read none).
    pub fn without_partners(pairs: &'p [ContextPair]) -> Vec<Self> {
        pairs
            .iter()
            .enumerate()
            .map(|(index, pair)| ItemJob {
                pair,
                index,
                partners: Vec::new(),
            })
            .collect()
    }
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
        let job = ItemJob {
            pair,
            index: item_index,
            partners: partners.to_vec(),
        };
        Ok(self
            .run_items_timed(std::slice::from_ref(&job))?
            .pop()
            .expect("one item in, one out"))
    }

    /// Runs every arm on several items: each item's arms are prepared on its
    /// own passes, then the questions and decoding run in batches (across
    /// the items only under [`Batching::Padded`]). Outcomes per item, in
    /// the order given.
    pub fn run_items_timed(&self, jobs: &[ItemJob]) -> Result<Vec<(Vec<ArmOutcome>, ItemTiming)>> {
        let mut items: Vec<(Vec<(Prepared, f64)>, ItemTiming)> = Vec::with_capacity(jobs.len());
        for job in jobs {
            items.push(self.prepare_item(job)?);
        }
        // Group arms; each group runs the question and decoding as one batch
        // (a program marked `decode_alone` forms a group of its own; where
        // the plan batches bridges, a gated arm shares its anchor's batch
        // where their caches share a layout, and the anchor and all its
        // gated arms decode alone where one of them does not).
        let alone = |i: usize, a: usize| format!("{i:06}:alone{a:06}");
        let gated = if self.plan.batch_bridges {
            self.gated_by_anchor()?
        } else {
            BTreeMap::new()
        };
        let mut groups: BTreeMap<String, Vec<(usize, usize)>> = BTreeMap::new();
        for (i, (prepared, _)) in items.iter().enumerate() {
            let mut keys: Vec<String> = prepared
                .iter()
                .enumerate()
                .map(|(a, (p, _))| {
                    let question = if self.plan.batch_bridges {
                        ""
                    } else {
                        p.question_key.as_str()
                    };
                    match self.batching {
                        _ if self.plan.programs[a].decode_alone => alone(i, a),
                        Batching::Batched => format!(
                            "{i:06}:{}:{:?}:{question}",
                            p.cache.len(),
                            p.cache.segments(),
                        ),
                        Batching::Padded => question.to_string(),
                        Batching::OneAtATime => format!("{i:06}:arm{a:06}"),
                    }
                })
                .collect();
            if self.plan.batch_bridges {
                keep_gates_together(&mut keys, &gated, |a| alone(i, a));
            }
            for (a, key) in keys.into_iter().enumerate() {
                groups.entry(key).or_default().push((i, a));
            }
        }
        let mut results: Vec<Vec<Option<Decoded>>> = items
            .iter()
            .map(|(prepared, _)| vec![None; prepared.len()])
            .collect();
        for members in groups.values() {
            let t0 = Instant::now();
            let refs: Vec<&KvCache> = members
                .iter()
                .map(|&(i, a)| &items[i].0[a].0.cache)
                .collect();
            let prompts: Vec<Vec<u32>> = members
                .iter()
                .map(|&(i, _)| jobs[i].pair.suffix.clone())
                .collect();
            let (i0, a0) = members[0];
            let per_row;
            let spec = if self.plan.batch_bridges {
                let specs: Vec<&HookSpec> = members
                    .iter()
                    .map(|&(i, a)| &items[i].0[a].0.question)
                    .collect();
                per_row = HookSpec::per_row(&specs)?;
                &per_row
            } else {
                &items[i0].0[a0].0.question
            };
            let greedy = self.greedy.clone().with_adapters(spec);
            let gen = if self.batching == Batching::Padded {
                let mut cache = KvCache::stack_padded(&refs)?;
                self.model
                    .generate_padded(&prompts, &mut cache, spec, &greedy)?
            } else {
                let mut cache = KvCache::stack(&refs)?;
                self.model
                    .generate_with(&prompts, &mut cache, spec, &greedy)?
            };
            let share = t0.elapsed().as_secs_f64() / members.len() as f64;
            let mut in_batch: Vec<usize> = members.iter().map(|&(i, _)| i).collect();
            in_batch.dedup();
            for i in in_batch {
                items[i].1.batches += 1;
            }
            for (row, &(i, a)) in members.iter().enumerate() {
                items[i].1.decode_s += share;
                results[i][a] = Some((
                    gen.tokens[row].clone(),
                    gen.first_logits.narrow(0, row, 1)?,
                    share,
                ));
            }
        }
        items
            .into_iter()
            .zip(results)
            .map(|((prepared, timing), mut results)| {
                let out = prepared
                    .into_iter()
                    .enumerate()
                    .map(|(a, (p, prep_s))| {
                        let (tokens, first_logits, share) =
                            results[a].take().expect("every arm ran");
                        ArmOutcome {
                            tokens,
                            first_logits,
                            measures: p.measures,
                            seconds: prep_s + share,
                            bit_exact: None,
                        }
                    })
                    .collect();
                Ok((self.check_gates(out)?, timing))
            })
            .collect()
    }

    /// One item's passes and every arm's prepared cache, with the time each
    /// took.
    fn prepare_item(&self, job: &ItemJob) -> Result<(Vec<(Prepared, f64)>, ItemTiming)> {
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
            job.pair,
            &job.partners,
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
            index: job.index,
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
        Ok((prepared, timing))
    }

    /// The position among the plan's programs of the anchor `program` is
    /// gated against bit for bit (`expect = { arm }`, the floor or the
    /// native reference); none for an arm without a gate. Programs are
    /// looked up by their arm's index: a plan may run a subset of the
    /// config's arms.
    fn gate_anchor(&self, program: &ArmProgram) -> Result<Option<usize>> {
        let anchor = match &program.expect {
            None => return Ok(None),
            Some(Expect::Floor) => self.plan.floor,
            Some(Expect::Native) => self.plan.native,
            Some(Expect::Arm(name)) => self
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
        Ok(Some(r))
    }

    /// Each gated arm by its anchor ([`Runner::gate_anchor`]): positions in
    /// the plan's programs.
    fn gated_by_anchor(&self) -> Result<BTreeMap<usize, Vec<usize>>> {
        let mut out: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (g, p) in self.plan.programs.iter().enumerate() {
            if let Some(x) = self.gate_anchor(p)? {
                out.entry(x).or_default().push(g);
            }
        }
        Ok(out)
    }

    /// One item's outcomes with their per-item gates checked: arms that must
    /// equal an anchor bit for bit.
    fn check_gates(&self, mut out: Vec<ArmOutcome>) -> Result<Vec<ArmOutcome>> {
        for (a, program) in self.plan.programs.iter().enumerate() {
            if let Some(r) = self.gate_anchor(program)? {
                let same = out[a].tokens == out[r].tokens
                    && bit_equal(&out[a].first_logits, &out[r].first_logits)?;
                out[a].bit_exact = Some(same);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gate_whose_arms_share_no_batch_decodes_alone() {
        let alone = |a: usize| format!("alone{a}");
        // Arm 0 anchors 1 and 2; arm 3 anchors 4. Arms 0-2 share a batch;
        // 4 has another layout than its anchor 3.
        let gated = BTreeMap::from([(0, vec![1, 2]), (3, vec![4])]);
        let mut keys: Vec<String> = ["x", "x", "x", "y", "z", "y"].map(String::from).to_vec();
        keep_gates_together(&mut keys, &gated, alone);
        assert_eq!(keys, ["x", "x", "x", "alone3", "alone4", "y"]);
        // One gated arm apart takes its anchor and the other gated arm out.
        let mut keys: Vec<String> = ["x", "x", "w"].map(String::from).to_vec();
        keep_gates_together(&mut keys, &BTreeMap::from([(0, vec![1, 2])]), alone);
        assert_eq!(keys, ["alone0", "alone1", "alone2"]);
        // A chain: 0 anchors 1, 1 anchors 2; 2 apart takes 1 out, and so 0.
        let mut keys: Vec<String> = ["x", "x", "y"].map(String::from).to_vec();
        keep_gates_together(
            &mut keys,
            &BTreeMap::from([(0, vec![1]), (1, vec![2])]),
            alone,
        );
        assert_eq!(keys, ["alone0", "alone1", "alone2"]);
    }
}
