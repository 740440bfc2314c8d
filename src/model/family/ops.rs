//! The math of the families' own ops ([`OpKind::HeadNorm`], [`OpKind::HeadRope`],
//! [`OpKind::GqaAttention`], [`OpKind::Mlp`], MLA's, and gpt-oss's experts in [`gpt_oss`])
//! against `OpEnv` and the path's `Device`.
//!
//! The per-head norm and RoPE are the device's RMSNorm and RoPE over one row per head (the
//! half-split pairing of transformers' `rotate_half` is a fixed permutation of the rotary dims
//! into the device's interleaved pairs and back, which moves values without rounding them), so
//! they run wherever the device does. The grouped-query attention is host math in the
//! reference's manner (products summed exactly in f64, exponentials in f64, one rounding) and has
//! no CUDA version yet (`family::cuda_unsupported`).

mod gpt_oss;

use rayon::prelude::*;

use super::super::env::{check_shape, internal, layer_of, param_n, weight, OpEnv};
use super::super::op::{Op, OpKind};
use super::super::rope::rope_freqs;
use super::super::ModelConfig;
use super::kind::{Family, Kind, RopeStyle};
use crate::device::kern::{dot64, exp64, sum64};
use crate::device::ops::RopeTable;
use crate::{Result, Tensor};

/// Execute a family op (one output each).
pub fn exec(op: &Op, inputs: &[&Tensor], env: &mut dyn OpEnv, cfg: &ModelConfig) -> Result<Tensor> {
    let fam = cfg
        .family
        .as_ref()
        .ok_or_else(|| internal(op, "a family op in a DeepSeek-V4 graph"))?;
    match op.kind {
        OpKind::HeadNorm => head_norm(op, inputs[0], env, cfg),
        OpKind::HeadRope => head_rope(op, inputs[0], env, cfg, fam),
        OpKind::GqaAttention => gqa(op, inputs, env, cfg, fam),
        OpKind::Mlp => mlp(op, inputs[0], env, cfg),
        OpKind::LatentNorm => latent_norm(op, inputs[0], env, cfg, fam),
        OpKind::MlaAttention => mla(op, inputs, env, cfg, fam),
        OpKind::GptOssExperts => gpt_oss::experts(op, inputs, env, cfg),
        _ => Err(internal(op, "not a family op")),
    }
}

/// RMSNorm of each head of x [t, n·dh] with the weight [dh] shared by the heads.
fn head_norm(op: &Op, x: &Tensor, env: &mut dyn OpEnv, cfg: &ModelConfig) -> Result<Tensor> {
    let dh = cfg.head_dim;
    let t = x.rows();
    if !x.cols().is_multiple_of(dh) {
        return Err(internal(
            op,
            format!("input {:?} is not whole heads of {dh}", x.shape),
        ));
    }
    let w = param_n(env, weight(op, 0)?, dh)?;
    let rows = Tensor::new(vec![x.numel() / dh, dh], x.data.clone());
    let y = env
        .device()
        .rmsnorm(&rows, &w.data, cfg.rms_norm_eps as f32)?;
    Ok(Tensor::new(vec![t, x.cols()], y.data))
}

/// The rope frequencies of a family (the rope's own dims), with the attention factor applied
/// to cos and sin as transformers does.
fn rope_table(
    cfg: &ModelConfig,
    fam: &Family,
    positions: impl Iterator<Item = usize>,
) -> RopeTable {
    let freqs = rope_freqs(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.yarn.as_ref());
    let mut tab = RopeTable::new(&freqs, positions);
    let a = fam.rope_attention_factor as f32;
    if a != 1.0 {
        tab.cos.iter_mut().for_each(|c| *c *= a);
        tab.sin.iter_mut().for_each(|s| *s *= a);
    }
    tab
}

/// The position of rotary dim i in the device's interleaved pairs: half-split dim i pairs with
/// i + half, so i goes to 2i and i + half to 2i + 1.
fn interleaved_pos(i: usize, half: usize) -> usize {
    if i < half {
        2 * i
    } else {
        2 * (i - half) + 1
    }
}

/// RoPE on the last `qk_rope_head_dim` dims of each head of x [t, n·dh] at position = row.
fn head_rope(
    op: &Op,
    x: &Tensor,
    env: &mut dyn OpEnv,
    cfg: &ModelConfig,
    fam: &Family,
) -> Result<Tensor> {
    layer_of(op)?;
    // DeepSeek-V3's rope key is the tail of the kv_a row (latent, then rope): one head of it all
    let shared_key = fam.kind == Kind::DeepseekV3 && op.id.ends_with(".attn.k_rope");
    let (dh, r) = (
        if shared_key { x.cols() } else { cfg.head_dim },
        cfg.qk_rope_head_dim,
    );
    let t = x.rows();
    if dh < r {
        return Err(internal(
            op,
            format!("input {:?} is narrower than the rope's {r} dims", x.shape),
        ));
    }
    if !x.cols().is_multiple_of(dh) {
        return Err(internal(
            op,
            format!("input {:?} is not whole heads of {dh}", x.shape),
        ));
    }
    let n = x.cols() / dh;
    let nope = dh - r;
    let half = r / 2;
    let mut rows = x.data.to_vec();
    if fam.rope_style == RopeStyle::HalfSplit {
        permute_rope(&mut rows, dh, nope, half, false);
    }
    let tab = rope_table(cfg, fam, (0..t).flat_map(|p| std::iter::repeat_n(p, n)));
    let rows = Tensor::new(vec![t * n, dh], rows);
    let y = env.device().rope(&rows, dh, nope, &tab)?;
    let mut out = y.data.to_vec();
    if fam.rope_style == RopeStyle::HalfSplit {
        permute_rope(&mut out, dh, nope, half, true);
    }
    Ok(Tensor::new(vec![t, x.cols()], out))
}

/// Move each head's rotary dims between half-split and interleaved order (`back`: the inverse).
fn permute_rope(v: &mut [f32], dh: usize, nope: usize, half: usize, back: bool) {
    let mut tmp = vec![0.0f32; 2 * half];
    for head in v.chunks_mut(dh) {
        let rot = &mut head[nope..];
        for (i, &x) in rot.iter().enumerate() {
            let j = interleaved_pos(i, half);
            if back {
                tmp[i] = rot[j];
            } else {
                tmp[j] = x;
            }
        }
        rot.copy_from_slice(&tmp);
    }
}

/// Causal grouped-query attention: q [t, h·dq], k [t, kv·dq], v [t, kv·dv] → [t, h·dv]; query
/// head i reads key/value head i / (h / kv). Scores = f32(q·k in f64) · dq^-½, softmax with f64
/// exponentials and denominator, probabilities rounded to f32, output Σ p·v in f64 rounded once,
/// then stored.
fn gqa(
    op: &Op,
    inputs: &[&Tensor],
    env: &mut dyn OpEnv,
    cfg: &ModelConfig,
    fam: &Family,
) -> Result<Tensor> {
    let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
    let (h, kvh, dq, dv) = (
        cfg.num_attention_heads,
        fam.num_key_value_heads,
        cfg.head_dim,
        fam.v_head_dim,
    );
    let t = q.rows();
    check_shape(op, "q", q, &[t, h * dq])?;
    check_shape(op, "k", k, &[t, kvh * dq])?;
    check_shape(op, "v", v, &[t, kvh * dv])?;
    let sinks = match op.weights.first() {
        Some(name) => Some(param_n(env, name, h)?),
        None => None,
    };
    let dims = Gqa {
        t,
        h,
        kvh,
        dq,
        dv,
        scale: fam.attn_scale as f32,
        window: fam.window(cfg.sliding_window, layer_of(op)?),
    };
    let sinks = sinks.as_ref().map(|s| &s.data[..]);
    let mut y = Tensor::new(
        vec![t, h * dv],
        gqa_core(&q.data, &k.data, &v.data, sinks, dims),
    );
    env.store(&mut y);
    Ok(y)
}

/// RMSNorm of the leading `kv_lora_rank` dims of each row (MLA's key/value latent) → [t, r].
fn latent_norm(
    op: &Op,
    x: &Tensor,
    env: &mut dyn OpEnv,
    cfg: &ModelConfig,
    fam: &Family,
) -> Result<Tensor> {
    let r = fam.kv_lora_rank;
    let (t, c) = (x.rows(), x.cols());
    if c < r {
        return Err(internal(
            op,
            format!("input {:?} is narrower than the latent's {r} dims", x.shape),
        ));
    }
    let w = param_n(env, weight(op, 0)?, r)?;
    let lead: Vec<f32> = x
        .data
        .chunks(c)
        .flat_map(|row| row[..r].iter().copied())
        .collect();
    env.device().rmsnorm(
        &Tensor::new(vec![t, r], lead),
        &w.data,
        cfg.rms_norm_eps as f32,
    )
}

/// Multi-head latent attention (DeepSeek-V3, as transformers computes it): head i's key is
/// [k_nope_i, k_rope] with k_nope_i from `kv_b` and the rope key shared by every head, its value
/// v_i from `kv_b`; then the causal attention of [`gqa_core`] with the YaRN-scaled softmax scale.
fn mla(
    op: &Op,
    inputs: &[&Tensor],
    env: &mut dyn OpEnv,
    cfg: &ModelConfig,
    fam: &Family,
) -> Result<Tensor> {
    let (q, kvb, kva) = (inputs[0], inputs[1], inputs[2]);
    let (h, dq, dv, rope) = (
        cfg.num_attention_heads,
        cfg.head_dim,
        fam.v_head_dim,
        cfg.qk_rope_head_dim,
    );
    let nope = dq - rope;
    let t = q.rows();
    check_shape(op, "q", q, &[t, h * dq])?;
    check_shape(op, "kv_b", kvb, &[t, h * (nope + dv)])?;
    check_shape(op, "kv_a", kva, &[t, fam.kv_lora_rank + rope])?;
    let mut k = Vec::with_capacity(t * h * dq);
    let mut v = Vec::with_capacity(t * h * dv);
    for ti in 0..t {
        let row = &kvb.data[ti * h * (nope + dv)..(ti + 1) * h * (nope + dv)];
        let kr = &kva.data
            [(ti + 1) * (fam.kv_lora_rank + rope) - rope..(ti + 1) * (fam.kv_lora_rank + rope)];
        for head in row.chunks(nope + dv) {
            k.extend_from_slice(&head[..nope]);
            k.extend_from_slice(kr);
            v.extend_from_slice(&head[nope..]);
        }
    }
    let dims = Gqa {
        t,
        h,
        kvh: h,
        dq,
        dv,
        scale: fam.attn_scale as f32,
        window: None,
    };
    let mut y = Tensor::new(vec![t, h * dv], gqa_core(&q.data, &k, &v, None, dims));
    env.store(&mut y);
    Ok(y)
}

/// Shapes and constants of the grouped-query attention.
#[derive(Clone, Copy, Debug)]
pub struct Gqa {
    pub t: usize,
    pub h: usize,
    pub kvh: usize,
    pub dq: usize,
    pub dv: usize,
    pub scale: f32,
    /// Keys per query including itself (sliding layers); `None`: every earlier key.
    pub window: Option<usize>,
}

/// The attention core (see [`gqa`]); `sinks` adds a per-head logit to the denominator.
pub fn gqa_core(q: &[f32], k: &[f32], v: &[f32], sinks: Option<&[f32]>, a: Gqa) -> Vec<f32> {
    let Gqa {
        t,
        h,
        kvh,
        dq,
        dv,
        scale,
        window,
    } = a;
    let group = (h / kvh.max(1)).max(1);
    let mut out = vec![0.0f32; t * h * dv];
    out.par_chunks_mut(dv.max(1))
        .enumerate()
        .for_each(|(task, o)| {
            let (ti, head) = (task / h, task % h);
            let g = head / group;
            let qv = &q[(ti * h + head) * dq..(ti * h + head + 1) * dq];
            let lo = window.map_or(0, |w| (ti + 1).saturating_sub(w));
            let s: Vec<f32> = (lo..=ti)
                .map(|j| {
                    let kj = &k[(j * kvh + g) * dq..(j * kvh + g + 1) * dq];
                    (dot64(qv, kj) as f32) * scale
                })
                .collect();
            let sink = sinks.map(|s| s[head]);
            let mx = s
                .iter()
                .cloned()
                .fold(sink.unwrap_or(f32::NEG_INFINITY), f32::max);
            let den =
                sink.map_or(0.0, |sk| exp64(sk - mx)) + sum64(s.iter().map(|&x| exp64(x - mx)));
            let mut acc = vec![0.0f64; dv];
            for (j, &sj) in (lo..=ti).zip(&s) {
                let p = (exp64(sj - mx) / den) as f32 as f64;
                let vj = &v[(j * kvh + g) * dv..(j * kvh + g + 1) * dv];
                acc.iter_mut()
                    .zip(vj)
                    .for_each(|(a, &x)| *a += p * x as f64);
            }
            o.iter_mut().zip(&acc).for_each(|(o, a)| *o = *a as f32);
        });
    out
}

/// DeepSeek-V3's group-limited expert choice (transformers' `DeepseekV3MoE.route_tokens_to_experts`):
/// keys = scores + correction bias; each of `n_group` groups scores the sum of its two best keys;
/// the best `topk_group` groups are kept and the other experts' keys set to 0 (not −∞, as
/// transformers and vLLM mask them); then the top-k keys. Expert ids [t, k].
pub fn select_grouped(
    scores: &[f32],
    bias: &[f32],
    t: usize,
    e: usize,
    k: usize,
    fam: &Family,
) -> Vec<usize> {
    use crate::device::kern::topk_select;
    let (ng, kg) = (fam.n_group.max(1), fam.topk_group);
    let per = e / ng;
    let mut idx = vec![0usize; t * k];
    let mut keys = vec![0.0f32; e];
    let mut best = [0usize; 2];
    let mut groups = vec![0usize; kg];
    for ti in 0..t {
        for (j, kk) in keys.iter_mut().enumerate() {
            *kk = scores[ti * e + j] + bias[j];
        }
        let gs: Vec<f32> = keys
            .chunks(per)
            .map(|g| {
                topk_select(g, 2, &mut best);
                g[best[0]] + g[best[1]]
            })
            .collect();
        topk_select(&gs, kg, &mut groups);
        for (gi, g) in keys.chunks_mut(per).enumerate() {
            if !groups.contains(&gi) {
                g.iter_mut().for_each(|v| *v = 0.0);
            }
        }
        topk_select(&keys, k, &mut idx[ti * k..(ti + 1) * k]);
    }
    idx
}

/// A dense SwiGLU MLP: down(silu(gate(x)) · up(x)), the hidden stored, the output stored.
fn mlp(op: &Op, x: &Tensor, env: &mut dyn OpEnv, cfg: &ModelConfig) -> Result<Tensor> {
    let layer = layer_of(op)?;
    let d = cfg.hidden_size;
    let sub = format!("L{layer}.ffn.mlp");
    let a = super::super::env::swiglu_hidden(
        env,
        &sub,
        x,
        weight(op, 0)?,
        weight(op, 1)?,
        cfg.swiglu_limit as f32,
    )?;
    let mut y =
        super::super::env::linear_checked(env, &format!("{sub}.w2"), &a, weight(op, 2)?, d)?;
    env.store(&mut y);
    Ok(y)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_limited_choice_masks_other_groups_to_zero() {
        let cfg = crate::model::ModelConfig::from_json(&serde_json::json!({
            "model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 1,
            "vocab_size": 10, "num_attention_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16,
            "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "n_group": 4, "topk_group": 1
        }))
        .unwrap();
        let fam = cfg.family.as_ref().unwrap();
        // groups {0,1} {2,3} {4,5} {6,7}: group 1 sums best (0.9 + 0.8)
        let scores = [0.5, 0.5, 0.9, 0.8, 0.95, 0.1, 0.2, 0.3];
        let idx = select_grouped(&scores, &[0.0; 8], 1, 8, 2, fam);
        assert_eq!(idx, [2, 3]);
        // a negative bias makes the kept group's keys < 0: masked experts (key 0) win, as in
        // transformers' masked_fill(…, 0.0)
        let bias = [0.0, 0.0, -1.0, -1.0, 0.0, 0.0, 0.0, 0.0];
        let scores = [0.1, 0.1, 0.9, 0.9, 0.1, 0.1, 0.1, 0.1];
        let idx = select_grouped(&scores, &bias, 1, 8, 2, fam);
        // group sums: 0.2, -0.2, 0.2, 0.2 → group 0 kept; keys 0.1, 0.1, then zeros
        assert_eq!(idx, [0, 1]);
    }

    #[test]
    fn the_permutation_round_trips_and_pairs_i_with_i_plus_half() {
        let mut v: Vec<f32> = (0..12).map(|i| i as f32).collect();
        // two heads of 6 dims: 2 nope, 4 rotary (half 2)
        permute_rope(&mut v, 6, 2, 2, false);
        assert_eq!(&v[..6], &[0.0, 1.0, 2.0, 4.0, 3.0, 5.0]);
        permute_rope(&mut v, 6, 2, 2, true);
        assert_eq!(v, (0..12).map(|i| i as f32).collect::<Vec<_>>());
    }

    #[test]
    fn gqa_of_one_key_is_its_value_and_heads_share_their_group() {
        // t = 2, h = 2, kv = 1: both heads read the same key/value head
        let q = vec![1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0];
        let k = vec![1.0, 0.0, 0.0, 2.0];
        let v = vec![3.0, 4.0, 5.0, 6.0];
        let a = Gqa {
            t: 2,
            h: 2,
            kvh: 1,
            dq: 2,
            dv: 2,
            scale: 1.0,
            window: None,
        };
        let o = gqa_core(&q, &k, &v, None, a);
        // row 0: only key 0
        assert_eq!(&o[..4], &[3.0, 4.0, 3.0, 4.0]);
        // row 1, head 0: scores 1 and 0; head 1: scores 0 and 2
        let p = |a: f64, b: f64| (a.exp() / (a.exp() + b.exp())) as f32 as f64;
        let (p0, p1) = (p(1.0, 0.0), p(2.0, 0.0));
        let want = [
            (p0 * 3.0 + (1.0 - p0) * 5.0) as f32,
            (p0 * 4.0 + (1.0 - p0) * 6.0) as f32,
        ];
        assert!((o[4] - want[0]).abs() < 1e-6 && (o[5] - want[1]).abs() < 1e-6);
        assert!((o[6] as f64 - ((1.0 - p1) * 3.0 + p1 * 5.0)).abs() < 1e-6);
        // a window of one key: each query sees itself only
        let o = gqa_core(
            &q,
            &k,
            &v,
            None,
            Gqa {
                window: Some(1),
                ..a
            },
        );
        assert_eq!(&o[4..], &[5.0, 6.0, 5.0, 6.0]);
    }
}
