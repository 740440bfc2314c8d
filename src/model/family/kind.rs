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
    /// `GptOssForCausalLM`: GQA with biases and per-head sinks, sliding and full layers, a biased
    /// router (top-k of the logits, softmax over the k), experts with fused interleaved gate/up,
    /// biases and the clamped GLU.
    GptOss,
}

impl Kind {
    /// The family's name on the command line and in messages.
    pub fn label(self) -> &'static str {
        match self {
            Kind::Qwen3Moe => "qwen3-moe",
            Kind::DeepseekV3 => "deepseek-v3",
            Kind::GptOss => "gpt-oss",
        }
    }

    /// Whether the family's transformers class stores its routed experts fused the gpt-oss way
    /// (`gate_up_proj` [E, in, 2I] with gate and up interleaved, `down_proj` [E, I, out], biases
    /// beside them; MXFP4 `*_blocks`/`*_scales` [E, out, …]) rather than stacked (Qwen3-MoE,
    /// DeepSeek-V3: `gate_up_proj` [E, 2I, in], gate rows then up rows). The same tensor name
    /// means either, so the checkpoint reader asks the config.
    pub fn interleaved_experts(self) -> bool {
        self == Kind::GptOss
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
    /// Per layer: attention over the last `ModelConfig::sliding_window` keys only (gpt-oss's
    /// `sliding_attention` layers); false: every earlier key.
    pub sliding: Vec<bool>,
    /// Whether the attention projections (q/k/v/o) have biases (gpt-oss's `attention_bias`).
    pub attention_bias: bool,
    /// Whether the attention has a learned per-head sink logit in its softmax (gpt-oss).
    pub sinks: bool,
    /// Whether the router's second parameter (`ffn.gate.bias`) is its linear's bias, added to the
    /// logits (gpt-oss), rather than a selection bias on the scores (DeepSeek-V3's
    /// `e_score_correction_bias`).
    pub router_logit_bias: bool,
    /// gpt-oss's routed experts stored as separate gate/up/down linears with biases
    /// (llm-compressor's `LinearExperts`: canonical `w1`, `w3`, `w2`) instead of the fused,
    /// interleaved `w13`; set from the checkpoint's tensors (`Checkpoint::model_config`).
    pub linear_experts: bool,
}

impl Family {
    /// Set [`Family::linear_experts`] from a checkpoint's canonical tensor or weight names: an
    /// interleaved-experts family (gpt-oss) whose routed experts are stored as separate gate
    /// linears (`….ffn.experts.E.w1…`) rather than the fused `w13`.
    pub fn note_expert_names<'a>(&mut self, names: impl IntoIterator<Item = &'a str>) {
        self.linear_experts = self.kind.interleaved_experts()
            && names
                .into_iter()
                .any(|n| n.contains(".ffn.experts.") && (n.ends_with(".w1") || n.contains(".w1.")));
    }

    /// Keys per query of layer `layer`'s attention, itself included: `cfg.sliding_window` on a
    /// sliding layer, `None` (every earlier key) otherwise.
    pub fn window(&self, sliding_window: usize, layer: usize) -> Option<usize> {
        self.sliding
            .get(layer)
            .copied()
            .unwrap_or(false)
            .then_some(sliding_window)
    }
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
    if mt == Some("gpt_oss") || (mt.is_none() && arch("GptOssForCausalLM")) {
        return Some(Kind::GptOss);
    }
    None
}
