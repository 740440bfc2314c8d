//! The runner's stages, in the order `run_capturing` calls them: [`plan`] (the request checked
//! against the model and the memory budget, the op graph), then, inside the backend's run
//! (`Backend::run_with`, whose hooks are told where the runner is), [`Stepper::step`] for every
//! op (the three paths, the isolated and noise executions, the record, what consumers make of a
//! divergent op's error), and the profile (`NVFP4_PROBE_PROFILE=1`).

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use super::env::{PathEnv, Shared};
use super::{
    budget, consequence, op_record_begin, op_record_finish, replay, OpRecord, Queued, RunOptions,
    MAX_CAPTURES,
};
use crate::backend::run::RunHooks;
use crate::checkpoint::Checkpoint;
use crate::model::env::ChunkAt;
use crate::model::graph::{build_graph, Op};
use crate::model::layers::LayerRange;
use crate::model::ModelConfig;
use crate::served::PathKind;
use crate::{Error, Result, Tensor};

/// What a run computes: its layers, whether it ends with the head, and the op graph.
pub(super) struct Plan {
    pub first: usize,
    pub cfg: ModelConfig,
    pub ops: Vec<Op>,
    /// Tokens per chunk when each layer runs over the prompt a chunk at a time (`--chunk`, or
    /// chosen from `--mem-gib` or the memory limit; `probe::chunked`). None: all at once.
    pub chunk: Option<usize>,
    /// In chunks on a device: the layers' output streams stay in device memory (they fit the
    /// budget) instead of waiting on the host.
    pub streams_on_device: bool,
}

/// Checks the request (layers, tokens, the memory estimate) before anything of the run's size is
/// allocated, then builds the op graph.
pub(super) fn plan(ckpt: &Checkpoint, opts: &RunOptions) -> Result<Plan> {
    let cfg = ckpt.model_config()?.clone();
    if let (Some(why), true) = (
        crate::model::family::cuda_unsupported(&cfg),
        opts.backend.on_device(),
    ) {
        return Err(Error::usage(format!("cuda backend: {why}")));
    }
    let (a, b) = LayerRange::new(opts.layers.0, opts.layers.1).check(cfg.num_hidden_layers)?;
    super::scan::check_tokens(ckpt, opts)?;
    let with_head = b + 1 == cfg.num_hidden_layers && ckpt.resolve("head.weight").is_some();
    let mut bp = budget::Plan {
        layers: (a, b),
        tokens: opts.tokens.len() as u64,
        keep_outputs: opts.keep_outputs,
        kept_rows: opts.keep_rows.as_ref().map(|r| r.len() as u64),
        with_head,
        layer_states: false,
        device: opts.backend.on_device(),
        chunk: None,
    };
    // each layer over the prompt in token chunks when asked, or when the whole prompt at once
    // would not fit
    bp.chunk = budget::token_chunk(
        &cfg,
        &bp,
        opts.chunk,
        opts.mem_gib,
        opts.max_mem,
        &opts.backend,
    )?;
    // nothing of the run's size is allocated before its estimate fits (`budget`)
    budget::check(&cfg, &bp, opts.max_mem, &opts.backend, "this run")?;
    let chunk = bp.chunk.map(|c| c as usize);
    let streams_on_device =
        budget::streams_fit_device(&cfg, &bp, opts.mem_gib, opts.max_mem, &opts.backend);
    let ops = build_graph(&cfg, b, with_head);
    crate::profile::mark("runner: graph built");
    Ok(Plan {
        first: a,
        cfg,
        ops,
        chunk,
        streams_on_device,
    })
}

/// The state of a run between ops: the three paths' live tensors, the records, the captures for
/// bisect and the consequence tracker.
pub(super) struct Stepper<'a> {
    pub ckpt: &'a Checkpoint,
    pub opts: &'a RunOptions,
    /// The first reported layer (earlier layers run unreported).
    pub a: usize,
    /// Keep the BF16 oracle's view of divergent ops (bisect).
    pub capture: bool,
    /// The last step at which each tensor id is consumed, so tensors can be dropped after it.
    pub last_use: HashMap<&'a str, usize>,
    pub shared: Shared<'a>,
    pub maps: [HashMap<String, Tensor>; 3],
    pub records: Vec<OpRecord>,
    pub captured: Vec<replay::Capture>,
    /// Divergent ops' faulty outputs, fed to their consumers (severity by consequence).
    pub tracker: consequence::Tracker,
    pub outputs: BTreeMap<String, Vec<(String, Tensor)>>,
    /// The last op's record, its metrics still queued on the device.
    pub queued: Option<Queued>,
    /// Seconds per op kind (`NVFP4_PROBE_PROFILE=1`).
    pub prof: BTreeMap<String, f64>,
}

impl<'a> Stepper<'a> {
    pub fn new(
        ckpt: &'a Checkpoint,
        opts: &'a RunOptions,
        p: &'a Plan,
        capture: bool,
    ) -> Stepper<'a> {
        let mut shared = opts.shared(ckpt, p.cfg.clone());
        shared.chunk = p.chunk;
        let mut last_use: HashMap<&str, usize> = HashMap::new();
        for (i, op) in p.ops.iter().enumerate() {
            for inp in &op.inputs {
                last_use.insert(inp.as_str(), i);
            }
        }
        Stepper {
            ckpt,
            opts,
            a: p.first,
            capture,
            last_use,
            shared,
            maps: Default::default(),
            records: Vec::new(),
            captured: Vec::new(),
            // carry divergent ops' errors to the model's output when the run reaches it
            tracker: consequence::Tracker::new(
                p.ops.iter().any(super::is_head) && p.chunk.is_none_or(|c| c >= opts.tokens.len()),
            ),
            outputs: BTreeMap::new(),
            queued: None,
            prof: BTreeMap::new(),
        }
    }

    /// Completes a queued record (its metrics read back) and follows a divergent op's error.
    pub fn finish(&mut self, q: Queued) -> Result<()> {
        let op = q.record.op.clone();
        let r = op_record_finish(self.ckpt, self.opts, q.record)?;
        if r.divergent {
            if let Some(c) = q.capture {
                if self.captured.len() < MAX_CAPTURES {
                    self.captured.push(c);
                }
            }
            self.tracker
                .finished(&r, &op, q.iso, self.maps[1].get(&op.id));
        }
        self.records.push(r);
        Ok(())
    }

    /// Runs op `step` on every path, records it when reported, and drops what no later op reads;
    /// `hooks` hear what the routers chose.
    pub fn step(&mut self, step: usize, op: &'a Op, hooks: &dyn RunHooks) -> Result<()> {
        let r = self.step_paths(step, op, hooks);
        if r.is_err() {
            // what a failed op left deferred is dropped, so the device state can run again
            self.shared.cancel_op();
        }
        r
    }

    fn step_paths(&mut self, step: usize, op: &'a Op, hooks: &dyn RunHooks) -> Result<()> {
        let opts = self.opts;
        let report = op.layer.is_none_or(|l| l >= self.a) && opts.spec.selects(&op.id);
        let Execs {
            outs,
            iso,
            fp_on_bf,
            touched,
            observed,
            per_expert,
        } = execs(
            &mut self.shared,
            op,
            &self.maps,
            report,
            opts.experts,
            |outs| hooks.routed(step, outs),
        )?;
        if report {
            let t_m = Instant::now();
            let mut p =
                op_record_begin(opts, step, op, &outs, &iso, &fp_on_bf, &touched, &observed)?;
            p.per_expert = per_expert.map(|rows| {
                let mut a = super::experts::PerExpert::default();
                a.add_rows(&rows);
                a
            });
            // what bisect would start from, should this op diverge
            let cand =
                (self.capture && self.captured.len() < MAX_CAPTURES).then(|| replay::Capture {
                    op: op.clone(),
                    inputs: op
                        .inputs
                        .iter()
                        .map(|id| self.maps[1][id].clone())
                        .collect(),
                    oracle_bf16: outs[1].clone(),
                });
            // the previous op's record: its metrics were queued before this op's work,
            // so waiting for them leaves the device busy
            let q = Queued {
                record: p,
                capture: cand,
                iso: iso.clone(),
            };
            if let Some(q) = self.queued.replace(q) {
                self.finish(q)?;
            }
            *self.prof.entry("(metrics)".into()).or_default() += t_m.elapsed().as_secs_f64();
            if opts.keep_outputs {
                let ratio = compressed_ratio(&self.shared.cfg, op);
                let t = opts.tokens.len();
                let whole = ChunkAt {
                    start: 0,
                    end: t,
                    total: t,
                };
                for (name, ts) in [
                    ("oracle_fp32", &outs[0]),
                    ("oracle_bf16", &outs[1]),
                    ("served", &outs[2]),
                    ("served_isolated", &iso),
                ] {
                    let e = self.outputs.entry(name.to_string()).or_default();
                    for (id, t) in op.outputs.iter().zip(ts.iter()) {
                        let kept = match &opts.keep_rows {
                            Some(rows) => kept_rows(t, rows, whole, ratio),
                            None => t.clone(),
                        };
                        e.push((id.clone(), kept));
                    }
                }
            }
        }
        if !report {
            // the last record is needed now: this op may consume its output
            if let Some(q) = self.queued.take() {
                self.finish(q)?;
            }
        }
        // an op that reads a divergent op's output: what does it make of the error?
        if self.tracker.consumes_faulty(op) {
            let _s = crate::profile::span("exec: consequence");
            self.tracker
                .consumer(op, &self.maps[1], &outs[1], &mut self.shared)?;
        }
        let _s = crate::profile::span("runner: clear + bookkeeping");
        self.shared.clear();
        keep_outputs(op, outs, &mut self.maps)?;
        // drop tensors nothing later consumes
        for m in self.maps.iter_mut() {
            m.retain(|id, _| self.last_use.get(id.as_str()).is_some_and(|&l| l > step));
        }
        self.tracker.retire(&self.last_use, step);
        // a device → host read that failed inside `Data` (values read as NaN) ends the run
        if let Some(e) = crate::tensor::take_device_error() {
            return Err(Error::Backend(format!("op {}: {e}", op.id)));
        }
        Ok(())
    }
}

/// Put each path's outputs of `op` into its map under the op's output ids.
pub(super) fn keep_outputs(
    op: &Op,
    outs: Vec<Vec<Tensor>>,
    maps: &mut [HashMap<String, Tensor>; 3],
) -> Result<()> {
    for (pi, out) in outs.into_iter().enumerate() {
        if out.len() != op.outputs.len() {
            return Err(Error::usage(format!(
                "internal: op {} returned {} outputs for {} ids",
                op.id,
                out.len(),
                op.outputs.len()
            )));
        }
        for (id, t) in op.outputs.iter().zip(out) {
            maps[pi].insert(id.clone(), t);
        }
    }
    Ok(())
}

/// `op` on `inputs` in `kind`'s numerics, as execution `slot` (whose token-chunk carry it keeps:
/// `Shared::carry_slot`), timed as `span`.
fn exec_as(
    shared: &mut Shared,
    op: &Op,
    inputs: &[&Tensor],
    kind: PathKind,
    slot: usize,
    span: &'static str,
) -> Result<Vec<Tensor>> {
    shared.carry_slot = slot;
    let mut env = PathEnv { kind, shared };
    let _s = crate::profile::span(span);
    super::prefill::exec(op, inputs, &mut env)
}

/// What one op's executions made: every propagated path's outputs, and for a reported op the
/// served op on the BF16 oracle's inputs (`iso`) and the FP32 numerics on them (`fp_on_bf`),
/// with what its served linears read (`touched`) and saw (`observed`).
pub(super) struct Execs {
    pub outs: Vec<Vec<Tensor>>,
    pub iso: Vec<Tensor>,
    pub fp_on_bf: Vec<Tensor>,
    pub touched: Vec<String>,
    pub observed: Vec<(String, crate::served::LinearObs)>,
    /// A routed-experts op's experts one by one (reported ops, unless switched off).
    pub per_expert: Option<super::experts::ExpertRows>,
}

/// Runs `op` on every path (inputs from `maps`, one per path), tells `routed` what the paths
/// made, then, when `report`, the isolated and noise executions. Each execution keeps its own
/// token-chunk carry (`Shared::carry_slot`).
pub(super) fn execs(
    shared: &mut Shared,
    op: &Op,
    maps: &[HashMap<String, Tensor>; 3],
    report: bool,
    experts: super::experts::ExpertMetrics,
    routed: impl FnOnce(&[Vec<Tensor>]),
) -> Result<Execs> {
    // the linears' hook: an op's weights preloaded in one batch, or a routed-experts op
    // deferred (every path's op, the isolated and FP32-on-BF16 ones included, only begins
    // here; the flush below runs them)
    let deferred = shared.begin_op(op)?;
    fn inputs_of<'m>(op: &Op, m: &'m HashMap<String, Tensor>) -> Result<Vec<&'m Tensor>> {
        op.inputs
            .iter()
            .map(|id| {
                m.get(id).ok_or_else(|| {
                    Error::usage(format!("internal: op {} input {id} not computed", op.id))
                })
            })
            .collect()
    }
    // the oracles' products on BF16-stored weights fed the BF16 oracle's inputs are made once
    // for the op (`env::OracleProducts`)
    let bf_inputs = inputs_of(op, &maps[1])?;
    shared.keep_products(&bf_inputs);
    let mut outs: Vec<Vec<Tensor>> = Vec::with_capacity(3);
    for (pi, kind) in PathKind::ALL.iter().enumerate() {
        let inputs = inputs_of(op, &maps[pi])?;
        shared.record_observations = *kind == PathKind::Served && report;
        let span = match kind {
            PathKind::OracleFp32 => "exec: oracle_fp32",
            PathKind::OracleBf16 => "exec: oracle_bf16",
            PathKind::Served => "exec: served",
        };
        outs.push(exec_as(shared, op, &inputs, *kind, pi, span)?);
    }
    shared.record_observations = false;
    routed(&outs);
    let touched = shared.touched.clone();
    let mut observed = std::mem::take(&mut shared.observed);
    if !report {
        shared.drop_products();
        if deferred {
            shared.flush_experts()?;
        }
        return Ok(Execs {
            outs,
            iso: Vec::new(),
            fp_on_bf: Vec::new(),
            touched,
            observed,
            per_expert: None,
        });
    }
    // the served numerics differ from the BF16 oracle's where a weight is quantized, and
    // where the engine's chunked prefill changes the op (`--served-chunk`)
    let quantized = touched.iter().any(|t| shared.is_quantized(t))
        || crate::served::faults::layer_fault_at(&shared.faults, &op.id)
        || shared
            .prefill
            .as_ref()
            .is_some_and(|p| super::prefill::splits(op, p));
    let iso: Vec<Tensor> = if quantized {
        let span = "exec: served isolated";
        exec_as(shared, op, &bf_inputs, PathKind::Served, 3, span)?
    } else {
        outs[1].clone()
    };
    // the op's own noise: FP32 numerics fed the same (BF16-oracle) inputs as the BF16 oracle
    let span = "exec: fp32 on bf16 inputs";
    let fp_on_bf = exec_as(shared, op, &bf_inputs, PathKind::OracleFp32, 4, span)?;
    shared.drop_products();
    if deferred {
        shared.flush_experts()?;
        observed.append(&mut shared.observed);
    }
    // each routed expert on its own rows, served vs the BF16 oracle (on the oracle's inputs)
    let per_expert = {
        let _s = crate::profile::span("exec: experts one by one");
        super::experts::measure(shared, op, &bf_inputs, experts)?
    };
    Ok(Execs {
        outs,
        iso,
        fp_on_bf,
        touched,
        observed,
        per_expert,
    })
}

/// Tokens per compressed row of a compressor op's output (None for every other op).
pub(super) fn compressed_ratio(cfg: &crate::model::ModelConfig, op: &Op) -> Option<usize> {
    let l = op.layer?;
    (op.kind == crate::model::graph::OpKind::Compressor)
        .then(|| cfg.ratio(l))
        .filter(|&r| r > 0)
}

/// What `--dump-rows` keeps of an op's output over the tokens `at` (the whole prompt, or one of
/// a run's token chunks): a token-major output ([end − start, …]) the rows among `rows` (prompt
/// token indices) inside [start, end), in order; a compressor's output (`ratio` given; its rows
/// are the compressed rows from start / ratio on) the compressed rows that cover those tokens
/// (row `j / ratio` for token j), ascending; anything else whole. A run's chunks' pieces join
/// into the whole prompt's.
pub fn kept_rows(x: &Tensor, rows: &[usize], at: ChunkAt, ratio: Option<usize>) -> Tensor {
    let n = x.shape.first().copied().unwrap_or(0);
    let pick: Vec<usize> = if let Some(r) = ratio {
        let b0 = at.start / r;
        let mut v: Vec<usize> = rows
            .iter()
            .map(|j| j / r)
            .filter(|&c| c >= b0 && c < b0 + n)
            .map(|c| c - b0)
            .collect();
        v.dedup();
        v
    } else if n == at.end - at.start {
        rows.iter()
            .filter(|&&j| j >= at.start && j < at.end)
            .map(|j| j - at.start)
            .collect()
    } else {
        return x.clone();
    };
    let w = x.numel() / n.max(1);
    let data: Vec<f32> = pick
        .iter()
        .flat_map(|&i| x.data[i * w..(i + 1) * w].iter().copied())
        .collect();
    let mut shape = x.shape.clone();
    shape[0] = pick.len();
    Tensor::new(shape, data)
}
