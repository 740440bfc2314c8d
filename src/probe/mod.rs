//! The runner: executes the op graph on the three numerics paths in lockstep, op by op, and
//! measures each op's output — propagated (each path fed its own inputs) and isolated (the served
//! numerics fed the BF16 oracle's inputs) — against the oracles.

pub mod budget;
pub mod consequence;
pub mod env;

mod chunked;
pub mod experts;
pub mod findings;
pub mod prefill;
pub mod progress;
pub mod replay;
mod runner;
pub mod scan;

pub mod spec;
pub mod tolerance;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use serde::Serialize;

use crate::backend::PendingStats;
use crate::checkpoint::Checkpoint;
use crate::metrics::head::HeadCompare;
use crate::metrics::{Compare, Stats};
use crate::model::graph::Op;
use crate::numerics::nvfp4::QuantHealth;
use crate::served::faults::Fault;
use crate::served::{Override, Profile};
use crate::{Result, Tensor};
use env::Shared;
use spec::ProbeSpec;

/// What to run.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Inclusive layer range to report; layers before it run too (their outputs feed it) but are not reported.
    pub layers: (usize, usize),
    pub tokens: Vec<u32>,
    pub profile: Profile,
    pub loader_faults: Vec<Fault>,
    pub spec: ProbeSpec,
    /// Keep each reported op's outputs for `--dump`.
    pub keep_outputs: bool,
    /// `--dump-rows`: of the kept outputs, only these token rows (ascending; see
    /// `runner::kept_rows`).
    pub keep_rows: Option<Vec<usize>>,
    /// Show a progress bar on stderr (hidden when stderr is not a terminal).
    pub progress: bool,
    /// Bisect's hypothesis: (weight base, override), applied to the served path.
    pub overrides: Vec<(String, Override)>,
    /// Stop after this op id (bisect re-runs).
    pub stop_after: Option<String>,
    /// Where the numerics run (CPU reference or the CUDA device).
    pub backend: crate::backend::Backend,
    /// `--max-mem` (GiB): the memory budget the run's estimate is held to instead of what the
    /// machine reports (`budget`).
    pub max_mem: Option<f64>,
    /// `--chunk`: tokens per chunk when each layer runs over the prompt a chunk at a time
    /// (`chunked`); None: chosen from `mem_gib` or the memory limit (`budget::token_chunk`).
    pub chunk: Option<usize>,
    /// `--mem-gib`: the memory budget (device memory on CUDA) the token chunk is chosen for.
    pub mem_gib: Option<f64>,
    /// `--served-chunk` / `--engine-fault`: the served path prefills as an engine does
    /// (`prefill`).
    pub prefill: Option<crate::served::engine::Prefill>,
    /// Which routed experts are measured one by one (`--exercise-experts`, `--no-expert-metrics`).
    pub experts: experts::ExpertMetrics,
}

impl RunOptions {
    /// Layers `layers` over `tokens` under the served W4A4 profile on the CPU: no loader faults,
    /// no hypotheses, the built-in probe spec, no kept outputs, no progress bar. Callers change
    /// what they need with struct update syntax.
    pub fn new(layers: (usize, usize), tokens: Vec<u32>) -> RunOptions {
        RunOptions {
            layers,
            tokens,
            profile: Profile::BlackwellW4a4,
            loader_faults: Vec::new(),
            spec: ProbeSpec::builtin(),
            keep_outputs: false,
            keep_rows: None,
            progress: false,
            overrides: Vec::new(),
            stop_after: None,
            backend: crate::backend::Backend::Cpu,
            max_mem: None,
            chunk: None,
            mem_gib: None,
            prefill: None,
            experts: experts::ExpertMetrics::Routed,
        }
    }

    /// The paths' shared state for this run: backend, loader faults and hypotheses applied.
    pub fn shared<'a>(&self, ckpt: &'a Checkpoint, cfg: crate::model::ModelConfig) -> Shared<'a> {
        let mut shared = Shared::new(ckpt, cfg, self.tokens.clone(), self.profile);
        shared.faults = self.loader_faults.clone();
        shared.overrides = self.overrides.clone();
        shared.prefill = self.prefill.clone();
        shared.set_backend(self.backend.clone());
        shared
    }
}

/// Index-valued outputs (router expert ids, indexer selections): agreement instead of cosine.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Agreement {
    pub served_isolated: f64,
    pub served_propagated: f64,
    pub oracle_bf16: f64,
}

/// One op's measurements. Field names are the run JSON's (docs/json-schema.md).
#[derive(Clone, Debug, Serialize)]
pub struct OpRecord {
    pub step: usize,
    pub id: String,
    pub class: String,
    pub layer: Option<usize>,
    pub shape: Vec<usize>,
    /// Weight bases this op read, with their formats.
    pub weights: Vec<(String, String)>,
    /// Statistics of each path's (propagated) output: oracle_fp32, oracle_bf16, served, served_isolated.
    pub stats: BTreeMap<String, Stats>,
    /// BF16 oracle vs FP32 oracle, each on its own inputs (propagated spread).
    pub bf16_vs_fp32: Compare,
    /// BF16 numerics vs FP32 numerics of this op alone, fed the same inputs: the op's noise floor.
    pub bf16_vs_fp32_isolated: Compare,
    pub served_isolated_vs_bf16: Compare,
    pub served_isolated_vs_fp32: Compare,
    pub served_propagated_vs_bf16: Compare,
    pub served_propagated_vs_fp32: Compare,
    pub agreement: Option<Agreement>,
    /// NVFP4 activation-quantization health of the served (propagated) op.
    pub health: Option<QuantHealth>,
    pub act_amax_over_calib: Option<f64>,
    /// rel-L2 the isolated error is held to.
    pub tolerance: f64,
    /// Which term set the tolerance: the table row (`Linear × nvfp4 × blackwell-w4a4`), the op's
    /// BF16 noise, or the floor.
    pub tolerance_basis: String,
    /// The op's own numerics diverge (isolated).
    pub divergent: bool,
    pub reason: Option<String>,
    /// The accumulated error is visible here (propagated).
    pub shows: bool,
    /// For a divergent op: whether its error reaches a later op (harmful) or is absorbed.
    pub consequence: Option<consequence::Consequence>,
    /// A routed-experts op: each expert a token reached (or `--exercise-experts` gave rows),
    /// served vs the BF16 oracle on its own rows, with its tolerance and verdict.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experts: Option<Vec<experts::ExpertRecord>>,
    /// … and the experts no token reached.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experts_unreached: Option<Vec<usize>>,
    /// The model's output (the head op only): next-token KL and top-1/top-5 agreement.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub head: Option<HeadMetrics>,
}

/// The head's logits on each path compared per position as next-token distributions: served
/// vs each oracle and the BF16 oracle vs the FP32 one (the oracle's own noise at the output).
/// Field names are the run JSON's (`head_served_vs_bf16.kl`, …; `head_positions` per position).
#[derive(Clone, Debug, Default, Serialize)]
pub struct HeadMetrics {
    pub head_served_vs_bf16: HeadCompare,
    pub head_served_vs_fp32: HeadCompare,
    pub head_bf16_vs_fp32: HeadCompare,
    /// Per position: served vs the BF16 oracle.
    pub head_positions: Vec<crate::metrics::head::HeadPosition>,
}

impl HeadMetrics {
    /// Adds a token chunk's logits (FP32 oracle, BF16 oracle, served; [rows, vocab] each).
    pub fn add(&mut self, fp: &Tensor, bf: &Tensor, sv: &Tensor) {
        let vocab = sv.shape.last().copied().unwrap_or(0);
        let (fp, bf, sv) = (&fp.data[..], &bf.data[..], &sv.data[..]);
        self.head_served_vs_bf16.append(sv, bf, vocab);
        self.head_served_vs_fp32.append(sv, fp, vocab);
        self.head_bf16_vs_fp32.append(bf, fp, vocab);
        let n0 = self.head_positions.len();
        self.head_positions
            .extend_from_slice(&self.head_served_vs_bf16.positions[n0..]);
    }

    /// Whether the served path's next-token choices are as close to the BF16 oracle's as the
    /// oracle's own numerics allow ([`consequence`]'s test "no effect at the model's output"):
    /// top-1 agreement no lower than the BF16 oracle's with the FP32 oracle, and mean KL within
    /// max(HEAD_KL_NOISE × the oracle's own, HEAD_KL_MIN).
    pub fn output_within_noise(&self) -> bool {
        let (s, n) = (&self.head_served_vs_bf16, &self.head_bf16_vs_fp32);
        let kl_bound = (HEAD_KL_NOISE * n.kl.unwrap_or(0.0)).max(HEAD_KL_MIN);
        s.non_finite == 0 && s.top1 >= n.top1 && s.kl.is_some_and(|k| k <= kl_bound)
    }
}

/// Mean next-token KL (nats) the served path may add at the output over the oracle's own spread.
pub const HEAD_KL_NOISE: f64 = 4.0;
/// … and at least this much.
pub const HEAD_KL_MIN: f64 = 1e-4;

/// Whether an op's output is the model's output (next-token logits).
pub(crate) fn is_head(op: &Op) -> bool {
    op.class == crate::model::graph::OpClass::Head
}

#[derive(Clone, Debug, Serialize, Default)]
pub struct Summary {
    pub ops: usize,
    pub first_divergent: Option<String>,
    pub first_divergent_reason: Option<String>,
    pub first_shows: Option<String>,
    pub first_non_finite: Option<(String, String)>,
    pub divergent_ops: usize,
    pub non_finite_ops: usize,
    /// Divergent ops whose error reaches a later op (or the output), and ops whose error no later
    /// op sees (`consequence` of each op).
    pub harmful_ops: usize,
    pub absorbed_ops: usize,
    /// First divergent op whose error is harmful.
    pub first_harmful: Option<String>,
    /// `run`: every finding (divergences, lint errors of the layers read, oracle anomalies),
    /// ordered by consequence, with the level that decides the exit code.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub findings: Option<Vec<findings::Finding>>,
}

impl Summary {
    /// Counts and firsts over a run's records, in execution order.
    pub fn of(records: &[OpRecord]) -> Summary {
        let mut summary = Summary {
            ops: records.len(),
            ..Default::default()
        };
        for r in records {
            if r.divergent {
                match r.consequence.as_ref().map(|c| c.severity) {
                    Some(consequence::Severity::Absorbed) => summary.absorbed_ops += 1,
                    _ => {
                        summary.harmful_ops += 1;
                        if summary.first_harmful.is_none() {
                            summary.first_harmful = Some(r.id.clone());
                        }
                    }
                }
                summary.divergent_ops += 1;
                if summary.first_divergent.is_none() {
                    summary.first_divergent = Some(r.id.clone());
                    summary.first_divergent_reason = r.reason.clone();
                }
            }
            if r.shows && summary.first_shows.is_none() {
                summary.first_shows = Some(r.id.clone());
            }
            let nf: Vec<&str> = ["oracle_fp32", "oracle_bf16", "served"]
                .into_iter()
                .filter(|p| r.stats[*p].non_finite())
                .collect();
            if !nf.is_empty() {
                summary.non_finite_ops += 1;
                if summary.first_non_finite.is_none() {
                    summary.first_non_finite = Some((nf.join(","), r.id.clone()));
                }
            }
        }
        summary
    }
}

pub struct RunResult {
    pub records: Vec<OpRecord>,
    pub summary: Summary,
    /// Kept outputs per path name ("oracle_fp32", "oracle_bf16", "served", "served_isolated"): (op id, tensor).
    pub outputs: BTreeMap<String, Vec<(String, Tensor)>>,
    pub seconds: f64,
    /// Bytes of tensor data read from the checkpoint during the run.
    pub bytes_read: u64,
    /// The token rows the kept outputs hold (`RunOptions::keep_rows`); None: all.
    pub kept_rows: Option<Vec<usize>>,
}

fn is_index_output(op: &Op) -> bool {
    op.id.ends_with(".attn.indexer")
}

/// An index selection's agreement with another's: the fraction of its entries equal to the
/// other's at the same position, from (equal entries, entries) — the `equal` count of the pair's
/// comparison, summed over a run's token chunks like its other sums (1 when there are none).
fn agreement_of((eq, n): (usize, usize)) -> f64 {
    if n == 0 {
        return 1.0;
    }
    eq as f64 / n as f64
}

/// Run the probe.
pub fn run(ckpt: &Checkpoint, opts: &RunOptions) -> Result<RunResult> {
    run_capturing(ckpt, opts, false).map(|(r, _)| r)
}

/// Divergent ops whose oracle view [`run_capturing`] keeps for bisect (in run order); the
/// hypotheses of later ones start from a capture pass of their own.
pub const MAX_CAPTURES: usize = 64;

/// Run the probe; with `capture`, also keep the BF16 oracle's view (inputs and outputs) of every
/// divergent op (the first [`MAX_CAPTURES`]), which is what `bisect`'s hypothesis replay starts
/// from (the same tensors [`replay::capture`] would compute by running the oracle up to the op
/// again).
pub fn run_capturing(
    ckpt: &Checkpoint,
    opts: &RunOptions,
    capture: bool,
) -> Result<(RunResult, Vec<replay::Capture>)> {
    let t0 = Instant::now();
    let bytes0 = ckpt.bytes_read();
    let plan = runner::plan(ckpt, opts)?;
    let (ops, cfg) = (&plan.ops, &plan.cfg);
    let mut pb = progress::Progress::new(ops, opts.tokens.len(), opts.progress);
    let mut st = runner::Stepper::new(ckpt, opts, &plan, capture);
    let run_plan = crate::backend::run::RunPlan {
        ckpt,
        cfg,
        ops,
        tokens: &opts.tokens,
    };
    // the backend's hooks follow the run: with CUDA a loader thread stages the coming ops'
    // weights on the device and a prefetcher reads them into the page cache, overlapping the
    // kernels (`backend::run`)
    opts.backend.run_with(&run_plan, |hooks| {
        crate::profile::mark("runner: first op");
        if let Some(c) = plan.chunk.filter(|&c| c < opts.tokens.len()) {
            return chunked::run(&mut st, ops, c, plan.streams_on_device, hooks, &mut pb);
        }
        for (step, op) in ops.iter().enumerate() {
            hooks.before_op(step);
            let t_op = Instant::now();
            crate::profile::set_step(step);
            pb.start(op);
            // a device allocation that fails says so, not "backend unavailable"
            st.step(step, op, hooks)
                .map_err(|e| crate::backend::oom::explain(e, &op.id, &opts.backend))?;
            pb.done();
            crate::profile::interval("op", step, t_op);
            *st.prof.entry(format!("{:?}", op.kind)).or_default() += t_op.elapsed().as_secs_f64();
            if opts.stop_after.as_deref() == Some(op.id.as_str()) {
                break;
            }
        }
        crate::profile::mark("runner: last op done");
        if let Some(q) = st.queued.take() {
            let id = q.record.op.id.clone();
            st.finish(q)
                .map_err(|e| crate::backend::oom::explain(e, &id, &opts.backend))?;
        }
        Ok(())
    })?;
    pb.finish();
    if crate::profile::enabled() {
        print_profile(std::mem::take(&mut st.prof));
    }
    crate::profile::write_timeline();
    let measured = st.tracker.into_parts();
    let mut records = st.records;
    let unfollowed = match plan.chunk.filter(|&c| c < opts.tokens.len()) {
        Some(_) => consequence::Unfollowed::Chunked,
        None => consequence::Unfollowed::BeyondLimit,
    };
    consequence::classify(&mut records, measured, &opts.spec.thresholds, unfollowed);
    let summary = Summary::of(&records);
    Ok((
        RunResult {
            records,
            summary,
            outputs: st.outputs,
            seconds: t0.elapsed().as_secs_f64(),
            bytes_read: ckpt.bytes_read() - bytes0,
            kept_rows: opts.keep_rows.clone(),
        },
        st.captured,
    ))
}

/// `NVFP4_PROBE_PROFILE=1`: seconds per op kind (all execs of the op) and in metrics, and the
/// host spans, on stderr (the device's own profile: `backend::run`).
fn print_profile(prof: BTreeMap<String, f64>) {
    let mut v: Vec<_> = prof.into_iter().collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    let line: Vec<String> = v.iter().map(|(k, s)| format!("{k} {s:.3}")).collect();
    eprintln!(
        "profile (s, ops include their metrics): {}",
        line.join(", ")
    );
    eprintln!("profile host spans (s, count): {}", crate::profile::spans());
}

/// The record of one reported op from its executions: the three propagated paths' outputs
/// (`outs`: FP32 oracle, BF16 oracle, served), the served op on the BF16 oracle's inputs (`iso`)
/// and the FP32 numerics on them (`fp_on_bf`); `touched`/`observed` are what its served linears
/// read and saw. The runner and bisect's one-layer measurement share it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn op_record(
    ckpt: &Checkpoint,
    opts: &RunOptions,
    step: usize,
    op: &Op,
    outs: &[Vec<Tensor>],
    iso: &[Tensor],
    fp_on_bf: &[Tensor],
    touched: &[String],
    observed: &[(String, crate::served::LinearObs)],
) -> Result<OpRecord> {
    let p = op_record_begin(opts, step, op, outs, iso, fp_on_bf, touched, observed)?;
    op_record_finish(ckpt, opts, p)
}

/// The last reported op while its metrics compute: its record, its oracle view (for bisect) and
/// its isolated (faulty, should it diverge) outputs.
struct Queued {
    record: PendingRecord,
    capture: Option<replay::Capture>,
    iso: Vec<Tensor>,
}

/// An op's record whose metrics may still be computing on the device.
pub(crate) struct PendingRecord {
    step: usize,
    op: Op,
    shape: Vec<usize>,
    touched: Vec<String>,
    observed: Vec<(String, crate::served::LinearObs)>,
    /// An index-valued output: its agreements come from the comparisons' equal counts.
    index_output: bool,
    metrics: PendingStats,
    /// The head's next-token comparisons (the head op only).
    head: Option<HeadMetrics>,
    /// A routed-experts op's experts one by one.
    per_expert: Option<experts::PerExpert>,
}

/// The first half of [`op_record`]: what needs the outputs' values on the host now, and the
/// metrics launched (on the device they only queue: [`op_record_finish`] waits for them, so the
/// runner can queue the next op's work first).
#[allow(clippy::too_many_arguments)]
pub(crate) fn op_record_begin(
    opts: &RunOptions,
    step: usize,
    op: &Op,
    outs: &[Vec<Tensor>],
    iso: &[Tensor],
    fp_on_bf: &[Tensor],
    touched: &[String],
    observed: &[(String, crate::served::LinearObs)],
) -> Result<PendingRecord> {
    let (fp, bf, sv, is) = (&outs[0][0], &outs[1][0], &outs[2][0], &iso[0]);
    let metrics = {
        let _s = crate::profile::span("metrics: launch");
        measure_launch(&opts.backend, fp, bf, sv, is, &fp_on_bf[0])?
    };
    let head = is_head(op).then(|| {
        let _s = crate::profile::span("metrics: head");
        let mut h = HeadMetrics::default();
        h.add(fp, bf, sv);
        h
    });
    Ok(PendingRecord {
        step,
        op: op.clone(),
        shape: sv.shape.clone(),
        touched: touched.to_vec(),
        observed: observed.to_vec(),
        index_output: is_index_output(op),
        metrics,
        head,
        per_expert: None,
    })
}

/// The second half of [`op_record`]: the metrics' values, tolerances and verdicts.
pub(crate) fn op_record_finish(
    ckpt: &Checkpoint,
    opts: &RunOptions,
    p: PendingRecord,
) -> Result<OpRecord> {
    let th = &opts.spec.thresholds;
    let PendingRecord {
        step,
        op,
        shape,
        touched,
        observed,
        index_output,
        metrics,
        head,
        per_expert,
    } = p;
    let (op, touched, observed) = (&op, &touched[..], &observed[..]);
    let ms = {
        let _s = crate::profile::span("metrics: measure");
        measure_finish(&opts.backend, metrics)?
    };
    // an index selection's agreements: the fused passes count the equal entries (the device's
    // values are not read by the host)
    let agreement = index_output.then(|| Agreement {
        served_isolated: agreement_of((ms.iso_bf.equal, ms.is.numel)),
        served_propagated: agreement_of((ms.prop_bf.equal, ms.sv.numel)),
        oracle_bf16: agreement_of((ms.noise.equal, ms.bf.numel)),
    });
    let mut stats = BTreeMap::new();
    stats.insert("oracle_fp32".to_string(), ms.fp);
    stats.insert("oracle_bf16".to_string(), ms.bf);
    stats.insert("served".to_string(), ms.sv);
    stats.insert("served_isolated".to_string(), ms.is);
    // in the op's own weight order (the graph's): a run in token chunks touches an expert
    // first in whichever chunk routes to it, a run over the whole prompt in expert order
    let mut touched = touched.to_vec();
    touched.sort_by_key(|t| op.weights.iter().position(|w| w == t).unwrap_or(usize::MAX));
    let weights: Vec<(String, String)> = touched
        .iter()
        .map(|t| (t.clone(), ckpt.weight_scheme(t).unwrap_or("?").to_string()))
        .collect();
    let class = format!("{:?}", op.class);
    let (noise, noise_iso, iso_bf, prop_bf) = (ms.noise, ms.noise_iso, ms.iso_bf, ms.prop_bf);
    let (health, act_ratio) = env::aggregate_health(observed);
    // an attention under --served-chunk reads earlier chunks' keys from the FP8 KV cache
    let cached: &[&str] = match (&opts.prefill, op.kind) {
        (Some(p), crate::model::graph::OpKind::Attention) if p.chunk < opts.tokens.len() => {
            &[tolerance::KV_CACHE_KEY]
        }
        _ => &[],
    };
    let (tol, tolerance_basis) = tolerance::op_tolerance(
        th,
        opts.profile,
        &class,
        &weights,
        cached,
        noise_iso.rel_l2.unwrap_or(0.0),
    );
    let bf_nf = stats["oracle_bf16"].non_finite();
    let (divergent, reason) = if stats["served_isolated"].non_finite() && !bf_nf {
        (
            true,
            Some("non-finite values where the BF16 oracle has none".to_string()),
        )
    } else if agreement.is_some() {
        (false, None)
    } else if let Some(r) = iso_bf.rel_l2.filter(|r| *r > tol) {
        (
            true,
            Some(format!("isolated rel-L2 {r:.3e} > tolerance {tol:.3e}")),
        )
    } else if let Some(q) = iso_bf
        .amax_ratio
        .filter(|q| *q > th.amax_ratio || *q < 1.0 / th.amax_ratio)
    {
        (
            true,
            Some(format!(
                "isolated amax ratio {q:.3e} outside [1/{0}, {0}]",
                th.amax_ratio
            )),
        )
    } else if iso_bf.rel_l2.is_none() && !bf_nf && stats["served_isolated"].non_finite() {
        (true, Some("undefined error".into()))
    } else {
        (false, None)
    };
    let shows = agreement.is_none()
        && ((stats["served"].non_finite() && !bf_nf)
            || prop_bf.rel_l2.is_none_or(|r| r > th.propagated_rel_l2));
    Ok(OpRecord {
        step,
        id: op.id.clone(),
        class,
        layer: op.layer,
        shape,
        weights,
        stats,
        bf16_vs_fp32: noise,
        bf16_vs_fp32_isolated: noise_iso,
        served_isolated_vs_fp32: ms.iso_fp,
        served_isolated_vs_bf16: iso_bf,
        served_propagated_vs_fp32: ms.prop_fp,
        served_propagated_vs_bf16: prop_bf,
        agreement,
        health,
        act_amax_over_calib: act_ratio,
        tolerance: tol,
        tolerance_basis,
        consequence: None,
        divergent,
        reason,
        shows,
        experts_unreached: per_expert
            .as_ref()
            .map(|p| p.unreached(opts_experts_of(ckpt))),
        experts: per_expert.map(|p| p.records(tol)),
        head,
    })
}

/// Routed experts per layer of the run's model (0 when its config cannot be read).
fn opts_experts_of(ckpt: &Checkpoint) -> usize {
    ckpt.model_config().map_or(0, |c| c.n_routed_experts)
}

/// One op's statistics and comparisons (the four paths' outputs and the noise-floor exec).
struct Measured {
    fp: Stats,
    bf: Stats,
    sv: Stats,
    is: Stats,
    noise: Compare,
    noise_iso: Compare,
    iso_bf: Compare,
    prop_bf: Compare,
    iso_fp: Compare,
    prop_fp: Compare,
}

/// (x, reference) pairs of an op's metrics over [fp, bf, sv, is, fp_on_bf]: statistics of x
/// and, with a reference, the comparison.
const PAIRS: [(usize, Option<usize>); 7] = [
    (0, None),
    (1, Some(0)),
    (2, Some(1)),
    (3, Some(1)),
    (1, Some(4)),
    (3, Some(0)),
    (2, Some(0)),
];

/// The metrics of one op, queued on the run's backend (one fused pass per pair on a device).
fn measure_launch(
    backend: &crate::backend::Backend,
    fp: &Tensor,
    bf: &Tensor,
    sv: &Tensor,
    is: &Tensor,
    fp_on_bf: &Tensor,
) -> Result<PendingStats> {
    backend.stats_launch(
        &[&fp.data, &bf.data, &sv.data, &is.data, &fp_on_bf.data],
        &PAIRS,
    )
}

fn measure_finish(backend: &crate::backend::Backend, m: PendingStats) -> Result<Measured> {
    let r = backend.stats_collect(m)?;
    let c = |i: usize| r[i].1.clone().unwrap_or_default();
    Ok(Measured {
        fp: r[0].0.clone(),
        bf: r[1].0.clone(),
        sv: r[2].0.clone(),
        is: r[3].0.clone(),
        noise: c(1),
        prop_bf: c(2),
        iso_bf: c(3),
        noise_iso: c(4),
        iso_fp: c(5),
        prop_fp: c(6),
    })
}

/// Deterministic synthetic token ids (splitmix64 over the vocabulary), the default token source.
/// A vocabulary of 0 (refused by the config's limits) yields id 0 rather than dividing by zero.
pub fn synthetic_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let vocab = vocab.max(1);
    let mut s = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z % vocab as u64) as u32
        })
        .collect()
}

/// Where a run's tokens came from, for reports.
#[derive(Clone, Debug, Serialize)]
pub struct TokenSource {
    pub kind: String,
    pub detail: Option<PathBuf>,
}
