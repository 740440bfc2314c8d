//! How the linears of a layer are wired, as far as the scale rules need it, for DeepSeek-V4 and
//! the families (`model::family`): which RMSNorm produces a linear's input (its activation amax is
//! bounded by that norm's weight), which linears an engine fuses into one GEMM with one tensor
//! scale (a mismatch inside the group is `fused.mismatch`), and which norm reads a linear's output
//! (a constant factor on that output is then absorbed).
//!
//! Canonical names only: V4's `attn.wq_a`/`wkv`, `ffn.experts.E.w1`/`w3`; Qwen3-MoE's
//! `attn.q_proj`/`k_proj`/`v_proj` (vLLM's `qkv_proj`); DeepSeek-V3's `attn.wq_a` with
//! `attn.kv_a_proj_with_mqa` (vLLM's and SGLang's `fused_qkv_a_proj`); the dense MLP's
//! `ffn.gate_proj`/`up_proj` (`gate_up_proj`).

/// `layers.N.` (or `mtp.N.`) and the rest of a canonical base.
fn split(base: &str) -> Option<(String, &str)> {
    for p in ["layers.", "mtp."] {
        if let Some(r) = base.strip_prefix(p) {
            let (n, rest) = r.split_once('.')?;
            return Some((format!("{p}{n}."), rest));
        }
    }
    None
}

/// The norm weights that may produce `base`'s input, most specific first (the first the
/// checkpoint holds is the one: V4's `wq_b` reads `attn.q_norm`, DeepSeek-V3's reads
/// `attn.q_a_layernorm`).
pub fn input_norms(base: &str) -> Vec<String> {
    let Some((prefix, rest)) = split(base) else {
        return Vec::new();
    };
    let expert_in = (rest.starts_with("ffn.experts.") || rest.starts_with("ffn.shared_experts."))
        && (rest.ends_with(".w1") || rest.ends_with(".w3"));
    let leaves: &[&str] = match rest {
        "attn.wq_a"
        | "attn.wkv"
        | "attn.indexer.weights_proj"
        | "attn.q_proj"
        | "attn.k_proj"
        | "attn.v_proj"
        | "attn.kv_a_proj_with_mqa" => &["attn_norm.weight"],
        r if r.starts_with("attn.compressor.") || r.starts_with("attn.indexer.compressor.") => {
            &["attn_norm.weight"]
        }
        "attn.wq_b" => &["attn.q_norm.weight", "attn.q_a_layernorm.weight"],
        "attn.indexer.wq_b" => &["attn.q_norm.weight"],
        "attn.kv_b_proj" => &["attn.kv_norm.weight"],
        "ffn.gate" | "ffn.gate_proj" | "ffn.up_proj" => &["ffn_norm.weight"],
        _ if expert_in => &["ffn_norm.weight"],
        _ => &[],
    };
    leaves.iter().map(|l| format!("{prefix}{l}")).collect()
}

/// The linears fused with `base` into one GEMM that come after it in its group (each pair is
/// then seen once): the served path's table of fused groups (`served::fused`). `attn.wq_a` is
/// fused with V4's `attn.wkv` or DeepSeek-V3's `attn.kv_a_proj_with_mqa`, whichever is there.
pub fn fused_partners(base: &str) -> Vec<String> {
    let mut alts = vec![base.to_string()];
    if let Some(p) = base.strip_suffix(".attn.wq_a") {
        alts.push(format!("{p}.attn.kv_a_proj_with_mqa"));
    }
    let mut out = Vec::new();
    for a in alts {
        if let Some(g) = crate::served::fused::group(&a) {
            if let Some(i) = g.members.iter().position(|m| m == base) {
                out.extend(g.members[i + 1..].iter().cloned());
            }
        }
    }
    out
}

/// The RMSNorm op that reads `base`'s whole output, so that a constant factor on that output does
/// not reach the norm's (V4's `q_norm` after `wq_a`, `kv_norm` after `wkv`; DeepSeek-V3's
/// `q_a_layernorm` after `q_a_proj`; Qwen3's per-head `q_norm`/`k_norm` after `q_proj`/`k_proj`).
/// DeepSeek-V3's `kv_a_proj_with_mqa` is not absorbed: its rope part bypasses the latent norm.
pub fn output_norm_op(base: &str) -> Option<String> {
    let (prefix, rest) = split(base)?;
    let n = prefix.strip_prefix("layers.")?.strip_suffix('.')?;
    let op = match rest {
        "attn.wq_a" => "attn.q_norm",
        "attn.wkv" => "attn.kv_norm",
        "attn.q_proj" => "attn.q_norm",
        "attn.k_proj" => "attn.k_norm",
        _ => return None,
    };
    Some(format!("L{n}.{op}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v4_and_family_wiring() {
        assert_eq!(
            input_norms("layers.2.attn.wkv"),
            ["layers.2.attn_norm.weight"]
        );
        assert_eq!(
            input_norms("layers.2.attn.wq_b"),
            [
                "layers.2.attn.q_norm.weight",
                "layers.2.attn.q_a_layernorm.weight"
            ]
        );
        assert_eq!(
            input_norms("layers.1.ffn.experts.7.w3"),
            ["layers.1.ffn_norm.weight"]
        );
        assert!(input_norms("layers.1.ffn.experts.7.w2").is_empty());
        assert_eq!(
            input_norms("layers.0.attn.kv_b_proj"),
            ["layers.0.attn.kv_norm.weight"]
        );
        assert_eq!(
            fused_partners("layers.1.attn.q_proj"),
            ["layers.1.attn.k_proj", "layers.1.attn.v_proj"]
        );
        assert_eq!(
            fused_partners("layers.1.ffn.experts.3.w1"),
            ["layers.1.ffn.experts.3.w3"]
        );
        assert_eq!(
            fused_partners("layers.0.ffn.gate_proj"),
            ["layers.0.ffn.up_proj"]
        );
        assert!(fused_partners("layers.1.ffn.experts.3.w3").is_empty());
        assert_eq!(
            output_norm_op("layers.3.attn.k_proj").as_deref(),
            Some("L3.attn.k_norm")
        );
        assert_eq!(output_norm_op("layers.3.attn.kv_a_proj_with_mqa"), None);
    }
}
