//! gpt-oss's routed experts ([`OpKind::GptOssExperts`](crate::model::op::OpKind)), as
//! transformers' `GptOssExperts` computes them and the engines serve them:
//!
//! - one fused gate/up projection per expert, `w13` [2I, D] with gate and up rows interleaved
//!   (row 2i is gate i, row 2i + 1 is up i: the released layout, which an engine that splits it
//!   must de-interleave), plus its bias [2I];
//! - the clamped GLU: gate ≤ L, −L ≤ up ≤ L, then (up + 1) · gate · σ(α · gate) with α = 1.702
//!   and L the config's `swiglu_limit` (7);
//! - `w2` [D, I] plus its bias [D]; the routing weight applied after it, summed over the k chosen
//!   experts in f32.
//!
//! The projections are the path's linears (`OpEnv::linear`), their biases added on the path's
//! device and stored once with them; the GLU is host math in the reference's manner (f64, one
//! rounding, then stored), so the op has no CUDA version yet (`family::cuda_unsupported`).

use super::super::super::env::{
    add_bias, add_routed, check_shape, expert_rows, internal, layer_of, weight, OpEnv,
};
use super::super::super::op::Op;
use super::super::super::ModelConfig;
use crate::{Result, Tensor};

/// The GLU's α (transformers' `GptOssExperts.alpha`; not a config field).
pub const ALPHA: f64 = 1.702;

/// The clamped GLU of one row of the fused projection `gu` [2I] (gate/up interleaved) into `h` [I].
pub fn glu_row(gu: &[f32], h: &mut [f32], limit: f32) {
    for (o, pair) in h.iter_mut().zip(gu.chunks_exact(2)) {
        let g = pair[0].min(limit) as f64;
        let u = pair[1].clamp(-limit, limit) as f64;
        let glu = g / (1.0 + (-ALPHA * g).exp());
        *o = ((u + 1.0) * glu) as f32;
    }
}

/// The routed experts of gpt-oss: inputs [x [t, D], weights [t, k], ids [t, k]]; per expert e
/// the op's weights [w13, w13.bias, w2, w2.bias] at 4e.. → [t, D].
pub fn experts(
    op: &Op,
    inputs: &[&Tensor],
    env: &mut dyn OpEnv,
    cfg: &ModelConfig,
) -> Result<Tensor> {
    let layer = layer_of(op)?;
    let (x, wts, idx) = (inputs[0], inputs[1], inputs[2]);
    let (d, e, k, i) = (
        cfg.hidden_size,
        cfg.n_routed_experts,
        cfg.num_experts_per_tok,
        cfg.moe_intermediate_size,
    );
    let t = x.rows();
    check_shape(op, "x", x, &[t, d])?;
    check_shape(op, "routing weights", wts, &[t, k])?;
    check_shape(op, "expert ids", idx, &[t, k])?;
    if op.weights.len() != 4 * e {
        return Err(internal(
            op,
            format!("{} weights for {e} experts of 4", op.weights.len()),
        ));
    }
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
    let limit = cfg.swiglu_limit as f32;
    let mut acc = vec![0.0f32; t * d];
    for (ex, toks) in per.iter().enumerate() {
        if toks.is_empty() {
            continue;
        }
        let xs = expert_rows(x, toks, d);
        let sub = format!("L{layer}.ffn.expert.{ex}");
        let w = |j: usize| weight(op, 4 * ex + j);
        let gu = super::super::super::env::linear_checked(
            env,
            &format!("{sub}.w13"),
            &xs,
            w(0)?,
            2 * i,
        )?;
        let gu = add_bias(env, &gu, w(1)?)?;
        let mut h = vec![0.0f32; toks.len() * i];
        for (row, out) in gu.data.chunks_exact(2 * i).zip(h.chunks_exact_mut(i)) {
            glu_row(row, out, limit);
        }
        let mut h = Tensor::new(vec![toks.len(), i], h);
        env.store(&mut h);
        let y = super::super::super::env::linear_checked(env, &format!("{sub}.w2"), &h, w(2)?, d)?;
        let y = add_bias(env, &y, w(3)?)?;
        add_routed(&mut acc, &y, toks, d);
    }
    Ok(Tensor::new(vec![t, d], acc))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The GLU against its definition, the clamps included: a gate above the limit is cut to it,
    /// an up beyond ±limit too, and the pairs are read interleaved.
    #[test]
    fn glu_clamps_and_reads_interleaved_pairs() {
        let sig = |z: f64| 1.0 / (1.0 + (-z).exp());
        let want = |g: f64, u: f64| ((u + 1.0) * g * sig(ALPHA * g)) as f32;
        // (gate, up) pairs: plain, gate over the limit, up under −limit, negative gate
        let gu = [0.5f32, -0.25, 9.0, 1.0, 1.0, -8.0, -3.0, 2.0];
        let mut h = [0f32; 4];
        glu_row(&gu, &mut h, 7.0);
        assert_eq!(h[0], want(0.5, -0.25));
        assert_eq!(h[1], want(7.0, 1.0));
        assert_eq!(h[2], want(1.0, -7.0));
        assert_eq!(h[3], want(-3.0, 2.0));
        // up = −1 zeroes the unit whatever the gate
        let mut z = [1f32];
        glu_row(&[4.0, -1.0], &mut z, 7.0);
        assert_eq!(z[0], 0.0);
    }
}
