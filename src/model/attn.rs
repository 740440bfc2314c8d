//! Attention core and the CSA indexer (DSV4-LAYER.md §3.4 steps 7–9, §3.5.3).
//!
//! Both work on blocks of queries so the score matrices are GEMMs (`matrixmultiply`) over only
//! the keys a block can see: the sliding window [t0−W+1, t1) and the compressed rows visible at
//! t1−1. Blocks run in parallel with rayon; each writes its own rows of the output.

use rayon::prelude::*;

use super::exec::{
    check_shape, internal, layer_of, layer_rope_freqs, linear_checked, param_n, weight, OpEnv,
};
use super::graph::Op;
use super::ops::{gemm, topk_order, RopeTable};
use super::ModelConfig;
use crate::{Result, Tensor};

/// Queries per parallel block.
const QB: usize = 32;

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
    let mut ki = super::exec::compress(
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

    out.par_chunks_mut(QB * kk)
        .enumerate()
        .for_each(|(cb, oc)| {
            let t0 = cb * QB;
            let nb = oc.len() / kk;
            let nvis = causal(t0 + nb - 1);
            if nvis == 0 {
                return;
            }
            let mut s = vec![0.0f32; nb * hi * nvis];
            gemm(
                nb * hi,
                di,
                nvis,
                &q.data[t0 * hi * di..],
                (di, 1),
                &ki.data,
                (1, di),
                &mut s,
                (nvis, 1),
                false,
            );
            let mut score = vec![0.0f32; nvis];
            let mut order: Vec<usize> = Vec::with_capacity(nvis);
            for i in 0..nb {
                let ti = t0 + i;
                let m = causal(ti);
                let o = &mut oc[i * kk..(i + 1) * kk];
                if m <= kk {
                    (0..m).for_each(|s| o[s] = s as f32);
                    continue;
                }
                score[..m].iter_mut().for_each(|v| *v = 0.0);
                for h in 0..hi {
                    let wh = w.data[ti * hi + h];
                    let row = &s[(i * hi + h) * nvis..(i * hi + h) * nvis + m];
                    score[..m]
                        .iter_mut()
                        .zip(row)
                        .for_each(|(a, b)| *a += b.max(0.0) * wh);
                }
                order.clear();
                order.extend(0..m);
                // Descending score, exact ties toward the lower index; NaN never wins.
                order.sort_by(|&a, &b| topk_order(score[a], a, score[b], b));
                let mut pick = order[..kk].to_vec();
                pick.sort_unstable();
                for (slot, p) in o.iter_mut().zip(pick) {
                    *slot = p as f32;
                }
            }
        });
    Ok(Tensor::new(vec![t, kk], out))
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
        check_shape(op, "compressed kv", c, &[t / ratio, dh])?;
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
    let win = cfg.sliding_window;
    let scale = (dh as f64).powf(-0.5) as f32;
    let kk = cfg.index_topk;

    // One task per (query block, head): enough tasks for many cores even at small T.
    let n_blocks = t.div_ceil(QB);
    let parts: Vec<Vec<f32>> = (0..n_blocks * h)
        .into_par_iter()
        .map(|task| {
            let (cb, head) = (task / h, task % h);
            let t0 = cb * QB;
            let t1 = (t0 + QB).min(t);
            let nb = t1 - t0;
            let mut oc = vec![0.0f32; nb * dh];
            let wlo = t0.saturating_sub(win.saturating_sub(1));
            let nw = t1 - wlo;
            let nvis = t1.checked_div(ratio).unwrap_or(0).min(n_c);
            let ncol = nw + nvis;
            // Which compressed rows each query may use.
            let mut allowed = vec![false; nb * nvis];
            for i in 0..nb {
                let ti = t0 + i;
                let m = (ti + 1).checked_div(ratio).unwrap_or(0).min(nvis);
                let a = &mut allowed[i * nvis..(i + 1) * nvis];
                match sel {
                    Some(s) => {
                        for &v in &s.data[ti * kk..(ti + 1) * kk] {
                            if v >= 0.0 && (v as usize) < m {
                                a[v as usize] = true;
                            }
                        }
                    }
                    None => a[..m].iter_mut().for_each(|x| *x = true),
                }
            }
            let mut p = vec![0.0f32; nb * ncol];
            {
                let qa = &q.data[t0 * hd + head * dh..];
                gemm(
                    nb,
                    dh,
                    nw,
                    qa,
                    (hd, 1),
                    &kv.data[wlo * dh..],
                    (1, dh),
                    &mut p,
                    (ncol, 1),
                    false,
                );
                if nvis > 0 {
                    gemm(
                        nb,
                        dh,
                        nvis,
                        qa,
                        (hd, 1),
                        &cmp.data,
                        (1, dh),
                        &mut p[nw..],
                        (ncol, 1),
                        false,
                    );
                }
                let sk = sink.data[head];
                for i in 0..nb {
                    let ti = t0 + i;
                    let row = &mut p[i * ncol..(i + 1) * ncol];
                    let mut mx = sk;
                    for (j, v) in row.iter_mut().enumerate() {
                        let ok = if j < nw {
                            let key = wlo + j;
                            key <= ti && ti - key < win
                        } else {
                            allowed[i * nvis + j - nw]
                        };
                        *v = if ok { *v * scale } else { f32::NEG_INFINITY };
                        mx = mx.max(*v);
                    }
                    let mut den = (sk - mx).exp();
                    for v in row.iter_mut() {
                        *v = (*v - mx).exp();
                        den += *v;
                    }
                    row.iter_mut().for_each(|v| *v /= den);
                }
                let oh = &mut oc[..];
                gemm(
                    nb,
                    nw,
                    dh,
                    &p,
                    (ncol, 1),
                    &kv.data[wlo * dh..],
                    (dh, 1),
                    oh,
                    (dh, 1),
                    false,
                );
                if nvis > 0 {
                    gemm(
                        nb,
                        nvis,
                        dh,
                        &p[nw..],
                        (ncol, 1),
                        &cmp.data,
                        (dh, 1),
                        oh,
                        (dh, 1),
                        true,
                    );
                }
            }
            oc
        })
        .collect();
    let mut out = vec![0.0f32; t * hd];
    for (task, part) in parts.iter().enumerate() {
        let (cb, head) = (task / h, task % h);
        for (i, row) in part.chunks(dh).enumerate() {
            let o = (cb * QB + i) * hd + head * dh;
            out[o..o + dh].copy_from_slice(row);
        }
    }
    let mut out = Tensor::new(vec![t, hd], out);
    env.store(&mut out);
    let tab = RopeTable::new(&layer_rope_freqs(cfg, layer), 0..t);
    let nope = cfg.nope_dim();
    for (pos, row) in out.data.chunks_mut(hd).enumerate() {
        for head in row.chunks_mut(dh) {
            tab.apply(&mut head[nope..], pos, true);
        }
    }
    env.store(&mut out);
    Ok(out)
}
