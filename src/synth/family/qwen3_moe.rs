//! Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3-30B-A3B's layout at tiny size — GQA with per-head
//! q/k RMSNorm, a softmax top-k router, routed experts, no shared expert.

use serde_json::{json, Map, Value};

use super::super::plan::{lin, single, Block, Format, Group};
use super::{ffn, norms, FamDims, Spec};
use crate::model::family::Kind;

pub(super) static SPEC: Spec = Spec {
    kind: Kind::Qwen3Moe,
    formats: &[Format::Bf16, Format::CtNvfp4, Format::ModelOptNvfp4],
    tiny: qwen3_tiny,
    tiny_layers: 4,
    release: None,
    release_layers: 0,
    layer: qwen3_layer,
    // llm-compressor's and ModelOpt's recipes quantize every Linear but the routers and lm_head
    quantizes: |f, _| f != Format::Bf16,
    config: qwen3_config,
    renames: &[("attn.q_norm.weight", "self_attn.q_norm.weight")],
    fuse: None,
    unfused: &[],
};

fn qwen3_tiny(layers: usize) -> FamDims {
    FamDims {
        hidden: 256,
        layers,
        vocab: 512,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        rope_dim: 64,
        v_head: 64,
        q_lora: 0,
        kv_lora: 0,
        experts: 8,
        topk: 2,
        inter: 128,
        shared: 0,
        first_dense: 0,
        dense_inter: 512,
        n_group: 1,
        topk_group: 1,
        routed_scaling: 1.0,
    }
}

/// GQA with per-head q/k RMSNorm; q/k/v share one NVFP4 tensor scale (engines fuse `qkv_proj`).
fn qwen3_layer(d: &FamDims, n: usize, _format: Format) -> Block {
    let p = |s: &str| format!("layers.{n}.{s}");
    let (h, hd) = (d.hidden, d.head_dim);
    let mut b = Block {
        layer: Some(n),
        params: norms(
            n,
            d,
            &[("attn.q_norm.weight", hd), ("attn.k_norm.weight", hd)],
        ),
        groups: vec![
            Group {
                members: vec![
                    lin(p("attn.q_proj"), d.heads * hd, h),
                    lin(p("attn.k_proj"), d.kv_heads * hd, h),
                    lin(p("attn.v_proj"), d.kv_heads * hd, h),
                ],
            },
            single(p("attn.o_proj"), h, d.heads * hd),
        ],
        experts: Vec::new(),
    };
    ffn(d, n, n < d.first_dense, &mut b);
    b
}

fn qwen3_config(d: &FamDims) -> Map<String, Value> {
    let v = json!({
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": false,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "decoder_sparse_step": 1,
        "eos_token_id": 1,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "hidden_size": d.hidden,
        "initializer_range": 0.02,
        "intermediate_size": d.dense_inter,
        "max_position_embeddings": 40960,
    });
    let w = json!({
        "max_window_layers": d.layers,
        "mlp_only_layers": (0..d.first_dense).collect::<Vec<_>>(),
        "model_type": "qwen3_moe",
        "moe_intermediate_size": d.inter,
        "norm_topk_prob": true,
        "num_attention_heads": d.heads,
        "num_experts": d.experts,
        "num_experts_per_tok": d.topk,
        "num_hidden_layers": d.layers,
        "num_key_value_heads": d.kv_heads,
        "output_router_logits": false,
        "rms_norm_eps": 1e-6,
        "rope_scaling": null,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": null,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": true,
        "use_sliding_window": false,
        "vocab_size": d.vocab,
    });
    let mut m = v.as_object().cloned().unwrap_or_default();
    m.extend(w.as_object().cloned().unwrap_or_default());
    m
}
