//! Attention core and the CSA indexer (docs/DSV4-LAYER.md §3.4 steps 7–9, §3.5.3).
//!
//! The numerics live behind the path's `device::Device` (`device::kern` on the host,
//! `backend::layer` on the GPU), which agree bit for bit: scores and weighted sums accumulate in
//! f64, softmax exponentials are evaluated in f64.

use super::env::{
    check_shape, internal, layer_of, layer_rope_freqs, linear_checked, param_n, weight, OpEnv,
};
use super::graph::Op;
use super::ModelConfig;
use crate::device::kern::{AttnDims, IndexerDims};
use crate::device::ops::RopeTable;
use crate::device::CmpRows;
use crate::{Error, Result, Tensor};

/// Selected compressed-row indices per query, [T, index_topk] as f32 with −1 for none, sorted
/// ascending (a set: its order carries no meaning, and sorted sets compare directly across paths).
pub(crate) fn indexer(
    op: &Op,
    inputs: &[&Tensor],
    env: &mut dyn OpEnv,
    cfg: &ModelConfig,
) -> Result<Tensor> {
    let layer = layer_of(op)?;
    let (x, qr) = (inputs[0], inputs[1]);
    let t = x.rows();
    let kk = cfg.index_topk;
    let ratio = cfg.ratio(layer);
    if ratio == 0 {
        return Err(internal(op, "indexer on a layer without compression"));
    }
    let n_c = t / ratio;
    let causal = |ti: usize| ((ti + 1) / ratio).min(n_c);
    let mut out = vec![-1.0f32; t * kk];
    if kk == 0 {
        return Ok(Tensor::new(vec![t, 0], out));
    }
    // Every causal row fits in the budget: the selection is all of them, no scoring needed.
    if n_c <= kk {
        for ti in 0..t {
            for s in 0..causal(ti) {
                out[ti * kk + s] = s as f32;
            }
        }
        return Ok(Tensor::new(vec![t, kk], out));
    }
    let (hi, di) = (cfg.index_n_heads, cfg.index_head_dim);
    let rd = cfg.qk_rope_head_dim;
    if rd > di {
        return Err(internal(
            op,
            format!("rope dim {rd} exceeds index_head_dim {di}"),
        ));
    }
    let names = [
        weight(op, 2)?,
        weight(op, 3)?,
        weight(op, 4)?,
        weight(op, 5)?,
    ];
    let mut ki = compress(
        env,
        &format!("{}.compressor", op.id),
        x,
        names,
        ratio,
        di,
        layer,
    )?;
    env.cache_store(&format!("L{layer}.attn.indexer.kv"), &mut ki);

    let mut q = linear_checked(env, &format!("{}.wq_b", op.id), qr, weight(op, 0)?, hi * di)?;
    env.store(&mut q);
    // RoPE on the last rd dims of each head, at position = row (the device rounds as it stores)
    let tab = RopeTable::new(&layer_rope_freqs(cfg, layer), 0..t);
    let mut q = env.device().rope(&q, di, di - rd, &tab)?;
    env.cache_store(&format!("L{layer}.attn.indexer.q"), &mut q);

    let mut w = linear_checked(
        env,
        &format!("{}.weights_proj", op.id),
        x,
        weight(op, 1)?,
        hi,
    )?;
    env.store(&mut w);
    let sc = ((di as f64).powf(-0.5) * (hi as f64).powf(-0.5)) as f32;
    let d = IndexerDims {
        t,
        hi,
        di,
        n_c,
        ratio,
        kk,
        q0: 0,
    };
    // scores and top-k where the path's device runs (on the GPU nothing comes back to the host)
    env.device().indexer_topk(&q, &ki, &w, sc, d)
}

/// MQA over one latent row per key (K = V), sliding window + causal compressed rows (or the
/// indexer's selection) + a per-head sink logit; fp32 accumulation; inverse RoPE on the output.
pub(crate) fn attention(
    op: &Op,
    inputs: &[&Tensor],
    env: &mut dyn OpEnv,
    cfg: &ModelConfig,
) -> Result<Tensor> {
    let layer = layer_of(op)?;
    let ratio = cfg.ratio(layer);
    let (h, dh) = (cfg.num_attention_heads, cfg.head_dim);
    let hd = h * dh;
    let (q, kv) = (inputs[0], inputs[1]);
    let t = q.rows();
    check_shape(op, "q", q, &[t, hd])?;
    check_shape(op, "kv", kv, &[t, dh])?;
    let empty = Tensor::new(vec![0, dh], vec![]);
    let cmp = if let Some(n_c) = t.checked_div(ratio) {
        let c = inputs
            .get(2)
            .ok_or_else(|| internal(op, "compressed KV input missing"))?;
        check_shape(op, "compressed kv", c, &[n_c, dh])?;
        *c
    } else {
        &empty
    };
    let n_c = cmp.rows();
    let sel = if ratio > 0 {
        inputs.get(3).copied()
    } else {
        None
    };
    if let Some(s) = sel {
        // its entries are checked by the device, where the indexer left them
        check_shape(op, "indexer selection", s, &[t, cfg.index_topk])?;
    }
    let sink = param_n(env, weight(op, 0)?, h)?;
    let dims = AttnDims {
        t,
        h,
        dh,
        n_c,
        win: cfg.sliding_window,
        scale: (dh as f64).powf(-0.5) as f32,
        q0: 0,
        kv0: 0,
    };
    let freqs = layer_rope_freqs(cfg, layer);
    let nope = cfg.nope_dim();
    let chunk = env.chunk_rows().unwrap_or(t).max(1);
    let tab = RopeTable::new(&freqs, 0..t);
    // one call: the device runs the query chunks itself, so chunked outputs never leave it
    env.device()
        .attention(
            q,
            kv,
            cmp,
            CmpRows { ratio, sel },
            &sink.data,
            dims,
            nope,
            &tab,
            chunk,
        )
        .map_err(|e| match e {
            Error::Usage(m) => internal(op, m),
            e => e,
        })
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
