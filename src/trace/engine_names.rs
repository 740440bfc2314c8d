//! vLLM's and SGLang's module paths of the families beyond DeepSeek-V4 (`model::family`), mapped
//! to their op ids: what `compare --names vllm|sglang` reads for a DeepSeek-V3/R1, Qwen3-MoE or
//! gpt-oss dump (probes/capture/_dump.py's convention: `PATH`, tuple elements `PATH:i`, inputs
//! `PATH:input`). The fused projections are split the way the engine splits their output, by the
//! config's sizes; the tensor-parallel layout of each output is in its rule.
//!
//! Read from the engines' sources (module names and what each module returns; nothing copied):
//! - vLLM `vllm/model_executor/models/deepseek_v2.py` (commits 002d6073 and b863fe5b):
//!   `self_attn.fused_qkv_a_proj` (`[q_lora_rank, kv_lora_rank + qk_rope_head_dim]`, replicated),
//!   `q_a_layernorm`, `q_b_proj` and `kv_b_proj` (column-parallel over heads), `kv_a_layernorm`,
//!   `o_proj`, `mla_attn` (the `MultiHeadLatentAttentionWrapper` of
//!   `vllm/model_executor/layers/mla.py` @ 00b9b7ad, which returns `o_proj`'s output; its
//!   `mla_attn` is the attention core, `[T, heads · v_head_dim]`), without a query LoRA
//!   `q_proj` and `kv_a_proj_with_mqa`; `mlp` is `DeepseekV2MLP` (`gate_up_proj`, `down_proj`) on
//!   the dense layers, else `DeepseekV2MoE` with `gate` (router logits), `shared_experts`
//!   (`reduce_results=False`) and `experts`. `experts` returns, in the `FusedMoEFactory` /
//!   `MoERunner` era (002d6073; `fused_moe/runner/moe_runner.py` @ 01cb3084),
//!   `shared + routed_scaling_factor · routed` reduced; in the `SharedFusedMoE` era (b863fe5b) the
//!   tuple `(shared, routed)`, partial sums, with the factor multiplied in afterwards by the caller.
//!   The decoder layer returns `(mlp output, residual)`, the residual being the attention side's
//!   sum; the fused add-RMSNorms return `(normed, residual)`.
//! - vLLM `qwen3_moe.py` (2e0831b0): `self_attn.qkv_proj` (`QKVParallelLinear`, per rank
//!   `[q, k, v]` of its heads), `q_norm`/`k_norm` on `[T, heads, head_dim]`, `attn`, `o_proj`;
//!   `mlp.gate` (logits), `mlp.experts` (`(None, routed)` partial sums in the `SharedFusedMoE`
//!   era); `Qwen3MoeMLP` on `mlp_only_layers`.
//! - vLLM `gpt_oss.py` (a6b6cfaa): `model.embedding`, `attn.qkv_proj`, `attn.attn` (with the
//!   sinks), `attn.o_proj`, `mlp.router` (a biased `nn.Linear`: logits), `mlp.experts`
//!   (`reduce_results=True`; its output may be wider than hidden and is cut to it).
//! - SGLang `python/sglang/srt/models/deepseek_v2.py` (3e4a39ee):
//!   `self_attn.fused_qkv_a_proj_with_mqa` (`[q_lora_rank, kv_lora_rank + qk_rope_head_dim]`),
//!   `q_a_layernorm`, `q_b_proj`, `kv_a_layernorm`, `kv_b_proj`, `attn_mha` (the MHA prefill's
//!   core), `o_proj` (`reduce_results=False`); `mlp.gate`, `mlp.topk` (`TopKOutput` = weights,
//!   ids, logits; the weights carry `routed_scaling_factor` on some MoE backends and not on
//!   others), `mlp.experts`, `mlp.shared_experts` — absent when the shared expert is fused into
//!   `experts` (`determine_num_fused_shared_experts`: 256 routed, 1 shared, CUDA), whose output
//!   is then routed + shared.
//! - SGLang `qwen3_moe.py` (e3d8e9ae): `self_attn.qkv_proj`, `q_norm`/`k_norm` on
//!   `[T · heads, head_dim]`, `attn`, `o_proj` (`reduce_results=False`); `mlp.gate`, `mlp.topk`,
//!   `mlp.experts`.
//! - SGLang `gpt_oss.py` (e9149048): `self_attn.qkv_proj`, `attn`, `o_proj`; `mlp.router`
//!   (logits), `mlp.topk` (softmax over the top k), `mlp.experts`.
//!
//! No op of ours is a router's logits or the fused gate/up half of an MLP (the MLP ops are whole
//! SwiGLUs), so `mlp.gate`, `mlp.router` and `gate_up_proj` stay unmapped.

use super::mapped::{layer_and_rest, Rule};
use crate::model::family::Kind;
use crate::model::ModelConfig;

/// Which engine's module tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    Vllm,
    Sglang,
}

fn one(op: String) -> Option<Vec<Rule>> {
    Some(vec![Rule::plain(op, true)])
}

/// The rules of `name` for `cfg`'s family under `engine` (`None`: not an op's output). `has` says
/// whether the trace holds another name.
pub fn map(
    engine: Engine,
    name: &str,
    cfg: &ModelConfig,
    has: &dyn Fn(&str) -> bool,
) -> Option<Vec<Rule>> {
    let fam = cfg.family.as_ref()?;
    let last = cfg.num_hidden_layers.checked_sub(1)?;
    // element 0 of a tuple is the module's output itself
    let name = name.strip_suffix(":0").unwrap_or(name);
    match name {
        "model.embed_tokens" => return one("embed".into()),
        "model.embedding" if engine == Engine::Vllm && fam.kind == Kind::GptOss => {
            return one("embed".into())
        }
        "model.norm" => return one("final_norm".into()),
        // the fused add-RMSNorm's residual: the last layer's output
        "model.norm:1" => return one(format!("L{last}.out")),
        "lm_head" | "logits" => return one("head".into()),
        _ => {}
    }
    let (n, rest) = layer_and_rest(name, "model.layers.")?;
    if n > last {
        return None;
    }
    let l = |s: &str| format!("L{n}.{s}");
    let dense = fam.dense.get(n).copied().unwrap_or(false);
    let shared = fam.kind == Kind::DeepseekV3 && cfg.n_shared_experts > 0;
    // the FFN side's output op: the dense MLP, the routed + shared sum, or the routed experts
    let ffn = if dense {
        l("ffn.mlp")
    } else if shared {
        l("ffn.out")
    } else {
        l("ffn.experts")
    };
    let attn = if engine == Engine::Vllm && fam.kind == Kind::GptOss {
        "attn"
    } else {
        "self_attn"
    };
    let rest = match rest.strip_prefix(attn) {
        Some(r) if r.is_empty() || r.starts_with(['.', ':']) => {
            return attention(engine, fam.kind, r, cfg, &l);
        }
        _ => rest,
    };
    // row-parallel outputs are partial sums until the engine reduces them (SGLang defers it to
    // the next layer's norm); `Sum` takes rank 0's copy when the ranks already agree
    Some(vec![match rest {
        "" => Rule::plain(ffn, true).sum(),
        ":1" | "post_attention_layernorm:1" => Rule::plain(l("attn.res"), true),
        "input_layernorm" => Rule::plain(l("attn.norm"), true),
        "input_layernorm:1" if n > 0 => Rule::plain(format!("L{}.out", n - 1), true),
        "post_attention_layernorm" => Rule::plain(l("ffn.norm"), true),
        "mlp" => Rule::plain(ffn, true).sum(),
        _ if dense => return None,
        "mlp.shared_experts" if shared => Rule::plain(l("ffn.shared"), true).sum(),
        "mlp.experts" => experts(engine, fam.kind, n, cfg, has, &l),
        // vLLM's `SharedFusedMoE` tuple: the routed sum before the caller's scaling factor
        "mlp.experts:1" if engine == Engine::Vllm => {
            let r = Rule::plain(l("ffn.experts"), true).sum();
            let f = cfg.routed_scaling_factor as f32;
            if fam.kind == Kind::DeepseekV3 && f != 1.0 {
                r.scaled(f)
            } else {
                r
            }
        }
        // SGLang's top-k weights carry DeepSeek-V3's scaling factor on some MoE backends only:
        // compared where the factor is 1, so either way they agree
        "mlp.topk" if engine == Engine::Sglang && cfg.routed_scaling_factor == 1.0 => {
            Rule::plain(l("ffn.router"), true)
        }
        "mlp.topk:1" if engine == Engine::Sglang => Rule::plain(l("ffn.router.idx"), true),
        _ => return None,
    }])
}

/// What `mlp.experts` returns: the routed sum (scaled, as the op), or routed + shared.
fn experts(
    engine: Engine,
    kind: Kind,
    n: usize,
    cfg: &ModelConfig,
    has: &dyn Fn(&str) -> bool,
    l: &dyn Fn(&str) -> String,
) -> Rule {
    let shared = kind == Kind::DeepseekV3 && cfg.n_shared_experts > 0;
    let p = format!("model.layers.{n}.mlp");
    let op = match engine {
        // `SharedFusedMoE`'s tuple: element 0 is the shared expert's output
        Engine::Vllm if shared && has(&format!("{p}.experts:1")) => l("ffn.shared"),
        // `MoERunner`: shared + scaled routed
        Engine::Vllm if shared => l("ffn.out"),
        // the shared expert fused into the experts: no module of its own
        Engine::Sglang if shared && !has(&format!("{p}.shared_experts")) => l("ffn.out"),
        _ => l("ffn.experts"),
    };
    let r = Rule::plain(op, true).sum();
    // gpt-oss's experts may write a padded hidden dim (vLLM cuts it to hidden after)
    if kind == Kind::GptOss {
        r.split(0, cfg.hidden_size)
    } else {
        r
    }
}

/// The attention side, `r` being the path after the attention module (`""`, `.q_b_proj`, …).
fn attention(
    engine: Engine,
    kind: Kind,
    r: &str,
    cfg: &ModelConfig,
    l: &dyn Fn(&str) -> String,
) -> Option<Vec<Rule>> {
    let fam = cfg.family.as_ref()?;
    let h = cfg.num_attention_heads;
    let core = || Rule::plain(l("attn.core"), true).per_head(h, fam.v_head_dim);
    let o = || Rule::plain(l("attn.o"), true).sum();
    let common = match r {
        "" | ".o_proj" => Some(o()),
        ".o_proj:input" => Some(core()),
        _ => None,
    };
    if let Some(rule) = common {
        return Some(vec![rule]);
    }
    match kind {
        Kind::DeepseekV3 => {
            let qk = cfg.head_dim;
            let nope = qk.saturating_sub(cfg.qk_rope_head_dim);
            let kv_a = fam.kv_lora_rank + cfg.qk_rope_head_dim;
            let fused = match engine {
                Engine::Vllm => ".fused_qkv_a_proj",
                Engine::Sglang => ".fused_qkv_a_proj_with_mqa",
            };
            if r == fused {
                let q = fam.q_lora_rank?;
                return Some(vec![
                    Rule::plain(l("attn.q_a"), true).split(0, q),
                    Rule::plain(l("attn.kv_a"), true).split(q, kv_a),
                ]);
            }
            let rule = match (engine, r) {
                (_, ".q_a_proj") => Rule::plain(l("attn.q_a"), true),
                (_, ".kv_a_proj_with_mqa") => Rule::plain(l("attn.kv_a"), true),
                (_, ".q_a_layernorm") => Rule::plain(l("attn.q_norm"), true),
                (_, ".q_b_proj") => Rule::plain(l("attn.q_b"), true).per_head(h, qk),
                (_, ".q_proj") => Rule::plain(l("attn.q"), true).per_head(h, qk),
                (_, ".kv_a_layernorm") => Rule::plain(l("attn.kv_norm"), true),
                (_, ".kv_b_proj") => {
                    Rule::plain(l("attn.kv_b"), true).per_head(h, nope + fam.v_head_dim)
                }
                (Engine::Vllm, ".mla_attn") => o(),
                (Engine::Vllm, ".mla_attn.mla_attn") | (Engine::Sglang, ".attn_mha") => core(),
                _ => return None,
            };
            Some(vec![rule])
        }
        Kind::Qwen3Moe | Kind::GptOss => {
            let (dh, kv) = (cfg.head_dim, fam.num_key_value_heads);
            let rule = match r {
                ".qkv_proj" => {
                    let (q, k) = (h * dh, kv * dh);
                    return Some(vec![
                        Rule::plain(l("attn.q"), true).per_head(h, dh).split(0, q),
                        Rule::plain(l("attn.k"), true).per_head(kv, dh).split(q, k),
                        Rule::plain(l("attn.v"), true)
                            .per_head(kv, dh)
                            .split(q + k, k),
                    ]);
                }
                ".q_norm" if kind == Kind::Qwen3Moe => {
                    Rule::plain(l("attn.q_norm"), true).per_head(h, dh)
                }
                ".k_norm" if kind == Kind::Qwen3Moe => {
                    Rule::plain(l("attn.k_norm"), true).per_head(kv, dh)
                }
                ".attn" => core(),
                _ => return None,
            };
            Some(vec![rule])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v3() -> ModelConfig {
        ModelConfig::from_json(&serde_json::json!({
            "model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 3,
            "vocab_size": 10, "num_attention_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 16,
            "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "intermediate_size": 32, "first_k_dense_replace": 1, "n_shared_experts": 1,
            "routed_scaling_factor": 2.5
        }))
        .unwrap()
    }

    fn ops(engine: Engine, name: &str, cfg: &ModelConfig, has: &[&str]) -> Vec<String> {
        map(engine, name, cfg, &|s| has.contains(&s))
            .unwrap_or_default()
            .into_iter()
            .map(|r| r.op)
            .collect()
    }

    #[test]
    fn deepseek_v3_fused_qkv_a_splits_at_the_query_lora_rank() {
        let cfg = v3();
        for (engine, name) in [
            (Engine::Vllm, "model.layers.2.self_attn.fused_qkv_a_proj"),
            (
                Engine::Sglang,
                "model.layers.2.self_attn.fused_qkv_a_proj_with_mqa",
            ),
        ] {
            let r = map(engine, name, &cfg, &|_| false).unwrap();
            assert_eq!(r.len(), 2);
            assert_eq!(
                (r[0].op.as_str(), r[1].op.as_str()),
                ("L2.attn.q_a", "L2.attn.kv_a")
            );
            let s: Vec<(usize, usize)> = r
                .iter()
                .map(|r| r.split.as_ref().map(|s| (s.start, s.len)).unwrap())
                .collect();
            // q_lora 24, then kv_lora 16 + rope 4
            assert_eq!(s, [(0, 24), (24, 20)]);
        }
        // each engine's own name only
        assert!(ops(
            Engine::Sglang,
            "model.layers.2.self_attn.fused_qkv_a_proj",
            &cfg,
            &[]
        )
        .is_empty());
    }

    #[test]
    fn experts_output_follows_what_the_module_wrote() {
        let cfg = v3();
        let e = "model.layers.1.mlp.experts";
        // vLLM's MoERunner: shared + routed in one tensor
        assert_eq!(ops(Engine::Vllm, e, &cfg, &[]), ["L1.ffn.out"]);
        // vLLM's SharedFusedMoE tuple: (shared, routed before the factor)
        let tuple = ["model.layers.1.mlp.experts:1"];
        assert_eq!(ops(Engine::Vllm, e, &cfg, &tuple), ["L1.ffn.shared"]);
        let r = map(Engine::Vllm, "model.layers.1.mlp.experts:1", &cfg, &|_| {
            true
        })
        .unwrap();
        assert_eq!(
            (r[0].op.as_str(), r[0].scale),
            ("L1.ffn.experts", Some(2.5))
        );
        // SGLang: routed alone beside its own shared-expert module, else the fused sum
        let with = ["model.layers.1.mlp.shared_experts"];
        assert_eq!(ops(Engine::Sglang, e, &cfg, &with), ["L1.ffn.experts"]);
        assert_eq!(ops(Engine::Sglang, e, &cfg, &[]), ["L1.ffn.out"]);
        // the dense layer 0 has no experts; its MLP is ffn.mlp
        assert!(ops(Engine::Vllm, "model.layers.0.mlp.experts", &cfg, &[]).is_empty());
        assert_eq!(
            ops(Engine::Vllm, "model.layers.0.mlp", &cfg, &[]),
            ["L0.ffn.mlp"]
        );
        // a scaled factor keeps SGLang's top-k weights out; the ids are compared
        assert!(ops(Engine::Sglang, "model.layers.1.mlp.topk", &cfg, &[]).is_empty());
        assert_eq!(
            ops(Engine::Sglang, "model.layers.1.mlp.topk:1", &cfg, &[]),
            ["L1.ffn.router.idx"]
        );
    }

    #[test]
    fn layer_tuples_and_fused_norm_residuals() {
        let cfg = v3();
        let o = |n: &str| ops(Engine::Vllm, n, &cfg, &[]);
        assert_eq!(o("model.layers.2"), ["L2.ffn.out"]);
        assert_eq!(o("model.layers.2:0"), ["L2.ffn.out"]);
        assert_eq!(o("model.layers.2:1"), ["L2.attn.res"]);
        assert_eq!(o("model.layers.2.input_layernorm:1"), ["L1.out"]);
        assert!(o("model.layers.0.input_layernorm:1").is_empty());
        assert_eq!(o("model.norm:1"), ["L2.out"]);
        assert!(o("model.layers.3.input_layernorm").is_empty());
        // no op is a router's logits or the gate/up half of an MLP
        for n in [
            "model.layers.1.mlp.gate",
            "model.layers.0.mlp.gate_up_proj",
            "model.layers.1.self_attn.rotary_emb",
        ] {
            assert!(o(n).is_empty(), "{n}");
        }
    }

    #[test]
    fn qwen3_qkv_splits_by_head_counts() {
        let cfg = ModelConfig::from_json(&serde_json::json!({
            "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2,
            "vocab_size": 100, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "intermediate_size": 96, "mlp_only_layers": [1]
        }))
        .unwrap();
        let r = map(
            Engine::Vllm,
            "model.layers.0.self_attn.qkv_proj",
            &cfg,
            &|_| false,
        )
        .unwrap();
        let got: Vec<(String, usize, usize, usize)> = r
            .iter()
            .map(|r| {
                let s = r.split.as_ref().unwrap();
                (r.op.clone(), s.start, s.len, r.per_head.unwrap().heads)
            })
            .collect();
        assert_eq!(
            got,
            [
                ("L0.attn.q".to_string(), 0, 64, 4),
                ("L0.attn.k".to_string(), 64, 32, 2),
                ("L0.attn.v".to_string(), 96, 32, 2),
            ]
        );
        let o = |e, n: &str| ops(e, n, &cfg, &[]);
        assert_eq!(
            o(Engine::Sglang, "model.layers.0.self_attn.k_norm"),
            ["L0.attn.k_norm"]
        );
        assert_eq!(
            o(Engine::Sglang, "model.layers.0.mlp.topk"),
            ["L0.ffn.router"]
        );
        assert_eq!(
            o(Engine::Vllm, "model.layers.0.mlp.experts:1"),
            ["L0.ffn.experts"]
        );
        assert_eq!(o(Engine::Vllm, "model.layers.1.mlp"), ["L1.ffn.mlp"]);
        assert_eq!(o(Engine::Vllm, "model.layers.1"), ["L1.ffn.mlp"]);
        assert_eq!(o(Engine::Vllm, "model.layers.0"), ["L0.ffn.experts"]);
    }
}
