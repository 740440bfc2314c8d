//! Hypotheses about how an engine served a weight it multiplies as exact dequantized values with
//! FP8 activations (DeepSeek-V3/R1's block-FP8 release, V4's MXFP4 experts): the activation's
//! power-of-two scale and the weight's block scales.
//!
//! Why apart from the NVFP4 scale hypotheses: these weights have no tensor scale, no activation
//! global scale and no alpha to get wrong. What block-FP8 engines do get wrong is the activation
//! quantizer's scale (divided out as an f32 but packed as its exponent alone: sglang #25704) and
//! the block scales (folded into the weight at load and applied again in the GEMM). Each is a
//! repair of the served reading (`served::Override`), evaluated like the others: over all such
//! weights of the op, then each projection (the NVFP4 hypotheses' units).

use super::{override_hypothesis, units, Family, Hypothesis};
use crate::checkpoint::formats::Served;
use crate::checkpoint::Scheme;
use crate::probe::replay::Replayer;
use crate::served::{ExactAct, ExactRecipe, Override};
use crate::Result;

/// The hypotheses for op `op` reading `weights` (base, scheme label): the power-of-two activation
/// scale over the weights served with DeepSeek's FP8 1×128 activations, the block scales applied
/// once over the block-FP8 weights; each over the units of [`units`].
pub(super) fn hypotheses(
    rp: &Replayer,
    op: &str,
    weights: &[(String, String)],
) -> Result<Vec<Hypothesis>> {
    let ckpt = rp.ckpt();
    let profile = rp.profile();
    let mut fp8_act = Vec::new();
    let mut block = Vec::new();
    for (b, label) in weights {
        let Some(s) = Scheme::from_label(label) else {
            continue;
        };
        if s.spec().served != Served::Fp8Act {
            continue;
        }
        if profile.exact_act(ExactRecipe::in_checkpoint(ckpt, s)) == ExactAct::Fp8x128 {
            fp8_act.push(b.clone());
        }
        if s == Scheme::Fp8Block {
            block.push(b.clone());
        }
    }
    let mut out = Vec::new();
    for (unit, bases) in units(rp.ckpt(), op, &fp8_act) {
        out.push(override_hypothesis(
            "fp8-act-pow2-scale",
            unit,
            "the FP8 1×128 activations are divided by their f32 scale while the kernel keeps only its exponent (a non-power-of-two scale packed as UE8M0): quantizing with the power-of-two scale restores the op",
            Family::ActScale,
            &bases,
            Vec::new(),
            "act_quant scale (UE8M0)".into(),
            Override::Pow2ActScale,
            6,
        ));
    }
    for (unit, bases) in units(rp.ckpt(), op, &block) {
        let tensors = rp
            .meta(&bases[0])?
            .tensors
            .block_scale
            .into_iter()
            .collect();
        out.push(override_hypothesis(
            "fp8-block-scale-once",
            unit,
            "the FP8 block scales are applied twice (folded into the weight at load and applied again by the GEMM): applying them once restores the op",
            Family::BlockScales,
            &bases,
            tensors,
            "weight_scale_inv".into(),
            Override::SingleBlockScale,
            6,
        ));
    }
    Ok(out)
}
