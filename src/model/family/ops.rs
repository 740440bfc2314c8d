//! The math of the families' own ops ([`OpKind::HeadNorm`], [`OpKind::HeadRope`],
//! [`OpKind::GqaAttention`], [`OpKind::Mlp`], MLA's, and gpt-oss's experts in [`gpt_oss`])
//! against `OpEnv` and the path's `Device`.
//!
//! Every step runs on the path's `Device` (host reference `device::family`, CUDA kernels in
//! `kernels/layer.cu`), so each op runs wherever the device does: the per-head norm is the
//! device's RMSNorm over one row per head, the RoPE the device's with transformers' half-split
//! pairing (`rotate_half`) or the interleaved one, the grouped-query attention (sinks, windows;
//! MLA's after its key gather) and gpt-oss's GLU the device's own ops, in the reference's manner
//! (products summed exactly in f64, exponentials in f64, one rounding). What stays on the host
//! is exact bookkeeping: gpt-oss's experts gather their token rows and add their routed outputs
//! there, in f32 in expert order, on every backend.

pub(crate) mod gpt_oss;

use super::super::env::{
    check_shape, history, internal, layer_of, param_n, pos0, weight, window, OpEnv,
};
use super::super::op::{Op, OpKind};
use super::super::rope::rope_freqs;
use super::super::ModelConfig;
use super::kind::{Family, Kind, RopeStyle};
use crate::device::family::{GqaDims, MlaDims};
use crate::device::ops::RopeTable;
use crate::{Result, Tensor};
use std::borrow::Cow;

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

/// RoPE on the last `qk_rope_head_dim` dims of each head of x [t, n·dh] at the rows' prompt
/// positions (from a token chunk's start), on the path's device: the half-split pairing of
/// transformers' `rotate_half` (Qwen3, gpt-oss, DeepSeek-V3 as transformers runs it) or the
/// interleaved pairs.
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
    let nope = dh - r;
    let p0 = pos0(env);
    let tab = rope_table(cfg, fam, p0..p0 + t);
    let dev = env.device();
    let y = match fam.rope_style {
        RopeStyle::HalfSplit => dev.rope_split(x, dh, nope, &tab)?,
        _ => dev.rope(x, dh, nope, &tab)?,
    };
    Ok(Tensor::new(vec![t, x.cols()], y.data))
}

/// The grouped-query attention's dims of a family op (the layer's window, the family's scale)
/// for `t` queries over their own keys (`q0` is set once earlier chunks' keys are joined).
fn gqa_dims(op: &Op, t: usize, cfg: &ModelConfig, fam: &Family, kvh: usize) -> Result<GqaDims> {
    Ok(GqaDims {
        t,
        q0: 0,
        h: cfg.num_attention_heads,
        kvh,
        dq: cfg.head_dim,
        dv: fam.v_head_dim,
        scale: fam.attn_scale as f32,
        window: fam.window(cfg.sliding_window, layer_of(op)?),
    })
}

/// Causal grouped-query attention: q [t, h·dq], k [t, kv·dq], v [t, kv·dv] → [t, h·dv]; query
/// head i reads key/value head i / (h / kv). Scores = f32(q·k in f64) · scale, softmax with f64
/// exponentials and denominator (a sink logit per head where the op has one), probabilities
/// rounded to f32, output Σ p·v in f64 rounded once, then stored: the device's
/// [`Device::gqa`](crate::device::Device::gqa) (host reference `device::family::gqa_core`).
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
    let mut dims = gqa_dims(op, t, cfg, fam, kvh)?;
    let (k, v) = with_earlier(op, env, Cow::Borrowed(k), Cow::Borrowed(v), dims.window)?;
    dims.q0 = k.rows() - t;
    env.device()
        .gqa(q, &k, &v, sinks.as_ref().map(|s| &s.data[..]), dims)
}

/// A token chunk's keys and values after those its queries still reach from earlier chunks
/// (kept as the op's carry): every earlier row, or a window's last `w − 1`. The whole prompt's
/// pass through unchanged. Each query's keys are then the same rows as in one pass, in the same
/// order, so the attention's bits do not depend on the chunking.
fn with_earlier<'t>(
    op: &Op,
    env: &mut dyn OpEnv,
    k: Cow<'t, Tensor>,
    v: Cow<'t, Tensor>,
    window_keys: Option<usize>,
) -> Result<(Cow<'t, Tensor>, Cow<'t, Tensor>)> {
    let Some(at) = env.chunk_at() else {
        return Ok((k, v));
    };
    let (kk, vk) = (format!("{}.k", op.id), format!("{}.v", op.id));
    Ok(match window_keys {
        Some(w) => {
            let tail = w.saturating_sub(1);
            (
                Cow::Owned(window(env, &kk, &k, at, tail)?),
                Cow::Owned(window(env, &vk, &v, at, tail)?),
            )
        }
        None => (
            Cow::Owned(history(env, &kk, k.into_owned(), at)?),
            Cow::Owned(history(env, &vk, v.into_owned(), at)?),
        ),
    })
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
    let c = x.cols();
    if c < r {
        return Err(internal(
            op,
            format!("input {:?} is narrower than the latent's {r} dims", x.shape),
        ));
    }
    let w = param_n(env, weight(op, 0)?, r)?;
    let dev = env.device();
    let lead = dev.slice_cols(x, 0, r)?;
    dev.rmsnorm(&lead, &w.data, cfg.rms_norm_eps as f32)
}

/// Multi-head latent attention (DeepSeek-V3, as transformers computes it): head i's key is
/// [k_nope_i, k_rope] with k_nope_i from `kv_b` and the rope key shared by every head, its value
/// v_i from `kv_b` (gathered on the path's device: `Device::mla_keys`); then the causal
/// attention of [`gqa`] (one key/value head per query head) with the YaRN-scaled softmax scale.
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
    let md = MlaDims {
        t,
        h,
        nope,
        rope,
        dv,
        lora: fam.kv_lora_rank,
    };
    let (k, v) = env.device().mla_keys(kvb, kva, md)?;
    let (k, v) = with_earlier(op, env, Cow::Owned(k), Cow::Owned(v), None)?;
    let dims = GqaDims {
        window: None,
        q0: k.rows() - t,
        ..gqa_dims(op, t, cfg, fam, h)?
    };
    env.device().gqa(q, &k, &v, None, dims)
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

    /// transformers' `rotate_half` RoPE: at 90° the half-split dims (a, b) become (−b, a); on
    /// random rows it is the device's interleaved RoPE of the dims permuted so that i pairs with
    /// i + half (what the family ran before the device had the pairing), to the bit.
    #[test]
    fn half_split_rope_is_rotate_half_and_the_permuted_interleaved_rope() {
        use crate::device::{CpuDevice, Device};
        let dev = CpuDevice::new(|t: &mut Tensor| t.round_bf16());
        let quarter = RopeTable {
            half: 2,
            cos: vec![0.0; 2],
            sin: vec![1.0; 2],
        };
        // one head of 6 dims: 2 nope, 4 rotary
        let x = Tensor::new(vec![1, 6], vec![9.0, 8.0, 1.0, 2.0, 3.0, 4.0]);
        let y = dev.rope_split(&x, 6, 2, &quarter).unwrap();
        assert_eq!(y.data, vec![9.0, 8.0, -3.0, -4.0, 1.0, 2.0]);
        // random rows: t = 5, 3 heads of 16 dims (4 nope, 12 rotary)
        let (t, n, dh, nope) = (5usize, 3usize, 16usize, 4usize);
        let half = (dh - nope) / 2;
        let vals: Vec<f32> = (0..t * n * dh)
            .map(|i| ((i as u32).wrapping_mul(2654435761) >> 8) as f32 / 8e6 - 1.0)
            .collect();
        let tab = RopeTable::new(&[0.9, 0.3, 0.1, 0.03, 0.01, 0.003], 0..t);
        let got = dev
            .rope_split(&Tensor::new(vec![t, n * dh], vals.clone()), dh, nope, &tab)
            .unwrap();
        // half-split dim i goes to 2i, i + half to 2i + 1
        let pos = |i: usize| if i < half { 2 * i } else { 2 * (i - half) + 1 };
        let mut perm = vals.clone();
        for (a, b) in perm.chunks_mut(dh).zip(vals.chunks(dh)) {
            (0..2 * half).for_each(|i| a[nope + pos(i)] = b[nope + i]);
        }
        let inter = dev
            .rope(&Tensor::new(vec![t, n * dh], perm), dh, nope, &tab)
            .unwrap();
        let mut want = inter.data.to_vec();
        for (a, b) in want.chunks_mut(dh).zip(inter.data.chunks(dh)) {
            (0..2 * half).for_each(|i| a[nope + i] = b[nope + pos(i)]);
        }
        assert_eq!(got.data, want);
        assert_ne!(
            got.data,
            Tensor::new(vec![t, n * dh], vals).rounded_bf16().data
        );
    }
}
