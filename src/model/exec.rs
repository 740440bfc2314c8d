//! The math of every op (docs/DSV4-LAYER.md §3), written against an [`OpEnv`] that supplies weights and
//! decides numerics. `exec` holds no weights between ops: every linear goes through the env, which
//! loads (and may quantise) per call, so memory stays bounded by one op and only routed experts are
//! ever read.

use std::collections::HashMap;

use super::graph::{Op, OpClass, OpKind};
use super::ModelConfig;
use crate::device::kern::{self, HcParams};
use crate::device::ops::sigmoid;

use crate::{Error, Result, Tensor};

use super::attn::compress;
use super::env::*;
pub use super::env::{layer_rope_freqs, OpEnv};

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
            if let Some(b) = op.weights.get(1) {
                // a family's biased projection (gpt-oss): x @ Wᵀ + b, stored once
                y = add_bias(env, &y, b)?;
            } else if op.class != OpClass::Head {
                // Logits stay fp32 (REF computes the head in fp32); everything else is a stored activation.
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
            let p0 = pos0(env);
            let tab = env.rope_table(&layer_rope_freqs(&cfg, layer), p0..p0 + t);
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
        OpKind::HeadNorm
        | OpKind::HeadRope
        | OpKind::GqaAttention
        | OpKind::Mlp
        | OpKind::LatentNorm
        | OpKind::MlaAttention
        | OpKind::GptOssExperts => {
            vec![super::family::ops::exec(op, inputs, env, &cfg)?]
        }
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
    let p0 = pos0(env);
    let tab = env.rope_table(&layer_rope_freqs(cfg, layer), p0..p0 + t);
    let nope = cfg.nope_dim();
    let eps = cfg.rms_norm_eps as f32;
    env.device().q_rope(q, h, dh, nope, &tab, eps)
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
    let mut logits = linear_checked(env, &op.id, x, gate, e)?;
    let logit_bias = cfg.family.as_ref().is_some_and(|f| f.router_logit_bias);
    if logit_bias {
        // gpt-oss: the gate is a biased linear, its logits stored once with the bias
        logits = add_bias(env, &logits, weight(op, 1)?)?;
    } else if cfg.family.as_ref().is_some_and(|f| f.router_logits_stored) {
        // engines and transformers that run the gate in the activation dtype round its logits
        env.store(&mut logits);
    }
    let f = kern::Scoring::parse(&cfg.scoring_func).ok_or_else(|| {
        Error::usage(format!(
            "config: unsupported scoring_func `{}`",
            cfg.scoring_func
        ))
    })?;
    let (norm, rs) = (cfg.norm_topk_prob, cfg.routed_scaling_factor as f32);
    let route = kern::Routing {
        t,
        e,
        k,
        f,
        norm,
        rs,
    };
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
        let wts = env.device().hash_route(&logits, &idx, route)?;
        (wts, idx)
    } else if let Some(fam) = cfg.family.as_ref().filter(|f| f.n_group > 1) {
        // DeepSeek-V3's group-limited top-k
        let bias = param_n(env, weight(op, 1)?, e)?;
        let scores = kern::route_scores(&logits.data, e, f);
        let idx = super::family::ops::select_grouped(&scores, &bias.data, t, e, k, fam);
        (kern::route_weights(&scores, &idx, t, e, k, norm, rs), idx)
    } else {
        // a router without a selection bias (Qwen3-MoE, gpt-oss) selects on the scores alone;
        // gpt-oss's softmax over the k chosen logits is the full softmax renormalized over them
        let bias = match op.weights.get(1).filter(|_| !logit_bias) {
            Some(name) => param_n(env, name, e)?.data.to_vec(),
            None => vec![0.0; e],
        };
        env.device().route(&logits, &bias, route)?
    };
    Ok(vec![
        Tensor::new(vec![t, k], wts),
        Tensor::new(
            vec![t, k],
            idx.iter().map(|&i| i as f32).collect::<Vec<f32>>(),
        ),
    ])
}

fn experts(op: &Op, inputs: &[&Tensor], env: &mut dyn OpEnv, cfg: &ModelConfig) -> Result<Tensor> {
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
    // the served path's engine emulation: the routed scaling dropped or applied twice
    let g = env.routed_weight_factor(layer_of(op)?);
    let ids = routed_ids(op, idx, e)?;
    let mut per: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e];
    for (s, &ex) in ids.iter().enumerate() {
        let w = wts.data[s];
        per[ex].push((s / k, if g == 1.0 { w } else { w * g }));
    }
    experts_over(op, x, &per, k, env, cfg)
}

/// The expert of every (token, slot) of a router's ids [t, k], token-major, each checked to be
/// an integer < `e`.
fn routed_ids(op: &Op, idx: &Tensor, e: usize) -> Result<Vec<usize>> {
    idx.data
        .iter()
        .map(|&v| {
            as_index(v, e)
                .ok_or_else(|| internal(op, format!("expert id {v} is not an integer < {e}")))
        })
        .collect()
}

/// The routed experts over x [t, d] with `per[e]` = (row, routing weight) of expert e, `k` slots
/// per row: fused where the env's machine has it, else expert by expert.
fn experts_over(
    op: &Op,
    x: &Tensor,
    per: &[Vec<(usize, f32)>],
    k: usize,
    env: &mut dyn OpEnv,
    cfg: &ModelConfig,
) -> Result<Tensor> {
    let layer = layer_of(op)?;
    let (t, d, e) = (x.rows(), cfg.hidden_size, cfg.n_routed_experts);
    let bases: Vec<&str> = (0..3 * e).map(|i| weight(op, i)).collect::<Result<_>>()?;
    let limit = match bases.first() {
        Some(b) => env.swiglu_limit(b),
        None => cfg.swiglu_limit as f32,
    };
    if let Some(r) = env.experts_fused(layer, x, per, k, &bases, limit) {
        return r;
    }
    let mut acc = vec![0.0f32; t * d];
    for (ex, toks) in per.iter().enumerate() {
        if toks.is_empty() {
            continue;
        }
        let xs = expert_rows(x, toks, d);
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
        add_routed(&mut acc, &y, toks, d);
    }
    Ok(Tensor::new(vec![t, d], acc))
}

/// Rows given to an expert no token reached when the run exercises every expert
/// (`--exercise-experts`, as calibration does): the prompt's first rows, at most this many.
pub const EXERCISE_ROWS: usize = 8;

/// Each routed expert's own output, unweighted, on the rows routed to it: a routed-experts op
/// (`OpKind::Experts`, inputs x [t, d], routing weights and ids [t, k]) run once over one row per
/// (token, slot) with weight 1, so that row s is expert `owner[s]`'s output on its token. With
/// `exercise`, every expert no token reached also gets the first [`EXERCISE_ROWS`] rows (they do
/// not enter the model's output: this is a measurement beside the op). Returns (rows [s, d],
/// owner of each row, its token).
pub fn experts_by_expert(
    op: &Op,
    inputs: &[&Tensor],
    env: &mut dyn OpEnv,
    exercise: bool,
) -> Result<(Tensor, Vec<usize>, Vec<usize>)> {
    let cfg = env.cfg().clone();
    let (x, idx) = (inputs[0], inputs[2]);
    let (d, e, k) = (
        cfg.hidden_size,
        cfg.n_routed_experts,
        cfg.num_experts_per_tok,
    );
    let t = x.rows();
    check_shape(op, "x", x, &[t, d])?;
    check_shape(op, "expert ids", idx, &[t, k])?;
    let mut reached = vec![false; e];
    let mut slots: Vec<(usize, usize)> = routed_ids(op, idx, e)?
        .into_iter()
        .enumerate()
        .map(|(s, ex)| {
            reached[ex] = true;
            (ex, s / k)
        })
        .collect();
    if exercise {
        for (ex, r) in reached.iter().enumerate() {
            if !r {
                slots.extend((0..t.min(EXERCISE_ROWS)).map(|ti| (ex, ti)));
            }
        }
    }
    let mut per: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e];
    for (s, &(ex, _)) in slots.iter().enumerate() {
        per[ex].push((s, 1.0));
    }
    let tokens: Vec<(usize, f32)> = slots.iter().map(|&(_, ti)| (ti, 1.0)).collect();
    let xs = expert_rows(x, &tokens, d);
    let y = match op.kind {
        OpKind::GptOssExperts => {
            super::family::ops::gpt_oss::experts_over(op, &xs, &per, env, &cfg)?
        }
        _ => experts_over(op, &xs, &per, 1, env, &cfg)?,
    };
    Ok((
        y,
        slots.iter().map(|s| s.0).collect(),
        slots.iter().map(|s| s.1).collect(),
    ))
}

fn shared(op: &Op, x: &Tensor, env: &mut dyn OpEnv, cfg: &ModelConfig) -> Result<Tensor> {
    let layer = layer_of(op)?;
    let d = cfg.hidden_size;
    let t = x.rows();
    if cfg.n_shared_experts == 0 {
        return Ok(Tensor::zeros(vec![t, d]));
    }
    let sub = format!("L{layer}.ffn.shared");
    let limit = env.swiglu_limit(weight(op, 0)?);
    let a = swiglu_hidden(env, &sub, x, weight(op, 0)?, weight(op, 1)?, limit)?;
    let mut y = linear_checked(env, &format!("{sub}.w2"), &a, weight(op, 2)?, d)?;
    env.store(&mut y);
    Ok(y)
}
