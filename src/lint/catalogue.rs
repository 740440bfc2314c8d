//! The lint rules of the 2026 catalogue (docs/CATALOGUE-2026.md, issue 43 item 7): field bugs of
//! the last year that the checkpoint itself shows.
//!
//! - `router.bias.precision`: a router's `e_score_correction_bias` stored in BF16/F16 (sglang
//!   PR #31213, vLLM PR #50761: the top-k over sigmoid scores plus a bias rounded to 8 mantissa
//!   bits flips near ties).
//! - `scale.input.uncalibrated`: every routed expert of a layer carries the bit-identical
//!   activation scale of one projection (a default copied into each, never calibrated per expert).
//! - `kv.scale`: the KV cache's `k_scale` / `v_scale` non-finite, ≤ 0 or 1.0 (uncalibrated), or
//!   missing where the config declares a quantized KV cache (TensorRT-LLM PR #16916, vLLM #55673).
//! - `tensor.keep-high-precision`: a router, a norm, the embedding / head or an MTP layer stored
//!   quantized (Model-Optimizer #2091).
//! - `tp.scale-block`: with `lint --tp N`, a tensor-parallel shard boundary that falls inside a
//!   scale block (vLLM #52997).

use super::rules::Severity::{Error as E, Warning as W};
use super::{layer_of, Cx, Finding};
use crate::checkpoint::{Dtype, Scheme, WeightMeta};

/// Every finding of the catalogue's rules.
pub(crate) fn findings(cx: &Cx, metas: &[WeightMeta]) -> Vec<Finding> {
    let mut out = Vec::new();
    out.extend(router_bias(cx));
    out.extend(uncalibrated(cx, metas));
    out.extend(kv_scales(cx));
    out.extend(high_precision(cx));
    if let Some(tp) = cx.rules.tp.filter(|&n| n > 1) {
        out.extend(tp_blocks(cx, metas, tp));
    }
    out
}

/// The name with its last `.component` removed.
fn module(raw: &str) -> &str {
    raw.rsplit_once('.').map_or(raw, |(m, _)| m)
}

fn read_f32(cx: &Cx, raw: &str) -> Option<Vec<f32>> {
    let info = cx.ck.info(raw)?;
    if !matches!(info.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
        return None;
    }
    let n: usize = info.shape.iter().product();
    if n > super::degenerate::PLAIN_MAX_ELEMENTS {
        return None;
    }
    let bytes = cx.ck.bytes(raw).ok()?;
    crate::checkpoint::convert::to_f32(bytes, info.dtype, &info.file, raw).ok()
}

/// `router.bias.precision`.
fn router_bias(cx: &Cx) -> Vec<Finding> {
    let mut out = Vec::new();
    for raw in cx.ck.tensor_names() {
        if !raw.ends_with("e_score_correction_bias") {
            continue;
        }
        let Some(info) = cx.ck.info(&raw) else {
            continue;
        };
        if !matches!(info.dtype, Dtype::BF16 | Dtype::F16) {
            continue;
        }
        out.extend(cx.finding(
            "router.bias.precision",
            W,
            &raw,
            &info.file,
            module(cx.ck.canonical_of(&raw).unwrap_or(&raw)),
            format!(
                "stored as {:?}: the router adds it to the sigmoid scores before the top-k, and a bias rounded to {} mantissa bits moves near ties to other experts (the release and the engines keep it in F32)",
                info.dtype,
                if info.dtype == Dtype::BF16 { 8 } else { 11 }
            ),
            "Export e_score_correction_bias in F32 from the original checkpoint (it is copied, never quantized).",
        ));
    }
    out
}

/// The activation amax an NVFP4 activation scale implies (E4M3 max 448 × E2M1 max 6 = 2688):
/// compressed-tensors stores g_x = 2688 / amax, ModelOpt d_x = amax / 2688.
fn implied_amax(m: &WeightMeta, v: f32) -> Option<f64> {
    use crate::numerics::nvfp4::Convention;
    match m.convention? {
        Convention::CompressedTensors => Some(2688.0 / v as f64),
        Convention::ModelOpt => Some(v as f64 * 2688.0),
    }
}

/// `scale.input.uncalibrated`: routed experts whose activation scale implies an amax of exactly
/// 1.0, the value an observer that never saw a token holds (a calibrated amax is the largest
/// |activation| the expert was routed, never 1.0 to the bit in several experts); a stored 1.0
/// is `scale.global.sentinel`'s. Producers that share one calibrated scale across a layer's
/// experts on purpose (llm-compressor's and ModelOpt's MoE exports) are not flagged.
fn uncalibrated(cx: &Cx, metas: &[WeightMeta]) -> Vec<Finding> {
    use std::collections::BTreeMap;
    // (layer prefix, projection) → (expert, meta, implied amax)
    type Group<'m> = Vec<(usize, &'m WeightMeta, f64)>;
    let mut groups: BTreeMap<(String, String), Group> = BTreeMap::new();
    for m in metas {
        let Some(v) = m.input_global else {
            continue;
        };
        let Some(amax) = implied_amax(m, v) else {
            continue;
        };
        let Some(i) = m.canonical.find(".ffn.experts.") else {
            continue;
        };
        let rest = &m.canonical[i + ".ffn.experts.".len()..];
        let Some((e, proj)) = rest.split_once('.') else {
            continue;
        };
        let Ok(e) = e.parse::<usize>() else {
            continue;
        };
        groups
            .entry((m.canonical[..i].to_string(), proj.to_string()))
            .or_default()
            .push((e, m, amax));
    }
    let mut out = Vec::new();
    for ((layer, proj), v) in groups {
        // f32 rounding of 2688 / 1 or 1 / 2688: within a few ulps of 1
        let default: Vec<&(usize, &WeightMeta, f64)> = v
            .iter()
            .filter(|(_, _, a)| (a - 1.0).abs() < 1e-6)
            .collect();
        if default.is_empty() {
            continue;
        }
        let experts: Vec<String> = default.iter().map(|(e, _, _)| e.to_string()).collect();
        for (_, m, _) in &default {
            let tensor = m
                .tensors
                .input_scale
                .clone()
                .unwrap_or_else(|| m.canonical.clone());
            let mut f = cx.finding(
                "scale.input.uncalibrated",
                W,
                &tensor,
                &m.file,
                &m.canonical,
                format!(
                    "experts {} of {layer} ({} of {}) carry a {proj} activation scale {:e} that implies an amax of exactly 1.0: the default of an observer that never saw a token, not a calibration (their real activations are then quantized as if their largest value were 1)",
                    experts.join(", "),
                    default.len(),
                    v.len(),
                    m.input_global.unwrap_or(f32::NAN)
                ),
                "Calibrate every expert (route enough calibration tokens to each, or calibrate experts on all tokens) and re-export.",
            );
            if let Some(f) = f.as_mut() {
                f.op = Some(format!(
                    "L{}.ffn.experts",
                    layer_of(&m.canonical).unwrap_or(0)
                ));
            }
            out.extend(f);
        }
    }
    out
}

/// Whether the config declares a quantized KV cache (compressed-tensors `kv_cache_scheme`,
/// ModelOpt `kv_cache_quant_algo`).
fn kv_cache_declared(cx: &Cx) -> Option<String> {
    let set = |v: Option<&serde_json::Value>| v.is_some_and(|v| !v.is_null());
    if let Some(q) = cx.ck.quantization_config() {
        if set(q.get("kv_cache_scheme")) {
            return Some("config.json quantization_config.kv_cache_scheme".into());
        }
        if set(q.get("kv_cache_quant_algo")) {
            return Some("config.json quantization_config.kv_cache_quant_algo".into());
        }
    }
    if let Some(h) = cx.ck.hf_quant_config() {
        let q = h.get("quantization").unwrap_or(h);
        if set(q.get("kv_cache_quant_algo")) {
            return Some("hf_quant_config.json kv_cache_quant_algo".into());
        }
    }
    None
}

fn is_kv_scale(raw: &str) -> Option<char> {
    let leaf = raw.rsplit('.').next()?;
    match leaf {
        "k_scale" => Some('k'),
        "v_scale" => Some('v'),
        _ => None,
    }
}

/// `kv.scale`.
fn kv_scales(cx: &Cx) -> Vec<Finding> {
    use std::collections::BTreeMap;
    let mut out = Vec::new();
    const FIX: &str = "Export the KV cache's k_scale/v_scale from a calibration (or serve the cache with dynamic scales); a scale of 1.0 or none makes an FP8/NVFP4 cache clip or underflow every key and value.";
    // layer → (has k, has v)
    let mut seen: BTreeMap<usize, (bool, bool)> = BTreeMap::new();
    for raw in cx.ck.tensor_names() {
        let Some(kv) = is_kv_scale(&raw) else {
            continue;
        };
        if let Some(l) = layer_of(&raw) {
            let e = seen.entry(l).or_default();
            if kv == 'k' {
                e.0 = true;
            } else {
                e.1 = true;
            }
        }
        let Some(info) = cx.ck.info(&raw) else {
            continue;
        };
        let Some(v) = read_f32(cx, &raw) else {
            continue;
        };
        let base = module(cx.ck.canonical_of(&raw).unwrap_or(&raw)).to_string();
        let bad = v.iter().filter(|x| !x.is_finite() || **x <= 0.0).count();
        if bad > 0 {
            out.extend(cx.finding(
                "kv.scale",
                E,
                &raw,
                &info.file,
                &base,
                format!("{bad} of {} values NaN, Inf or ≤ 0: every cached key or value is divided by it", v.len()),
                FIX,
            ));
        } else if !v.is_empty() && v.iter().all(|x| *x == 1.0) {
            out.extend(cx.finding(
                "kv.scale",
                W,
                &raw,
                &info.file,
                &base,
                "1.0, the value an uncalibrated KV-cache scale is initialised to: keys and values are cast to the cache's format unscaled".into(),
                FIX,
            ));
        }
    }
    if let Some(what) = kv_cache_declared(cx) {
        let layers = cx
            .ck
            .model_config()
            .map(|c| c.num_hidden_layers)
            .unwrap_or(0);
        let held: std::collections::BTreeSet<usize> = cx
            .ck
            .tensor_names()
            .iter()
            .filter_map(|t| layer_of(t))
            .filter(|l| *l < layers.max(1))
            .collect();
        for l in held {
            let (k, v) = seen.get(&l).copied().unwrap_or_default();
            for (has, name) in [(k, "k_scale"), (v, "v_scale")] {
                if has {
                    continue;
                }
                out.extend(cx.finding(
                    "kv.scale",
                    E,
                    &format!("layers.{l}.attn.{name}"),
                    cx.ck.config_path(),
                    &format!("layers.{l}.attn"),
                    format!("{what} declares a quantized KV cache, but layer {l} has no `{name}`: engines then cache with scale 1.0 (vLLM #55673, TensorRT-LLM PR #16916)"),
                    FIX,
                ));
            }
        }
    }
    out
}

/// The quantized leaves: packed data and its scales.
const QUANT_LEAVES: &[&str] = &[
    "weight_packed",
    "weight_scale",
    "weight_scale_inv",
    "weight_scale_2",
    "weight_global_scale",
    "_blocks",
    "_scales",
];

/// What a module that must stay in high precision is, and the severity of finding it quantized.
fn keep_high(module: &str, mtp: bool) -> Option<(&'static str, super::Severity)> {
    let last = module.rsplit('.').next().unwrap_or(module);
    if module.ends_with("mlp.gate")
        || module.ends_with("mlp.router")
        || module.ends_with("ffn.gate")
    {
        return Some(("the router (gate)", E));
    }
    if last.contains("norm") {
        return Some(("a norm", E));
    }
    if last.contains("embed") {
        return Some(("the embedding", W));
    }
    if last == "lm_head" || module == "head" {
        return Some(("the output head (lm_head)", W));
    }
    if mtp {
        return Some(("a multi-token-prediction (MTP) layer", W));
    }
    None
}

/// `tensor.keep-high-precision`.
fn high_precision(cx: &Cx) -> Vec<Finding> {
    let layers = cx.ck.model_config().map(|c| c.num_hidden_layers).ok();
    let mut out = Vec::new();
    let mut done = std::collections::HashSet::new();
    for raw in cx.ck.tensor_names() {
        let Some(info) = cx.ck.info(&raw) else {
            continue;
        };
        let leaf = raw.rsplit('.').next().unwrap_or(&raw);
        let quant_leaf = QUANT_LEAVES.iter().any(|q| leaf.ends_with(q));
        let quant_dtype = matches!(
            info.dtype,
            Dtype::U8 | Dtype::I8 | Dtype::F8_E4M3 | Dtype::F8_E5M2
        ) && leaf == "weight";
        if !quant_leaf && !quant_dtype {
            continue;
        }
        let m = module(&raw);
        let mtp = raw.starts_with("mtp.")
            || raw.contains(".mtp.")
            || matches!((layer_of(&raw), layers), (Some(l), Some(n)) if l >= n);
        let Some((what, sev)) = keep_high(m, mtp) else {
            continue;
        };
        if !done.insert(m.to_string()) {
            continue;
        }
        out.extend(cx.finding(
            "tensor.keep-high-precision",
            sev,
            &raw,
            &info.file,
            module(cx.ck.canonical_of(&raw).unwrap_or(&raw)),
            format!("`{m}` is {what} and is stored quantized ({:?} `{leaf}`): producers keep it in BF16 (Model-Optimizer #2091); engines either refuse it or run it with the quantized values", info.dtype),
            "Add the module to the producer's ignore / exclude_modules list and re-export it from the original checkpoint in BF16.",
        ));
    }
    out
}

/// How a tensor-parallel engine shards a weight: along its output rows (column-parallel) or its
/// input columns (row-parallel); None for a weight it replicates or this rule does not know.
fn tp_dim(canonical: &str) -> Option<bool> {
    let leaf = canonical.rsplit('.').next()?;
    match leaf {
        "wq_b" | "q_b_proj" | "q_proj" | "kv_b_proj" | "w1" | "w3" | "w13" | "gate_proj"
        | "up_proj" => Some(true),
        "o_proj" | "w2" | "down_proj" => Some(false),
        _ => None,
    }
}

/// `tp.scale-block`: every sharded dimension splits into whole scale blocks per rank.
fn tp_blocks(cx: &Cx, metas: &[WeightMeta], tp: usize) -> Vec<Finding> {
    let mut out = Vec::new();
    for m in metas {
        let Some(rows_split) = tp_dim(&m.canonical) else {
            continue;
        };
        let block = match (m.block, m.scheme) {
            (Some(b), _) => b,
            (None, Scheme::Nvfp4Ct | Scheme::Nvfp4ModelOpt) => [1, 16],
            (None, Scheme::Mxfp4 | Scheme::Mxfp8) => [1, 32],
            _ => continue,
        };
        let (dim, b, what) = if rows_split {
            (m.out_features, block[0], "output rows (column-parallel)")
        } else {
            (m.in_features, block[1], "input columns (row-parallel)")
        };
        let why = if !dim.is_multiple_of(tp) {
            format!("{dim} {what} do not divide by --tp {tp}")
        } else if !(dim / tp).is_multiple_of(b) {
            format!(
                "{dim} {what} split {tp} ways give {} per rank, not a multiple of the scale block's {b}: a shard boundary falls inside a block, whose one scale two ranks then need",
                dim / tp
            )
        } else {
            continue;
        };
        let tensor = m
            .tensors
            .block_scale
            .clone()
            .unwrap_or_else(|| m.canonical.clone());
        out.extend(cx.finding(
            "tp.scale-block",
            E,
            &tensor,
            &m.file,
            &m.canonical,
            format!("{why} (vLLM #52997)"),
            "Serve with a tensor-parallel size that splits every sharded dimension into whole scale blocks, or re-quantize with a block size that divides the per-rank shard.",
        ));
    }
    out
}
