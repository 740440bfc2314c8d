//! The linears an engine fuses into one GEMM, and the one tensor scale it keeps for each fused
//! weight when the members were stored with different ones (docs/NVFP4.md §3.4, "Fused layers").
//! One table for the served path ([`super::resolve_nvfp4_named`]), `lint`'s `fused.mismatch`
//! (`lint::wiring::fused_partners`) and `bisect`'s own-shard hypotheses.
//!
//! Canonical names only. The groups:
//! - a merged dense linear (vLLM `MergedColumnParallelLinear` / `QKVParallelLinear`): DeepSeek-V4's
//!   `attn.wq_a` + `attn.wkv`; DeepSeek-V3's `attn.wq_a` + `attn.kv_a_proj_with_mqa`
//!   (`fused_qkv_a_proj`); `attn.q_proj` + `k_proj` + `v_proj` (Qwen3-MoE, gpt-oss: `qkv_proj`); a
//!   shared expert's `w1` + `w3` and the dense MLP's `gate_proj` + `up_proj` (`gate_up_proj`);
//! - a routed expert's `w1` + `w3` (vLLM's `FusedMoE` `w13`), every family.
//!
//! The engine's rule (vLLM's `process_weights_after_loading`, the same under every served profile
//! for the weight scale; activation scales are unused by Marlin's W4A16):
//! - merged dense linear: the largest stored value of the group, for the weight and the activation
//!   scale alike — the largest decode scale for ModelOpt (`weight_scale_2`, `input_scale`), the
//!   largest encode scale for compressed-tensors (`weight_global_scale`, `input_global_scale`);
//! - routed expert `w13`: the weight scale of the gate (`w1`) shard, for both producers (vLLM keeps
//!   the first column of the `[experts, 2]` scale parameter and warns when the columns differ);
//!   the activation scale is the largest *decode* scale of the pair (ModelOpt: max `input_scale`;
//!   compressed-tensors inverts `input_global_scale` first, so the smallest encode scale).

use crate::checkpoint::Checkpoint;
use crate::numerics::nvfp4::Convention;

/// How the engine merges a group's tensor scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupKind {
    /// One merged dense linear: the max over the members (in the stored convention).
    Merged,
    /// A routed expert's gate/up (`w13`): the gate's weight scale, the max decode activation scale.
    RoutedW13,
}

/// One fused group: its members (canonical bases, in the engine's shard order) and its rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Group {
    pub kind: GroupKind,
    pub members: Vec<String>,
    /// The engine's fused weight (vLLM's module name).
    pub engine: &'static str,
}

/// `layers.N.` (or `mtp.N.`) and the rest of a canonical base.
fn split(base: &str) -> Option<(&str, &str)> {
    for p in ["layers.", "mtp."] {
        if let Some(r) = base.strip_prefix(p) {
            let dot = r.find('.')?;
            let cut = p.len() + dot + 1;
            return Some((&base[..cut], &base[cut..]));
        }
    }
    None
}

/// The fused group `base` belongs to (None for a linear the engine runs alone).
pub fn group(base: &str) -> Option<Group> {
    let (prefix, rest) = split(base)?;
    let merged = |engine: &'static str, tails: &[&str]| {
        Some(Group {
            kind: GroupKind::Merged,
            members: tails.iter().map(|t| format!("{prefix}{t}")).collect(),
            engine,
        })
    };
    if let Some(e) = rest.strip_prefix("ffn.experts.") {
        let (idx, leaf) = e.split_once('.')?;
        if !idx.bytes().all(|b| b.is_ascii_digit()) || !matches!(leaf, "w1" | "w3") {
            return None;
        }
        let p = format!("{prefix}ffn.experts.{idx}.");
        return Some(Group {
            kind: GroupKind::RoutedW13,
            members: vec![format!("{p}w1"), format!("{p}w3")],
            engine: "w13",
        });
    }
    match rest {
        "attn.wq_a" | "attn.wkv" => merged("fused_wqa_wkv", &["attn.wq_a", "attn.wkv"]),
        "attn.kv_a_proj_with_mqa" => merged(
            "fused_qkv_a_proj",
            &["attn.wq_a", "attn.kv_a_proj_with_mqa"],
        ),
        "attn.q_proj" | "attn.k_proj" | "attn.v_proj" => {
            merged("qkv_proj", &["attn.q_proj", "attn.k_proj", "attn.v_proj"])
        }
        "ffn.shared_experts.w1" | "ffn.shared_experts.w3" => merged(
            "shared_experts.gate_up_proj",
            &["ffn.shared_experts.w1", "ffn.shared_experts.w3"],
        ),
        "ffn.gate_proj" | "ffn.up_proj" => {
            merged("gate_up_proj", &["ffn.gate_proj", "ffn.up_proj"])
        }
        _ => None,
    }
}

/// The members of `base`'s group present in `ckpt` (V4 holds `attn.wq_a` with `attn.wkv`,
/// DeepSeek-V3 with `attn.kv_a_proj_with_mqa`: the group of `attn.wq_a` is the one whose other
/// member exists).
pub fn members_in(ckpt: &Checkpoint, base: &str) -> Option<(GroupKind, Vec<String>)> {
    let mut g = group(base)?;
    if base.ends_with(".attn.wq_a") && ckpt.nvfp4_scalars(&g.members[1]).is_none() {
        g = group(&base.replace(".attn.wq_a", ".attn.kv_a_proj_with_mqa"))?;
    }
    let present: Vec<String> = g
        .members
        .into_iter()
        .filter(|m| m == base || ckpt.nvfp4_scalars(m).is_some())
        .collect();
    (present.len() > 1).then_some((g.kind, present))
}

/// Which tensor scale of a fused group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Which {
    Weight,
    Activation,
}

/// The stored value the engine keeps for a group whose members store `values` (in the group's
/// order, each in the checkpoint's own convention `conv`), and the index of the member it comes
/// from. NaN values are skipped, as `f32::max` skips them (None: no value at all); a routed
/// expert's weight scale is the gate's whatever it holds.
pub fn kept(
    kind: GroupKind,
    which: Which,
    conv: Convention,
    values: &[f32],
) -> Option<(f32, usize)> {
    let pick_min = kind == GroupKind::RoutedW13
        && which == Which::Activation
        && conv == Convention::CompressedTensors;
    if kind == GroupKind::RoutedW13 && which == Which::Weight {
        // the gate's (first) shard, whatever the others hold
        return values.first().map(|v| (*v, 0));
    }
    let mut best: Option<(f32, usize)> = None;
    for (i, v) in values.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        best = match best {
            None => Some((*v, i)),
            Some((b, j)) => {
                let better = if pick_min { *v < b } else { *v > b };
                Some(if better { (*v, i) } else { (b, j) })
            }
        };
    }
    best
}

/// The engine's (weight, activation) tensor scales for `base` in its fused group, in the stored
/// convention (weight_global, input_global as `WeightMeta` holds them), given `base`'s own; its
/// own values when the engine runs it alone. A missing activation scale reads as 0.
pub fn merged_scalars(
    ckpt: &Checkpoint,
    base: &str,
    conv: Convention,
    weight_global: f32,
    input_global: Option<f32>,
) -> (f32, f32) {
    let own = (weight_global, input_global.unwrap_or(0.0));
    let Some((kind, members)) = members_in(ckpt, base) else {
        return own;
    };
    let mut ws = Vec::with_capacity(members.len());
    let mut is = Vec::with_capacity(members.len());
    for m in &members {
        let (w, i) = if m == base {
            own
        } else {
            match ckpt.nvfp4_scalars(m) {
                Some((w, i)) => (w, i.unwrap_or(0.0)),
                None => own,
            }
        };
        ws.push(w);
        is.push(i);
    }
    let w = kept(kind, Which::Weight, conv, &ws).map_or(own.0, |k| k.0);
    let i = kept(kind, Which::Activation, conv, &is).map_or(own.1, |k| k.0);
    (w, i)
}

/// The member whose stored value the engine keeps for `base` (`which` scale), when that is not
/// `base` itself: the sibling a bisect "own-shard" hypothesis names.
pub fn kept_from(ckpt: &Checkpoint, base: &str, conv: Convention, which: Which) -> Option<String> {
    let (kind, members) = members_in(ckpt, base)?;
    let vals: Vec<f32> = members
        .iter()
        .map(|m| {
            ckpt.nvfp4_scalars(m)
                .map_or(f32::NAN, |(w, i)| match which {
                    Which::Weight => w,
                    Which::Activation => i.unwrap_or(0.0),
                })
        })
        .collect();
    let (_, at) = kept(kind, which, conv, &vals)?;
    (members[at] != base).then(|| members[at].clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_of_every_family() {
        let g = group("layers.2.ffn.experts.7.w3").unwrap();
        assert_eq!(g.kind, GroupKind::RoutedW13);
        assert_eq!(
            g.members,
            ["layers.2.ffn.experts.7.w1", "layers.2.ffn.experts.7.w3"]
        );
        assert!(group("layers.2.ffn.experts.7.w2").is_none());
        assert!(group("layers.2.ffn.experts.7.w13").is_none());
        let g = group("layers.1.attn.v_proj").unwrap();
        assert_eq!(g.kind, GroupKind::Merged);
        assert_eq!(g.members.len(), 3);
        assert_eq!(
            group("layers.0.attn.kv_a_proj_with_mqa").unwrap().members,
            ["layers.0.attn.wq_a", "layers.0.attn.kv_a_proj_with_mqa"]
        );
        assert_eq!(
            group("mtp.0.attn.wkv").unwrap().members,
            ["mtp.0.attn.wq_a", "mtp.0.attn.wkv"]
        );
        assert_eq!(
            group("layers.3.ffn.shared_experts.w1").unwrap().kind,
            GroupKind::Merged
        );
        assert_eq!(
            group("layers.0.ffn.up_proj").unwrap().members[0],
            "layers.0.ffn.gate_proj"
        );
        assert!(group("layers.0.attn.wq_b").is_none());
    }

    #[test]
    fn the_engines_rules() {
        use Convention::{CompressedTensors as Ct, ModelOpt as Mo};
        use GroupKind::*;
        // merged: the max of the stored values, either convention, either scale
        for c in [Ct, Mo] {
            for w in [Which::Weight, Which::Activation] {
                assert_eq!(kept(Merged, w, c, &[1.0, 3.0, 2.0]), Some((3.0, 1)));
            }
        }
        // routed w13: the gate's weight scale, smaller or larger
        for c in [Ct, Mo] {
            assert_eq!(
                kept(RoutedW13, Which::Weight, c, &[1.0, 3.0]),
                Some((1.0, 0))
            );
            assert_eq!(
                kept(RoutedW13, Which::Weight, c, &[3.0, 1.0]),
                Some((3.0, 0))
            );
        }
        // routed activation: the max decode scale (CT: the min encode scale)
        assert_eq!(
            kept(RoutedW13, Which::Activation, Mo, &[1.0, 3.0]),
            Some((3.0, 1))
        );
        assert_eq!(
            kept(RoutedW13, Which::Activation, Ct, &[1.0, 3.0]),
            Some((1.0, 0))
        );
        assert_eq!(
            kept(Merged, Which::Weight, Mo, &[f32::NAN, 2.0]),
            Some((2.0, 1))
        );
    }
}
