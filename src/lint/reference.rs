//! `--reference`: dequantise the checkpoint and a reference (the BF16 original, or the same
//! model in another format) tensor by tensor and name the cause of any difference.
//!
//! The checkpoint's own scales cannot reveal a nibble swap, shifted or swizzled scale rows or a
//! consistently rescaled tensor: every decoder reads the same bytes the same way. Against a
//! reference the pattern of the difference tells the cause apart — a constant ratio is a
//! tensor scale, a per-row ratio pattern is the block scales, right norm with cosine ≈ 0 is the
//! packing — and each suspected cause is then confirmed by undoing it on the checkpoint's bytes
//! and checking the reference is matched. Pairs are streamed: one tensor of each checkpoint in
//! memory at a time.

use super::rules::Severity::{Error as E, Info as I, Warning as W};
use super::{Cx, Finding, Rules};
use crate::checkpoint::{Checkpoint, Dtype, QuantWeight, Scheme, WeightFormat};
use crate::numerics::nvfp4::Convention;
use crate::numerics::swizzle;
use crate::Result;

fn g(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        format!("{x}")
    } else if (1e-3..1e5).contains(&x.abs()) {
        let s = format!("{x:.4}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        format!("{x:.4e}")
    }
}

/// Cosine, norm ratio ‖a‖/‖r‖, and the spread (std of log) of the per-row norm ratios.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PairStats {
    pub cos: f64,
    pub norm_ratio: f64,
    pub row_log_std: f64,
    pub non_finite: usize,
}

pub fn pair_stats(a: &[f32], r: &[f32], cols: usize) -> PairStats {
    let (mut dot, mut na, mut nr, mut bad) = (0f64, 0f64, 0f64, 0usize);
    let mut logs = Vec::new();
    for (ra, rr) in a.chunks(cols.max(1)).zip(r.chunks(cols.max(1))) {
        let (mut x, mut y) = (0f64, 0f64);
        for (&p, &q) in ra.iter().zip(rr) {
            if !p.is_finite() || !q.is_finite() {
                bad += 1;
                continue;
            }
            let (p, q) = (p as f64, q as f64);
            dot += p * q;
            x += p * p;
            y += q * q;
        }
        na += x;
        nr += y;
        if x > 0.0 && y > 0.0 {
            logs.push(0.5 * (x / y).ln());
        }
    }
    let cos = if na > 0.0 && nr > 0.0 {
        dot / (na * nr).sqrt()
    } else if na == nr {
        1.0
    } else {
        0.0
    };
    let norm_ratio = if nr > 0.0 {
        (na / nr).sqrt()
    } else if na == 0.0 {
        1.0
    } else {
        f64::INFINITY
    };
    let row_log_std = if logs.len() > 1 {
        let m = logs.iter().sum::<f64>() / logs.len() as f64;
        (logs.iter().map(|l| (l - m).powi(2)).sum::<f64>() / logs.len() as f64).sqrt()
    } else {
        0.0
    };
    PairStats {
        cos,
        norm_ratio,
        row_log_std,
        non_finite: bad,
    }
}

/// A measured constant factor as the tensor scale means it: the nearest power of two when the
/// measurement is within 2 % of it (a doubled or halved scale; the measured value differs by the
/// quantization's own error), else the value itself.
pub fn factor_text(n: f64) -> String {
    match nearest_power_of_two(n) {
        Some(p) if p != 1.0 => format!("{} (measured {})", g(p), g(n)),
        _ => g(n),
    }
}

fn nearest_power_of_two(n: f64) -> Option<f64> {
    if !(n.is_finite() && n > 0.0) {
        return None;
    }
    let k = n.log2().round();
    ((n.log2() - k).abs() < 0.03).then(|| 2f64.powi(k as i32))
}

/// The stored tensor scale that makes a weight decode `n` × its reference, and the value that
/// reproduces the reference: (tensor, leaf, stored, corrected). CT's `weight_global_scale` is
/// the encode multiplier g (decoded = stored / g: corrected g·n), ModelOpt's `weight_scale_2`
/// the decode multiplier d (corrected d/n).
fn scale_fix(w: &QuantWeight, n: f64) -> Option<(String, &'static str, f32, f32)> {
    let WeightFormat::Nvfp4 {
        weight_global,
        convention,
        ..
    } = &w.format
    else {
        return None;
    };
    let tensor = w.tensors.global_scale.clone()?;
    let n = nearest_power_of_two(n).unwrap_or(n);
    let gs = *weight_global as f64;
    Some(match convention {
        Convention::CompressedTensors => (
            tensor,
            "weight_global_scale",
            *weight_global,
            (gs * n) as f32,
        ),
        Convention::ModelOpt => (tensor, "weight_scale_2", *weight_global, (gs / n) as f32),
    })
}

/// A reference finding with what a run needs to name it: the constant factor the weight
/// decodes off its reference by (`reference.global-scale`) and the stored tensor scale that
/// does it, with its value and the one that reproduces the reference.
#[derive(Clone, Debug)]
pub struct RefFinding {
    pub finding: Finding,
    pub factor: Option<f64>,
    /// (checkpoint tensor, its leaf as the format names it, stored value, corrected value).
    pub scale: Option<(String, &'static str, f32, f32)>,
}

fn close(x: f64, y: f64, tol: f64) -> bool {
    x > 0.0 && y > 0.0 && (x.ln() - y.ln()).abs() <= tol
}

/// Candidate repairs of a quantised weight's bytes, each named by the fault it undoes.
fn repairs(w: &QuantWeight) -> Vec<(&'static str, &'static str, QuantWeight)> {
    let mut v = Vec::new();
    let (o, _i) = (w.out_features, w.in_features);
    let with = |f: WeightFormat| QuantWeight {
        format: f,
        ..w.clone()
    };
    let rot = |s: &[u8], rows: usize, left: bool| -> Vec<u8> {
        let mut s = s.to_vec();
        if rows > 1 && s.len().is_multiple_of(rows) {
            let rb = s.len() / rows;
            if left {
                s.rotate_left(rb)
            } else {
                s.rotate_right(rb)
            }
        }
        s
    };
    match &w.format {
        WeightFormat::Nvfp4 { packed, scales, .. } | WeightFormat::Mxfp4 { packed, scales } => {
            let set = |p: Option<Vec<u8>>, s: Option<Vec<u8>>| -> WeightFormat {
                let mut f = w.format.clone();
                match &mut f {
                    WeightFormat::Nvfp4 { packed, scales, .. }
                    | WeightFormat::Mxfp4 { packed, scales } => {
                        if let Some(p) = p {
                            *packed = p;
                        }
                        if let Some(s) = s {
                            *scales = s;
                        }
                    }
                    _ => {}
                }
                f
            };
            let swapped: Vec<u8> = packed.iter().map(|b| b.rotate_left(4)).collect();
            v.push(("reference.packing", "the e2m1 nibbles of each byte are swapped (high nibble holds the even element; docs/NVFP4.md §1.2)", with(set(Some(swapped), None))));
            let cols = scales.len().checked_div(o).unwrap_or(0);
            if o >= 128 && cols.is_multiple_of(4) && cols > 0 && o.is_multiple_of(128) {
                let un = swizzle::unswizzle_128x4(scales, o, cols);
                v.push(("reference.block-scales", "the block scales are stored in the 128×4 swizzled layout (docs/NVFP4.md §5.1), not linear", with(set(None, Some(un)))));
            }
            v.push(("reference.block-scales", "the block-scale rows are shifted down by one (row r holds row r−1's scales: a wrong offset or TP slice)", with(set(None, Some(rot(scales, o, true))))));
            v.push((
                "reference.block-scales",
                "the block-scale rows are shifted up by one (row r holds row r+1's scales)",
                with(set(None, Some(rot(scales, o, false)))),
            ));
        }
        WeightFormat::Fp8Block { scales, block, .. } => {
            let rows = o.div_ceil(block[0]);
            let f32rot = |left: bool| -> Vec<f32> {
                let mut s = scales.clone();
                if rows > 1 && s.len().is_multiple_of(rows) {
                    let rb = s.len() / rows;
                    if left {
                        s.rotate_left(rb)
                    } else {
                        s.rotate_right(rb)
                    }
                }
                s
            };
            let set = |s: Vec<f32>| -> WeightFormat {
                let mut f = w.format.clone();
                if let WeightFormat::Fp8Block { scales, .. } = &mut f {
                    *scales = s;
                }
                f
            };
            v.push((
                "reference.block-scales",
                "the FP8 scale-grid rows are shifted down by one (wrong offset / TP slice)",
                with(set(f32rot(true))),
            ));
            v.push((
                "reference.block-scales",
                "the FP8 scale-grid rows are shifted up by one",
                with(set(f32rot(false))),
            ));
            v.push((
                "reference.block-scales",
                "the FP8 block scales are inverted (stored as divisors 1/s)",
                with(set(scales.iter().map(|s| 1.0 / s).collect())),
            ));
        }
        WeightFormat::Blocked { scales, .. } => {
            // a format of the table: its scale rows, as for the packed formats
            let set = |sc: Vec<u8>| -> WeightFormat {
                let mut f = w.format.clone();
                if let WeightFormat::Blocked { scales, .. } = &mut f {
                    *scales = sc;
                }
                f
            };
            v.push(("reference.block-scales", "the block-scale rows are shifted down by one (row r holds row r−1's scales: a wrong offset or TP slice)", with(set(rot(scales, o, true)))));
            v.push((
                "reference.block-scales",
                "the block-scale rows are shifted up by one (row r holds row r+1's scales)",
                with(set(rot(scales, o, false))),
            ));
        }
        WeightFormat::Dense { .. } => {}
    }
    v
}

const GATE_UP_FIX: &str = "Store gpt-oss's w13 (and its bias) as the release does: gate row i at row 2i, up row i at row 2i + 1 (convert a stacked [gate; up] layout by interleaving it once).";

/// For gpt-oss's fused gate/up weight or bias (`base` a `w13`, `a` of `rows` rows): the row order
/// the stored values are in when re-ordering them makes `matches` hold, and the re-ordered values.
/// Interleaving restores rows stored de-interleaved (stacked gate, then up); de-interleaving
/// restores rows interleaved twice.
fn gate_up_order(
    base: &str,
    a: &[f32],
    rows: usize,
    matches: impl Fn(&[f32]) -> bool,
) -> Option<(&'static str, Vec<f32>)> {
    use crate::served::faults::{deinterleave, interleave, is_w13};
    if !is_w13(base) || rows < 4 || !rows.is_multiple_of(2) || !a.len().is_multiple_of(rows) {
        return None;
    }
    let i = interleave(a, rows);
    if matches(&i) {
        return Some(("the gate and up rows are stored de-interleaved (all gate rows, then all up rows) where the release interleaves them", i));
    }
    let d = deinterleave(a, rows);
    matches(&d).then_some(("the gate and up rows are interleaved twice (a stacked-to-interleaved conversion applied to rows already interleaved)", d))
}

/// The diagnosis of one pair: (rule, evidence, fix), or None when the tensor matches.
pub fn diagnose(
    w: &QuantWeight,
    a: &[f32],
    r: &[f32],
    rules: &Rules,
) -> Result<Option<(&'static str, String, String)>> {
    let th = &rules.thresholds;
    let cols = w.in_features;
    let s = pair_stats(a, r, cols);
    let tol = (1.0 + th.reference_norm_tol).ln();
    let good = |p: &PairStats| {
        p.non_finite == 0 && p.cos >= th.reference_cos && close(p.norm_ratio, 1.0, tol)
    };
    if good(&s) {
        return Ok(None);
    }
    let head = format!(
        "vs reference: cosine {}, norm ratio {}, per-row log-ratio std {}{}",
        g(s.cos),
        g(s.norm_ratio),
        g(s.row_log_std),
        if s.non_finite > 0 {
            format!(", {} non-finite values", s.non_finite)
        } else {
            String::new()
        }
    );
    if s.non_finite == 0 && s.cos >= th.reference_cos && s.row_log_std < 0.05 {
        let n = s.norm_ratio;
        let mut reading = format!("a constant factor {}", factor_text(n));
        if let Some((t, leaf, stored, right)) = scale_fix(w, n) {
            reading.push_str(&format!(
                ": the stored {leaf} `{t}` = {} decodes it so; {} reproduces the reference",
                g(stored as f64),
                g(right as f64)
            ));
        }
        if let WeightFormat::Nvfp4 {
            weight_global,
            convention,
            ..
        } = &w.format
        {
            let gs = *weight_global as f64;
            let name = match convention {
                Convention::CompressedTensors => "weight_global_scale",
                Convention::ModelOpt => "weight_scale_2",
            };
            if close(n, gs * gs, 0.05) || close(n, 1.0 / (gs * gs), 0.05) {
                reading = format!("{} = {}²: the stored {name} is the reciprocal of the right one (the other producer's convention); reading it as 1/x reproduces the reference", g(n), g(gs));
            } else if close(n, 2688.0, 0.05) || close(n, 1.0 / 2688.0, 0.05) {
                reading = format!(
                    "{} ≈ 2688^{}: the {name} is off by 2688 = 6·448",
                    g(n),
                    if n > 1.0 { "1" } else { "−1" }
                );
            }
        } else if close(n, 2688.0, 0.05) || close(n, 1.0 / 2688.0, 0.05) {
            reading = format!("{} ≈ 2688^±1: a scale is off by 6·448", g(n));
        }
        return Ok(Some((
            "reference.global-scale",
            format!("{head}: the whole tensor is off by {reading}"),
            "Fix the tensor scale (docs/NVFP4.md §3.4): the direction of every weight is right, only the magnitude is not.".into(),
        )));
    }
    if let Some((order, fixed)) = gate_up_order(&w.canonical, a, w.out_features, |x| {
        good(&pair_stats(x, r, cols))
    }) {
        let p = pair_stats(&fixed, r, cols);
        return Ok(Some((
            "reference.row-order",
            format!(
                "{head}; {order} — re-ordering them gives cosine {} and norm ratio {}",
                g(p.cos),
                g(p.norm_ratio)
            ),
            GATE_UP_FIX.into(),
        )));
    }
    for (rule, cause, fixed) in repairs(w) {
        let d = fixed.dequantize()?;
        let p = pair_stats(&d.data, r, cols);
        if good(&p) {
            return Ok(Some((
                rule,
                format!("{head}; {cause} — undoing that gives cosine {} and norm ratio {}", g(p.cos), g(p.norm_ratio)),
                match rule {
                    "reference.packing" => "Re-pack with the low nibble holding the even element (docs/DSV4-LAYER.md §2.3).".into(),
                    _ => "Re-export the block scales linear, row-aligned with the weight rows (docs/NVFP4.md §3.4, §5).".into(),
                },
            )));
        }
    }
    let (rule, cause) = if s.non_finite == 0
        && s.cos.abs() < 0.3
        && close(s.norm_ratio, 1.0, (1.5f64).ln())
    {
        ("reference.packing", "the magnitude is right but the direction is not: the packing (nibble or K order) differs from the reference's")
    } else if s.non_finite == 0 && s.row_log_std >= 0.05 {
        ("reference.block-scales", "the per-row norm ratio varies: the block scales do not belong to their rows (layout, transposition or offset)")
    } else {
        (
            "reference.mismatch",
            "no single cause (tensor scale, block-scale layout, packing) explains the difference",
        )
    };
    Ok(Some((rule, format!("{head}; {cause}"), "Compare the export path of this tensor with the reference's; lint could not pin one cause.".into())))
}

/// Compare every quantised weight of `ck` with the same weight of `reference`.
pub fn compare(ck: &Checkpoint, reference: &Checkpoint, rules: &Rules) -> Result<Vec<Finding>> {
    Ok(compare_where(ck, reference, rules, |_| true)?
        .into_iter()
        .map(|r| r.finding)
        .collect())
}

/// [`compare`] over the weights and parameters a run of layers 0..=`last` reads (those of these
/// layers and those outside any layer), with each finding's factor and stored scale.
pub fn compare_layers(
    ck: &Checkpoint,
    reference: &Checkpoint,
    rules: &Rules,
    last: usize,
) -> Result<Vec<RefFinding>> {
    compare_where(ck, reference, rules, |name| {
        super::layer_of(name).is_none_or(|l| l <= last)
    })
}

fn compare_where(
    ck: &Checkpoint,
    reference: &Checkpoint,
    rules: &Rules,
    keep: impl Fn(&str) -> bool,
) -> Result<Vec<RefFinding>> {
    let cx = Cx::new(ck, rules);
    let mut out = Vec::new();
    let plain = |f: Finding| RefFinding {
        finding: f,
        factor: None,
        scale: None,
    };
    for base in ck.weight_bases().into_iter().filter(|b| keep(b)) {
        let Ok(meta) = ck.weight_meta(&base) else {
            continue;
        };
        if meta.scheme == Scheme::Dense {
            continue;
        }
        let tensor = meta.tensors.weight.clone();
        let Ok(w) = ck.weight(&base) else { continue };
        let Ok(a) = w.dequantize() else { continue };
        let r = match reference.weight(&base).and_then(|x| x.dequantize()) {
            Ok(r) => r,
            Err(e) => {
                out.extend(cx.finding("reference.absent", I, &tensor, &meta.file, &base, format!("no comparable weight in the reference: {e}"), "Nothing to fix; point --reference at a checkpoint of the same model to cover it.").map(plain));
                continue;
            }
        };
        if r.shape != a.shape {
            let t = r.shape.len() == 2
                && a.shape.len() == 2
                && r.shape[0] == a.shape[1]
                && r.shape[1] == a.shape[0];
            out.extend(
                cx.finding(
                    "reference.mismatch",
                    E,
                    &tensor,
                    &meta.file,
                    &base,
                    format!(
                        "shape {:?} vs reference {:?}{}",
                        a.shape,
                        r.shape,
                        if t { " (transposed)" } else { "" }
                    ),
                    "Store linear weights as [out, in] like the reference.",
                )
                .map(plain),
            );
            continue;
        }
        if let Some((rule, ev, fix)) = diagnose(&w, &a.data, &r.data, rules)? {
            let Some(mut f) = cx.finding(rule, E, &tensor, &meta.file, &base, ev, &fix) else {
                continue;
            };
            let (mut factor, mut scale) = (None, None);
            if rule == "reference.global-scale" {
                let n = pair_stats(&a.data, &r.data, w.in_features).norm_ratio;
                factor = Some(n);
                scale = scale_fix(&w, n);
                // a constant factor on a linear's output that an RMSNorm reads is absorbed there
                if let Some(norm) = super::checks::absorbing_norm(&base, n) {
                    f.evidence.push_str(&format!("; absorbed by {norm}: an RMSNorm divides by its input's RMS, so a constant factor on this linear's output does not change the norm's (a warning; `--strict` makes it an error)"));
                    f.severity = f.severity.min(W);
                    f.absorbed_by = Some(norm);
                }
            }
            out.push(RefFinding {
                finding: f,
                factor,
                scale,
            });
        }
    }
    out.extend(
        compare_params(&cx, reference)
            .into_iter()
            .filter(|f| keep(&f.tensor))
            .map(plain),
    );
    Ok(out)
}

/// Largest relative L2 difference between two stored copies of one parameter: BF16 keeps 8
/// significant bits, so re-storing a value changes it by at most 2⁻⁹ relative (rel-L2 ≤ 2e-3);
/// any real difference (another tensor's values, a different init) is far above.
const PARAM_REL_L2: f64 = 1e-2;

fn rel_l2(a: &[f32], r: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(r) {
        num += (x as f64 - y as f64).powi(2);
        den += (y as f64).powi(2);
    }
    if den > 0.0 {
        (num / den).sqrt()
    } else if num == 0.0 {
        0.0
    } else {
        f64::INFINITY
    }
}

/// Norm weights and biases (1-D `.weight` / `.bias` parameters) of a checkpoint, canonical names.
fn params_1d(ck: &Checkpoint) -> Vec<(String, usize)> {
    ck.canonical_names()
        .into_iter()
        .filter(|n| n.ends_with(".weight") || n.ends_with(".bias"))
        .filter_map(|n| {
            let i = ck.canonical_info(&n)?;
            let float = matches!(i.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32);
            (float && i.shape.len() == 1 && i.shape[0] > 1).then_some((n, i.shape[0]))
        })
        .collect()
}

/// Rule `reference.param`: the 1-D parameters (norm weights, router biases) the weight
/// comparison does not cover, each against the reference's of the same name; one that holds the
/// values of another parameter of its layer in the reference is named as a swap (the exporter
/// wrote two tensors under each other's names: the checkpoint's own numbers cannot show it).
fn compare_params(cx: &Cx, reference: &Checkpoint) -> Vec<Finding> {
    let ck = cx.ck;
    let refs = params_1d(reference);
    let mut out = Vec::new();
    for (name, len) in params_1d(ck) {
        let Some((_, rlen)) = refs.iter().find(|(n, _)| *n == name) else {
            continue;
        };
        let (Ok(a), Ok(r)) = (ck.tensor_f32(&name), reference.tensor_f32(&name)) else {
            continue;
        };
        // a fused expert bias is named by its row of the fused tensor (`…_bias[3]`)
        let raw = ck.raw_label(&name).unwrap_or_else(|| name.clone());
        let file = ck.canonical_info(&name).map(|i| i.file).unwrap_or_default();
        let base = name.strip_suffix(".weight").unwrap_or(&name).to_string();
        let d = if *rlen == len {
            rel_l2(&a.data, &r.data)
        } else {
            f64::INFINITY
        };
        if d <= PARAM_REL_L2 {
            continue;
        }
        // gpt-oss's w13 bias re-ordered with its weight
        let w13 = name.strip_suffix(".bias").unwrap_or("");
        if let Some((order, _)) = gate_up_order(w13, &a.data, len, |x| {
            *rlen == len && rel_l2(x, &r.data) <= PARAM_REL_L2
        }) {
            out.extend(cx.finding(
                "reference.row-order",
                E,
                &raw,
                &file,
                w13,
                format!(
                    "differs from the reference's `{name}` (rel-L2 {}): {order}",
                    g(d)
                ),
                GATE_UP_FIX,
            ));
            continue;
        }
        let layer = name.split_once(".attn").or_else(|| name.split_once(".ffn"));
        let swapped = refs.iter().find_map(|(other, olen)| {
            let same_layer = layer.is_some_and(|(l, _)| other.starts_with(&format!("{l}.")));
            if *other == name || *olen != len || !same_layer {
                return None;
            }
            let o = reference.tensor_f32(other).ok()?;
            let e = rel_l2(&a.data, &o.data);
            (e <= PARAM_REL_L2).then(|| (other.clone(), e))
        });
        let (ev, fix) = match swapped {
            Some((other, e)) => (
                format!("holds the reference's `{other}` (rel-L2 {} to it, {} to its own `{name}`): the two parameters are stored under each other's names", g(e), g(d)),
                format!("Store `{name}` and `{other}` under their own names (an export or conversion map that swaps them, e.g. q_norm/k_norm)."),
            ),
            None => (
                format!(
                    "differs from the reference's `{name}`: rel-L2 {}{}{}",
                    g(d),
                    if *rlen == len { String::new() } else { format!(" (length {len} vs {rlen})") },
                    if a.data.iter().all(|&x| x == 0.0) { "; every value is 0 (exported as zeros, never loaded?)" } else { "" }
                ),
                "Re-export the parameter from the original; norm weights and router biases are not quantized and must match it.".to_string(),
            ),
        };
        out.extend(cx.finding("reference.param", E, &raw, &file, &base, ev, &fix));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_doubled_or_halved_scale_is_named_as_such() {
        assert_eq!(factor_text(0.5015), "0.5 (measured 0.5015)");
        assert_eq!(factor_text(1.9991), "2 (measured 1.9991)");
        // not near a power of two, or no factor at all: the measurement as it is
        assert_eq!(factor_text(1.28), "1.28");
        assert_eq!(factor_text(1.004), "1.004");
        assert_eq!(nearest_power_of_two(0.25), Some(0.25));
        assert_eq!(nearest_power_of_two(0.7), None);
        assert_eq!(nearest_power_of_two(f64::NAN), None);
    }

    #[test]
    fn stats_of_scaled_and_orthogonal() {
        let r: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.1)
            .collect();
        let a: Vec<f32> = r.iter().map(|x| x * 4.0).collect();
        let s = pair_stats(&a, &r, 16);
        assert!(
            (s.cos - 1.0).abs() < 1e-12
                && (s.norm_ratio - 4.0).abs() < 1e-9
                && s.row_log_std < 1e-9
        );
        // [1, 0, 1, 0] vs [0, 1, 0, 1]: orthogonal, same norm.
        let s = pair_stats(&[1.0, 0.0, 1.0, 0.0], &[0.0, 1.0, 0.0, 1.0], 2);
        assert_eq!(s.cos, 0.0);
        assert!((s.norm_ratio - 1.0).abs() < 1e-12);
    }
}
