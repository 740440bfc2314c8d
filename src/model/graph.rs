//! The forward pass as data: an ordered list of ops with stable ids.
//!
//! Ids are the contract between the model, the runner, reports, JSON records and gate rules, so they
//! are fixed strings (`L3.attn.q_b`, `L3.ffn.router.idx`, `head`), never derived from positions in
//! the list. The list is topologically ordered: every input id is produced by an earlier op.
//!
//! Each op names its inputs by tensor id and its checkpoint reads by canonical (official DeepSeek)
//! name; `exec` reads both lists by position, so the order documented on [`OpKind`] is part of the
//! contract too.

use super::ModelConfig;

pub(crate) use super::op::op;
pub use super::op::{Op, OpClass, OpKind};

/// Ops of layers `0..=last_layer` (plus `hc_head`, `final_norm`, `head` when `with_head`).
/// `last_layer` beyond the config is clamped to the last layer.
pub fn build_graph(cfg: &ModelConfig, last_layer: usize, with_head: bool) -> Vec<Op> {
    if cfg.family.is_some() {
        return super::family::graph::build(cfg, last_layer, with_head);
    }
    let mut ops = Vec::new();
    ops.push(op(
        "embed".into(),
        OpKind::Embed,
        OpClass::Embed,
        None,
        vec![],
        vec!["embed".into()],
    ));
    ops.push(op(
        "hc_expand".into(),
        OpKind::HcExpand,
        OpClass::Mix,
        None,
        vec!["embed".into()],
        vec![],
    ));
    let n_layers = cfg.compress_ratios.len().min(cfg.num_hidden_layers);
    let mut x_prev = "hc_expand".to_string();
    if n_layers == 0 {
        return ops;
    }
    let last = last_layer.min(n_layers - 1);
    for n in 0..=last {
        layer_ops(cfg, n, &x_prev, &mut ops);
        x_prev = format!("L{n}.out");
    }
    if with_head {
        ops.push(op(
            "hc_head".into(),
            OpKind::HcHead,
            OpClass::Mix,
            None,
            vec![x_prev],
            vec![
                "hc_head_fn".into(),
                "hc_head_base".into(),
                "hc_head_scale".into(),
            ],
        ));
        ops.push(op(
            "final_norm".into(),
            OpKind::RmsNorm,
            OpClass::Norm,
            None,
            vec!["hc_head".into()],
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

/// The ops of layer `n` alone (its input named `x`): what the layer reads, for checks of a
/// checkpoint's completeness that must not build every layer of a config.
pub fn layer_graph(cfg: &ModelConfig, n: usize) -> Vec<Op> {
    if cfg.family.is_some() {
        return super::family::graph::layer(cfg, n);
    }
    let mut ops = Vec::new();
    if n < cfg.compress_ratios.len().min(cfg.num_hidden_layers) {
        layer_ops(cfg, n, "x", &mut ops);
    }
    ops
}

fn layer_ops(cfg: &ModelConfig, n: usize, x_prev: &str, ops: &mut Vec<Op>) {
    let l = Some(n);
    let id = |s: &str| format!("L{n}.{s}");
    let w = |s: &str| format!("layers.{n}.{s}");
    let ratio = cfg.ratio(n);

    let hc_pre = |side: &str, input: String, ops: &mut Vec<Op>| {
        let mut o = op(
            id(&format!("{side}.hc_pre")),
            OpKind::HcPre,
            OpClass::Mix,
            l,
            vec![input],
            vec![
                w(&format!("hc_{side}_fn")),
                w(&format!("hc_{side}_base")),
                w(&format!("hc_{side}_scale")),
            ],
        );
        o.outputs.push(format!("{}.post", o.id));
        o.outputs.push(format!("{}.comb", o.id));
        ops.push(o);
    };

    // Attention side.
    hc_pre("attn", x_prev.to_string(), ops);
    ops.push(op(
        id("attn.norm"),
        OpKind::RmsNorm,
        OpClass::Norm,
        l,
        vec![id("attn.hc_pre")],
        vec![w("attn_norm.weight")],
    ));
    ops.push(op(
        id("attn.q_a"),
        OpKind::Linear,
        OpClass::Linear,
        l,
        vec![id("attn.norm")],
        vec![w("attn.wq_a")],
    ));
    ops.push(op(
        id("attn.kv"),
        OpKind::Linear,
        OpClass::Linear,
        l,
        vec![id("attn.norm")],
        vec![w("attn.wkv")],
    ));
    ops.push(op(
        id("attn.q_norm"),
        OpKind::RmsNorm,
        OpClass::Norm,
        l,
        vec![id("attn.q_a")],
        vec![w("attn.q_norm.weight")],
    ));
    ops.push(op(
        id("attn.kv_norm"),
        OpKind::RmsNorm,
        OpClass::Norm,
        l,
        vec![id("attn.kv")],
        vec![w("attn.kv_norm.weight")],
    ));
    ops.push(op(
        id("attn.q_b"),
        OpKind::Linear,
        OpClass::Linear,
        l,
        vec![id("attn.q_norm")],
        vec![w("attn.wq_b")],
    ));
    ops.push(op(
        id("attn.q_rope"),
        OpKind::QRope,
        OpClass::Rope,
        l,
        vec![id("attn.q_b")],
        vec![],
    ));
    ops.push(op(
        id("attn.kv_rope"),
        OpKind::KvRope,
        OpClass::Rope,
        l,
        vec![id("attn.kv_norm")],
        vec![],
    ));
    let mut core_inputs = vec![id("attn.q_rope"), id("attn.kv_rope")];
    if ratio > 0 {
        ops.push(op(
            id("attn.compressor"),
            OpKind::Compressor,
            OpClass::Compressor,
            l,
            vec![id("attn.norm")],
            vec![
                w("attn.compressor.wkv"),
                w("attn.compressor.wgate"),
                w("attn.compressor.ape"),
                w("attn.compressor.norm.weight"),
            ],
        ));
        core_inputs.push(id("attn.compressor"));
    }
    if ratio == 4 {
        ops.push(op(
            id("attn.indexer"),
            OpKind::Indexer,
            OpClass::Indexer,
            l,
            vec![id("attn.norm"), id("attn.q_norm")],
            vec![
                w("attn.indexer.wq_b"),
                w("attn.indexer.weights_proj"),
                w("attn.indexer.compressor.wkv"),
                w("attn.indexer.compressor.wgate"),
                w("attn.indexer.compressor.ape"),
                w("attn.indexer.compressor.norm.weight"),
            ],
        ));
        core_inputs.push(id("attn.indexer"));
    }
    ops.push(op(
        id("attn.core"),
        OpKind::Attention,
        OpClass::Attention,
        l,
        core_inputs,
        vec![w("attn.attn_sink")],
    ));
    ops.push(op(
        id("attn.wo_a"),
        OpKind::GroupedLinear,
        OpClass::Linear,
        l,
        vec![id("attn.core")],
        vec![w("attn.wo_a")],
    ));
    ops.push(op(
        id("attn.wo_b"),
        OpKind::Linear,
        OpClass::Linear,
        l,
        vec![id("attn.wo_a")],
        vec![w("attn.wo_b")],
    ));
    ops.push(op(
        id("attn.hc_post"),
        OpKind::HcPost,
        OpClass::Mix,
        l,
        vec![
            id("attn.wo_b"),
            x_prev.to_string(),
            id("attn.hc_pre.post"),
            id("attn.hc_pre.comb"),
        ],
        vec![],
    ));

    // FFN side.
    hc_pre("ffn", id("attn.hc_post"), ops);
    ops.push(op(
        id("ffn.norm"),
        OpKind::RmsNorm,
        OpClass::Norm,
        l,
        vec![id("ffn.hc_pre")],
        vec![w("ffn_norm.weight")],
    ));
    let sel = if cfg.is_hash_layer(n) {
        w("ffn.gate.tid2eid")
    } else {
        w("ffn.gate.bias")
    };
    let mut router = op(
        id("ffn.router"),
        OpKind::Router,
        OpClass::Router,
        l,
        vec![id("ffn.norm")],
        vec![w("ffn.gate"), sel],
    );
    router.outputs.push(id("ffn.router.idx"));
    ops.push(router);
    let mut experts = Vec::with_capacity(3 * cfg.n_routed_experts);
    for e in 0..cfg.n_routed_experts {
        for p in ["w1", "w3", "w2"] {
            experts.push(w(&format!("ffn.experts.{e}.{p}")));
        }
    }
    ops.push(op(
        id("ffn.experts"),
        OpKind::Experts,
        OpClass::Moe,
        l,
        vec![id("ffn.norm"), id("ffn.router"), id("ffn.router.idx")],
        experts,
    ));
    ops.push(op(
        id("ffn.shared"),
        OpKind::SharedExpert,
        OpClass::Moe,
        l,
        vec![id("ffn.norm")],
        vec![
            w("ffn.shared_experts.w1"),
            w("ffn.shared_experts.w3"),
            w("ffn.shared_experts.w2"),
        ],
    ));
    ops.push(op(
        id("ffn.out"),
        OpKind::Sum,
        OpClass::Elementwise,
        l,
        vec![id("ffn.experts"), id("ffn.shared")],
        vec![],
    ));
    ops.push(op(
        id("out"),
        OpKind::HcPost,
        OpClass::Mix,
        l,
        vec![
            id("ffn.out"),
            id("attn.hc_post"),
            id("ffn.hc_pre.post"),
            id("ffn.hc_pre.comb"),
        ],
        vec![],
    ));
}

/// The weights `op` reads whole from the checkpoint: all of them but the embedding's, of which a
/// run reads only the prompt's rows (`Checkpoint::embedding_rows`). What the backends' readers
/// read ahead of the runner.
pub fn whole_weights(op: &Op) -> &[String] {
    if op.kind == OpKind::Embed {
        &[]
    } else {
        &op.weights
    }
}

/// Whether at `t` tokens `op` reads no weight at all: an indexer that selects every compressed
/// row without scoring, a compressor with nothing to compress.
pub fn reads_nothing(cfg: &ModelConfig, op: &Op, t: usize) -> bool {
    indexer_reads_nothing(cfg, op, t) || compressor_reads_nothing(cfg, op, t)
}

/// An indexer whose every causal compressed row fits its top-k budget selects them all without
/// scoring (`model::attn::indexer`), so it reads none of its weights.
pub fn indexer_reads_nothing(cfg: &ModelConfig, op: &Op, t: usize) -> bool {
    op.kind == OpKind::Indexer
        && op.layer.is_some_and(|l| {
            let ratio = cfg.ratio(l);
            ratio > 0 && (cfg.index_topk == 0 || t / ratio <= cfg.index_topk)
        })
}

/// A compressor whose ratio exceeds the prompt's length compresses no row and reads no weight.
pub fn compressor_reads_nothing(cfg: &ModelConfig, op: &Op, t: usize) -> bool {
    op.kind == OpKind::Compressor
        && op.layer.is_some_and(|l| {
            let ratio = cfg.ratio(l);
            ratio > 0 && t / ratio == 0
        })
}

/// The experts op that consumes the expert ids (output 1) of the router at `step`.
pub fn experts_fed_by(ops: &[Op], step: usize) -> Option<usize> {
    let idx_id = ops[step].outputs.get(1)?;
    (step + 1..ops.len())
        .find(|&i| ops[i].kind == OpKind::Experts && ops[i].inputs.iter().any(|x| x == idx_id))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ModelConfig {
        ModelConfig::from_json(&serde_json::json!({
            "hidden_size": 256, "num_hidden_layers": 5, "vocab_size": 512,
            "num_attention_heads": 4, "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 128,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
            "num_hash_layers": 1, "compress_ratios": [0, 128, 4, 128, 4], "index_topk": 8
        }))
        .unwrap()
    }

    #[test]
    fn ids_are_unique_and_topologically_ordered() {
        let ops = build_graph(&cfg(), 4, true);
        let mut seen = std::collections::HashSet::new();
        for o in &ops {
            assert_eq!(o.outputs[0], o.id);
            for i in &o.inputs {
                assert!(
                    seen.contains(i),
                    "{} consumes {i} before it is produced",
                    o.id
                );
            }
            for out in &o.outputs {
                assert!(seen.insert(out.clone()), "duplicate id {out}");
            }
        }
        assert_eq!(ops.last().unwrap().id, "head");
    }

    #[test]
    fn schedule_follows_compress_ratios() {
        let ops = build_graph(&cfg(), 4, false);
        let has = |s: &str| ops.iter().any(|o| o.id == s);
        assert!(!has("L0.attn.compressor") && !has("L0.attn.indexer"));
        assert!(has("L1.attn.compressor") && !has("L1.attn.indexer"));
        assert!(has("L2.attn.compressor") && has("L2.attn.indexer"));
        assert!(!has("hc_head") && !has("head"));
        let r0 = ops.iter().find(|o| o.id == "L0.ffn.router").unwrap();
        assert_eq!(r0.weights[1], "layers.0.ffn.gate.tid2eid");
        let r1 = ops.iter().find(|o| o.id == "L1.ffn.router").unwrap();
        assert_eq!(r1.weights[1], "layers.1.ffn.gate.bias");
        assert_eq!(r1.outputs, vec!["L1.ffn.router", "L1.ffn.router.idx"]);
        let ex = ops.iter().find(|o| o.id == "L3.ffn.experts").unwrap();
        assert_eq!(ex.weights.len(), 24);
        assert_eq!(ex.weights[5], "layers.3.ffn.experts.1.w2");
    }

    #[test]
    fn last_layer_limits_the_graph() {
        let ops = build_graph(&cfg(), 1, false);
        assert_eq!(ops.last().unwrap().id, "L1.out");
        assert!(!ops.iter().any(|o| o.layer == Some(2)));
    }

    #[test]
    fn csa_layer_ids_in_order() {
        let ops = build_graph(&cfg(), 2, false);
        let ids: Vec<String> = ops
            .iter()
            .filter(|o| o.layer == Some(2))
            .flat_map(|o| o.outputs.clone())
            .collect();
        let want: Vec<String> = [
            "attn.hc_pre",
            "attn.hc_pre.post",
            "attn.hc_pre.comb",
            "attn.norm",
            "attn.q_a",
            "attn.kv",
            "attn.q_norm",
            "attn.kv_norm",
            "attn.q_b",
            "attn.q_rope",
            "attn.kv_rope",
            "attn.compressor",
            "attn.indexer",
            "attn.core",
            "attn.wo_a",
            "attn.wo_b",
            "attn.hc_post",
            "ffn.hc_pre",
            "ffn.hc_pre.post",
            "ffn.hc_pre.comb",
            "ffn.norm",
            "ffn.router",
            "ffn.router.idx",
            "ffn.experts",
            "ffn.shared",
            "ffn.out",
            "out",
        ]
        .iter()
        .map(|s| format!("L2.{s}"))
        .collect();
        assert_eq!(ids, want);
        let first: Vec<&str> = ops.iter().take(2).map(|o| o.id.as_str()).collect();
        assert_eq!(first, ["embed", "hc_expand"]);
        let core = ops.iter().find(|o| o.id == "L2.attn.core").unwrap();
        assert_eq!(
            core.inputs,
            [
                "L2.attn.q_rope",
                "L2.attn.kv_rope",
                "L2.attn.compressor",
                "L2.attn.indexer"
            ]
        );
        let post = ops.iter().find(|o| o.id == "L2.out").unwrap();
        assert_eq!(
            post.inputs,
            [
                "L2.ffn.out",
                "L2.attn.hc_post",
                "L2.ffn.hc_pre.post",
                "L2.ffn.hc_pre.comb"
            ]
        );
        let hp = ops.iter().find(|o| o.id == "L2.attn.hc_pre").unwrap();
        assert_eq!(hp.inputs, ["L1.out"]);
    }
}
