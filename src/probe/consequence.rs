//! Severity by consequence: does a divergent op's error reach anything downstream?
//!
//! An op diverges when its own (isolated) error exceeds its tolerance. Whether that matters is a
//! second question: a magnitude-only error in front of an RMSNorm (a fused pair's global scale
//! that the engine merged, `q_a` decoded ×1.28) leaves the norm's output — the next op's input —
//! as it was. So for every divergent op X the runner feeds X's *faulty* output (the served op on
//! the oracle's inputs, i.e. exactly its isolated output) to each op C that consumes it, in the BF16
//! oracle's numerics with every other input the oracle's, and keeps (two executions of C):
//! - C on the faulty input against the oracle's C output (the error as it reaches C's output),
//! - C on the faulty input with its best scalar factor removed (X's output / c*, c* the least-squares
//!   factor between X's faulty and oracle outputs) against C on the faulty input: whether C cares
//!   about the magnitude at all.
//!
//! [`classify`] then calls X *absorbed* by C when either C's output error stays within C's own
//! noise (noise_multiplier × its BF16-vs-FP32 spread on the same inputs, at least min_rel_l2), or
//! X's error is magnitude-only (its rel-L2 with c* removed is within X's tolerance) and C is blind
//! to that magnitude (the two C outputs agree within C's noise); and *harmful* when any consumer
//! shows it (error beyond noise, new NaN/Inf, a changed routing or index choice) or X's output is
//! the model's output. Each consumer is judged on its own; X is absorbed only when every consumer
//! absorbs it. The cost is two executions of each consumer of each divergent op.

use std::collections::HashMap;

use serde::Serialize;

use super::env::{PathEnv, Shared};
use super::spec::Thresholds;
use super::OpRecord;
use crate::metrics::head::HeadCompare;
use crate::metrics::Compare;
use crate::model::exec::exec;
use crate::model::graph::{Op, OpKind};
use crate::served::PathKind;
use crate::{Result, Tensor};

/// What a divergent op's error does downstream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// The error reaches a later op (beyond noise, NaN/Inf, routing) or the model's output.
    Harmful,
    /// No later op sees it: every consumer removes it.
    Absorbed,
}

impl Severity {
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Harmful => "harmful",
            Severity::Absorbed => "absorbed",
        }
    }
}

/// One consumer C of a divergent op X, fed X's faulty output.
#[derive(Clone, Debug, Serialize)]
pub struct Downstream {
    /// C's op id.
    pub op: String,
    /// C's kind (`RmsNorm`, `Linear`, …).
    pub kind: String,
    /// C on X's faulty output vs the oracle's C (the error as it reaches C's output).
    pub effect: Compare,
    /// C on X's faulty output vs C on it with X's factor c* removed: C's sensitivity to magnitude.
    pub magnitude_effect: Compare,
    /// C's noise bound (noise_multiplier × its BF16-vs-FP32 spread, ≥ min_rel_l2); set by classify.
    pub noise: Option<f64>,
    /// Fraction of C's index outputs (router experts, indexer picks) unchanged; None if it has none.
    pub index_agreement: Option<f64>,
    /// Executions of C this took (2: faulty and factor-free input; 1 without a factor).
    pub execs: usize,
}

/// The consequence of one divergent op.
#[derive(Clone, Debug, Serialize)]
pub struct Consequence {
    pub severity: Severity,
    /// The ops that absorb it (every consumer), when absorbed.
    pub absorbed_by: Vec<String>,
    /// Where it shows first (consumer op), when harmful and a consumer shows it.
    pub shows_at: Option<String>,
    /// One sentence: why harmful, or which op absorbs it and why.
    pub why: String,
    /// Least-squares factor between X's faulty and oracle outputs.
    pub scale: Option<f64>,
    /// X's isolated rel-L2 with that factor removed (its error that is not magnitude).
    pub rel_l2_without_scale: Option<f64>,
    pub downstream: Vec<Downstream>,
    /// The op's faulty output carried to the model's output (every later op in the BF16
    /// oracle's numerics) against the BF16 oracle's next-token distributions, when the run
    /// reaches the head.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at_output: Option<HeadCompare>,
}

/// Per followed op: its least-squares factor and its error with the factor removed.
pub type Scales = HashMap<String, (Option<f64>, Option<f64>)>;

/// A divergent op whose consumers are still to run.
struct Faulty {
    op: Op,
    iso: Vec<Tensor>,
    scale: Option<f64>,
    /// Carried to the model's output: the tensors downstream of the op as they are with its
    /// faulty output (every other op in the BF16 oracle's numerics), by id; None when not carried.
    shadow: Option<HashMap<String, Tensor>>,
}

/// The runner's bookkeeping of divergent ops and what their consumers did with their outputs.
#[derive(Default)]
pub(crate) struct Tracker {
    faulty: Vec<Faulty>,
    found: HashMap<String, Vec<Downstream>>,
    /// Per followed op: its least-squares factor and its error without it.
    scales: Scales,
    /// Divergent ops kept (bounded: each holds its outputs until its last consumer ran).
    kept: usize,
    /// Carry divergent ops' errors to the model's output (the run reaches the head, whole prompt).
    to_output: bool,
    /// Divergent ops carried so far (bounded by [`MAX_CARRIED`]).
    carried: usize,
    /// Per carried op: its effect at the model's output.
    at_output: HashMap<String, HeadCompare>,
}

/// Divergent ops whose error is carried to the model's output (each costs one BF16-oracle
/// execution of every later op); later ones are judged without it.
pub const MAX_CARRIED: usize = 8;

/// Divergent ops whose consumers are followed; later ones are reported without the analysis.
pub const MAX_FOLLOWED: usize = 256;

/// Least-squares factor c with faulty ≈ c · oracle, over finite pairs.
fn lsq_scale(faulty: &[f32], oracle: &[f32]) -> Option<f64> {
    let (mut xy, mut yy) = (0f64, 0f64);
    for (&x, &y) in faulty.iter().zip(oracle) {
        if x.is_finite() && y.is_finite() {
            xy += x as f64 * y as f64;
            yy += y as f64 * y as f64;
        }
    }
    (yy > 0.0 && xy.is_finite() && xy != 0.0).then(|| xy / yy)
}

fn has_index_output(op: &Op) -> bool {
    matches!(op.kind, OpKind::Router | OpKind::Indexer)
}

impl Tracker {
    /// A tracker; `to_output`: carry divergent ops' errors to the model's output.
    pub fn new(to_output: bool) -> Tracker {
        Tracker {
            to_output,
            ..Default::default()
        }
    }

    /// Record `rec` (just finished); when divergent, keep its faulty outputs `iso` for its consumers.
    pub fn finished(&mut self, rec: &OpRecord, op: &Op, iso: Vec<Tensor>, oracle: Option<&Tensor>) {
        if !rec.divergent || self.kept >= MAX_FOLLOWED || iso.is_empty() {
            return;
        }
        self.kept += 1;
        let (scale, without) = match oracle {
            Some(o) if o.numel() == iso[0].numel() => {
                let c = lsq_scale(&iso[0].data, &o.data);
                let w = c.and_then(|c| {
                    let scaled: Vec<f32> =
                        iso[0].data.iter().map(|&v| (v as f64 / c) as f32).collect();
                    Compare::of(&scaled, &o.data).rel_l2
                });
                (c, w)
            }
            _ => (None, None),
        };
        self.found.entry(rec.id.clone()).or_default();
        self.scales.insert(rec.id.clone(), (scale, without));
        let shadow = (self.to_output && self.carried < MAX_CARRIED).then(|| {
            self.carried += 1;
            op.outputs
                .iter()
                .cloned()
                .zip(iso.iter().cloned())
                .collect()
        });
        self.faulty.push(Faulty {
            op: op.clone(),
            iso,
            scale,
            shadow,
        });
    }

    /// Whether `op` consumes an output of a divergent op being followed, or a tensor its error
    /// reached on the way to the model's output.
    pub fn consumes_faulty(&self, op: &Op) -> bool {
        self.faulty.iter().any(|f| {
            f.op.outputs.iter().any(|o| op.inputs.contains(o))
                || f.shadow
                    .as_ref()
                    .is_some_and(|sh| op.inputs.iter().any(|i| sh.contains_key(i)))
        })
    }

    /// Carries each followed op's error through `op` (inputs from its shadow where it has them,
    /// else the BF16 oracle's `vals`), in the BF16 oracle's numerics; at the head, compares with
    /// the oracle's logits `oracle_out`. Returns the executions it took.
    fn carry(
        &mut self,
        op: &Op,
        vals: &HashMap<String, Tensor>,
        oracle_out: &[Tensor],
        shared: &mut Shared,
        direct: &HashMap<usize, Vec<Tensor>>,
    ) -> Result<usize> {
        let mut execs = 0;
        for i in 0..self.faulty.len() {
            let f = &self.faulty[i];
            let Some(sh) = &f.shadow else { continue };
            if !op.inputs.iter().any(|id| sh.contains_key(id)) {
                continue;
            }
            let out = match direct.get(&i) {
                // a direct consumer ran on the faulty output already (its first execution)
                Some(o)
                    if op
                        .inputs
                        .iter()
                        .all(|id| !sh.contains_key(id) || f.op.outputs.contains(id)) =>
                {
                    o.clone()
                }
                _ => {
                    let inputs: Option<Vec<Tensor>> = op
                        .inputs
                        .iter()
                        .map(|id| sh.get(id).or_else(|| vals.get(id)).cloned())
                        .collect();
                    let Some(inputs) = inputs else { continue };
                    let refs: Vec<&Tensor> = inputs.iter().collect();
                    let mut env = PathEnv {
                        kind: PathKind::OracleBf16,
                        shared: &mut *shared,
                    };
                    execs += 1;
                    exec(op, &refs, &mut env)?
                }
            };
            if super::is_head(op) {
                if let (Some(x), Some(o)) = (out.first(), oracle_out.first()) {
                    let vocab = o.shape.last().copied().unwrap_or(0);
                    let h = HeadCompare::of(&x.data, &o.data, vocab);
                    self.at_output.insert(self.faulty[i].op.id.clone(), h);
                }
            }
            let f = &mut self.faulty[i];
            if let Some(sh) = &mut f.shadow {
                for (id, t) in op.outputs.iter().zip(out) {
                    sh.insert(id.clone(), t);
                }
            }
        }
        Ok(execs)
    }

    /// Run consumer `op` on each followed divergent op's faulty output it reads (inputs from the
    /// BF16 oracle's `vals`, outputs compared with the oracle's `oracle_out`); returns the
    /// executions it took.
    pub fn consumer(
        &mut self,
        op: &Op,
        vals: &HashMap<String, Tensor>,
        oracle_out: &[Tensor],
        shared: &mut Shared,
    ) -> Result<usize> {
        let mut execs = 0;
        let mut direct: HashMap<usize, Vec<Tensor>> = HashMap::new();
        let idx: Vec<usize> = (0..self.faulty.len())
            .filter(|&i| {
                self.faulty[i]
                    .op
                    .outputs
                    .iter()
                    .any(|o| op.inputs.contains(o))
            })
            .collect();
        for i in idx {
            let f = &self.faulty[i];
            let replaced = |scale: Option<f64>| -> Option<Vec<Tensor>> {
                op.inputs
                    .iter()
                    .map(|id| match f.op.outputs.iter().position(|o| o == id) {
                        Some(k) => {
                            let t = f.iso.get(k)?;
                            Some(match (k, scale) {
                                (0, Some(c)) => Tensor::new(
                                    t.shape.clone(),
                                    t.data
                                        .iter()
                                        .map(|&v| (v as f64 / c) as f32)
                                        .collect::<Vec<f32>>(),
                                ),
                                _ => t.clone(),
                            })
                        }
                        None => vals.get(id).cloned(),
                    })
                    .collect()
            };
            let (Some(faulty_in), Some(unscaled_in)) = (replaced(None), replaced(f.scale)) else {
                continue;
            };
            let mut run = |inputs: &[Tensor]| -> Result<Vec<Tensor>> {
                let refs: Vec<&Tensor> = inputs.iter().collect();
                let mut env = PathEnv {
                    kind: PathKind::OracleBf16,
                    shared: &mut *shared,
                };
                exec(op, &refs, &mut env)
            };
            let out_f = run(&faulty_in)?;
            if f.shadow.is_some() {
                direct.insert(i, out_f.clone());
            }
            let out_s = if f.scale.is_some() {
                run(&unscaled_in)?
            } else {
                out_f.clone()
            };
            let (Some(a), Some(o), Some(s)) = (out_f.first(), oracle_out.first(), out_s.first())
            else {
                continue;
            };
            let index_agreement = if has_index_output(op) {
                let pick = |v: &[Tensor]| -> Option<Vec<f32>> {
                    let t = if op.kind == OpKind::Router {
                        v.get(1)?
                    } else {
                        v.first()?
                    };
                    Some(t.data.to_vec())
                };
                match (pick(&out_f), pick(oracle_out)) {
                    (Some(x), Some(y)) if x.len() == y.len() && !x.is_empty() => Some(
                        x.iter().zip(&y).filter(|(p, q)| p == q).count() as f64 / x.len() as f64,
                    ),
                    _ => None,
                }
            } else {
                None
            };
            let d = Downstream {
                op: op.id.clone(),
                kind: format!("{:?}", op.kind),
                effect: Compare::of(&a.data, &o.data),
                magnitude_effect: Compare::of(&a.data, &s.data),
                noise: None,
                index_agreement,
                execs: if f.scale.is_some() { 2 } else { 1 },
            };
            execs += d.execs;
            self.found.entry(f.op.id.clone()).or_default().push(d);
        }
        execs += self.carry(op, vals, oracle_out, shared, &direct)?;
        Ok(execs)
    }

    /// Drop the faulty outputs no later op consumes (after step `step`).
    pub fn retire(&mut self, last_use: &HashMap<&str, usize>, step: usize) {
        let live = |o: &str| last_use.get(o).is_some_and(|&l| l > step);
        for f in &mut self.faulty {
            if let Some(sh) = &mut f.shadow {
                sh.retain(|id, _| live(id));
                if sh.is_empty() {
                    f.shadow = None;
                }
            }
        }
        self.faulty
            .retain(|f| f.op.outputs.iter().any(|o| live(o)) || f.shadow.is_some());
    }

    /// What was measured: per followed op its consumers, its factor and factor-free error, and
    /// its effect at the model's output where carried there.
    pub fn into_parts(self) -> Measured {
        Measured {
            found: self.found,
            scales: self.scales,
            at_output: self.at_output,
        }
    }
}

/// What the tracker measured (see [`Tracker::into_parts`]).
#[derive(Default)]
pub struct Measured {
    pub found: HashMap<String, Vec<Downstream>>,
    pub scales: Scales,
    pub at_output: HashMap<String, HeadCompare>,
}

/// The noise bound an op's output is held to when judging what reached it.
fn noise_bound(th: &Thresholds, rec: Option<&OpRecord>) -> f64 {
    let n = rec
        .and_then(|r| r.bf16_vs_fp32_isolated.rel_l2)
        .unwrap_or(0.0);
    (th.noise_multiplier * n).max(th.min_rel_l2)
}

/// Scale-invariant ops: a constant factor on the input does not change the output (RMSNorm,
/// the families' per-head and latent RMSNorms).
fn scale_invariant(kind: &str) -> bool {
    matches!(kind, "RmsNorm" | "HeadNorm" | "LatentNorm")
}

/// Isolated rel-L2 at or beyond which an op's output is not a perturbation of the oracle's
/// but a different tensor (zeroed, inverted, garbage): harmful whatever follows.
pub const HARMFUL_REL_L2: f64 = 0.9;

/// Why a divergent op was not followed into its consumers, for its consequence's text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unfollowed {
    /// More divergent ops than the tracker follows ([`MAX_FOLLOWED`]).
    BeyondLimit,
    /// The run took the prompt in token chunks (`probe::chunked`): no op was followed.
    Chunked,
}

/// Whether the head comparison `h` of a carried error is within the oracle's own noise at the
/// output (`noise`: BF16 vs FP32 oracle): top-1 agreement no lower than the oracle's, mean KL
/// within max(HEAD_KL_NOISE × the oracle's own, HEAD_KL_MIN).
fn output_unchanged(h: &HeadCompare, noise: Option<&HeadCompare>) -> bool {
    let (n_top1, n_kl) = noise.map_or((1.0, 0.0), |n| (n.top1, n.kl.unwrap_or(0.0)));
    let bound = (super::HEAD_KL_NOISE * n_kl).max(super::HEAD_KL_MIN);
    h.non_finite == 0 && h.top1 >= n_top1 && h.kl.is_some_and(|k| k <= bound)
}

fn head_text(h: &HeadCompare) -> String {
    format!(
        "next-token KL {} nats (max {}), top-1 agreement {:.1} %, top-5 {:.1} %",
        h.kl.map_or("undefined".into(), |k| format!("{k:.2e}")),
        h.kl_max.map_or("undefined".into(), |k| format!("{k:.2e}")),
        h.top1 * 100.0,
        h.top5 * 100.0
    )
}

/// Classify every divergent record from what was measured (`m`: its consumers, its factor and
/// factor-free error, its effect at the model's output). Absorbed only where proven:
/// - a constant factor before a scale-invariant op: the error is magnitude-only (its rel-L2 with
///   the least-squares factor removed is within the op's tolerance) and every consumer is an
///   RMSNorm whose output is the same with or without the factor (within its noise); or
/// - measured at the model's output: the op's faulty output carried through every later op
///   (BF16 oracle numerics) leaves the next-token distributions within the oracle's own noise
///   (top-1 agreement, mean KL: `output_unchanged`).
///
/// Harmful otherwise, and always when the op's own output is non-finite, identically zero where
/// the oracle's is not, or off by isolated rel-L2 ≥ [`HARMFUL_REL_L2`]. A consumer that happens to
/// hide the error in this run (a residual sum dominated by its other input) proves nothing.
pub fn classify(records: &mut [OpRecord], m: Measured, th: &Thresholds, unfollowed: Unfollowed) {
    let Measured {
        mut found,
        scales,
        at_output,
    } = m;
    let by_id: HashMap<String, usize> = records
        .iter()
        .enumerate()
        .map(|(i, r)| (r.id.clone(), i))
        .collect();
    let output_noise: Option<HeadCompare> = records
        .iter()
        .find_map(|r| r.head.as_ref().map(|h| h.head_bf16_vs_fp32.clone()));
    for i in 0..records.len() {
        if !records[i].divergent {
            continue;
        }
        let id = records[i].id.clone();
        let (scale, without) = scales.get(&id).copied().unwrap_or((None, None));
        let tol = records[i].tolerance;
        let mut ds = found.remove(&id).unwrap_or_default();
        for d in &mut ds {
            d.noise = Some(noise_bound(th, by_id.get(&d.op).map(|&j| &records[j])));
        }
        let at_out = at_output.get(&id).cloned();
        let served = &records[i].stats["served_isolated"];
        let oracle = &records[i].stats["oracle_bf16"];
        let self_nf = served.non_finite() && !oracle.non_finite();
        let self_zero = served.numel > 0
            && served.zeros == served.numel
            && !(oracle.numel > 0 && oracle.zeros == oracle.numel);
        let iso = records[i].served_isolated_vs_bf16.rel_l2;
        let magnitude_only = without.is_some_and(|w| w <= tol) && !self_nf;
        let base =
            |severity, why: String, shows_at: Option<String>, absorbed_by: Vec<String>, ds| {
                Consequence {
                    severity,
                    absorbed_by,
                    shows_at,
                    why,
                    scale,
                    rel_l2_without_scale: without,
                    downstream: ds,
                    at_output: at_out.clone(),
                }
            };
        // the op's own output is broken: harmful whatever follows
        let broken = if self_nf {
            Some("its own output has NaN/Inf where the oracle has none".to_string())
        } else if self_zero {
            Some("its own output is identically zero where the oracle's is not".to_string())
        } else {
            iso.filter(|r| *r >= HARMFUL_REL_L2).map(|r| {
                format!("its own output is not a perturbation of the oracle's (isolated rel-L2 {r:.2e} ≥ {HARMFUL_REL_L2})")
            })
        };
        if let Some(why) = broken {
            let why = match &at_out {
                Some(h) => format!("{why}; at the model's output: {}", head_text(h)),
                None if unfollowed == Unfollowed::Chunked && !scales.contains_key(&id) => format!(
                    "{why} (not followed downstream: the run took the prompt in token chunks, which does not replay an op's consumers)"
                ),
                None => why,
            };
            records[i].consequence = Some(base(
                Severity::Harmful,
                why,
                Some(id.clone()),
                Vec::new(),
                ds,
            ));
            continue;
        }
        // what each consumer shows, and whether it proves absorption (scale invariance)
        let mut shows: Option<(String, String)> = None;
        let mut proven: Vec<(String, String)> = Vec::new();
        let mut hidden: Vec<(String, f64, f64)> = Vec::new();
        for d in &ds {
            let noise = d.noise.unwrap_or(th.min_rel_l2);
            let eff = d.effect.rel_l2;
            if d.effect.new_non_finite > 0 {
                shows.get_or_insert((
                    d.op.clone(),
                    format!("{} NaN/Inf appear at {}", d.effect.new_non_finite, d.op),
                ));
            } else if let Some(a) = d.index_agreement.filter(|a| *a < 1.0) {
                shows.get_or_insert((
                    d.op.clone(),
                    format!(
                        "the choices of {} change ({:.1} % of them)",
                        d.op,
                        (1.0 - a) * 100.0
                    ),
                ));
            } else if scale_invariant(&d.kind)
                && magnitude_only
                && d.magnitude_effect.rel_l2.is_some_and(|e| e <= noise)
            {
                proven.push((d.op.clone(), format!(
                    "an RMSNorm divides by its input's RMS, so a constant factor on its input does not reach its output: the error is a factor ×{:.4} (rel-L2 {:.2e} without it, within the op's tolerance {:.2e}) and {}'s output is the same with or without it (rel-L2 {:.2e} ≤ its noise {:.2e})",
                    scale.unwrap_or(f64::NAN),
                    without.unwrap_or(f64::NAN),
                    tol,
                    d.op,
                    d.magnitude_effect.rel_l2.unwrap_or(0.0),
                    noise
                )));
            } else if eff.is_some_and(|e| e <= noise) {
                hidden.push((d.op.clone(), eff.unwrap_or(0.0), noise));
            } else {
                shows.get_or_insert((
                    d.op.clone(),
                    format!(
                        "the error reaches {}'s output (rel-L2 {} vs the oracle, noise {:.2e})",
                        d.op,
                        eff.map_or("undefined".into(), |e| format!("{e:.2e}")),
                        noise
                    ),
                ));
            }
        }
        let all_proven = !ds.is_empty() && proven.len() == ds.len();
        let c = if all_proven && shows.is_none() {
            base(
                Severity::Absorbed,
                proven
                    .iter()
                    .map(|(o, w)| format!("{o}: {w}"))
                    .collect::<Vec<_>>()
                    .join("; "),
                None,
                proven.into_iter().map(|(o, _)| o).collect(),
                ds,
            )
        } else if let Some(h) = at_out
            .as_ref()
            .filter(|h| output_unchanged(h, output_noise.as_ref()))
        {
            // measured where it matters: the model's next-token distributions
            let noise_txt = output_noise.as_ref().map_or(String::new(), |n| {
                format!(" (the BF16 oracle's own against FP32: {})", head_text(n))
            });
            base(
                Severity::Absorbed,
                format!("measured at the model's output: with this op's error carried through every later op, {}{noise_txt}", head_text(h)),
                None,
                vec!["head".to_string()],
                ds,
            )
        } else if let Some(h) = &at_out {
            base(
                Severity::Harmful,
                format!("the error reaches the model's output: {}", head_text(h)),
                Some("head".to_string()),
                Vec::new(),
                ds,
            )
        } else if let Some((at, why)) = shows {
            base(Severity::Harmful, why, Some(at), Vec::new(), ds)
        } else if !hidden.is_empty() {
            let (o, e, n) = &hidden[0];
            base(
                Severity::Harmful,
                format!("not proven absorbed: {o}'s output moves by rel-L2 {e:.2e} ≤ its noise {n:.2e} in this run, but only a constant factor before an RMSNorm or an unchanged model output proves an error harmless (run through the head, or with --layers up to the last layer, to measure it there)"),
                None,
                Vec::new(),
                ds,
            )
        } else if ds.is_empty() {
            let why = if scales.contains_key(&id) {
                "no later op the run measured consumes its output (it is the last one measured): counted as harmful".to_string()
            } else {
                match unfollowed {
                    Unfollowed::BeyondLimit => format!(
                        "not followed downstream (more than {MAX_FOLLOWED} divergent ops): counted as harmful"
                    ),
                    Unfollowed::Chunked => "not followed downstream (the run took the prompt in token chunks, which does not replay an op's consumers; run without --chunk, or a shorter prompt, to see whether it is absorbed): counted as harmful".into(),
                }
            };
            base(Severity::Harmful, why, None, Vec::new(), ds)
        } else {
            base(
                Severity::Harmful,
                "not proven absorbed".into(),
                None,
                Vec::new(),
                ds,
            )
        };
        records[i].consequence = Some(c);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_fit_recovers_a_factor() {
        let o: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let f: Vec<f32> = o.iter().map(|v| v * 1.28).collect();
        let c = lsq_scale(&f, &o).unwrap();
        assert!((c - 1.28).abs() < 1e-6, "{c}");
        assert_eq!(lsq_scale(&f, &vec![0.0; 100]), None);
    }
}
