//! Cheap passes for bisect's layer search. A full run costs five op executions per reported op
//! (three propagated paths, the served op on the oracle's inputs, FP32 on the oracle's inputs);
//! finding *which layer* holds a fault needs far less:
//! - [`scan`]: the BF16 oracle and the served path only (two executions per op), keeping the state
//!   both carry into every layer and the oracle's layer outputs, stopping at the first layer whose
//!   served output is clearly broken ([`ShowRule`]);
//! - [`served_from`]: the served path alone over layers m..=n started from the oracle's state at
//!   layer m (one execution per op), compared against the oracle output the scan kept;
//! - [`measure_layer`]: the runner's full per-op measurement of one layer, started from the scan's
//!   saved states instead of from the embedding.
//!
//! Every path here builds its `Shared` with `RunOptions::shared` and runs `PathEnv`s the way
//! `probe::run` does, so the backend the options select applies here too. Metrics are computed on
//! the host (`Compare::of`), not through the runner's device metrics.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use serde::Serialize;

use super::env::{PathEnv, Shared};
use super::replay::Capture;
use super::spec::Thresholds;
use super::{OpRecord, RunOptions};
use crate::checkpoint::Checkpoint;
use crate::metrics::{Compare, Stats};
use crate::model::graph::{build_graph, Op};
use crate::served::PathKind;
use crate::{Error, Result, Tensor};

/// When a propagated layer output counts as *clearly broken* (not merely noisy). On random or
/// small models routing is chaotic and a clean served path already sits at rel-L2 ≈ 0.5 after a
/// few layers, so the runner's `propagated_rel_l2` cannot drive a search: a search step that fires
/// on noise would point at a clean layer. These limits sit well beyond that noise.
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct ShowRule {
    /// rel-L2 vs the BF16 oracle above this is broken.
    pub rel_l2: f64,
    /// cosine vs the BF16 oracle below this is broken.
    pub cos: f64,
    /// amax ratio outside [1/x, x] is broken.
    pub amax_ratio: f64,
    /// The scan restarts its served path from the oracle's state every this many layers, so that
    /// noise never accumulates over more layers than that: on the tiny random model four layers
    /// of clean noise stay under rel-L2 0.65, while sixteen reach 0.9 by layer 9 and would stop a
    /// scan on noise alone. A fault that needs more layers than this to break the output is
    /// subtle; the linear search finds it.
    pub segment_layers: usize,
}

impl ShowRule {
    /// Derived from the probe spec: rel-L2 beyond 1.8× the propagated threshold (at least 0.9),
    /// cosine under 0.3, amax ratio beyond the square of the op-level amax threshold.
    pub fn from_thresholds(th: &Thresholds) -> ShowRule {
        ShowRule {
            rel_l2: (1.8 * th.propagated_rel_l2).max(0.9),
            cos: 0.3,
            amax_ratio: th.amax_ratio * th.amax_ratio,
            segment_layers: 4,
        }
    }

    /// The rule a search probe is held to once a scan has stopped at a broken layer S: rel-L2 at
    /// 3/4 of the scan's limit, cosine under 0.5. A probe restarted from the oracle at layer m drops
    /// the noise of the layers before m, so a probe that still carries the fault sits a little
    /// below the level that stopped the scan (on the tiny model 0.89 against the scan's 0.92),
    /// while one without it carries the noise of fewer layers than the scan saw (≤ 0.65 on the
    /// tiny model's five). A wrong answer either way is caught: the named layer is then measured
    /// and, without a divergent op, the search falls back to the linear one.
    pub fn for_probes(&self) -> ShowRule {
        ShowRule {
            rel_l2: 0.75 * self.rel_l2,
            cos: self.cos.max(0.5),
            amax_ratio: self.amax_ratio,
            segment_layers: self.segment_layers,
        }
    }

    /// Why `c` (served vs oracle) is clearly broken, or None.
    pub fn broken(&self, c: &Compare, served: &Stats, oracle: &Stats) -> Option<String> {
        if served.non_finite() && !oracle.non_finite() {
            return Some("non-finite values where the BF16 oracle has none".into());
        }
        if oracle.non_finite() {
            // both sides broken the same way: not the served path's doing
            return None;
        }
        if let Some(r) = c.rel_l2.filter(|r| !r.is_finite() || *r > self.rel_l2) {
            return Some(format!("rel-L2 {r:.3e} > {:.3}", self.rel_l2));
        }
        if let Some(v) = c.cos.filter(|v| *v < self.cos) {
            return Some(format!("cosine {v:.4} < {}", self.cos));
        }
        if let Some(q) = c
            .amax_ratio
            .filter(|q| *q > self.amax_ratio || *q < 1.0 / self.amax_ratio)
        {
            return Some(format!(
                "amax ratio {q:.3e} outside [1/{0}, {0}]",
                self.amax_ratio
            ));
        }
        None
    }
}

/// The served path vs the BF16 oracle at one layer's output.
#[derive(Clone, Debug, Serialize)]
pub struct LayerOut {
    pub layer: usize,
    /// The op id of the layer's output (`L3.out`).
    pub id: String,
    pub vs_bf16: Compare,
    pub served: Stats,
    pub oracle: Stats,
    /// Beyond the runner's `propagated_rel_l2` (or non-finite): what a run marks `shows`.
    pub shows: bool,
    /// Clearly broken by the [`ShowRule`], with the reason.
    pub broken: Option<String>,
}

/// The tensors a layer consumes from before it (by tensor id), in each path.
#[derive(Clone, Debug, Default)]
pub struct Boundary {
    pub oracle: HashMap<String, Tensor>,
    pub served: HashMap<String, Tensor>,
}

/// What the BF16 oracle produced at one (selected) op: enough for magnitude anomalies.
#[derive(Clone, Debug, Serialize)]
pub struct OracleOp {
    pub id: String,
    pub layer: Option<usize>,
    pub weights: Vec<(String, String)>,
    pub stats: Stats,
}

pub struct ScanResult {
    /// Layer outputs compared, in order (up to the stop layer).
    pub outs: Vec<LayerOut>,
    /// State at the input of each scanned layer.
    pub boundaries: BTreeMap<usize, Boundary>,
    /// The oracle's output of each scanned layer.
    pub oracle_outs: BTreeMap<usize, Tensor>,
    /// Oracle statistics of every selected op from the first reported layer on.
    pub oracle_ops: Vec<OracleOp>,
    /// The first clearly broken layer.
    pub broken_at: Option<usize>,
    /// The layer where the served path last restarted from the oracle before `broken_at`: the
    /// fault that broke it lies in [segment start, broken_at].
    pub segment_start: Option<usize>,
    pub execs: usize,
    pub seconds: f64,
}

/// A served-only partial run.
#[derive(Clone, Debug, Serialize)]
pub struct Probe {
    pub from: usize,
    pub to: usize,
    pub out: LayerOut,
    pub execs: usize,
    pub seconds: f64,
}

/// The runner's records of one layer, measured from saved states.
pub struct Measured {
    pub records: Vec<OpRecord>,
    /// The BF16-oracle view of the layer's divergent ops, in order (what `replay::capture` returns).
    pub captures: Vec<Capture>,
    pub execs: usize,
    pub seconds: f64,
}

/// The op graph over the requested layers, with each layer's op index range.
pub struct LayerGraph {
    pub ops: Vec<Op>,
    /// layer → [first op index, last op index].
    pub span: BTreeMap<usize, (usize, usize)>,
    last_use: HashMap<String, usize>,
}

impl LayerGraph {
    /// The graph `probe::run` builds for `opts` minus the head (a layer search never needs it).
    pub fn new(ckpt: &Checkpoint, opts: &RunOptions) -> Result<LayerGraph> {
        let cfg = ckpt.model_config()?;
        let (a, b) = crate::model::layers::LayerRange::new(opts.layers.0, opts.layers.1)
            .check(cfg.num_hidden_layers)?;
        // the search keeps both paths' state at every layer input: checked before any is made
        super::budget::check(
            cfg,
            &super::budget::Plan {
                layers: (a, b),
                tokens: opts.tokens.len() as u64,
                keep_outputs: false,
                kept_rows: None,
                with_head: false,
                layer_states: true,
                chunk: None,
                device: opts.backend.on_device(),
            },
            opts.max_mem,
            &opts.backend,
            "this layer search",
        )?;
        let ops = build_graph(cfg, b, false);
        let mut span: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
        let mut last_use = HashMap::new();
        for (i, op) in ops.iter().enumerate() {
            if let Some(l) = op.layer {
                span.entry(l).and_modify(|s| s.1 = i).or_insert((i, i));
            }
            for inp in &op.inputs {
                last_use.insert(inp.clone(), i);
            }
        }
        Ok(LayerGraph {
            ops,
            span,
            last_use,
        })
    }

    fn span_of(&self, layer: usize) -> Result<(usize, usize)> {
        self.span
            .get(&layer)
            .copied()
            .ok_or_else(|| Error::usage(format!("layer {layer} is not in the graph")))
    }

    /// Tensor ids the ops from `layer` on consume that were produced before it.
    pub fn boundary_ids(&self, layer: usize) -> Result<Vec<String>> {
        let (s, _) = self.span_of(layer)?;
        let produced_before: std::collections::HashSet<&str> = self.ops[..s]
            .iter()
            .flat_map(|o| o.outputs.iter().map(String::as_str))
            .collect();
        let mut ids: Vec<String> = Vec::new();
        for op in &self.ops[s..] {
            for i in &op.inputs {
                if produced_before.contains(i.as_str()) && !ids.contains(i) {
                    ids.push(i.clone());
                }
            }
        }
        Ok(ids)
    }

    fn drop_dead(&self, step: usize, m: &mut HashMap<String, Tensor>) {
        m.retain(|id, _| self.last_use.get(id).is_some_and(|&l| l > step));
    }
}

/// The run's tokens: at least one, each inside the model's vocabulary.
pub(super) fn check_tokens(ckpt: &Checkpoint, opts: &RunOptions) -> Result<()> {
    let vocab = ckpt.model_config()?.vocab_size;
    if opts.tokens.is_empty() {
        return Err(Error::usage("no tokens to run"));
    }
    if let Some(&bad) = opts.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::usage(format!(
            "token id {bad} is outside the vocabulary (vocab_size {vocab})"
        )));
    }
    Ok(())
}

/// The runner's shared state (backend, loader faults, hypotheses) for these options.
fn shared<'a>(ckpt: &'a Checkpoint, opts: &RunOptions) -> Result<Shared<'a>> {
    let cfg = ckpt.model_config()?.clone();
    Ok(opts.shared(ckpt, cfg))
}

fn run_op(
    op: &Op,
    map: &HashMap<String, Tensor>,
    kind: PathKind,
    shared: &mut Shared,
) -> Result<Vec<Tensor>> {
    let inputs: Vec<&Tensor> = op
        .inputs
        .iter()
        .map(|id| {
            map.get(id).ok_or_else(|| {
                Error::usage(format!("internal: op {} input {id} not computed", op.id))
            })
        })
        .collect::<Result<_>>()?;
    let mut env = PathEnv { kind, shared };
    // the served path as the run's (`--served-chunk`: in the engine's prefill chunks)
    let outs = super::prefill::exec(op, &inputs, &mut env)?;
    if outs.len() != op.outputs.len() {
        return Err(Error::usage(format!(
            "internal: op {} returned {} outputs for {} ids",
            op.id,
            outs.len(),
            op.outputs.len()
        )));
    }
    Ok(outs)
}

fn insert(op: &Op, outs: Vec<Tensor>, map: &mut HashMap<String, Tensor>) {
    for (id, t) in op.outputs.iter().zip(outs) {
        map.insert(id.clone(), t);
    }
}

fn layer_out(
    layer: usize,
    id: &str,
    served: &Tensor,
    oracle: &Tensor,
    th: &Thresholds,
    rule: &ShowRule,
) -> Result<LayerOut> {
    if served.data.len() != oracle.data.len() {
        return Err(Error::usage(format!(
            "internal: {id}: served has {} values, the oracle {}",
            served.data.len(),
            oracle.data.len()
        )));
    }
    let c = Compare::of(&served.data, &oracle.data);
    let (ss, os) = (Stats::of(&served.data), Stats::of(&oracle.data));
    let shows =
        (ss.non_finite() && !os.non_finite()) || c.rel_l2.is_none_or(|r| r > th.propagated_rel_l2);
    let broken = rule.broken(&c, &ss, &os);
    Ok(LayerOut {
        layer,
        id: id.to_string(),
        vs_bf16: c,
        served: ss,
        oracle: os,
        shows,
        broken,
    })
}

/// The BF16 oracle over layers 0..=b and the served path from `opts.layers.0` on (started from the
/// oracle's state there, so faults before the reported range do not count, as in a run's isolated
/// measurement, and restarted every `rule.segment_layers` layers). With `stop`, ends after the
/// first clearly broken layer output.
pub fn scan(
    ckpt: &Checkpoint,
    opts: &RunOptions,
    rule: &ShowRule,
    stop: bool,
) -> Result<ScanResult> {
    let t0 = Instant::now();
    check_tokens(ckpt, opts)?;
    let g = LayerGraph::new(ckpt, opts)?;
    let th = &opts.spec.thresholds;
    let a = opts.layers.0;
    // from layer 0 the served path runs the embedding too, as in a run
    let start = if a == 0 { 0 } else { g.span_of(a)?.0 };
    let mut sh = shared(ckpt, opts)?;
    let mut bf: HashMap<String, Tensor> = HashMap::new();
    let mut sv: HashMap<String, Tensor> = HashMap::new();
    let mut res = ScanResult {
        outs: Vec::new(),
        boundaries: BTreeMap::new(),
        oracle_outs: BTreeMap::new(),
        oracle_ops: Vec::new(),
        broken_at: None,
        segment_start: None,
        execs: 0,
        seconds: 0.0,
    };
    let seg = rule.segment_layers.max(1);
    let mut seg_start = a;
    for (step, op) in g.ops.iter().enumerate() {
        if let Some(l) = op.layer.filter(|&l| l >= a && g.span[&l].0 == step) {
            // the first reported layer starts from the oracle (the embedding aside), later
            // segments restart from it
            let restart = (l == a && step == start) || (l > a && (l - a).is_multiple_of(seg));
            if restart {
                seg_start = l;
            }
            let mut bd = Boundary::default();
            for id in g.boundary_ids(l)? {
                let o = bf.get(&id).cloned().ok_or_else(|| {
                    Error::usage(format!("internal: boundary tensor {id} missing"))
                })?;
                if restart {
                    sv.insert(id.clone(), o.clone());
                }
                let s = sv.get(&id).cloned().ok_or_else(|| {
                    Error::usage(format!("internal: boundary tensor {id} missing"))
                })?;
                bd.oracle.insert(id.clone(), o);
                bd.served.insert(id, s);
            }
            res.boundaries.insert(l, bd);
        }
        let o = run_op(op, &bf, PathKind::OracleBf16, &mut sh)?;
        res.execs += 1;
        let s = if step >= start {
            res.execs += 1;
            Some(run_op(op, &sv, PathKind::Served, &mut sh)?)
        } else {
            None
        };
        if step >= start && opts.spec.selects(&op.id) {
            res.oracle_ops.push(OracleOp {
                id: op.id.clone(),
                layer: op.layer,
                weights: sh
                    .touched
                    .iter()
                    .map(|t| (t.clone(), ckpt.weight_scheme(t).unwrap_or("?").to_string()))
                    .collect(),
                stats: Stats::of(&o[0].data),
            });
        }
        sh.clear();
        let mut broke = false;
        if let (Some(l), Some(s)) = (op.layer, &s) {
            if g.span[&l].1 == step {
                let lo = layer_out(l, &op.id, &s[0], &o[0], th, rule)?;
                broke = lo.broken.is_some();
                res.outs.push(lo);
                res.oracle_outs.insert(l, o[0].clone());
                if broke && res.broken_at.is_none() {
                    res.broken_at = Some(l);
                    res.segment_start = Some(seg_start);
                }
            }
        }
        insert(op, o, &mut bf);
        if let Some(s) = s {
            insert(op, s, &mut sv);
        }
        g.drop_dead(step, &mut bf);
        g.drop_dead(step, &mut sv);
        if broke && stop {
            break;
        }
    }
    res.seconds = t0.elapsed().as_secs_f64();
    Ok(res)
}

/// The served path alone over layers `from..=to`, started from the oracle's state at the input of
/// `from`, compared at `to`'s output against the oracle's output `reference`.
pub fn served_from(
    ckpt: &Checkpoint,
    opts: &RunOptions,
    start: &Boundary,
    (from, to): (usize, usize),
    reference: &Tensor,
    rule: &ShowRule,
) -> Result<Probe> {
    let t0 = Instant::now();
    let g = LayerGraph::new(ckpt, opts)?;
    let (s0, _) = g.span_of(from)?;
    let (_, s1) = g.span_of(to)?;
    let mut sh = shared(ckpt, opts)?;
    let mut sv = start.oracle.clone();
    let mut execs = 0;
    let mut last: Option<Tensor> = None;
    for step in s0..=s1 {
        let op = &g.ops[step];
        let out = run_op(op, &sv, PathKind::Served, &mut sh)?;
        execs += 1;
        sh.clear();
        if step == s1 {
            last = out.first().cloned();
        }
        insert(op, out, &mut sv);
        g.drop_dead(step, &mut sv);
    }
    let last =
        last.ok_or_else(|| Error::usage(format!("internal: layer {to} produced no output")))?;
    let out = layer_out(
        to,
        &g.ops[s1].id,
        &last,
        reference,
        &opts.spec.thresholds,
        rule,
    )?;
    Ok(Probe {
        from,
        to,
        out,
        execs,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// One layer measured the way `probe::run` measures a reported op (five executions per quantized
/// op), with the BF16 oracle and the served path resumed from `start` (the scan's states, so the
/// isolated measurements and the served propagated picture equal a full run's when the scan began
/// at layer 0). The FP32 oracle resumes from the BF16 oracle's state: its propagated spread
/// (`bf16_vs_fp32`, `served_*_vs_fp32`) covers this layer only; divergence does not depend on it.
/// Keeps the oracle's inputs of the first divergent op, which is what the replay needs.
pub fn measure_layer(
    ckpt: &Checkpoint,
    opts: &RunOptions,
    layer: usize,
    start: &Boundary,
) -> Result<Measured> {
    let t0 = Instant::now();
    let g = LayerGraph::new(ckpt, opts)?;
    let (s0, s1) = g.span_of(layer)?;
    let mut sh = shared(ckpt, opts)?;
    let mut maps: [HashMap<String, Tensor>; 3] = [
        start.oracle.clone(),
        start.oracle.clone(),
        start.served.clone(),
    ];
    let mut records = Vec::new();
    let mut captures: Vec<Capture> = Vec::new();
    let mut tracker = super::consequence::Tracker::default();
    let mut execs = 0;
    for step in s0..=s1 {
        let op = &g.ops[step];
        let report = opts.spec.selects(&op.id);
        let mut outs: Vec<Vec<Tensor>> = Vec::with_capacity(3);
        // the oracles' products on BF16-stored weights made once for the op, as the runner's
        let bf_in: Vec<&Tensor> = op.inputs.iter().filter_map(|id| maps[1].get(id)).collect();
        sh.keep_products(&bf_in);
        for (pi, kind) in PathKind::ALL.iter().enumerate() {
            sh.record_observations = *kind == PathKind::Served && report;
            outs.push(run_op(op, &maps[pi], *kind, &mut sh)?);
            execs += 1;
        }
        sh.record_observations = false;
        let observed = std::mem::take(&mut sh.observed);
        let touched = sh.touched.clone();
        if report {
            let quantized = touched.iter().any(|t| sh.is_quantized(t));
            let iso: Vec<Tensor> = if quantized {
                execs += 1;
                run_op(op, &maps[1], PathKind::Served, &mut sh)?
            } else {
                outs[1].clone()
            };
            let fp_on_bf = run_op(op, &maps[1], PathKind::OracleFp32, &mut sh)?;
            execs += 1;
            sh.drop_products();
            let rec = super::op_record(
                ckpt, opts, step, op, &outs, &iso, &fp_on_bf, &touched, &observed,
            )?;
            if rec.divergent {
                if captures.len() < super::MAX_CAPTURES {
                    captures.push(Capture {
                        op: op.clone(),
                        inputs: op.inputs.iter().map(|id| maps[1][id].clone()).collect(),
                        oracle_bf16: outs[1].clone(),
                    });
                }
                tracker.finished(&rec, op, iso, outs[1].first());
            }
            records.push(rec);
        }
        if tracker.consumes_faulty(op) {
            execs += tracker.consumer(op, &maps[1], &outs[1], &mut sh)?;
        }
        sh.clear();
        for (pi, out) in outs.into_iter().enumerate() {
            insert(op, out, &mut maps[pi]);
        }
        for m in maps.iter_mut() {
            g.drop_dead(step, m);
        }
    }
    super::consequence::classify(
        &mut records,
        tracker.into_parts(),
        &opts.spec.thresholds,
        super::consequence::Unfollowed::BeyondLimit,
    );
    Ok(Measured {
        records,
        captures,
        execs,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Op executions of one `probe::run` that produced `records` over `ops_run` ops: three paths per
/// op, plus for each reported op the FP32 oracle on the oracle's inputs and, when it reads a
/// quantized weight, the served op on them, plus each divergent op's consumers (one or two
/// executions each, `consequence`).
pub fn run_execs(ckpt: &Checkpoint, ops_run: usize, records: &[OpRecord]) -> usize {
    let extra: usize = records
        .iter()
        .map(|r| {
            let q = r.weights.iter().any(|(b, _)| {
                ckpt.weight_scheme(b)
                    .is_some_and(|s| s != "bf16" && s != "f16" && s != "f32")
            });
            // a divergent op's consumers, fed its faulty output (severity by consequence)
            let consequence: usize = r
                .consequence
                .iter()
                .flat_map(|c| c.downstream.iter())
                .map(|d| d.execs)
                .sum();
            1 + usize::from(q) + consequence
        })
        .sum();
    3 * ops_run + extra
}
