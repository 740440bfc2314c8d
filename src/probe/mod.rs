//! The runner: executes the op graph on the three numerics paths in lockstep, op by op, and
//! measures each op's output — propagated (each path fed its own inputs) and isolated (the served
//! numerics fed the BF16 oracle's inputs) — against the oracles.

pub mod budget;
pub mod consequence;
pub mod env;

pub mod findings;
pub mod replay;
mod runner;
pub mod scan;

pub mod spec;
pub mod tolerance;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::Instant;

use serde::Serialize;

use crate::checkpoint::Checkpoint;
use crate::metrics::{Compare, Stats};
use crate::model::graph::{build_graph, Op, OpKind};
use crate::numerics::nvfp4::QuantHealth;
use crate::served::faults::Fault;
use crate::served::{Override, Profile};
use crate::{Error, Result, Tensor};
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
    /// `--chunk`: query tokens per attention call (None: from `mem_gib`, else all at once).
    pub chunk: Option<usize>,
    /// `--mem-gib`: the memory one attention chunk may hold; chooses the chunk (`budget::chunk_rows`).
    pub mem_gib: Option<f64>,
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
            progress: false,
            overrides: Vec::new(),
            stop_after: None,
            backend: crate::backend::Backend::Cpu,
            max_mem: None,
            chunk: None,
            mem_gib: None,
        }
    }

    /// The paths' shared state for this run: backend, loader faults and hypotheses applied.
    pub fn shared<'a>(&self, ckpt: &'a Checkpoint, cfg: crate::model::ModelConfig) -> Shared<'a> {
        let mut shared = Shared::new(ckpt, cfg, self.tokens.clone(), self.profile);
        shared.faults = self.loader_faults.clone();
        shared.overrides = self.overrides.clone();
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
}

fn is_index_output(op: &Op) -> bool {
    op.id.ends_with(".attn.indexer")
}

fn agreement(a: &[f32], b: &[f32]) -> f64 {
    if a.is_empty() {
        return 1.0;
    }
    a.iter().zip(b).filter(|(x, y)| x == y).count() as f64 / a.len() as f64
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
    let pb = if opts.progress {
        let pb = indicatif::ProgressBar::new(ops.len() as u64);
        pb.set_style(
            indicatif::ProgressStyle::with_template("{spinner} {pos}/{len} ops {wide_bar} {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        pb
    } else {
        indicatif::ProgressBar::hidden()
    };
    // With the CUDA backend a thread asks the kernel to read ahead the weights of the coming ops
    // while the device computes (cold runs are disk-bound; this overlaps the two), and a loader
    // thread stages them on the device (its own pinned buffers and copy stream), so the host's
    // reads and the copies overlap the kernels (`backend::stage`).
    let at_step = std::sync::atomic::AtomicUsize::new(0);
    let done = std::sync::atomic::AtomicBool::new(false);
    let t_len = opts.tokens.len();
    let routed: std::sync::Mutex<HashMap<usize, Vec<bool>>> = Default::default();
    let loader = runner::start_loader(ckpt, opts, &plan)?;
    let mut st = runner::Stepper::new(ckpt, opts, &plan, capture, &routed);
    let scoped = std::thread::scope(|sc| -> Result<()> {
        if let Some(stager) = &loader.stager {
            let (routed, at_step, done) = (&routed, &at_step, &done);
            let stage_plan = &loader.plan;
            sc.spawn(move || {
                // hash-routed layers: their experts are known from the token ids alone
                for (target, used) in hash_routing(ckpt, cfg, ops, &opts.tokens) {
                    if let Ok(mut m) = routed.lock() {
                        m.entry(target).or_insert(used);
                    }
                }
                crate::backend::stage::run_loader(stager, ckpt, stage_plan, routed, at_step, done)
            });
        }
        if st.reads_ahead {
            let (routed, at_step, done) = (&routed, &at_step, &done);
            sc.spawn(move || {
                // its plan is made here, off the runner's path (15 ms for V4-Flash's five
                // layers on the H200, in parallel): it matters when the page cache is cold
                let plan = plan_of(ops, |op| {
                    if reads_nothing(cfg, op, t_len) {
                        Vec::new()
                    } else {
                        prefetch_groups(ckpt, op)
                    }
                });
                prefetch_loop(ckpt, &plan, routed, at_step, done, PREFETCH_AHEAD)
            });
        }
        crate::profile::mark("runner: first op");
        let r = (|| -> Result<()> {
            for (step, op) in ops.iter().enumerate() {
                at_step.store(step, std::sync::atomic::Ordering::Relaxed);
                let t_op = Instant::now();
                crate::profile::set_step(step);
                pb.set_message(op.id.clone());
                // a device allocation that fails says so, not "backend unavailable"
                st.step(step, op)
                    .map_err(|e| crate::backend::oom::explain(e, &op.id, opts.backend.gpu()))?;
                pb.inc(1);
                crate::profile::interval("op", step, t_op);
                *st.prof.entry(format!("{:?}", op.kind)).or_default() +=
                    t_op.elapsed().as_secs_f64();
                if opts.stop_after.as_deref() == Some(op.id.as_str()) {
                    break;
                }
            }
            crate::profile::mark("runner: last op done");
            if let Some(q) = st.queued.take() {
                let id = q.record.op.id.clone();
                st.finish(q)
                    .map_err(|e| crate::backend::oom::explain(e, &id, opts.backend.gpu()))?;
            }
            Ok(())
        })();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        r
    });
    let stage_stats = runner::stop_loader(opts, loader.stager);
    crate::profile::mark("runner: loader and prefetcher joined");
    scoped?;
    pb.finish_and_clear();
    if crate::profile::enabled() {
        print_profile(
            opts,
            ops,
            std::mem::take(&mut st.prof),
            stage_stats.as_ref(),
        );
    }
    crate::profile::write_timeline();
    let (found, scales) = st.tracker.into_parts();
    let mut records = st.records;
    consequence::classify(&mut records, found, &scales, &opts.spec.thresholds);
    let summary = Summary::of(&records);
    Ok((
        RunResult {
            records,
            summary,
            outputs: st.outputs,
            seconds: t0.elapsed().as_secs_f64(),
            bytes_read: ckpt.bytes_read() - bytes0,
        },
        st.captured,
    ))
}

/// `NVFP4_PROBE_PROFILE=1`: seconds per op kind (all execs of the op) and in metrics, host spans,
/// the device's counters, the loader's statistics and the device time per kernel, on stderr.
fn print_profile(
    opts: &RunOptions,
    ops: &[Op],
    prof: BTreeMap<String, f64>,
    stage_stats: Option<&crate::backend::stage::StageStats>,
) {
    let mut v: Vec<_> = prof.into_iter().collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    let line: Vec<String> = v.iter().map(|(k, s)| format!("{k} {s:.3}")).collect();
    eprintln!(
        "profile (s, ops include their metrics): {}",
        line.join(", ")
    );
    eprintln!("profile host spans (s, count): {}", crate::profile::spans());
    if let Some(g) = opts.backend.gpu() {
        if let Ok(g) = g.lock() {
            eprintln!(
                "gpu counters: {}",
                serde_json::to_string(&g.counters).unwrap_or_default()
            );
            if let Some(s) = stage_stats {
                let dropped: Vec<String> = s
                    .dropped_at
                    .iter()
                    .map(|(step, b)| {
                        format!("{} {b}", ops.get(*step).map_or("?", |o| o.id.as_str()))
                    })
                    .collect();
                eprintln!(
                    "loader (weights staged ahead): {}; dropped by op: {}",
                    serde_json::to_string(s).unwrap_or_default(),
                    dropped.join(", ")
                );
            }
            if let Some(by_step) = g.kernel_times_by_step() {
                let mut kinds: HashMap<String, f64> = HashMap::new();
                for &(step, secs) in &by_step {
                    let kind = ops
                        .get(step)
                        .map_or("?".into(), |o| format!("{:?}", o.kind));
                    *kinds.entry(kind).or_default() += secs;
                    crate::profile::record("device", step, 0.0, secs);
                }
                let mut v: Vec<_> = kinds.into_iter().collect();
                v.sort_by(|a, b| b.1.total_cmp(&a.1));
                let line: Vec<String> = v.iter().map(|(k, s)| format!("{k} {s:.3}")).collect();
                eprintln!("gpu device time by op kind (s): {}", line.join(", "));
                for &(step, secs) in by_step.iter().filter(|x| x.1 > 0.02) {
                    let top: Vec<String> = g
                        .kernel_times_of_step(step)
                        .iter()
                        .take(4)
                        .map(|(k, n, s)| format!("{k} {:.1} ms ({n})", s * 1e3))
                        .collect();
                    eprintln!(
                        "gpu device time of step {step} {}: {:.1} ms: {}",
                        ops.get(step).map_or("?", |o| o.id.as_str()),
                        secs * 1e3,
                        top.join(", ")
                    );
                }
            }
            if let Some(kt) = g.kernel_times() {
                let sum = |copies: bool| -> f64 {
                    kt.iter()
                        .filter(|(k, _, _)| k.starts_with("copy") == copies)
                        .map(|(_, _, s)| s)
                        .sum()
                };
                let top: Vec<String> = kt
                    .iter()
                    .take(16)
                    .map(|(k, n, s)| format!("{k} {s:.3} ({n})"))
                    .collect();
                eprintln!(
                        "gpu device time (events around every launch and copy): kernels + cuBLAS {:.3} s, copies {:.3} s; by kernel (s, calls): {}",
                        sum(false),
                        sum(true),
                        top.join(", ")
                    );
            }
        }
    }
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
    agreement: Option<Agreement>,
    metrics: PendingMeasure,
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
    let agreement = if is_index_output(op) {
        Some(Agreement {
            served_isolated: agreement(&is.data, &bf.data),
            served_propagated: agreement(&sv.data, &bf.data),
            oracle_bf16: agreement(&bf.data, &fp.data),
        })
    } else {
        None
    };
    Ok(PendingRecord {
        step,
        op: op.clone(),
        shape: sv.shape.clone(),
        touched: touched.to_vec(),
        observed: observed.to_vec(),
        agreement,
        metrics,
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
        agreement,
        metrics,
    } = p;
    let (op, touched, observed) = (&op, &touched[..], &observed[..]);
    let ms = {
        let _s = crate::profile::span("metrics: measure");
        measure_finish(&opts.backend, metrics)?
    };
    let mut stats = BTreeMap::new();
    stats.insert("oracle_fp32".to_string(), ms.fp);
    stats.insert("oracle_bf16".to_string(), ms.bf);
    stats.insert("served".to_string(), ms.sv);
    stats.insert("served_isolated".to_string(), ms.is);
    let weights: Vec<(String, String)> = touched
        .iter()
        .map(|t| (t.clone(), ckpt.weight_scheme(t).unwrap_or("?").to_string()))
        .collect();
    let class = format!("{:?}", op.class);
    let (noise, noise_iso, iso_bf, prop_bf) = (ms.noise, ms.noise_iso, ms.iso_bf, ms.prop_bf);
    let (health, act_ratio) = env::aggregate_health(observed);
    let (tol, tolerance_basis) = tolerance::op_tolerance(
        th,
        opts.profile,
        &class,
        &weights,
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
    })
}

/// Per op, what `f` plans for it (ops in parallel).
fn plan_of<T: Send>(ops: &[Op], f: impl Fn(&Op) -> Vec<T> + Sync + Send) -> Vec<Vec<T>> {
    use rayon::prelude::*;
    ops.par_iter().map(f).collect()
}

/// How far (bytes of weights) the prefetch thread may run ahead of the op being computed.
const PREFETCH_AHEAD: usize = 8 << 30;

/// Canonical names of the stored tensors some weights occupy (data and block scales).
fn prefetch_names(ckpt: &Checkpoint, weights: &[String]) -> Vec<String> {
    let mut v = Vec::new();
    for name in weights {
        if let Ok(l) = ckpt.weight_layout(name) {
            v.push(l.weight);
            v.extend(l.scale);
        } else if ckpt.canonical_info(name).is_some() {
            // a parameter (norm weight, hc mixing, sink, ...): small, but on the critical path
            v.push(name.clone());
        }
    }
    v
}

/// Tensors of an op to read ahead, grouped: one group per routed expert (`expert` set: read only
/// once the router has chosen it), one group for everything else.
struct Group {
    expert: Option<usize>,
    names: Vec<String>,
}

fn prefetch_groups(ckpt: &Checkpoint, op: &Op) -> Vec<Group> {
    if whole_weights(op).is_empty() {
        return Vec::new();
    }
    if op.kind == OpKind::Experts {
        // weights are [e0.w1, e0.w3, e0.w2, e1.w1, ...]
        use rayon::prelude::*;
        op.weights
            .par_chunks(3)
            .enumerate()
            .map(|(e, w)| Group {
                expert: Some(e),
                names: prefetch_names(ckpt, w),
            })
            .collect()
    } else {
        vec![Group {
            expert: None,
            names: prefetch_names(ckpt, whole_weights(op)),
        }]
    }
}

/// The weights `op` reads whole from the checkpoint: all of them but the embedding's, of which
/// the runner reads the prompt's rows (`Checkpoint::embedding_rows`). What the early reader, the
/// page-cache prefetcher and the CUDA loader read ahead.
fn whole_weights(op: &Op) -> &[String] {
    if op.kind == OpKind::Embed {
        &[]
    } else {
        &op.weights
    }
}

/// Whether at `t` tokens `op` reads no weight at all: an indexer that selects every compressed
/// row without scoring, a compressor with nothing to compress.
fn reads_nothing(cfg: &crate::model::config::ModelConfig, op: &Op, t: usize) -> bool {
    indexer_reads_nothing(cfg, op, t) || compressor_reads_nothing(cfg, op, t)
}

/// An indexer whose every causal compressed row fits its top-k budget selects them all without
/// scoring (`model::attn::indexer`), so it reads none of its weights: nothing to stage.
fn indexer_reads_nothing(cfg: &crate::model::config::ModelConfig, op: &Op, t: usize) -> bool {
    op.kind == OpKind::Indexer
        && op.layer.is_some_and(|l| {
            let ratio = cfg.ratio(l);
            ratio > 0 && (cfg.index_topk == 0 || t / ratio <= cfg.index_topk)
        })
}

/// A compressor whose ratio exceeds the prompt's length compresses no row and reads no weight.
fn compressor_reads_nothing(cfg: &crate::model::config::ModelConfig, op: &Op, t: usize) -> bool {
    op.kind == OpKind::Compressor
        && op.layer.is_some_and(|l| {
            let ratio = cfg.ratio(l);
            ratio > 0 && t / ratio == 0
        })
}

/// The weights an op uploads, for the loader: one group per routed expert, one for the rest.
fn stage_groups(ckpt: &Checkpoint, op: &Op) -> Vec<crate::backend::stage::StageGroup> {
    use crate::backend::{cuda::Gpu, stage::StageGroup};
    let spans =
        |ws: &[String]| -> Vec<_> { ws.iter().flat_map(|w| Gpu::staged_spans(ckpt, w)).collect() };
    if whole_weights(op).is_empty() {
        return Vec::new();
    }
    if op.kind == OpKind::Experts {
        use rayon::prelude::*;
        op.weights
            .par_chunks(3)
            .enumerate()
            .map(|(e, w)| StageGroup {
                expert: Some(e),
                spans: spans(w),
            })
            .collect()
    } else {
        vec![StageGroup {
            expert: None,
            spans: spans(whole_weights(op)),
        }]
    }
}

/// The experts op each hash-routed layer's router feeds, with the experts its table gives the
/// run's tokens (known before the run: the table and the token ids are all it depends on).
/// Tables that do not fit are left out (the router reports them; the loader then just waits).
fn hash_routing(
    ckpt: &Checkpoint,
    cfg: &crate::model::config::ModelConfig,
    ops: &[Op],
    tokens: &[u32],
) -> Vec<(usize, Vec<bool>)> {
    let k = cfg.num_experts_per_tok;
    let mut out = Vec::new();
    for (step, op) in ops.iter().enumerate() {
        if op.kind != OpKind::Router || !op.layer.is_some_and(|l| cfg.is_hash_layer(l)) {
            continue;
        }
        let (Some(target), Some(name)) = (experts_fed_by(ops, step), op.weights.get(1)) else {
            continue;
        };
        // only the prompt's rows of the table
        let Ok(table) = ckpt.tensor_rows(name, tokens, "a routing table") else {
            continue;
        };
        if table.cols() != k || k == 0 {
            continue;
        }
        let n = ops[target].weights.len() / 3;
        let mut used = vec![false; n];
        for &v in table.data.iter() {
            if v.is_finite() && v >= 0.0 && (v as usize) < n {
                used[v as usize] = true;
            }
        }
        out.push((target, used));
    }
    out
}

/// Drops what a failed op left deferred on the device, so the device state can run again.
struct CancelDeferred<'a>(Option<&'a std::sync::Arc<std::sync::Mutex<crate::backend::cuda::Gpu>>>);

impl Drop for CancelDeferred<'_> {
    fn drop(&mut self) {
        if let Some(Ok(mut g)) = self.0.map(|g| g.lock()) {
            g.cancel_deferred();
        }
    }
}

/// The step of the routed-experts op that consumes the expert ids (output 1) of the router at
/// `step`.
fn experts_fed_by(ops: &[Op], step: usize) -> Option<usize> {
    let idx_id = ops[step].outputs.get(1)?;
    (step + 1..ops.len())
        .find(|&i| ops[i].kind == OpKind::Experts && ops[i].inputs.iter().any(|x| x == idx_id))
}

/// After the router's step: the experts op that consumes its choice (the op reading its `idx`
/// output) gets the union of the experts every path chose.
fn publish_routing(
    ops: &[Op],
    step: usize,
    outs: &[Vec<Tensor>],
    routed: &std::sync::Mutex<HashMap<usize, Vec<bool>>>,
) {
    let Some(target) = experts_fed_by(ops, step) else {
        return;
    };
    let n = ops[target].weights.len() / 3;
    let mut used = vec![false; n];
    for path in outs {
        if let Some(t) = path.get(1) {
            for &v in &t.data {
                if v.is_finite() && v >= 0.0 && (v as usize) < n {
                    used[v as usize] = true;
                }
            }
        }
    }
    if let Ok(mut m) = routed.lock() {
        m.insert(target, used);
    }
}

/// Bytes the early reader (`start_early_read`) reads at most.
pub const EARLY_READ_BYTES: usize = 2 << 30;

/// Start reading, on a detached thread, up to `budget` bytes of the weights a run over layers
/// `0..=last` will need, in op order, with positioned reads from the files, so the disk works
/// while the device and the rest of the command start. Routed experts are left out (which ones
/// are needed is known only once the run routes), and so are the embedding rows. The page cache
/// is shared, so the runner then finds those bytes there; nothing is kept in memory here, and
/// when the process ends first the thread just ends with it. For the GPU backend (a CPU run is
/// compute-bound). Returns the bytes queued.
pub fn start_early_read(ckpt: &Checkpoint, last: usize, budget: usize) -> usize {
    let Ok(cfg) = ckpt.model_config() else {
        return 0;
    };
    let last = last.min(cfg.num_hidden_layers.saturating_sub(1));
    let with_head = last + 1 == cfg.num_hidden_layers && ckpt.resolve("head.weight").is_some();
    let mut ranges: Vec<(PathBuf, u64, usize)> = Vec::new();
    let mut total = 0usize;
    'ops: for op in build_graph(cfg, last, with_head) {
        if op.kind == OpKind::Experts {
            continue;
        }
        for name in prefetch_names(ckpt, whole_weights(&op)) {
            if let Ok(crate::checkpoint::Span::File { path, offset, len }) =
                ckpt.canonical_span(&name)
            {
                if total + len > budget {
                    break 'ops;
                }
                total += len;
                ranges.push((path.to_path_buf(), offset, len));
            }
        }
    }
    if ranges.is_empty() {
        return 0;
    }
    let _ = std::thread::Builder::new()
        .name("early-read".into())
        .spawn(move || {
            use std::os::unix::fs::FileExt;
            let mut buf = vec![0u8; 8 << 20];
            let mut files: HashMap<PathBuf, std::fs::File> = HashMap::new();
            for (path, mut off, len) in ranges {
                if !files.contains_key(&path) {
                    match std::fs::File::open(&path) {
                        Ok(f) => {
                            files.insert(path.clone(), f);
                        }
                        Err(_) => continue,
                    }
                }
                let f = &files[&path];
                let end = off + len as u64;
                while off < end {
                    let n = ((end - off) as usize).min(buf.len());
                    match f.read_at(&mut buf[..n], off) {
                        Ok(0) | Err(_) => break,
                        Ok(k) => off += k as u64,
                    }
                }
            }
        });
    total
}

/// Read ahead the tensors of the ops after the current one, at most `ahead` bytes (of the plan,
/// every expert counted) beyond it. A routed expert's tensors are read only once the router has
/// chosen it (`routed`); until then the loop waits at that op, so no byte of an expert the run
/// does not use is read.
fn prefetch_loop(
    ckpt: &Checkpoint,
    plan: &[Vec<Group>],
    routed: &std::sync::Mutex<HashMap<usize, Vec<bool>>>,
    at: &std::sync::atomic::AtomicUsize,
    done: &std::sync::atomic::AtomicBool,
    ahead: usize,
) {
    use std::sync::atomic::Ordering::Relaxed;
    let size = |n: &String| ckpt.canonical_span(n).map(|s| s.len()).unwrap_or(0);
    let sizes: Vec<Vec<Vec<usize>>> = plan
        .iter()
        .map(|gs| {
            gs.iter()
                .map(|g| g.names.iter().map(size).collect())
                .collect()
        })
        .collect();
    let mut start_of = vec![0usize; plan.len() + 1];
    for (i, s) in sizes.iter().enumerate() {
        start_of[i + 1] = start_of[i] + s.iter().flatten().sum::<usize>();
    }
    // the embedding rows are read first, by the main thread: do not queue I/O in front of them
    while at.load(Relaxed) == 0 && !done.load(Relaxed) {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let mut pos = 0usize; // bytes of the plan already passed
    for (step, groups) in plan.iter().enumerate() {
        for (gi, g) in groups.iter().enumerate() {
            if let Some(e) = g.expert {
                // wait for the routing (or for the op to be done: then there is nothing to do)
                let chosen = loop {
                    if done.load(Relaxed) {
                        return;
                    }
                    if at.load(Relaxed) > step {
                        break false;
                    }
                    if let Some(u) = routed.lock().ok().and_then(|m| m.get(&step).cloned()) {
                        break u.get(e).copied().unwrap_or(true);
                    }
                    std::thread::sleep(std::time::Duration::from_millis(1));
                };
                if !chosen {
                    pos += sizes[step][gi].iter().sum::<usize>();
                    continue;
                }
            }
            for (name, &len) in g.names.iter().zip(&sizes[step][gi]) {
                loop {
                    if done.load(Relaxed) {
                        return;
                    }
                    let cur = at.load(Relaxed).min(plan.len());
                    if step < cur {
                        break; // that op is already done: skip
                    }
                    if pos + len <= start_of[cur] + ahead || step == cur {
                        ckpt.readahead(name);
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                pos += len;
            }
        }
    }
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

/// An op's metrics: computed (host), or queued on the device.
pub(crate) enum PendingMeasure {
    Done(Vec<(Stats, Option<Compare>)>),
    Device(crate::backend::cuda::PendingMetrics),
}

/// The metrics of one op, on the device when the run has one (one fused pass per pair, queued).
fn measure_launch(
    backend: &crate::backend::Backend,
    fp: &Tensor,
    bf: &Tensor,
    sv: &Tensor,
    is: &Tensor,
    fp_on_bf: &Tensor,
) -> Result<PendingMeasure> {
    let td: [&crate::tensor::Data; 5] = [&fp.data, &bf.data, &sv.data, &is.data, &fp_on_bf.data];
    let same = td.iter().all(|x| x.len() == td[0].len());
    Ok(match backend.gpu() {
        Some(g) if same => {
            let mut g = g
                .lock()
                .map_err(|_| Error::Backend("cuda: device state poisoned".into()))?;
            PendingMeasure::Device(g.metrics_launch(&td, &PAIRS)?)
        }
        _ => {
            let t: [&[f32]; 5] = td.map(|d| &d[..]);
            PendingMeasure::Done(if same {
                crate::metrics::stats_and_compares(&t, &PAIRS)
            } else {
                PAIRS
                    .iter()
                    .map(|&(i, j)| (Stats::of(t[i]), j.map(|j| Compare::of(t[i], t[j]))))
                    .collect()
            })
        }
    })
}

fn measure_finish(backend: &crate::backend::Backend, m: PendingMeasure) -> Result<Measured> {
    let r = match m {
        PendingMeasure::Done(r) => r,
        PendingMeasure::Device(p) => match backend.gpu() {
            Some(g) => g
                .lock()
                .map_err(|_| Error::Backend("cuda: device state poisoned".into()))?
                .metrics_collect(p)?,
            None => return Err(Error::Backend("metrics queued without a device".into())),
        },
    };
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

#[cfg(test)]
mod stage_plan_tests {
    //! What the CUDA loader thread plans from before the run (`hash_routing`,
    //! `indexer_reads_nothing`), checked against what the run itself does on the CPU.
    use super::*;

    fn tiny() -> (Checkpoint, crate::model::config::ModelConfig) {
        let ck = crate::synth::builtin(0).expect("built-in model");
        let cfg = ck.model_config().expect("config").clone();
        (ck, cfg)
    }

    #[test]
    fn hash_routing_known_before_the_run_is_what_the_routers_choose() {
        let (ck, cfg) = tiny();
        assert!(
            cfg.num_hash_layers > 0,
            "the tiny model has hash-routed layers"
        );
        let last = cfg.num_hash_layers.min(cfg.num_hidden_layers - 1);
        let tokens = synthetic_tokens(48, cfg.vocab_size, 7);
        let ops = build_graph(&cfg, last, false);
        let early = hash_routing(&ck, &cfg, &ops, &tokens);
        assert_eq!(early.len(), cfg.num_hash_layers.min(last + 1));
        let mut opts = RunOptions::new((0, last), tokens);
        opts.keep_outputs = true;
        let r = run(&ck, &opts).expect("run");
        for (target, used) in &early {
            // the router whose expert ids the experts op at `target` consumes
            let router = ops
                .iter()
                .find(|o| {
                    o.kind == OpKind::Router
                        && o.outputs
                            .get(1)
                            .is_some_and(|id| ops[*target].inputs.contains(id))
                })
                .expect("router of the experts op");
            let idx_id = &router.outputs[1];
            let mut chosen = vec![false; used.len()];
            for path in ["oracle_fp32", "oracle_bf16", "served"] {
                let (_, t) = r.outputs[path]
                    .iter()
                    .find(|(id, _)| id == idx_id)
                    .expect("router ids kept");
                for &v in t.data.iter() {
                    chosen[v as usize] = true;
                }
            }
            assert_eq!(&chosen, used, "experts of {}", ops[*target].id);
            assert!(used.iter().any(|&u| u));
        }
    }

    #[test]
    fn indexers_left_out_of_the_plan_read_no_weight() {
        let (ck, cfg) = tiny();
        let ops = build_graph(&cfg, cfg.num_hidden_layers - 1, false);
        let indexers: Vec<&Op> = ops.iter().filter(|o| o.kind == OpKind::Indexer).collect();
        assert!(!indexers.is_empty(), "the tiny model has indexers");
        let mut seen = (false, false);
        for t in [12, 64] {
            let opts = RunOptions::new(
                (0, cfg.num_hidden_layers - 1),
                synthetic_tokens(t, cfg.vocab_size, 3),
            );
            let r = run(&ck, &opts).expect("run");
            for op in &indexers {
                let rec = r
                    .records
                    .iter()
                    .find(|x| x.id == op.id)
                    .expect("indexer record");
                let skip = indexer_reads_nothing(&cfg, op, t);
                assert_eq!(skip, rec.weights.is_empty(), "{} at T = {t}", op.id);
                if skip {
                    seen.0 = true;
                } else {
                    seen.1 = true;
                }
            }
        }
        assert_eq!(seen, (true, true), "both cases occur");
    }

    /// Every op the loader stages weights for reads weights in the run (the embedding, read a
    /// few rows at a time, is not staged: 1 GB of a Flash checkpoint).
    #[test]
    fn the_plan_stages_only_weights_the_ops_read() {
        // on disk: the loader stages stored file spans
        let dir = tempfile::tempdir().expect("temp dir");
        let so = crate::synth::SynthOptions::new(
            crate::synth::Preset::Tiny,
            crate::synth::Format::OfficialMixed,
            crate::checkpoint::naming::Naming::Official,
            0,
        );
        crate::synth::synth_to_dir(&so, dir.path()).expect("synth");
        let ck = Checkpoint::open(dir.path()).expect("open");
        let cfg = ck.model_config().expect("config").clone();
        let last = cfg.num_hidden_layers - 1;
        let ops = build_graph(&cfg, last, false);
        let r = run(
            &ck,
            &RunOptions::new((0, last), synthetic_tokens(12, cfg.vocab_size, 5)),
        )
        .expect("run");
        let mut staged_ops = 0;
        for op in &ops {
            if reads_nothing(&cfg, op, 12) {
                let rec = r.records.iter().find(|x| x.id == op.id).expect("record");
                assert!(rec.weights.is_empty(), "{} is left out but reads", op.id);
                continue;
            }
            let groups = stage_groups(&ck, op);
            if groups.iter().all(|g| g.spans.is_empty()) {
                continue;
            }
            staged_ops += 1;
            let rec = r.records.iter().find(|x| x.id == op.id).expect("record");
            assert!(
                !rec.weights.is_empty(),
                "{} is staged but reads no weight",
                op.id
            );
        }
        assert!(staged_ops > 0);
        assert!(
            ops.iter().any(|o| compressor_reads_nothing(&cfg, o, 12)),
            "a compressor left out at T = 12"
        );
        let embed = ops
            .iter()
            .find(|o| o.kind == OpKind::Embed)
            .expect("embed op");
        assert!(stage_groups(&ck, embed).is_empty());
    }
}
