//! What the op math is written against: the [`OpEnv`] a numerics path provides (weights,
//! parameters, linears, rounding, the device), and the small checks and lookups every op shares.
//! `exec.rs` (the op dispatch and most ops) and `attn.rs` (attention, compressor, indexer) both
//! build on it.

use super::graph::Op;
use super::rope::rope_freqs;
use super::ModelConfig;
use crate::device::{CpuDevice, Device};
use crate::{Error, Result, Tensor};

/// Where a token chunk sits in the prompt, for a run that takes each layer's ops over the
/// prompt a chunk of tokens at a time (`probe::chunked`): the op's inputs are the rows of
/// tokens [start, end) of a prompt of `total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkAt {
    pub start: usize,
    pub end: usize,
    pub total: usize,
}

/// What a numerics path provides to the op math.
pub trait OpEnv {
    fn cfg(&self) -> &ModelConfig;
    fn token_ids(&self) -> &[u32];
    /// A non-linear parameter (norm weights, hc fn/base/scale, attn_sink, compressor ape, gate.bias,
    /// tid2eid, hc_head_*) as f32 values exactly as stored. Canonical official name, e.g.
    /// "layers.0.hc_attn_fn".
    fn param(&mut self, canonical: &str) -> Result<Tensor>;
    /// [`OpEnv::param`] for a parameter the device reads: an env on a device may hand it out with
    /// a device copy attached, made once for all the paths of an op.
    fn param_dev(&mut self, canonical: &str) -> Result<Tensor> {
        self.param(canonical)
    }
    /// Rows `ids` of a 2-D parameter (tid2eid), [ids.len(), cols], as stored; an id past its
    /// last row is an error naming it. An env may read only those rows.
    fn param_rows(&mut self, canonical: &str, ids: &[u32]) -> Result<Tensor> {
        let p = self.param(canonical)?;
        gather_rows(canonical, &p, ids)
    }
    /// Embedding rows for the given ids, [ids.len(), D], as stored.
    fn embed_rows(&mut self, ids: &[u32]) -> Result<Tensor>;
    /// The RoPE table of `freqs` at `positions` (`RopeTable::new`); an env may keep the tables
    /// it made for its other paths and ops (the same values).
    fn rope_table(
        &mut self,
        freqs: &[f32],
        positions: std::ops::Range<usize>,
    ) -> std::sync::Arc<crate::device::ops::RopeTable> {
        std::sync::Arc::new(crate::device::ops::RopeTable::new(freqs, positions))
    }
    /// y = x @ Wᵀ for the checkpoint weight `base` (e.g. "layers.0.attn.wq_a",
    /// "layers.0.ffn.experts.3.w1", "layers.0.attn.compressor.wkv", "head"), x [rows, in] →
    /// [rows, out] in f32. The env decides the numerics (dequant precision, activation
    /// quantization). `sub_id` names this GEMM for the env's records, e.g. "L0.attn.q_a",
    /// "L0.ffn.expert.3.w1", "L0.attn.compressor.wkv".
    fn linear(&mut self, sub_id: &str, x: &Tensor, base: &str) -> Result<Tensor>;
    /// Grouped projection (wo_a): x [rows, G, K], weight [G·R, K] where group g uses rows
    /// g·R..(g+1)·R → [rows, G, R].
    fn linear_grouped(
        &mut self,
        sub_id: &str,
        x: &Tensor,
        base: &str,
        groups: usize,
    ) -> Result<Tensor>;
    /// The SwiGLU clamp of the experts op reading `weight` (any of its weights) on this path:
    /// the config's `swiglu_limit` (the default; +inf means none), or what the path's engine
    /// emulation uses (the served path under `swiglu-unclamped`).
    fn swiglu_limit(&self, _weight: &str) -> f32 {
        self.cfg().swiglu_limit as f32
    }
    /// The factor the routed-experts op of layer `layer` applies to the routing weights it is
    /// given (which carry the config's `routed_scaling_factor`): 1 (the default), or what the
    /// served path's engine emulation uses (`routed-scaling-dropped` 1/rs, `-doubled` rs).
    fn routed_weight_factor(&self, _layer: usize) -> f32 {
        1.0
    }
    /// The path's storage rounding ("bf()" in the spec): BF16 RNE for the BF16/served paths,
    /// identity for the FP32 oracle.
    fn store(&self, t: &mut Tensor);
    /// Hook for KV-cache fidelity simulation (docs/DSV4-LAYER.md §3.4 step 5, §3.5): called on what a
    /// serving stack writes to its caches, after rope and `store`. Sites: "Ln.attn.kv_rope"
    /// [T, Dh], "Ln.attn.compressor" [n_c, Dh], "Ln.attn.indexer.kv" [n_c, Di],
    /// "Ln.attn.indexer.q" [T, Hi·Di]. The L0 math leaves them alone (the default).
    fn cache_store(&self, _site: &str, _t: &mut Tensor) {}
    /// Query tokens per attention call: the attention runs over its queries in chunks of this
    /// many, with the same bits as in one call. None: all at once.
    fn chunk_rows(&self) -> Option<usize> {
        None
    }
    /// The token chunk the op's inputs cover (their first row is token `start`; `token_ids` are
    /// the chunk's), or None for the whole prompt. The ops whose rows depend on earlier tokens
    /// (RoPE positions, the compressors, the indexer, the attention) take what they need from
    /// the state the op's previous chunk left ([`OpEnv::take_carry`]).
    fn chunk_at(&self) -> Option<ChunkAt> {
        None
    }
    /// The state this op left under `key` at its previous token chunk (on this path), taken:
    /// the op puts back ([`OpEnv::put_carry`]) what its next chunk needs. None on a first chunk
    /// and outside a run in chunks.
    fn take_carry(&mut self, _key: &str) -> Option<Tensor> {
        None
    }
    /// Keep `t` for this op's next token chunk under `key` ([`OpEnv::take_carry`]).
    fn put_carry(&mut self, _key: &str, _t: Tensor) {}
    /// Keys at positions before this one are read from an engine's KV cache (the served path
    /// under `--served-chunk`: the first token of the engine chunk the op's rows are in), the
    /// others as computed. None: every key as computed.
    fn cached_before(&self) -> Option<usize> {
        None
    }
    /// The whole routed-experts op in one call, for a backend that batches it on a device:
    /// x [t, d], `per[e]` = (token, routing weight) pairs of expert e in token order, `k` slots
    /// per token, `bases[3e..3e+3]` = (w1, w3, w2). `None` = compute it linear by linear.
    fn experts_fused(
        &mut self,
        _layer: usize,
        _x: &Tensor,
        _per: &[Vec<(usize, f32)>],
        _k: usize,
        _bases: &[&str],
        _limit: f32,
    ) -> Option<Result<Tensor>> {
        None
    }
    /// The file a weight or parameter is stored in, so that errors found in the op math (a
    /// parameter of the wrong size) name it; None when the env does not know (built-in models).
    fn weight_file(&self, _name: &str) -> Option<std::path::PathBuf> {
        None
    }
    /// The device the non-linear ops run on, rounding as this path stores ([`OpEnv::store`]);
    /// the host reference ([`CpuDevice`]) unless the env runs on a GPU.
    fn device(&self) -> Box<dyn Device + '_> {
        Box::new(CpuDevice::new(move |t: &mut Tensor| self.store(t)))
    }
}

/// The prompt position of an op's first input row (its chunk's start; 0 for the whole prompt).
pub(crate) fn pos0(env: &dyn OpEnv) -> usize {
    env.chunk_at().map_or(0, |c| c.start)
}

/// Rows `r` of `x` (x itself when that is all of it).
pub(crate) fn rows(env: &dyn OpEnv, x: &Tensor, r: std::ops::Range<usize>) -> Result<Tensor> {
    if r.start == 0 && r.end == x.rows() {
        return Ok(x.clone());
    }
    env.device().cat_rows(&[(x, r)])
}

/// `a`'s rows then `b`'s.
pub(crate) fn join(env: &dyn OpEnv, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    match (a.rows(), b.rows()) {
        (0, _) => Ok(b.clone()),
        (_, 0) => Ok(a.clone()),
        (na, nb) => env.device().cat_rows(&[(a, 0..na), (b, 0..nb)]),
    }
}

/// Every row so far of a tensor that grows by `new`'s rows at each token chunk (the compressed
/// keys): the earlier chunks' rows under `key`, then `new`'s; kept for the next chunk.
pub(crate) fn history(env: &mut dyn OpEnv, key: &str, new: Tensor, at: ChunkAt) -> Result<Tensor> {
    if env.chunk_at().is_none() {
        return Ok(new);
    }
    let all = match env.take_carry(key) {
        Some(prev) => join(env, &prev, &new)?,
        None => new,
    };
    if at.end < at.total {
        env.put_carry(key, all.clone());
    }
    Ok(all)
}

/// A token-major tensor's rows over a sliding window: the last `tail` rows before this chunk
/// (kept under `key`), then the chunk's `new` rows; its last `tail` rows are kept for the next.
pub(crate) fn window(
    env: &mut dyn OpEnv,
    key: &str,
    new: &Tensor,
    at: ChunkAt,
    tail: usize,
) -> Result<Tensor> {
    let all = match env.take_carry(key) {
        Some(prev) => join(env, &prev, new)?,
        None => new.clone(),
    };
    if at.end < at.total {
        let keep = tail.min(all.rows());
        env.put_carry(key, rows(env, &all, all.rows() - keep..all.rows())?);
    }
    Ok(all)
}

/// Rows `ids` of the 2-D tensor `p` (named `name` in errors).
pub(crate) fn gather_rows(name: &str, p: &Tensor, ids: &[u32]) -> Result<Tensor> {
    if p.shape.len() != 2 {
        return Err(bad_weight(
            name,
            format!("shape {:?}, expected 2 dimensions", p.shape),
        ));
    }
    p.select_rows(ids).ok_or_else(|| {
        let rows = p.shape[0];
        let id = ids
            .iter()
            .find(|&&i| i as usize >= rows)
            .copied()
            .unwrap_or(0);
        bad_weight(
            name,
            format!("token id {id} outside the table of {rows} rows"),
        )
    })
}

pub(crate) fn internal(op: &Op, msg: impl std::fmt::Display) -> Error {
    Error::usage(format!("op {}: {msg}", op.id))
}

/// Placeholder file of [`bad_weight`] errors until [`exec`] names the real one.
const UNKNOWN_FILE: &str = "(checkpoint)";

/// A weight or parameter with the wrong shape: the checkpoint is at fault. [`exec`] replaces the
/// placeholder file with the one the env says holds the tensor.
pub(crate) fn bad_weight(name: &str, msg: impl Into<String>) -> Error {
    Error::bad(UNKNOWN_FILE, Some(name), msg)
}

/// Name the file of a [`bad_weight`] error.
pub(crate) fn locate(err: Error, env: &dyn OpEnv) -> Error {
    match err {
        Error::BadInput { file, tensor, msg } if file.as_os_str() == UNKNOWN_FILE => {
            let file = tensor
                .as_deref()
                .and_then(|t| env.weight_file(t))
                .unwrap_or(file);
            Error::BadInput { file, tensor, msg }
        }
        other => other,
    }
}

pub(crate) fn check_shape(op: &Op, what: &str, t: &Tensor, want: &[usize]) -> Result<()> {
    if t.shape != want {
        return Err(internal(
            op,
            format!("{what} has shape {:?}, expected {want:?}", t.shape),
        ));
    }
    Ok(())
}

pub(crate) fn param_n(env: &mut dyn OpEnv, name: &str, n: usize) -> Result<Tensor> {
    let p = env.param(name)?;
    check_numel(name, p, n)
}

/// [`param_n`] for a parameter the device reads (its device copy made once per op: [`OpEnv::param_dev`]).
pub(crate) fn param_n_dev(env: &mut dyn OpEnv, name: &str, n: usize) -> Result<Tensor> {
    let p = env.param_dev(name)?;
    check_numel(name, p, n)
}

fn check_numel(name: &str, p: Tensor, n: usize) -> Result<Tensor> {
    if p.numel() != n {
        return Err(bad_weight(
            name,
            format!(
                "has {} elements (shape {:?}), expected {n}",
                p.numel(),
                p.shape
            ),
        ));
    }
    Ok(p)
}

pub(crate) fn linear_checked(
    env: &mut dyn OpEnv,
    sub: &str,
    x: &Tensor,
    base: &str,
    out: usize,
) -> Result<Tensor> {
    let y = env.linear(sub, x, base)?;
    if y.numel() != x.rows() * out {
        return Err(bad_weight(
            base,
            format!(
                "linear {sub}: output shape {:?}, expected [{}, {out}]",
                y.shape,
                x.rows()
            ),
        ));
    }
    Ok(Tensor::new(vec![x.rows(), out], y.data))
}

pub(crate) fn weight(op: &Op, i: usize) -> Result<&str> {
    op.weights
        .get(i)
        .map(String::as_str)
        .ok_or_else(|| internal(op, format!("weight #{i} missing from the op")))
}

pub(crate) fn layer_of(op: &Op) -> Result<usize> {
    op.layer.ok_or_else(|| internal(op, "op has no layer"))
}

/// RoPE frequencies of a layer: `compress_rope_theta` with YaRN on compressed layers, `rope_theta`
/// without YaRN on window-only layers (docs/DSV4-LAYER.md §3.4).
pub fn layer_rope_freqs(cfg: &ModelConfig, layer: usize) -> Vec<f32> {
    if cfg.ratio(layer) > 0 {
        rope_freqs(
            cfg.qk_rope_head_dim,
            cfg.compress_rope_theta,
            cfg.yarn.as_ref(),
        )
    } else {
        rope_freqs(cfg.qk_rope_head_dim, cfg.rope_theta, None)
    }
}

/// y + b with the bias parameter `name` [y.cols()] on every row, on the path's device, rounded
/// once as the path stores (a biased projection's output: the engines add the bias in the GEMM's
/// epilogue).
/// The rows of x [t, d] routed to one expert, `toks` = (token, routing weight): [n, d].
pub(crate) fn expert_rows(x: &Tensor, toks: &[(usize, f32)], d: usize) -> Tensor {
    let mut xs = Vec::with_capacity(toks.len() * d);
    for &(ti, _) in toks {
        xs.extend_from_slice(&x.data[ti * d..(ti + 1) * d]);
    }
    Tensor::new(vec![toks.len(), d], xs)
}

/// Add one expert's output y [n, d], each row times its routing weight, into its tokens' rows of
/// acc [t, d]: the weight applied after w2 (transformers' and the engines' order), summed in f32.
pub(crate) fn add_routed(acc: &mut [f32], y: &Tensor, toks: &[(usize, f32)], d: usize) {
    for (r, &(ti, w)) in toks.iter().enumerate() {
        let yr = &y.data[r * d..(r + 1) * d];
        acc[ti * d..(ti + 1) * d]
            .iter_mut()
            .zip(yr)
            .for_each(|(o, v)| *o += w * v);
    }
}

pub(crate) fn add_bias(env: &mut dyn OpEnv, y: &Tensor, name: &str) -> Result<Tensor> {
    let n = y.cols();
    let b = param_n(env, name, n)?;
    let rows: Vec<f32> = b.data.iter().copied().cycle().take(y.numel()).collect();
    env.device().add(y, &Tensor::new(y.shape.clone(), rows))
}

/// SwiGLU with the clamp: gt = min(bf(x@w1ᵀ), L), up = clamp(bf(x@w3ᵀ), ±L), a = bf(silu(gt)·up).
pub(crate) fn swiglu_hidden(
    env: &mut dyn OpEnv,
    sub: &str,
    x: &Tensor,
    w1: &str,
    w3: &str,
    limit: f32,
) -> Result<Tensor> {
    let mut gt = env.linear(&format!("{sub}.w1"), x, w1)?;
    let mut up = env.linear(&format!("{sub}.w3"), x, w3)?;
    if gt.shape != up.shape || gt.rows() != x.rows() {
        return Err(bad_weight(
            w1,
            format!(
                "w1 output {:?} and w3 output {:?} disagree",
                gt.shape, up.shape
            ),
        ));
    }
    env.store(&mut gt);
    env.store(&mut up);
    env.device().swiglu(&gt, &up, limit)
}
