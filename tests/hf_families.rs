//! The FP32 oracle of each model family beyond DeepSeek-V4 against Hugging Face transformers'
//! own implementation (float32, TF32 off), on the tiny checkpoints transformers made and traced
//! in tests/data/hf-families (save_pretrained layout, BF16 weights, 64 tokens). Every op the
//! trace maps to (`trace::family_names`) must agree to ≤ 1e-4 relative L2; the routers must
//! choose the same experts with the same weights (to 1e-5) for every token.

mod trace_support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use nvfp4_probe::checkpoint::Checkpoint;
use nvfp4_probe::probe::{run, RunOptions};
use nvfp4_probe::trace::family_names::map_hf;
use nvfp4_probe::Tensor;
use safetensors::SafeTensors;
use trace_support::{f32s, rel_l2};

fn data(family: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/hf-families")
        .join(family)
}

/// Runs every layer of the family's checkpoint on its tokens and checks each mapped op; returns
/// the ops checked with their rel-L2.
fn check(family: &str) -> Vec<(String, f64)> {
    let dir = data(family);
    let ckpt = Checkpoint::open(&dir).expect("open the checkpoint");
    let cfg = ckpt.model_config().unwrap().clone();
    assert!(cfg.family.is_some(), "{family} not detected as a family");
    let tokens: Vec<u32> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokens.json")).unwrap()).unwrap();
    let last = cfg.num_hidden_layers - 1;
    let opts = RunOptions {
        keep_outputs: true,
        ..RunOptions::new((0, last), tokens.clone())
    };
    let res = run(&ckpt, &opts).expect("run");
    let ours: HashMap<&str, &Tensor> = res.outputs["oracle_fp32"]
        .iter()
        .map(|(id, t)| (id.as_str(), t))
        .collect();
    let bytes = std::fs::read(dir.join("trace-fp32.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ids = f32s(&st.tensor("input_ids").unwrap());
    assert_eq!(
        ids,
        tokens.iter().map(|&t| t as f32).collect::<Vec<_>>(),
        "the trace was made from other tokens"
    );
    let mut checked = Vec::new();
    let mut failures = Vec::new();
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    for name in names {
        let Some(m) = map_hf(&name, &cfg) else {
            continue;
        };
        let theirs = f32s(&st.tensor(&name).unwrap());
        let mine = ours
            .get(m.op.as_str())
            .unwrap_or_else(|| panic!("op {} (from {name}) not produced by the runner", m.op));
        assert_eq!(mine.numel(), theirs.len(), "{name} → {}: size", m.op);
        if m.op.ends_with(".ffn.router") || m.op.ends_with(".ffn.router.idx") {
            continue; // checked as (expert, weight) pairs below
        }
        let e = rel_l2(&mine.data, &theirs);
        if e > 1e-4 {
            failures.push(format!("{name} → {}: rel-L2 {e:.3e} > 1e-4", m.op));
        }
        checked.push((m.op.clone(), e));
    }
    // routing: the same experts with the same weights for every token
    for n in 0..cfg.num_hidden_layers {
        // the router module is `mlp.gate` (Qwen3-MoE, DeepSeek-V3) or `mlp.router` (gpt-oss)
        let outs = || {
            ["gate", "router"]
                .into_iter()
                .flat_map(move |m| (0..3).map(move |i| format!("model.layers.{n}.mlp.{m}:{i}")))
        };
        let (Some(w_name), Some(i_name)) = (
            outs().find(|s| map_hf(s, &cfg).is_some_and(|m| m.op.ends_with(".ffn.router"))),
            outs().find(|s| map_hf(s, &cfg).is_some_and(|m| m.op.ends_with(".router.idx"))),
        ) else {
            continue;
        };
        let w = f32s(&st.tensor(&w_name).unwrap());
        let i = f32s(&st.tensor(&i_name).unwrap());
        let mw = ours[format!("L{n}.ffn.router").as_str()];
        let mi = ours[format!("L{n}.ffn.router.idx").as_str()];
        let k = mw.cols();
        let mut worst = 0f64;
        for r in 0..tokens.len() {
            let pairs = |idx: &[f32], wt: &[f32]| {
                let mut p: Vec<(i64, f32)> = (0..k)
                    .map(|j| (idx[r * k + j] as i64, wt[r * k + j]))
                    .collect();
                p.sort_by_key(|p| p.0);
                p
            };
            for (x, y) in pairs(&mi.data, &mw.data).iter().zip(&pairs(&i, &w)) {
                assert_eq!(x.0, y.0, "{family} L{n} token {r}: routed experts differ");
                let e = ((x.1 - y.1).abs() / y.1.abs().max(1e-30)) as f64;
                worst = worst.max(e);
                assert!(
                    (x.1 - y.1).abs() <= 1e-5 * y.1.abs().max(1.0),
                    "{family} L{n} token {r}: weight {} vs {}",
                    x.1,
                    y.1
                );
            }
        }
        checked.push((format!("L{n}.ffn.router"), worst));
    }
    let worst =
        checked.iter().cloned().fold(
            (0f64, String::new()),
            |a, (op, e)| if e > a.0 { (e, op) } else { a },
        );
    eprintln!(
        "{family}: {} ops agree; worst rel-L2 {:.2e} at {}",
        checked.len(),
        worst.0,
        worst.1
    );
    if std::env::var("HF_REF_VERBOSE").is_ok() {
        for (op, e) in &checked {
            eprintln!("  {op:24} {e:.2e}");
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    checked
}

#[test]
fn qwen3_moe_fp32_oracle_matches_transformers() {
    let checked = check("qwen3_moe");
    // every layer's 12 mapped ops (norms, q/k/v, q/k norms, core, o, experts, out, router), the
    // embedding, final norm and head
    assert!(
        checked.len() >= 3 * 12 + 3,
        "only {} ops compared",
        checked.len()
    );
    for want in [
        "L2.attn.q_norm",
        "L2.attn.core",
        "L2.ffn.experts",
        "L2.out",
        "head",
    ] {
        assert!(
            checked.iter().any(|(op, _)| op == want),
            "{want} not compared"
        );
    }
}

/// `compare --names hf` of transformers' BF16 trace (autocast, stored as F32) against our oracles:
/// no op diverges, and every traced op of every layer is compared.
fn compare_bf16_clean(family: &str, min_ops: usize) {
    use nvfp4_probe::cli::{CompareArgs, TokenArgs};
    use nvfp4_probe::commands::compare::compare;
    let dir = data(family);
    let r = compare(&CompareArgs {
        model: Some(dir.clone()),
        trace: dir.join("trace-bf16.safetensors"),
        names: "hf".into(),
        tokens: TokenArgs::default(),
        json: None,
        markdown: None,
        seed: 0,
        mem: Default::default(),
    })
    .expect("compare");
    let bad: Vec<String> = r
        .ops
        .iter()
        .filter(|o| o.diverges())
        .map(|o| format!("{} ({}): {}", o.op, o.trace_name, o.verdict))
        .collect();
    assert!(bad.is_empty(), "{family}: divergent ops: {bad:?}");
    assert_eq!(r.summary.first_divergent, None, "{:?}", r.summary);
    assert!(
        r.ops.len() >= min_ops,
        "{family}: only {} ops compared",
        r.ops.len()
    );
}

#[test]
fn qwen3_moe_bf16_trace_compares_clean() {
    compare_bf16_clean("qwen3_moe", 3 * 13 + 3);
}

#[test]
fn deepseek_v3_fp32_oracle_matches_transformers() {
    let checked = check("deepseek_v3");
    // layer 0 dense (9 mapped ops: norms, q_a, q_norm, q_b, kv_a, kv_norm, kv_b, core, o, mlp,
    // out), layers 1-2 MoE (14 with the router, experts, shared, ffn.out), embed, norm, head
    assert!(
        checked.len() >= 11 + 2 * 14 + 3,
        "only {} ops compared",
        checked.len()
    );
    for want in [
        "L0.ffn.mlp",
        "L2.attn.core",
        "L2.attn.kv_norm",
        "L2.ffn.shared",
        "L2.ffn.router",
        "L2.out",
        "head",
    ] {
        assert!(
            checked.iter().any(|(op, _)| op == want),
            "{want} not compared"
        );
    }
}

#[test]
fn deepseek_v3_bf16_trace_compares_clean() {
    compare_bf16_clean("deepseek_v3", 11 + 2 * 15 + 3);
}

#[test]
fn gpt_oss_fp32_oracle_matches_transformers() {
    let checked = check("gpt_oss");
    // every layer's 11 mapped ops (norms, q/k/v, core, o, router, experts, out, and the routing
    // pairs), the embedding, final norm and head
    assert!(
        checked.len() >= 4 * 10 + 3,
        "only {} ops compared",
        checked.len()
    );
    // sliding layers (0, 2) and full ones (1, 3); layer 1's experts pass the GLU clamp
    for want in [
        "L0.attn.core",
        "L1.attn.core",
        "L2.attn.core",
        "L1.ffn.experts",
        "L3.ffn.router",
        "L3.out",
        "head",
    ] {
        assert!(
            checked.iter().any(|(op, _)| op == want),
            "{want} not compared"
        );
    }
}

#[test]
fn gpt_oss_bf16_trace_compares_clean() {
    compare_bf16_clean("gpt_oss", 4 * 10 + 3);
}

/// A family config outside its limits is refused up front, naming config.json and the field,
/// exit 2 from the command.
#[test]
fn a_bad_family_config_is_refused_naming_the_file_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let src = data("qwen3_moe");
    for f in ["model.safetensors", "tokens.json"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg["num_key_value_heads"] = serde_json::json!(3);
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let out = assert_cmd::Command::cargo_bin("nvfp4-probe")
        .unwrap()
        .args(["run", "--backend", "cpu", "--model"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("config.json") && err.contains("`num_key_value_heads` 3"),
        "{err}"
    );
}
