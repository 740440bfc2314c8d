//! transformers' module paths of the model families beyond DeepSeek-V4 (`model::family`), mapped
//! to their op ids: what `compare --names hf` reads for a Qwen3-MoE, DeepSeek-V3 or gpt-oss trace
//! (as written by probes/capture/make_hf_families.py: `PATH`, tuple outputs `PATH:i`, inputs
//! `PATH:input`).

use super::mapped::{layer_and_rest, Mapped};
use crate::model::family::Kind;
use crate::model::ModelConfig;

/// The op a transformers module path of `cfg`'s family feeds (`None`: not an op's output).
pub fn map_hf(name: &str, cfg: &ModelConfig) -> Option<Mapped> {
    let fam = cfg.family.as_ref()?;
    let m = |op: String| {
        Some(Mapped {
            op,
            token_rows: true,
        })
    };
    match name {
        "model.embed_tokens" => return m("embed".into()),
        "model.norm" => return m("final_norm".into()),
        "lm_head" | "logits" => return m("head".into()),
        _ => {}
    }
    let (n, rest) = layer_and_rest(name, "model.layers.")?;
    let l = format!("L{n}");
    let dense = fam.dense.get(n).copied().unwrap_or(false);
    let op = match (fam.kind, rest) {
        (_, "") => "out",
        (_, "input_layernorm") => "attn.norm",
        (_, "post_attention_layernorm") => "ffn.norm",
        (Kind::Qwen3Moe | Kind::GptOss, "self_attn.q_proj") => "attn.q",
        (Kind::Qwen3Moe | Kind::GptOss, "self_attn.k_proj") => "attn.k",
        (Kind::Qwen3Moe | Kind::GptOss, "self_attn.v_proj") => "attn.v",
        (Kind::Qwen3Moe, "self_attn.q_norm") => "attn.q_norm",
        (Kind::Qwen3Moe, "self_attn.k_norm") => "attn.k_norm",
        (Kind::DeepseekV3, "self_attn.q_a_proj") => "attn.q_a",
        (Kind::DeepseekV3, "self_attn.q_a_layernorm") => "attn.q_norm",
        (Kind::DeepseekV3, "self_attn.q_b_proj") => "attn.q_b",
        (Kind::DeepseekV3, "self_attn.q_proj") => "attn.q",
        (Kind::DeepseekV3, "self_attn.kv_a_proj_with_mqa") => "attn.kv_a",
        (Kind::DeepseekV3, "self_attn.kv_a_layernorm") => "attn.kv_norm",
        (Kind::DeepseekV3, "self_attn.kv_b_proj") => "attn.kv_b",
        (Kind::DeepseekV3, "mlp.shared_experts") if !dense => "ffn.shared",
        (Kind::DeepseekV3, "mlp") if !dense => "ffn.out",
        (_, "self_attn.o_proj:input") => "attn.core",
        (_, "self_attn.o_proj") => "attn.o",
        // gpt-oss's `mlp.router` returns (logits, weights, ids) as the gate below
        (Kind::GptOss, "mlp.router:1") => "ffn.router",
        (Kind::GptOss, "mlp.router:2") => "ffn.router.idx",
        // the router's (logits, weights, ids): weights and ids are the op's two outputs
        (Kind::Qwen3Moe | Kind::DeepseekV3, "mlp.gate:1") if !dense => "ffn.router",
        (Kind::Qwen3Moe | Kind::DeepseekV3, "mlp.gate:2") if !dense => "ffn.router.idx",
        (_, "mlp.experts") if !dense => "ffn.experts",
        (_, "mlp") if dense => "ffn.mlp",
        _ => return None,
    };
    m(format!("{l}.{op}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen3_moe_paths() {
        let cfg = ModelConfig::from_json(&serde_json::json!({
            "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2,
            "vocab_size": 100, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "intermediate_size": 96, "mlp_only_layers": [1]
        }))
        .unwrap();
        let op = |n: &str| map_hf(n, &cfg).map(|m| m.op);
        assert_eq!(
            op("model.layers.1.self_attn.k_norm").unwrap(),
            "L1.attn.k_norm"
        );
        assert_eq!(
            op("model.layers.0.self_attn.o_proj:input").unwrap(),
            "L0.attn.core"
        );
        assert_eq!(
            op("model.layers.0.mlp.gate:2").unwrap(),
            "L0.ffn.router.idx"
        );
        assert_eq!(op("model.layers.0").unwrap(), "L0.out");
        assert_eq!(op("model.layers.0.mlp.experts").unwrap(), "L0.ffn.experts");
        assert_eq!(op("model.layers.1.mlp").unwrap(), "L1.ffn.mlp");
        assert!(op("model.layers.0.mlp").is_none() && op("model.layers.1.mlp.experts").is_none());
        assert!(op("model.layers.0.mlp.gate:0").is_none() && op("model.rotary_emb").is_none());
        assert_eq!(op("lm_head").unwrap(), "head");
    }

    #[test]
    fn gpt_oss_paths() {
        let cfg = ModelConfig::from_json(&serde_json::json!({
            "model_type": "gpt_oss", "hidden_size": 64, "num_hidden_layers": 2,
            "vocab_size": 100, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
            "intermediate_size": 32, "sliding_window": 8
        }))
        .unwrap();
        let op = |n: &str| map_hf(n, &cfg).map(|m| m.op);
        assert_eq!(op("model.layers.1.self_attn.v_proj").unwrap(), "L1.attn.v");
        assert_eq!(op("model.layers.1.mlp.router:1").unwrap(), "L1.ffn.router");
        assert_eq!(
            op("model.layers.1.mlp.router:2").unwrap(),
            "L1.ffn.router.idx"
        );
        assert_eq!(op("model.layers.0.mlp.experts").unwrap(), "L0.ffn.experts");
        // the logits, the mlp's tuple and the attention's output are no op's outputs of their own
        for n in [
            "model.layers.0.mlp.router:0",
            "model.layers.0.mlp.router",
            "model.layers.0.mlp",
            "model.layers.0.mlp:1",
            "model.layers.0.self_attn",
            "model.layers.0.self_attn.q_norm",
            "model.layers.0.mlp.gate:1",
        ] {
            assert!(op(n).is_none(), "{n}");
        }
    }
}
