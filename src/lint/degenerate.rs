//! Faults that are not in a weight's scales: a config value that makes an op degenerate
//! (`config.degenerate`) and NaN/Inf in a plain (unquantized) tensor such as a router's correction
//! bias, a norm weight, a bias or the attention sinks (`tensor.non-finite`). Both are named by the
//! field or tensor that holds them, never blamed on a weight's scales: the oracle reads the same
//! config and the same tensor, so nothing diverges and a run would otherwise say "clean".

use std::collections::HashSet;

use super::rules::Severity::Error as E;
use super::{layer_of, Cx, Finding};
use crate::checkpoint::Dtype;

/// The largest plain tensor read in full (elements): norms, biases, sinks, router weights and
/// correction biases are far below it; an unquantized embedding, head or BF16 linear is not read.
pub const PLAIN_MAX_ELEMENTS: usize = 1 << 22;

/// Name endings of quantization parameters (checked by the `scale.*` rules, not here).
const SCALE_SUFFIXES: &[&str] = &[
    "weight_scale",
    "weight_scale_2",
    "weight_scale_inv",
    "weight_global_scale",
    "input_scale",
    "input_global_scale",
    "k_scale",
    "v_scale",
    "_scales",
    ".scale",
];

/// One degenerate value: the config key, its value, why it is degenerate.
fn degenerate_values(ck: &crate::checkpoint::Checkpoint) -> Vec<(String, f64, String)> {
    let Ok(cfg) = ck.model_config() else {
        return Vec::new(); // config.model says why
    };
    let json = ck.config_json();
    // the key the config really uses (V4 reads either spelling)
    let key = |names: &[&str]| -> String {
        names
            .iter()
            .find(|n| json.get(**n).is_some())
            .unwrap_or(&names[0])
            .to_string()
    };
    let mut out = Vec::new();
    let eps = cfg.rms_norm_eps;
    if !eps.is_finite() || eps > RMS_EPS_MAX {
        out.push((
            key(&["rms_norm_eps", "norm_eps"]),
            eps,
            format!(
                "every RMSNorm divides by sqrt(mean(x²) + eps): with eps {eps:e} (> {RMS_EPS_MAX:e}; releases use 1e-6 to 1e-5) each norm's output is its input shrunk toward 0 — at 1e308 every norm outputs 0"
            ),
        ));
    }
    let is_v4 = cfg.family.is_none();
    if is_v4 && (!cfg.hc_eps.is_finite() || cfg.hc_eps > RMS_EPS_MAX) {
        out.push((
            key(&["hc_eps"]),
            cfg.hc_eps,
            format!("the hyper-connection mixing's eps {:e} dominates the Sinkhorn normalisation (> {RMS_EPS_MAX:e})", cfg.hc_eps),
        ));
    }
    for (names, theta) in [
        (&["rope_theta"][..], cfg.rope_theta),
        (&["compress_rope_theta"][..], cfg.compress_rope_theta),
    ] {
        if names[0] == "compress_rope_theta" && !is_v4 {
            continue;
        }
        if !theta.is_finite() || theta <= 1.0 {
            out.push((
                key(names),
                theta,
                format!("RoPE frequencies are theta^(-2i/d): with theta {theta:e} (≤ 1) every dimension rotates at least once per token and positions alias"),
            ));
        }
    }
    let r = cfg.routed_scaling_factor;
    if cfg.n_routed_experts > 0 && (!r.is_finite() || r <= 0.0) {
        out.push((
            key(&["routed_scaling_factor"]),
            r,
            format!("the routed experts' output is multiplied by routed_scaling_factor {r:e}: the MoE contributes nothing (0) or flips sign"),
        ));
    }
    let clamped = is_v4
        || cfg
            .family
            .as_ref()
            .is_some_and(|f| f.kind == crate::model::family::kind::Kind::GptOss);
    if clamped && json.get("swiglu_limit").is_some() {
        let l = cfg.swiglu_limit;
        if !l.is_finite() || l <= 0.0 {
            out.push((
                key(&["swiglu_limit"]),
                l,
                format!("SwiGLU clamps gate and up to ±swiglu_limit: {l:e} clamps every expert's activation to 0"),
            ));
        }
    }
    if let Some(y) = &cfg.yarn {
        if !y.factor.is_finite() || y.factor <= 0.0 {
            out.push((
                "rope_scaling.factor".into(),
                y.factor,
                "YaRN divides the frequencies by factor: a non-positive factor makes every position's angle meaningless".into(),
            ));
        }
    }
    out
}

/// Largest RMSNorm eps that is not degenerate (releases use 1e-6 to 1e-5; activations' mean
/// square is rarely below 1e-3).
pub const RMS_EPS_MAX: f64 = 1e-2;

/// `config.degenerate`: config values that make an op degenerate, named by key and file.
pub(crate) fn config_findings(cx: &Cx) -> Vec<Finding> {
    let file = cx.ck.config_path().to_path_buf();
    degenerate_values(cx.ck)
        .into_iter()
        .filter_map(|(key, v, why)| {
            let mut f = cx.finding(
                "config.degenerate",
                E,
                &format!("config.json:{key}"),
                &file,
                "",
                format!("`{key}` = {v:e}: {why}"),
                "Restore the value the model was trained with (the original checkpoint's config.json); the weights and their scales are not at fault.",
            )?;
            f.op = op_of_key(&key);
            Some(f)
        })
        .collect()
}

/// The op kind a degenerate config key breaks, for grouping (`None`: many ops).
fn op_of_key(key: &str) -> Option<String> {
    match key {
        "routed_scaling_factor" | "swiglu_limit" => Some("ffn.experts".into()),
        _ => None,
    }
}

/// A plain parameter, not a weight matrix (lint reads no weights): a vector (norm weight, bias,
/// correction bias, sinks, V4's mHC bases and scales) or a router's gate matrix.
fn is_parameter(raw: &str, canonical: Option<&str>, shape: &[usize]) -> bool {
    let name = canonical.unwrap_or(raw);
    shape.len() <= 1
        || name.ends_with("ffn.gate.weight")
        || raw.ends_with("mlp.gate.weight")
        || raw.ends_with("mlp.router.weight")
}

fn is_scale(name: &str) -> bool {
    SCALE_SUFFIXES.iter().any(|s| name.ends_with(s))
}

/// `tensor.non-finite`: NaN/Inf in a plain parameter ([`is_parameter`]) of the layers in
/// `layers` (None: every layer) and those outside any layer, up to [`PLAIN_MAX_ELEMENTS`]
/// elements each.
pub(crate) fn tensor_findings(cx: &Cx, layers: Option<&HashSet<usize>>) -> Vec<Finding> {
    let mut out = Vec::new();
    for raw in cx.ck.tensor_names() {
        if is_scale(&raw) {
            continue;
        }
        if let (Some(set), Some(l)) = (layers, layer_of(&raw)) {
            if !set.contains(&l) {
                continue;
            }
        }
        let Some(info) = cx.ck.info(&raw) else {
            continue;
        };
        if !matches!(info.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
            continue;
        }
        let n: usize = info.shape.iter().product();
        if n == 0
            || n > PLAIN_MAX_ELEMENTS
            || !is_parameter(&raw, cx.ck.canonical_of(&raw), &info.shape)
        {
            continue;
        }
        let Ok(bytes) = cx.ck.bytes(&raw) else {
            continue;
        };
        let Ok(v) = crate::checkpoint::convert::to_f32(bytes, info.dtype, &info.file, &raw) else {
            continue;
        };
        let nan = v.iter().filter(|x| x.is_nan()).count();
        let inf = v.iter().filter(|x| x.is_infinite()).count();
        if nan + inf == 0 {
            continue;
        }
        let first = v.iter().position(|x| !x.is_finite()).unwrap_or(0);
        let canonical = cx.ck.canonical_of(&raw).unwrap_or(&raw).to_string();
        let base = canonical
            .strip_suffix(".weight")
            .or_else(|| canonical.strip_suffix(".bias"))
            .unwrap_or(&canonical)
            .to_string();
        out.extend(cx.finding(
            "tensor.non-finite",
            E,
            &raw,
            &info.file,
            &base,
            format!(
                "{nan} NaN and {inf} Inf of {n} elements (first at flat index {first}); the oracle reads the same values, so nothing diverges, but an engine's routing, norm or bias does"
            ),
            "Re-export the tensor from the original checkpoint: plain (unquantized) tensors are copied, never computed, by the quantizer.",
        ));
    }
    out
}
