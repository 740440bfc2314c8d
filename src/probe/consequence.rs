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
}

/// Per followed op: its least-squares factor and its error with the factor removed.
pub type Scales = HashMap<String, (Option<f64>, Option<f64>)>;

/// A divergent op whose consumers are still to run.
struct Faulty {
    op: Op,
    iso: Vec<Tensor>,
    scale: Option<f64>,
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
}

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
        self.faulty.push(Faulty {
            op: op.clone(),
            iso,
            scale,
        });
    }

    /// Whether `op` consumes an output of a divergent op being followed.
    pub fn consumes_faulty(&self, op: &Op) -> bool {
        self.faulty
            .iter()
            .any(|f| f.op.outputs.iter().any(|o| op.inputs.contains(o)))
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
        Ok(execs)
    }

    /// Drop the faulty outputs no later op consumes (after step `step`).
    pub fn retire(&mut self, last_use: &HashMap<&str, usize>, step: usize) {
        self.faulty.retain(|f| {
            f.op.outputs
                .iter()
                .any(|o| last_use.get(o.as_str()).is_some_and(|&l| l > step))
        });
    }

    /// What was measured: per followed op its consumers, and its factor and factor-free error.
    pub fn into_parts(self) -> (HashMap<String, Vec<Downstream>>, Scales) {
        (self.found, self.scales)
    }
}

/// The noise bound an op's output is held to when judging what reached it.
fn noise_bound(th: &Thresholds, rec: Option<&OpRecord>) -> f64 {
    let n = rec
        .and_then(|r| r.bf16_vs_fp32_isolated.rel_l2)
        .unwrap_or(0.0);
    (th.noise_multiplier * n).max(th.min_rel_l2)
}

fn why_absorber(kind: &str) -> &'static str {
    match kind {
        "RmsNorm" => "an RMSNorm divides by its input's RMS, so a constant factor on its input does not reach its output",
        "Router" | "Indexer" => "its choices do not change",
        _ => "the error does not reach its output",
    }
}

/// Why a divergent op was not followed into its consumers, for its consequence's text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unfollowed {
    /// More divergent ops than the tracker follows ([`MAX_FOLLOWED`]).
    BeyondLimit,
    /// The run took the prompt in token chunks (`probe::chunked`): no op was followed.
    Chunked,
}

/// Classify every divergent record from what its consumers showed (`found`: per op id) and the
/// factors measured when it finished (`scales`). Records that were not followed (beyond
/// [`MAX_FOLLOWED`]) are harmful, as are ops nothing consumes in the run (their output is what the
/// run ends with).
pub fn classify(
    records: &mut [OpRecord],
    mut found: HashMap<String, Vec<Downstream>>,
    scales: &Scales,
    th: &Thresholds,
    unfollowed: Unfollowed,
) {
    let by_id: HashMap<String, usize> = records
        .iter()
        .enumerate()
        .map(|(i, r)| (r.id.clone(), i))
        .collect();
    for i in 0..records.len() {
        if !records[i].divergent {
            continue;
        }
        let (scale, without) = scales.get(&records[i].id).copied().unwrap_or((None, None));
        let tol = records[i].tolerance;
        let mut ds = found.remove(&records[i].id).unwrap_or_default();
        for d in &mut ds {
            d.noise = Some(noise_bound(th, by_id.get(&d.op).map(|&j| &records[j])));
        }
        let self_nf = records[i].stats["served_isolated"].non_finite()
            && !records[i].stats["oracle_bf16"].non_finite();
        let magnitude_only = without.is_some_and(|w| w <= tol) && !self_nf;
        let mut absorbed_by = Vec::new();
        let mut harmful: Option<(String, String)> = None;
        for d in &ds {
            let noise = d.noise.unwrap_or(th.min_rel_l2);
            let verdict: std::result::Result<String, String> = if d.effect.new_non_finite > 0 {
                Err(format!(
                    "{} NaN/Inf appear at {}",
                    d.effect.new_non_finite, d.op
                ))
            } else if let Some(a) = d.index_agreement.filter(|a| *a < 1.0) {
                Err(format!(
                    "the choices of {} change ({:.1} % of them)",
                    d.op,
                    (1.0 - a) * 100.0
                ))
            } else if d.effect.rel_l2.is_some_and(|e| e <= noise) {
                Ok(format!(
                    "{}: {}'s output moves by rel-L2 {:.2e} ≤ its noise {:.2e}",
                    why_absorber(&d.kind),
                    d.op,
                    d.effect.rel_l2.unwrap_or(0.0),
                    noise
                ))
            } else if magnitude_only && d.magnitude_effect.rel_l2.is_some_and(|e| e <= noise) {
                Ok(format!(
                    "{}: the error is a factor ×{:.4} (rel-L2 {:.2e} without it, within the op's tolerance {:.2e}) and {}'s output is the same with or without it (rel-L2 {:.2e} ≤ its noise {:.2e})",
                    why_absorber(&d.kind),
                    scale.unwrap_or(f64::NAN),
                    without.unwrap_or(f64::NAN),
                    tol,
                    d.op,
                    d.magnitude_effect.rel_l2.unwrap_or(0.0),
                    noise
                ))
            } else {
                Err(format!(
                    "the error reaches {}'s output (rel-L2 {} vs the oracle, noise {:.2e})",
                    d.op,
                    d.effect
                        .rel_l2
                        .map_or("undefined".into(), |e| format!("{e:.2e}")),
                    noise
                ))
            };
            match verdict {
                Ok(w) => absorbed_by.push((d.op.clone(), w)),
                Err(w) => {
                    if harmful.is_none() {
                        harmful = Some((d.op.clone(), w));
                    }
                }
            }
        }
        let c = if self_nf {
            Consequence {
                severity: Severity::Harmful,
                absorbed_by: Vec::new(),
                shows_at: Some(records[i].id.clone()),
                why: "its own output has NaN/Inf where the oracle has none".into(),
                scale,
                rel_l2_without_scale: without,
                downstream: ds,
            }
        } else if let Some((at, why)) = harmful {
            Consequence {
                severity: Severity::Harmful,
                absorbed_by: Vec::new(),
                shows_at: Some(at),
                why,
                scale,
                rel_l2_without_scale: without,
                downstream: ds,
            }
        } else if ds.is_empty() {
            Consequence {
                severity: Severity::Harmful,
                absorbed_by: Vec::new(),
                shows_at: None,
                why: if scales.contains_key(&records[i].id) {
                    "no later op the run measured consumes its output (it is the last one measured): counted as harmful"
                        .into()
                } else {
                    match unfollowed {
                        Unfollowed::BeyondLimit => format!(
                            "not followed downstream (more than {MAX_FOLLOWED} divergent ops): counted as harmful"
                        ),
                        Unfollowed::Chunked => "not followed downstream (the run took the prompt in token chunks, which does not replay an op's consumers; run without --chunk, or a shorter prompt, to see whether it is absorbed): counted as harmful".into(),
                    }
                },
                scale,
                rel_l2_without_scale: without,
                downstream: ds,
            }
        } else {
            Consequence {
                severity: Severity::Absorbed,
                why: absorbed_by
                    .iter()
                    .map(|(o, w)| format!("{o}: {w}"))
                    .collect::<Vec<_>>()
                    .join("; "),
                absorbed_by: absorbed_by.into_iter().map(|(o, _)| o).collect(),
                shows_at: None,
                scale,
                rel_l2_without_scale: without,
                downstream: ds,
            }
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
