//! Every lint rule fires on its planted fault and names the right tensor; clean checkpoints of
//! every format and naming give no error and no warning. Faults come from `synth --fault`
//! where synth can plant them, and from byte-level edits of a clean synth checkpoint for the
//! rest (zero rows, sentinels, negative/denormal scales, config lies).

use std::path::Path;

use nvfp4_probe::checkpoint::{Checkpoint, Naming, ShardWriter};
use nvfp4_probe::lint::{lint, lint_dir, Report, Rules, Severity};
use nvfp4_probe::served::faults::Fault;
use nvfp4_probe::synth::{synth_to_dir, Format, Preset, SynthOptions};
use tempfile::TempDir;

fn synth(format: Format, naming: Naming, faults: &[&str]) -> TempDir {
    let d = TempDir::new().unwrap();
    let mut o = SynthOptions::new(Preset::Tiny, format, naming, 0);
    o.faults = faults.iter().map(|f| Fault::parse(f).unwrap()).collect();
    synth_to_dir(&o, d.path()).unwrap();
    d
}

fn run(d: &Path) -> Report {
    lint_dir(d, None, &Rules::default()).unwrap()
}

fn show(r: &Report) -> String {
    r.findings
        .iter()
        .map(|f| {
            format!(
                "{} {} {} | {}",
                f.severity.as_str(),
                f.rule,
                f.tensor,
                f.evidence
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// An error of `rule` whose tensor contains `tensor`.
fn assert_fires(r: &Report, rule: &str, tensor: &str) {
    assert!(
        r.findings
            .iter()
            .any(|f| f.rule == rule && f.severity == Severity::Error && f.tensor.contains(tensor)),
        "expected error {rule} on `{tensor}`, got:\n{}",
        show(r)
    );
}

#[test]
fn clean_checkpoints_of_every_format_are_clean() {
    for naming in [Naming::Official, Naming::Hf] {
        for format in Format::ALL {
            let d = synth(format, naming, &[]);
            let r = run(d.path());
            let bad: Vec<_> = r
                .findings
                .iter()
                .filter(|f| f.severity >= Severity::Warning)
                .collect();
            assert!(bad.is_empty(), "{format:?} {naming:?}:\n{}", show(&r));
            assert_eq!(r.exit_code(), 0);
            assert!(r.weights > 100);
        }
    }
}

#[test]
fn every_synth_fault_is_found_and_named() {
    use Format::*;
    // (format, fault, rule, tensor the finding must name)
    let cases: &[(Format, &str, &str, &str)] = &[
        (
            CtNvfp4,
            "inverted-input-scale@L1.ffn.expert.2.w1",
            "scale.convention",
            "layers.1.ffn.experts.2.w1.input_global_scale",
        ),
        (
            ModelOptNvfp4,
            "inverted-input-scale@L2.attn.q_a",
            "scale.convention",
            "layers.2.attn.wq_a.input_scale",
        ),
        (
            CtNvfp4,
            "inverted-weight-scale@L1.ffn.expert.2.w1",
            "scale.convention",
            "layers.1.ffn.experts.2.w1.weight_global_scale",
        ),
        (
            ModelOptNvfp4,
            "inverted-weight-scale@L2.attn.q_a",
            "scale.convention",
            "layers.2.attn.wq_a.weight_scale_2",
        ),
        (
            OfficialMixed,
            "inverted-weight-scale@L1.attn.q_b",
            "scale.convention",
            "layers.1.attn.wq_b.scale",
        ),
        (
            CtNvfp4,
            "input-amax-x64@L1.ffn.expert.2.w1",
            "scale.input.implausible",
            "layers.1.ffn.experts.2.w1.input_global_scale",
        ),
        (
            OfficialMixed,
            "input-amax-x64@L1.ffn.experts",
            "scale.input.implausible",
            "layers.1.ffn.experts.5.w3.input_scale",
        ),
        (
            OfficialMixed,
            "input-amax-x64@L1.ffn.expert.4.w2",
            "scale.input.spread",
            "layers.1.ffn.experts.4.w2.input_scale",
        ),
        (
            CtNvfp4,
            "zero-input-scale@L1.ffn.expert.2.w1",
            "scale.global.zero",
            "layers.1.ffn.experts.2.w1.input_global_scale",
        ),
        (
            OfficialMixed,
            "zero-input-scale@L3.ffn.expert.0.w2",
            "scale.global.zero",
            "layers.3.ffn.experts.0.w2.input_scale",
        ),
        (
            CtNvfp4,
            "missing-input-scale@L1.ffn.expert.2.w1",
            "scale.missing",
            "layers.1.ffn.experts.2.w1.input_global_scale",
        ),
        (
            OfficialMixed,
            "missing-input-scale@L2.ffn.expert.7.w2",
            "scale.missing",
            "layers.2.ffn.experts.7.w2.input_scale",
        ),
        (
            CtNvfp4,
            "nan-input-scale@L1.ffn.expert.2.w1",
            "scale.global.non-finite",
            "layers.1.ffn.experts.2.w1.input_global_scale",
        ),
        (
            CtNvfp4,
            "nan-block-scale@L1.ffn.expert.2.w1",
            "scale.block.nan",
            "layers.1.ffn.experts.2.w1.weight_scale",
        ),
        (
            OfficialMixed,
            "nan-block-scale@L1.attn.q_b",
            "scale.block.nan",
            "layers.1.attn.wq_b.scale",
        ),
        (
            Mxfp4,
            "nan-block-scale@L3.ffn.expert.1.w2",
            "scale.block.nan",
            "layers.3.ffn.experts.1.w2.scale",
        ),
        (
            CtNvfp4,
            "w13-scale-mismatch@L1.ffn.expert.2",
            "fused.mismatch",
            "layers.1.ffn.experts.2.w3.weight_global_scale",
        ),
        (
            ModelOptNvfp4,
            "w13-scale-mismatch@L1.ffn.shared",
            "fused.mismatch",
            "layers.1.ffn.shared_experts.w3.weight_scale_2",
        ),
        (
            CtNvfp4,
            "swizzled-scales@L1.ffn.expert.2.w1",
            "layout.swizzled",
            "layers.1.ffn.experts.2.w1.weight_scale",
        ),
        (
            ModelOptNvfp4,
            "swizzled-scales@L2.attn.q_a",
            "layout.swizzled",
            "layers.2.attn.wq_a.weight_scale",
        ),
        (
            Mxfp4,
            "swizzled-scales@L3.ffn.expert.1.w2",
            "layout.swizzled",
            "layers.3.ffn.experts.1.w2.scale",
        ),
        (
            OfficialMixed,
            "non-pow2-ue8m0@L1.attn.q_b",
            "fp8.scale.non-pow2",
            "layers.1.attn.wq_b.scale",
        ),
        (
            CtNvfp4,
            "double-scale@L1.ffn.expert.2.w1",
            "scale.block.saturated",
            "layers.1.ffn.experts.2.w1.weight_scale",
        ),
        (
            ModelOptNvfp4,
            "double-scale@L2.attn.q_a",
            "scale.block.saturated",
            "layers.2.attn.wq_a.weight_scale",
        ),
    ];
    for (format, fault, rule, tensor) in cases {
        let d = synth(*format, Naming::Official, &[fault]);
        let r = run(d.path());
        assert_eq!(r.exit_code(), 1, "{fault}");
        assert_fires(&r, rule, tensor);
    }
}

#[test]
fn hf_naming_faults_name_hf_tensors() {
    let d = synth(
        Format::ModelOptNvfp4,
        Naming::Hf,
        &["nan-input-scale@L1.ffn.expert.3.w2"],
    );
    let r = run(d.path());
    assert_fires(
        &r,
        "scale.global.non-finite",
        "model.layers.1.mlp.experts.3.",
    );
    let f = r.of_rule("scale.global.non-finite").next().unwrap();
    assert_eq!(f.op.as_deref(), Some("L1.ffn.experts"));
    assert!(f.file.ends_with(".safetensors"), "{}", f.file);
}

/// Copy a checkpoint tensor by tensor, letting `edit` change or drop tensors, and write
/// `config` (None: the original).
fn rewrite(
    src: &Path,
    edit: impl Fn(&str, &mut Vec<u8>) -> bool,
    config: Option<serde_json::Value>,
) -> TempDir {
    let ck = Checkpoint::open(src).unwrap();
    let d = TempDir::new().unwrap();
    let mut w = ShardWriter::new(d.path(), 1 << 30).unwrap();
    for n in ck.tensor_names() {
        let i = ck.info(&n).unwrap();
        let mut b = ck.bytes(&n).unwrap().to_vec();
        if edit(&n, &mut b) {
            w.add(&n, i.dtype, &i.shape, b).unwrap();
        }
    }
    let cfg = config.unwrap_or_else(|| ck.config_json().clone());
    w.finish(&serde_json::to_string(&cfg).unwrap()).unwrap();
    if src.join("hf_quant_config.json").exists() {
        std::fs::copy(
            src.join("hf_quant_config.json"),
            d.path().join("hf_quant_config.json"),
        )
        .unwrap();
    }
    d
}

fn f32_bytes(x: f32) -> Vec<u8> {
    x.to_le_bytes().to_vec()
}

#[test]
fn edited_faults_are_found_and_named() {
    let clean = synth(Format::CtNvfp4, Naming::Official, &[]);
    // A zeroed block-scale row of a live weight row: its output channel decodes to zeros.
    let d = rewrite(
        clean.path(),
        |n, b| {
            if n == "layers.2.ffn.experts.1.w2.weight_scale" {
                let cols = 256 / 16;
                b[5 * cols..6 * cols].fill(0);
            }
            true
        },
        None,
    );
    let r = run(d.path());
    assert_fires(
        &r,
        "scale.block.zero-row",
        "layers.2.ffn.experts.1.w2.weight_scale",
    );
    assert!(r
        .of_rule("scale.block.zero-row")
        .next()
        .unwrap()
        .evidence
        .contains("row 5"));
    // Negative block scale byte (-1.0 = 0xB8), float-max weight scale, subnormal and negative
    // activation scales.
    let d = rewrite(
        clean.path(),
        |n, b| {
            match n {
                "layers.1.attn.wq_b.weight_scale" => b[3] = 0xB8,
                "layers.1.attn.wq_b.weight_global_scale" => *b = f32_bytes(f32::MAX),
                "layers.3.ffn.experts.0.w1.input_global_scale" => *b = f32_bytes(1e-40),
                "layers.3.ffn.experts.6.w2.input_global_scale" => *b = f32_bytes(-3.0),
                _ => {}
            }
            true
        },
        None,
    );
    let r = run(d.path());
    assert_fires(
        &r,
        "scale.block.negative",
        "layers.1.attn.wq_b.weight_scale",
    );
    assert_fires(
        &r,
        "scale.global.sentinel",
        "layers.1.attn.wq_b.weight_global_scale",
    );
    assert_fires(
        &r,
        "scale.global.denormal",
        "layers.3.ffn.experts.0.w1.input_global_scale",
    );
    assert_fires(
        &r,
        "scale.global.negative",
        "layers.3.ffn.experts.6.w2.input_global_scale",
    );
    // 1.0 for every activation scale of layer 2's experts: a default, not a calibration.
    let d = rewrite(
        clean.path(),
        |n, b| {
            if n.starts_with("layers.2.ffn.experts.") && n.ends_with("input_global_scale") {
                *b = f32_bytes(1.0);
            }
            true
        },
        None,
    );
    let r = run(d.path());
    assert_fires(
        &r,
        "scale.global.sentinel",
        "layers.2.ffn.experts.4.w3.input_global_scale",
    );
    // Missing weight tensor scale and missing block scale.
    let d = rewrite(
        clean.path(),
        |n, _| {
            n != "layers.1.attn.wkv.weight_global_scale"
                && n != "layers.4.ffn.experts.2.w1.weight_scale"
        },
        None,
    );
    let r = run(d.path());
    assert_fires(&r, "scale.missing", "layers.1.attn.wkv.weight_global_scale");
    assert_fires(
        &r,
        "scale.missing",
        "layers.4.ffn.experts.2.w1.weight_scale",
    );
}

#[test]
fn config_lies_are_found() {
    let clean = synth(Format::CtNvfp4, Naming::Official, &[]);
    let ck = Checkpoint::open(clean.path()).unwrap();
    let cfg = ck.config_json().clone();
    // No quantization_config at all.
    let mut c = cfg.clone();
    c.as_object_mut().unwrap().remove("quantization_config");
    let r = run(rewrite(clean.path(), |_, _| true, Some(c)).path());
    assert_fires(&r, "config.scheme", "");
    // Claims MXFP4.
    let mut c = cfg.clone();
    c["quantization_config"]["format"] = "mxfp4-pack-quantized".into();
    c["quantization_config"]["config_groups"]["group_0"]["format"] = "mxfp4-pack-quantized".into();
    let r = run(rewrite(clean.path(), |_, _| true, Some(c)).path());
    assert_fires(&r, "config.scheme", "layers.1.attn.wq_a.weight_packed");
    // wo_a (BF16) dropped from the ignore list, a quantized weight added, a stale exact name.
    let mut c = cfg.clone();
    let ign: Vec<serde_json::Value> = c["quantization_config"]["ignore"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e.as_str() != Some("layers.2.attn.wo_a"))
        .cloned()
        .chain(["layers.3.attn.wq_b".into(), "layers.9.attn.wo_a".into()])
        .collect();
    c["quantization_config"]["ignore"] = ign.into();
    let r = run(rewrite(clean.path(), |_, _| true, Some(c)).path());
    assert_fires(&r, "config.ignore", "layers.2.attn.wo_a.weight");
    assert_fires(&r, "config.ignore", "layers.3.attn.wq_b.weight_packed");
    assert!(r.findings.iter().any(|f| f.rule == "config.ignore"
        && f.severity == Severity::Warning
        && f.tensor == "layers.9.attn.wo_a"));
}

#[test]
fn rules_file_switches_and_reclassifies() {
    let d = synth(
        Format::CtNvfp4,
        Naming::Official,
        &["w13-scale-mismatch@L1.ffn.expert.2"],
    );
    let ck = Checkpoint::open(d.path()).unwrap();
    let off = Rules::from_toml("[severity]\n\"fused.mismatch\" = \"off\"").unwrap();
    assert_eq!(lint(&ck, &off).unwrap().exit_code(), 0);
    // 1.6× is an error by default, a warning when the error ratio is raised above it.
    let lax = Rules::from_toml("[thresholds]\nfused_error = 2.0").unwrap();
    let r = lint(&ck, &lax).unwrap();
    assert_eq!(r.exit_code(), 0);
    let f = r.of_rule("fused.mismatch").next().unwrap();
    assert_eq!(f.severity, Severity::Warning);
    assert!(f.evidence.contains("ratio 1.6"), "{}", f.evidence);
}

#[test]
fn lint_reads_scales_not_weights() {
    let d = synth(Format::CtNvfp4, Naming::Official, &[]);
    let ck = Checkpoint::open(d.path()).unwrap();
    let packed: u64 = ck
        .weight_bases()
        .iter()
        .filter_map(|b| ck.weight_meta(b).ok())
        .filter(|m| m.convention.is_some())
        .map(|m| (m.out_features * m.in_features / 2) as u64)
        .sum();
    let r = lint(&ck, &Rules::default()).unwrap();
    // Block scales are 1/8 of the packed bytes; nothing else of size is read.
    assert!(
        r.bytes_read * 6 < packed,
        "{} read vs {} packed",
        r.bytes_read,
        packed
    );
}

#[test]
fn json_and_markdown_outputs() {
    let d = synth(
        Format::CtNvfp4,
        Naming::Official,
        &["nan-block-scale@L1.attn.q_b"],
    );
    let r = run(d.path());
    let j: serde_json::Value = serde_json::from_str(&nvfp4_probe::lint::to_json(&r)).unwrap();
    assert_eq!(j["schema"], "nvfp4-probe.lint/1");
    let f = &j["findings"][0];
    for k in [
        "rule", "severity", "tensor", "file", "op", "evidence", "fix",
    ] {
        assert!(f.get(k).is_some(), "{k}");
    }
    assert_eq!(f["rule"], "scale.block.nan");
    assert_eq!(f["severity"], "error");
    assert_eq!(f["op"], "L1.attn.q_b");
    let md = nvfp4_probe::lint::to_markdown(&r);
    assert!(
        md.contains("| `scale.block.nan` | `layers.1.attn.wq_b.weight_scale` |"),
        "{md}"
    );
}

/// One inverted global scale over a layer's experts is one root cause: the terminal shows one
/// block naming all of them as a pattern, `--verbose` each tensor, and the JSON keeps every
/// finding plus the group.
#[test]
fn one_root_cause_over_many_experts_is_one_finding() {
    let d = synth(
        Format::ModelOptNvfp4,
        Naming::Official,
        &["inverted-weight-scale@L3.ffn.experts"],
    );
    let r = run(d.path());
    let n = r.of_rule("scale.convention").count();
    assert!(
        n >= 8,
        "expected one finding per expert projection, got {n}"
    );
    let bin = assert_cmd::cargo::cargo_bin("nvfp4-probe");
    let out = std::process::Command::new(&bin)
        .args(["lint", "--model"])
        .arg(d.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    let heads: Vec<&str> = text.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(heads.len(), 1, "{text}");
    assert!(
        heads[0].contains(&format!("{n} weights: layers.3.ffn.experts.{{0–"))
            && heads[0].contains("{w1,w2,w3}.weight_scale_2"),
        "{}",
        heads[0]
    );
    assert!(text.contains("root cause"), "{text}");
    let out = std::process::Command::new(&bin)
        .args(["lint", "--verbose", "--model"])
        .arg(d.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let listed = text
        .lines()
        .filter(|l| l.trim_start().starts_with("layers.3.ffn.experts."))
        .count();
    assert_eq!(listed, n, "{text}");
}
