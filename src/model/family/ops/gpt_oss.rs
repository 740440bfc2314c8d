//! gpt-oss's routed experts ([`OpKind::GptOssExperts`](crate::model::op::OpKind)), as
//! transformers' `GptOssExperts` computes them and the engines serve them:
//!
//! - one fused gate/up projection per expert, `w13` [2I, D] with gate and up rows interleaved
//!   (row 2i is gate i, row 2i + 1 is up i: the released layout, which an engine that splits it
//!   must de-interleave), plus its bias [2I]; or, as llm-compressor stores the experts it
//!   quantizes (`LinearExperts`), gate `w1` [I, D] and up `w3` [I, D] with their biases, two
//!   linears (each with its own scales) whose outputs the GLU pairs unit by unit;
//! - the clamped GLU: gate ≤ L, −L ≤ up ≤ L, then (up + 1) · gate · σ(α · gate) with α = 1.702
//!   and L the config's `swiglu_limit` (7);
//! - `w2` [D, I] plus its bias [D]; the routing weight applied after it, summed over the k chosen
//!   experts in f32.
//!
//! The projections are the path's linears (`OpEnv::linear`, one expert at a time: the fused
//! `Linears::experts` knows neither biases nor this GLU), their biases added on the path's device
//! and stored once with them; the GLU is the device's (`Device::glu_oss`, host reference
//! `device::family::glu_unit`: f64, one rounding, then stored). The tokens' rows are gathered and
//! the weighted outputs summed on the host (f32, expert by expert, on every backend).

use super::super::super::env::{
    add_bias, add_routed, check_shape, expert_rows, internal, layer_of, weight, OpEnv,
};
use super::super::super::op::Op;
use super::super::super::ModelConfig;
use crate::device::GluIn;
use crate::{Result, Tensor};

/// The routed experts of gpt-oss: inputs [x [t, D], weights [t, k], ids [t, k]]; per expert e
/// the op's weights [w13, w13.bias, w2, w2.bias] at 4e.., or [w1, w1.bias, w3, w3.bias, w2,
/// w2.bias] at 6e.. (`Family::linear_experts`) → [t, D].
pub fn experts(
    op: &Op,
    inputs: &[&Tensor],
    env: &mut dyn OpEnv,
    cfg: &ModelConfig,
) -> Result<Tensor> {
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
            if !(v >= 0.0 && v.fract() == 0.0 && (v as usize) < e) {
                return Err(internal(
                    op,
                    format!("expert id {v} is not an integer < {e}"),
                ));
            }
            per[v as usize].push((ti, wts.data[ti * k + j]));
        }
    }
    experts_over(op, x, &per, env, cfg)
}

/// The experts over x [t, D] with `per[e]` = (row, routing weight) of expert e (the op's math
/// after routing; `model::exec::experts_by_expert` runs it over one row per (token, slot)).
pub fn experts_over(
    op: &Op,
    x: &Tensor,
    per: &[Vec<(usize, f32)>],
    env: &mut dyn OpEnv,
    cfg: &ModelConfig,
) -> Result<Tensor> {
    let layer = layer_of(op)?;
    let (t, d, e, i) = (
        x.rows(),
        cfg.hidden_size,
        cfg.n_routed_experts,
        cfg.moe_intermediate_size,
    );
    let per_expert = op.weights.len().checked_div(e).unwrap_or(0);
    if !(per_expert == 4 || per_expert == 6) || op.weights.len() != per_expert * e {
        return Err(internal(
            op,
            format!("{} weights for {e} experts of 4 or 6", op.weights.len()),
        ));
    }
    let limit = env.swiglu_limit(weight(op, 0)?);
    let mut acc = vec![0.0f32; t * d];
    for (ex, toks) in per.iter().enumerate() {
        if toks.is_empty() {
            continue;
        }
        let xs = expert_rows(x, toks, d);
        let sub = format!("L{layer}.ffn.expert.{ex}");
        let w = |j: usize| weight(op, per_expert * ex + j);
        let linear = |env: &mut dyn OpEnv, name: &str, x: &Tensor, j: usize, n: usize| {
            let y = super::super::super::env::linear_checked(
                env,
                &format!("{sub}.{name}"),
                x,
                w(j)?,
                n,
            )?;
            add_bias(env, &y, w(j + 1)?)
        };
        let h = if per_expert == 4 {
            let gu = linear(env, "w13", &xs, 0, 2 * i)?;
            env.device().glu_oss(GluIn::Interleaved(&gu), limit)?
        } else {
            let g = linear(env, "w1", &xs, 0, i)?;
            let u = linear(env, "w3", &xs, 2, i)?;
            env.device().glu_oss(GluIn::Split(&g, &u), limit)?
        };
        let y = linear(env, "w2", &h, per_expert - 2, d)?;
        add_routed(&mut acc, &y, toks, d);
    }
    Ok(Tensor::new(vec![t, d], acc))
}
