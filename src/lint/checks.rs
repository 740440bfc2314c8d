//! Per-weight rules (scalars, block scales, convention, layout) and the rules that need several
//! weights at once (missing activation scales, sentinels, activation plausibility and spread,
//! fused pairs).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use super::layout;
use super::rules::Severity::{self, Error as E, Info as I, Warning as W};
use super::wiring;
use super::{Cx, Finding};
use crate::checkpoint::formats::{AmaxRule, Block};
use crate::checkpoint::quant::implied_amax;
use crate::checkpoint::{Dtype, Fp8ScaleKind, Scheme, WeightMeta};
use crate::numerics::nvfp4::Convention;
use crate::numerics::{e4m3, swizzle, ue8m0};
use crate::served::fused;
use crate::Error;

const FP4_FP8_MAX: f64 = 2688.0;

fn g(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return format!("{x}");
    }
    let a = x.abs();
    if (1e-3..1e5).contains(&a) {
        let s = format!("{x:.4}");
        let s = s.trim_end_matches('0').trim_end_matches('.');
        s.to_string()
    } else {
        format!("{x:.4e}")
    }
}

fn push(out: &mut Vec<Finding>, f: Option<Finding>) {
    out.extend(f);
}

fn file_of(cx: &Cx, raw: &str, fallback: &Path) -> PathBuf {
    cx.ck
        .info(raw)
        .map(|i| i.file)
        .unwrap_or_else(|| fallback.to_path_buf())
}

/// Raw name of a weight without its leaf (`….weight_packed` / `….weight` / `…[e, a..b]`).
pub(crate) fn raw_stem(meta: &WeightMeta) -> String {
    let w = meta.tensors.weight.split('[').next().unwrap_or("");
    for s in [".weight_packed", ".weight"] {
        if let Some(stem) = w.strip_suffix(s) {
            return stem.to_string();
        }
    }
    w.to_string()
}

fn conv_name(c: Convention) -> &'static str {
    match c {
        Convention::CompressedTensors => "compressed-tensors encode scale g (amax = 2688/g)",
        Convention::ModelOpt => "ModelOpt decode scale d (amax = 2688·d)",
    }
}

fn other_conv_name(c: Convention) -> &'static str {
    match c {
        Convention::CompressedTensors => conv_name(Convention::ModelOpt),
        Convention::ModelOpt => conv_name(Convention::CompressedTensors),
    }
}

/// The amax a stored tensor scale implies when read in the other producer's convention.
fn other_amax(c: Convention, stored: f32) -> f64 {
    match c {
        Convention::CompressedTensors => FP4_FP8_MAX * stored as f64,
        Convention::ModelOpt => FP4_FP8_MAX / stored as f64,
    }
}

pub(crate) fn check_weight(cx: &Cx, base: &str) -> (Vec<Finding>, Option<WeightMeta>) {
    let mut out = Vec::new();
    let meta = match cx.ck.weight_meta_unchecked(base) {
        Ok(m) => m,
        Err(e) => {
            meta_error(cx, base, e, &mut out);
            return (out, None);
        }
    };
    // the check `run` makes before any op (`checkpoint::shapes`)
    if let Err(e) = cx.ck.check_config_shape(&meta) {
        push(
            &mut out,
            cx.finding(
                "config.model",
                E,
                &meta.tensors.weight,
                &meta.file,
                base,
                e.to_string(),
                "Fix config.json or the tensor: engines build the module from the config, and `run` refuses the checkpoint.",
            ),
        );
        return (out, None);
    }
    if meta.scheme == Scheme::Dense {
        return (out, Some(meta));
    }
    if let (Some(v), Some(t)) = (meta.weight_global, &meta.tensors.global_scale) {
        scalar(cx, &meta, "weight", t, v, &mut out);
    }
    if let (Some(v), Some(t)) = (meta.input_global, &meta.tensors.input_scale) {
        scalar(cx, &meta, "activation", t, v, &mut out);
    }
    if let Err(e) = block_scales(cx, &meta, &mut out) {
        let t = meta.tensors.block_scale.clone().unwrap_or_default();
        push(
            &mut out,
            cx.finding(
                "tensor.invalid",
                E,
                &t,
                &meta.file,
                base,
                e.to_string(),
                "Re-export the block scale tensor; lint could not read it.",
            ),
        );
    }
    (out, Some(meta))
}

/// A weight whose headers do not describe a readable scheme: a missing sibling, or block
/// scales in the padded swizzled shape, or something else.
fn meta_error(cx: &Cx, base: &str, e: Error, out: &mut Vec<Finding>) {
    let winfo = cx
        .ck
        .canonical_info(&format!("{base}.weight_packed"))
        .or_else(|| cx.ck.canonical_info(&format!("{base}.weight")));
    let wfile = winfo.as_ref().map(|i| i.file.clone()).unwrap_or_default();
    match e {
        Error::MissingTensor { tensor, hint, .. } => push(
            out,
            cx.finding(
                "scale.missing",
                E,
                &tensor,
                &wfile,
                base,
                format!("`{tensor}` is absent: {hint}"),
                "Re-export the weight with all its scale tensors; an engine loads a missing scale as 0 or garbage (vLLM #45212).",
            ),
        ),
        other => {
            if let Some(f) = swizzled_shape(cx, base) {
                out.push(f);
                return;
            }
            let (file, tensor) = match &other {
                Error::BadInput { file, tensor, .. } => {
                    (file.clone(), tensor.clone().unwrap_or_else(|| base.to_string()))
                }
                _ => (wfile, base.to_string()),
            };
            push(
                out,
                cx.finding(
                    "tensor.invalid",
                    E,
                    &tensor,
                    &file,
                    base,
                    other.to_string(),
                    "Fix the tensor's dtype/shape so it matches one scheme (docs/NVFP4.md §3.4, §6); no engine can load it as is.",
                ),
            )
        }
    }
}

/// Block scales whose shape is the padded 128×4-swizzled shape of the weight, not its linear one.
fn swizzled_shape(cx: &Cx, base: &str) -> Option<Finding> {
    let w = cx
        .ck
        .canonical_info(&format!("{base}.weight_packed"))
        .or_else(|| cx.ck.canonical_info(&format!("{base}.weight")))?;
    let sc = [format!("{base}.weight_scale"), format!("{base}.scale")]
        .into_iter()
        .find(|c| cx.ck.canonical_info(c).is_some())?;
    let s = cx.ck.canonical_info(&sc)?;
    if !matches!(w.dtype, Dtype::U8 | Dtype::I8) || w.shape.len() != 2 {
        return None;
    }
    let blk = if s.dtype == Dtype::F8_E4M3 { 16 } else { 32 };
    let (rows, inf) = (w.shape[0], w.shape[1] * 2);
    if inf % blk != 0 {
        return None;
    }
    let lin = (rows, inf / blk);
    let (rp, cp) = swizzle::padded_128x4(lin.0, lin.1);
    if s.shape != [rp, cp] || (rp, cp) == lin {
        return None;
    }
    let raw = cx.ck.resolve(&sc).unwrap_or(sc);
    cx.finding(
        "layout.swizzled",
        E,
        &raw,
        &s.file,
        base,
        format!(
            "block scale shape {:?} is the 128×4-swizzled padding of the linear [{}, {}] a [{rows}, {inf}] weight needs",
            s.shape, lin.0, lin.1
        ),
        "Store block scales linear [out, in/block] (unswizzle with docs/NVFP4.md §5.1 and drop the padding); only the serving engine swizzles.",
    )
}

/// Sentinels producers and loaders use for "not set".
fn sentinel(v: f32) -> Option<&'static str> {
    let a = v.abs();
    if a == f32::MAX {
        Some("float32 max")
    } else if a == f32::MIN_POSITIVE {
        Some("float32 smallest normal")
    } else if a == 3.389_531_4e38 {
        Some("bfloat16 max")
    } else if a == 65504.0 {
        Some("float16 max")
    } else if a == f32::EPSILON {
        Some("float32 epsilon")
    } else {
        None
    }
}

fn scalar(cx: &Cx, meta: &WeightMeta, which: &str, tensor: &str, v: f32, out: &mut Vec<Finding>) {
    let file = file_of(cx, tensor, &meta.file);
    let base = &meta.canonical;
    let (rule, ev, fix) = if !v.is_finite() {
        (
            "scale.global.non-finite",
            format!("{which} tensor scale = {v}"),
            "Recalibrate (the observer saw no data or divided by zero, compressed-tensors #595); never ship a NaN/Inf scale.",
        )
    } else if v == 0.0 {
        (
            "scale.global.zero",
            format!("{which} tensor scale = 0: encode scale 1/0 = inf, GEMM alpha 0"),
            "Recalibrate this scale; a 0 zeroes the op's output or turns it into NaN (vLLM #54189, #45212).",
        )
    } else if v < 0.0 {
        (
            "scale.global.negative",
            format!("{which} tensor scale = {}", g(v as f64)),
            "Tensor scales are amax-derived and positive; re-export with |scale| after finding why the sign flipped.",
        )
    } else if v.is_subnormal() {
        (
            "scale.global.denormal",
            format!("{which} tensor scale = {v:e} is subnormal: its reciprocal is inf"),
            "Recalibrate (a dead expert's near-zero amax, vLLM PR #42601) or clamp to the layer's smallest sane value.",
        )
    } else if let Some(s) = sentinel(v) {
        (
            "scale.global.sentinel",
            format!("{which} tensor scale = {v:e} ({s}), a placeholder, not a calibrated value"),
            "The scale was never written (sentinel initialisation, vllm-omni #5263); recalibrate it.",
        )
    } else {
        return;
    };
    push(out, cx.finding(rule, E, tensor, &file, base, ev, fix));
}

/// Block scales of one weight: NaN/negative bytes, zero rows, saturation, convention, layout,
/// FP8 power-of-two.
fn block_scales(cx: &Cx, meta: &WeightMeta, out: &mut Vec<Finding>) -> crate::Result<()> {
    let Some(sraw) = &meta.tensors.block_scale else {
        return Ok(());
    };
    if meta.block_scale_dtype.is_none() {
        return Ok(());
    }
    let base = meta.canonical.as_str();
    let sfile = file_of(cx, sraw, &meta.file);
    let (o, i) = (meta.out_features, meta.in_features);
    let Some(d) = meta.scheme.spec().decode else {
        return Ok(());
    };
    let (rows, cols, kind) = match d.block {
        Block::Row(bn) => (o, i / bn, d.scale.name()),
        Block::Grid => {
            let b = meta.block.unwrap_or([128, 128]);
            let k = if meta.fp8_scale_kind == Some(Fp8ScaleKind::Ue8m0) {
                "UE8M0"
            } else {
                "F32"
            };
            (o.div_ceil(b[0]), i.div_ceil(b[1]), k)
        }
    };
    let n = rows * cols;
    let (mut nan, mut neg, mut sat, mut nonpow2) = (0usize, 0usize, 0usize, 0usize);
    let mut first_nan = None;
    let mut first_neg = None;
    let mut zero_rows = Vec::new();
    let (mut max_s, mut min_s) = (0f32, f32::INFINITY);
    let bytes: Option<std::borrow::Cow<'_, [u8]>> = if kind == "F32" {
        None
    } else {
        // this weight's own scales (an expert's slice of a fused scale tensor)
        cx.ck.block_scale_bytes(meta)?
    };
    let bytes = bytes.as_deref();
    let len_err = |got: usize| {
        Error::bad(
            &sfile,
            Some(sraw),
            format!("{got} block scales, {n} expected for [{rows}, {cols}]"),
        )
    };
    if let Some(b) = bytes {
        // Byte formats: a histogram decides counts and extremes with 256 decodes, and only
        // the rare rows that start with a zero byte are scanned further.
        if b.len() != n {
            return Err(len_err(b.len()));
        }
        let e4 = kind == "E4M3";
        let decode = |x: u8| -> f32 {
            if e4 {
                e4m3::decode(x)
            } else if x == 0 {
                0.0 // UE8M0 0x00 = 2^-127: a zero scale for every practical purpose
            } else {
                ue8m0::decode(x)
            }
        };
        let mut hist = [0usize; 256];
        for &x in b {
            hist[x as usize] += 1;
        }
        for (x, &k) in hist.iter().enumerate() {
            if k == 0 {
                continue;
            }
            let v = decode(x as u8);
            if !v.is_finite() {
                nan += k;
            } else if v < 0.0 {
                neg += k;
            } else if v > 0.0 {
                max_s = max_s.max(v);
                min_s = min_s.min(v);
            }
            if e4 && v == 448.0 {
                sat += k;
            }
        }
        let zero_mask = if e4 { 0x7F } else { 0xFF };
        for (r, row) in b.chunks_exact(cols.max(1)).enumerate() {
            if row.iter().all(|&x| x & zero_mask == 0) {
                zero_rows.push(r);
            }
        }
        if nan + neg > 0 {
            for (k, &x) in b.iter().enumerate() {
                let v = decode(x);
                if !v.is_finite() {
                    first_nan.get_or_insert((k / cols, k % cols));
                } else if v < 0.0 {
                    first_neg.get_or_insert((k / cols, k % cols, v));
                }
            }
        }
    } else {
        let c = cx.ck.canonical_of(sraw).unwrap_or(sraw).to_string();
        let vals = cx.ck.tensor_f32(&c)?.data;
        if vals.len() != n {
            return Err(len_err(vals.len()));
        }
        for r in 0..rows {
            let row = &vals[r * cols..(r + 1) * cols];
            let mut all_zero = true;
            for (c, &v) in row.iter().enumerate() {
                if !v.is_finite() {
                    nan += 1;
                    first_nan.get_or_insert((r, c));
                    all_zero = false;
                    continue;
                }
                if v != 0.0 {
                    all_zero = false;
                }
                if v < 0.0 {
                    neg += 1;
                    first_neg.get_or_insert((r, c, v));
                } else if v > 0.0 {
                    max_s = max_s.max(v);
                    min_s = min_s.min(v);
                    if !ue8m0::is_pow2(v) {
                        nonpow2 += 1;
                    }
                }
            }
            if all_zero && cols > 0 {
                zero_rows.push(r);
            }
        }
    }
    if nan > 0 {
        let (r, c) = first_nan.unwrap_or((0, 0));
        let byte = bytes
            .map(|b| format!(", byte 0x{:02X}", b[r * cols + c]))
            .unwrap_or_default();
        push(out, cx.finding(
            "scale.block.nan",
            E,
            sraw,
            &sfile,
            base,
            format!("{nan} of {n} {kind} block scales are NaN; first at [{r}, {c}]{byte}"),
            "Re-export with block scales clamped to the format's range before the cast (ModelOpt #1633); a NaN scale poisons every output row that touches the block.",
        ));
    }
    if neg > 0 {
        let (r, c, v) = first_neg.unwrap_or((0, 0, 0.0));
        push(out, cx.finding(
            "scale.block.negative",
            E,
            sraw,
            &sfile,
            base,
            format!("{neg} of {n} block scales are negative; first at [{r}, {c}] = {}", g(v as f64)),
            "Producers write non-negative scales (UE4M3); re-export, the sign bit flips whole blocks.",
        ));
    }
    zero_row_findings(cx, meta, sraw, &sfile, &zero_rows, rows, cols, out)?;
    if kind == "E4M3" && n > 0 {
        let frac = sat as f64 / n as f64;
        if frac >= cx.th().saturated_fraction {
            push(out, cx.finding(
                "scale.block.saturated",
                E,
                sraw,
                &sfile,
                base,
                format!("{:.1}% of block scales are 448 (0x7E): their blocks' elements were clipped to ±6", 100.0 * frac),
                "Requantise with the tensor scale applied once (g = 2688/amax); a scale applied twice (vLLM #39407) or an amax far too small pins every block at 448.",
            ));
        }
    }
    convention(cx, meta, sraw, &sfile, kind, max_s, min_s, out);
    if nonpow2 > 0 {
        let ue = cx
            .ck
            .quantization_config()
            .and_then(|q| q.get("scale_fmt"))
            .and_then(|v| v.as_str())
            == Some("ue8m0");
        if ue {
            push(out, cx.finding(
                "fp8.scale.non-pow2",
                E,
                sraw,
                &sfile,
                base,
                format!("{nonpow2} of {n} FP8 block scales are not powers of two, but quantization_config.scale_fmt is \"ue8m0\""),
                "Round scales up to 2^ceil(log2(amax/448)) and store them as F8_E8M0 (docs/NVFP4.md §6.1); kernels on the UE8M0 path keep only the exponent (sglang #25704).",
            ));
        }
    }
    if let (Some(b), "E4M3" | "UE8M0") = (bytes, kind) {
        if let Some((lin, un)) = layout::swizzle_fits(b, rows, cols, 2) {
            let th = cx.th();
            if un > lin + th.swizzle_margin && un > th.swizzle_min_r2 {
                push(out, cx.finding(
                    "layout.swizzled",
                    E,
                    sraw,
                    &sfile,
                    base,
                    format!("two-way (row + column) fit of the block scales: R² {} read linear, {} after unswizzling 128×4 — the bytes are in the swizzled layout", g(lin), g(un)),
                    "Write block scales linear [out, in/block] (unswizzle with docs/NVFP4.md §5.1); checkpoints are linear and only the serving engine swizzles (modular #6600).",
                ));
            }
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn zero_row_findings(
    cx: &Cx,
    meta: &WeightMeta,
    sraw: &str,
    sfile: &Path,
    zero_rows: &[usize],
    rows: usize,
    cols: usize,
    out: &mut Vec<Finding>,
) -> crate::Result<()> {
    if zero_rows.is_empty() {
        return Ok(());
    }
    let base = meta.canonical.as_str();
    // The weight row a scale row covers, and how to read it: packed FP4 rows hold in/2 bytes
    // (a value is non-zero when its magnitude bits are), FP8 rows in bytes.
    let Some(d) = meta.scheme.spec().decode else {
        return Ok(());
    };
    let row_bytes = meta.in_features / d.elem.per_byte();
    let step = match d.block {
        Block::Grid => meta.block.unwrap_or([128, 128])[0],
        Block::Row(_) => 1,
    };
    let wc = [format!("{base}.weight_packed"), format!("{base}.weight")]
        .into_iter()
        .find(|c| cx.ck.canonical_info(c).is_some())
        .unwrap_or_default();
    let wraw = cx.ck.resolve(&wc).unwrap_or_default();
    // an expert's slice of a fused tensor (no canonical name of its own): its rows are read from
    // the slice, not from the fused tensor's start
    let sliced = !wraw.is_empty() && cx.ck.canonical_of(&wraw).is_none();
    let mut live = Vec::new();
    for &r in zero_rows.iter().take(4) {
        let b = if sliced {
            let (lo, hi) = (r * step * row_bytes, (r * step + 1) * row_bytes);
            cx.ck
                .canonical_bytes(&wc)?
                .get(lo..hi)
                .map(<[u8]>::to_vec)
                .ok_or_else(|| {
                    Error::bad(
                        &meta.file,
                        Some(&wraw),
                        format!("row {r} is past the slice's end"),
                    )
                })?
        } else {
            cx.sampler
                .row(cx.ck, &wraw, &meta.file, r * step, row_bytes)?
        };
        let nz: usize = b.iter().map(|&x| d.elem.nonzero_in(x)).sum();
        let total = row_bytes * d.elem.per_byte();
        live.push((r, nz, total));
    }
    let more = if zero_rows.len() > 4 {
        format!(
            " ({} zero rows in all; the first 4 sampled)",
            zero_rows.len()
        )
    } else {
        String::new()
    };
    let _ = rows;
    for (r, nz, total) in live {
        let (sev, ev, fix) = if nz > 0 {
            (
                E,
                format!("scale row {r}: all {cols} block scales are 0 while {nz} of {total} values of the weight row are non-zero — the row decodes to zeros{more}"),
                "Recompute the row's block scales from the weight (0x00 is only right for all-zero blocks); the op's output channel is silently lost.",
            )
        } else {
            (
                I,
                format!("scale row {r}: all {cols} block scales are 0 and the sampled weight row is all zero too{more}"),
                "Nothing to fix if the channel is pruned on purpose.",
            )
        };
        push(
            out,
            cx.finding("scale.block.zero-row", sev, sraw, sfile, base, ev, fix),
        );
    }
    Ok(())
}

/// Rule 4: the tensor scale against the block scales. For NVFP4 the largest block scale of a
/// correctly scaled tensor is close to 448 and the weight amax that scale and the stored tensor
/// scale imply is plausible for a weight; a stored value that works only as its reciprocal, or
/// only ×/÷2688, is the other producer's convention.
#[allow(clippy::too_many_arguments)]
fn convention(
    cx: &Cx,
    meta: &WeightMeta,
    sraw: &str,
    sfile: &Path,
    kind: &str,
    max_s: f32,
    min_s: f32,
    out: &mut Vec<Finding>,
) {
    let th = cx.th();
    let ok = |a: f64| a.is_finite() && a >= th.weight_amax_min && a <= th.weight_amax_max;
    let base = meta.canonical.as_str();
    if max_s <= 0.0 || !max_s.is_finite() {
        return;
    }
    let range = format!("[{}, {}]", g(th.weight_amax_min), g(th.weight_amax_max));
    let spec = meta.scheme.spec();
    let elem_max = spec.decode.map_or(f64::NAN, |d| d.elem.max() as f64);
    match (&spec.lint.amax, meta.convention, meta.weight_global) {
        (AmaxRule::TensorScale, Some(conv), Some(gs)) => {
            if gs.is_nan() || gs <= 0.0 || !gs.is_finite() || gs.is_subnormal() {
                return; // reported by the scalar rules
            }
            let tensor = meta.tensors.global_scale.clone().unwrap_or_default();
            let gfile = file_of(cx, &tensor, &meta.file);
            let stored = implied_amax(conv, gs) as f64 * max_s as f64 / 448.0;
            let other = other_amax(conv, gs) * max_s as f64 / 448.0;
            if !ok(stored) {
                let (ev, fix) = if ok(other) {
                    (
                        format!(
                            "tensor scale {} read as the {} implies weight amax {} (plausible {range}); read as the reciprocal, the {}, it implies {}: the value is in the other producer's convention",
                            g(gs as f64), conv_name(conv), g(stored), other_conv_name(conv), g(other)
                        ),
                        "Store the reciprocal (CT keeps g = 2688/amax as a divisor, ModelOpt d = amax/2688 as a multiplier, docs/NVFP4.md §3.4); an engine reading it as stored is off by the scale squared (modular #6600).",
                    )
                } else if ok(stored * FP4_FP8_MAX) || ok(stored / FP4_FP8_MAX) {
                    let fixed = if ok(stored * FP4_FP8_MAX) {
                        stored * FP4_FP8_MAX
                    } else {
                        stored / FP4_FP8_MAX
                    };
                    (
                        format!(
                            "tensor scale {} read as the {} implies weight amax {}; off by 2688 (= 6·448) it would be {}, and as the reciprocal {}",
                            g(gs as f64), conv_name(conv), g(stored), g(fixed), g(other)
                        ),
                        "Compute the tensor scale with the 6·448 factor (g = 2688/amax, d = amax/2688, docs/NVFP4.md §3.1).",
                    )
                } else {
                    (
                        format!(
                            "tensor scale {} implies weight amax {} read as the {}, {} as the reciprocal; neither is plausible {range}",
                            g(gs as f64), g(stored), conv_name(conv), g(other)
                        ),
                        "Recompute the tensor scale from the weight's amax (docs/NVFP4.md §3.3).",
                    )
                };
                push(
                    out,
                    cx.finding("scale.convention", E, &tensor, &gfile, base, ev, fix),
                );
            } else if (max_s as f64) < 448.0 / 64.0 {
                let hint = if (max_s as f64 - 448.0 / FP4_FP8_MAX).abs() < 0.05 {
                    " = 448/2688: the tensor scale used at quantisation lacked the 6·448 factor"
                } else {
                    ""
                };
                push(out, cx.finding(
                    "scale.convention",
                    E,
                    sraw,
                    sfile,
                    base,
                    format!(
                        "largest block scale is {}{hint}; a correct tensor scale puts it close to 448 (with tensor scale {} read as the {}, weight amax {})",
                        g(max_s as f64), g(gs as f64), conv_name(conv), g(stored)
                    ),
                    "Requantise with g = 2688/amax (CT) or d = amax/2688 (ModelOpt); the block scales now use a sliver of the E4M3 range and small blocks underflow.",
                ));
            }
        }
        (
            AmaxRule::BlockMax {
                inverted: true,
                fix,
            },
            _,
            _,
        ) => {
            let stored = max_s as f64 * elem_max;
            if !ok(stored) {
                let other = if min_s > 0.0 && min_s.is_finite() {
                    elem_max / min_s as f64
                } else {
                    f64::NAN
                };
                let ev = if ok(other) {
                    format!("block scales up to {} imply weight amax {} (plausible {range}); read as divisors (1/s) they imply {}: the scales are inverted", g(max_s as f64), g(stored), g(other))
                } else {
                    format!(
                        "block scales up to {} imply weight amax {}, outside {range}",
                        g(max_s as f64),
                        g(stored)
                    )
                };
                push(
                    out,
                    cx.finding("scale.convention", E, sraw, sfile, base, ev, fix),
                );
            }
        }
        (
            AmaxRule::BlockMax {
                inverted: false,
                fix,
            },
            _,
            _,
        ) => {
            let stored = max_s as f64 * elem_max;
            if !ok(stored) {
                push(
                    out,
                    cx.finding(
                        "scale.convention",
                        E,
                        sraw,
                        sfile,
                        base,
                        format!(
                            "{kind} block scales up to {} imply weight amax {}, outside {range}",
                            g(max_s as f64),
                            g(stored)
                        ),
                        fix,
                    ),
                );
            }
        }
        _ => {}
    }
}

/// Hard bounds on max|y| for y = x/rms(x) ⊙ γ: at least sqrt(D/Σγ⁻²) (all |yᵢ| equal), at most
/// sqrt(D)·max|γ| (all mass in one element).
pub fn norm_bounds(gamma: &[f32]) -> (f64, f64) {
    let d = gamma.len() as f64;
    let inv: f64 = gamma
        .iter()
        .map(|&x| {
            let x = x as f64;
            if x == 0.0 {
                f64::INFINITY
            } else {
                1.0 / (x * x)
            }
        })
        .sum();
    let lo = if inv.is_finite() && inv > 0.0 {
        (d / inv).sqrt()
    } else {
        0.0
    };
    let hi = d.sqrt() * gamma.iter().fold(0f64, |m, &x| m.max((x as f64).abs()));
    (lo, hi)
}

fn layer_prefix(base: &str) -> String {
    let mut it = base.splitn(3, '.');
    match (it.next(), it.next()) {
        (Some(a), Some(b)) if a == "layers" || a == "mtp" => format!("{a}.{b}"),
        _ => String::new(),
    }
}

/// Rules `config.model` and `weight.missing`: a config the model cannot be built from, and
/// tensors the config requires of the layers present that no stored tensor provides (a whole
/// expert left out of an export has no weight to describe, so the per-weight checks never see
/// it). Both read headers only.
pub(crate) fn completeness(cx: &Cx) -> Vec<Finding> {
    let mut out = Vec::new();
    if let Err(e) = cx.ck.model_config() {
        let msg = e.to_string();
        let field = msg
            .split_once("config field `")
            .and_then(|(_, r)| r.split_once('`'))
            .map_or("config.json", |(f, _)| f);
        out.extend(cx.finding(
            "config.model",
            E,
            field,
            cx.ck.config_path(),
            "",
            msg.clone(),
            "Fix config.json: engines build the model's modules from it, and `run` refuses it.",
        ));
    }
    // parameters (norms, biases, mHC, compressors' `ape`, sinks) against the config, the check
    // `run` makes before any op (`checkpoint::shapes`)
    for p in crate::checkpoint::shapes::shape_problems(cx.ck) {
        out.extend(cx.finding(
            "config.model",
            E,
            &p.tensor,
            &p.file,
            &p.base,
            p.to_error().to_string(),
            "Fix config.json or the tensor: engines build the module from the config, and `run` refuses the checkpoint.",
        ));
    }
    for m in cx.ck.missing_tensors() {
        out.extend(cx.finding(
            "weight.missing",
            E,
            &m.tensor,
            &m.file,
            &m.base,
            format!(
                "`{}` ({}) is absent: no tensor of the checkpoint maps to it, while its layer is there",
                m.tensor, m.what
            ),
            "Re-export the layer with all its weights; an engine fails to load it or leaves the module uninitialised.",
        ));
    }
    out
}

pub(crate) fn cross_checks(cx: &Cx, metas: &[WeightMeta]) -> Vec<Finding> {
    let mut out = Vec::new();
    let nv: Vec<&WeightMeta> = metas.iter().filter(|m| m.convention.is_some()).collect();
    missing_inputs(cx, &nv, &mut out);
    sentinels(cx, &nv, &mut out);
    activations(cx, &nv, &mut out);
    fused(cx, &nv, &mut out);
    out
}

fn missing_inputs(cx: &Cx, nv: &[&WeightMeta], out: &mut Vec<Finding>) {
    let with = nv.iter().filter(|m| m.input_global.is_some()).count();
    if with == 0 {
        return;
    }
    for m in nv.iter().filter(|m| m.input_global.is_none()) {
        let leaf = match m.convention {
            Some(Convention::CompressedTensors) => "input_global_scale",
            _ => "input_scale",
        };
        let t = format!("{}.{leaf}", raw_stem(m));
        push(out, cx.finding(
            "scale.missing",
            E,
            &t,
            &m.file,
            &m.canonical,
            format!("`{t}` is absent while {with} other NVFP4 weights of the checkpoint carry a static activation scale (W4A4)"),
            "Calibrate this weight's activation scale (experts never routed during calibration need one too: use the layer's max over experts); engines load it as 0 → 1/0 = inf → NaN (vLLM #45212).",
        ));
    }
}

fn sentinels(cx: &Cx, nv: &[&WeightMeta], out: &mut Vec<Finding>) {
    // (layer, which) → (count of scales, those exactly 1.0)
    type Ones<'m> = Vec<(&'m WeightMeta, String)>;
    let mut groups: BTreeMap<(String, &str), (usize, Ones)> = BTreeMap::new();
    for m in nv {
        // A whole layer's routed experts set to 1.0 is a default; attention and shared
        // experts are their own group.
        let fam = if m.canonical.contains(".ffn.experts.") {
            "routed experts"
        } else {
            "other weights"
        };
        let l = format!("{} {fam}", layer_prefix(&m.canonical));
        for (which, v, t) in [
            ("weight", m.weight_global, &m.tensors.global_scale),
            ("activation", m.input_global, &m.tensors.input_scale),
        ] {
            if let (Some(v), Some(t)) = (v, t) {
                let e = groups.entry((l.clone(), which)).or_default();
                e.0 += 1;
                if v == 1.0 {
                    e.1.push((m, t.clone()));
                }
            }
        }
    }
    for ((layer, which), (total, ones)) in groups {
        let all = ones.len() == total && total >= 2;
        for (m, t) in &ones {
            let (sev, ev) = if all {
                (E, format!("{which} tensor scale is exactly 1.0, as are all {total} {which} scales of {layer}: a default, not a calibration"))
            } else {
                (W, format!("{which} tensor scale is exactly 1.0 (implied amax 2688), the value producers substitute for a failed calibration; {} of {total} in {layer}", ones.len()))
            };
            let file = file_of(cx, t, &m.file);
            push(out, cx.finding(
                "scale.global.sentinel",
                sev,
                t,
                &file,
                &m.canonical,
                ev,
                "Recalibrate; 1.0 saturates real activations above amax 2688 and is wrong for anything else (compressed-tensors #595).",
            ));
        }
    }
}

fn activations(cx: &Cx, nv: &[&WeightMeta], out: &mut Vec<Finding>) {
    let th = cx.th();
    let mut norms: HashMap<String, Option<(f64, f64)>> = HashMap::new();
    // (layer, projection) → [(meta, amax)]
    let mut experts: BTreeMap<(String, &str), Vec<(&WeightMeta, f64)>> = BTreeMap::new();
    for m in nv {
        let (Some(v), Some(conv), Some(t)) = (m.input_global, m.convention, &m.tensors.input_scale)
        else {
            continue;
        };
        if v.is_nan() || v <= 0.0 || !v.is_finite() || v.is_subnormal() || v == 1.0 {
            continue; // the scalar and sentinel rules speak for these
        }
        let a = implied_amax(conv, v) as f64;
        let other = other_amax(conv, v);
        // the norm in front of the linear, for the post-RMSNorm amax bounds
        let norm = wiring::input_norms(&m.canonical)
            .into_iter()
            .find(|n| cx.ck.canonical_info(n).is_some());
        let bounds = norm.as_ref().and_then(|n| {
            *norms.entry(n.clone()).or_insert_with(|| {
                cx.ck
                    .tensor_f32(n)
                    .ok()
                    .filter(|t| !t.data.is_empty())
                    .map(|t| norm_bounds(&t.data))
            })
        });
        let (lo, hi, why) = match (bounds, &norm) {
            (Some((lo, hi)), Some(n)) => (
                lo / th.norm_slack,
                hi * th.norm_slack,
                format!("the input is RMSNorm output (`{n}`): amax ∈ [{}, {}] by construction, ×/÷{} slack", g(lo), g(hi), g(th.norm_slack)),
            ),
            _ => (
                th.input_amax_min,
                th.input_amax_max,
                format!("plausible activation amax range [{}, {}]", g(th.input_amax_min), g(th.input_amax_max)),
            ),
        };
        let file = file_of(cx, t, &m.file);
        let inside = |x: f64| x.is_finite() && x >= lo && x <= hi;
        if !inside(a) {
            if inside(other) {
                push(out, cx.finding(
                    "scale.convention",
                    E,
                    t,
                    &file,
                    &m.canonical,
                    format!("activation scale {} read as the {} implies activation amax {}; read as the reciprocal, the {}, it implies {}; {why}", g(v as f64), conv_name(conv), g(a), other_conv_name(conv), g(other)),
                    "Store the activation scale in the checkpoint's own convention (CT input_global_scale = 2688/amax, ModelOpt input_scale = amax/2688); read as is it under- or overflows every activation block (vLLM #45212-class loader bug).",
                ));
            } else {
                let rel = if a < lo {
                    format!("{}× below the lower bound", g(lo / a))
                } else {
                    format!("{}× above the upper bound", g(a / hi))
                };
                push(out, cx.finding(
                    "scale.input.implausible",
                    E,
                    t,
                    &file,
                    &m.canonical,
                    format!("activation scale {} implies activation amax {} ({rel}); {why}", g(v as f64), g(a)),
                    "Recalibrate the activation scale on representative data; a too-small amax saturates activation blocks at 448, a too-large one underflows them to zero (docs/NVFP4.md §7.2).",
                ));
            }
            continue;
        }
        if m.canonical.contains(".ffn.experts.") {
            let proj = if m.canonical.ends_with(".w2") {
                "w2"
            } else {
                "w1/w3"
            };
            experts
                .entry((layer_prefix(&m.canonical), proj))
                .or_default()
                .push((m, a));
        }
    }
    for ((layer, proj), v) in experts {
        if v.len() < 3 {
            continue;
        }
        let mut s: Vec<f64> = v.iter().map(|x| x.1).collect();
        s.sort_by(|a, b| a.total_cmp(b));
        let med = s[s.len() / 2];
        for (m, a) in &v {
            let ratio = (a / med).max(med / a);
            let sev = if ratio >= th.spread_error {
                E
            } else if ratio >= th.spread_warning {
                W
            } else {
                continue;
            };
            let t = m.tensors.input_scale.clone().unwrap_or_default();
            let file = file_of(cx, &t, &m.file);
            push(out, cx.finding(
                "scale.input.spread",
                sev,
                &t,
                &file,
                &m.canonical,
                format!("activation amax {} vs the median {} of {} experts' {proj} in {layer}: {}× {}", g(*a), g(med), v.len(), g(ratio), if *a < med { "smaller" } else { "larger" }),
                "Recalibrate this expert with enough routed tokens, or give never-routed experts the layer's max amax for the projection.",
            ));
        }
    }
}

/// Weight-scale factors an RMSNorm behind the shard provably absorbs: any magnification (the
/// norm's eps then matters even less), and shrinking down to ×1/4, where the norm's output moves by
/// eps·15/(2·ms) relative — below 1e-3 while the shard's output RMS stays above 0.09 at eps = 1e-6
/// (the run measures the real activations; `run`/`bisect` classify by what they see).
const ABSORBED_MIN_FACTOR: f64 = 0.25;

/// The RMSNorm that follows a fused shard (`wiring::output_norm_op`: V4's q_a/kv, V3's q_a,
/// Qwen3's q/k), when a constant factor on the shard's output is absorbed by it.
pub(super) fn absorbing_norm(base: &str, factor: f64) -> Option<String> {
    if !(factor.is_finite() && factor >= ABSORBED_MIN_FACTOR) {
        return None;
    }
    wiring::output_norm_op(base)
}

/// The fused groups among `nv` (members of one convention), each in wiring order: a member no
/// other member names as its partner first (q_proj, then k_proj, then v_proj; w1, then w3).
fn fused_groups<'m>(nv: &[&'m WeightMeta]) -> Vec<Vec<&'m WeightMeta>> {
    let by: HashMap<&str, &WeightMeta> = nv.iter().map(|m| (m.canonical.as_str(), *m)).collect();
    let mut groups: Vec<Vec<&WeightMeta>> = Vec::new();
    for m in nv {
        let mut members = vec![*m];
        members.extend(
            wiring::fused_partners(&m.canonical)
                .iter()
                .filter_map(|p| by.get(p.as_str()).copied())
                .filter(|p| p.convention == m.convention),
        );
        if members.len() < 2 {
            continue;
        }
        let same = |a: &WeightMeta, b: &WeightMeta| a.canonical == b.canonical;
        match groups
            .iter_mut()
            .find(|g| g.iter().any(|x| members.iter().any(|y| same(x, y))))
        {
            Some(g) => {
                for y in members {
                    if !g.iter().any(|x| same(x, y)) {
                        g.push(y);
                    }
                }
            }
            None => groups.push(members),
        }
    }
    for grp in &mut groups {
        // how many members name it as their partner: 0 for the head
        let named = |m: &WeightMeta| {
            grp.iter()
                .filter(|x| wiring::fused_partners(&x.canonical).contains(&m.canonical))
                .count()
        };
        let mut keyed: Vec<(usize, String, &'m WeightMeta)> = grp
            .iter()
            .map(|m| (named(m), m.canonical.clone(), *m))
            .collect();
        keyed.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        *grp = keyed.into_iter().map(|k| k.2).collect();
    }
    groups
}

fn fused(cx: &Cx, nv: &[&WeightMeta], out: &mut Vec<Finding>) {
    for grp in fused_groups(nv) {
        if grp.len() >= 3 {
            odd_one_out(cx, &grp, out);
        } else {
            fused_pair(cx, grp[0], grp[1], &["weight", "activation"], out);
        }
    }
}

/// The short name of a member in the evidence: the canonical base's last component (`v_proj`).
fn member(m: &WeightMeta) -> &str {
    m.canonical.rsplit('.').next().unwrap_or(&m.canonical)
}

/// A fused group of three or more (Qwen3's and gpt-oss's q/k/v): the member whose tensor scale
/// disagrees with all the others, which agree among themselves, is the one that is wrong; the
/// finding names it, and whether its own consumer absorbs the factor. When no majority agrees the
/// finding says that lint cannot tell which member is wrong (`--reference` can).
fn odd_one_out(cx: &Cx, grp: &[&WeightMeta], out: &mut Vec<Finding>) {
    let th = cx.th();
    let conv = grp[0].convention.unwrap_or(Convention::ModelOpt);
    let names = grp.iter().map(|m| member(m)).collect::<Vec<_>>().join(", ");
    type Pick = fn(&WeightMeta) -> (Option<f32>, Option<&String>);
    let picks: [(&str, Pick); 2] = [
        ("weight", |m| {
            (m.weight_global, m.tensors.global_scale.as_ref())
        }),
        ("activation", |m| {
            (m.input_global, m.tensors.input_scale.as_ref())
        }),
    ];
    for (which, pick) in picks {
        let vals: Vec<(&WeightMeta, f32, &String)> = grp
            .iter()
            .filter_map(|m| {
                let (v, t) = pick(m);
                let (v, t) = (v?, t?);
                (v > 0.0 && v.is_finite()).then_some((*m, v, t))
            })
            .collect();
        if vals.len() < 2 {
            continue;
        }
        if vals.len() == 2 {
            // a member without the scalar: the two that have it, as a pair
            fused_pair(cx, vals[0].0, vals[1].0, &[which], out);
            continue;
        }
        let agree = |a: f32, b: f32| (a.max(b) / a.min(b)) as f64 <= th.fused_warning;
        let hi = vals.iter().map(|v| v.1).fold(f32::MIN, f32::max);
        let lo = vals.iter().map(|v| v.1).fold(f32::MAX, f32::min);
        if agree(hi, lo) {
            continue;
        }
        let listed = vals
            .iter()
            .map(|(_, v, t)| format!("`{t}` = {}", g(*v as f64)))
            .collect::<Vec<_>>()
            .join(", ");
        // the member every other member disagrees with, while those agree among themselves
        let odd = (0..vals.len()).find(|&i| {
            let rest: Vec<f32> = (0..vals.len())
                .filter(|&j| j != i)
                .map(|j| vals[j].1)
                .collect();
            rest.iter().all(|&x| !agree(x, vals[i].1)) && rest.iter().all(|&x| agree(x, rest[0]))
        });
        let Some(i) = odd else {
            let ratio = (hi / lo) as f64;
            let sev = if ratio >= th.fused_error { E } else { W };
            let (m, _, t) = vals[0];
            let file = file_of(cx, t, &m.file);
            push(out, cx.finding(
                "fused.mismatch",
                sev,
                t,
                &file,
                &m.canonical,
                format!("{which} tensor scales of a fused group ({names}) all differ: {listed} (largest ratio {}); no two agree, so lint cannot tell which member is wrong (`lint --reference ORIGINAL` compares each with the original); an engine that fuses them keeps one (vLLM: the max, {}) and every other member decodes off its own scale", g(ratio), g(hi as f64)),
                "Re-export with linked observers so the members share one tensor scale (max amax of the group, docs/NVFP4.md §3.4); vLLM #54974.",
            ));
            continue;
        };
        let (m, v, t) = vals[i];
        let major = vals[if i == 0 { 1 } else { 0 }].1;
        let ratio = (v.max(major) / v.min(major)) as f64;
        // the odd member's own reading relative to its group's (CT g divides, ModelOpt d multiplies)
        let own = match conv {
            Convention::CompressedTensors => (major / v) as f64,
            Convention::ModelOpt => (v / major) as f64,
        };
        let others: Vec<&WeightMeta> = vals
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != i)
            .map(|(_, x)| x.0)
            .collect();
        let agreeing = others
            .iter()
            .map(|o| format!("`{}`", member(o)))
            .collect::<Vec<_>>()
            .join(" and ");
        // vLLM keeps the max: when it is the odd member's, the others decode off theirs
        let kept_is_odd = v > major;
        let sib = match conv {
            Convention::CompressedTensors => 1.0 / ratio,
            Convention::ModelOpt => ratio,
        };
        let mut evidence = format!(
            "{which} tensor scales of a fused group ({names}) disagree: {listed}; {agreeing} agree, `{}` is the odd one out (ratio {}), so `{t}` is the one off: `{}` {} ×{} relative to its group's",
            member(m),
            g(ratio),
            member(m),
            if which == "weight" { "decodes" } else { "has its activations scaled" },
            g(own)
        );
        evidence.push_str(&if kept_is_odd {
            format!("; an engine that fuses them keeps one (vLLM: the max, {}, the odd member's) and {agreeing} then {} ×{}", g(v as f64), if which == "weight" { "decode" } else { "have their activations scaled" }, g(sib))
        } else {
            format!("; an engine that fuses them keeps one (vLLM: the max, {}, the group's) and reads `{}` with it", g(major as f64), member(m))
        });
        let mut absorbed = None;
        if which == "weight" {
            let own_norm = absorbing_norm(&m.canonical, own);
            let sibs_absorbed = !kept_is_odd
                || others
                    .iter()
                    .all(|o| absorbing_norm(&o.canonical, sib).is_some());
            match (&own_norm, wiring::output_norm_op(&m.canonical)) {
                (Some(norm), _) if sibs_absorbed => {
                    evidence.push_str(&format!("; absorbed by {norm}: an RMSNorm divides by its input's RMS, and a wrong weight tensor scale multiplies `{}`'s output by one constant, so the norm's output does not change (a warning; `--strict` makes it an error)", member(m)));
                    absorbed = own_norm;
                }
                (Some(norm), _) => evidence.push_str(&format!("; {norm} absorbs `{}`'s own factor, but not the engine's on the members without a norm after them", member(m))),
                (None, Some(norm)) => evidence.push_str(&format!("; not absorbed: {norm} follows `{}`, but a factor below ×{ABSORBED_MIN_FACTOR} lets its eps matter", member(m))),
                (None, None) => evidence.push_str(&format!("; not absorbed: no norm reads `{}`'s output", member(m))),
            }
        }
        let sev: Severity = if absorbed.is_some() || ratio < th.fused_error {
            W
        } else {
            E
        };
        let file = file_of(cx, t, &m.file);
        if let Some(mut f) = cx.finding(
            "fused.mismatch",
            sev,
            t,
            &file,
            &m.canonical,
            evidence,
            "Re-export the odd member's tensor scale with its group's (linked observers: one tensor scale per fused group, max amax of the group, docs/NVFP4.md §3.4); vLLM #54974.",
        ) {
            f.absorbed_by = absorbed;
            out.push(f);
        }
    }
}

/// Two members of a fused GEMM (w1/w3, V4's q_a/kv, V3's q_a/kv_a): which one loses the
/// engine's merge and by how much.
fn fused_pair(cx: &Cx, m: &WeightMeta, p: &WeightMeta, kinds: &[&str], out: &mut Vec<Finding>) {
    let th = cx.th();
    {
        if m.convention != p.convention {
            return;
        }
        let conv = m.convention.unwrap_or(Convention::ModelOpt);
        for (which, a, bb, ta, tb) in [
            (
                "weight",
                m.weight_global,
                p.weight_global,
                &m.tensors.global_scale,
                &p.tensors.global_scale,
            ),
            (
                "activation",
                m.input_global,
                p.input_global,
                &m.tensors.input_scale,
                &p.tensors.input_scale,
            ),
        ] {
            let (Some(a), Some(bv), Some(ta), Some(tb)) = (a, bb, ta, tb) else {
                continue;
            };
            if !kinds.contains(&which) {
                continue;
            }
            if !(a > 0.0 && bv > 0.0 && a.is_finite() && bv.is_finite()) {
                continue;
            }
            let ratio = (a.max(bv) / a.min(bv)) as f64;
            if ratio <= th.fused_warning {
                continue;
            }
            // the engine's rule for this group (`served::fused`): which stored value it keeps
            let kind = fused::group(&m.canonical).map_or(fused::GroupKind::Merged, |g| g.kind);
            let w = if which == "weight" {
                fused::Which::Weight
            } else {
                fused::Which::Activation
            };
            let Some((kept, at)) = fused::kept(kind, w, conv, &[a, bv]) else {
                continue;
            };
            // the shard whose own value lost the merge, and its own stored value
            let (mis_base, mis, own) = if at == 0 {
                (p.canonical.as_str(), tb, bv)
            } else {
                (m.canonical.as_str(), ta, a)
            };
            // what the shard's decode scale is multiplied by: d_kept/d_own (ModelOpt stores d),
            // g_own/g_kept (compressed-tensors stores g = 1/d)
            let factor = match conv {
                Convention::CompressedTensors => (own / kept) as f64,
                Convention::ModelOpt => (kept / own) as f64,
            };
            let rule = match kind {
                fused::GroupKind::RoutedW13 if which == "weight" => {
                    "vLLM's fused MoE: the gate (w1) shard's, "
                }
                fused::GroupKind::RoutedW13 if conv == Convention::CompressedTensors => {
                    "vLLM's fused MoE: the largest decode scale = the smallest, "
                }
                _ => "vLLM: the max, ",
            };
            let absorbed = if which == "weight" {
                absorbing_norm(mis_base, factor)
            } else {
                None
            };
            let sev: Severity = if absorbed.is_some() {
                W
            } else if ratio >= th.fused_error {
                E
            } else {
                W
            };
            let file = file_of(cx, tb, &p.file);
            let mut evidence = format!("{which} tensor scales of a fused pair differ: `{ta}` = {}, `{tb}` = {} (ratio {}); an engine that fuses them keeps one ({rule}{}) and `{mis}` then {} ×{}", g(a as f64), g(bv as f64), g(ratio), g(kept as f64), if which == "weight" { "decodes" } else { "has its activations scaled" }, g(factor));
            if let Some(norm) = &absorbed {
                evidence.push_str(&format!("; absorbed by {norm}: an RMSNorm divides by its input's RMS, and a wrong weight tensor scale multiplies the shard's output by one constant, so the norm's output does not change (a warning; `--strict` makes it an error)"));
            }
            if let Some(mut f) = cx.finding(
                "fused.mismatch",
                sev,
                tb,
                &file,
                &p.canonical,
                evidence,
                "Re-export with linked observers so both members share one tensor scale (max amax of the pair, docs/NVFP4.md §3.4); vLLM #54974.",
            ) {
                f.absorbed_by = absorbed;
                out.push(f);
            }
        }
    }
}
