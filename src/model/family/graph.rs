//! The op graphs of the families, with ids in V4's scheme (`L3.attn.q`, `L3.ffn.router.idx`,
//! `head`) so that reports, gate rules and bisect read them alike: the ops a family shares with
//! V4 keep V4's kinds and ids (`attn.norm`, `ffn.norm`, `ffn.router`, `ffn.experts`, `out`,
//! `final_norm`, `head`), the rest are new ids of new kinds. Weights are named canonically, as
//! `checkpoint::naming` maps the families' transformers names (`model.layers.3.self_attn.q_proj`
//! → `layers.3.attn.q_proj`).
//!
//! Qwen3-MoE, layer n (input X = `embed` or `L{n-1}.out`):
//! `attn.norm` → `attn.q`, `attn.k`, `attn.v` → `attn.q_norm`, `attn.k_norm` (per head) →
//! `attn.q_rope`, `attn.k_rope` → `attn.core` (GQA) → `attn.o` → `attn.res` = X + o →
//! `ffn.norm` → `ffn.router` (+ `.idx`) → `ffn.experts` (or `ffn.mlp` on a dense layer) →
//! `out` = res + ffn.
//!
//! DeepSeek-V3, layer n: `attn.norm` → `attn.q_a` → `attn.q_norm` → `attn.q_b` (or `attn.q` without
//! a query LoRA) → `attn.q_rope`; `attn.kv_a` → `attn.kv_norm` (the latent) → `attn.kv_b`, and
//! `attn.k_rope` (the shared rope key, the latent passed through) → `attn.core` (MLA) → `attn.o` →
//! `attn.res`; `ffn.norm` → `ffn.mlp` on the leading dense layers, else `ffn.router` (+ `.idx`),
//! `ffn.experts`, `ffn.shared` → `ffn.out` = experts + shared → `out` = res + ffn.
//!
//! gpt-oss, layer n: `attn.norm` → `attn.q`, `attn.k`, `attn.v` (with their biases) →
//! `attn.q_rope`, `attn.k_rope` → `attn.core` (GQA with the per-head sinks, over the sliding
//! window on sliding layers) → `attn.o` → `attn.res`; `ffn.norm` → `ffn.router` (+ `.idx`: the
//! biased gate's top-k, softmax over the k) → `ffn.experts` (`GptOssExperts`: per expert `w13`,
//! its bias, `w2`, its bias; stored as llm-compressor's linear experts `w1`, its bias, `w3`, its
//! bias, `w2`, its bias) → `out` = res + experts.

use super::super::op::{op, Op, OpClass, OpKind};
use super::super::ModelConfig;
use super::kind::Kind;

/// Ops of layers `0..=last_layer` (clamped), then `final_norm` and `head` when `with_head`.
pub fn build(cfg: &ModelConfig, last_layer: usize, with_head: bool) -> Vec<Op> {
    let mut ops = vec![op(
        "embed".into(),
        OpKind::Embed,
        OpClass::Embed,
        None,
        vec![],
        vec!["embed".into()],
    )];
    if cfg.num_hidden_layers == 0 {
        return ops;
    }
    let mut x = "embed".to_string();
    for n in 0..=last_layer.min(cfg.num_hidden_layers - 1) {
        layer_ops(cfg, n, &x, &mut ops);
        x = format!("L{n}.out");
    }
    if with_head {
        ops.push(op(
            "final_norm".into(),
            OpKind::RmsNorm,
            OpClass::Norm,
            None,
            vec![x],
            vec!["norm.weight".into()],
        ));
        ops.push(op(
            "head".into(),
            OpKind::Linear,
            OpClass::Head,
            None,
            vec!["final_norm".into()],
            vec!["head".into()],
        ));
    }
    ops
}

/// The ops of layer `n` alone (input named `x`).
pub fn layer(cfg: &ModelConfig, n: usize) -> Vec<Op> {
    let mut ops = Vec::new();
    if n < cfg.num_hidden_layers {
        layer_ops(cfg, n, "x", &mut ops);
    }
    ops
}

fn layer_ops(cfg: &ModelConfig, n: usize, x: &str, ops: &mut Vec<Op>) {
    let Some(f) = cfg.family.as_ref() else {
        return;
    };
    match f.kind {
        Kind::Qwen3Moe => {
            gqa_attention(n, x, ops);
            ffn(cfg, n, ops);
        }
        Kind::DeepseekV3 => {
            mla_attention(cfg, n, x, ops);
            ffn(cfg, n, ops);
        }
        Kind::GptOss => {
            sink_attention(cfg, n, x, ops);
            gpt_oss_ffn(cfg, n, ops);
        }
    }
}

/// Per-layer helpers: the op id and the canonical weight name.
fn id(n: usize, s: &str) -> String {
    format!("L{n}.{s}")
}
fn w(n: usize, s: &str) -> String {
    format!("layers.{n}.{s}")
}

fn linear(n: usize, name: &str, input: String, weight: &str, ops: &mut Vec<Op>) {
    ops.push(op(
        id(n, name),
        OpKind::Linear,
        OpClass::Linear,
        Some(n),
        vec![input],
        vec![w(n, weight)],
    ));
}

/// A linear whose op also reads its bias (`{weight}.bias`) when `bias`.
fn linear_b(n: usize, name: &str, input: String, weight: &str, bias: bool, ops: &mut Vec<Op>) {
    linear(n, name, input, weight, ops);
    if bias {
        let b = w(n, &format!("{weight}.bias"));
        ops.last_mut().expect("pushed above").weights.push(b);
    }
}

/// gpt-oss's attention side: q/k/v projections (with biases), RoPE, GQA with the sinks (and the
/// window on sliding layers), o_proj, residual.
fn sink_attention(cfg: &ModelConfig, n: usize, x: &str, ops: &mut Vec<Op>) {
    let l = Some(n);
    let bias = cfg.family.as_ref().is_some_and(|f| f.attention_bias);
    ops.push(op(
        id(n, "attn.norm"),
        OpKind::RmsNorm,
        OpClass::Norm,
        l,
        vec![x.to_string()],
        vec![w(n, "attn_norm.weight")],
    ));
    for s in ["q", "k", "v"] {
        let weight = format!("attn.{s}_proj");
        linear_b(
            n,
            &format!("attn.{s}"),
            id(n, "attn.norm"),
            &weight,
            bias,
            ops,
        );
    }
    for s in ["q", "k"] {
        ops.push(op(
            id(n, &format!("attn.{s}_rope")),
            OpKind::HeadRope,
            OpClass::Rope,
            l,
            vec![id(n, &format!("attn.{s}"))],
            vec![],
        ));
    }
    ops.push(op(
        id(n, "attn.core"),
        OpKind::GqaAttention,
        OpClass::Attention,
        l,
        vec![id(n, "attn.q_rope"), id(n, "attn.k_rope"), id(n, "attn.v")],
        vec![w(n, "attn.attn_sink")],
    ));
    linear_b(n, "attn.o", id(n, "attn.core"), "attn.o_proj", bias, ops);
    ops.push(op(
        id(n, "attn.res"),
        OpKind::Sum,
        OpClass::Elementwise,
        l,
        vec![x.to_string(), id(n, "attn.o")],
        vec![],
    ));
}

/// gpt-oss's FFN side: norm, the biased router, the routed experts, the residual sum.
fn gpt_oss_ffn(cfg: &ModelConfig, n: usize, ops: &mut Vec<Op>) {
    let l = Some(n);
    ops.push(op(
        id(n, "ffn.norm"),
        OpKind::RmsNorm,
        OpClass::Norm,
        l,
        vec![id(n, "attn.res")],
        vec![w(n, "ffn_norm.weight")],
    ));
    let mut router = op(
        id(n, "ffn.router"),
        OpKind::Router,
        OpClass::Router,
        l,
        vec![id(n, "ffn.norm")],
        vec![w(n, "ffn.gate"), w(n, "ffn.gate.bias")],
    );
    router.outputs.push(id(n, "ffn.router.idx"));
    ops.push(router);
    let linear = cfg.family.as_ref().is_some_and(|f| f.linear_experts);
    let per: &[&str] = if linear {
        &["w1", "w1.bias", "w3", "w3.bias", "w2", "w2.bias"]
    } else {
        &["w13", "w13.bias", "w2", "w2.bias"]
    };
    let mut experts = Vec::with_capacity(per.len() * cfg.n_routed_experts);
    for e in 0..cfg.n_routed_experts {
        for p in per {
            experts.push(w(n, &format!("ffn.experts.{e}.{p}")));
        }
    }
    ops.push(op(
        id(n, "ffn.experts"),
        OpKind::GptOssExperts,
        OpClass::Moe,
        l,
        vec![
            id(n, "ffn.norm"),
            id(n, "ffn.router"),
            id(n, "ffn.router.idx"),
        ],
        experts,
    ));
    ops.push(op(
        id(n, "out"),
        OpKind::Sum,
        OpClass::Elementwise,
        l,
        vec![id(n, "attn.res"), id(n, "ffn.experts")],
        vec![],
    ));
}

/// Qwen3's attention side: q/k/v projections, per-head q/k RMSNorm, RoPE, GQA, o_proj, residual.
fn gqa_attention(n: usize, x: &str, ops: &mut Vec<Op>) {
    let l = Some(n);
    ops.push(op(
        id(n, "attn.norm"),
        OpKind::RmsNorm,
        OpClass::Norm,
        l,
        vec![x.to_string()],
        vec![w(n, "attn_norm.weight")],
    ));
    for (name, weight) in [("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")] {
        linear(
            n,
            &format!("attn.{name}"),
            id(n, "attn.norm"),
            &format!("attn.{weight}"),
            ops,
        );
    }
    for s in ["q", "k"] {
        ops.push(op(
            id(n, &format!("attn.{s}_norm")),
            OpKind::HeadNorm,
            OpClass::Norm,
            l,
            vec![id(n, &format!("attn.{s}"))],
            vec![w(n, &format!("attn.{s}_norm.weight"))],
        ));
    }
    for s in ["q", "k"] {
        ops.push(op(
            id(n, &format!("attn.{s}_rope")),
            OpKind::HeadRope,
            OpClass::Rope,
            l,
            vec![id(n, &format!("attn.{s}_norm"))],
            vec![],
        ));
    }
    ops.push(op(
        id(n, "attn.core"),
        OpKind::GqaAttention,
        OpClass::Attention,
        l,
        vec![id(n, "attn.q_rope"), id(n, "attn.k_rope"), id(n, "attn.v")],
        vec![],
    ));
    linear(n, "attn.o", id(n, "attn.core"), "attn.o_proj", ops);
    ops.push(op(
        id(n, "attn.res"),
        OpKind::Sum,
        OpClass::Elementwise,
        l,
        vec![x.to_string(), id(n, "attn.o")],
        vec![],
    ));
}

/// DeepSeek-V3's MLA side (HF names mapped by `checkpoint::naming`: `q_a_proj` → `wq_a`,
/// `q_b_proj` → `wq_b`, `kv_a_layernorm` → `kv_norm`).
fn mla_attention(cfg: &ModelConfig, n: usize, x: &str, ops: &mut Vec<Op>) {
    let l = Some(n);
    let lora = cfg.family.as_ref().and_then(|f| f.q_lora_rank).is_some();
    ops.push(op(
        id(n, "attn.norm"),
        OpKind::RmsNorm,
        OpClass::Norm,
        l,
        vec![x.to_string()],
        vec![w(n, "attn_norm.weight")],
    ));
    let q = if lora {
        linear(n, "attn.q_a", id(n, "attn.norm"), "attn.wq_a", ops);
        ops.push(op(
            id(n, "attn.q_norm"),
            OpKind::RmsNorm,
            OpClass::Norm,
            l,
            vec![id(n, "attn.q_a")],
            vec![w(n, "attn.q_a_layernorm.weight")],
        ));
        linear(n, "attn.q_b", id(n, "attn.q_norm"), "attn.wq_b", ops);
        id(n, "attn.q_b")
    } else {
        linear(n, "attn.q", id(n, "attn.norm"), "attn.q_proj", ops);
        id(n, "attn.q")
    };
    linear(
        n,
        "attn.kv_a",
        id(n, "attn.norm"),
        "attn.kv_a_proj_with_mqa",
        ops,
    );
    ops.push(op(
        id(n, "attn.kv_norm"),
        OpKind::LatentNorm,
        OpClass::Norm,
        l,
        vec![id(n, "attn.kv_a")],
        vec![w(n, "attn.kv_norm.weight")],
    ));
    linear(n, "attn.kv_b", id(n, "attn.kv_norm"), "attn.kv_b_proj", ops);
    ops.push(op(
        id(n, "attn.q_rope"),
        OpKind::HeadRope,
        OpClass::Rope,
        l,
        vec![q],
        vec![],
    ));
    ops.push(op(
        id(n, "attn.k_rope"),
        OpKind::HeadRope,
        OpClass::Rope,
        l,
        vec![id(n, "attn.kv_a")],
        vec![],
    ));
    ops.push(op(
        id(n, "attn.core"),
        OpKind::MlaAttention,
        OpClass::Attention,
        l,
        vec![
            id(n, "attn.q_rope"),
            id(n, "attn.kv_b"),
            id(n, "attn.k_rope"),
        ],
        vec![],
    ));
    linear(n, "attn.o", id(n, "attn.core"), "attn.o_proj", ops);
    ops.push(op(
        id(n, "attn.res"),
        OpKind::Sum,
        OpClass::Elementwise,
        l,
        vec![x.to_string(), id(n, "attn.o")],
        vec![],
    ));
}

/// The FFN side: norm, then the routed experts (router, experts) or a dense MLP, then the
/// residual sum `out`.
fn ffn(cfg: &ModelConfig, n: usize, ops: &mut Vec<Op>) {
    let l = Some(n);
    ops.push(op(
        id(n, "ffn.norm"),
        OpKind::RmsNorm,
        OpClass::Norm,
        l,
        vec![id(n, "attn.res")],
        vec![w(n, "ffn_norm.weight")],
    ));
    let dense = cfg
        .family
        .as_ref()
        .is_some_and(|f| f.dense.get(n).copied().unwrap_or(false));
    let y = if dense {
        ops.push(op(
            id(n, "ffn.mlp"),
            OpKind::Mlp,
            OpClass::Moe,
            l,
            vec![id(n, "ffn.norm")],
            vec![
                w(n, "ffn.gate_proj"),
                w(n, "ffn.up_proj"),
                w(n, "ffn.down_proj"),
            ],
        ));
        id(n, "ffn.mlp")
    } else {
        let mut rw = vec![w(n, "ffn.gate")];
        if cfg
            .family
            .as_ref()
            .is_some_and(|f| f.kind == Kind::DeepseekV3)
        {
            // `e_score_correction_bias`, canonically `ffn.gate.bias`
            rw.push(w(n, "ffn.gate.bias"));
        }
        let mut router = op(
            id(n, "ffn.router"),
            OpKind::Router,
            OpClass::Router,
            l,
            vec![id(n, "ffn.norm")],
            rw,
        );
        router.outputs.push(id(n, "ffn.router.idx"));
        ops.push(router);
        let mut experts = Vec::with_capacity(3 * cfg.n_routed_experts);
        for e in 0..cfg.n_routed_experts {
            for p in ["w1", "w3", "w2"] {
                experts.push(w(n, &format!("ffn.experts.{e}.{p}")));
            }
        }
        ops.push(op(
            id(n, "ffn.experts"),
            OpKind::Experts,
            OpClass::Moe,
            l,
            vec![
                id(n, "ffn.norm"),
                id(n, "ffn.router"),
                id(n, "ffn.router.idx"),
            ],
            experts,
        ));
        if cfg.n_shared_experts > 0 {
            ops.push(op(
                id(n, "ffn.shared"),
                OpKind::SharedExpert,
                OpClass::Moe,
                l,
                vec![id(n, "ffn.norm")],
                vec![
                    w(n, "ffn.shared_experts.w1"),
                    w(n, "ffn.shared_experts.w3"),
                    w(n, "ffn.shared_experts.w2"),
                ],
            ));
            ops.push(op(
                id(n, "ffn.out"),
                OpKind::Sum,
                OpClass::Elementwise,
                l,
                vec![id(n, "ffn.experts"), id(n, "ffn.shared")],
                vec![],
            ));
            id(n, "ffn.out")
        } else {
            id(n, "ffn.experts")
        }
    };
    ops.push(op(
        id(n, "out"),
        OpKind::Sum,
        OpClass::Elementwise,
        l,
        vec![id(n, "attn.res"), y],
        vec![],
    ));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen(dense: &[usize]) -> ModelConfig {
        ModelConfig::from_json(&serde_json::json!({
            "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 3,
            "vocab_size": 100, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "intermediate_size": 96, "mlp_only_layers": dense
        }))
        .unwrap()
    }

    #[test]
    fn qwen3_ids_are_unique_ordered_and_stable() {
        let ops = build(&qwen(&[]), 9, true);
        let mut seen = std::collections::HashSet::new();
        for o in &ops {
            for i in &o.inputs {
                assert!(seen.contains(i), "{} reads {i} before it is made", o.id);
            }
            for out in &o.outputs {
                assert!(seen.insert(out.clone()), "duplicate {out}");
            }
        }
        let l1: Vec<String> = ops
            .iter()
            .filter(|o| o.layer == Some(1))
            .flat_map(|o| o.outputs.clone())
            .collect();
        let want: Vec<String> = [
            "attn.norm",
            "attn.q",
            "attn.k",
            "attn.v",
            "attn.q_norm",
            "attn.k_norm",
            "attn.q_rope",
            "attn.k_rope",
            "attn.core",
            "attn.o",
            "attn.res",
            "ffn.norm",
            "ffn.router",
            "ffn.router.idx",
            "ffn.experts",
            "out",
        ]
        .iter()
        .map(|s| format!("L1.{s}"))
        .collect();
        assert_eq!(l1, want);
        assert_eq!(ops[0].id, "embed");
        assert_eq!(ops.last().unwrap().id, "head");
        let n = ops.iter().find(|o| o.id == "L0.attn.norm").unwrap();
        assert_eq!(n.inputs, ["embed"]);
        let ex = ops.iter().find(|o| o.id == "L2.ffn.experts").unwrap();
        assert_eq!(ex.weights[4], "layers.2.ffn.experts.1.w3");
        let q = ops.iter().find(|o| o.id == "L2.attn.q_norm").unwrap();
        assert_eq!(q.weights, ["layers.2.attn.q_norm.weight"]);
    }

    #[test]
    fn deepseek_v3_layers_in_order() {
        let cfg = ModelConfig::from_json(&serde_json::json!({
            "model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 2,
            "vocab_size": 10, "num_attention_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16,
            "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "intermediate_size": 32, "first_k_dense_replace": 1, "n_shared_experts": 1
        }))
        .unwrap();
        let ops = build(&cfg, 1, true);
        let ids = |l: usize| -> Vec<String> {
            ops.iter()
                .filter(|o| o.layer == Some(l))
                .flat_map(|o| o.outputs.clone())
                .map(|s| s[3..].to_string())
                .collect()
        };
        let attn = [
            "attn.norm",
            "attn.q_a",
            "attn.q_norm",
            "attn.q_b",
            "attn.kv_a",
            "attn.kv_norm",
            "attn.kv_b",
            "attn.q_rope",
            "attn.k_rope",
            "attn.core",
            "attn.o",
            "attn.res",
            "ffn.norm",
        ];
        let mut l0: Vec<&str> = attn.to_vec();
        l0.extend(["ffn.mlp", "out"]);
        assert_eq!(ids(0), l0);
        let mut l1: Vec<&str> = attn.to_vec();
        l1.extend([
            "ffn.router",
            "ffn.router.idx",
            "ffn.experts",
            "ffn.shared",
            "ffn.out",
            "out",
        ]);
        assert_eq!(ids(1), l1);
        let r = ops.iter().find(|o| o.id == "L1.ffn.router").unwrap();
        assert_eq!(r.weights, ["layers.1.ffn.gate", "layers.1.ffn.gate.bias"]);
        let core = ops.iter().find(|o| o.id == "L1.attn.core").unwrap();
        assert_eq!(
            core.inputs,
            ["L1.attn.q_rope", "L1.attn.kv_b", "L1.attn.k_rope"]
        );
        let kv = ops.iter().find(|o| o.id == "L1.attn.kv_norm").unwrap();
        assert_eq!(kv.weights, ["layers.1.attn.kv_norm.weight"]);
    }

    #[test]
    fn gpt_oss_layers_in_order_with_biases_and_sinks() {
        let cfg = ModelConfig::from_json(&serde_json::json!({
            "model_type": "gpt_oss", "hidden_size": 64, "num_hidden_layers": 2,
            "vocab_size": 10, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "num_local_experts": 3, "num_experts_per_tok": 2, "intermediate_size": 32,
            "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]
        }))
        .unwrap();
        let ops = build(&cfg, 1, true);
        let l1: Vec<String> = ops
            .iter()
            .filter(|o| o.layer == Some(1))
            .flat_map(|o| o.outputs.clone())
            .map(|s| s[3..].to_string())
            .collect();
        let want = [
            "attn.norm",
            "attn.q",
            "attn.k",
            "attn.v",
            "attn.q_rope",
            "attn.k_rope",
            "attn.core",
            "attn.o",
            "attn.res",
            "ffn.norm",
            "ffn.router",
            "ffn.router.idx",
            "ffn.experts",
            "out",
        ];
        assert_eq!(l1, want);
        let get = |id: &str| ops.iter().find(|o| o.id == id).unwrap();
        assert_eq!(
            get("L1.attn.k").weights,
            ["layers.1.attn.k_proj", "layers.1.attn.k_proj.bias"]
        );
        assert_eq!(get("L0.attn.core").weights, ["layers.0.attn.attn_sink"]);
        assert_eq!(get("L0.attn.q_rope").inputs, ["L0.attn.q"]);
        assert_eq!(
            get("L1.ffn.router").weights,
            ["layers.1.ffn.gate", "layers.1.ffn.gate.bias"]
        );
        let ex = get("L1.ffn.experts");
        assert_eq!(ex.kind, OpKind::GptOssExperts);
        assert_eq!(ex.weights.len(), 12);
        assert_eq!(
            ex.weights[4..8],
            [
                "layers.1.ffn.experts.1.w13",
                "layers.1.ffn.experts.1.w13.bias",
                "layers.1.ffn.experts.1.w2",
                "layers.1.ffn.experts.1.w2.bias"
            ]
        );
        assert_eq!(get("L1.out").inputs, ["L1.attn.res", "L1.ffn.experts"]);
        // without attention_bias the projections read no bias
        let mut v = serde_json::json!({
            "model_type": "gpt_oss", "hidden_size": 64, "num_hidden_layers": 1,
            "vocab_size": 10, "num_attention_heads": 4, "head_dim": 16,
            "num_local_experts": 3, "num_experts_per_tok": 2, "intermediate_size": 32,
            "sliding_window": 8, "attention_bias": false
        });
        let ops = build(&ModelConfig::from_json(&v).unwrap(), 0, false);
        let o = ops.iter().find(|o| o.id == "L0.attn.o").unwrap();
        assert_eq!(o.weights, ["layers.0.attn.o_proj"]);
        v["attention_bias"] = serde_json::json!(true);
        let ops = build(&ModelConfig::from_json(&v).unwrap(), 0, false);
        let o = ops.iter().find(|o| o.id == "L0.attn.o").unwrap();
        assert_eq!(o.weights.len(), 2);
    }

    #[test]
    fn dense_layers_have_an_mlp_instead_of_experts() {
        let ops = build(&qwen(&[1]), 2, false);
        let has = |s: &str| ops.iter().any(|o| o.id == s);
        assert!(has("L1.ffn.mlp") && !has("L1.ffn.router") && !has("L1.ffn.experts"));
        assert!(has("L0.ffn.experts") && has("L2.ffn.experts") && !has("head"));
        let out = ops.iter().find(|o| o.id == "L1.out").unwrap();
        assert_eq!(out.inputs, ["L1.attn.res", "L1.ffn.mlp"]);
    }
}
