//! Attention core and the CSA indexer (docs/DSV4-LAYER.md §3.4 steps 7–9, §3.5.3).
//!
//! The numerics live behind the path's `device::Device` (`device::kern` on the host,
//! `backend::layer` on the GPU), which agree bit for bit: scores and weighted sums accumulate in
//! f64, softmax exponentials are evaluated in f64.

use rayon::prelude::*;

use super::env::{
    check_shape, internal, layer_of, layer_rope_freqs, linear_checked, param_n, weight, OpEnv,
};
use super::graph::Op;
use super::ModelConfig;
use crate::device::kern::{self, AttnDims, CmpKeys};
use crate::device::ops::{topk_order, RopeTable};
use crate::device::Device;
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
    let tab = RopeTable::new(&layer_rope_freqs(cfg, layer), 0..t);
    for (p, row) in q.data.chunks_mut(hi * di).enumerate() {
        for head in row.chunks_mut(di) {
            tab.apply(&mut head[di - rd..], p, false);
        }
    }
    env.store(&mut q);
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
    w.data.iter_mut().for_each(|v| *v *= sc);

    let rows = kern::score_block_rows(n_c);
    let dims = (t, hi, di, n_c);
    select_blocks(
        &*env.device(),
        &q.data,
        &ki.data,
        &w.data,
        dims,
        ratio,
        kk,
        rows,
        &mut out,
    )?;
    Ok(Tensor::new(vec![t, kk], out))
}

/// Scores and top-k of the queries in blocks (q [t, hi·di], ki [n_c, di], w [t, hi]): each
/// block is scored against the compressed rows its last query may see (no score beyond the
/// causal count is ever needed), then each query keeps its top kk of its causal rows, sorted
/// ascending, into `out` [t, kk]. A query with no more causal rows than kk keeps them all.
#[allow(clippy::too_many_arguments)]
fn select_blocks(
    dev: &dyn Device,
    q: &[f32],
    ki: &[f32],
    w: &[f32],
    (t, hi, di, n_c): (usize, usize, usize, usize),
    ratio: usize,
    kk: usize,
    rows: usize,
    out: &mut [f32],
) -> Result<()> {
    let causal = |ti: usize| ((ti + 1) / ratio).min(n_c);
    let rows = rows.max(1);
    let mut t0 = 0;
    while t0 < t {
        let t1 = (t0 + rows).min(t);
        // every query of the block keeps all its causal rows: nothing to score
        let m_b = causal(t1 - 1);
        let scores = if m_b > kk {
            dev.indexer_scores(
                &q[t0 * hi * di..t1 * hi * di],
                &ki[..m_b * di],
                &w[t0 * hi..t1 * hi],
                t1 - t0,
                hi,
                di,
                m_b,
            )?
        } else {
            Vec::new()
        };
        out[t0 * kk..t1 * kk]
            .par_chunks_mut(kk)
            .enumerate()
            .for_each(|(i, o)| {
                let m = causal(t0 + i);
                if m <= kk {
                    (0..m).for_each(|s| o[s] = s as f32);
                    return;
                }
                let score = &scores[i * m_b..i * m_b + m];
                let mut order: Vec<usize> = (0..m).collect();
                // Descending score, exact ties toward the lower index; NaN never wins. A total
                // order, so the kk first are the same set as after a full sort.
                order.select_nth_unstable_by(kk - 1, |&a, &b| topk_order(score[a], a, score[b], b));
                let mut pick = order[..kk].to_vec();
                pick.sort_unstable();
                for (slot, p) in o.iter_mut().zip(pick) {
                    *slot = p as f32;
                }
            });
        t0 = t1;
    }
    Ok(())
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
        check_shape(op, "indexer selection", s, &[t, cfg.index_topk])?;
        if let Some(v) = s
            .data
            .iter()
            .find(|&&v| v != -1.0 && !(v >= 0.0 && v.fract() == 0.0 && (v as usize) < n_c))
        {
            return Err(internal(
                op,
                format!("indexer entry {v} is neither −1 nor a row < {n_c}"),
            ));
        }
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
    let kk = cfg.index_topk;
    let lists = sel.map(|s| kern::selection_lists(&s.data, kk, n_c));
    let keys = CmpKeys {
        ratio,
        sel: lists.as_deref().map(|l| (l, kk)),
    };
    let freqs = layer_rope_freqs(cfg, layer);
    let nope = cfg.nope_dim();
    let chunk = env.chunk_rows().unwrap_or(t).max(1);
    if chunk >= t {
        let tab = RopeTable::new(&freqs, 0..t);
        return env
            .device()
            .attention(q, kv, cmp, keys, &sink.data, dims, nope, &tab);
    }
    // Chunks of queries [q0, q1): each sees the kv rows from its first query's window on and
    // every compressed row (the causal count and the selection lists stay per query), so each
    // query's keys, their order and the result are those of one call over the prompt.
    let rows = |x: &Tensor, a: usize, b: usize| {
        let c = x.cols();
        Tensor::new(vec![b - a, c], x.data[a * c..b * c].to_vec())
    };
    let mut out = Vec::with_capacity(t * hd);
    let mut q0 = 0;
    while q0 < t {
        let q1 = (q0 + chunk).min(t);
        let kv0 = (q0 + 1).saturating_sub(dims.win).min(q0);
        let part = AttnDims {
            t: q1 - q0,
            q0,
            kv0,
            ..dims
        };
        let part_keys = CmpKeys {
            ratio,
            sel: lists.as_deref().map(|l| (&l[q0 * kk..q1 * kk], kk)),
        };
        let tab = RopeTable::new(&freqs, q0..q1);
        let y = env.device().attention(
            &rows(q, q0, q1),
            &rows(kv, kv0, q1),
            cmp,
            part_keys,
            &sink.data,
            part,
            nope,
            &tab,
        )?;
        out.extend_from_slice(&y.data[..]);
        q0 = q1;
    }
    // each chunk was stored (rounded) by the path's device already
    Ok(Tensor::new(vec![t, hd], out))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::CpuDevice;
    use crate::model::mem_env::Rng;

    /// Scoring and selecting in query blocks of any size picks, for every query, the top kk of
    /// its causal rows by an independent full sort of the whole [t, n_c] scores.
    #[test]
    fn blocks_of_any_size_select_what_a_full_sort_selects() {
        let (t, hi, di, n_c, ratio, kk) = (57usize, 3usize, 8usize, 14usize, 4usize, 3usize);
        let mut rng = Rng::new(9);
        let q = rng.normals(t * hi * di, 0.0, 1.0);
        let mut ki = rng.normals(n_c * di, 0.0, 1.0);
        // two equal rows: exact ties go to the lower index
        let (a, b) = (ki[2 * di..3 * di].to_vec(), 5 * di);
        ki[b..b + di].copy_from_slice(&a);
        let w = rng.normals(t * hi, 0.0, 0.3);
        let scores = kern::indexer_scores(&q, &ki, &w, t, hi, di, n_c);
        let mut want = vec![-1.0f32; t * kk];
        for ti in 0..t {
            let m = ((ti + 1) / ratio).min(n_c);
            let mut order: Vec<usize> = (0..m).collect();
            let s = &scores[ti * n_c..(ti + 1) * n_c];
            order.sort_by(|&x, &y| topk_order(s[x], x, s[y], y));
            let mut pick = order[..m.min(kk)].to_vec();
            pick.sort_unstable();
            for (j, p) in pick.into_iter().enumerate() {
                want[ti * kk + j] = p as f32;
            }
        }
        let dev = CpuDevice::new(|_: &mut Tensor| {});
        for rows in [1usize, 5, 16, t] {
            let mut out = vec![-1.0f32; t * kk];
            let dims = (t, hi, di, n_c);
            select_blocks(&dev, &q, &ki, &w, dims, ratio, kk, rows, &mut out).unwrap();
            assert_eq!(out, want, "blocks of {rows} rows");
        }
    }
}
