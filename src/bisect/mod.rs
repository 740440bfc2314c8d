//! Bisect: every op whose own numerics diverge, and the scale parameter that explains each.
//!
//! One `probe::run` gives the isolated and propagated picture, and keeps the BF16-oracle view of
//! every divergent op. The isolated error of each op is measured on the oracle's inputs, so each
//! divergent op is explained on its own: every hypothesis about a scale the op consumes costs one
//! re-evaluation of that op. A hypothesis becomes an op's verdict only when it brings the op back
//! within the tolerance the runner held it to; otherwise the op's health counters are shown
//! instead of a guess. Ops of one root cause (the same verdict at the same op of several layers)
//! form one finding; once a verdict is known, the same op elsewhere tries it first (three
//! evaluations instead of the whole set). Faults the oracle shares (it decodes the same bytes)
//! cannot diverge, so bisect also reports the static lint of the layers it read and oracle
//! anomalies (zero or non-finite outputs, magnitude jumps across layers).

mod experts;
mod fp8;
mod prefill;
pub mod render;
pub mod search;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Instant;

use serde::Serialize;

use crate::checkpoint::{Checkpoint, WeightMeta, WeightTensors};
use crate::metrics::Compare;
use crate::numerics::nvfp4::{Convention, QuantHealth};
use crate::probe::consequence::{Consequence, Severity};
use crate::probe::findings::{self, Finding, Impact, Level, OpValue, Source};
use crate::probe::replay::{self, Capture, Patch, Replayer};
use crate::probe::scan::{self as pscan, OracleOp};
use crate::probe::{self, OpRecord, RunOptions, RunResult, Summary};
use crate::served::{Nvfp4Params, Override};
use crate::Result;

/// Divergent ops that get the whole hypothesis set; beyond it only ops of a root cause already
/// found (same op in another layer: its verdict is tried first) are explained, the rest are listed
/// unexplained. Bounds the cost at MAX_SEARCHED × (2 + hypotheses) op evaluations.
pub const MAX_SEARCHED: usize = 16;

/// The parameter family a hypothesis changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Family {
    /// Activation global scale (g_x / its reciprocal).
    InputScale,
    /// Weight global scale (d_w).
    WeightScale,
    /// GEMM alpha.
    Alpha,
    /// E4M3 block scales (layout, NaN bytes).
    BlockScales,
    /// e2m1 nibble order of the packed weight.
    NibbleOrder,
    /// gpt-oss's `w13` gate/up row order (interleaved in the release).
    GateUpOrder,
    /// The state an engine carries across its chunked-prefill boundaries (`--served-chunk`).
    ChunkState,
    /// The FP8 activation quantizer's scale (its power-of-two packing).
    ActScale,
    /// The experts' SwiGLU clamp (config.json's `swiglu_limit`, a kernel argument).
    SwigluClamp,
}

/// A named parameter: checkpoint tensor(s), the engine's name, values before and after the fix.
#[derive(Clone, Debug, Serialize)]
pub struct ParamRef {
    pub family: Family,
    /// Weight bases the hypothesis changed.
    pub bases: Vec<String>,
    /// Checkpoint tensor names holding the parameter (of the first base).
    pub tensors: Vec<String>,
    /// The engine's (vLLM's) parameter name.
    pub engine: String,
    /// The value the served path used (first base).
    pub current: Option<f32>,
    /// The value that restores agreement (first base).
    pub corrected: Option<f32>,
    /// The value as stored in the checkpoint (first base), when a scalar.
    pub stored: Option<f32>,
    /// The fused sibling's tensor whose value the engine's merged parameter took (own-shard kinds).
    pub from_sibling: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Hypothesis {
    /// Stable kind id, e.g. `input-reciprocal`.
    pub kind: String,
    /// Which weights: `all experts of L1 (w1, w3, w2)`, `layers.1.attn.wq_a`.
    pub unit: String,
    pub what: String,
    pub param: ParamRef,
    #[serde(skip)]
    pub patches: Vec<(String, Patch)>,
    /// Preference among hypotheses that restore equally well (lower = more specific).
    pub prior: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct Ranked {
    pub hypothesis: Hypothesis,
    pub after: Compare,
    pub restores: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct Verdict {
    pub op: String,
    pub sentence: String,
    pub param: ParamRef,
    pub kind: String,
    pub unit: String,
    pub before: Compare,
    pub after: Compare,
}

/// The first divergent op and what explains it.
#[derive(Clone, Debug, Serialize)]
pub struct Divergence {
    pub op: String,
    /// The op's step in the run.
    pub step: Option<usize>,
    pub reason: Option<String>,
    pub tolerance: f64,
    pub weights: Vec<(String, String)>,
    /// Where the accumulated error first shows (propagated), at or after the op.
    pub shows_at: Option<String>,
    /// First layer output (`Ln.out`) where it shows.
    pub shows_at_layer_out: Option<String>,
    /// The served op on the oracle's inputs, re-evaluated by the replay (equals the run's isolated metric).
    pub before: Compare,
    pub verdict: Option<Verdict>,
    /// Hypotheses ranked by restored rel-L2 (best first), at most 8.
    pub ranked: Vec<Ranked>,
    pub hypotheses_tried: usize,
    /// When no hypothesis explains it: the op's health counters, per served linear.
    pub health: Option<QuantHealth>,
    pub health_per_linear: Vec<(String, QuantHealth)>,
    pub act_amax_over_calib: Option<f64>,
    /// Harmful or absorbed, with where it shows or which op absorbs it (from the run).
    pub consequence: Option<Consequence>,
    /// Op evaluations this op's attribution cost (capture pass not included).
    pub evals: usize,
    /// Set when the op was not searched (budget) or was explained by a known root cause's verdict.
    pub note: Option<String>,
}

/// A magnitude anomaly that no divergence can show (the oracle decodes the same bytes).
#[derive(Clone, Debug, Serialize)]
pub struct Anomaly {
    pub op: String,
    pub sentence: String,
    /// amax(out)/amax(in) of this op (oracle).
    pub gain: Option<f64>,
    /// Median gain of the same op in the other layers.
    pub gain_other_layers: Option<f64>,
    pub oracle_non_finite: bool,
    pub weights: Vec<String>,
    /// Stored scale tensors of `weights` broken on their face (see [`broken_scales`]).
    pub suspects: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct BisectResult {
    pub summary: Summary,
    /// The first divergent op (as in `nvfp4-probe.bisect/1`).
    pub divergence: Option<Divergence>,
    /// Every divergent op, in run order, each explained on its own.
    pub divergences: Vec<Divergence>,
    /// Every finding (divergences grouped by root cause, lint of the layers read, anomalies),
    /// ordered by consequence; levels as without `--strict` ([`BisectResult::set_strict`]).
    pub findings: Vec<Finding>,
    pub anomalies: Vec<Anomaly>,
    pub ops: usize,
    pub seconds_run: f64,
    pub seconds_bisect: f64,
    /// How the divergent op was found: which search ran, its steps, time and op executions per phase.
    pub search: SearchReport,
}

/// How bisect looks for the first divergent op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Search {
    /// `layers` when the run covers at least 8 layers and its largest layer holds at least
    /// 256 MiB of weights, else `linear`.
    // (the numbers are `search::AUTO_MIN_LAYERS` and `AUTO_LAYER_BYTES`; cli.rs's
    // `search_help_matches_the_auto_thresholds` keeps them equal)
    #[default]
    Auto,
    /// One full run, then hypotheses at the first divergent op.
    Linear,
    /// Binary search over layers on propagated error, then one layer measured in full; falls back
    /// to `linear` when it finds nothing conclusive.
    Layers,
}

/// One phase of a bisect: wall time and op executions (one op on one numerics path = 1).
#[derive(Clone, Debug, Serialize)]
pub struct Phase {
    pub name: String,
    pub seconds: f64,
    pub execs: usize,
}

/// One probe of the layer search.
#[derive(Clone, Debug, Serialize)]
pub struct Step {
    /// `scan` (oracle + served from the first layer), `probe` (served alone from the oracle's state
    /// at `layers.0`), `measure` (one layer, full isolated measurement).
    pub kind: String,
    /// Inclusive layer range executed.
    pub layers: (usize, usize),
    /// Where the served output was compared (`L3.out`), or the measured layer's first divergent op.
    pub at: Option<String>,
    pub rel_l2: Option<f64>,
    pub cos: Option<f64>,
    /// Clearly broken there (why), or not.
    pub broken: Option<String>,
    pub execs: usize,
    pub seconds: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct SearchReport {
    pub requested: Search,
    /// The search whose result is reported: `linear` or `layers`.
    pub ran: Search,
    /// Why this search (auto's rule, or a fallback).
    pub why: String,
    /// Set when the layer search ran, found nothing conclusive, and the linear search took over.
    pub fell_back: Option<String>,
    /// The layer the layer search named (before the in-layer scan).
    pub layer: Option<usize>,
    pub steps: Vec<Step>,
    pub phases: Vec<Phase>,
}

impl SearchReport {
    pub fn total_execs(&self) -> usize {
        self.phases.iter().map(|p| p.execs).sum()
    }
    fn linear(why: &str) -> SearchReport {
        SearchReport {
            requested: Search::Linear,
            ran: Search::Linear,
            why: why.into(),
            fell_back: None,
            layer: None,
            steps: Vec::new(),
            phases: Vec::new(),
        }
    }
}

impl BisectResult {
    /// A finding that fails the bisect: a harmful divergence, a lint error, an anomaly (absorbed
    /// divergences count only under `--strict`).
    pub fn has_findings(&self) -> bool {
        self.findings.iter().any(|f| f.level == Level::Error)
    }

    /// `--strict`: absorbed findings are errors.
    pub fn set_strict(&mut self, strict: bool) {
        for f in &mut self.findings {
            f.set_strict(strict);
        }
        let steps: HashMap<String, usize> = self
            .divergences
            .iter()
            .filter_map(|d| Some((d.op.clone(), d.step?)))
            .collect();
        findings::sort(&mut self.findings, |op| {
            steps.get(op).copied().unwrap_or(usize::MAX)
        });
    }
}

/// Bisect over `opts.layers`: one run, then hypotheses at the first divergent op.
pub fn bisect(ckpt: &Checkpoint, opts: &RunOptions) -> Result<BisectResult> {
    // the run keeps the divergent ops' oracle inputs, so the replay needs no capture pass
    let (res, caps) = probe::run_capturing(ckpt, opts, true)?;
    bisect_run_from(ckpt, opts, &res, caps)
}

/// Bisect with a chosen search (`Auto` decides by [`search::auto_choice`]).
pub fn bisect_with(ckpt: &Checkpoint, opts: &RunOptions, how: Search) -> Result<BisectResult> {
    let (ran, why) = match how {
        Search::Auto => search::auto_choice(ckpt, opts)?,
        Search::Linear => (Search::Linear, "requested".to_string()),
        Search::Layers => (Search::Layers, "requested".to_string()),
    };
    if ran == Search::Layers {
        let mut r = search::layer_search(ckpt, opts)?;
        r.search.requested = how;
        r.search.why = why;
        return Ok(r);
    }
    let mut r = bisect(ckpt, opts)?;
    r.search.requested = how;
    r.search.why = why;
    Ok(r)
}

/// Bisect given a finished run over `opts` (the run's options must be these).
pub fn bisect_run(ckpt: &Checkpoint, opts: &RunOptions, res: &RunResult) -> Result<BisectResult> {
    bisect_run_from(ckpt, opts, res, Vec::new())
}

/// [`bisect_run`] with the oracle views the run kept ([`probe::run_capturing`]); an op without one
/// is captured by running the oracle up to it.
pub fn bisect_run_from(
    ckpt: &Checkpoint,
    opts: &RunOptions,
    res: &RunResult,
    caps: Vec<Capture>,
) -> Result<BisectResult> {
    let t0 = Instant::now();
    let mut cost = Cost::default();
    let first = res.records.iter().find(|r| r.divergent);
    let divergences = explain_all(ckpt, opts, &res.records, caps, &mut cost)?;
    let divergence = divergences.first().cloned();
    // an anomaly at or before the divergent op means the oracle itself is off there: the divergence
    // may be a consequence (activation calibration no longer fits the magnitudes)
    let upto = first.map_or(res.records.len(), |r| {
        res.records
            .iter()
            .position(|x| x.id == r.id)
            .map_or(0, |i| i + 1)
    });
    let mut anomalies = find_anomalies(&res.records[..upto]);
    name_suspects(ckpt, &mut anomalies);
    let lint = lint_of(ckpt, opts)?;
    let findings = all_findings(&res.records, &divergences, &anomalies, &lint);
    let ops_run = match &opts.stop_after {
        Some(_) => res.records.last().map_or(0, |r| r.step + 1),
        None => {
            let cfg = ckpt.model_config()?;
            let b = opts.layers.1;
            let with_head = b + 1 == cfg.num_hidden_layers && ckpt.resolve("head.weight").is_some();
            crate::model::graph::build_graph(cfg, b, with_head).len()
        }
    };
    let seconds_bisect = t0.elapsed().as_secs_f64();
    let mut search = SearchReport::linear("requested");
    search.phases.push(Phase {
        name: "run".into(),
        seconds: res.seconds,
        execs: pscan::run_execs(ckpt, ops_run, &res.records),
    });
    cost.phases(seconds_bisect, &mut search.phases);
    Ok(BisectResult {
        summary: res.summary.clone(),
        divergence,
        divergences,
        findings,
        anomalies,
        ops: res.records.len(),
        seconds_run: res.seconds,
        seconds_bisect,
        search,
    })
}

/// Op executions and time of the attribution (capture + hypothesis replays).
#[derive(Default)]
struct Cost {
    capture_execs: usize,
    capture_seconds: f64,
    evals: usize,
}

impl Cost {
    fn phases(&self, seconds_total: f64, out: &mut Vec<Phase>) {
        if self.capture_execs > 0 {
            out.push(Phase {
                name: "capture".into(),
                seconds: self.capture_seconds,
                execs: self.capture_execs,
            });
        }
        out.push(Phase {
            name: "hypotheses".into(),
            seconds: (seconds_total - self.capture_seconds).max(0.0),
            execs: self.evals,
        });
    }
}

/// The op without its layer: `L3.ffn.experts` → `ffn.experts` (the key of "the same op elsewhere").
fn op_suffix(op: &str) -> &str {
    op.split_once('.')
        .filter(|(l, _)| l.starts_with('L'))
        .map_or(op, |(_, s)| s)
}

/// Explain every divergent op of `records` on its own (the first [`MAX_SEARCHED`] with every
/// hypothesis; an op whose suffix already has a verdict tries that verdict first; beyond the
/// budget, ops without a known root cause are listed unexplained).
fn explain_all(
    ckpt: &Checkpoint,
    opts: &RunOptions,
    records: &[OpRecord],
    mut caps: Vec<Capture>,
    cost: &mut Cost,
) -> Result<Vec<Divergence>> {
    let mut out: Vec<Divergence> = Vec::new();
    let mut known: HashMap<String, String> = HashMap::new();
    let mut searched = 0usize;
    for rec in records.iter().filter(|r| r.divergent) {
        let suffix = op_suffix(&rec.id).to_string();
        let hint = known.get(&suffix).cloned();
        if hint.is_none() && searched >= MAX_SEARCHED {
            out.push(unexplained(
                rec,
                format!("not searched: {MAX_SEARCHED} divergent ops were searched already (bisect's budget); bisect a narrower --layers range"),
            ));
            continue;
        }
        let cap = caps
            .iter()
            .position(|c| c.op.id == rec.id)
            .map(|i| caps.swap_remove(i));
        let d = explain(ckpt, opts, records, rec, cap, cost, hint.as_deref())?;
        if hint.is_none() || d.note.is_none() {
            searched += 1;
        }
        if let Some(v) = &d.verdict {
            known.entry(suffix).or_insert_with(|| v.kind.clone());
        }
        out.push(d);
    }
    Ok(out)
}

/// A divergent op listed without hypotheses.
fn unexplained(rec: &OpRecord, why: String) -> Divergence {
    Divergence {
        op: rec.id.clone(),
        step: Some(rec.step),
        reason: rec.reason.clone(),
        tolerance: rec.tolerance,
        weights: rec.weights.clone(),
        shows_at: None,
        shows_at_layer_out: None,
        before: rec.served_isolated_vs_bf16.clone(),
        verdict: None,
        ranked: Vec::new(),
        hypotheses_tried: 0,
        health: rec.health,
        health_per_linear: Vec::new(),
        act_amax_over_calib: rec.act_amax_over_calib,
        consequence: rec.consequence.clone(),
        evals: 0,
        note: Some(why),
    }
}

/// The static lint of the weights a run over `opts.layers` reads (default rules).
fn lint_of(ckpt: &Checkpoint, opts: &RunOptions) -> Result<Vec<crate::lint::Finding>> {
    Ok(crate::lint::lint_layers(ckpt, &crate::lint::Rules::default(), opts.layers.1)?.findings)
}

/// What to do about a verdict, by kind.
fn fix_text(kind: &str, p: &ParamRef) -> String {
    let t = p
        .tensors
        .first()
        .map_or("the parameter".to_string(), |t| format!("`{t}`"));
    let to = fmt_v(p.corrected);
    match kind {
        "input-reciprocal" | "weight-reciprocal" => format!(
            "read {t} in the checkpoint's convention (compressed-tensors stores the encode scale 2688/amax, ModelOpt the decode scale amax/2688): the engine's `{}` must be {to} (docs/NVFP4.md §3.4)",
            p.engine
        ),
        "alpha-recomputed" => format!(
            "compute alpha at load as d_x·d_w of the scales in use: {to} (docs/NVFP4.md §3.5)"
        ),
        "input-x2688" | "input-div2688" | "weight-x2688" | "weight-div2688" => format!(
            "{t} is off by 2688 = 448·6 (an amax stored where the scale belongs, or the reverse): the engine's `{}` must be {to}",
            p.engine
        ),
        "weight-own-shard" | "input-own-shard" | "weight-sibling-shard" | "input-sibling-shard" => format!(
            "re-export the fused pair with one shared tensor scale (linked observers: the max amax of the pair), or requantize the shard at load: {t} needs {to}, the merged value is {} (docs/NVFP4.md §3.4; vLLM #54974)",
            fmt_v(p.current)
        ),
        "nibble-swap" => "read the packed e2m1 bytes with the even element in the low nibble (docs/NVFP4.md §1.2)".into(),
        "unshift-rows" => format!("{t}: the block-scale rows are shifted by one; fix the row offset where they are written or read"),
        "unswizzle" => format!("{t} is stored in the 128×4 swizzled layout: unswizzle it at load or re-export it linear (docs/NVFP4.md §5.1)"),
        "stored-block-scales" => format!("re-read {t} from the checkpoint (non-finite bytes: re-export the weight; ModelOpt #1633)"),
        "gate-up-interleave" | "gate-up-deinterleave" => format!("read {t} as the release stores it: gate row i at row 2i, up row i at row 2i + 1 (the GLU reads interleaved pairs); convert to another kernel layout exactly once"),
        "stored-mxfp4-scales" => format!("load {t} beside the `_blocks` and decode each block with its E8M0 scale (2^(s − 127))"),
        "fp8-act-pow2-scale" => "quantize the activation with the power-of-two scale the kernel keeps: round the f32 scale up to a power of two before dividing (DeepSeek's `act_quant` with `scale_fmt=\"ue8m0\"`; sglang #25704)".into(),
        "swiglu-clamp" => format!("pass the config's `swiglu_limit` ({to}) to the experts' kernel: gate ≤ limit and −limit ≤ up ≤ limit before the GLU (vLLM's FusedMoE `swiglu_limit`)"),
        "fp8-block-scale-once" => format!("apply {t} once: either fold it into the dequantized weight or pass it to the GEMM as the block scale, not both"),
        "stored-nvfp4-scales" => format!("map ModelOpt's underscore scale keys ({t}, `_weight_scale_2`, `_input_scale`) onto the fused experts' parameters (a scalar broadcast to every expert), as vLLM #46645 does"),
        "input-calibrated" => format!(
            "recalibrate the activation scale: {t}{} gives {}, the activations the oracle feeds this op need {to} (2688/amax)",
            p.stored.map(|v| format!(" = {}", fmt_v(Some(v)))).unwrap_or_default(),
            fmt_v(p.current)
        ),
        prefill::KIND => prefill::fix(p),
        _ => format!("set `{}` to {to}", p.engine),
    }
}

/// Divergences grouped by root cause (same verdict kind at the same op, and the same impact), lint
/// findings and anomalies, ordered by consequence (levels without `--strict`).
fn all_findings(
    records: &[OpRecord],
    divs: &[Divergence],
    anomalies: &[Anomaly],
    lint: &[crate::lint::Finding],
) -> Vec<Finding> {
    let impact_of = |d: &Divergence| match d.consequence.as_ref().map(|c| c.severity) {
        Some(Severity::Absorbed) => Impact::Absorbed,
        _ => Impact::Harmful,
    };
    let mut out: Vec<Finding> = Vec::new();
    let mut key_of: Vec<(String, usize)> = Vec::new();
    for d in divs {
        let impact = impact_of(d);
        let key = match &d.verdict {
            Some(v) => format!("{}|{}|{}", v.kind, op_suffix(&d.op), impact.as_str()),
            None => format!("unexplained|{}", d.op),
        };
        let value = OpValue {
            op: d.op.clone(),
            tensor: d
                .verdict
                .as_ref()
                .and_then(|v| v.param.tensors.first().cloned()),
            current: d.verdict.as_ref().and_then(|v| v.param.current),
            corrected: d.verdict.as_ref().and_then(|v| v.param.corrected),
            before: d.before.clone(),
            after: d.verdict.as_ref().map(|v| v.after.clone()),
        };
        if let Some(&(_, i)) = key_of.iter().find(|(k, _)| *k == key) {
            let f = &mut out[i];
            f.ops.push(d.op.clone());
            for t in d.verdict.iter().flat_map(|v| v.param.tensors.iter()) {
                if !f.tensors.contains(t) {
                    f.tensors.push(t.clone());
                }
            }
            for a in d.consequence.iter().flat_map(|c| c.absorbed_by.iter()) {
                if !f.absorbed_by.contains(a) {
                    f.absorbed_by.push(a.clone());
                }
            }
            f.values.push(value);
            continue;
        }
        let why = match &d.consequence {
            Some(c) => c.why.clone(),
            None => "not analysed downstream (counted as harmful)".into(),
        };
        let f = match &d.verdict {
            Some(v) => Finding {
                source: Source::Divergence,
                impact,
                level: if impact == Impact::Absorbed { Level::Warning } else { Level::Error },
                ops: vec![d.op.clone()],
                tensors: v.param.tensors.clone(),
                parameter: Some(v.param.engine.clone()),
                kind: Some(v.kind.clone()),
                summary: v.sentence.clone(),
                values: vec![value],
                absorbed_by: d.consequence.iter().flat_map(|c| c.absorbed_by.clone()).collect(),
                why,
                fix: Some(fix_text(&v.kind, &v.param)),
            },
            None => Finding {
                source: Source::Divergence,
                impact,
                level: if impact == Impact::Absorbed { Level::Warning } else { Level::Error },
                ops: vec![d.op.clone()],
                tensors: d.weights.iter().map(|(b, _)| b.clone()).collect(),
                parameter: None,
                kind: None,
                summary: format!(
                    "{}: {} — {}",
                    d.op,
                    d.reason.as_deref().unwrap_or("diverges"),
                    d.note.clone().unwrap_or_else(|| format!(
                        "no hypothesis explains it ({} tried)",
                        d.hypotheses_tried
                    ))
                ),
                values: vec![value],
                absorbed_by: d.consequence.iter().flat_map(|c| c.absorbed_by.clone()).collect(),
                why,
                fix: Some("check the op's activation-quantization health counters (bisect's JSON) and the checkpoint against a reference (`nvfp4-probe lint --reference DIR`)".into()),
            },
        };
        key_of.push((key, out.len()));
        out.push(f);
    }
    for f in &mut out {
        if f.ops.len() > 1 {
            f.summary = format!("{} ops, one root cause — {}", f.ops.len(), f.summary);
        }
    }
    // oracle anomalies: zero/non-finite outputs over the whole run, magnitude jumps as found
    let mut seen: BTreeSet<String> = BTreeSet::new();
    for a in findings::oracle_anomalies(records, false) {
        seen.extend(a.ops.iter().cloned());
        out.push(a);
    }
    for a in anomalies {
        if !seen.insert(a.op.clone()) {
            continue;
        }
        out.push(Finding {
            source: Source::Anomaly,
            impact: Impact::Harmful,
            level: Level::Error,
            ops: vec![a.op.clone()],
            tensors: a.weights.clone(),
            parameter: None,
            kind: Some(
                if a.oracle_non_finite {
                    "oracle-non-finite"
                } else {
                    "magnitude"
                }
                .into(),
            ),
            summary: a.sentence.clone(),
            values: Vec::new(),
            absorbed_by: Vec::new(),
            why: "served and oracle decode the same bytes, so nothing diverges".into(),
            fix: Some("`nvfp4-probe lint --reference DIR` names the cause".into()),
        });
    }
    let divergent: std::collections::HashSet<&str> = divs.iter().map(|d| d.op.as_str()).collect();
    out.extend(findings::lint_findings(lint, &divergent, false));
    findings::measure_fused_lint(&mut out, records, false);
    let steps: HashMap<&str, usize> = records.iter().map(|r| (r.id.as_str(), r.step)).collect();
    findings::sort(&mut out, |op| steps.get(op).copied().unwrap_or(usize::MAX));
    out
}

fn restores(c: &Compare, tol: f64, amax_ratio: f64) -> bool {
    c.new_non_finite == 0
        && c.rel_l2.is_some_and(|r| r.is_finite() && r <= tol)
        && c.amax_ratio
            .is_none_or(|q| q <= amax_ratio && q >= 1.0 / amax_ratio)
}

/// Hypotheses at `rec`. `cap` is the oracle's view of the op when the caller has it already (the
/// layer search does); otherwise it is captured by running the oracle up to the op. `records` are
/// the measured ops the propagated picture is read from.
///
/// `hint`: the verdict kind of a root cause already found at the same op of another layer; its
/// hypotheses are evaluated first, and when one restores the op the rest are not evaluated.
fn explain(
    ckpt: &Checkpoint,
    opts: &RunOptions,
    records: &[OpRecord],
    rec: &OpRecord,
    cap: Option<Capture>,
    cost: &mut Cost,
    hint: Option<&str>,
) -> Result<Divergence> {
    let th = &opts.spec.thresholds;
    let evals0 = cost.evals;
    let cap = match cap {
        Some(c) => c,
        None => {
            let t = Instant::now();
            let c = replay::capture(ckpt, opts, &rec.id)?;
            cost.capture_seconds += t.elapsed().as_secs_f64();
            // the oracle over every op before it, then the op
            cost.capture_execs += rec.step + 1;
            c
        }
    };
    let mut rp = Replayer::new(ckpt, opts, cap)?;
    let base = rp.eval(&[])?;
    cost.evals += 1;
    let nvfp4: Vec<String> = rec
        .weights
        .iter()
        .filter(|(_, s)| s.starts_with("nvfp4"))
        .map(|(b, _)| b.clone())
        .collect();
    // activations as the oracle feeds each weight (every quantized weight in oracle numerics)
    let clean_amax: HashMap<String, f32> = if nvfp4.is_empty() {
        HashMap::new()
    } else {
        let all: Vec<(String, Patch)> = nvfp4.iter().map(|b| (b.clone(), Patch::Oracle)).collect();
        cost.evals += 1;
        rp.eval(&all)?.act_amax
    };
    let mut hyps = Vec::new();
    for (unit, bases) in units(rp.ckpt(), &rec.id, &nvfp4) {
        hyps.extend(hypotheses(&mut rp, &unit, &bases, &clean_amax)?);
    }
    // gpt-oss's fused experts: gate/up row order, unread MXFP4 scales
    hyps.extend(experts::hypotheses(&rp, &rec.id, &rec.weights)?);
    // FP8-activation weights (block FP8, DeepSeek's MXFP4): activation scale, block scales
    hyps.extend(fp8::hypotheses(&rp, &rec.id, &rec.weights)?);
    // the experts' SwiGLU clamp (gpt-oss, V4)
    hyps.extend(experts::clamp_hypothesis(&rp, &rec.id, &rec.weights));
    // the engine's chunked prefill: the op prefilled whole (`--served-chunk`)
    hyps.extend(prefill::hypothesis(&rp));
    // the known root cause's kind first; stop there when it restores the op
    if let Some(k) = hint {
        hyps.sort_by_key(|h| h.kind != k);
    }
    let mut note = None;
    // one evaluation per distinct patch set
    let mut seen: BTreeSet<String> = BTreeSet::new();
    let mut ranked: Vec<Ranked> = Vec::new();
    for h in hyps {
        if let Some(k) = hint {
            if h.kind != k && ranked.iter().any(|r| r.restores) {
                note = Some(format!(
                    "explained by the verdict `{k}` found at the same op of another layer (tried first; the other hypotheses were not evaluated)"
                ));
                break;
            }
        }
        let whole = h.param.family == Family::ChunkState;
        let key = format!("{:?}", h.patches);
        if !whole && (h.patches.is_empty() || !seen.insert(key)) {
            continue;
        }
        let ev = match whole {
            true => rp.eval_prefilled_whole()?,
            false => rp.eval(&h.patches)?,
        };
        cost.evals += 1;
        let ok = restores(&ev.vs_bf16, rec.tolerance, th.amax_ratio);
        ranked.push(Ranked {
            hypothesis: h,
            after: ev.vs_bf16,
            restores: ok,
        });
    }
    let tried = ranked.len();
    let key = |r: &Ranked| {
        r.after
            .rel_l2
            .filter(|v| v.is_finite())
            .unwrap_or(f64::INFINITY)
    };
    ranked.sort_by(|a, b| {
        key(a)
            .total_cmp(&key(b))
            .then(a.hypothesis.prior.cmp(&b.hypothesis.prior))
    });
    // an activation scale whose corrected value implies an activation amax far (beyond ×8) from
    // the one the oracle feeds the weight may still restore the op (a coarse quantization can pass
    // the tolerance) but does not explain it: such candidates are passed over when another does
    let plausible = |r: &Ranked| -> bool {
        let p = &r.hypothesis.param;
        match (
            p.family,
            p.corrected,
            p.bases.first().and_then(|b| clean_amax.get(b)),
        ) {
            (Family::InputScale, Some(g), Some(&a)) if g > 0.0 && a > 0.0 => {
                let q = (2688.0 / g as f64) / a as f64;
                (0.125..=8.0).contains(&q)
            }
            _ => true,
        }
    };
    let restoring = |r: &&Ranked| r.restores;
    let any_plausible = ranked.iter().filter(restoring).any(plausible);
    let best = ranked
        .iter()
        .filter(restoring)
        .filter(|r| !any_plausible || plausible(r))
        .map(key)
        .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.min(v))));
    let verdict = best.and_then(|b| {
        // among those that restore about as well as the best, the most specific explanation
        let pick = ranked
            .iter()
            .filter(|r| r.restores && key(r) <= b * 1.25 + 1e-3)
            .filter(|r| !any_plausible || plausible(r))
            .min_by_key(|r| (r.hypothesis.prior, r.hypothesis.param.bases.len()))?;
        Some(Verdict {
            op: rec.id.clone(),
            sentence: sentence(&rec.id, &pick.hypothesis, &base.vs_bf16, &pick.after),
            param: pick.hypothesis.param.clone(),
            kind: pick.hypothesis.kind.clone(),
            unit: pick.hypothesis.unit.clone(),
            before: base.vs_bf16.clone(),
            after: pick.after.clone(),
        })
    });
    if let Some(v) = &verdict {
        // the verdict first, then the rest by metric
        if let Some(i) = ranked
            .iter()
            .position(|r| r.hypothesis.kind == v.kind && r.hypothesis.unit == v.unit)
        {
            let r = ranked.remove(i);
            ranked.insert(0, r);
        }
    }
    ranked.truncate(8);
    let mut per_linear: Vec<(String, QuantHealth)> = Vec::new();
    for (sub, _, o) in &base.obs {
        if let Some(h) = &o.health {
            per_linear.push((sub.clone(), *h));
        }
    }
    let after_op = records.iter().skip_while(|r| r.id != rec.id);
    let shows_at = after_op.clone().find(|r| r.shows).map(|r| r.id.clone());
    let shows_at_layer_out = after_op
        .filter(|r| r.id.ends_with(".out") && r.shows)
        .map(|r| r.id.clone())
        .next();
    Ok(Divergence {
        op: rec.id.clone(),
        step: Some(rec.step),
        consequence: rec.consequence.clone(),
        evals: cost.evals - evals0,
        note,
        reason: rec.reason.clone(),
        tolerance: rec.tolerance,
        weights: rec.weights.clone(),
        shows_at,
        shows_at_layer_out,
        before: base.vs_bf16,
        health: if verdict.is_none() { rec.health } else { None },
        health_per_linear: if verdict.is_none() {
            per_linear
        } else {
            Vec::new()
        },
        act_amax_over_calib: rec.act_amax_over_calib,
        verdict,
        ranked,
        hypotheses_tried: tried,
    })
}

/// The checkpoint's own name of a weight: its stored tensor without the `.weight` /
/// `.weight_packed` suffix (`model.layers.3.mlp.experts.0.gate_proj` for the canonical
/// `layers.3.ffn.experts.0.w1` in HF naming); the canonical base when it has no stored tensor.
pub(crate) fn own_name(ckpt: &crate::checkpoint::Checkpoint, base: &str) -> String {
    let Ok(m) = ckpt.weight_meta(base) else {
        return base.to_string();
    };
    let w = m.tensors.weight.split('[').next().unwrap_or("").trim();
    for suf in [".weight_packed", ".weight"] {
        if let Some(stem) = w.strip_suffix(suf) {
            return stem.to_string();
        }
    }
    if w.is_empty() {
        base.to_string()
    } else {
        w.to_string()
    }
}

/// The projection a weight is in the checkpoint's own names: the last component of
/// [`own_name`] (`gate_proj` in HF naming, `w1` in DeepSeek's).
fn own_role(ckpt: &crate::checkpoint::Checkpoint, base: &str) -> String {
    let n = own_name(ckpt, base);
    n.rsplit('.').next().unwrap_or(&n).to_string()
}

/// The distinct projections of these weights in the checkpoint's own names, in order.
fn own_roles(ckpt: &crate::checkpoint::Checkpoint, bases: &[&String]) -> Vec<String> {
    let mut roles: Vec<String> = Vec::new();
    for b in bases {
        let r = own_role(ckpt, b);
        if !roles.contains(&r) {
            roles.push(r);
        }
    }
    roles
}

/// Groups of weights a hypothesis is applied to together: each weight of a plain op; for routed
/// experts every expert at once (all projections, then each projection role), so one verdict can
/// say "all experts of L1". The NVFP4 scale hypotheses and the FP8 ones (`fp8.rs`) share them.
/// The labels name the weights as the checkpoint does (`gate_proj` in HF naming, `w1` in
/// DeepSeek's).
fn units(
    ckpt: &crate::checkpoint::Checkpoint,
    op: &str,
    nvfp4: &[String],
) -> Vec<(String, Vec<String>)> {
    let experts: Vec<&String> = nvfp4
        .iter()
        .filter(|b| b.contains(".ffn.experts."))
        .collect();
    let mut out = Vec::new();
    if experts.len() > 1 {
        let layer = op.split('.').next().unwrap_or(op);
        let by_role: Vec<Vec<&String>> = ["w1", "w3", "w2"]
            .iter()
            .map(|role| {
                experts
                    .iter()
                    .copied()
                    .filter(|b| b.ends_with(&format!(".{role}")))
                    .collect()
            })
            .collect();
        let firsts: Vec<&String> = by_role.iter().filter_map(|v| v.first().copied()).collect();
        out.push((
            format!(
                "all experts of {layer} ({})",
                own_roles(ckpt, &firsts).join(", ")
            ),
            experts.iter().map(|s| s.to_string()).collect(),
        ));
        for v in by_role.iter().filter(|v| !v.is_empty()) {
            out.push((
                format!(
                    "all experts of {layer} ({})",
                    own_roles(ckpt, &v[..1]).join(", ")
                ),
                v.iter().map(|s| s.to_string()).collect(),
            ));
        }
    }
    for b in nvfp4 {
        if experts.len() <= 1 || !b.contains(".ffn.experts.") {
            out.push((own_name(ckpt, b), vec![b.clone()]));
        }
    }
    // an op of several weights (the shared expert's w1, w3, w2): all of them at once, then the
    // fused pair, so a scale broken in every member (or in both members of the pair, which the
    // engine merges) is one hypothesis
    let plain: Vec<String> = nvfp4
        .iter()
        .filter(|b| !b.contains(".ffn.experts."))
        .cloned()
        .collect();
    if plain.len() > 1 {
        out.push((format!("all weights of {op}"), plain.clone()));
        let pair: Vec<String> = plain
            .iter()
            .filter(|b| b.ends_with(".w1") || b.ends_with(".w3"))
            .cloned()
            .collect();
        if pair.len() == 2 && plain.len() > 2 {
            let refs: Vec<&String> = pair.iter().collect();
            out.push((
                format!("{op} ({})", own_roles(ckpt, &refs).join(", ")),
                pair,
            ));
        }
    }
    out
}

/// One hypothesis that applies override `o` to every base of `bases`.
#[allow(clippy::too_many_arguments)]
pub(super) fn override_hypothesis(
    kind: &str,
    unit: String,
    what: &str,
    family: Family,
    bases: &[String],
    tensors: Vec<String>,
    engine: String,
    o: Override,
    prior: usize,
) -> Hypothesis {
    Hypothesis {
        kind: kind.into(),
        unit,
        what: what.into(),
        param: ParamRef {
            family,
            bases: bases.to_vec(),
            tensors,
            engine,
            current: None,
            corrected: None,
            stored: None,
            from_sibling: None,
        },
        patches: bases
            .iter()
            .map(|b| (b.clone(), Patch::Ov(o.clone())))
            .collect(),
        prior,
    }
}

/// The first other member of `base`'s fused group in the checkpoint (`served::fused`).
fn sibling(ckpt: &crate::checkpoint::Checkpoint, base: &str) -> Option<String> {
    let (_, members) = crate::served::fused::members_in(ckpt, base)?;
    members.into_iter().find(|m| m != base)
}

fn is_moe(base: &str) -> bool {
    base.contains(".ffn.experts.")
}

/// The engine's parameter name for a family on a weight (vLLM's names; MoE weights use the fused
/// `w13_`/`w2_` parameters).
fn engine_name(base: &str, conv: Convention, fam: Family) -> String {
    if is_moe(base) {
        let p = if base.ends_with(".w2") { "w2" } else { "w13" };
        let ct = conv == Convention::CompressedTensors;
        return match fam {
            Family::InputScale if ct => format!("{p}_input_global_scale"),
            Family::InputScale => format!("{p}_input_scale"),
            Family::WeightScale if ct => format!("{p}_weight_global_scale"),
            Family::WeightScale => format!("{p}_weight_scale_2"),
            Family::Alpha => {
                if p == "w2" {
                    "g2_alphas".into()
                } else {
                    "g1_alphas".into()
                }
            }
            Family::BlockScales => format!("{p}_weight_scale"),
            Family::NibbleOrder | Family::GateUpOrder => format!("{p}_weight"),
            Family::ChunkState | Family::ActScale | Family::SwigluClamp => String::new(),
        };
    }
    match fam {
        Family::InputScale => "input_global_scale_inv".into(),
        Family::WeightScale => "weight_global_scale".into(),
        Family::Alpha => "alpha".into(),
        Family::BlockScales => "weight_scale".into(),
        Family::NibbleOrder | Family::GateUpOrder => {
            if conv == Convention::CompressedTensors {
                "weight_packed".into()
            } else {
                "weight".into()
            }
        }
        Family::ChunkState | Family::ActScale | Family::SwigluClamp => String::new(),
    }
}

fn tensors_of(t: &WeightTensors, fam: Family) -> Vec<String> {
    let v: Vec<Option<&String>> = match fam {
        Family::InputScale => vec![t.input_scale.as_ref()],
        Family::WeightScale => vec![t.global_scale.as_ref()],
        Family::Alpha => vec![t.input_scale.as_ref(), t.global_scale.as_ref()],
        Family::BlockScales => vec![t.block_scale.as_ref()],
        Family::NibbleOrder | Family::GateUpOrder => vec![Some(&t.weight)],
        Family::ChunkState | Family::ActScale | Family::SwigluClamp => Vec::new(),
    };
    v.into_iter().flatten().cloned().collect()
}

/// What the hypotheses need of one NVFP4 weight: headers and scalar scales, nothing decoded.
struct WInfo {
    meta: WeightMeta,
    conv: Convention,
    p: Nvfp4Params,
    stored_w: f32,
    stored_i: Option<f32>,
    /// The engine's fused max over the pair changes this shard's weight / input scale.
    fused_w: bool,
    fused_i: bool,
}

fn winfo(rp: &mut Replayer, base: &str) -> Result<Option<WInfo>> {
    let meta = rp.meta(base)?;
    let Some(conv) = replay::nvfp4_convention(&meta) else {
        return Ok(None);
    };
    // as stored (a missing tensor scale reads as NaN, as the decoded weight carries it)
    let (sw, si) = (meta.weight_global.unwrap_or(f32::NAN), meta.input_global);
    let Some(p) = rp.params(base)? else {
        return Ok(None);
    };
    let resolve = |fuse: bool| {
        crate::served::resolve_nvfp4_named(rp.ckpt(), &meta.canonical, conv, sw, si, fuse, &[])
    };
    let (fused, own) = (resolve(true), resolve(false));
    let ne = |a: f32, b: f32| a.to_bits() != b.to_bits();
    Ok(Some(WInfo {
        fused_w: ne(fused.d_w, own.d_w),
        fused_i: ne(fused.g_x, own.g_x),
        meta,
        conv,
        p,
        stored_w: sw,
        stored_i: si,
    }))
}

fn differs(a: f32, b: f32) -> bool {
    a.is_finite() && b > 0.0 && b.is_finite() && ((a - b) / b).abs() > 1e-6
        || (!a.is_finite() && b.is_finite() && b > 0.0)
}

/// Every hypothesis for one unit of weights.
fn hypotheses(
    rp: &mut Replayer,
    unit: &str,
    bases: &[String],
    clean_amax: &HashMap<String, f32>,
) -> Result<Vec<Hypothesis>> {
    let mut infos: Vec<(String, WInfo)> = Vec::new();
    let mut sib: HashMap<String, Nvfp4Params> = HashMap::new();
    for b in bases {
        if let Some(w) = winfo(rp, b)? {
            if let Some(s) = sibling(rp.ckpt(), b) {
                if rp
                    .ckpt()
                    .weight_scheme(&s)
                    .is_some_and(|x| x.starts_with("nvfp4"))
                {
                    if let Some(sp) = rp.params(&s)? {
                        sib.insert(b.clone(), sp);
                    }
                }
            }
            infos.push((b.clone(), w));
        }
    }
    if infos.is_empty() {
        return Ok(Vec::new());
    }
    // (kind, prior, family, what, per-base (current, corrected) → patches)
    type Gen<'g> = Box<dyn Fn(&str, &WInfo) -> Option<(f32, f32, Vec<Patch>)> + 'g>;
    let input = |g: f32, w: &WInfo| -> Option<(f32, f32, Vec<Patch>)> {
        differs(w.p.g_x, g).then(|| {
            (
                w.p.g_x,
                g,
                vec![
                    Patch::Ov(Override::InputEncode(g)),
                    Patch::Ov(Override::Alpha(w.p.d_w / g)),
                ],
            )
        })
    };
    let weight = |d: f32, w: &WInfo| -> Option<(f32, f32, Vec<Patch>)> {
        differs(w.p.d_w, d).then(|| {
            (
                w.p.d_w,
                d,
                vec![
                    Patch::Ov(Override::WeightDecode(d)),
                    Patch::Ov(Override::Alpha(d / w.p.g_x)),
                ],
            )
        })
    };
    let own_input = |w: &WInfo| -> Option<f32> {
        let i = w.stored_i?;
        Some(match w.conv {
            Convention::CompressedTensors => i,
            Convention::ModelOpt => 1.0 / i,
        })
    };
    let own_weight = |w: &WInfo| -> f32 {
        match w.conv {
            Convention::CompressedTensors => 1.0 / w.stored_w,
            Convention::ModelOpt => w.stored_w,
        }
    };
    let layout = |o: Override| -> Gen {
        Box::new(move |_b, _w: &WInfo| Some((f32::NAN, f32::NAN, vec![Patch::Ov(o.clone())])))
    };
    let gens: Vec<(&str, usize, Family, &str, Gen)> = vec![
        ("input-reciprocal", 0, Family::InputScale,
         "the activation global scale is read in the wrong convention (its reciprocal is the encode multiplier)",
         Box::new(|_b, w| input(1.0 / w.p.g_x, w))),
        ("weight-reciprocal", 1, Family::WeightScale,
         "the weight global scale is read in the wrong convention (a divisor used as the decode multiplier)",
         Box::new(|_b, w| weight(1.0 / w.p.d_w, w))),
        ("alpha-recomputed", 2, Family::Alpha,
         "the GEMM alpha is not d_x·d_w of the scales in use",
         Box::new(|_b, w| {
             let a = w.p.d_w / w.p.g_x;
             differs(w.p.alpha, a).then(|| (w.p.alpha, a, vec![Patch::Ov(Override::Alpha(a))]))
         })),
        ("input-x2688", 3, Family::InputScale, "the activation global scale is off by 448·6 = 2688 (amax stored instead of scale)",
         Box::new(|_b, w| input(w.p.g_x * 2688.0, w))),
        ("input-div2688", 3, Family::InputScale, "the activation global scale is off by 448·6 = 2688 (scale stored instead of amax)",
         Box::new(|_b, w| input(w.p.g_x / 2688.0, w))),
        ("weight-x2688", 3, Family::WeightScale, "the weight global scale is off by 448·6 = 2688",
         Box::new(|_b, w| weight(w.p.d_w * 2688.0, w))),
        ("weight-div2688", 3, Family::WeightScale, "the weight global scale is off by 448·6 = 2688",
         Box::new(|_b, w| weight(w.p.d_w / 2688.0, w))),
        ("weight-own-shard", 0, Family::WeightScale,
         "the engine keeps one weight global scale for the fused group (the max over a merged linear, the gate's for a routed expert's w13) and the sibling's value does not fit this shard (its own stored value restores it)",
         Box::new(|_b, w| if w.fused_w { weight(own_weight(w), w) } else { None })),
        ("input-own-shard", 0, Family::InputScale,
         "the engine keeps one activation scale for the fused group (the max decode scale) and the sibling's value does not fit this shard (its own stored value restores it)",
         Box::new(|_b, w| if w.fused_i { own_input(w).and_then(|g| input(g, w)) } else { None })),
        ("weight-sibling-shard", 5, Family::WeightScale,
         "the weight global scale differs from the fused sibling shard's (the engine keeps one per merged layer)",
         Box::new(|b, w| sib.get(b).and_then(|s| weight(s.d_w, w)))),
        ("input-sibling-shard", 5, Family::InputScale,
         "the activation global scale differs from the fused sibling shard's",
         Box::new(|b, w| sib.get(b).and_then(|s| input(s.g_x, w)))),
        ("nibble-swap", 6, Family::NibbleOrder, "the e2m1 nibbles are read in the wrong order within each byte", layout(Override::NibbleSwap)),
        ("unshift-rows", 6, Family::BlockScales, "the block-scale rows are shifted by one", layout(Override::UnshiftRows)),
        ("unswizzle", 6, Family::BlockScales, "the block scales are stored swizzled (128×4) and read linear", layout(Override::Unswizzle)),
        ("stored-block-scales", 7, Family::BlockScales,
         "the block scales in use are not the checkpoint's: re-read linear from the stored tensor (non-finite bytes re-derived)",
         Box::new(|_b, _w| Some((f32::NAN, f32::NAN, vec![Patch::StoredBlockScales])))),
        ("input-calibrated", 8, Family::InputScale,
         "the activation global scale does not match the activations seen (calibrated value 2688/amax restores it)",
         Box::new(|b, w| {
             let a = *clean_amax.get(b)?;
             (a > 0.0).then(|| input(2688.0 / a, w)).flatten()
         })),
    ];
    let mut out = Vec::new();
    for (kind, prior, fam, what, g) in gens {
        let mut patches = Vec::new();
        let mut changed: Vec<String> = Vec::new();
        let mut first: Option<(f32, f32, &WInfo)> = None;
        for (b, w) in &infos {
            if let Some((cur, cor, ps)) = g(b, w) {
                if first.is_none() {
                    first = Some((cur, cor, w));
                }
                changed.push(b.clone());
                for p in ps {
                    patches.push((b.clone(), p));
                }
            }
        }
        let Some((cur, cor, w)) = first else { continue };
        let no_value = cur.is_nan() && cor.is_nan();
        let fin = |v: f32| Some(v).filter(|_| !no_value);
        let stored = match fam {
            Family::InputScale => w.stored_i,
            Family::WeightScale => Some(w.stored_w),
            _ => None,
        };
        let from_sibling = if kind.ends_with("own-shard") {
            let which = if fam == Family::InputScale {
                crate::served::fused::Which::Activation
            } else {
                crate::served::fused::Which::Weight
            };
            match crate::served::fused::kept_from(rp.ckpt(), &changed[0], w.conv, which) {
                Some(sb) => rp
                    .meta(&sb)
                    .ok()
                    .and_then(|m| tensors_of(&m.tensors, fam).into_iter().next()),
                None => None,
            }
        } else {
            None
        };
        out.push(Hypothesis {
            kind: kind.into(),
            unit: if changed.len() == bases.len() {
                unit.to_string()
            } else {
                unit_label(rp.ckpt(), unit, &changed)
            },
            what: what.into(),
            param: ParamRef {
                family: fam,
                tensors: tensors_of(&w.meta.tensors, fam),
                engine: engine_name(&changed[0], w.conv, fam),
                bases: changed,
                from_sibling,
                current: fin(cur),
                corrected: fin(cor),
                stored,
            },
            patches,
            prior,
        });
    }
    Ok(out)
}

/// "all experts of L1 (w3)" when the changed weights are one projection of every expert in the
/// unit (in the checkpoint's own names, as [`units`]).
fn unit_label(ckpt: &crate::checkpoint::Checkpoint, unit: &str, changed: &[String]) -> String {
    let refs: Vec<&String> = changed.iter().collect();
    let mut roles = own_roles(ckpt, &refs);
    roles.sort();
    if let Some((head, _)) = unit.split_once(" (") {
        if head.starts_with("all experts") && changed.iter().all(|b| is_moe(b)) {
            return format!("{head} ({}; {} weights)", roles.join(", "), changed.len());
        }
    }
    let own: Vec<String> = changed.iter().map(|b| own_name(ckpt, b)).collect();
    format!("{unit}: {}", short_list(&own))
}

fn short_list(v: &[String]) -> String {
    if v.len() <= 3 {
        v.join(", ")
    } else {
        format!("{}, … ({} weights)", v[..2].join(", "), v.len())
    }
}

fn fmt_v(v: Option<f32>) -> String {
    match v {
        Some(x) if x != 0.0 && (x.abs() >= 1e4 || x.abs() < 1e-2) => format!("{x:.4e}"),
        Some(x) => format!("{x:.5}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string(),
        None => "—".into(),
    }
}

fn fmt_cos(c: &Compare) -> String {
    c.cos.map_or("undefined".into(), |v| format!("{v:.4}"))
}

fn fmt_rel(c: &Compare) -> String {
    c.rel_l2.map_or("undefined".into(), |v| format!("{v:.3e}"))
}

/// One sentence naming the parameter, its values and the metric before and after.
fn sentence(op: &str, h: &Hypothesis, before: &Compare, after: &Compare) -> String {
    let p = &h.param;
    if p.family == Family::ChunkState {
        return format!(
            "{op}: {} — prefilled whole, the op's cosine vs the BF16 oracle goes from {} to {} (rel-L2 {} → {})",
            h.what,
            fmt_cos(before),
            fmt_cos(after),
            fmt_rel(before),
            fmt_rel(after)
        );
    }
    let tensor = p
        .tensors
        .first()
        .map(|t| format!("`{t}`"))
        .unwrap_or_else(|| match p.family {
            Family::ActScale => "(computed per token at run time)".into(),
            Family::SwigluClamp => "(config.json `swiglu_limit`)".into(),
            _ => "(computed at load)".into(),
        });
    let tensor = if p.family == Family::Alpha {
        format!(
            "(computed at load from {})",
            p.tensors
                .iter()
                .map(|t| format!("`{t}`"))
                .collect::<Vec<_>>()
                .join(" and ")
        )
    } else {
        tensor
    };
    let verb = match p.family {
        Family::InputScale => "encodes the activation with",
        Family::WeightScale => "decodes the weight with",
        Family::Alpha => "scales the GEMM output by",
        _ => "uses",
    };
    let values = match (p.current, p.corrected) {
        (Some(c), Some(k)) => format!(
            "{tensor}{}: the served path {verb} {} (engine `{}`); with {} ",
            p.stored
                .map(|v| format!(" = {}", fmt_v(Some(v))))
                .unwrap_or_default(),
            fmt_v(Some(c)),
            p.engine,
            fmt_v(Some(k))
        ),
        _ => format!("{tensor} (engine `{}`): with the repair ", p.engine),
    };
    let who = if p.bases.len() > 1 {
        format!(" [{}]", h.unit)
    } else {
        String::new()
    };
    format!(
        "{op}{who}: {} — {values}the op's cosine vs the BF16 oracle goes from {} to {} (rel-L2 {} → {})",
        h.what,
        fmt_cos(before),
        fmt_cos(after),
        fmt_rel(before),
        fmt_rel(after)
    )
}

/// Ops whose (oracle) output amax jumps by orders of magnitude against their input and against the
/// same op in the other layers, or whose oracle output is non-finite on finite input.
pub fn find_anomalies(records: &[OpRecord]) -> Vec<Anomaly> {
    let view: Vec<OracleOp> = records
        .iter()
        .filter_map(|r| {
            Some(OracleOp {
                id: r.id.clone(),
                layer: r.layer,
                weights: r.weights.clone(),
                stats: r.stats.get("oracle_bf16")?.clone(),
            })
        })
        .collect();
    find_anomalies_in(&view)
}

/// [`find_anomalies`] over the BF16 oracle's statistics alone (what a layer scan keeps).
pub fn find_anomalies_in(records: &[OracleOp]) -> Vec<Anomaly> {
    let by_id: HashMap<&str, &OracleOp> = records.iter().map(|r| (r.id.as_str(), r)).collect();
    let suffix = |id: &str| id.split_once('.').map(|(_, s)| s.to_string());
    let amax = |r: &OracleOp| Some(r.stats.amax);
    let nf = |r: &OracleOp| r.stats.non_finite();
    // gain of each quantized op: amax(out) / amax(its input)
    let mut gains: BTreeMap<String, Vec<(String, f64)>> = BTreeMap::new();
    let mut gain_of: HashMap<String, f64> = HashMap::new();
    for r in records {
        if r.weights.is_empty()
            || !r
                .weights
                .iter()
                .any(|(_, s)| s != "bf16" && s != "f16" && s != "f32")
        {
            continue;
        }
        let Some(inp) = input_of(r) else { continue };
        let Some(ri) = by_id.get(inp.as_str()) else {
            continue;
        };
        let (Some(a), Some(ai)) = (amax(r), amax(ri)) else {
            continue;
        };
        if ai > 0.0 && a.is_finite() && ai.is_finite() && a > 0.0 {
            let g = a / ai;
            gain_of.insert(r.id.clone(), g);
            if let Some(s) = suffix(&r.id) {
                gains.entry(s).or_default().push((r.id.clone(), g));
            }
        }
    }
    let mut out = Vec::new();
    for r in records {
        let wts: Vec<String> = r.weights.iter().map(|(b, _)| b.clone()).collect();
        if nf(r) {
            let inp_ok = input_of(r)
                .and_then(|i| by_id.get(i.as_str()).copied())
                .is_none_or(|ri| !nf(ri));
            if inp_ok && !wts.is_empty() {
                out.push(Anomaly {
                    op: r.id.clone(),
                    sentence: format!(
                        "{}: the BF16 oracle itself is non-finite on finite input — the checkpoint's bytes are at fault (served and oracle decode the same bytes)",
                        r.id
                    ),
                    gain: None,
                    gain_other_layers: None,
                    oracle_non_finite: true,
                    weights: wts,
                    suspects: Vec::new(),
                });
                break;
            }
            continue;
        }
        let (Some(&g), Some(s)) = (gain_of.get(&r.id), suffix(&r.id)) else {
            continue;
        };
        let others: Vec<f64> = gains[&s]
            .iter()
            .filter(|(id, _)| *id != r.id)
            .map(|(_, g)| *g)
            .collect();
        if others.is_empty() {
            continue;
        }
        let mut o = others.clone();
        o.sort_by(|a, b| a.total_cmp(b));
        let med = o[o.len() / 2];
        // orders of magnitude against the other layers, and a gain far from 1 against its own input
        let jump = (g / med).log10().abs();
        if jump >= 1.5 && g.log10().abs() >= 1.5 {
            out.push(Anomaly {
                op: r.id.clone(),
                sentence: format!(
                    "{}: output amax is {:.3e}× its input's, against {:.3e}× for the same op in the other layers — a scale the oracle shares is wrong (weight global scale inverted or applied twice?); served and oracle decode the same bytes, so nothing diverges",
                    r.id, g, med
                ),
                gain: Some(g),
                gain_other_layers: Some(med),
                oracle_non_finite: false,
                weights: wts,
                suspects: Vec::new(),
            });
            break;
        }
    }
    out
}

/// The stored scale tensors of `weights` that are broken on their face — NaN block scales, a
/// zero or non-finite tensor scale — each with what is wrong (as `lint` reports them; the
/// values a scale should have need `lint --reference`).
pub fn broken_scales(ckpt: &Checkpoint, weights: &[String]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for w in weights {
        let Ok(m) = ckpt.weight_meta(w) else { continue };
        if let (Some(t), Ok(Some(s))) = (&m.tensors.block_scale, ckpt.scale_summary(&m)) {
            if s.frac_nan > 0.0 {
                let n = ((s.frac_nan * s.count as f64).round() as usize).max(1);
                out.push((
                    t.clone(),
                    format!("{n} of its {} block scales are NaN", s.count),
                ));
            }
        }
        for (t, v, what) in [
            (
                &m.tensors.global_scale,
                m.weight_global,
                "weight tensor scale",
            ),
            (
                &m.tensors.input_scale,
                m.input_global,
                "activation tensor scale",
            ),
        ] {
            if let (Some(t), Some(v)) = (t, v) {
                if !v.is_finite() || v == 0.0 {
                    out.push((t.clone(), format!("{what} is {v}")));
                }
            }
        }
    }
    out
}

/// End each anomaly's sentence with what to check: the broken scale tensors of its weights by
/// name when their bytes show it ([`broken_scales`]), else its weights and `lint --reference`.
pub fn name_suspects(ckpt: &Checkpoint, anomalies: &mut [Anomaly]) {
    let dir = if ckpt.location() == std::path::Path::new(crate::checkpoint::BUILTIN) {
        "DIR".to_string()
    } else {
        ckpt.location().display().to_string()
    };
    for a in anomalies {
        let broken = broken_scales(ckpt, &a.weights);
        let hint = match broken.as_slice() {
            [] => {
                let first = a.weights.first().map(String::as_str).unwrap_or("?");
                let more = match a.weights.len() {
                    0 | 1 => String::new(),
                    n => format!(" and {} more", n - 1),
                };
                format!(
                    "; check the scales of `{first}`{more} against the original with `nvfp4-probe lint --model {dir} --reference ORIGINAL`"
                )
            }
            [(t, why), rest @ ..] => format!(
                "; `{t}`: {why}{} (`nvfp4-probe lint --model {dir}` lists every broken scale)",
                if rest.is_empty() {
                    String::new()
                } else {
                    format!(", and {} more broken scale tensors", rest.len())
                }
            ),
        };
        a.sentence.push_str(&hint);
        a.suspects = broken.into_iter().map(|(t, _)| t).collect();
    }
}

/// The main data input of an op id, by the graph's conventions.
fn input_of(r: &OracleOp) -> Option<String> {
    let (l, rest) = r.id.split_once('.')?;
    let inp = match rest {
        "attn.q_a" | "attn.kv" => "attn.norm",
        "attn.q_b" => "attn.q_norm",
        "attn.wo_a" => "attn.core",
        "attn.wo_b" => "attn.wo_a",
        "ffn.experts" | "ffn.shared" | "ffn.router" => "ffn.norm",
        "attn.compressor" | "attn.indexer" => "attn.norm",
        _ => return None,
    };
    Some(format!("{l}.{inp}"))
}
