//! What a family is, as data: which one ([`Kind`], [`detect`] from `config.json`), and what it
//! adds to the shared [`ModelConfig`](super::super::ModelConfig) fields ([`Family`]). Nothing here
//! reads or builds a `ModelConfig`: the parser ([`super::config`]) does, so the config type can
//! carry a `Family` without the two files importing each other.

use serde_json::Value;

/// Which family a config describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Kind {
    /// `Qwen3MoeForCausalLM`: GQA with per-head q/k RMSNorm, softmax top-k router, no shared expert.
    Qwen3Moe,
    /// `DeepseekV3ForCausalLM` (V3, R1): MLA, leading dense layers, sigmoid router with the
    /// correction bias and group-limited top-k, a shared expert.
    DeepseekV3,
}

impl Kind {
    /// The family's name on the command line and in messages.
    pub fn label(self) -> &'static str {
        match self {
            Kind::Qwen3Moe => "qwen3-moe",
            Kind::DeepseekV3 => "deepseek-v3",
        }
    }
}

/// How a head's rotary dims pair up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum RopeStyle {
    /// transformers' `rotate_half`: dim i pairs with i + half (Qwen3, gpt-oss).
    HalfSplit,
    /// Adjacent pairs (2i, 2i+1), as DeepSeek's complex rotation (V3's `rope_interleave`).
    Interleaved,
}

/// What a non-V4 family adds to the shared [`ModelConfig`] fields.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Family {
    pub kind: Kind,
    /// Key/value heads of the grouped-query attention (divides `num_attention_heads`).
    pub num_key_value_heads: usize,
    /// Width of a value head (the q/k head is `ModelConfig::head_dim`).
    pub v_head_dim: usize,
    pub rope_style: RopeStyle,
    /// cos/sin multiplier of the rope (YaRN's attention factor; 1 without).
    pub rope_attention_factor: f64,
    /// Per layer: a dense MLP instead of the routed experts.
    pub dense: Vec<bool>,
    /// Width of the dense MLP.
    pub intermediate_size: usize,
    /// Whether the checkpoint has its own output head (`tie_word_embeddings` false).
    pub separate_head: bool,
    /// The attention's softmax scale (head_dim^-½, times YaRN's mscale² on DeepSeek-V3).
    pub attn_scale: f64,
    /// MLA (DeepSeek-V3): the query LoRA rank (`None`: a plain `q_proj`), the KV latent rank.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    /// Group-limited routing: experts in `n_group` groups, the best `topk_group` groups kept.
    pub n_group: usize,
    pub topk_group: usize,
    /// Whether the router's logits are stored activations (the gate runs in the activation
    /// dtype, so BF16 paths round them before the scores), or kept in FP32.
    pub router_logits_stored: bool,
}

/// The family a config names, if it is not V4: `model_type` first, then `architectures`.
pub fn detect(v: &Value) -> Option<Kind> {
    let mt = v.get("model_type").and_then(Value::as_str);
    let arch = |a: &str| {
        v.get("architectures")
            .and_then(Value::as_array)
            .is_some_and(|x| x.iter().any(|s| s.as_str() == Some(a)))
    };
    if mt == Some("qwen3_moe") || (mt.is_none() && arch("Qwen3MoeForCausalLM")) {
        return Some(Kind::Qwen3Moe);
    }
    if mt == Some("deepseek_v3") || (mt.is_none() && arch("DeepseekV3ForCausalLM")) {
        return Some(Kind::DeepseekV3);
    }
    None
}
