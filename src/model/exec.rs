//! The math of every op (docs/DSV4-LAYER.md §3), written against an [`OpEnv`] that supplies weights and
//! decides numerics. `exec` holds no weights between ops: every linear goes through the env, which
//! loads (and may quantise) per call, so memory stays bounded by one op and only routed experts are
//! ever read.

use std::collections::HashMap;

use super::graph::{Op, OpClass, OpKind};
use super::rope::rope_freqs;
use super::ModelConfig;
use crate::device::kern::{self, HcParams};
use crate::device::ops::{sigmoid, RopeTable};
use crate::device::{CpuDevice, Device};
use crate::{Error, Result, Tensor};

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
    /// The path's storage rounding ("bf()" in the spec): BF16 RNE for the BF16/served paths,
    /// identity for the FP32 oracle.
    fn store(&self, t: &mut Tensor);
    /// Hook for KV-cache fidelity simulation (docs/DSV4-LAYER.md §3.4 step 5, §3.5): called on what a
    /// serving stack writes to its caches, after rope and `store`. Sites: "Ln.attn.kv_rope"
    /// [T, Dh], "Ln.attn.compressor" [n_c, Dh], "Ln.attn.indexer.kv" [n_c, Di],
    /// "Ln.attn.indexer.q" [T, Hi·Di]. The L0 math leaves them alone (the default).
    fn cache_store(&self, _site: &str, _t: &mut Tensor) {}
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
fn locate(err: Error, env: &dyn OpEnv) -> Error {
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

/// Execute one op; returns one tensor per `op.outputs`. An error about a weight names the file
/// that holds it.
pub fn exec(op: &Op, inputs: &[&Tensor], env: &mut dyn OpEnv) -> Result<Vec<Tensor>> {
    exec_op(op, inputs, env).map_err(|e| locate(e, env))
}

fn exec_op(op: &Op, inputs: &[&Tensor], env: &mut dyn OpEnv) -> Result<Vec<Tensor>> {
    if inputs.len() != op.inputs.len() {
        return Err(internal(
            op,
            format!("got {} inputs, expected {}", inputs.len(), op.inputs.len()),
        ));
    }
    let cfg = env.cfg().clone();
    let d = cfg.hidden_size;
    let hc = cfg.hc_mult;
    let out = match op.kind {
        OpKind::Embed => {
            let ids = env.token_ids().to_vec();
            let mut e = env.embed_rows(&ids)?;
            if e.numel() != ids.len() * d {
                return Err(bad_weight(
                    weight(op, 0)?,
                    format!("embedding rows have shape {:?}", e.shape),
                ));
            }
            e.shape = vec![ids.len(), d];
            env.store(&mut e);
            vec![e]
        }
        OpKind::HcExpand => {
            let e = inputs[0];
            let t = e.numel() / d.max(1);
            check_shape(op, "embedding", e, &[t, d])?;
            vec![env.device().repeat_rows(e, d, hc)?]
        }
        OpKind::HcPre => hc_pre(op, inputs[0], env, &cfg)?,
        OpKind::HcPost => vec![hc_post(op, inputs, env, &cfg)?],
        OpKind::RmsNorm => {
            let x = inputs[0];
            let w = param_n(env, weight(op, 0)?, x.cols())?;
            let eps = cfg.rms_norm_eps as f32;
            vec![env.device().rmsnorm(x, &w.data, eps)?]
        }
        OpKind::Linear => {
            let x = inputs[0];
            let base = weight(op, 0)?;
            let mut y = env.linear(&op.id, x, base)?;
            if y.rows() != x.rows() {
                return Err(bad_weight(
                    base,
                    format!(
                        "linear {}: output shape {:?} for input {:?}",
                        op.id, y.shape, x.shape
                    ),
                ));
            }
            let mut shape = x.shape.clone();
            shape.pop();
            shape.push(y.cols());
            y.shape = shape;
            // Logits stay fp32 (REF computes the head in fp32); everything else is a stored activation.
            if op.class != OpClass::Head {
                env.store(&mut y);
            }
            vec![y]
        }
        OpKind::GroupedLinear => {
            let x = inputs[0];
            let g = cfg.o_groups;
            let t = x.rows();
            let hd = cfg.num_attention_heads * cfg.head_dim;
            check_shape(op, "attention output", x, &[t, hd])?;
            let x3 = Tensor::new(vec![t, g, hd / g], x.data.clone());
            let base = weight(op, 0)?;
            let mut y = env.linear_grouped(&op.id, &x3, base, g)?;
            if y.numel() != t * g * cfg.o_lora_rank {
                return Err(bad_weight(
                    base,
                    format!("grouped linear output shape {:?}", y.shape),
                ));
            }
            y.shape = vec![t, g * cfg.o_lora_rank];
            env.store(&mut y);
            vec![y]
        }
        OpKind::QRope => vec![q_rope(op, inputs[0], env, &cfg)?],
        OpKind::KvRope => {
            let layer = layer_of(op)?;
            let x = inputs[0];
            let t = x.rows();
            check_shape(op, "kv", x, &[t, cfg.head_dim])?;
            let tab = RopeTable::new(&layer_rope_freqs(&cfg, layer), 0..t);
            let nope = cfg.nope_dim();
            let mut y = env.device().rope(x, cfg.head_dim, nope, &tab)?;
            env.cache_store(&op.id, &mut y);
            vec![y]
        }
        OpKind::Compressor => {
            let layer = layer_of(op)?;
            let names = [
                weight(op, 0)?,
                weight(op, 1)?,
                weight(op, 2)?,
                weight(op, 3)?,
            ];
            let mut ck = compress(
                env,
                &op.id,
                inputs[0],
                names,
                cfg.ratio(layer),
                cfg.head_dim,
                layer,
            )?;
            env.cache_store(&op.id, &mut ck);
            vec![ck]
        }
        OpKind::Indexer => vec![super::attn::indexer(op, inputs, env, &cfg)?],
        OpKind::Attention => vec![super::attn::attention(op, inputs, env, &cfg)?],
        OpKind::Router => router(op, inputs[0], env, &cfg)?,
        OpKind::Experts => vec![experts(op, inputs, env, &cfg)?],
        OpKind::SharedExpert => vec![shared(op, inputs[0], env, &cfg)?],
        OpKind::Sum => {
            let (a, b) = (inputs[0], inputs[1]);
            if a.shape != b.shape {
                return Err(internal(
                    op,
                    format!("shapes {:?} and {:?} differ", a.shape, b.shape),
                ));
            }
            vec![env.device().add(a, b)?]
        }
        OpKind::HcHead => vec![hc_head(op, inputs[0], env, &cfg)?],
    };
    if out.len() != op.outputs.len() {
        return Err(internal(
            op,
            format!(
                "produced {} outputs for {} ids",
                out.len(),
                op.outputs.len()
            ),
        ));
    }
    Ok(out)
}

/// Execute `ops` in order, feeding outputs forward; returns every output by id.
pub fn run_graph(ops: &[Op], env: &mut dyn OpEnv) -> Result<HashMap<String, Tensor>> {
    let mut vals: HashMap<String, Tensor> = HashMap::new();
    for op in ops {
        let outs = {
            let mut ins = Vec::with_capacity(op.inputs.len());
            for i in &op.inputs {
                ins.push(
                    vals.get(i)
                        .ok_or_else(|| internal(op, format!("input `{i}` was not computed")))?,
                );
            }
            exec(op, &ins, env)?
        };
        for (id, t) in op.outputs.iter().zip(outs) {
            vals.insert(id.clone(), t);
        }
    }
    Ok(vals)
}

fn hc_pre(op: &Op, x: &Tensor, env: &mut dyn OpEnv, cfg: &ModelConfig) -> Result<Vec<Tensor>> {
    let (d, hc) = (cfg.hidden_size, cfg.hc_mult);
    let t = x.shape.first().copied().unwrap_or(0);
    check_shape(op, "residual", x, &[t, hc, d])?;
    let mix = cfg.hc_mix();
    let f = param_n_dev(env, weight(op, 0)?, mix * hc * d)?;
    let base = param_n(env, weight(op, 1)?, mix)?;
    let scale = param_n(env, weight(op, 2)?, 3)?;
    let p = HcParams {
        hc,
        scale: &scale.data,
        base: &base.data,
        iters: cfg.hc_sinkhorn_iters,
        eps: cfg.hc_eps as f32,
    };
    let rms_eps = cfg.rms_norm_eps as f32;
    let (y, post, comb) = env.device().hc_pre(x, t, d, &f, &p, rms_eps)?;
    Ok(vec![y, post, comb])
}

fn hc_post(op: &Op, inputs: &[&Tensor], env: &mut dyn OpEnv, cfg: &ModelConfig) -> Result<Tensor> {
    let (d, hc) = (cfg.hidden_size, cfg.hc_mult);
    let (y, x, post, comb) = (inputs[0], inputs[1], inputs[2], inputs[3]);
    let t = y.rows();
    check_shape(op, "block output", y, &[t, d])?;
    check_shape(op, "residual", x, &[t, hc, d])?;
    check_shape(op, "post", post, &[t, hc])?;
    check_shape(op, "comb", comb, &[t, hc, hc])?;
    env.device().hc_post(y, x, post, comb, t, hc, d)
}

fn hc_head(op: &Op, x: &Tensor, env: &mut dyn OpEnv, cfg: &ModelConfig) -> Result<Tensor> {
    let (d, hc) = (cfg.hidden_size, cfg.hc_mult);
    let t = x.shape.first().copied().unwrap_or(0);
    check_shape(op, "residual", x, &[t, hc, d])?;
    let f = param_n_dev(env, weight(op, 0)?, hc * hc * d)?;
    let base = param_n(env, weight(op, 1)?, hc)?;
    let scale = param_n(env, weight(op, 2)?, 1)?;
    let eps = cfg.hc_eps as f32;
    let rms_eps = cfg.rms_norm_eps as f32;
    // the stream weights from the scaled mixing rows [t, hc]
    let coef = |m: &[f32]| -> Vec<f32> {
        m.iter()
            .enumerate()
            .map(|(i, &v)| sigmoid(v * scale.data[0] + base.data[i % hc]) + eps)
            .collect()
    };
    env.device().hc_head(x, t, d, hc, &f, rms_eps, &coef)
}

/// Per-head RMS normalisation without weight (fp32) then RoPE on each head's last dims at p_t.
fn q_rope(op: &Op, q: &Tensor, env: &mut dyn OpEnv, cfg: &ModelConfig) -> Result<Tensor> {
    let layer = layer_of(op)?;
    let (h, dh) = (cfg.num_attention_heads, cfg.head_dim);
    let t = q.rows();
    check_shape(op, "q", q, &[t, h * dh])?;
    let tab = RopeTable::new(&layer_rope_freqs(cfg, layer), 0..t);
    let nope = cfg.nope_dim();
    let eps = cfg.rms_norm_eps as f32;
    env.device().q_rope(q, h, dh, nope, &tab, eps)
}

/// Compressed KV rows of a compressor (docs/DSV4-LAYER.md §3.5.1): gated softmax pooling over `ratio`
/// slots per channel (ratio 4: 8 overlapping slots, c = 2), then bf, RMSNorm with weight, RoPE at
/// position b·ratio, bf. `names` = [wkv base, wgate base, ape, norm weight]. Returns [n_c, dc].
pub(crate) fn compress(
    env: &mut dyn OpEnv,
    sub_prefix: &str,
    x: &Tensor,
    names: [&str; 4],
    ratio: usize,
    dc: usize,
    layer: usize,
) -> Result<Tensor> {
    let cfg = env.cfg().clone();
    if ratio == 0 {
        return Err(Error::usage(format!(
            "{sub_prefix}: compressor on a layer with ratio 0"
        )));
    }
    let t = x.rows();
    let n_c = t / ratio;
    if n_c == 0 {
        return Ok(Tensor::new(vec![0, dc], vec![]));
    }
    let w = if ratio == 4 { 2 * dc } else { dc };
    let n = n_c * ratio;
    let xs = if n == t {
        x.clone() // shares device values, if any
    } else {
        Tensor::new(vec![n, x.cols()], x.data[..n * x.cols()].to_vec())
    };
    let a = linear_checked(env, &format!("{sub_prefix}.wkv"), &xs, names[0], w)?;
    let g = linear_checked(env, &format!("{sub_prefix}.wgate"), &xs, names[1], w)?;
    let ape = param_n(env, names[2], ratio * w)?;
    let norm = param_n(env, names[3], dc)?;

    let rd = cfg.qk_rope_head_dim;
    if rd > dc {
        return Err(Error::usage(format!(
            "{sub_prefix}: rope dim {rd} exceeds compressed width {dc}"
        )));
    }
    let tab = RopeTable::new(&layer_rope_freqs(&cfg, layer), (0..n_c).map(|b| b * ratio));
    let eps = cfg.rms_norm_eps as f32;
    env.device()
        .compress_tail(&a, &g, &ape.data, &norm.data, n_c, dc, ratio, eps, &tab)
}

/// Read an integer id stored as f32; rejects non-integers and values outside 0..limit.
fn as_index(v: f32, limit: usize) -> Option<usize> {
    (v >= 0.0 && v.fract() == 0.0 && (v as usize) < limit).then_some(v as usize)
}

fn router(op: &Op, x: &Tensor, env: &mut dyn OpEnv, cfg: &ModelConfig) -> Result<Vec<Tensor>> {
    let layer = layer_of(op)?;
    let (e, k) = (cfg.n_routed_experts, cfg.num_experts_per_tok);
    let t = x.rows();
    let gate = weight(op, 0)?;
    let logits = linear_checked(env, &op.id, x, gate, e)?;
    let f = kern::Scoring::parse(&cfg.scoring_func).ok_or_else(|| {
        Error::usage(format!(
            "config: unsupported scoring_func `{}`",
            cfg.scoring_func
        ))
    })?;
    let (norm, rs) = (cfg.norm_topk_prob, cfg.routed_scaling_factor as f32);
    let (wts, idx) = if cfg.is_hash_layer(layer) {
        let name = weight(op, 1)?;
        let ids = env.token_ids().to_vec();
        if ids.len() != t {
            return Err(internal(
                op,
                format!("{} token ids for {t} rows", ids.len()),
            ));
        }
        // only the prompt's rows of the table (tid2eid is [vocab, k])
        let table = env.param_rows(name, &ids)?;
        if table.cols() != k || table.rows() != t {
            return Err(bad_weight(
                name,
                format!("rows of shape {:?}, expected [{t}, {k}]", table.shape),
            ));
        }
        let mut idx = vec![0usize; t * k];
        for (ti, &tok) in ids.iter().enumerate() {
            for j in 0..k {
                let v = table.data[ti * k + j];
                idx[ti * k + j] = as_index(v, e).ok_or_else(|| {
                    bad_weight(
                        name,
                        format!("entry {v} for token {tok} is not an expert id < {e}"),
                    )
                })?;
            }
        }
        let scores = kern::route_scores(&logits.data, e, f);
        (kern::route_weights(&scores, &idx, t, e, k, norm, rs), idx)
    } else {
        let bias = param_n(env, weight(op, 1)?, e)?;
        env.device()
            .route(&logits, &bias.data, t, e, k, f, norm, rs)?
    };
    Ok(vec![
        Tensor::new(vec![t, k], wts),
        Tensor::new(
            vec![t, k],
            idx.iter().map(|&i| i as f32).collect::<Vec<f32>>(),
        ),
    ])
}

/// SwiGLU with the clamp: gt = min(bf(x@w1ᵀ), L), up = clamp(bf(x@w3ᵀ), ±L), a = bf(silu(gt)·up).
fn swiglu_hidden(
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

fn experts(op: &Op, inputs: &[&Tensor], env: &mut dyn OpEnv, cfg: &ModelConfig) -> Result<Tensor> {
    let layer = layer_of(op)?;
    let (x, wts, idx) = (inputs[0], inputs[1], inputs[2]);
    let (d, e, k) = (
        cfg.hidden_size,
        cfg.n_routed_experts,
        cfg.num_experts_per_tok,
    );
    let t = x.rows();
    check_shape(op, "x", x, &[t, d])?;
    check_shape(op, "routing weights", wts, &[t, k])?;
    check_shape(op, "expert ids", idx, &[t, k])?;
    let mut per: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e];
    for ti in 0..t {
        for j in 0..k {
            let v = idx.data[ti * k + j];
            let ex = as_index(v, e)
                .ok_or_else(|| internal(op, format!("expert id {v} is not an integer < {e}")))?;
            per[ex].push((ti, wts.data[ti * k + j]));
        }
    }
    let limit = cfg.swiglu_limit as f32;
    let bases: Vec<&str> = (0..3 * e).map(|i| weight(op, i)).collect::<Result<_>>()?;
    if let Some(r) = env.experts_fused(layer, x, &per, k, &bases, limit) {
        return r;
    }
    let mut acc = vec![0.0f32; t * d];
    for (ex, toks) in per.iter().enumerate() {
        if toks.is_empty() {
            continue;
        }
        let mut xs = Vec::with_capacity(toks.len() * d);
        for &(ti, _) in toks {
            xs.extend_from_slice(&x.data[ti * d..(ti + 1) * d]);
        }
        let xs = Tensor::new(vec![toks.len(), d], xs);
        let sub = format!("L{layer}.ffn.expert.{ex}");
        let a = swiglu_hidden(
            env,
            &sub,
            &xs,
            weight(op, 3 * ex)?,
            weight(op, 3 * ex + 1)?,
            limit,
        )?;
        let w2 = weight(op, 3 * ex + 2)?;
        let y = linear_checked(env, &format!("{sub}.w2"), &a, w2, d)?;
        // Routing weight applied after w2 (vLLM/HF order), accumulated in f32.
        for (i, &(ti, w)) in toks.iter().enumerate() {
            let yr = &y.data[i * d..(i + 1) * d];
            acc[ti * d..(ti + 1) * d]
                .iter_mut()
                .zip(yr)
                .for_each(|(o, v)| *o += w * v);
        }
    }
    Ok(Tensor::new(vec![t, d], acc))
}

fn shared(op: &Op, x: &Tensor, env: &mut dyn OpEnv, cfg: &ModelConfig) -> Result<Tensor> {
    let layer = layer_of(op)?;
    let d = cfg.hidden_size;
    let t = x.rows();
    if cfg.n_shared_experts == 0 {
        return Ok(Tensor::zeros(vec![t, d]));
    }
    let sub = format!("L{layer}.ffn.shared");
    let a = swiglu_hidden(
        env,
        &sub,
        x,
        weight(op, 0)?,
        weight(op, 1)?,
        cfg.swiglu_limit as f32,
    )?;
    let mut y = linear_checked(env, &format!("{sub}.w2"), &a, weight(op, 2)?, d)?;
    env.store(&mut y);
    Ok(y)
}
