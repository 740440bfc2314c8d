//! The run hooks: what a run tells its backend as it goes, and what the backend does around the
//! runner's ops. [`Backend::run_with`](super::Backend::run_with) begins a run, hands the runner a
//! [`RunHooks`] to say which op it is at (`before_op`) and what each router chose (`routed`), and
//! ends the run when the runner returns. On CUDA the beginning starts the loader thread, which
//! stages the coming ops' weights on the device through the device state's pinned buffers and its
//! own copy stream (`stage`), and the page-cache prefetcher (`readahead`); the end joins both,
//! gives the pinned buffers back and, with `NVFP4_PROBE_PROFILE=1`, prints the device's profile.
//! Per op, the linears' own hooks (`served::Linears::begin_op`, `cancel_op`) preload an op's
//! weights and defer the routed experts. The CPU backend has no hooks: its runs are
//! compute-bound.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use super::cuda::Gpu;
use super::readahead::{by_expert, plan_of, prefetch_groups, prefetch_loop, PREFETCH_AHEAD};
use super::stage::{StageGroup, StageStats, Stager};
use crate::checkpoint::Checkpoint;
use crate::model::graph::{experts_fed_by, reads_nothing, Op, OpKind};
use crate::model::ModelConfig;
use crate::{Result, Tensor};

/// What a run is over: the checkpoint, the model, the op graph and the prompt's token ids.
pub struct RunPlan<'a> {
    pub ckpt: &'a Checkpoint,
    pub cfg: &'a ModelConfig,
    pub ops: &'a [Op],
    pub tokens: &'a [u32],
}

/// What the runner tells its backend during a run.
pub trait RunHooks: Sync {
    /// The runner begins op `step` (the loader and the prefetcher work ahead of it).
    fn before_op(&self, step: usize);
    /// The op at `step` has run on every path, `outs` its outputs per path: a router's choice
    /// tells the loader which experts the coming experts op reads.
    fn routed(&self, step: usize, outs: &[Vec<Tensor>]);
}

/// The CPU backend's hooks: nothing to do.
pub(super) struct NoHooks;

impl RunHooks for NoHooks {
    fn before_op(&self, _: usize) {}
    fn routed(&self, _: usize, _: &[Vec<Tensor>]) {}
}

/// Where the runner is and what the routers chose, shared with the loader and the prefetcher.
struct Follow<'a> {
    ops: &'a [Op],
    at: AtomicUsize,
    done: AtomicBool,
    /// Experts op step → the experts any path routed to.
    routed: Mutex<HashMap<usize, Vec<bool>>>,
}

impl RunHooks for Follow<'_> {
    fn before_op(&self, step: usize) {
        self.at.store(step, Relaxed);
    }
    fn routed(&self, step: usize, outs: &[Vec<Tensor>]) {
        if self.ops[step].kind == OpKind::Router {
            publish_routing(self.ops, step, outs, &self.routed);
        }
    }
}

/// A run on the device: the loader and the prefetcher run beside `body` (the runner) and are
/// joined before this returns, whatever `body` returns.
pub(super) fn run_cuda<R>(
    g: &Arc<Mutex<Gpu>>,
    p: &RunPlan,
    body: impl FnOnce(&dyn RunHooks) -> Result<R>,
) -> Result<R> {
    let follow = Follow {
        ops: p.ops,
        at: AtomicUsize::new(0),
        done: AtomicBool::new(false),
        routed: Mutex::new(HashMap::new()),
    };
    let (stager, stage_plan) = start_loader(g, p)?;
    let r = std::thread::scope(|sc| {
        let f = &follow;
        if let Some(stager) = &stager {
            let stage_plan = &stage_plan;
            sc.spawn(move || {
                // hash-routed layers: their experts are known from the token ids alone; score-
                // routed layers whose prompt routes to nearly every expert: all of them, until
                // their router says which (its choice then replaces this guess)
                let known = hash_routing(p.ckpt, p.cfg, p.ops, p.tokens);
                let guessed = likely_routing(p.cfg, p.ops, p.tokens.len());
                if let Ok(mut m) = f.routed.lock() {
                    for (target, used) in known.into_iter().chain(guessed) {
                        m.entry(target).or_insert(used);
                    }
                }
                super::stage::run_loader(stager, p.ckpt, stage_plan, &f.routed, &f.at, &f.done)
            });
        }
        sc.spawn(move || {
            // its plan is made here, off the runner's path (15 ms for V4-Flash's five layers on
            // the H200, in parallel): it matters when the page cache is cold
            let t_len = p.tokens.len();
            let plan = plan_of(p.ops, |op| {
                if reads_nothing(p.cfg, op, t_len) {
                    Vec::new()
                } else {
                    prefetch_groups(p.ckpt, op)
                }
            });
            prefetch_loop(p.ckpt, &plan, &f.routed, &f.at, &f.done, PREFETCH_AHEAD)
        });
        let r = body(f);
        f.done.store(true, Relaxed);
        r
    });
    let stats = stop_loader(g, stager);
    crate::profile::mark("runner: loader and prefetcher joined");
    if crate::profile::enabled() {
        print_profile(g, p.ops, stats.as_ref());
    }
    r
}

/// The loader, if it runs, and the weights it stages per op step.
type LoaderPlan = (Option<Arc<Stager>>, Vec<Vec<StageGroup>>);

/// The loader (`NVFP4_PROBE_STAGE=0` switches it off) and its plan: the weights each op stages,
/// made here (in parallel: a few ms) so that it starts reading at once.
fn start_loader(g: &Arc<Mutex<Gpu>>, p: &RunPlan) -> Result<LoaderPlan> {
    if !Stager::enabled() {
        return Ok((None, Vec::new()));
    }
    let stager = {
        let mut g = super::linears::lock(g)?;
        // the loader reads through the device state's large pinned buffers (pinning new ones
        // would stall this thread's driver calls at the start of the run)
        let lent = g.lend_pinned()?;
        let s = Stager::new(g.ctx.clone(), g.stream.clone(), lent);
        g.stager = Some(s.clone());
        s
    };
    let t_len = p.tokens.len();
    let plan = plan_of(p.ops, |op| {
        if reads_nothing(p.cfg, op, t_len) {
            Vec::new()
        } else {
            stage_groups(p.ckpt, op)
        }
    });
    crate::profile::mark("runner: loader set up");
    Ok((Some(stager), plan))
}

/// Ends the loader (its thread has been joined) and gives the device back its pinned buffers.
fn stop_loader(g: &Arc<Mutex<Gpu>>, stager: Option<Arc<Stager>>) -> Option<StageStats> {
    stager.map(|st| {
        if let Ok(mut g) = g.lock() {
            g.stager = None;
            // the loader thread has ended (the scope joined it) and synchronized its copies
            let _ = g.unlend_pinned();
        }
        st.shutdown();
        st.stats()
    })
}

/// The weights an op uploads, for the loader: one group per routed expert, one for the rest.
pub fn stage_groups(ckpt: &Checkpoint, op: &Op) -> Vec<StageGroup> {
    by_expert(op, |ws| {
        ws.iter().flat_map(|w| Gpu::staged_spans(ckpt, w)).collect()
    })
    .into_iter()
    .map(|(expert, spans)| StageGroup { expert, spans })
    .collect()
}

/// The experts op each hash-routed layer's router feeds, with the experts its table gives the
/// run's tokens (known before the run: the table and the token ids are all it depends on).
/// Tables that do not fit are left out (the router reports them; the loader then just waits).
pub fn hash_routing(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    ops: &[Op],
    tokens: &[u32],
) -> Vec<(usize, Vec<bool>)> {
    let k = cfg.num_experts_per_tok;
    let mut out = Vec::new();
    for (step, op) in ops.iter().enumerate() {
        if op.kind != OpKind::Router || !op.layer.is_some_and(|l| cfg.is_hash_layer(l)) {
            continue;
        }
        let (Some((target, n)), Some(name)) = (fed_experts(ops, step), op.weights.get(1)) else {
            continue;
        };
        // only the prompt's rows of the table
        let Ok(table) = ckpt.tensor_rows(name, tokens, "a routing table") else {
            continue;
        };
        if table.cols() != k || k == 0 {
            continue;
        }
        let mut used = vec![false; n];
        mark_used(&mut used, &table.data);
        out.push((target, used));
    }
    out
}

/// The experts op router `step` feeds (the op reading its `idx` output) and its number of
/// experts (three weights each).
fn fed_experts(ops: &[Op], step: usize) -> Option<(usize, usize)> {
    let target = experts_fed_by(ops, step)?;
    Some((target, ops[target].weights.len() / 3))
}

/// Mark the experts that router ids (as f32 values) name; other values are left out.
fn mark_used(used: &mut [bool], ids: &[f32]) {
    for &v in ids {
        if v.is_finite() && v >= 0.0 && (v as usize) < used.len() {
            used[v as usize] = true;
        }
    }
}

/// The share of experts a score-routed layer's prompt is expected to reach at least, from which
/// the loader reads all of them without waiting for the router (`likely_routing`).
pub const ROUTE_GUESS_COVERAGE: f64 = 0.95;

/// The experts ops of score-routed layers whose `t` tokens, `k` experts each out of `n`, are
/// expected to reach at least [`ROUTE_GUESS_COVERAGE`] of the experts (1 − (1 − k/n)^t, the
/// share an expert is missed by t independent choices), each with every expert marked used. The
/// loader then streams those experts while the layer's attention runs instead of idling until
/// the router's choice is known; the choice, once published, replaces the guess, and what was
/// read for an expert nobody chose is at most 1/0.95 of the experts' bytes needed. Off with
/// `NVFP4_PROBE_ROUTE_GUESS=0`.
pub fn likely_routing(cfg: &ModelConfig, ops: &[Op], t: usize) -> Vec<(usize, Vec<bool>)> {
    if std::env::var("NVFP4_PROBE_ROUTE_GUESS").ok().as_deref() == Some("0") {
        return Vec::new();
    }
    let k = cfg.num_experts_per_tok;
    let mut out = Vec::new();
    for (step, op) in ops.iter().enumerate() {
        if op.kind != OpKind::Router || op.layer.is_some_and(|l| cfg.is_hash_layer(l)) {
            continue;
        }
        let Some((target, n)) = fed_experts(ops, step) else {
            continue;
        };
        if n == 0 || k == 0 || k > n {
            continue;
        }
        let missed = (1.0 - k as f64 / n as f64).powf(t as f64);
        if 1.0 - missed >= ROUTE_GUESS_COVERAGE {
            out.push((target, vec![true; n]));
        }
    }
    out
}

/// After the router's step: the experts op that consumes its choice (the op reading its `idx`
/// output) gets the union of the experts every path chose.
fn publish_routing(
    ops: &[Op],
    step: usize,
    outs: &[Vec<Tensor>],
    routed: &Mutex<HashMap<usize, Vec<bool>>>,
) {
    let Some((target, n)) = fed_experts(ops, step) else {
        return;
    };
    let mut used = vec![false; n];
    for path in outs {
        if let Some(t) = path.get(1) {
            mark_used(&mut used, &t.data);
        }
    }
    if let Ok(mut m) = routed.lock() {
        m.insert(target, used);
    }
}

/// The run's physical floors, on stderr: its GEMM-class work (`Gpu::work`) at the device's f64
/// GEMM rate and the bytes it uploaded at the pinned host → device rate, both rates measured
/// now (a DGEMM of 4096³, the staging buffer's copy).
fn print_floors(g: &mut Gpu) {
    let (rate, rate32, h2d) = match (g.dgemm_rate(4096), g.sgemm_rate(4096), g.pinned_h2d_rate()) {
        (Ok(r), Ok(r32), Ok(h)) => (r, r32, h),
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
            eprintln!("floors: not measured ({e})");
            return;
        }
    };
    let w = &g.work;
    let tf = |v: f64| v / 1e12;
    let bytes = g.counters.bytes_uploaded as f64;
    eprintln!(
        "floors: GEMM-class work {:.3} TFLOP (exact f64 GEMMs {:.3}, routed experts {:.3}, attention {:.3}, indexer scores {:.3}, FP32/BF16 GEMMs {:.3}) at the measured FP64 DGEMM rate {:.1} TFLOP/s = {:.3} s (at the FP32 SGEMM rate {:.1} TFLOP/s: {:.3} s); host→device {:.2} GB uploaded at the measured pinned rate {:.1} GB/s = {:.3} s",
        tf(w.total()),
        tf(w.dgemm.get()),
        tf(w.experts.get()),
        tf(w.attention.get()),
        tf(w.indexer.get()),
        tf(w.native.get()),
        rate / 1e12,
        w.total() / rate,
        rate32 / 1e12,
        w.total() / rate32,
        bytes / 1e9,
        h2d / 1e9,
        bytes / h2d
    );
}

/// `NVFP4_PROBE_PROFILE=1`: the device's counters, the loader's statistics and the device time
/// per op kind, per slow step and per kernel, on stderr.
fn print_profile(g: &Mutex<Gpu>, ops: &[Op], stage_stats: Option<&StageStats>) {
    if let Ok(mut g) = g.lock() {
        eprintln!(
            "gpu counters: {}",
            serde_json::to_string(&g.counters).unwrap_or_default()
        );
        if let Some(s) = stage_stats {
            let dropped: Vec<String> = s
                .dropped_at
                .iter()
                .map(|(step, b)| format!("{} {b}", ops.get(*step).map_or("?", |o| o.id.as_str())))
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
                .take(24)
                .map(|(k, n, s)| format!("{k} {s:.3} ({n})"))
                .collect();
            eprintln!(
                    "gpu device time (events around every launch and copy): kernels + cuBLAS {:.3} s, copies {:.3} s; by kernel (s, calls): {}",
                    sum(false),
                    sum(true),
                    top.join(", ")
                );
        }
        if let Some(idle) = g.idle_by_step() {
            let top: Vec<String> = idle
                .iter()
                .take(16)
                .map(|(step, n, s)| {
                    let id = ops.get(*step).map_or("?", |o| o.id.as_str());
                    format!("{id} {:.1} ms ({n})", s * 1e3)
                })
                .collect();
            eprintln!(
                "gpu idle between timed work: {:.3} s in {} gaps; by the op that ended them: {}",
                idle.iter().map(|x| x.2).sum::<f64>(),
                idle.iter().map(|x| x.1).sum::<u64>(),
                top.join(", ")
            );
        }
        // last: its own GEMMs and copies must not count as the run's (kernel times above)
        print_floors(&mut g);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::graph::build_graph;

    #[test]
    fn the_loader_guesses_every_expert_only_where_the_prompt_reaches_nearly_all() {
        // 8 experts, 2 per token; layer 0 hash-routed (its table says), 1 and 2 score-routed
        let cfg = ModelConfig::from_json(&serde_json::json!({
            "hidden_size": 256, "num_hidden_layers": 3, "vocab_size": 512,
            "num_attention_heads": 4, "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 128,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
            "num_hash_layers": 1, "compress_ratios": [0, 4, 128], "index_topk": 8
        }))
        .unwrap();
        let ops = build_graph(&cfg, 2, false);
        let step = |id: &str| ops.iter().position(|o| o.id == id).unwrap();
        // 10 tokens: each expert missed with probability (3/4)^10 = 5.6 %: below 95 % reached
        assert!(likely_routing(&cfg, &ops, 10).is_empty());
        // 11 tokens: (3/4)^11 = 4.2 % missed
        let g = likely_routing(&cfg, &ops, 11);
        let targets: Vec<usize> = g.iter().map(|x| x.0).collect();
        assert_eq!(targets, [step("L1.ffn.experts"), step("L2.ffn.experts")]);
        assert!(g
            .iter()
            .all(|(_, used)| used.len() == 8 && used.iter().all(|&u| u)));
    }
}
