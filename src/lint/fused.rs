//! gpt-oss's fused expert tensors (one per projection for all of a layer's experts: MXFP4
//! `*_blocks` with `*_scales`, BF16 `gate_up_proj`, `*_bias`), named as the checkpoint stores them.
//!
//! Why: the checkpoint reads a fused tensor as one canonical tensor per expert, so a left-out
//! `gate_up_proj_scales` surfaces as eight experts' missing `weight_scale` under a name no file
//! holds (`…gate_up_proj_blocks.weight_scale`), and a left-out `down_proj_bias` as eight
//! canonical biases. A porter looks for the tensor the release stores: this module names the
//! pair (`_blocks` without its `_scales`, or the reverse) and the fused tensor a missing expert
//! piece belongs to, and drops the per-expert findings it replaces.

use std::collections::BTreeMap;

use super::rules::Severity::Error as E;
use super::{Cx, Finding};
use crate::checkpoint::formats::TABLE;
use crate::checkpoint::naming::{canonical_in, Canon, FusedLayout, Naming};

/// The fused projections: canonical projection, transformers' fused name.
const PROJ: [(&str, &str); 2] = [("w13", "gate_up_proj"), ("w2", "down_proj")];

/// One format's fused data/scale pair, one of which the checkpoint lacks.
struct Unpaired {
    /// Canonical layer prefix (`layers.1`) and projection (`w13`).
    prefix: String,
    proj: String,
    /// Raw names: the data tensor (`…_blocks`), the scale tensor (`…_scales`).
    data: String,
    scale: String,
    data_present: bool,
    /// The format whose fused pair it is.
    spec: &'static crate::checkpoint::formats::FormatSpec,
}

/// The (layer prefix, projection) a fused raw name stands for, through the reader's own mapping.
fn fused_target(raw: &str) -> Option<(String, String)> {
    match canonical_in(raw, Naming::Hf, FusedLayout::Interleaved) {
        Canon::PerExpert { prefix, leaf, .. } => {
            let proj = leaf.split('.').next()?.to_string();
            Some((prefix, proj))
        }
        _ => None,
    }
}

fn unpaired(cx: &Cx) -> Vec<Unpaired> {
    let names = cx.ck.tensor_names();
    let has = |n: &str| cx.ck.info(n).is_some();
    let mut out = Vec::new();
    for n in &names {
        // fused tensors map to many canonical tensors, so none is recorded for them
        if cx.ck.canonical_of(n).is_some() {
            continue;
        }
        for (spec, f) in TABLE
            .iter()
            .filter_map(|s| Some((s, s.tensors.fused_experts.as_ref()?)))
        {
            // a data tensor named as the fused weight itself (ModelOpt's NVFP4) is that format's
            // only when it holds its packed bytes
            let bytes_of_spec = || {
                cx.ck
                    .info(n)
                    .is_some_and(|i| spec.tensors.weight_dtypes.contains(&i.dtype))
            };
            let (stem, data_present) = if let Some(s) = n.strip_suffix(f.scale_suffix) {
                (s, false)
            } else if let Some(s) = n.strip_suffix(f.data_suffix) {
                if f.data_suffix.is_empty()
                    && !(PROJ.iter().any(|(_, p)| n.ends_with(p)) && bytes_of_spec())
                {
                    continue;
                }
                (s, true)
            } else {
                continue;
            };
            let (data, scale) = (
                format!("{stem}{}", f.data_suffix),
                format!("{stem}{}", f.scale_suffix),
            );
            let other = if data_present { &scale } else { &data };
            if has(other) {
                continue;
            }
            if let Some((prefix, proj)) = fused_target(n) {
                out.push(Unpaired {
                    prefix,
                    proj,
                    data,
                    scale,
                    data_present,
                    spec,
                });
            }
        }
    }
    out
}

/// Replace the per-expert findings about gpt-oss's fused tensors by findings naming the fused
/// tensors: an unpaired `_blocks`/`_scales` (an error naming both), and the fused tensor each
/// group of missing expert pieces belongs to.
pub(crate) fn fused_findings(cx: &Cx, findings: &mut Vec<Finding>) {
    let layout_interleaved =
        crate::model::family::detect(cx.ck.config_json()).is_some_and(|k| k.interleaved_experts());
    if !layout_interleaved {
        return;
    }
    let pairs = unpaired(cx);
    let covered = |tensor: &str| {
        pairs.iter().any(|p| {
            tensor.starts_with(&format!("{}.", p.data))
                || expert_piece(tensor).is_some_and(|(prefix, _, proj, leaf)| {
                    prefix == p.prefix && proj == p.proj && leaf == "weight"
                })
        })
    };
    findings.retain(|f| {
        !(matches!(f.rule.as_str(), "scale.missing" | "weight.missing") && covered(&f.tensor))
    });
    for p in &pairs {
        let base = format!("{}.ffn.experts.0.{}", p.prefix, p.proj);
        let (present, absent) = if p.data_present {
            (&p.data, &p.scale)
        } else {
            (&p.scale, &p.data)
        };
        let file = cx.ck.info(present).map(|i| i.file).unwrap_or_default();
        let (fmt, code) = (
            p.spec.name,
            p.spec.decode.map_or("block", |d| d.scale.name()),
        );
        let nvfp4 = p
            .spec
            .tensors
            .fused_experts
            .as_ref()
            .is_some_and(|f| f.transposed);
        let (rule, ev, fix) = if p.data_present {
            (
                "scale.missing",
                format!("`{}` (every expert's {fmt} data of this projection) is stored without `{}`, its {code} block scales: an engine fails to load it or reads every block with its scale parameter's initial value{}", p.data, p.scale,
                    if nvfp4 { " (vLLM #46641: ModelOpt's underscore scale keys dropped → NaN logits, \"!!!!\" output)" } else { " (scale 1, E8M0 127)" }),
                if nvfp4 {
                    "Export `_weight_scale`, `_weight_scale_2` and `_input_scale` beside every fused NVFP4 expert projection, as ModelOpt's export of gpt-oss does."
                } else {
                    "Export `_scales` beside `_blocks` for every fused expert projection, as the gpt-oss release does."
                },
            )
        } else {
            (
                "weight.missing",
                format!("`{}` (every expert's {code} block scales of this projection) is stored without `{}`, the {fmt} data they scale", p.scale, p.data),
                if nvfp4 {
                    "Export the packed NVFP4 weight beside its `_weight_scale` for every fused expert projection."
                } else {
                    "Export `_blocks` beside `_scales` for every fused expert projection, as the gpt-oss release does."
                },
            )
        };
        findings.extend(cx.finding(rule, E, absent, &file, &base, ev, fix));
    }
    regroup_missing(cx, findings);
}

/// `layers.1.ffn.experts.3.w13.bias` → (`layers.1`, 3, `w13`, `bias`).
fn expert_piece(t: &str) -> Option<(String, usize, String, String)> {
    let (prefix, rest) = t.split_once(".ffn.experts.")?;
    let mut it = rest.splitn(3, '.');
    let (e, proj, leaf) = (it.next()?, it.next()?, it.next()?);
    Some((
        prefix.to_string(),
        e.parse().ok()?,
        proj.to_string(),
        leaf.to_string(),
    ))
}

/// `weight.missing` findings on canonical expert pieces (`layers.1.ffn.experts.3.w13.bias`) become
/// one finding per fused tensor (`model.layers.1.mlp.experts.gate_up_proj_bias`) naming the
/// experts it lacks.
fn regroup_missing(cx: &Cx, findings: &mut Vec<Finding>) {
    let mxfp4 = cx
        .ck
        .quantization_config()
        .and_then(|q| q.get("quant_method")?.as_str().map(str::to_string))
        .is_some_and(|m| m == "mxfp4");
    let experts = cx.ck.model_config().map_or(0, |c| c.n_routed_experts);
    let mut groups: BTreeMap<(String, String, String), (Finding, Vec<usize>)> = BTreeMap::new();
    findings.retain(|f| {
        let piece = (f.rule == "weight.missing")
            .then(|| expert_piece(&f.tensor))
            .flatten();
        let Some((prefix, e, proj, leaf)) = piece else {
            return true;
        };
        if !PROJ.iter().any(|(p, _)| *p == proj) || !matches!(leaf.as_str(), "bias" | "weight") {
            return true;
        }
        groups
            .entry((prefix, proj, leaf))
            .or_insert_with(|| (f.clone(), Vec::new()))
            .1
            .push(e);
        false
    });
    for ((prefix, proj, leaf), (mut f, mut es)) in groups {
        es.sort_unstable();
        let name = PROJ.iter().find(|(p, _)| *p == proj).map_or("", |x| x.1);
        let suffix = match leaf.as_str() {
            "bias" => "_bias",
            _ if mxfp4 => "_blocks",
            _ => "",
        };
        let raw = format!("model.{prefix}.mlp.experts.{name}{suffix}");
        let what = if leaf == "bias" { "bias" } else { "weight" };
        let which = match (es.first(), es.last()) {
            (Some(a), Some(b)) if es.len() > 1 && b - a + 1 == es.len() => {
                format!("experts {a}–{b}")
            }
            _ => format!(
                "expert(s) {}",
                es.iter()
                    .map(|e| e.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        f.evidence = match cx.ck.info(&raw) {
            Some(i) => format!(
                "`{raw}` {:?} holds {} expert(s) where config.json declares {experts}: the {proj} {what} of {which} is missing",
                i.shape,
                i.shape.first().copied().unwrap_or(0)
            ),
            None => format!(
                "`{raw}` is absent: the {proj} {what} of {which} (of {experts}) has no tensor, while the layer is there"
            ),
        };
        f.tensor = raw;
        findings.push(f);
    }
}
