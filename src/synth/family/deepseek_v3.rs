//! DeepSeek-V3 / R1 (`DeepseekV3ForCausalLM`): the hub release's layout at tiny size — MLA,
//! leading dense layers, a sigmoid router with `e_score_correction_bias` and group-limited top-k,
//! one shared expert; DeepSeek's own release is FP8 block (`weight_scale_inv`).

use serde_json::{json, Map, Value};

use super::super::plan::{lin, param, single, Block, Format, Group, PDtype, PKind, Role};
use super::{ffn, norms, FamDims, Spec};
use crate::model::family::Kind;

pub(super) static SPEC: Spec = Spec {
    kind: Kind::DeepseekV3,
    formats: &[
        Format::Bf16,
        Format::CtNvfp4,
        Format::ModelOptNvfp4,
        Format::Fp8Block,
    ],
    tiny: v3_tiny,
    tiny_layers: 4,
    release: Some(v3_release),
    release_layers: 2,
    layer: v3_layer,
    // NVIDIA's DeepSeek-R1-FP4 (ModelOpt) quantizes the MLPs only, attention stays as released
    quantizes: |f, r| match f {
        Format::Bf16 => false,
        Format::ModelOptNvfp4 => matches!(r, Role::Expert(_) | Role::Shared(_)),
        _ => true,
    },
    config: v3_config,
    renames: &[("attn.kv_norm.weight", "self_attn.kv_a_layernorm.weight")],
    fuse: None,
    unfused: &[],
};

fn v3_tiny(layers: usize) -> FamDims {
    FamDims {
        hidden: 256,
        layers,
        vocab: 512,
        heads: 4,
        kv_heads: 4,
        head_dim: 96,
        rope_dim: 32,
        v_head: 64,
        q_lora: 128,
        kv_lora: 64,
        experts: 8,
        topk: 2,
        inter: 128,
        shared: 1,
        first_dense: 1.min(layers),
        dense_inter: 512,
        n_group: 4,
        topk_group: 2,
        routed_scaling: 2.5,
    }
}

/// DeepSeek-V3 / R1 as released (its `config.json`): hidden 7168, 128 heads of 128 + 64 (rope)
/// with values of 128, q LoRA 1536, KV latent 512, 256 routed experts of 2048 (top 8 in 4 of 8
/// groups, ×2.5), one shared expert, the vocabulary of 129,280. Its first three layers are dense
/// (MLP 18,432); here the first of `layers` is, so that two layers hold one dense and one MoE layer.
fn v3_release(layers: usize) -> FamDims {
    FamDims {
        hidden: 7168,
        layers,
        vocab: 129280,
        heads: 128,
        kv_heads: 128,
        head_dim: 192,
        rope_dim: 64,
        v_head: 128,
        q_lora: 1536,
        kv_lora: 512,
        experts: 256,
        topk: 8,
        inter: 2048,
        shared: 1,
        first_dense: 1.min(layers),
        dense_inter: 18432,
        n_group: 8,
        topk_group: 4,
        routed_scaling: 2.5,
    }
}

/// MLA (query LoRA, the KV latent with the shared rope key); q_a and kv_a share one NVFP4 tensor
/// scale (vLLM and SGLang fuse them as `fused_qkv_a_proj`); the router's correction bias in f32.
fn v3_layer(d: &FamDims, n: usize, _format: Format) -> Block {
    let p = |s: &str| format!("layers.{n}.{s}");
    let h = d.hidden;
    let nope = d.head_dim - d.rope_dim;
    let dense = n < d.first_dense;
    let mut params = norms(
        n,
        d,
        &[
            ("attn.q_a_layernorm.weight", d.q_lora),
            ("attn.kv_norm.weight", d.kv_lora),
        ],
    );
    if !dense {
        params.push(param(
            p("ffn.gate.bias"),
            vec![d.experts],
            PDtype::F32,
            PKind::Bias,
        ));
    }
    let mut b = Block {
        layer: Some(n),
        params,
        groups: vec![
            Group {
                members: vec![
                    lin(p("attn.wq_a"), d.q_lora, h),
                    lin(p("attn.kv_a_proj_with_mqa"), d.kv_lora + d.rope_dim, h),
                ],
            },
            single(p("attn.wq_b"), d.heads * d.head_dim, d.q_lora),
            single(p("attn.kv_b_proj"), d.heads * (nope + d.v_head), d.kv_lora),
            single(p("attn.o_proj"), h, d.heads * d.v_head),
        ],
        experts: Vec::new(),
    };
    ffn(d, n, dense, &mut b);
    b
}

fn v3_config(d: &FamDims) -> Map<String, Value> {
    let v = json!({
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": false,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "ep_size": 1,
        "first_k_dense_replace": d.first_dense,
        "hidden_act": "silu",
        "hidden_size": d.hidden,
        "initializer_range": 0.02,
        "intermediate_size": d.dense_inter,
        "kv_lora_rank": d.kv_lora,
        "max_position_embeddings": 163840,
        "model_type": "deepseek_v3",
    });
    let w = json!({
        "moe_intermediate_size": d.inter,
        "moe_layer_freq": 1,
        "n_group": d.n_group,
        "n_routed_experts": d.experts,
        "n_shared_experts": d.shared,
        "norm_topk_prob": true,
        "num_attention_heads": d.heads,
        "num_experts_per_tok": d.topk,
        "num_hidden_layers": d.layers,
        "num_key_value_heads": d.heads,
        // no MTP tensors are written, so no MTP layer is declared
        "num_nextn_predict_layers": 0,
        "q_lora_rank": d.q_lora,
        "qk_nope_head_dim": d.head_dim - d.rope_dim,
        "qk_rope_head_dim": d.rope_dim,
        "rms_norm_eps": 1e-6,
        "rope_scaling": {
            "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": d.routed_scaling,
        "scoring_func": "sigmoid",
        "seq_aux": true,
        "tie_word_embeddings": false,
        "topk_group": d.topk_group,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.33.1",
        "use_cache": true,
        "v_head_dim": d.v_head,
        "vocab_size": d.vocab,
    });
    let mut m = v.as_object().cloned().unwrap_or_default();
    m.extend(w.as_object().cloned().unwrap_or_default());
    m
}
