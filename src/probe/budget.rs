//! What a run will need, estimated from the config, the layers and the token count alone, and
//! checked against what the machine offers — before anything is allocated.
//!
//! Why: a run's memory grows with tokens × activation width × numerics paths (the attention's
//! key sets are per-query lists and the indexer scores query blocks, so nothing grows with
//! tokens²). A request the
//! machine cannot hold used to end in an allocator abort or the OOM killer minutes in; now it is
//! refused up front (exit 2) with the estimate and the limit in the message, and `--max-mem GIB`
//! sets a budget below the detected limit (never above it: a budget beyond `RLIMIT_AS`, the
//! cgroup or `MemAvailable` would only trade the refusal for an allocator abort). The estimate is deliberately an upper
//! bound of the peak (every path's live tensors at once, the largest op's weights in all their
//! copies); it is checked against the tiny model's measured peaks in the tests.
//!
//! Available host memory is the least of /proc/meminfo's MemAvailable, the cgroup's limit minus
//! its usage (v2 and v1; reclaimable page cache counted as free) and RLIMIT_AS minus the address
//! space already mapped; on CUDA the token-dependent part (activations, attention, the DGEMM
//! attention's and indexer's blocks, the loader's staging cap) is checked against the device's
//! memory as well.

use crate::model::ModelConfig;
use crate::{Error, Result};

const GIB: f64 = (1u64 << 30) as f64;

/// What is about to run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Plan {
    /// Inclusive reported layers; layers before them run too.
    pub layers: (usize, usize),
    /// Number of tokens (u64: `--seq-len` is checked before any token is made).
    pub tokens: u64,
    /// Every reported op's outputs kept on every path (`--dump`, `compare`).
    pub keep_outputs: bool,
    /// Of the kept outputs, this many token rows (`--dump-rows`); None: all of them.
    pub kept_rows: Option<u64>,
    /// The runner includes the LM head (last layer requested and the checkpoint has one).
    pub with_head: bool,
    /// The state at every layer input kept for two paths (bisect's layer search).
    pub layer_states: bool,
    /// The numerics run on a CUDA device.
    pub device: bool,
    /// Tokens per chunk when each layer runs over the prompt a chunk at a time (`--chunk`);
    /// None: the whole prompt at once.
    pub chunk: Option<u64>,
}

/// The estimate, in bytes, by part.
#[derive(Clone, Debug, PartialEq)]
pub struct Estimate {
    pub activations: f64,
    pub attention: f64,
    pub weights: f64,
    pub kept: f64,
    pub graph: f64,
    /// Device bytes when `device` (activations, attention and the loader's staging cap).
    pub device: Option<f64>,
    /// CUDA backend only: host bytes of the pinned staging buffers and the rows read back from
    /// the device.
    pub host_rows: f64,
    /// Rough seconds on the CPU backend (f64 GEMMs and f64 attention on every path).
    pub cpu_seconds: f64,
}

/// The share of the host-side activation formula the CUDA backend holds on the device: its
/// paths keep fewer f32 copies of an op's operands than the CPU runner. Measured on the H200
/// (V4-Flash-dimension ModelOpt checkpoint, layers 0..4, BENCHMARKS.md session 20): device peak
/// 28.2 GB at 4,096 tokens and 68.2 GB at 16,384, a slope of 3.26 MiB per token where the formula
/// gives 9.7: 0.34, with a 25 % margin.
const DEVICE_ACTIVATIONS: f64 = 0.42;

/// Host bytes per token of the CUDA backend's runner (rows that host code reads back: routing,
/// the indexer's top-k, metrics), in residual-stream rows of f32: measured host peak RSS 11.95 GB
/// at 4,096 tokens, 11.98 GB at 16,384 and 16.2 GB at 65,536 (about 1.3 rows per token of
/// V4-Flash's 4 × 4096-wide stream); counted as 2.
const DEVICE_HOST_ROWS: f64 = 2.0;

impl Estimate {
    pub fn host(&self) -> f64 {
        if self.device.is_some() {
            // activations and the attention live on the device (counted in `device`); the host
            // holds the staged weights, the rows host code reads back and the graph
            return self.host_rows + self.weights + self.kept + self.graph;
        }
        self.activations + self.attention + self.weights + self.kept + self.graph
    }
    fn parts(&self) -> String {
        if self.device.is_some() {
            return format!(
                "staging and rows read back {}, weights {}, kept outputs {}, op graph {}",
                gib(self.host_rows),
                gib(self.weights),
                gib(self.kept),
                gib(self.graph)
            );
        }
        let mut v = vec![
            format!("activations {}", gib(self.activations)),
            format!("attention {}", gib(self.attention)),
            format!("weights {}", gib(self.weights)),
        ];
        if self.kept > 0.0 {
            v.push(format!("kept outputs {}", gib(self.kept)));
        }
        v.push(format!("op graph {}", gib(self.graph)));
        v.join(", ")
    }
}

/// Bytes as GiB for messages: three significant digits, and never "0 GiB" for a small need.
pub fn gib(b: f64) -> String {
    let g = b / GIB;
    if !g.is_finite() || g >= 1e6 {
        format!("{g:.3e} GiB")
    } else if g >= 100.0 {
        format!("{g:.0} GiB")
    } else if g >= 0.01 {
        format!("{g:.2} GiB")
    } else {
        format!("{g:.4} GiB")
    }
}

/// Per-op weight element counts of one layer (and the head), the largest first.
fn op_weights(cfg: &ModelConfig, layer: usize, tokens: f64, with_head: bool) -> Vec<f64> {
    let f = |x: usize| x as f64;
    let (d, h, dh) = (
        f(cfg.hidden_size),
        f(cfg.num_attention_heads),
        f(cfg.head_dim),
    );
    let (ql, ol, g) = (f(cfg.q_lora_rank), f(cfg.o_lora_rank), f(cfg.o_groups));
    let (e, k, i) = (
        f(cfg.n_routed_experts),
        f(cfg.num_experts_per_tok),
        f(cfg.moe_intermediate_size),
    );
    let ratio = cfg.compress_ratios.get(layer).copied().unwrap_or(0);
    let c = if ratio == 4 { 2.0 } else { 1.0 };
    let (hi, di) = (f(cfg.index_n_heads), f(cfg.index_head_dim));
    let mut v = vec![
        d * ql,
        d * dh,
        ql * h * dh,
        ol * h * dh,
        d * g * ol,
        e * d,
        e.min(tokens * k) * 3.0 * i * d,
        3.0 * i * d * f(cfg.n_shared_experts.max(1)),
    ];
    if ratio > 0 {
        v.push(2.0 * d * c * dh);
    }
    if ratio == 4 {
        v.push(ql * hi * di + d * hi + 2.0 * d * 2.0 * di);
    }
    if with_head {
        v.push(f(cfg.vocab_size) * d);
    }
    v.sort_by(|a, b| b.total_cmp(a));
    v
}

/// What a model family's attention carries from token chunk to token chunk on its five
/// executions (`model::family::ops`): the keys and values every later query still reaches —
/// all earlier rows, or a sliding layer's window — for the widest of the run's layers (one layer
/// runs at a time). MLA (DeepSeek-V3) carries its gathered per-head keys and values.
fn family_carry(
    cfg: &ModelConfig,
    fam: &crate::model::family::Family,
    t: f64,
    layers: usize,
) -> f64 {
    let (dq, dv) = (cfg.head_dim as f64, fam.v_head_dim as f64);
    let kv_heads = if fam.kind == crate::model::family::Kind::DeepseekV3 {
        cfg.num_attention_heads
    } else {
        fam.num_key_value_heads
    } as f64;
    (0..layers)
        .map(|l| {
            let keys = fam
                .window(cfg.sliding_window, l)
                .map_or(t, |w| (w as f64).min(t));
            5.0 * 4.0 * keys * kv_heads * (dq + dv)
        })
        .fold(0.0, f64::max)
}

/// The estimate for `plan` (see the module doc for what it counts).
pub fn estimate(cfg: &ModelConfig, plan: &Plan) -> Estimate {
    let f = |x: usize| x as f64;
    let t = plan.tokens as f64;
    // the rows an op runs over at once: a chunk's, or the prompt's
    let rows = plan.chunk.map_or(t, |c| (c as f64).min(t));
    let (a, b) = plan.layers;
    let run_layers = (b + 1).min(cfg.num_hidden_layers);
    let reported = (b + 1).saturating_sub(a).min(run_layers).max(1);
    let (d, hc, h, dh) = (
        f(cfg.hidden_size),
        f(cfg.hc_mult),
        f(cfg.num_attention_heads),
        f(cfg.head_dim),
    );
    let (ql, ol, g) = (f(cfg.q_lora_rank), f(cfg.o_lora_rank), f(cfg.o_groups));
    let (e, k, i) = (
        f(cfg.n_routed_experts),
        f(cfg.num_experts_per_tok),
        f(cfg.moe_intermediate_size),
    );
    let (hi, di, topk) = (
        f(cfg.index_n_heads),
        f(cfg.index_head_dim),
        f(cfg.index_topk),
    );
    let resid = hc * d;
    let q = h * dh;
    let ratios = &cfg.compress_ratios[..run_layers.min(cfg.compress_ratios.len())];
    let csa = ratios.contains(&4);
    // the widest tensor an op makes or reads, per token
    let mut wide = [resid, q, ql, g * ol, e, 2.0 * 2.0 * dh, k * i * 3.0]
        .into_iter()
        .fold(0.0, f64::max);
    if csa {
        wide = wide.max(hi * di).max(topk).max(2.0 * 2.0 * di);
    }
    if plan.with_head {
        wide = wide.max(f(cfg.vocab_size));
    }
    // live tensors per token on each of the three propagated paths (the layer input and what the
    // attention keeps alive until its last use), plus the op being run on five executions
    let live = 3.0 * resid + 3.0 * q + ql + 3.0 * d + 4.0 * dh + if csa { topk } else { 0.0 };
    let per_token = 3.0 * live + 5.0 * 3.0 * wide + 3.0 * hc * hc;
    // in chunks, the layers' outputs of every chunk so far wait on the host for the next layer
    // (the three paths' streams into the layer and out of it)
    let streams = if plan.chunk.is_some() {
        6.0 * t * resid * 4.0
    } else {
        0.0
    };
    let activations = rows * per_token * 4.0;

    // the attention's per-query key lists on CSA layers (i32 [t, topk]) and the indexer's
    // scores of one query block (`device::kern::score_block_rows`: at most 64 MiB, never
    // [t, n_c]) with the top-k ordering each thread keeps (8 bytes per causal row), one
    // execution at a time
    let threads = rayon::current_num_threads().max(1) as f64;
    let attention = ratios
        .iter()
        .filter(|&&r| r == 4)
        .map(|_| {
            let n_c = (t / 4.0).floor();
            let block = f(crate::device::kern::score_block_rows(n_c as usize)).min(rows);
            rows * topk * 4.0 + block * n_c * 4.0 + threads * n_c * 8.0
        })
        .fold(0.0, f64::max)
        // in chunks, what each of the five executions carries to the next chunk: every
        // compressed row so far (attention and indexer keys) and the window's last rows
        + if plan.chunk.is_none() {
            0.0
        } else if let Some(fam) = &cfg.family {
            family_carry(cfg, fam, t, run_layers)
        } else {
            let n_c = ratios
                .iter()
                .filter(|&&r| r > 0)
                .map(|&r| (t / r as f64).floor() * (dh + if r == 4 { di } else { 0.0 }))
                .sum::<f64>();
            5.0 * 4.0 * (n_c + f(cfg.sliding_window) * dh)
        };

    // weights: the CPU runner's cache holds an op's weights in three f32 copies (oracle, BF16,
    // served) up to its 4 GiB budget, plus the largest weight and its dequantization
    let largest_op: Vec<f64> = (0..run_layers.min(cfg.compress_ratios.len()))
        .map(|l| {
            let v = op_weights(cfg, l, t, plan.with_head && l + 1 == run_layers);
            v.first().copied().unwrap_or(0.0)
        })
        .collect();
    let largest = largest_op.iter().copied().fold(0.0, f64::max);
    let weights = if plan.device {
        // staged in the device state's pinned buffers, made when the backend opened
        largest * 1.0
    } else {
        (largest * 12.0).min(4.0 * GIB) + largest * 16.0
    };

    let kept = if plan.keep_outputs {
        // every op's outputs of a layer (hc streams, q, LoRA, KV, norms, experts), with room
        // for the vectors' spare capacity
        let per_layer =
            1.5 * (2.0 * resid + 3.0 * q + 2.0 * ql + 3.0 * dh + 8.0 * d + g * ol + topk + 2.0 * k);
        let head = if plan.with_head {
            f(cfg.vocab_size) + d + resid
        } else {
            0.0
        };
        let rows = plan.kept_rows.map_or(t, |r| (r as f64).min(t));
        4.0 * 4.0 * rows * (per_layer * reported as f64 + head)
    } else {
        0.0
    } + if plan.layer_states {
        2.0 * 4.0 * t * resid * run_layers as f64
    } else {
        0.0
    };

    // op ids, input ids and weight names: ~30 ops and 3 names per routed expert per layer
    let graph = run_layers as f64 * (3.0 * e * 96.0 + 64.0 * 1024.0);

    // CPU time: f64 GEMM flops on five executions per reported op (three per earlier op), plus
    // the f64 attention, at 4 GFLOP/s per thread (the tiny model runs at ~6 on one x86 core:
    // 5 layers × 1000 tokens took 25 CPU-seconds)
    let gemm_per_token: f64 = (0..run_layers.min(cfg.compress_ratios.len()))
        .map(|l| {
            let r = cfg.compress_ratios[l];
            let c = if r == 4 { 2.0 } else { 1.0 };
            let mut w =
                d * ql + d * dh + ql * q + ol * q + d * g * ol + e * d + (k + 1.0) * 3.0 * i * d;
            if r > 0 {
                w += 2.0 * d * c * dh;
            }
            if r == 4 {
                w += ql * hi * di + d * hi;
            }
            let keys = f(cfg.sliding_window).min(t)
                + if r == 4 {
                    topk.min(t / 4.0)
                } else if r > 0 {
                    t / r as f64
                } else {
                    0.0
                };
            let attn = 4.0 * h * dh * keys;
            let execs = if l >= a { 5.0 } else { 3.0 };
            execs * (2.0 * w + attn)
        })
        .sum();
    let cpu_seconds = t * gemm_per_token / (4.0e9 * threads);

    let stage = std::env::var("NVFP4_PROBE_STAGE_GIB")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|g| g.is_finite() && *g >= 0.0)
        .unwrap_or(8.0)
        * GIB;
    // in chunks a layer's weights stay on the device for all its chunks: its stored bytes (at
    // most one byte per element but for the BF16 ones)
    let held = if plan.chunk.is_some() {
        (0..run_layers.min(cfg.compress_ratios.len()))
            .map(|l| {
                op_weights(cfg, l, t, plan.with_head && l + 1 == run_layers)
                    .iter()
                    .sum::<f64>()
            })
            .fold(0.0, f64::max)
            * 1.1
    } else {
        0.0
    };
    // the batched-DGEMM attention's and indexer's blocks and f64 keys (backend/attn.rs): keys
    // per query, the window and the most compressed rows a layer's query reads
    let tokens = plan.tokens as usize;
    let max_keys = cfg.sliding_window
        + ratios
            .iter()
            .map(|&r| match r {
                0 => 0,
                4 => cfg.index_topk.min(tokens / 4),
                r => tokens / r,
            })
            .max()
            .unwrap_or(0);
    let blas = crate::device::kern::blas_scratch_bytes(
        rows as usize,
        (cfg.num_attention_heads, cfg.head_dim, max_keys),
        csa.then_some((cfg.index_n_heads, cfg.index_head_dim, tokens / 4)),
    ) as f64;
    let device = plan
        .device
        .then_some(DEVICE_ACTIVATIONS * activations + attention + stage + held + blas);
    // the CUDA backend's host side: the pinned staging buffers and the rows read back
    let host_rows = if plan.device {
        stage + DEVICE_HOST_ROWS * rows * resid * 4.0 + streams
    } else {
        0.0
    };
    // on the host backend the streams are activations too
    let activations = if plan.device {
        activations
    } else {
        activations + streams
    };

    Estimate {
        activations,
        attention,
        weights,
        kept,
        graph,
        device,
        host_rows,
        cpu_seconds,
    }
}

/// A memory limit and where it comes from, for messages.
#[derive(Clone, Debug, PartialEq)]
pub struct Limit {
    pub bytes: f64,
    pub source: String,
}

/// `--max-mem GIB` as a limit; refuses a non-positive or non-finite value.
pub fn max_mem_limit(gib_arg: f64) -> Result<Limit> {
    if !gib_arg.is_finite() || gib_arg <= 0.0 {
        return Err(Error::usage(format!(
            "--max-mem {gib_arg}: expected a positive number of GiB"
        )));
    }
    Ok(Limit {
        bytes: gib_arg * GIB,
        source: format!("--max-mem {gib_arg}"),
    })
}

/// `--max-mem GIB` bounded by what was detected (`host_limit`, `device_limit`): the smaller of
/// the two, so a budget above the machine's real limit is refused exactly as the automatic
/// estimate is, naming that limit.
pub fn max_mem_bounded(gib_arg: f64, detected: Option<Limit>) -> Result<Limit> {
    let given = max_mem_limit(gib_arg)?;
    Ok(match detected {
        Some(d) if d.bytes < given.bytes => Limit {
            bytes: d.bytes,
            source: format!("{}; below --max-mem {gib_arg}", d.source),
        },
        _ => given,
    })
}

fn read(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

/// `Key:   123 kB` of /proc/meminfo or /proc/self/status, in bytes.
fn kb_field(text: &str, key: &str) -> Option<f64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let n: f64 = line[key.len()..]
        .trim_start_matches(':')
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(n * 1024.0)
}

fn num_file(path: &str) -> Option<f64> {
    read(path)?.trim().parse().ok()
}

/// `stat` file's `key value` line, in bytes.
fn stat_field(path: &str, key: &str) -> Option<f64> {
    read(path)?
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The cgroup's limit minus its non-reclaimable usage, v2 then v1; None without a limit.
fn cgroup_free() -> Option<(f64, String)> {
    let cg = read("/proc/self/cgroup")?;
    // v2: "0::/path"; the limit is the smallest along the path to the root
    let mut best: Option<(f64, String)> = None;
    let mut consider = |free: f64, what: String| {
        if best.as_ref().is_none_or(|b| free < b.0) {
            best = Some((free.max(0.0), what));
        }
    };
    if let Some(p) = cg.lines().find_map(|l| l.strip_prefix("0::")) {
        let mut dir = std::path::PathBuf::from(format!("/sys/fs/cgroup{}", p.trim_end()));
        loop {
            let d = dir.display().to_string();
            if let (Some(max), Some(cur)) = (
                num_file(&format!("{d}/memory.max")),
                num_file(&format!("{d}/memory.current")),
            ) {
                let inactive =
                    stat_field(&format!("{d}/memory.stat"), "inactive_file").unwrap_or(0.0);
                consider(
                    max - cur + inactive,
                    format!(
                        "cgroup memory.max {} − usage {}",
                        gib(max),
                        gib(cur - inactive)
                    ),
                );
            }
            if !dir.pop()
                || !dir.starts_with("/sys/fs/cgroup")
                || dir.as_os_str() == "/sys/fs/cgroup"
            {
                break;
            }
        }
    }
    // v1: "N:memory:/path"; inside a container the path is often not mounted, the root is
    if let Some(p) = cg.lines().find_map(|l| {
        l.split_once(":memory:")
            .map(|(_, p)| p.trim_end().to_string())
    }) {
        for d in [
            format!("/sys/fs/cgroup/memory{p}"),
            "/sys/fs/cgroup/memory".to_string(),
        ] {
            if let (Some(lim), Some(used)) = (
                num_file(&format!("{d}/memory.limit_in_bytes")),
                num_file(&format!("{d}/memory.usage_in_bytes")),
            ) {
                // "no limit" is a page-aligned i64::MAX
                if lim < 1e18 {
                    let inactive = stat_field(&format!("{d}/memory.stat"), "total_inactive_file")
                        .unwrap_or(0.0);
                    consider(
                        lim - used + inactive,
                        format!("cgroup limit {} − usage {}", gib(lim), gib(used - inactive)),
                    );
                }
                break;
            }
        }
    }
    best
}

/// RLIMIT_AS minus the address space already mapped (shards included), less room for thread
/// stacks and allocator arenas; None when unlimited.
fn address_space_free() -> Option<(f64, String)> {
    let limits = read("/proc/self/limits")?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max address space"))?;
    let soft = line["Max address space".len()..]
        .split_whitespace()
        .next()?;
    let cap: f64 = soft.parse().ok()?; // "unlimited" does not parse
    let mapped = kb_field(&read("/proc/self/status")?, "VmSize").unwrap_or(0.0);
    let threads = rayon::current_num_threads() as f64;
    let reserve = (256.0 + 64.0 * (threads + 4.0)) * (1u64 << 20) as f64;
    Some((
        cap - mapped - reserve,
        format!("RLIMIT_AS {} − mapped {}", gib(cap), gib(mapped)),
    ))
}

/// Host memory this process may still use: the least of MemAvailable, the cgroup's room and the
/// address-space limit's room.
pub fn host_limit() -> Limit {
    let mut best = Limit {
        bytes: f64::INFINITY,
        source: "no limit found".into(),
    };
    let mut take = |b: f64, s: String| {
        if b < best.bytes {
            best = Limit {
                bytes: b.max(0.0),
                source: s,
            };
        }
    };
    if let Some(avail) = read("/proc/meminfo").and_then(|m| kb_field(&m, "MemAvailable")) {
        take(avail, "MemAvailable".into());
    }
    if let Some((b, s)) = cgroup_free() {
        take(b, s);
    }
    if let Some((b, s)) = address_space_free() {
        take(b, s);
    }
    best
}

/// The backend GPU's total memory. Not its free memory: the device state keeps pools of
/// buffers from earlier runs in the same process (bisect's re-runs, selftest), which it reuses
/// but the driver counts as used, so "free" would refuse runs that fit.
pub fn device_limit(backend: &crate::backend::Backend) -> Option<Limit> {
    let (free, total) = backend.device_memory()?;
    Some(Limit {
        bytes: total as f64,
        source: format!("device memory ({} free now)", gib(free as f64)),
    })
}

/// Refuse `plan` when its estimate exceeds the limit (`max_mem` GiB when given, else what is
/// detected). `what` says what asked for it ("--seq-len 1000000", "--tokens ids.json (100000
/// tokens)", "this run"), the subject of the message. Returns the estimate.
pub fn check(
    cfg: &ModelConfig,
    plan: &Plan,
    max_mem: Option<f64>,
    backend: &crate::backend::Backend,
    what: &str,
) -> Result<Estimate> {
    let est = estimate(cfg, plan);
    let host = match max_mem {
        Some(g) => max_mem_bounded(g, Some(host_limit()))?,
        None => host_limit(),
    };
    let layers = format!("layers {}..{}", plan.layers.0, plan.layers.1);
    if est.host() > host.bytes {
        return Err(Error::usage(format!(
            "{what} needs an estimated {} of host memory ({layers}, {} tokens: {}) but the limit is {} ({}); run fewer tokens or layers (--max-mem GIB sets a lower budget, never one above the machine's limit)",
            gib(est.host()),
            plan.tokens,
            est.parts(),
            gib(host.bytes),
            host.source
        )));
    }
    if let (Some(need), true) = (est.device, backend.on_device()) {
        let dev = match max_mem {
            Some(g) => Some(max_mem_bounded(g, device_limit(backend))?),
            None => device_limit(backend),
        };
        if let Some(dev) = dev.filter(|d| need > d.bytes) {
            return Err(Error::usage(format!(
                "{what} needs an estimated {} of device memory ({layers}, {} tokens: activations {}, attention {}, loader staging) but the limit is {} ({}); run fewer tokens or layers (--max-mem GIB sets a lower budget, never one above the machine's limit)",
                gib(need),
                plan.tokens,
                gib(est.activations),
                gib(est.attention),
                gib(dev.bytes),
                dev.source
            )));
        }
    }
    Ok(est)
}

/// Bytes of the layers' output streams of a run in chunks (every chunk's pieces, three paths,
/// into a layer and out of it).
fn device_streams(cfg: &ModelConfig, plan: &Plan) -> f64 {
    6.0 * plan.tokens as f64 * (cfg.hc_mult * cfg.hidden_size) as f64 * 4.0
}

/// The smallest token chunk a device run takes to keep its layers' output streams in device
/// memory (`streams_fit_device`) rather than run larger chunks with the streams on the host:
/// on the H200, 65,536 V4-Flash tokens ran in 60 s in chunks of 8,192 with the streams on the
/// device and in 103 s in chunks of ~21,800 with them on the host (BENCHMARKS.md, session 29).
pub const STREAM_CHUNK_MIN: u64 = 4096;

/// Whether a run in chunks on a device can keep the layers' output streams (every chunk's
/// pieces, three paths, into a layer and out of it) in device memory next to its estimate,
/// within `--mem-gib` (else `--max-mem`, else the device's memory): then they never travel
/// through the host between layers.
pub fn streams_fit_device(
    cfg: &ModelConfig,
    plan: &Plan,
    mem_gib: Option<f64>,
    max_mem: Option<f64>,
    backend: &crate::backend::Backend,
) -> bool {
    let Some(need) = estimate(cfg, plan).device.filter(|_| plan.chunk.is_some()) else {
        return false;
    };
    let streams = device_streams(cfg, plan);
    let limit = match (mem_gib, max_mem) {
        (Some(g), _) => g * GIB,
        (None, Some(g)) => max_mem_bounded(g, device_limit(backend)).map_or(0.0, |l| l.bytes),
        (None, None) => device_limit(backend).map_or(0.0, |l| l.bytes),
    };
    need + streams <= limit
}

/// The token chunk of a run (each layer over the prompt `chunk` tokens at a time): `--chunk N`
/// as given, else the most tokens whose estimate fits `--mem-gib` (device memory on CUDA,
/// host memory on the CPU), else, when the whole prompt does not fit the run's limit
/// (`--max-mem`, else what the machine has), the most tokens that do. None: the whole prompt at
/// once (it fits, or the families other than V4, which run unchunked). A chunk of 0, or a
/// `--mem-gib` too small for a chunk of one token, is a usage error (exit 2) naming what works.
pub fn token_chunk(
    cfg: &ModelConfig,
    plan: &Plan,
    chunk: Option<usize>,
    mem_gib: Option<f64>,
    max_mem: Option<f64>,
    backend: &crate::backend::Backend,
) -> Result<Option<u64>> {
    let t = plan.tokens;
    if chunk == Some(0) {
        return Err(Error::usage("--chunk 0: a chunk holds at least one token"));
    }
    if let Some(n) = chunk {
        return Ok(((n as u64) < t).then_some(n as u64));
    }
    let need = |c: Option<u64>| {
        let e = estimate(cfg, &Plan { chunk: c, ..*plan });
        match (plan.device, e.device) {
            (true, Some(d)) => d,
            _ => e.host(),
        }
    };
    let budget = match mem_gib {
        Some(g) if !(g.is_finite() && g > 0.0) => {
            return Err(Error::usage(format!(
                "--mem-gib {g}: expected a positive number of GiB"
            )))
        }
        Some(g) => g * GIB,
        None => {
            let limit = match (max_mem, plan.device) {
                (Some(g), true) => Some(max_mem_bounded(g, device_limit(backend))?),
                (Some(g), false) => Some(max_mem_bounded(g, Some(host_limit()))?),
                (None, true) => device_limit(backend),
                (None, false) => Some(host_limit()),
            };
            match limit {
                Some(l) => l.bytes,
                None => return Ok(None),
            }
        }
    };
    if t <= 1 || need(None) <= budget {
        return Ok(None);
    }
    let one = need(Some(1));
    if one > budget {
        return match mem_gib {
            // in GiB, rounded up to 1e-6 GiB
            Some(g) => Err(Error::usage(format!(
                "--mem-gib {g}: a chunk of one token over {t} tokens needs an estimated {} of {} memory; the smallest workable budget is --mem-gib {:.6}",
                gib(one),
                if plan.device { "device" } else { "host" },
                (one / GIB * 1e6).ceil() / 1e6
            ))),
            // the run's own check refuses it, with the estimate of its smallest chunk
            None => Ok(Some(1)),
        };
    }
    // the most tokens that fit (need(c) grows with c): on a device, beside the layers' output
    // streams when a chunk of at least STREAM_CHUNK_MIN tokens fits there (they then never
    // travel through the host), else alone
    let most = |room: f64| {
        let (mut lo, mut hi) = (1u64, t - 1);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if need(Some(mid)) <= room {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        (need(Some(lo)) <= room).then_some(lo)
    };
    // a multiple of the CUDA backend's GEMM row blocks when larger, so a chunked run sums every
    // GEMM in the order of the whole prompt's and reports the same bits
    let whole = |c: u64| {
        let rows = crate::backend::cuda::GEMM_ROWS as u64;
        if c >= rows {
            c - c % rows
        } else {
            c
        }
    };
    if plan.device {
        let beside = most(budget - device_streams(cfg, plan));
        if let Some(c) = beside.filter(|&c| c >= STREAM_CHUNK_MIN.min(t - 1)) {
            return Ok(Some(whole(c)));
        }
    }
    Ok(Some(whole(most(budget).unwrap_or(1))))
}

#[cfg(test)]
mod tests {
    /// No device: the estimate and the explanation without device memory.
    const CPU: crate::backend::Backend = crate::backend::Backend::Cpu;
    use super::*;

    fn tiny() -> ModelConfig {
        crate::synth::builtin(0)
            .unwrap()
            .model_config()
            .unwrap()
            .clone()
    }

    /// The estimate of `p` in chunks of `c` tokens.
    fn chunked(cfg: &ModelConfig, p: &Plan, c: u64) -> Estimate {
        estimate(
            cfg,
            &Plan {
                chunk: Some(c),
                ..*p
            },
        )
    }

    fn plan(tokens: u64) -> Plan {
        Plan {
            layers: (0, 4),
            tokens,
            keep_outputs: false,
            kept_rows: None,
            with_head: true,
            layer_states: false,
            device: false,
            chunk: None,
        }
    }

    /// On the CUDA backend the activations are on the device: the host estimate of a
    /// V4-Flash-dimension run at 16,384 tokens stays near what the H200 measured (12 GB host
    /// RSS), the device estimate lies between the measured 68 GB and the 139 GiB card, and
    /// 65,536 tokens (which ran out of the card's memory there) is beyond it.
    #[test]
    fn the_cuda_estimate_follows_the_h200_measurements() {
        use crate::checkpoint::Naming;
        use crate::synth::plan::{config_files, Dims, Format, Preset};
        let d = Dims::new(Preset::FlashLayer, Some(5)).unwrap();
        let (json, _) = config_files(&d, Format::Bf16, Naming::Official, &[]);
        let cfg = ModelConfig::from_json(&serde_json::from_str(&json).unwrap()).unwrap();
        let on = |t| {
            estimate(
                &cfg,
                &Plan {
                    device: true,
                    ..plan(t)
                },
            )
        };
        let e16 = on(16384);
        assert!(e16.host() < 24.0 * GIB, "host {}", gib(e16.host()));
        let dev = e16.device.unwrap();
        assert!((68.2e9..139.0 * GIB).contains(&dev), "device {}", gib(dev));
        assert!(on(65536).device.unwrap() > 143.0 * GIB);
        // the CPU backend keeps its activations on the host
        let cpu = estimate(
            &cfg,
            &Plan {
                with_head: false,
                ..plan(16384)
            },
        );
        assert!(cpu.host() > 100.0 * GIB);
    }

    #[test]
    fn grows_with_tokens_and_never_quadratically_in_attention() {
        let cfg = tiny();
        let a = estimate(&cfg, &plan(1000));
        let b = estimate(&cfg, &plan(2000));
        assert!((b.activations / a.activations - 2.0).abs() < 1e-9);
        // short prompts: the indexer's one score block is [t, t/4], quadratic
        let r = b.attention / a.attention;
        assert!((3.0..4.1).contains(&r), "attention ratio {r}");
        // long prompts: per-query key lists and a bounded score block, at most linear in tokens
        let (l1, l2) = (
            estimate(&cfg, &plan(1 << 20)),
            estimate(&cfg, &plan(1 << 21)),
        );
        let r = l2.attention / l1.attention;
        assert!((1.0..2.01).contains(&r), "attention ratio at length {r}");
        assert!(l1.attention < 2.0 * GIB, "{}", l1.attention);
        assert!(b.cpu_seconds > 1.9 * a.cpu_seconds);
        // u64::MAX tokens neither overflows nor panics: it is just enormous
        let z = estimate(&cfg, &plan(u64::MAX));
        assert!(z.host() > 1e20, "{}", z.host());
    }

    #[test]
    fn long_cpu_runs_are_estimated_long() {
        // measured: the tiny model's 5 layers over 1000 tokens take ~25 CPU-seconds
        let cfg = tiny();
        let threads = rayon::current_num_threads() as f64;
        let s = estimate(&cfg, &plan(1000)).cpu_seconds * threads;
        assert!(
            (10.0..100.0).contains(&s),
            "{s} CPU-seconds for 1000 tokens"
        );
        // a 100k-token file is announced (the runner warns past 60 s), 64 tokens are not
        assert!(estimate(&cfg, &plan(100_000)).cpu_seconds > 60.0);
        assert!(estimate(&cfg, &plan(64)).cpu_seconds < 60.0);
    }

    #[test]
    fn the_chunk_comes_from_the_budget_and_a_too_small_budget_names_the_smallest() {
        let cfg = tiny();
        let t = 8192;
        let p = plan(t);
        let chunk = |c: Option<usize>, g: Option<f64>| token_chunk(&cfg, &p, c, g, None, &CPU);
        assert_eq!(chunk(Some(64), None).unwrap(), Some(64));
        assert_eq!(
            chunk(Some(9000), None).unwrap(),
            None,
            "a chunk of the whole prompt"
        );
        assert_eq!(chunk(Some(0), None).unwrap_err().exit_code(), 2);
        // the chunk that fits: its estimate within the budget, one token more not
        let need = |c: u64| chunked(&cfg, &p, c).host();
        let g = (need(100) + need(101)) / 2.0 / GIB;
        assert_eq!(chunk(None, Some(g)).unwrap(), Some(100));
        assert_eq!(
            chunk(None, Some(1e6)).unwrap(),
            None,
            "the whole prompt fits"
        );
        // more tokens per chunk cost more; chunks cost less than the whole prompt at length
        assert!(need(2048) > need(64));
        assert!(need(64) < estimate(&cfg, &p).host());
        // too small: exit 2, and the budget the message names works
        let e = chunk(None, Some(need(1) / GIB * 0.99)).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        let msg = e.to_string();
        let named: f64 = msg
            .rsplit("--mem-gib ")
            .next()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or_else(|| panic!("no budget named in: {msg}"));
        assert_eq!(chunk(None, Some(named)).unwrap(), Some(1));
        for bad in [0.0, -1.0, f64::NAN] {
            assert_eq!(chunk(None, Some(bad)).unwrap_err().exit_code(), 2);
        }
    }

    /// The model families chunk as V4 does (`--chunk` is taken, a budget picks one), and what a
    /// chunk carries is their attention's keys and values: every earlier row on full layers,
    /// a sliding layer's window — so a longer prompt carries more, a window no more than itself.
    #[test]
    fn a_family_takes_its_chunk_and_its_carry_is_the_attention_s_keys_and_values() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf-families");
        for f in ["qwen3_moe", "deepseek_v3", "gpt_oss"] {
            let cfg = ModelConfig::from_file(&dir.join(f).join("config.json")).unwrap();
            let fam = cfg.family.clone().unwrap();
            let p = Plan {
                layers: (0, cfg.num_hidden_layers - 1),
                ..plan(4096)
            };
            let chunk = |c: Option<usize>, g: Option<f64>| token_chunk(&cfg, &p, c, g, None, &CPU);
            assert_eq!(chunk(Some(64), None).unwrap(), Some(64), "{f}");
            let need = |c: u64| chunked(&cfg, &p, c).host();
            let g = (need(100) + need(101)) / 2.0 / GIB;
            assert_eq!(chunk(None, Some(g)).unwrap(), Some(100), "{f}");
            let layers = cfg.num_hidden_layers;
            let (c1, c2) = (
                family_carry(&cfg, &fam, 1000.0, layers),
                family_carry(&cfg, &fam, 2000.0, layers),
            );
            assert!(c1 > 0.0 && c2 == 2.0 * c1, "{f}: {c1} {c2}");
            // gpt-oss's layer 0 slides: alone, its carry stops growing at the window
            let slides = fam.window(cfg.sliding_window, 0).is_some();
            assert_eq!(slides, f == "gpt_oss");
            let (w1, w2) = (
                family_carry(&cfg, &fam, 1e6, 1),
                family_carry(&cfg, &fam, 2e6, 1),
            );
            assert_eq!(slides, w1 == w2, "{f}: {w1} {w2}");
        }
    }

    /// On a device the chunk leaves room for the layers' output streams when a chunk of at
    /// least STREAM_CHUNK_MIN tokens fits beside them; below that the chunk takes the budget
    /// alone and the streams go through the host.
    #[test]
    fn a_device_chunk_keeps_the_streams_on_the_device_when_a_large_chunk_fits_beside_them() {
        let cfg = tiny();
        let p = Plan {
            device: true,
            ..plan(65536)
        };
        let need = |c: u64| chunked(&cfg, &p, c).device.expect("a device plan");
        let streams = device_streams(&cfg, &p);
        let chunk = |g: f64| token_chunk(&cfg, &p, None, Some(g), None, &CPU).unwrap();
        let fits = |c: Option<u64>, g: f64| {
            streams_fit_device(&cfg, &Plan { chunk: c, ..p }, Some(g), None, &CPU)
        };
        // room for 6,144 tokens beside the streams: that chunk, streams on the device; room for
        // 6,000: the multiple of 512 below (a chunk sums its GEMMs as the whole prompt does)
        let g = (need(6144) + streams) / GIB;
        let c = chunk(g);
        assert_eq!(c, Some(6144));
        assert!(fits(c, g));
        assert_eq!(chunk((need(6000) + streams) / GIB), Some(5632));
        // room for 3,000 beside them (< STREAM_CHUNK_MIN): the larger chunk of the budget alone
        let g = (need(3000) + streams) / GIB;
        let c = chunk(g).expect("chunked");
        assert!(c > 3000 && c % 512 == 0, "{c}");
        assert!(need(c) <= g * GIB && need(c + 512) > g * GIB);
        assert!(!fits(Some(c), g));
        // the whole prompt fits: unchunked, nothing to keep
        assert_eq!(chunk(1e6), None);
    }

    #[test]
    fn keeping_outputs_costs_memory() {
        let cfg = tiny();
        let a = estimate(&cfg, &plan(512));
        let b = estimate(
            &cfg,
            &Plan {
                keep_outputs: true,
                kept_rows: None,
                ..plan(512)
            },
        );
        assert!(b.kept > 0.0 && b.host() > a.host());
    }

    #[test]
    fn refusal_names_what_asked_the_estimate_and_the_limit() {
        let cfg = tiny();
        let e = check(&cfg, &plan(64), Some(1e-6), &CPU, "--seq-len 64")
            .unwrap_err()
            .to_string();
        for want in [
            "--seq-len 64",
            "estimated",
            "GiB",
            "--max-mem 0.000001",
            "layers 0..4",
        ] {
            assert!(e.contains(want), "`{want}` missing: {e}");
        }
        assert!(check(&cfg, &plan(64), Some(8.0), &CPU, "x").is_ok());
        assert!(check(&cfg, &plan(64), Some(0.0), &CPU, "x").is_err());
        assert!(check(&cfg, &plan(64), Some(f64::NAN), &CPU, "x").is_err());
    }

    /// Issue 44: a `--max-mem` above the machine's real limit is bounded by it, so a run whose
    /// estimate fits the budget but not the machine is refused naming the machine's limit, as
    /// without `--max-mem`; a budget below the limit stays the limit.
    #[test]
    fn max_mem_above_the_real_limit_is_bounded_by_it() {
        let cfg = tiny();
        let host = host_limit();
        // a prompt whose estimate exceeds the machine but not a budget of 2^40 GiB
        let mut t = 1u64 << 20;
        while estimate(&cfg, &plan(t)).host() <= host.bytes {
            t *= 2;
        }
        let huge = (1u64 << 40) as f64;
        assert!(estimate(&cfg, &plan(t)).host() < huge * GIB);
        let e = check(&cfg, &plan(t), Some(huge), &CPU, "--seq-len N")
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("below --max-mem {huge}")), "{e}");
        assert!(e.contains("estimated"), "{e}");
        let l = max_mem_bounded(huge, Some(host.clone())).unwrap();
        assert_eq!(l.bytes, host.bytes);
        let small = max_mem_bounded(1e-3, Some(host)).unwrap();
        assert_eq!(small.bytes, 1e-3 * GIB);
        assert_eq!(small.source, "--max-mem 0.001");
        assert!(max_mem_bounded(-1.0, None).is_err());
        // under a huge --max-mem the prompt is still cut into chunks the machine can hold
        let c = token_chunk(&cfg, &plan(t), None, None, Some(huge), &CPU).unwrap();
        assert!(c.is_some_and(|c| c < t), "{c:?}");
    }

    #[test]
    fn host_limit_is_positive_and_finite_here() {
        let l = host_limit();
        assert!(l.bytes > 0.0 && l.bytes.is_finite(), "{l:?}");
    }

    #[test]
    fn gib_formatting() {
        assert_eq!(gib(GIB), "1.00 GiB");
        assert_eq!(gib(GIB * 250.0), "250 GiB");
        assert!(gib(1e40).contains('e'));
        assert_eq!(gib(GIB / 1000.0), "0.0010 GiB");
    }
}
