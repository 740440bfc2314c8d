//! Issue 43, items 4 and 5, on the producers' own checkpoints (tests/data/hf-families: the tiny
//! Qwen3-MoE quantized by compressed-tensors 0.20, DeepSeek-V3 by ModelOpt 0.47) with one stored
//! tensor scale edited:
//! - lint's fused groups of three (Qwen3's q/k/v): the member whose scale disagrees with the two
//!   others is the one named, with its own consumer's absorption (v_proj has no norm after it);
//!   when all three differ, lint says it cannot tell;
//! - `run`/`bisect --reference DIR`: the weights the run reads against the original, so a wrong
//!   stored scale that the oracle shares (nothing diverges) is an error naming the scale tensor
//!   and the factor; a clean checkpoint against its original exits 0; the original is read only.

use std::path::{Path, PathBuf};

use nvfp4_probe::lint::{lint_dir, Finding, Rules, Severity};
use serde_json::Value;
use tempfile::TempDir;

#[path = "verdict_support/mod.rs"]
mod verdict_support;
use verdict_support::{cli, f32_of, rewrite, set_f32};

fn family(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/hf-families")
        .join(name)
}

fn qwen_ct() -> PathBuf {
    family("qwen3_moe/ct-nvfp4")
}

const ATTN: &str = "model.layers.1.self_attn";

/// A copy of `src` with the named F32 scalars multiplied by their factors.
fn scaled(src: &Path, edits: &[(&str, f32)]) -> TempDir {
    let edits: Vec<(String, f32)> = edits.iter().map(|(n, f)| (n.to_string(), *f)).collect();
    let d = rewrite(src, |n, shape, b| {
        if let Some((_, f)) = edits.iter().find(|(e, _)| e == n) {
            let v = f32_of(b);
            set_f32(b, v * f);
        }
        Some(shape.to_vec())
    });
    // every edit landed on a stored tensor
    for (n, _) in &edits {
        assert!(
            nvfp4_probe::checkpoint::Checkpoint::open(d.path())
                .unwrap()
                .info(n)
                .is_some(),
            "{n}"
        );
    }
    d
}

fn fused(d: &Path) -> Vec<Finding> {
    let r = lint_dir(d, None, &Rules::default()).unwrap();
    r.findings
        .into_iter()
        .filter(|f| f.rule == "fused.mismatch")
        .collect()
}

fn show(f: &[Finding]) -> String {
    f.iter()
        .map(|f| format!("{:?} {} {} {}", f.severity, f.rule, f.tensor, f.evidence))
        .collect::<Vec<_>>()
        .join("\n")
}

/// v_proj's weight_global_scale ×2 (q and k keep the group's shared value): lint names v_proj,
/// an error (no norm reads v_proj's output), and nothing about k_proj or q_proj.
#[test]
fn the_odd_member_of_qkv_is_named_v_proj() {
    let v = format!("{ATTN}.v_proj.weight_global_scale");
    let d = scaled(&qwen_ct(), &[(&v, 2.0)]);
    let f = fused(d.path());
    assert_eq!(f.len(), 1, "{}", show(&f));
    let f = &f[0];
    assert_eq!(f.tensor, v);
    assert_eq!(f.op.as_deref(), Some("L1.attn.v"));
    assert_eq!(f.severity, Severity::Error, "{}", f.evidence);
    assert_eq!(f.absorbed_by, None);
    assert!(
        f.evidence.contains("`v_proj` is the odd one out (ratio 2)"),
        "{}",
        f.evidence
    );
    // CT's g is the encode multiplier: ×2 stored decodes ×0.5
    assert!(f.evidence.contains("decodes ×0.5"), "{}", f.evidence);
    assert!(
        f.evidence
            .contains("not absorbed: no norm reads `v_proj`'s output"),
        "{}",
        f.evidence
    );
    assert!(!f.evidence.contains("k_norm"), "{}", f.evidence);
    let r = lint_dir(d.path(), None, &Rules::default()).unwrap();
    assert!(
        r.findings
            .iter()
            .all(|f| !f.tensor.contains("k_proj") && !f.tensor.contains("q_proj")),
        "{}",
        show(&r.findings)
    );
    assert_eq!(r.exit_code(), 1);
}

/// The odd member is k_proj (×0.5: it decodes ×2, and the engine's max is the group's, which
/// reads k_proj right): k_norm absorbs it, so a warning naming k_proj, absorbed by L1.attn.k_norm.
#[test]
fn an_odd_member_with_a_norm_after_it_is_absorbed_there() {
    let k = format!("{ATTN}.k_proj.weight_global_scale");
    let d = scaled(&qwen_ct(), &[(&k, 0.5)]);
    let f = fused(d.path());
    assert_eq!(f.len(), 1, "{}", show(&f));
    assert_eq!(f[0].tensor, k);
    assert_eq!(f[0].severity, Severity::Warning, "{}", f[0].evidence);
    assert_eq!(f[0].absorbed_by.as_deref(), Some("L1.attn.k_norm"));
    assert!(f[0].evidence.contains("decodes ×2"), "{}", f[0].evidence);
    // k_proj ×2 instead: the engine keeps k's (the max), and v_proj then decodes ×0.5 there,
    // which no norm absorbs: an error
    let d = scaled(&qwen_ct(), &[(&k, 2.0)]);
    let f = fused(d.path());
    assert_eq!(f.len(), 1, "{}", show(&f));
    assert_eq!(f[0].tensor, k);
    assert_eq!(f[0].severity, Severity::Error, "{}", f[0].evidence);
    assert_eq!(f[0].absorbed_by, None);
}

/// q ×2 and v ×4: no two members agree, so lint says it cannot tell which one is wrong.
#[test]
fn a_group_without_a_majority_cannot_tell() {
    let d = scaled(
        &qwen_ct(),
        &[
            (&format!("{ATTN}.q_proj.weight_global_scale"), 2.0),
            (&format!("{ATTN}.v_proj.weight_global_scale"), 4.0),
        ],
    );
    let f = fused(d.path());
    assert_eq!(f.len(), 1, "{}", show(&f));
    assert!(f[0].evidence.contains("all differ"), "{}", f[0].evidence);
    assert!(
        f[0].evidence
            .contains("lint cannot tell which member is wrong"),
        "{}",
        f[0].evidence
    );
    assert_eq!(f[0].severity, Severity::Error);
    assert_eq!(f[0].absorbed_by, None);
}

/// The clean producer checkpoint's q/k/v share one scale: no fused finding.
#[test]
fn the_producers_groups_agree() {
    assert!(fused(&qwen_ct()).is_empty());
}

/// `--json` of a command: (exit code, text, the findings of its JSON).
fn json_findings(args: &[&str], model: &Path, reference: Option<&Path>) -> (i32, String, Value) {
    let tmp = TempDir::new().unwrap();
    let json = tmp.path().join("out.json");
    let mut a: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    a.extend(["--backend", "cpu", "--json"].map(String::from));
    a.push(json.display().to_string());
    if let Some(r) = reference {
        a.push("--reference".into());
        a.push(r.display().to_string());
    }
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let (code, out) = cli(&a, model);
    let v: Value = match std::fs::read_to_string(&json) {
        Ok(t) => serde_json::from_str(&t).unwrap(),
        Err(_) => Value::Null,
    };
    let f = if a[0] == "run" {
        v["summary"]["findings"].clone()
    } else {
        v["findings"].clone()
    };
    (code, out, f)
}

fn reference_errors(f: &Value) -> Vec<&Value> {
    f.as_array()
        .map(|a| {
            a.iter()
                .filter(|f| {
                    f["kind"]
                        .as_str()
                        .is_some_and(|k| k.starts_with("reference."))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// `run --reference` and `bisect --reference` on the planted Qwen3-MoE CT checkpoint: exit 1, one
/// reference finding naming v_proj's weight_global_scale and the factor ×0.5 (with the BF16
/// original and with the clean producer checkpoint as the reference); the clean checkpoint
/// against the original exits 0 with no reference finding.
#[test]
fn run_and_bisect_with_reference_name_v_proj_and_the_factor() {
    let v = format!("{ATTN}.v_proj.weight_global_scale");
    let d = scaled(&qwen_ct(), &[(&v, 2.0)]);
    let bf16 = family("qwen3_moe");
    for (cmd, reference) in [
        (&["run", "--quiet"][..], bf16.clone()),
        (&["run", "--quiet"][..], qwen_ct()),
        (&["bisect", "--search", "linear"][..], bf16.clone()),
    ] {
        let (code, out, f) = json_findings(cmd, d.path(), Some(&reference));
        assert_eq!(code, 1, "{cmd:?} {}:\n{out}", reference.display());
        let refs = reference_errors(&f);
        assert_eq!(refs.len(), 1, "{cmd:?}: {f:#}");
        let r = refs[0];
        assert_eq!(r["kind"], "reference.global-scale");
        assert_eq!(r["level"], "error");
        assert_eq!(r["tensors"][0], v.as_str());
        assert_eq!(r["parameter"], "weight_global_scale");
        assert_eq!(r["ops"], serde_json::json!(["L1.attn.v"]));
        let summary = r["summary"].as_str().unwrap();
        assert!(summary.contains("×0.5"), "{summary}");
        assert!(out.contains(&format!("reference: `{v}`")), "{out}");
        // the fused group's lint names v_proj too, never k_proj (k_proj's own divergence under
        // the engine's max rule, absorbed by its k_norm, is the engine's doing, not a blame)
        assert!(
            !out.contains("lint fused.mismatch: `model.layers.1.self_attn.k_proj"),
            "{out}"
        );
    }
    for cmd in [
        &["run", "--quiet"][..],
        &["bisect", "--search", "linear"][..],
    ] {
        let (code, out, f) = json_findings(cmd, &qwen_ct(), Some(&bf16));
        assert_eq!(code, 0, "{cmd:?}:\n{out}");
        assert!(reference_errors(&f).is_empty(), "{f:#}");
    }
}

/// DeepSeek-V3 as ModelOpt quantizes it (MLP only), expert 3's down_proj weight_scale_2 ×2 on
/// layer 1: the oracle decodes the same scale and the expert has no fused partner, so plain `run`
/// finds nothing (exit 0); with `--reference` the original shows it: exit 1, the tensor named,
/// factor ×2 (ModelOpt's d is the decode multiplier). The clean checkpoint exits 0.
#[test]
fn deepseek_v3_modelopt_run_with_reference() {
    let t = "model.layers.1.mlp.experts.3.down_proj.weight_scale_2";
    let d = scaled(&family("deepseek_v3/modelopt-nvfp4"), &[(t, 2.0)]);
    let bf16 = family("deepseek_v3");
    let (code, out, _) = json_findings(&["run", "--quiet"], d.path(), None);
    assert_eq!(code, 0, "{out}");
    let (code, out, f) = json_findings(&["run", "--quiet"], d.path(), Some(&bf16));
    assert_eq!(code, 1, "{out}");
    let refs = reference_errors(&f);
    assert_eq!(refs.len(), 1, "{f:#}");
    assert_eq!(refs[0]["tensors"][0], t);
    assert_eq!(refs[0]["parameter"], "weight_scale_2");
    assert_eq!(refs[0]["ops"], serde_json::json!(["L1.ffn.experts"]));
    assert!(
        refs[0]["summary"].as_str().unwrap().contains("×2 "),
        "{}",
        refs[0]["summary"]
    );
    let (code, out, f) = json_findings(
        &["run", "--quiet"],
        &family("deepseek_v3/modelopt-nvfp4"),
        Some(&bf16),
    );
    assert_eq!(code, 0, "{out}");
    assert!(reference_errors(&f).is_empty(), "{f:#}");
    // two experts of one op with the same fault: one finding naming both scales
    let t5 = "model.layers.1.mlp.experts.5.down_proj.weight_scale_2";
    let d = scaled(
        &family("deepseek_v3/modelopt-nvfp4"),
        &[(t, 2.0), (t5, 2.0)],
    );
    let (code, out, f) = json_findings(&["run", "--quiet"], d.path(), Some(&bf16));
    assert_eq!(code, 1, "{out}");
    let refs = reference_errors(&f);
    assert_eq!(refs.len(), 1, "{f:#}");
    let tensors = refs[0]["tensors"].as_array().unwrap();
    assert!(
        tensors.iter().any(|x| x == t) && tensors.iter().any(|x| x == t5),
        "{f:#}"
    );
    assert!(
        refs[0]["summary"]
            .as_str()
            .unwrap()
            .starts_with("2 weights"),
        "{}",
        refs[0]["summary"]
    );
}

/// The reference is only read: an output inside it is refused (exit 2) before anything runs,
/// and its files are unchanged; an unusable reference is exit 2 naming it.
#[test]
fn the_reference_is_never_written() {
    let r = TempDir::new().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(family("qwen3_moe").join(f), r.path().join(f)).unwrap();
    }
    let before: Vec<(String, Vec<u8>)> = ["config.json", "model.safetensors"]
        .iter()
        .map(|f| (f.to_string(), std::fs::read(r.path().join(f)).unwrap()))
        .collect();
    for cmd in ["run", "bisect"] {
        let inside = r.path().join("out.json");
        let (code, out) = cli(
            &[
                cmd,
                "--backend",
                "cpu",
                "--reference",
                r.path().to_str().unwrap(),
                "--json",
                inside.to_str().unwrap(),
            ],
            &qwen_ct(),
        );
        assert_eq!(code, 2, "{cmd}:\n{out}");
        assert!(!inside.exists(), "{cmd}");
        let missing = r.path().join("absent");
        let (code, out) = cli(
            &[
                cmd,
                "--backend",
                "cpu",
                "--reference",
                missing.to_str().unwrap(),
            ],
            &qwen_ct(),
        );
        assert_eq!(code, 2, "{cmd}:\n{out}");
        assert!(out.contains("absent"), "{cmd}:\n{out}");
    }
    let names: Vec<String> = std::fs::read_dir(r.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    for (f, b) in before {
        assert_eq!(std::fs::read(r.path().join(&f)).unwrap(), b, "{f}");
    }
}

/// DeepSeek-V4 (the synthetic tiny model, compressed-tensors NVFP4), layer 1's `wo_b`
/// weight_global_scale ×2: no fused partner and the oracle shares it, so `run` alone exits 0;
/// against the BF16 synth of the same seed `run --reference` exits 1 naming the scale and ×0.5.
/// The built-in model (no `--model`) against that BF16 original is clean.
#[test]
fn deepseek_v4_synth_run_with_reference() {
    use nvfp4_probe::synth::Format;
    let t = "layers.1.attn.wo_b.weight_global_scale";
    let ct = verdict_support::synth(Format::CtNvfp4, 0, &[]);
    let d = scaled(ct.path(), &[(t, 2.0)]);
    let bf16 = verdict_support::synth(Format::Bf16, 0, &[]);
    let args = ["run", "--quiet", "--layers", "1", "--seq-len", "8"];
    let (code, out, _) = json_findings(&args, d.path(), None);
    assert_eq!(code, 0, "{out}");
    let (code, out, f) = json_findings(&args, d.path(), Some(bf16.path()));
    assert_eq!(code, 1, "{out}");
    let refs = reference_errors(&f);
    assert_eq!(refs.len(), 1, "{f:#}");
    assert_eq!(refs[0]["tensors"][0], t);
    assert_eq!(refs[0]["parameter"], "weight_global_scale");
    assert_eq!(refs[0]["ops"], serde_json::json!(["L1.attn.wo_b"]));
    assert!(
        refs[0]["summary"].as_str().unwrap().contains("×0.5 "),
        "{}",
        refs[0]["summary"]
    );
    // the built-in model is the official-mixed synth of seed 0
    let tmp = TempDir::new().unwrap();
    let json = tmp.path().join("run.json");
    let out = std::process::Command::new(assert_cmd::cargo::cargo_bin("nvfp4-probe"))
        .args(args)
        .args(["--backend", "cpu", "--reference"])
        .arg(bf16.path())
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(reference_errors(&v["summary"]["findings"]).is_empty());
}
