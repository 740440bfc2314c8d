//! The runner's stages, in the order `run_capturing` calls them: [`plan`] (the request checked
//! against the model and the memory budget, the op graph), [`start_loader`] (the device loader
//! and its plan), [`Stepper::step`] for every op (the three paths, the isolated and noise
//! executions, the record, what consumers make of a divergent op's error), [`stop_loader`],
//! and [`print_profile`] (`NVFP4_PROBE_PROFILE=1`).

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use super::env::{PathEnv, Shared};
use super::{
    budget, consequence, op_record_begin, op_record_finish, plan_of, publish_routing,
    reads_nothing, replay, stage_groups, CancelDeferred, OpRecord, Queued, RunOptions,
    MAX_CAPTURES,
};
use crate::checkpoint::Checkpoint;
use crate::model::exec::exec;
use crate::model::graph::{build_graph, Op, OpKind};
use crate::model::layers::LayerRange;
use crate::model::ModelConfig;
use crate::served::PathKind;
use crate::{Error, Result, Tensor};

/// What a run computes: its layers, whether it ends with the head, and the op graph.
pub(super) struct Plan {
    pub first: usize,
    pub cfg: ModelConfig,
    pub ops: Vec<Op>,
    /// Query tokens per attention call (`--chunk`, or chosen from `--mem-gib`).
    pub chunk: Option<usize>,
}

/// Checks the request (layers, tokens, the memory estimate) before anything of the run's size is
/// allocated, then builds the op graph.
pub(super) fn plan(ckpt: &Checkpoint, opts: &RunOptions) -> Result<Plan> {
    let cfg = ckpt.model_config()?.clone();
    if let (Some(why), Some(_)) = (
        crate::model::family::cuda_unsupported(&cfg),
        opts.backend.gpu(),
    ) {
        return Err(Error::usage(format!("cuda backend: {why}")));
    }
    let (a, b) = LayerRange::new(opts.layers.0, opts.layers.1).check(cfg.num_hidden_layers)?;
    super::scan::check_tokens(ckpt, opts)?;
    let with_head = b + 1 == cfg.num_hidden_layers && ckpt.resolve("head.weight").is_some();
    // nothing of the run's size is allocated before its estimate fits (`budget`)
    budget::check(
        &cfg,
        &budget::Plan {
            layers: (a, b),
            tokens: opts.tokens.len() as u64,
            keep_outputs: opts.keep_outputs,
            with_head,
            layer_states: false,
            device: opts.backend.gpu().is_some(),
        },
        opts.max_mem,
        opts.backend.gpu(),
        "this run",
    )?;
    let chunk = budget::chunk_rows(&cfg, opts.tokens.len(), opts.chunk, opts.mem_gib)?;
    let ops = build_graph(&cfg, b, with_head);
    crate::profile::mark("runner: graph built");
    Ok(Plan {
        first: a,
        cfg,
        ops,
        chunk,
    })
}

/// The device loader (CUDA only; `NVFP4_PROBE_STAGE=0` switches it off) and its plan: the
/// weights each op stages, made here (in parallel: a few ms) so that it starts reading at once.
pub(super) struct Loader {
    pub stager: Option<std::sync::Arc<crate::backend::stage::Stager>>,
    pub plan: Vec<Vec<crate::backend::stage::StageGroup>>,
}

pub(super) fn start_loader(ckpt: &Checkpoint, opts: &RunOptions, p: &Plan) -> Result<Loader> {
    let stager = match opts.backend.gpu() {
        Some(g) if crate::backend::stage::Stager::enabled() => {
            let mut g = g
                .lock()
                .map_err(|_| Error::Backend("cuda: device state poisoned".into()))?;
            // the loader reads through the device state's large pinned buffers (pinning new
            // ones would stall this thread's driver calls at the start of the run)
            let lent = g.lend_pinned()?;
            let s = crate::backend::stage::Stager::new(g.ctx.clone(), g.stream.clone(), lent);
            g.stager = Some(s.clone());
            Some(s)
        }
        _ => None,
    };
    let t_len = opts.tokens.len();
    let plan = match &stager {
        Some(_) => plan_of(&p.ops, |op| {
            if reads_nothing(&p.cfg, op, t_len) {
                Vec::new()
            } else {
                stage_groups(ckpt, op)
            }
        }),
        None => Vec::new(),
    };
    crate::profile::mark("runner: loader set up");
    Ok(Loader { stager, plan })
}

/// Ends the loader (its thread has been joined) and gives the device back its pinned buffers.
pub(super) fn stop_loader(
    opts: &RunOptions,
    stager: Option<std::sync::Arc<crate::backend::stage::Stager>>,
) -> Option<crate::backend::stage::StageStats> {
    stager.map(|st| {
        if let Some(g) = opts.backend.gpu() {
            if let Ok(mut g) = g.lock() {
                g.stager = None;
                // the loader thread has ended (the scope joined it) and synchronized its copies
                let _ = g.unlend_pinned();
            }
        }
        st.shutdown();
        st.stats()
    })
}

/// The state of a run between ops: the three paths' live tensors, the records, the captures for
/// bisect and the consequence tracker.
pub(super) struct Stepper<'a> {
    pub ckpt: &'a Checkpoint,
    pub opts: &'a RunOptions,
    pub ops: &'a [Op],
    /// The first reported layer (earlier layers run unreported).
    pub a: usize,
    /// Keep the BF16 oracle's view of divergent ops (bisect).
    pub capture: bool,
    /// The page-cache prefetcher follows the routing (CUDA).
    pub reads_ahead: bool,
    /// Experts op step → the experts any path routed to (published after the router's step).
    pub routed: &'a std::sync::Mutex<HashMap<usize, Vec<bool>>>,
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
        routed: &'a std::sync::Mutex<HashMap<usize, Vec<bool>>>,
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
            ops: &p.ops,
            a: p.first,
            capture,
            reads_ahead: opts.backend.gpu().is_some(),
            routed,
            last_use,
            shared,
            maps: Default::default(),
            records: Vec::new(),
            captured: Vec::new(),
            tracker: consequence::Tracker::default(),
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

    /// Runs op `step` on every path, records it when reported, and drops what no later op reads.
    pub fn step(&mut self, step: usize, op: &'a Op) -> Result<()> {
        let opts = self.opts;
        let report = op.layer.is_none_or(|l| l >= self.a) && opts.spec.selects(&op.id);
        // an op made of linears: its weights in one parallel read and one copy per batch
        // (routed experts load themselves once routed)
        if matches!(
            op.kind,
            OpKind::Linear | OpKind::GroupedLinear | OpKind::SharedExpert
        ) {
            if let Some(g) = opts.backend.gpu() {
                let bases: Vec<&str> = op.weights.iter().map(String::as_str).collect();
                g.lock()
                    .map_err(|_| Error::Backend("cuda: device state poisoned".into()))?
                    .preload(self.ckpt, &bases)?;
            }
        }
        // a routed-experts op on the device: every path's op (and the isolated and
        // FP32-on-BF16 ones) only begins here; the flush below runs them interleaved,
        // chunk by chunk of experts as the loader brings them (`cuda::experts`)
        let deferred = op.kind == OpKind::Experts
            && match opts.backend.gpu() {
                Some(g) => g
                    .lock()
                    .map_err(|_| Error::Backend("cuda: device state poisoned".into()))?
                    .defer_experts(),
                None => false,
            };
        let _cancel = deferred.then(|| CancelDeferred(opts.backend.gpu()));
        let mut outs: Vec<Vec<Tensor>> = Vec::with_capacity(3);
        for (pi, kind) in PathKind::ALL.iter().enumerate() {
            let inputs: Vec<&Tensor> = op
                .inputs
                .iter()
                .map(|id| {
                    self.maps[pi].get(id).ok_or_else(|| {
                        Error::usage(format!("internal: op {} input {id} not computed", op.id))
                    })
                })
                .collect::<Result<_>>()?;
            self.shared.record_observations = *kind == PathKind::Served && report;
            let mut env = PathEnv {
                kind: *kind,
                shared: &mut self.shared,
            };
            let _s = crate::profile::span(match kind {
                PathKind::OracleFp32 => "exec: oracle_fp32",
                PathKind::OracleBf16 => "exec: oracle_bf16",
                PathKind::Served => "exec: served",
            });
            outs.push(exec(op, &inputs, &mut env)?);
        }
        self.shared.record_observations = false;
        if self.reads_ahead && op.kind == OpKind::Router {
            publish_routing(self.ops, step, &outs, self.routed);
        }
        let touched = self.shared.touched.clone();
        let mut observed = std::mem::take(&mut self.shared.observed);
        if report {
            let quantized = touched.iter().any(|t| self.shared.is_quantized(t));
            let iso: Vec<Tensor> = if quantized {
                let inputs: Vec<&Tensor> = op.inputs.iter().map(|id| &self.maps[1][id]).collect();
                let mut env = PathEnv {
                    kind: PathKind::Served,
                    shared: &mut self.shared,
                };
                let _s = crate::profile::span("exec: served isolated");
                exec(op, &inputs, &mut env)?
            } else {
                outs[1].clone()
            };
            // the op's own noise: FP32 numerics fed the same (BF16-oracle) inputs as the BF16 oracle
            let fp_on_bf: Vec<Tensor> = {
                let inputs: Vec<&Tensor> = op.inputs.iter().map(|id| &self.maps[1][id]).collect();
                let mut env = PathEnv {
                    kind: PathKind::OracleFp32,
                    shared: &mut self.shared,
                };
                let _s = crate::profile::span("exec: fp32 on bf16 inputs");
                exec(op, &inputs, &mut env)?
            };
            if deferred {
                self.shared.flush_experts()?;
                observed.append(&mut self.shared.observed);
            }
            let t_m = Instant::now();
            let p = op_record_begin(opts, step, op, &outs, &iso, &fp_on_bf, &touched, &observed)?;
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
                for (name, ts) in [
                    ("oracle_fp32", &outs[0]),
                    ("oracle_bf16", &outs[1]),
                    ("served", &outs[2]),
                    ("served_isolated", &iso),
                ] {
                    let e = self.outputs.entry(name.to_string()).or_default();
                    for (id, t) in op.outputs.iter().zip(ts.iter()) {
                        e.push((id.clone(), t.clone()));
                    }
                }
            }
        }
        if deferred && !report {
            self.shared.flush_experts()?;
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
        for (pi, out) in outs.into_iter().enumerate() {
            if out.len() != op.outputs.len() {
                return Err(Error::usage(format!(
                    "internal: op {} returned {} self.outputs for {} ids",
                    op.id,
                    out.len(),
                    op.outputs.len()
                )));
            }
            for (id, t) in op.outputs.iter().zip(out) {
                self.maps[pi].insert(id.clone(), t);
            }
        }
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
