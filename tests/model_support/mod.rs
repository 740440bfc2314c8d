//! Shared setup of the model tests: the tiny config of the task and token streams.
#![allow(dead_code)]

use nvfp4_probe::model::mem_env::Rng;
use nvfp4_probe::model::ModelConfig;
use nvfp4_probe::Tensor;

/// D = 256, H = 4, head_dim 512 / rope 64, G = 2, Ro = 128, q_lora 128, E = 8, k = 2, I = 128,
/// 1 hash layer, ratios [0, 128, 4, 128, 4], index_topk 8, W = 128, vocab 512, Pro rope/YaRN.
pub fn tiny_cfg() -> ModelConfig {
    ModelConfig::from_json(&serde_json::json!({
        "hidden_size": 256, "num_hidden_layers": 5, "vocab_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
        "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 128, "sliding_window": 128,
        "compress_ratios": [0, 128, 4, 128, 4], "compress_rope_theta": 160000, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "rms_norm_eps": 1e-6, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 128, "num_hash_layers": 1, "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": true, "routed_scaling_factor": 2.5, "swiglu_limit": 10.0,
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 8
    }))
    .expect("tiny config parses")
}

pub fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.below(vocab) as u32).collect()
}

pub fn rel_l2(a: &[f32], b: &[f64]) -> f64 {
    let mut num = 0.0;
    let mut den = 0.0;
    for (x, y) in a.iter().zip(b) {
        num += (*x as f64 - y) * (*x as f64 - y);
        den += y * y;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

pub fn rel_l2_f32(a: &Tensor, b: &Tensor) -> f64 {
    let bb: Vec<f64> = b.data.iter().map(|&v| v as f64).collect();
    rel_l2(&a.data, &bb)
}
