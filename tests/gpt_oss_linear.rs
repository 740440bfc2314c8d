//! gpt-oss's routed experts as llm-compressor stores them (`LinearExperts`: separate gate, up and
//! down linears with biases under `mlp.experts.experts.E`, gate and up de-interleaved from the
//! release's fused `gate_up_proj`). The same BF16 model written both ways (transformers' fused
//! layout, tests/data/hf-families/gpt_oss, and its linear experts made here) gives the same report
//! on every path bit for bit: the split op pairs the gate and up units the fused op reads
//! interleaved. On the compressed-tensors checkpoint llm-compressor's layout gives
//! (tests/data/hf-families/gpt_oss/ct-nvfp4), `lint` finds the planted checkpoint faults of this
//! layout: gate and up of one expert with different global scales (the engines fuse them under
//! one) and a left-out bias; and `bisect` attributes loader faults on the experts' NVFP4
//! parameters (nibble order, the weight global scale's convention, an unread input scale) to the
//! experts op and the parameter.

use std::path::{Path, PathBuf};

use assert_cmd::Command;
use serde_json::{json, Value};
use tempfile::TempDir;

#[path = "safetensors_support/mod.rs"]
mod safetensors_support;
use safetensors_support::{read_all, write_all};
#[path = "verdict_support/mod.rs"]
mod verdict_support;
use verdict_support::run_report;

fn bin() -> Command {
    Command::cargo_bin("nvfp4-probe").unwrap()
}

fn family_dir(kind: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf-families/gpt_oss");
    if kind.is_empty() {
        d
    } else {
        d.join(kind)
    }
}

/// 2-byte elements (BF16) of `bytes` picked by `idx`.
fn pick(bytes: &[u8], idx: impl Iterator<Item = usize>) -> Vec<u8> {
    idx.flat_map(|i| [bytes[2 * i], bytes[2 * i + 1]]).collect()
}

/// The BF16 model of tests/data/hf-families/gpt_oss with its experts as llm-compressor's linear
/// experts: `gate_up_proj` [E, H, 2I] (stored [in, out], gate column 2i, up 2i + 1) → per expert
/// `gate_proj.weight` / `up_proj.weight` [I, H]; `down_proj` [E, I, H] → `down_proj.weight` [H, I];
/// the biases split alike.
fn linearized() -> TempDir {
    let src = family_dir("");
    let d = TempDir::new().unwrap();
    std::fs::copy(src.join("config.json"), d.path().join("config.json")).unwrap();
    let mut out = Vec::new();
    let all = read_all(&src.join("model.safetensors"));
    let get = |name: &str| all.iter().find(|t| t.0 == name).unwrap();
    let bf = |s: Vec<usize>, b: Vec<u8>| ("BF16".to_string(), s, b);
    for (k, dt, shape, bytes) in &all {
        if let Some(p) = k.strip_suffix("mlp.experts.gate_up_proj") {
            assert_eq!(dt, "BF16");
            let (e, h, i2) = (shape[0], shape[1], shape[2]);
            let i = i2 / 2;
            let bias = &get(&format!("{k}_bias")).3;
            for x in 0..e {
                for (leaf, par) in [("gate_proj", 0), ("up_proj", 1)] {
                    let w = pick(
                        bytes,
                        (0..i).flat_map(|o| (0..h).map(move |c| (x * h + c) * i2 + 2 * o + par)),
                    );
                    let b = pick(bias, (0..i).map(|o| x * i2 + 2 * o + par));
                    let (d1, s1, w) = bf(vec![i, h], w);
                    out.push((
                        format!("{p}mlp.experts.experts.{x}.{leaf}.weight"),
                        d1,
                        s1,
                        w,
                    ));
                    let (d2, s2, b) = bf(vec![i], b);
                    out.push((format!("{p}mlp.experts.experts.{x}.{leaf}.bias"), d2, s2, b));
                }
            }
        } else if let Some(p) = k.strip_suffix("mlp.experts.down_proj") {
            let (e, i, h) = (shape[0], shape[1], shape[2]);
            let bias = &get(&format!("{k}_bias")).3;
            for x in 0..e {
                let w = pick(
                    bytes,
                    (0..h).flat_map(|o| (0..i).map(move |c| (x * i + c) * h + o)),
                );
                let b = pick(bias, (0..h).map(|o| x * h + o));
                out.push((
                    format!("{p}mlp.experts.experts.{x}.down_proj.weight"),
                    "BF16".into(),
                    vec![h, i],
                    w,
                ));
                out.push((
                    format!("{p}mlp.experts.experts.{x}.down_proj.bias"),
                    "BF16".into(),
                    vec![h],
                    b,
                ));
            }
        } else if !(k.ends_with("_bias") && k.contains(".mlp.experts.")) {
            out.push((k.clone(), dt.clone(), shape.clone(), bytes.clone()));
        }
    }
    write_all(&d.path().join("model.safetensors"), &out);
    d
}

#[test]
fn linear_experts_give_the_fused_layouts_report_bit_for_bit() {
    let lin = linearized();
    let fused = run_report(&family_dir(""));
    let split = run_report(lin.path());
    let (a, b) = (
        fused["ops"].as_array().unwrap(),
        split["ops"].as_array().unwrap(),
    );
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x["id"], y["id"]);
        if x["id"].as_str().unwrap().ends_with("ffn.experts") {
            assert_eq!(x["weights"].as_array().unwrap().len(), 16);
            assert_eq!(y["weights"].as_array().unwrap().len(), 24);
        }
        // every field but the weight list: statistics, comparisons, verdicts
        let (mut x, mut y) = (x.clone(), y.clone());
        x.as_object_mut().unwrap().remove("weights");
        y.as_object_mut().unwrap().remove("weights");
        assert!(x["stats"]["oracle_fp32"]["numel"].as_u64().unwrap() > 0);
        assert!(x.get("served_propagated_vs_fp32").is_some());
        assert_eq!(x, y, "{}", x["id"]);
    }
    assert_eq!(fused["summary"], split["summary"]);
}

/// `lint --json`: findings' rules, with the tensor they name.
fn lint_rules(model: &Path) -> Vec<(String, String)> {
    let t = TempDir::new().unwrap();
    let json = t.path().join("lint.json");
    bin()
        .args(["lint", "--model"])
        .arg(model)
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f["rule"].as_str().unwrap().to_string(), f.to_string()))
        .collect()
}

/// An edit of a tensor's bytes.
type Edit<'a> = &'a dyn Fn(&mut Vec<u8>);

/// The compressed-tensors checkpoint with tensor `name` edited by `edit` (or left out when None).
fn ct_with(name: &str, edit: Option<Edit<'_>>) -> TempDir {
    let src = family_dir("ct-nvfp4");
    let d = TempDir::new().unwrap();
    std::fs::copy(src.join("config.json"), d.path().join("config.json")).unwrap();
    let mut all = read_all(&src.join("model.safetensors"));
    assert!(all.iter().any(|t| t.0 == name), "{name}");
    match edit {
        Some(f) => all
            .iter_mut()
            .filter(|t| t.0 == name)
            .for_each(|t| f(&mut t.3)),
        None => all.retain(|t| t.0 != name),
    }
    write_all(&d.path().join("model.safetensors"), &all);
    d
}

#[test]
fn lint_finds_the_planted_faults_of_the_linear_layout() {
    let clean = lint_rules(&family_dir("ct-nvfp4"));
    assert!(
        clean.iter().all(|(r, _)| r != "fused.mismatch"),
        "{clean:?}"
    );
    let x = "model.layers.1.mlp.experts.experts.3";
    // gate and up of one expert under different global scales: the engines' fused w13 keeps one
    let d = ct_with(
        &format!("{x}.up_proj.weight_global_scale"),
        Some(&|b: &mut Vec<u8>| {
            let v = f32::from_le_bytes(b[..4].try_into().unwrap()) * 2.0;
            b[..4].copy_from_slice(&v.to_le_bytes());
        }),
    );
    let f = lint_rules(d.path());
    assert!(
        f.iter()
            .any(|(r, e)| r == "fused.mismatch" && e.contains("experts.3")),
        "{f:?}"
    );
    // a left-out bias: refused (exit 2) naming it
    let d = ct_with(&format!("{x}.down_proj.bias"), None);
    let o = bin()
        .args(["run", "--backend", "cpu", "--quiet", "--model"])
        .arg(d.path())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("layers.1.ffn.experts.3.w2.bias"), "{e}");
}

/// `bisect --backend cpu --json` on `model` with `args` (exit 1 expected: a finding): the report.
fn bisect_report(model: &Path, args: &[&str]) -> Value {
    let t = TempDir::new().unwrap();
    let json = t.path().join("bisect.json");
    let o = bin()
        .args(["bisect", "--backend", "cpu", "--model"])
        .arg(model)
        .args(args)
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(1),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap()
}

/// `bisect --loader-fault K@L1.ffn.experts` on the compressed-tensors checkpoint: the first
/// finding's ops, kind and summary.
fn bisect_first(fault: &str) -> (Vec<Value>, String, String) {
    let at = format!("{fault}@L1.ffn.experts");
    let v = bisect_report(&family_dir("ct-nvfp4"), &["--loader-fault", &at]);
    let f = &v["findings"][0];
    (
        f["ops"].as_array().unwrap().clone(),
        f["kind"].as_str().unwrap_or("").to_string(),
        f["summary"].as_str().unwrap_or("").to_string(),
    )
}

/// Loader faults on the linear experts' NVFP4 parameters are attributed by `bisect` to the
/// experts op of L1 and the parameter the fault touched, as on the other layouts.
#[test]
fn bisect_attributes_loader_faults_on_the_linear_experts() {
    for (fault, kind, names) in [
        ("nibble-swap", "nibble-swap", "gate_proj.weight_packed"),
        (
            "inverted-weight-scale",
            "weight-reciprocal",
            "gate_proj.weight_global_scale",
        ),
        (
            "missing-input-scale",
            "input-calibrated",
            "gate_proj.input_global_scale",
        ),
    ] {
        let (ops, k, summary) = bisect_first(fault);
        assert_eq!(ops, vec![json!("L1.ffn.experts")], "{fault}: {summary}");
        assert!(
            summary.contains(names) && summary.contains("gate_proj, up_proj, down_proj"),
            "{fault}: {summary}"
        );
        assert_eq!(k, kind, "{fault}: {summary}");
    }
}

/// `synth --family gpt-oss --format ct-nvfp4` writes llm-compressor's layout (the experts as
/// `mlp.experts.experts.E.{gate,up,down}_proj` with biases, no fused tensor; gate and up sharing
/// their global scale, the router ignored), which lints clean and runs; a fault planted in it
/// (the activation global scale inverted) is attributed by `bisect` to the experts op.
#[test]
fn synth_writes_llm_compressors_layout() {
    let t = TempDir::new().unwrap();
    let m = t.path().join("m");
    let o = bin()
        .args([
            "synth", "--family", "gpt-oss", "--format", "ct-nvfp4", "--out",
        ])
        .arg(&m)
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let ck = nvfp4_probe::checkpoint::Checkpoint::open(&m).unwrap();
    let names = ck.tensor_names();
    assert!(
        names.iter().all(|n| !n.contains("gate_up_proj")),
        "fused tensors written"
    );
    let x = "model.layers.1.mlp.experts.experts.3";
    for leaf in [
        "gate_proj.weight_packed",
        "up_proj.bias",
        "down_proj.input_global_scale",
    ] {
        assert!(names.contains(&format!("{x}.{leaf}")), "{leaf}");
    }
    let e = "layers.1.ffn.experts.3";
    assert_eq!(
        ck.tensor_f32(&format!("{e}.w1.weight_global_scale"))
            .unwrap(),
        ck.tensor_f32(&format!("{e}.w3.weight_global_scale"))
            .unwrap(),
    );
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(m.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        cfg["quantization_config"]["ignore"],
        json!(["lm_head", "re:.*mlp.router$"])
    );
    let errors: Vec<_> = lint_rules(&m)
        .into_iter()
        .filter(|(_, f)| f.contains("\"error\""))
        .collect();
    assert!(errors.is_empty(), "{errors:?}");
    let v = run_report(&m);
    assert_eq!(v["summary"]["divergent_ops"], 0);
    // a planted fault
    let f = t.path().join("f");
    let o = bin()
        .args(["synth", "--family", "gpt-oss", "--format", "ct-nvfp4"])
        .args(["--fault", "inverted-input-scale@L1.ffn.experts", "--out"])
        .arg(&f)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0));
    let b = bisect_report(&f, &[]);
    assert_eq!(b["findings"][0]["ops"], json!(["L1.ffn.experts"]));
    assert_eq!(b["findings"][0]["parameter"], "w13_input_global_scale");
}
