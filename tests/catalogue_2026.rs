//! The 2026 catalogue (docs/CATALOGUE-2026.md, issue 43 item 7): one test per class, named by
//! the class id, each planting the class's fault (bytes of a synth checkpoint, or a loader /
//! engine fault on the served path) and asserting that lint or bisect catches it, while the clean
//! checkpoint gives nothing. `catalogue_ids_agree_with_docs_readme_and_tests` keeps the docs
//! table, the README's list and the tests of this file equal.

#[path = "safetensors_support/mod.rs"]
mod st;

use std::path::Path;

use assert_cmd::Command;
use nvfp4_probe::bisect;
use nvfp4_probe::checkpoint::{Checkpoint, Naming};
use nvfp4_probe::lint::{lint_dir, Report, Rules, Severity};
use nvfp4_probe::model::family::Kind;
use nvfp4_probe::probe::{synthetic_tokens, RunOptions};
use nvfp4_probe::served::faults::Fault;
use nvfp4_probe::synth::{self, Format, Preset, SynthOptions};
use serde_json::{json, Value};
use tempfile::TempDir;

const SEED: u64 = 4;

fn bin() -> Command {
    Command::cargo_bin("nvfp4-probe").unwrap()
}

fn family(kind: Kind, format: Format, faults: &[&str]) -> TempDir {
    let d = TempDir::new().unwrap();
    let mut o = SynthOptions::family(kind, format, SEED);
    o.faults = faults.iter().map(|f| Fault::parse(f).unwrap()).collect();
    synth::synth_to_dir(&o, d.path()).unwrap();
    d
}

fn v4(format: Format, faults: &[&str]) -> TempDir {
    let d = TempDir::new().unwrap();
    let mut o = SynthOptions::new(Preset::Tiny, format, Naming::Official, SEED);
    o.faults = faults.iter().map(|f| Fault::parse(f).unwrap()).collect();
    synth::synth_to_dir(&o, d.path()).unwrap();
    d
}

fn lint_with(d: &Path, rules: &Rules) -> Report {
    lint_dir(d, None, rules).unwrap()
}

fn lint(d: &Path) -> Report {
    lint_with(d, &Rules::default())
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

/// A finding of `rule` at `sev` whose tensor contains `tensor`.
fn assert_fires(r: &Report, rule: &str, sev: Severity, tensor: &str) {
    assert!(
        r.findings
            .iter()
            .any(|f| f.rule == rule && f.severity == sev && f.tensor.contains(tensor)),
        "expected {sev:?} {rule} on `{tensor}`, got:\n{}",
        show(r)
    );
}

fn assert_silent(r: &Report, rule: &str) {
    assert!(
        r.of_rule(rule).next().is_none(),
        "{rule} on a clean checkpoint:\n{}",
        show(r)
    );
}

/// Rewrite the single `model.safetensors` of `d` in place: `edit` may change, add or drop entries.
fn rewrite(d: &Path, edit: impl FnOnce(&mut Vec<st::Entry>)) {
    let p = d.join("model.safetensors");
    let mut e = st::read_all(&p);
    edit(&mut e);
    st::write_all(&p, &e);
}

fn edit_config(d: &Path, edit: impl FnOnce(&mut Value)) {
    let p = d.join("config.json");
    let mut c: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    edit(&mut c);
    std::fs::write(&p, serde_json::to_vec_pretty(&c).unwrap()).unwrap();
}

fn f32_of(b: &[u8]) -> f32 {
    f32::from_le_bytes(b[..4].try_into().unwrap())
}

/// The first divergent op bisect finds with `fault` on the served path (layers 0..=last), and
/// with none (must be None).
fn divergence(d: &Path, fault: &str, last: usize) -> Option<String> {
    let ck = Checkpoint::open(d).unwrap();
    let vocab = ck.model_config().unwrap().vocab_size;
    let opts = |faults: Vec<Fault>| RunOptions {
        loader_faults: faults,
        ..RunOptions::new((0, last), synthetic_tokens(32, vocab, 7))
    };
    let clean = bisect::bisect(&ck, &opts(vec![])).unwrap();
    assert!(
        clean.divergence.is_none(),
        "clean {}: {:?}",
        d.display(),
        clean.divergence.map(|d| d.op)
    );
    let r = bisect::bisect(&ck, &opts(vec![Fault::parse(fault).unwrap()])).unwrap();
    r.divergence.map(|d| d.op)
}

/// `run --loader-fault FAULT` must be refused up front (exit 2): its message.
fn refused(model: &Path, fault: &str) -> String {
    let out = bin()
        .args([
            "run",
            "--backend",
            "cpu",
            "--quiet",
            "--loader-fault",
            fault,
            "--model",
        ])
        .arg(model)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{fault}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

// ---------------------------------------------------------------------------------------------
// One test per class.

/// C01: the power-of-two (UE8M0) scale contract. A checkpoint that claims UE8M0 and is not is
/// lint's `fp8.scale.non-pow2`; a loader that rounds a non-UE8M0 checkpoint's FP8 block scales to
/// powers of two (`ue8m0-requantized`) is the first divergent op in bisect.
#[test]
fn c01_ue8m0_scale_contract() {
    let d = v4(Format::OfficialMixed, &["non-pow2-ue8m0@L1.attn.q_b"]);
    assert_fires(
        &lint(d.path()),
        "fp8.scale.non-pow2",
        Severity::Error,
        "layers.1.attn.wq_b",
    );
    let fp8 = family(Kind::DeepseekV3, Format::Fp8Block, &[]);
    assert_eq!(
        divergence(fp8.path(), "ue8m0-requantized@L1.attn.q_b", 1).as_deref(),
        Some("L1.attn.q_b")
    );
    let nv = family(Kind::DeepseekV3, Format::CtNvfp4, &[]);
    assert!(refused(nv.path(), "ue8m0-requantized@L1.attn.q_b").contains("does not apply"));
}

/// C02: E8M0 exponent bias off by one: MXFP4 experts decoded with bias 128.
#[test]
fn c02_e8m0_bias_rounding() {
    let d = family(Kind::GptOss, Format::Mxfp4, &[]);
    assert_eq!(
        divergence(d.path(), "e8m0-bias-off-by-one@L1.ffn.experts", 1).as_deref(),
        Some("L1.ffn.experts")
    );
}

/// C03: E4M3 block scales widened to BF16 without the exponent re-bias.
#[test]
fn c03_e4m3_scale_widening() {
    let d = family(Kind::DeepseekV3, Format::CtNvfp4, &[]);
    assert_eq!(
        divergence(d.path(), "e4m3-scale-unbiased@L1.attn.q_b", 1).as_deref(),
        Some("L1.attn.q_b")
    );
}

/// C05: the router's correction bias in BF16: stored so (lint), or rounded so by the loader
/// (bisect stops at the router).
#[test]
fn c05_router_bias_precision() {
    let d = family(Kind::DeepseekV3, Format::CtNvfp4, &[]);
    assert_silent(&lint(d.path()), "router.bias.precision");
    // the tiny model's biases (|b| ≈ 0.1) round by ≈ 4e-4 and flip no top-k of 32 tokens; biases
    // near 4, as trained routers carry, lie on BF16's 1/32 grid, so every other expert moves by
    // ≈ 1/64 against its neighbours
    rewrite(d.path(), |e| {
        for (name, _, _, bytes) in e.iter_mut() {
            if name == "model.layers.1.mlp.gate.e_score_correction_bias" {
                *bytes = (0..8)
                    .flat_map(|i| (4.0f32 + 0.0155 * i as f32).to_le_bytes())
                    .collect();
            }
        }
    });
    assert_silent(&lint(d.path()), "router.bias.precision");
    assert_eq!(
        divergence(d.path(), "bf16-correction-bias@L1.ffn.router", 1).as_deref(),
        Some("L1.ffn.router")
    );
    rewrite(d.path(), |e| {
        for (name, dt, _, bytes) in e.iter_mut() {
            if name == "model.layers.1.mlp.gate.e_score_correction_bias" {
                *dt = "BF16".into();
                *bytes = bytes
                    .chunks(4)
                    .flat_map(|c| {
                        let b = f32_of(c).to_bits();
                        (((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16).to_le_bytes()
                    })
                    .collect();
            }
        }
    });
    assert_fires(
        &lint(d.path()),
        "router.bias.precision",
        Severity::Warning,
        "model.layers.1.mlp.gate.e_score_correction_bias",
    );
}

/// C06: MoE extras dropped or doubled: the routed scaling factor (new engine kinds), the SwiGLU
/// clamp (`swiglu-unclamped`, tests/gpt_oss_faults.rs) and the expert biases
/// (`missing-expert-bias`: lint `weight.missing`).
#[test]
fn c06_moe_extras() {
    let d = family(Kind::DeepseekV3, Format::CtNvfp4, &[]);
    for kind in ["routed-scaling-dropped", "routed-scaling-doubled"] {
        let op = divergence(d.path(), &format!("{kind}@L1.ffn.experts"), 1);
        assert!(
            matches!(op.as_deref(), Some("L1.ffn.router" | "L1.ffn.experts")),
            "{kind}: {op:?}"
        );
    }
    // gpt-oss's routed scaling is 1: nothing to drop
    let go = family(Kind::GptOss, Format::Mxfp4, &[]);
    assert!(refused(go.path(), "routed-scaling-dropped@L1.ffn.experts")
        .contains("routed_scaling_factor"));
    let nb = family(
        Kind::GptOss,
        Format::Mxfp4,
        &["missing-expert-bias@L1.ffn.experts"],
    );
    assert_fires(
        &lint(nb.path()),
        "weight.missing",
        Severity::Error,
        "layers.1.mlp.experts",
    );
}

/// C07: uncalibrated experts: activation scales that imply an amax of exactly 1.0 (an observer
/// that never saw a token) in some experts of a layer.
#[test]
fn c07_uncalibrated_experts() {
    let d = family(Kind::DeepseekV3, Format::CtNvfp4, &[]);
    assert_silent(&lint(d.path()), "scale.input.uncalibrated");
    // experts 5, 6 and 7 (the rarely routed ones) keep a default copied in; 0..4 their own
    let default = 2688f32.to_le_bytes().to_vec();
    rewrite(d.path(), |e| {
        for t in e.iter_mut() {
            for x in 5..8 {
                if t.0 == format!("model.layers.1.mlp.experts.{x}.gate_proj.input_global_scale") {
                    t.3 = default.clone();
                }
            }
        }
    });
    let r = lint(d.path());
    for x in 5..8 {
        assert_fires(
            &r,
            "scale.input.uncalibrated",
            Severity::Warning,
            &format!("layers.1.mlp.experts.{x}.gate_proj"),
        );
    }
    assert_eq!(
        r.of_rule("scale.input.uncalibrated").count(),
        3,
        "{}",
        show(&r)
    );
    let f = r.of_rule("scale.input.uncalibrated").next().unwrap();
    assert_eq!(f.op.as_deref(), Some("L1.ffn.experts"));
    assert!(f.evidence.contains("experts 5, 6, 7"), "{}", f.evidence);
    // a producer that shares one calibrated scale across the layer's experts on purpose (as
    // llm-compressor's and ModelOpt's MoE exports do) is not flagged
    let d = family(Kind::DeepseekV3, Format::CtNvfp4, &[]);
    rewrite(d.path(), |e| {
        let name =
            |x: usize| format!("model.layers.1.mlp.experts.{x}.gate_proj.input_global_scale");
        let own = e.iter().find(|t| t.0 == name(0)).unwrap().3.clone();
        for t in e.iter_mut() {
            if (0..8).any(|x| t.0 == name(x)) {
                t.3 = own.clone();
            }
        }
    });
    assert_silent(&lint(d.path()), "scale.input.uncalibrated");
}

/// C08: KV-cache scales lost: declared by the config but absent, 1.0, or NaN.
#[test]
fn c08_kv_cache_scales() {
    let d = family(Kind::DeepseekV3, Format::CtNvfp4, &[]);
    assert_silent(&lint(d.path()), "kv.scale");
    edit_config(d.path(), |c| {
        c["quantization_config"]["kv_cache_scheme"] = json!({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": false, "symmetric": true});
    });
    rewrite(d.path(), |e| {
        e.push((
            "model.layers.0.self_attn.k_scale".into(),
            "F32".into(),
            vec![],
            1f32.to_le_bytes().to_vec(),
        ));
        e.push((
            "model.layers.0.self_attn.v_scale".into(),
            "F32".into(),
            vec![],
            f32::NAN.to_le_bytes().to_vec(),
        ));
    });
    let r = lint(d.path());
    assert_fires(
        &r,
        "kv.scale",
        Severity::Warning,
        "model.layers.0.self_attn.k_scale",
    );
    assert_fires(
        &r,
        "kv.scale",
        Severity::Error,
        "model.layers.0.self_attn.v_scale",
    );
    assert_fires(&r, "kv.scale", Severity::Error, "layers.1.attn.k_scale");
    assert_fires(&r, "kv.scale", Severity::Error, "layers.3.attn.v_scale");
    assert_eq!(r.exit_code(), 1);
}

/// C09: gpt-oss's attention sinks dropped by the engine.
#[test]
fn c09_attention_sinks() {
    let d = family(Kind::GptOss, Format::Mxfp4, &[]);
    let op = divergence(d.path(), "sinks-dropped@L1.attn", 1);
    assert!(
        op.as_deref().is_some_and(|o| o.starts_with("L1.attn")),
        "{op:?}"
    );
    let ds = family(Kind::DeepseekV3, Format::CtNvfp4, &[]);
    assert!(refused(ds.path(), "sinks-dropped@L1.attn").contains("no attention sinks"));
}

/// C10: tensors that must stay in high precision stored quantized: a router and a norm.
#[test]
fn c10_keep_high_precision() {
    let d = family(Kind::DeepseekV3, Format::CtNvfp4, &[]);
    assert_silent(&lint(d.path()), "tensor.keep-high-precision");
    rewrite(d.path(), |e| {
        e.push((
            "model.layers.1.mlp.gate.weight_scale".into(),
            "F8_E4M3".into(),
            vec![8, 16],
            vec![0x38; 128],
        ));
        e.push((
            "model.layers.2.post_attention_layernorm.weight_scale".into(),
            "F8_E4M3".into(),
            vec![1, 16],
            vec![0x38; 16],
        ));
    });
    let r = lint(d.path());
    assert_fires(
        &r,
        "tensor.keep-high-precision",
        Severity::Error,
        "model.layers.1.mlp.gate.weight_scale",
    );
    assert_fires(
        &r,
        "tensor.keep-high-precision",
        Severity::Error,
        "model.layers.2.post_attention_layernorm.weight_scale",
    );
}

/// C11: a tensor-parallel shard boundary inside a scale block (`lint --tp N`).
#[test]
fn c11_tp_scale_block() {
    let d = family(Kind::DeepseekV3, Format::Fp8Block, &[]);
    let mut rules = Rules::default();
    assert_silent(&lint_with(d.path(), &rules), "tp.scale-block");
    rules.tp = Some(1);
    assert_silent(&lint_with(d.path(), &rules), "tp.scale-block");
    rules.tp = Some(2);
    let r = lint_with(d.path(), &rules);
    // 128 expert rows / 2 = 64 per rank, block 128; q_b's 384 rows / 2 = 192
    assert_fires(
        &r,
        "tp.scale-block",
        Severity::Error,
        "model.layers.1.mlp.experts.0.gate_proj",
    );
    assert_fires(
        &r,
        "tp.scale-block",
        Severity::Error,
        "model.layers.1.self_attn.q_b_proj",
    );
    // the command line: --tp 2 exits 1, --tp 0 is refused
    let out = bin()
        .args(["lint", "--tp", "2", "--model"])
        .arg(d.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("tp.scale-block"));
    let out = bin()
        .args(["lint", "--tp", "0", "--model"])
        .arg(d.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// C12: an index that omits scale tensors: engines load by the index and would not see them;
/// the checkpoint is unusable (exit 2 naming the index and the tensor).
#[test]
fn c12_index_omits_scales() {
    let d = v4(Format::CtNvfp4, &[]);
    let p = d.path().join("model.safetensors.index.json");
    let mut idx: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    let map = idx["weight_map"].as_object_mut().unwrap();
    let dropped: String = map
        .keys()
        .find(|k| k.ends_with(".weight_scale"))
        .unwrap()
        .clone();
    map.remove(&dropped);
    std::fs::write(&p, serde_json::to_vec(&idx).unwrap()).unwrap();
    let out = bin()
        .args(["lint", "--model"])
        .arg(d.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&dropped) && err.contains("index does not list it"),
        "{err}"
    );
    assert!(out.stdout.is_empty());
}

// ---------------------------------------------------------------------------------------------
// The docs table, the README's list and this file's tests name the same classes.

/// `cNN_name`: a class id.
fn is_class_id(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() > 4 && b[0] == b'c' && b[1].is_ascii_digit() && b[2].is_ascii_digit() && b[3] == b'_'
}

/// (id, caught) rows of docs/CATALOGUE-2026.md's table: `| c01_… | … | caught |` or `not yet caught`.
fn docs_rows() -> Vec<(String, bool)> {
    let doc = include_str!("../docs/CATALOGUE-2026.md");
    doc.lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let id = cells.get(1)?.trim_matches('`');
            if !(id.len() > 4
                && id.starts_with('c')
                && id[1..3].chars().all(|c| c.is_ascii_digit()))
            {
                return None;
            }
            let status = cells.get(cells.len().checked_sub(2)?)?;
            Some((id.to_string(), !status.contains("not yet caught")))
        })
        .collect()
}

#[test]
fn catalogue_ids_agree_with_docs_readme_and_tests() {
    let rows = docs_rows();
    assert_eq!(rows.len(), 12, "{rows:?}");
    let me = include_str!("catalogue_2026.rs");
    let readme = include_str!("../README.md");
    // the class tests: `fn cNN_…(` at the start of a line
    let tests: Vec<String> = me
        .lines()
        .filter_map(|l| l.strip_prefix("fn "))
        .filter_map(|r| r.split('(').next())
        .filter(|n| is_class_id(n))
        .map(String::from)
        .collect();
    assert!(tests.len() >= 10, "{tests:?}");
    for (id, caught) in &rows {
        let has_test = tests.iter().any(|t| t == id);
        assert_eq!(
            has_test, *caught,
            "{id}: a test exactly where the docs say caught"
        );
        let line = readme
            .lines()
            .find(|l| l.contains(&format!("`{id}`")))
            .unwrap_or_else(|| panic!("README does not list {id}"));
        assert_eq!(
            !line.contains("not yet caught"),
            *caught,
            "README's line for {id}: {line}"
        );
    }
    // every test of a class is in the docs
    for t in tests {
        assert!(
            rows.iter().any(|(r, _)| *r == t),
            "{t} has a test but no docs row"
        );
    }
}
