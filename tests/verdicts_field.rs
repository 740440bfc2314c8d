//! Issue 43's planted faults on the producer-made checkpoints of every family
//! (tests/data/hf-families/*/{ct-nvfp4,modelopt-nvfp4}: compressed-tensors 0.20 and ModelOpt 0.47
//! quantizing transformers-made tiny Qwen3-MoE, DeepSeek-V3 and gpt-oss; see that folder's
//! README), each fault made by editing one stored value of a copy:
//! - one expert's inverted activation scale (gate and up) → exit 1, the expert named;
//! - a zeroed MoE (every expert's input scale inverted by the loader) → error [harmful];
//! - a NaN in a router bias (or, for Qwen3, which has none, a norm weight) → exit 1 naming it;
//! - `rms_norm_eps` 1e308 → `config.degenerate` naming the field, no weight blamed;
//! - the clean checkpoints stay exit 0 with no finding.

#[path = "verdict_support/mod.rs"]
mod verdict_support;

use std::path::{Path, PathBuf};

use verdict_support::{cli, f32_of, rewrite, set_f32};

/// (family folder, producer folder, the activation-scale leaf of that producer)
const CHECKPOINTS: [(&str, &str, &str); 5] = [
    ("qwen3_moe", "ct-nvfp4", "input_global_scale"),
    ("qwen3_moe", "modelopt-nvfp4", "input_scale"),
    ("deepseek_v3", "ct-nvfp4", "input_global_scale"),
    ("deepseek_v3", "modelopt-nvfp4", "input_scale"),
    ("gpt_oss", "ct-nvfp4", "input_global_scale"),
];

fn dir(family: &str, kind: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/hf-families")
        .join(family)
        .join(kind)
}

/// `model.layers.1.mlp.experts.3.` (gpt-oss's compressed-tensors linears sit one level deeper).
fn expert_prefix(family: &str, e: usize) -> String {
    match family {
        "gpt_oss" => format!("model.layers.1.mlp.experts.experts.{e}."),
        _ => format!("model.layers.1.mlp.experts.{e}."),
    }
}

fn run(model: &Path, extra: &[&str]) -> (i32, String) {
    let mut args = vec!["run", "--quiet", "--backend", "cpu"];
    args.extend(extra);
    cli(&args, model)
}

#[test]
fn clean_producer_checkpoints_stay_clean() {
    for (family, kind, _) in CHECKPOINTS {
        let (code, out) = run(&dir(family, kind), &[]);
        assert_eq!(code, 0, "{family}/{kind}:\n{out}");
        assert!(out.contains("findings: none"), "{family}/{kind}:\n{out}");
    }
}

/// One expert of L1 calibrated with its activation scale inverted (the reciprocal stored, gate
/// and up): the whole op averages it with the healthy experts; the per-expert measurement names
/// it, and the run exits 1.
#[test]
fn one_experts_inverted_input_scale_is_named() {
    for (family, kind, leaf) in CHECKPOINTS {
        let e = 3;
        let pre = expert_prefix(family, e);
        let d = rewrite(&dir(family, kind), |n, s, b| {
            if n.starts_with(&pre)
                && (n.contains("gate_proj.") || n.contains("up_proj."))
                && n.ends_with(leaf)
            {
                let v = f32_of(b);
                set_f32(b, 1.0 / v);
            }
            Some(s.to_vec())
        });
        let tmp = tempfile::tempdir().unwrap();
        let json = tmp.path().join("run.json");
        let (code, out) = run(d.path(), &["--json", json.to_str().unwrap()]);
        assert_eq!(code, 1, "{family}/{kind}:\n{out}");
        assert!(
            out.contains(&format!("L1.ffn.experts expert {e} diverges")),
            "{family}/{kind}: the expert is not named:\n{out}"
        );
        // the run JSON: expert 3 divergent on its own rows, every other expert reached is not
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let op = v["ops"]
            .as_array()
            .unwrap()
            .iter()
            .find(|o| o["id"] == "L1.ffn.experts")
            .unwrap();
        for x in op["experts"].as_array().unwrap() {
            let ex = x["expert"].as_u64().unwrap() as usize;
            assert_eq!(
                x["divergent"].as_bool().unwrap(),
                ex == e,
                "{family}/{kind} expert {ex}: {x}"
            );
        }
        // the finding names the expert's weights
        let finding = v["summary"]["findings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["kind"] == "expert")
            .unwrap_or_else(|| panic!("{family}/{kind}: no expert finding"));
        let tensors = finding["tensors"].as_array().unwrap();
        assert!(
            !tensors.is_empty()
                && tensors
                    .iter()
                    .all(|t| t.as_str().unwrap().contains(&format!("experts.{e}."))),
            "{family}/{kind}: {finding}"
        );
    }
}

/// Every expert of L1 with its input scale read inverted (the loader fault): the MoE's served
/// output is zero, which is never harmless, whatever the residual stream does with it.
#[test]
fn a_zeroed_moe_is_harmful() {
    for (family, kind, _) in CHECKPOINTS {
        let (code, out) = run(
            &dir(family, kind),
            &["--loader-fault", "inverted-input-scale@L1.ffn.experts"],
        );
        assert_eq!(code, 1, "{family}/{kind}:\n{out}");
        let line = out
            .lines()
            .find(|l| l.contains("L1.ffn.experts diverges"))
            .unwrap_or_else(|| panic!("{family}/{kind}:\n{out}"));
        assert!(line.contains("error [harmful]"), "{family}/{kind}: {line}");
        assert!(!out.contains("[absorbed"), "{family}/{kind}:\n{out}");
    }
}

/// A NaN in one element of a router's bias (DeepSeek-V3's `e_score_correction_bias`, gpt-oss's
/// router bias) or, for Qwen3-MoE whose router has none, of a norm weight: the oracle reads the
/// same NaN, so nothing diverges; lint's `tensor.non-finite` names the tensor and the run exits 1.
#[test]
fn a_nan_in_a_plain_tensor_is_named() {
    for (family, kind, tensor) in [
        (
            "deepseek_v3",
            "modelopt-nvfp4",
            "model.layers.1.mlp.gate.e_score_correction_bias",
        ),
        (
            "deepseek_v3",
            "ct-nvfp4",
            "model.layers.1.mlp.gate.e_score_correction_bias",
        ),
        ("gpt_oss", "ct-nvfp4", "model.layers.1.mlp.router.bias"),
        (
            "qwen3_moe",
            "ct-nvfp4",
            "model.layers.1.self_attn.k_norm.weight",
        ),
    ] {
        let d = rewrite(&dir(family, kind), |n, s, b| {
            if n == tensor {
                // the second element: F32 or BF16 NaN
                if b.len() >= 8 && b.len() == s.iter().product::<usize>() * 4 {
                    b[4..8].copy_from_slice(&f32::NAN.to_le_bytes());
                } else {
                    b[2..4].copy_from_slice(&[0xc0, 0x7f]);
                }
            }
            Some(s.to_vec())
        });
        for cmd in ["run", "lint"] {
            let (code, out) = if cmd == "run" {
                run(d.path(), &[])
            } else {
                cli(&["lint"], d.path())
            };
            assert_eq!(code, 1, "{family}/{kind} {cmd}:\n{out}");
            assert!(
                out.contains("tensor.non-finite") && out.contains(tensor),
                "{family}/{kind} {cmd}:\n{out}"
            );
        }
    }
}

/// `rms_norm_eps: 1e308`: every norm outputs ≈ 0. A finding names the field and config.json;
/// no weight's scales are blamed for the zeros it causes.
#[test]
fn a_degenerate_norm_eps_is_named_not_blamed_on_weights() {
    for (family, kind, _) in CHECKPOINTS {
        let tmp = tempfile::tempdir().unwrap();
        for e in std::fs::read_dir(dir(family, kind)).unwrap() {
            let p = e.unwrap().path();
            std::fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
        }
        let cfg = tmp.path().join("config.json");
        let mut c: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
        c["rms_norm_eps"] = serde_json::json!(1e308);
        std::fs::write(&cfg, serde_json::to_string_pretty(&c).unwrap()).unwrap();
        let (code, out) = run(tmp.path(), &[]);
        assert_eq!(code, 1, "{family}/{kind}:\n{out}");
        assert!(
            out.contains("config.degenerate") && out.contains("rms_norm_eps"),
            "{family}/{kind}:\n{out}"
        );
        assert!(
            !out.contains("oracle anomaly") && !out.contains("re-export the weight's scales"),
            "{family}/{kind}: a weight is blamed:\n{out}"
        );
        let (code, out) = cli(&["lint"], tmp.path());
        assert_eq!(code, 1, "{family}/{kind} lint:\n{out}");
        assert!(out.contains("config.degenerate"), "{out}");
    }
}

/// The head's next-token metrics are in the run JSON: on a clean checkpoint the BF16 oracle agrees
/// with the FP32 one nearly everywhere; with a zeroed MoE the served path's top-1 agreement drops.
#[test]
fn head_kl_and_top_k_agreement_are_reported() {
    let d = dir("qwen3_moe", "ct-nvfp4");
    let get = |extra: &[&str]| -> serde_json::Value {
        let tmp = tempfile::tempdir().unwrap();
        let json = tmp.path().join("run.json");
        let mut a = vec!["--json", json.to_str().unwrap()];
        a.extend(extra);
        run(&d, &a);
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        v["ops"]
            .as_array()
            .unwrap()
            .iter()
            .find(|o| o["id"] == "head")
            .unwrap()
            .clone()
    };
    let clean = get(&[]);
    let noise = &clean["head_bf16_vs_fp32"];
    assert!(noise["top1"].as_f64().unwrap() >= 0.95, "{noise}");
    let n = clean["head_positions"].as_array().unwrap().len();
    assert_eq!(n, clean["shape"][0].as_u64().unwrap() as usize);
    let bad = get(&["--loader-fault", "inverted-input-scale@L1.ffn.experts"]);
    let (c, b) = (
        clean["head_served_vs_bf16"]["top1"].as_f64().unwrap(),
        bad["head_served_vs_bf16"]["top1"].as_f64().unwrap(),
    );
    assert!(b < c, "top-1 agreement {b} (faulty) vs {c} (clean)");
    assert!(
        bad["head_served_vs_bf16"]["kl"].as_f64().unwrap()
            > 2.0 * clean["head_served_vs_bf16"]["kl"].as_f64().unwrap()
    );
}

/// `gate` holds the model's output: a rule on the head's top-1 agreement passes a clean run against
/// itself and fails the zeroed MoE's run against the clean baseline; an agreement above 1 in a
/// run JSON is refused as impossible.
#[test]
fn gate_holds_the_heads_next_token_agreement() {
    let d = dir("qwen3_moe", "ct-nvfp4");
    let tmp = tempfile::tempdir().unwrap();
    let json = |name: &str, extra: &[&str]| -> PathBuf {
        let p = tmp.path().join(name);
        let mut a = vec!["--json", p.to_str().unwrap()];
        a.extend(extra);
        run(&d, &a);
        p
    };
    let base = json("base.json", &[]);
    let bad = json(
        "bad.json",
        &["--loader-fault", "inverted-input-scale@L1.ffn.experts"],
    );
    let rules = tmp.path().join("rules.toml");
    std::fs::write(
        &rules,
        "defaults = false\n[[rule]]\nops = \"head\"\nmetric = \"top1\"\nmax_drop = 0.05\n",
    )
    .unwrap();
    let gate = |cur: &Path| -> (i32, String) {
        let out = std::process::Command::new(assert_cmd::cargo::cargo_bin("nvfp4-probe"))
            .args(["gate", "--force", "--baseline"])
            .arg(&base)
            .arg("--current")
            .arg(cur)
            .arg("--tolerances")
            .arg(&rules)
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let (code, out) = gate(&base);
    assert_eq!(code, 0, "{out}");
    let (code, out) = gate(&bad);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("top1"), "{out}");
    // an impossible agreement is refused
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&base).unwrap()).unwrap();
    for op in v["ops"].as_array_mut().unwrap() {
        if op["id"] == "head" {
            op["head_served_vs_bf16"]["top1"] = serde_json::json!(1.5);
        }
    }
    let broken = tmp.path().join("broken.json");
    std::fs::write(&broken, serde_json::to_string(&v).unwrap()).unwrap();
    let (code, out) = gate(&broken);
    assert_eq!(code, 2, "{out}");
}
