//! Issue 44 ("edges, round 3"): config, scheme and shape defects an outside tester reproduced on
//! the binary. Each case builds a tiny synthetic checkpoint, edits its config.json (or relabels a
//! tensor's header) and runs `lint`, `run` and `inspect`:
//! - a quantization config the tool does not know is a lint error (`config.scheme`, naming the
//!   field and config.json) and `run` refuses it (exit 2), where both said clean before;
//! - every shape `run` refuses, lint reports (`config.model` / `tensor.invalid`): the same
//!   checker (`checkpoint::shapes`), before any op runs — a compressor's `ape` too, which the op
//!   reads only once a whole block of tokens reaches it;
//! - a config value of the wrong type (a bool given as a string, a name given as a number or an
//!   unknown name) is refused naming the field and the file, not read as its default;
//! - `inspect` on a config `run` refuses still lists the tensors but exits 2.

use std::path::{Path, PathBuf};

use assert_cmd::Command;
use nvfp4_probe::checkpoint::Naming;
use nvfp4_probe::model::family::Kind;
use nvfp4_probe::synth::{synth_to_dir, Format, Preset, SynthOptions};
use serde_json::{json, Value};
use tempfile::TempDir;

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

fn probe(args: &[&str]) -> Out {
    let o = Command::cargo_bin("nvfp4-probe")
        .unwrap()
        .args(args)
        .env_remove("NVFP4_PROBE_PROFILE")
        .timeout(std::time::Duration::from_secs(120))
        .output()
        .unwrap();
    let out = Out {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    };
    assert!(
        !out.stderr.contains("panicked"),
        "{args:?} panicked: {}",
        out.stderr
    );
    out
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A tiny V4 checkpoint (3 layers: window, HCA, CSA) in `dir/name`.
fn v4(dir: &Path, name: &str, format: Format) -> PathBuf {
    let m = dir.join(name);
    let mut so = SynthOptions::new(Preset::Tiny, format, Naming::Official, 0);
    so.layers = Some(3);
    synth_to_dir(&so, &m).unwrap();
    m
}

/// A tiny checkpoint of a family (4 layers) in `dir/name`.
fn family(dir: &Path, name: &str, kind: Kind, format: Format) -> PathBuf {
    let m = dir.join(name);
    synth_to_dir(&SynthOptions::family(kind, format, 0), &m).unwrap();
    m
}

fn set_config(m: &Path, f: impl FnOnce(&mut Value)) {
    let p = m.join("config.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

/// `lint --json`: (exit code, findings of severity error).
fn lint(m: &Path) -> (i32, Vec<Value>) {
    let d = TempDir::new().unwrap();
    let j = d.path().join("lint.json");
    let o = probe(&["lint", "--model", s(m), "--json", s(&j)]);
    let v: Value = serde_json::from_slice(
        &std::fs::read(&j)
            .unwrap_or_else(|e| panic!("lint wrote no JSON ({e}): {}\n{}", o.stdout, o.stderr)),
    )
    .unwrap();
    let errors = v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["severity"] == "error")
        .cloned()
        .collect();
    (o.code, errors)
}

/// `run` of layers 0..1 over `seq` tokens on the CPU.
fn run(m: &Path, seq: &str) -> Out {
    probe(&[
        "run",
        "--model",
        s(m),
        "--backend",
        "cpu",
        "--layers",
        "0..1",
        "--seq-len",
        seq,
        "--quiet",
    ])
}

#[track_caller]
fn assert_refused(o: &Out, needles: &[&str]) {
    assert_eq!(o.code, 2, "expected exit 2: {}\n{}", o.stdout, o.stderr);
    for n in needles {
        assert!(o.stderr.contains(n), "message lacks `{n}`: {}", o.stderr);
    }
}

/// The untouched checkpoints lint clean and run clean, so that every refusal below is the edit's.
#[track_caller]
fn assert_clean(m: &Path) {
    let (code, errors) = lint(m);
    assert_eq!(code, 0, "{errors:?}");
    let o = run(m, "8");
    assert_eq!(o.code, 0, "{}\n{}", o.stdout, o.stderr);
}

// ------------------------------------------------------------ 1. unknown quantization schemes

#[test]
fn unknown_quantization_schemes_are_lint_errors_and_run_refuses_them() {
    let d = TempDir::new().unwrap();
    let ct = v4(d.path(), "ct", Format::CtNvfp4);
    let mo = v4(d.path(), "mo", Format::ModelOptNvfp4);
    assert_clean(&ct);
    assert_clean(&mo);
    type Edit = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(&str, &Path, &str, Edit)> = vec![
        (
            "ct-float-quantized",
            &ct,
            "quantization_config.format",
            Box::new(|c| {
                c["quantization_config"]["format"] = json!("float-quantized");
                c["quantization_config"]["config_groups"]["group_0"]["format"] =
                    json!("float-quantized");
            }),
        ),
        (
            "ct-pack-quantized",
            &ct,
            "quantization_config.format",
            Box::new(|c| {
                c["quantization_config"]["format"] = json!("pack-quantized");
                c["quantization_config"]["config_groups"]["group_0"]["format"] =
                    json!("pack-quantized");
            }),
        ),
        (
            // the group's format alone disagrees with the top-level one
            "ct-group-float-quantized",
            &ct,
            "quantization_config.config_groups.group_0.format",
            Box::new(|c| {
                c["quantization_config"]["config_groups"]["group_0"]["format"] =
                    json!("float-quantized");
            }),
        ),
        (
            "modelopt-fp8",
            &mo,
            "quantization_config.quant_algo",
            Box::new(|c| c["quantization_config"]["quant_algo"] = json!("FP8")),
        ),
        (
            "modelopt-w4a8-awq",
            &mo,
            "quantization_config.quant_algo",
            Box::new(|c| c["quantization_config"]["quant_algo"] = json!("W4A8_AWQ")),
        ),
        (
            "modelopt-empty",
            &mo,
            "quantization_config.quant_algo",
            Box::new(|c| c["quantization_config"]["quant_algo"] = json!("")),
        ),
        (
            "modelopt-mixed-without-layers",
            &mo,
            "quantization_config.quant_algo",
            Box::new(|c| c["quantization_config"]["quant_algo"] = json!("MIXED_PRECISION")),
        ),
        (
            "gptq",
            &ct,
            "quantization_config.quant_method",
            Box::new(|c| c["quantization_config"]["quant_method"] = json!("gptq")),
        ),
        (
            "no-method",
            &ct,
            "quantization_config.quant_method",
            Box::new(|c| {
                c["quantization_config"]
                    .as_object_mut()
                    .unwrap()
                    .remove("quant_method");
            }),
        ),
    ];
    for (name, src, field, edit) in cases {
        let m = d.path().join(name);
        copy_dir(src, &m);
        set_config(&m, |c| edit(c));
        let (code, errors) = lint(&m);
        assert_eq!(code, 1, "{name}: lint must fail: {errors:?}");
        let f = errors
            .iter()
            .find(|f| f["rule"] == "config.scheme")
            .unwrap_or_else(|| panic!("{name}: no config.scheme error: {errors:?}"));
        assert_eq!(f["tensor"], field, "{name}: {f}");
        assert!(
            f["file"].as_str().unwrap().ends_with("config.json"),
            "{name}: {f}"
        );
        assert!(
            f["evidence"].as_str().unwrap().contains(field),
            "{name}: {f}"
        );
        assert_refused(&run(&m, "8"), &[field, "config.json"]);
    }
}

/// ModelOpt's MIXED_PRECISION is read through `quantized_layers`: listed as the tensors are, it
/// lints clean; a layer listed with another scheme is `config.scheme`.
#[test]
fn modelopt_mixed_precision_is_checked_per_layer() {
    let d = TempDir::new().unwrap();
    let mo = v4(d.path(), "mo", Format::ModelOptNvfp4);
    let ck = nvfp4_probe::checkpoint::Checkpoint::open(&mo).unwrap();
    let layers: serde_json::Map<String, Value> = ck
        .weight_bases()
        .iter()
        .filter_map(|b| {
            let m = ck.weight_meta(b).unwrap();
            (m.scheme != nvfp4_probe::checkpoint::Scheme::Dense).then(|| {
                let stem = m
                    .tensors
                    .weight
                    .strip_suffix(".weight")
                    .unwrap()
                    .to_string();
                (stem, json!({"quant_algo": "NVFP4", "group_size": 16}))
            })
        })
        .collect();
    drop(ck);
    let first = layers.keys().next().unwrap().clone();
    set_config(&mo, |c| {
        c["quantization_config"]["quant_algo"] = json!("MIXED_PRECISION");
        c["quantization_config"]["quantized_layers"] = Value::Object(layers);
    });
    let (code, errors) = lint(&mo);
    assert_eq!(code, 0, "{errors:?}");
    set_config(&mo, |c| {
        c["quantization_config"]["quantized_layers"][&first]["quant_algo"] = json!("MXFP8")
    });
    let (code, errors) = lint(&mo);
    assert_eq!(code, 1);
    assert!(
        errors
            .iter()
            .any(|f| f["rule"] == "config.scheme"
                && f["tensor"].as_str().unwrap().starts_with(&first)),
        "{errors:?}"
    );
    set_config(&mo, |c| {
        c["quantization_config"]["quantized_layers"][&first]["quant_algo"] = json!("INT4_AWQ")
    });
    assert_refused(
        &run(&mo, "8"),
        &["quantized_layers", "INT4_AWQ", "config.json"],
    );
}

// ------------------------------------------------------------ 2. one shape checker

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Rewrite the shape of `tensor` in the header of `model.safetensors` (same bytes).
fn relabel(m: &Path, tensor: &str, shape: &[usize]) {
    let p = m.join("model.safetensors");
    let b = std::fs::read(&p).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let mut h: Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    h[tensor]["shape"] = json!(shape);
    let text = h.to_string();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(&b[8 + n..]);
    std::fs::write(&p, out).unwrap();
}

/// Each edit makes `run` refuse the checkpoint (exit 2, naming the fields); lint must report an
/// error for it too. `seq` is the run's token count: the compressor's case runs fewer tokens than
/// one compressed block, which never read `ape` before.
#[test]
fn every_shape_run_refuses_lint_reports() {
    let d = TempDir::new().unwrap();
    let v3 = family(d.path(), "v3", Kind::DeepseekV3, Format::Bf16);
    let oss = family(d.path(), "oss", Kind::GptOss, Format::Mxfp4);
    let qw = family(d.path(), "qw", Kind::Qwen3Moe, Format::CtNvfp4);
    let v4m = v4(d.path(), "v4", Format::CtNvfp4);
    for m in [&v3, &oss, &qw] {
        assert_clean(m);
    }
    type Edit = Box<dyn Fn(&Path)>;
    let cases: Vec<(&str, &Path, &[&str], &str, Edit)> = vec![
        (
            "v3-kv-lora-rank",
            &v3,
            &["kv_lora_rank", "config.json"],
            "8",
            Box::new(|m| set_config(m, |c| c["kv_lora_rank"] = json!(32))),
        ),
        (
            "v3-v-head-dim",
            &v3,
            &[
                "v_head_dim",
                "config.json",
                "model.safetensors",
                "kv_b_proj",
            ],
            "8",
            Box::new(|m| set_config(m, |c| c["v_head_dim"] = json!(32))),
        ),
        (
            "oss-kv-heads",
            &oss,
            &["num_key_value_heads", "config.json"],
            "8",
            Box::new(|m| set_config(m, |c| c["num_key_value_heads"] = json!(1))),
        ),
        (
            "v4-hc-mult",
            &v4m,
            &["hc_mult", "config.json"],
            "8",
            Box::new(|m| set_config(m, |c| c["hc_mult"] = json!(2))),
        ),
        (
            "qwen-head-dim",
            &qw,
            &["head_dim", "config.json"],
            "8",
            Box::new(|m| set_config(m, |c| c["head_dim"] = json!(16))),
        ),
        (
            // layer 1's HCA ratio 16 → 64: its `ape` [16, head_dim] no longer fits, with 8
            // tokens (no whole block of 64) as with many
            "v4-compress-ratio",
            &v4m,
            &["compress_ratios[1]", "config.json", "compressor.ape"],
            "8",
            Box::new(|m| {
                set_config(m, |c| {
                    assert_eq!(c["compress_ratios"][1], 16, "the tiny model's HCA ratio");
                    c["compress_ratios"][1] = json!(64);
                })
            }),
        ),
        (
            // MXFP4 blocks relabelled [E, out/2, 2·in/32, 16] while their scales say [E, out, in/32]
            "oss-mxfp4-relabelled",
            &oss,
            &["gate_up_proj_scales", "model.safetensors"],
            "8",
            Box::new(|m| {
                relabel(
                    m,
                    "model.layers.0.mlp.experts.gate_up_proj_blocks",
                    &[8, 128, 16, 16],
                )
            }),
        ),
    ];
    for (name, src, needles, seq, edit) in cases {
        let m = d.path().join(name);
        copy_dir(src, &m);
        edit(&m);
        let o = run(&m, seq);
        assert_refused(&o, needles);
        let (code, errors) = lint(&m);
        assert_eq!(
            code, 1,
            "{name}: run refuses ({}) but lint finds no error",
            o.stderr
        );
        assert!(
            errors
                .iter()
                .any(|f| f["rule"] == "config.model" || f["rule"] == "tensor.invalid"),
            "{name}: {errors:?}"
        );
    }
}

// ------------------------------------------------------------ 3. mistyped config values

#[test]
fn config_values_of_the_wrong_type_are_refused_naming_the_field() {
    let d = TempDir::new().unwrap();
    let v3 = family(d.path(), "v3", Kind::DeepseekV3, Format::Bf16);
    let qw = family(d.path(), "qw", Kind::Qwen3Moe, Format::Bf16);
    let oss = family(d.path(), "oss", Kind::GptOss, Format::Mxfp4);
    let v4m = v4(d.path(), "v4", Format::Bf16);
    type Edit = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(&str, &Path, &str, Edit)> = vec![
        (
            "v4-norm-topk-string",
            &v4m,
            "norm_topk_prob",
            Box::new(|c| c["norm_topk_prob"] = json!("false")),
        ),
        (
            "v4-scoring-number",
            &v4m,
            "scoring_func",
            Box::new(|c| c["scoring_func"] = json!(5)),
        ),
        (
            "v4-scoring-unknown",
            &v4m,
            "scoring_func",
            Box::new(|c| c["scoring_func"] = json!("softmaxx")),
        ),
        (
            "v4-rope-type-number",
            &v4m,
            "rope_scaling.type",
            Box::new(|c| {
                c["rope_scaling"] = json!({"type": 3, "factor": 16});
                c.as_object_mut().unwrap().remove("rope_parameters");
            }),
        ),
        (
            "v3-scoring-number",
            &v3,
            "scoring_func",
            Box::new(|c| c["scoring_func"] = json!(5)),
        ),
        (
            "v3-rope-type-number",
            &v3,
            "rope_scaling.type",
            Box::new(|c| c["rope_scaling"]["type"] = json!(3)),
        ),
        (
            "v3-norm-topk-string",
            &v3,
            "norm_topk_prob",
            Box::new(|c| c["norm_topk_prob"] = json!("true")),
        ),
        (
            "qwen-tie-string",
            &qw,
            "tie_word_embeddings",
            Box::new(|c| c["tie_word_embeddings"] = json!("false")),
        ),
        (
            "oss-attention-bias-number",
            &oss,
            "attention_bias",
            Box::new(|c| c["attention_bias"] = json!(1)),
        ),
    ];
    for (name, src, field, edit) in cases {
        let m = d.path().join(name);
        copy_dir(src, &m);
        set_config(&m, |c| edit(c));
        assert_refused(&run(&m, "8"), &[&format!("`{field}`"), "config.json"]);
        let (code, errors) = lint(&m);
        assert_eq!(code, 1, "{name}: {errors:?}");
        assert!(
            errors
                .iter()
                .any(|f| f["rule"] == "config.model" && f["tensor"] == field),
            "{name}: {errors:?}"
        );
    }
}

// ------------------------------------------------------------ 4. inspect

#[test]
fn inspect_lists_the_tensors_of_a_config_run_refuses_and_exits_2() {
    let d = TempDir::new().unwrap();
    let m = v4(d.path(), "m", Format::Bf16);
    let o = probe(&["inspect", "--all", "--model", s(&m)]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    set_config(&m, |c| c["num_hidden_layers"] = json!(1_000_000_000u64));
    let o = probe(&["inspect", "--all", "--model", s(&m)]);
    assert_eq!(o.code, 2, "{}\n{}", o.stdout, o.stderr);
    assert!(o.stdout.contains("layers.2.attn.wq_a"), "{}", o.stdout);
    assert!(
        o.stderr.contains("num_hidden_layers") && o.stderr.contains("config.json"),
        "{}",
        o.stderr
    );
    assert_refused(&run(&m, "8"), &["num_hidden_layers", "config.json"]);
    // a shape run refuses: the weights are listed as stored, the exit is 2
    let v3 = family(d.path(), "v3", Kind::DeepseekV3, Format::Bf16);
    set_config(&v3, |c| c["v_head_dim"] = json!(32));
    let o = probe(&["inspect", "--all", "--model", s(&v3)]);
    assert_eq!(o.code, 2, "{}\n{}", o.stdout, o.stderr);
    assert!(o.stdout.contains("kv_b_proj"), "{}", o.stdout);
    assert!(o.stderr.contains("v_head_dim"), "{}", o.stderr);
}
