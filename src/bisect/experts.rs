//! Hypotheses about how a loader or an engine read a routed-experts op: gpt-oss's fused experts'
//! gate/up row order of `w13` (the release interleaves gate and up rows; a loader that takes them
//! for stacked de-interleaves them, one that interleaves them again scrambles them another way),
//! the MXFP4 `*_scales` a loader did not read (every block then decodes with scale 1), and the
//! SwiGLU clamp an MoE kernel was not given (gpt-oss's experts, V4's routed and shared experts).
//!
//! Why apart from the NVFP4 scale hypotheses: no scale explains a wrong row order or a missing
//! clamp, and MXFP4 weights have no tensor or activation scale to get wrong at all, while a wrong
//! row order (on MXFP4 experts, and on ModelOpt's NVFP4 export, whose interleaved rows FlashInfer's
//! kernels need de-interleaved), unread block scales or the clamp are what an expert loader or
//! kernel gets wrong. Each is a repair of the served reading (`served::Override`), evaluated like
//! the others.

use super::{override_hypothesis, Family, Hypothesis};
use crate::probe::replay::Replayer;
use crate::served::faults::{is_w13, loader_fault_applies, FaultKind};
use crate::served::Override;
use crate::Result;

/// The hypotheses for op `op` reading `weights` (base, scheme label): the two gate/up re-orderings
/// over every routed quantized `w13` (MXFP4, NVFP4, FP8), and the stored block scales over the MXFP4 experts
/// (all projections, then each).
pub(super) fn hypotheses(
    rp: &Replayer,
    op: &str,
    weights: &[(String, String)],
) -> Result<Vec<Hypothesis>> {
    let layer = op.split('.').next().unwrap_or(op);
    let w13: Vec<String> = weights
        .iter()
        .filter(|(b, s)| is_w13(b) && loader_fault_applies(FaultKind::GateUpDeinterleaved, s))
        .map(|(b, _)| b.clone())
        .collect();
    let mut out = Vec::new();
    if !w13.is_empty() {
        let tensors = vec![raw_of(rp, &w13[0])];
        for (kind, o, what) in [
            (
                "gate-up-interleave",
                Override::InterleaveGateUp,
                "w13's gate and up rows are read de-interleaved (the release's interleaved rows taken for stacked gate, then up)",
            ),
            (
                "gate-up-deinterleave",
                Override::DeinterleaveGateUp,
                "w13's gate and up rows are interleaved a second time (the release interleaves them already)",
            ),
        ] {
            out.push(override_hypothesis(
                kind,
                format!("all experts of {layer} (w13; {} weights)", w13.len()),
                what,
                Family::GateUpOrder,
                &w13,
                tensors.clone(),
                "w13_weight".into(),
                o,
                6,
            ));
        }
    }
    let mx: Vec<String> = weights
        .iter()
        .filter(|(b, s)| {
            b.contains(".ffn.experts.") && loader_fault_applies(FaultKind::MissingBlockScales, s)
        })
        .map(|(b, _)| b.clone())
        .collect();
    let mut units = vec![("w13, w2", mx.clone())];
    for role in ["w13", "w2"] {
        let v: Vec<String> = mx
            .iter()
            .filter(|b| b.ends_with(&format!(".{role}")))
            .cloned()
            .collect();
        if !v.is_empty() && v.len() < mx.len() {
            units.push((role, v));
        }
    }
    for (roles, bases) in units.into_iter().filter(|(_, b)| !b.is_empty()) {
        let meta = rp.meta(&bases[0])?;
        let proj = if bases[0].ends_with(".w2") {
            "w2"
        } else {
            "w13"
        };
        let nvfp4 = meta.scheme == crate::checkpoint::Scheme::Nvfp4ModelOpt;
        out.push(override_hypothesis(
            if nvfp4 {
                "stored-nvfp4-scales"
            } else {
                "stored-mxfp4-scales"
            },
            format!("all experts of {layer} ({roles}; {} weights)", bases.len()),
            "the block scales in use are not the stored ones (MXFP4 `*_scales`; ModelOpt NVFP4's underscore keys `*_weight_scale`, `*_weight_scale_2`, `*_input_scale`): decoding with them restores the op",
            Family::BlockScales,
            &bases,
            meta.tensors.block_scale.into_iter().collect(),
            format!("{proj}_weight_scale"),
            Override::StoredBlockScales,
            7,
        ));
    }
    Ok(out)
}

/// The checkpoint tensor holding a weight (the fused tensor for a fused expert's piece).
fn raw_of(rp: &Replayer, base: &str) -> String {
    rp.ckpt()
        .resolve(&format!("{base}.weight"))
        .unwrap_or_else(|| base.to_string())
}

/// The experts' SwiGLU clamp restored (config.json's `swiglu_limit`) at a routed or shared
/// experts op of a model whose experts clamp: one hypothesis over the op's weights (the clamp is
/// one kernel argument for all of them).
pub(super) fn clamp_hypothesis(
    rp: &Replayer,
    op: &str,
    weights: &[(String, String)],
) -> Option<Hypothesis> {
    let limit = rp.ckpt().model_config().ok()?.swiglu_limit as f32;
    if limit.is_nan()
        || limit <= 0.0
        || !(op.ends_with(".ffn.experts") || op.ends_with(".ffn.shared"))
    {
        return None;
    }
    let bases: Vec<String> = weights.iter().map(|(b, _)| b.clone()).collect();
    if bases.is_empty() {
        return None;
    }
    let layer = op.split('.').next().unwrap_or(op);
    let mut h = override_hypothesis(
        "swiglu-clamp",
        format!("{op} ({} weights of {layer})", bases.len()),
        "the experts' SwiGLU runs without its clamp (an MoE kernel not given the config's `swiglu_limit`): clamping gate ≤ limit and −limit ≤ up ≤ limit restores the op",
        Family::SwigluClamp,
        &bases,
        Vec::new(),
        "swiglu_limit".into(),
        Override::SwigluClamp,
        6,
    );
    h.param.current = Some(f32::INFINITY);
    h.param.corrected = Some(limit);
    h.param.stored = Some(limit);
    Some(h)
}
