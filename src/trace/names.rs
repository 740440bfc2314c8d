//! Built-in maps from engines' module paths to op ids.
//!
//! A trace tensor name is `PATH` or `PATH:aux` (the capture scripts' convention). `map_name` returns the
//! op id and how the tensor is laid out relative to the op's output.

/// How a trace tensor relates to the op output it maps to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapped {
    pub op: String,
    /// True when the tensor's rows are token rows (so `rows` metadata selects them); false for
    /// compressed rows, indexer picks and other non-token layouts, which are kept whole.
    pub token_rows: bool,
}

fn layer_and_rest<'a>(name: &'a str, prefix: &str) -> Option<(usize, &'a str)> {
    let r = name.strip_prefix(prefix)?;
    let (n, rest) = r.split_once('.').unwrap_or((r, ""));
    Some((n.parse().ok()?, rest))
}

/// Hugging Face transformers' DeepseekV4ForCausalLM module paths (as written by probes/capture/hf_capture.py).
pub fn map_hf(name: &str) -> Option<Mapped> {
    let m = |op: String, token_rows: bool| Some(Mapped { op, token_rows });
    match name {
        "model.embed_tokens" => return m("embed".into(), true),
        "model.hc_head" => return m("hc_head".into(), true),
        "model.norm" => return m("final_norm".into(), true),
        "lm_head" | "logits" => return m("head".into(), true),
        _ => {}
    }
    if let Some((n, rest)) = layer_and_rest(name, "model.layers.") {
        let l = format!("L{n}");
        let op = match rest {
            "" => format!("{l}.out"),
            "attn_hc" => format!("{l}.attn.hc_pre"),
            "attn_hc:post" => format!("{l}.attn.hc_pre.post"),
            "attn_hc:comb" => format!("{l}.attn.hc_pre.comb"),
            "input_layernorm" => format!("{l}.attn.norm"),
            "self_attn.q_a_proj" => format!("{l}.attn.q_a"),
            "self_attn.kv_proj" => format!("{l}.attn.kv"),
            "self_attn.q_a_norm" => format!("{l}.attn.q_norm"),
            "self_attn.kv_norm" => format!("{l}.attn.kv_norm"),
            "self_attn.q_b_proj" => format!("{l}.attn.q_b"),
            "self_attn.compressor" => return m(format!("{l}.attn.compressor"), false),
            "self_attn.compressor.indexer" => return m(format!("{l}.attn.indexer"), false),
            "self_attn.o_a_proj:input" => format!("{l}.attn.core"),
            "self_attn.o_a_proj" => format!("{l}.attn.wo_a"),
            "self_attn.o_b_proj" | "self_attn" => format!("{l}.attn.wo_b"),
            "ffn_hc:input" => format!("{l}.attn.hc_post"),
            "ffn_hc" => format!("{l}.ffn.hc_pre"),
            "ffn_hc:post" => format!("{l}.ffn.hc_pre.post"),
            "ffn_hc:comb" => format!("{l}.ffn.hc_pre.comb"),
            "post_attention_layernorm" => format!("{l}.ffn.norm"),
            "mlp.gate" => format!("{l}.ffn.router"),
            "mlp.gate:idx" => format!("{l}.ffn.router.idx"),
            "mlp.experts" => return m(format!("{l}.ffn.experts"), false),
            "mlp.shared_experts" => format!("{l}.ffn.shared"),
            "mlp" => format!("{l}.ffn.out"),
            _ => return None,
        };
        return m(op, true);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn hf_names() {
        assert_eq!(
            map_hf("model.layers.3.self_attn.q_b_proj").unwrap().op,
            "L3.attn.q_b"
        );
        assert_eq!(map_hf("model.layers.0").unwrap().op, "L0.out");
        assert_eq!(
            map_hf("model.layers.2.ffn_hc:input").unwrap().op,
            "L2.attn.hc_post"
        );
        assert!(
            !map_hf("model.layers.2.self_attn.compressor")
                .unwrap()
                .token_rows
        );
        assert!(map_hf("model.layers.2.self_attn.rotary_emb").is_none());
        assert_eq!(map_hf("lm_head").unwrap().op, "head");
    }
}
