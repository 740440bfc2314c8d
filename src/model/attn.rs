//! Attention core and the CSA indexer (docs/DSV4-LAYER.md §3.4 steps 7–9, §3.5.3).
//!
//! The numerics live behind the path's `device::Device` (`device::kern` on the host,
//! `backend::layer` on the GPU), which agree bit for bit: scores and weighted sums accumulate in
//! f64, softmax exponentials are evaluated in f64.

use super::env::{
    check_shape, history, internal, join, layer_of, layer_rope_freqs, linear_checked, param_n,
    rows, weight, window, ChunkAt, OpEnv,
};
use super::graph::Op;
use super::ModelConfig;
use crate::device::kern::{AttnDims, IndexerDims};
use crate::device::ops::RopeTable;
use crate::device::CmpRows;
use crate::numerics::fp8_block::{INDEXER_KEY_GROUP, KV_GROUP};
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
    let at = chunk_of(env, t);
    // compressed rows of the whole prompt: the shortcut below is the same at every chunk
    let n_all = at.total / ratio;
    let causal = |ti: usize| ((at.start + ti + 1) / ratio).min(n_all);
    let mut out = vec![-1.0f32; t * kk];
    if kk == 0 {
        return Ok(Tensor::new(vec![t, 0], out));
    }
    // Every causal row fits in the budget: the selection is all of them, no scoring needed.
    if n_all <= kk {
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
    // the keys of the chunks before this one, then this chunk's
    let ki = history(env, &format!("{}.ki", op.id), ki, at)?;
    // the keys of earlier prefill chunks as the engine's FP8 indexer cache gives them back
    // (`--served-chunk`: one scale per 128-wide key)
    let ki = match env.cached_before() {
        Some(c0) => {
            let n = (c0 / ratio).min(ki.rows());
            cached_prefix(env, &ki, n, di, INDEXER_KEY_GROUP)?
        }
        None => ki,
    };

    let mut q = linear_checked(env, &format!("{}.wq_b", op.id), qr, weight(op, 0)?, hi * di)?;
    env.store(&mut q);
    // RoPE on the last rd dims of each head, at position = row (the device rounds as it stores)
    let tab = env.rope_table(&layer_rope_freqs(cfg, layer), at.start..at.start + t);
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
        n_c: ki.rows(),
        ratio,
        kk,
        q0: at.start,
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
    let cmp = if ratio > 0 {
        let c = inputs
            .get(2)
            .ok_or_else(|| internal(op, "compressed KV input missing"))?;
        // the compressed rows this chunk's tokens complete (all of them over the whole prompt)
        let (_, b0, b1) = blocks(env, t, ratio);
        check_shape(op, "compressed kv", c, &[b1 - b0, dh])?;
        *c
    } else {
        &empty
    };
    let at = chunk_of(env, t);
    // a later chunk: its window reaches back into the chunks before, and every compressed row
    // so far is a key
    let (kv, cmp) = if env.chunk_at().is_some() {
        let tail = cfg.sliding_window.saturating_sub(1);
        let kv = window(env, &window_key(&op.id), kv, at, tail)?;
        let cmp = history(env, &format!("{}.cmp", op.id), cmp.clone(), at)?;
        (kv, cmp)
    } else {
        (kv.clone(), cmp.clone())
    };
    // the keys of earlier prefill chunks as the engine's KV cache gives them back
    // (`--served-chunk`); this chunk's as computed
    let (kv, cmp) = match env.cached_before() {
        Some(c0) => {
            let nope = cfg.nope_dim();
            let kv0 = at.start + t - kv.rows();
            let nk = c0.saturating_sub(kv0).min(kv.rows());
            // compressed row b is complete once token (b + 1)·ratio − 1 is
            let nc = c0.checked_div(ratio).unwrap_or(0).min(cmp.rows());
            (
                cached_prefix(env, &kv, nk, nope, KV_GROUP)?,
                cached_prefix(env, &cmp, nc, nope, KV_GROUP)?,
            )
        }
        None => (kv, cmp),
    };
    let (kv, cmp) = (&kv, &cmp);
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
        q0: at.start,
        kv0: at.start + t - kv.rows(),
    };
    let freqs = layer_rope_freqs(cfg, layer);
    let nope = cfg.nope_dim();
    let chunk = env.chunk_rows().unwrap_or(t).max(1);
    let tab = env.rope_table(&freqs, at.start..at.start + t);
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
    let at = chunk_of(env, x.rows());
    let (n, b0, b1) = blocks(env, x.rows(), ratio);
    let chunked = env.chunk_at().is_some();
    let w = if ratio == 4 { 2 * dc } else { dc };
    // the first block a pooling over blocks from `b` reads (ratio 4: the one before it too)
    let first_read = |b: usize| if ratio == 4 && b > 0 { b - 1 } else { b };
    let [ka, kg] = state_keys(sub_prefix);
    let carried = match chunked {
        true => env.take_carry(&ka).zip(env.take_carry(&kg)),
        false => None,
    };
    if n == 0 && b1 == b0 && carried.is_none() {
        return Ok(Tensor::new(vec![0, dc], vec![]));
    }
    // the linears of the tokens of whole blocks only (rows n.. of the chunk complete none)
    let (a, g) = if n > 0 {
        let xs = if n == x.rows() {
            x.clone() // shares device values, if any
        } else {
            env.device().cat_rows(&[(x, 0..n)])?
        };
        let a = linear_checked(env, &format!("{sub_prefix}.wkv"), &xs, names[0], w)?;
        let g = linear_checked(env, &format!("{sub_prefix}.wgate"), &xs, names[1], w)?;
        (a, g)
    } else {
        let e = Tensor::new(vec![0, w], vec![]);
        (e.clone(), e)
    };
    // rows [s0, at.start + n): what earlier chunks left, then this chunk's
    let (a, g, s0) = match carried {
        Some((ca, cg)) => {
            let s0 = at.start - ca.rows();
            (join(env, &ca, &a)?, join(env, &cg, &g)?, s0)
        }
        None => (a, g, at.start),
    };
    let ck = if b1 > b0 {
        let ape = param_n(env, names[2], ratio * w)?;
        let norm = param_n(env, names[3], dc)?;
        let rd = cfg.qk_rope_head_dim;
        if rd > dc {
            return Err(Error::usage(format!(
                "{sub_prefix}: rope dim {rd} exceeds compressed width {dc}"
            )));
        }
        // pooled from block bs on; the rows before b0 (a block whose previous block this chunk
        // no longer holds) were emitted by the chunk before, and are dropped
        let bs = first_read(b0);
        let span = bs * ratio - s0..b1 * ratio - s0;
        let (a, g) = (rows(env, &a, span.clone())?, rows(env, &g, span)?);
        let tab = RopeTable::new(&layer_rope_freqs(&cfg, layer), (bs..b1).map(|b| b * ratio));
        let eps = cfg.rms_norm_eps as f32;
        let ck = env.device().compress_tail(
            &a,
            &g,
            &ape.data,
            &norm.data,
            b1 - bs,
            dc,
            ratio,
            eps,
            &tab,
        )?;
        rows(env, &ck, b0 - bs..b1 - bs)?
    } else {
        Tensor::new(vec![0, dc], vec![])
    };
    // what the next chunk's pooling reads of these rows (nothing once the prompt's last whole
    // block is done)
    let end = at.start + n;
    if chunked && end == at.end && at.end < at.total {
        let keep = first_read(b1) * ratio - s0..end - s0;
        let (ca, cg) = (rows(env, &a, keep.clone())?, rows(env, &g, keep)?);
        env.put_carry(&ka, ca);
        env.put_carry(&kg, cg);
    }
    Ok(ck)
}

/// The carry keys of a compressor's state (`sub_prefix`: the op id of a compressor, `{id}.compressor`
/// for the indexer's): the linear outputs `a` and `g` of the rows whose blocks are not pooled yet.
pub fn state_keys(sub_prefix: &str) -> [String; 2] {
    [format!("{sub_prefix}.a"), format!("{sub_prefix}.g")]
}

/// The carry key of the attention's sliding-window KV rows (op id `attention`).
pub fn window_key(attention: &str) -> String {
    format!("{attention}.kv")
}

/// The compressor state keys of op `op` ([`state_keys`]): a compressor's own, the indexer's
/// compressor's; none for other ops.
pub fn op_state_keys(op: &Op) -> Vec<String> {
    use super::graph::OpKind;
    match op.kind {
        OpKind::Compressor => state_keys(&op.id).to_vec(),
        OpKind::Indexer => state_keys(&format!("{}.compressor", op.id)).to_vec(),
        _ => Vec::new(),
    }
}

/// Where an op's rows sit in the prompt: its token chunk, or the whole prompt of `t` tokens.
fn chunk_of(env: &dyn OpEnv, t: usize) -> ChunkAt {
    env.chunk_at().unwrap_or(ChunkAt {
        start: 0,
        end: t,
        total: t,
    })
}

/// A compressor over the `t` rows of a token chunk: (the chunk's rows it reads, the compressed
/// rows [b0, b1) it completes). Only the prompt's whole blocks are read (its tokens below
/// ⌊total / ratio⌋·ratio), as over the whole prompt at once; b1 − b0 rows come out.
pub(crate) fn blocks(env: &dyn OpEnv, t: usize, ratio: usize) -> (usize, usize, usize) {
    blocks_at(chunk_of(env, t), ratio)
}

/// [`blocks`] of the tokens `at`.
pub fn blocks_at(at: ChunkAt, ratio: usize) -> (usize, usize, usize) {
    let lim = at.total / ratio * ratio;
    let xe = at.end.min(lim).max(at.start);
    (xe - at.start, at.start / ratio, xe / ratio)
}

/// `x` with its first `n` rows read back from an engine's FP8 cache (`Device::kv_cache_fp8`: dims
/// [0, nope) per `group`).
fn cached_prefix(
    env: &dyn OpEnv,
    x: &Tensor,
    n: usize,
    nope: usize,
    group: usize,
) -> Result<Tensor> {
    if n == 0 {
        return Ok(x.clone());
    }
    let head = env
        .device()
        .kv_cache_fp8(&rows(env, x, 0..n)?, nope, group)?;
    if n == x.rows() {
        return Ok(head);
    }
    // the rest straight from x (one copy)
    env.device().cat_rows(&[(&head, 0..n), (x, n..x.rows())])
}
