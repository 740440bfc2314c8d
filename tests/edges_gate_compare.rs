//! Issue 44 ("edges, round 3"), the gate / compare / contract defects an outside tester found:
//! - `gate`: a rule's unknown op class (`class = "moe"`; the class is `Moe`) matched nothing and
//!   the gate passed; impossible metric values in a run JSON (`rel_l2: -1`, `nan: -5`,
//!   `cos: 1.5`) were gated as numbers. Both are refused (exit 2, naming what and where).
//! - `compare`: the run's precision was read from the mapped tensors only, so a one-entry user map
//!   naming a float32 norm of a BF16 (autocast) run held it to F32 and raised a false divergence.
//! - a prompt in token chunks (`--chunk 5`) equals the whole prompt in every record (the host
//!   GEMM sums each row in one order whatever the row count: `device::gemm`'s unit tests).
//! - a scalar scale stored as 10000 elements is unusable input (exit 2 naming file and tensor).
//! - a bad id in a `--tokens` file names the file.
//! - `--loader-fault` / `--engine-fault` targets outside `--layers` are refused, not ignored.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use nvfp4_probe::cli::{CompareArgs, TokenArgs};
use nvfp4_probe::commands::compare::compare;
use nvfp4_probe::trace::precision::Precision;
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn probe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nvfp4-probe"))
        .args(args)
        .env_remove("NVFP4_PROBE_PROFILE")
        .output()
        .unwrap()
}

/// Exit 2, no panic, and stderr holds every needle.
fn refused(o: &Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(
        o.status.code(),
        Some(2),
        "expected exit 2: {err}{}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(!err.contains("panic"), "panicked: {err}");
    for n in needles {
        assert!(err.contains(n), "message lacks `{n}`: {err}");
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

// ------------------------------------------------------------------------------------- gate

#[test]
fn a_rule_with_an_unknown_op_class_is_refused_naming_it_and_the_known_ones() {
    let d = tempfile::tempdir().unwrap();
    let base = root().join("reports/baseline.json");
    let tol = d.path().join("tol.toml");
    // a rule the baseline itself fails, were it applied: `moe` must not match nothing silently
    std::fs::write(
        &tol,
        "[[rule]]\nops = \"*\"\nclass = \"moe\"\nmetric = \"cos\"\nmin = 1.5\n",
    )
    .unwrap();
    let o = probe(&[
        "gate",
        "--baseline",
        s(&base),
        "--current",
        s(&base),
        "--tolerances",
        s(&tol),
    ]);
    refused(&o, &["tol.toml", "`moe`", "Moe", "Linear", "Attention"]);
    // the class spelled as the run JSON spells it applies (and this rule fails: exit 1)
    std::fs::write(
        &tol,
        "[[rule]]\nops = \"*\"\nclass = \"Moe\"\nmetric = \"cos\"\nmin = 1.5\n",
    )
    .unwrap();
    let o = probe(&[
        "gate",
        "--baseline",
        s(&base),
        "--current",
        s(&base),
        "--tolerances",
        s(&tol),
    ]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
}

#[test]
fn impossible_metric_values_in_a_run_json_are_refused_naming_file_op_and_metric() {
    let d = tempfile::tempdir().unwrap();
    let base = root().join("reports/baseline.json");
    let text = std::fs::read_to_string(&base).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let op = v["ops"][5]["id"].as_str().unwrap().to_string();
    for (group, metric, value) in [
        ("served_propagated_vs_bf16", "rel_l2", serde_json::json!(-1)),
        ("served_propagated_vs_bf16", "cos", serde_json::json!(1.5)),
        ("served_isolated_vs_fp32", "cos", serde_json::json!(-1.01)),
        ("stats.served", "nan", serde_json::json!(-5)),
        ("stats.oracle_bf16", "inf", serde_json::json!(0.5)),
        ("bf16_vs_fp32", "amax_ratio", serde_json::json!(-2.0)),
    ] {
        let mut bad = v.clone();
        let rec = &mut bad["ops"][5];
        let obj = match group.split_once('.') {
            Some((a, b)) => &mut rec[a][b],
            None => &mut rec[group],
        };
        obj[metric] = value.clone();
        let cur = d.path().join("current.json");
        std::fs::write(&cur, serde_json::to_string(&bad).unwrap()).unwrap();
        let o = probe(&["gate", "--baseline", s(&base), "--current", s(&cur)]);
        refused(&o, &["current.json", &op, &format!("{group}.{metric}")]);
        // as the baseline too
        let o = probe(&["gate", "--baseline", s(&cur), "--current", s(&base)]);
        refused(&o, &["current.json", &op, metric]);
    }
    // the values a run does write pass: the unchanged baseline gates clean
    let o = probe(&["gate", "--baseline", s(&base), "--current", s(&base)]);
    assert_eq!(o.status.code(), Some(0));
}

// ---------------------------------------------------------------------------------- compare

fn hf_tiny(f: &str) -> PathBuf {
    root().join("tests/data/hf-tiny").join(f)
}

fn compare_args(trace: &Path, names: &str) -> CompareArgs {
    CompareArgs {
        model: Some(hf_tiny("")),
        trace: trace.to_path_buf(),
        names: names.into(),
        tokens: TokenArgs::default(),
        json: None,
        markdown: None,
        seed: 0,
        mem: Default::default(),
    }
}

/// A user map of one entry holds its op to the precision the whole trace was computed at, as
/// `--names hf` does: transformers' BF16 (autocast) run computes its RMSNorm in float32, so the
/// norm's values alone carry F32; the run's other tensors say BF16.
#[test]
fn a_one_entry_map_holds_its_op_to_the_runs_precision_as_the_built_in_map_does() {
    let d = tempfile::tempdir().unwrap();
    let trace = hf_tiny("trace-77-bf16.safetensors");
    let full = compare(&compare_args(&trace, "hf")).unwrap();
    for (name, op) in [
        ("model.layers.0.input_layernorm", "L0.attn.norm"),
        ("model.layers.1.attn_hc:comb", "L1.attn.hc_pre.comb"),
        ("model.layers.2.self_attn.q_b_proj", "L2.attn.q_b"),
    ] {
        let map = d.path().join("one.toml");
        std::fs::write(&map, format!("[map]\n\"{name}\" = \"{op}\"\n")).unwrap();
        let one = compare(&compare_args(&trace, s(&map))).unwrap();
        assert_eq!(one.ops.len(), 1, "{name}");
        assert_eq!(one.summary.run_precision, Precision::Bf16.name(), "{name}");
        let (a, b) = (&one.ops[0], full.ops.iter().find(|o| o.op == op).unwrap());
        assert_eq!(a.held_at, Some(Precision::Bf16), "{name}");
        assert_eq!(
            (a.held_at, a.tolerance.to_bits(), &a.verdict),
            (b.held_at, b.tolerance.to_bits(), &b.verdict),
            "{name}: one-entry map vs --names hf"
        );
        assert!(!a.diverges(), "{name}: {:?}", a.reason);
    }
    // an F32 run stays F32 whatever the map holds
    let f32_trace = hf_tiny("trace-77.safetensors");
    let map = d.path().join("one.toml");
    std::fs::write(
        &map,
        "[map]\n\"model.layers.0.input_layernorm\" = \"L0.attn.norm\"\n",
    )
    .unwrap();
    let one = compare(&compare_args(&f32_trace, s(&map))).unwrap();
    assert_eq!(one.summary.run_precision, Precision::F32.name());
    assert!(!one.ops[0].diverges(), "{:?}", one.ops[0].reason);
}

// -------------------------------------------------------------------------------- contracts

/// README: a prompt in token chunks reports what the whole prompt does, bit for bit. Chunks of
/// 5 tokens (a GEMM of 5 rows; the whole prompt's has 64) over the built-in model.
#[test]
fn chunks_of_five_tokens_give_the_whole_prompts_records_bit_for_bit() {
    use nvfp4_probe::probe::{run, synthetic_tokens, RunOptions};
    let ck = nvfp4_probe::synth::builtin(0).unwrap();
    let cfg = ck.model_config().unwrap().clone();
    let go = |chunk: Option<usize>| {
        let opts = RunOptions {
            chunk,
            ..RunOptions::new((0, 4), synthetic_tokens(64, cfg.vocab_size, 0))
        };
        run(&ck, &opts).unwrap()
    };
    let (whole, chunked) = (go(None), go(Some(5)));
    let (a, b) = (
        serde_json::to_value(&whole.records).unwrap(),
        serde_json::to_value(&chunked.records).unwrap(),
    );
    for (x, y) in a.as_array().unwrap().iter().zip(b.as_array().unwrap()) {
        assert_eq!(y, x, "record of {}", x["id"]);
    }
    assert_eq!(
        serde_json::to_value(&chunked.summary).unwrap(),
        serde_json::to_value(&whole.summary).unwrap()
    );
}

/// Rewrites `name` in the shard holding it as an F32 tensor of shape [1, 10000] holding its
/// value 10000 times.
fn widen_scalar(dir: &Path, name: &str) -> String {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "safetensors") {
            continue;
        }
        let buf = std::fs::read(&p).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&buf).unwrap();
        let st = safetensors::SafeTensors::deserialize(&buf).unwrap();
        if !st.names().iter().any(|n| *n == name) {
            continue;
        }
        let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
            .collect();
        for t in owned.iter_mut().filter(|t| t.0 == name) {
            assert_eq!(t.1, safetensors::Dtype::F32, "{name}");
            assert_eq!(t.3.len(), 4, "{name} is a scalar");
            t.3 = t.3.repeat(10000);
            t.2 = vec![1, 10000];
        }
        let views: Vec<(String, safetensors::tensor::TensorView)> = owned
            .iter()
            .map(|(n, d, sh, b)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(*d, sh.clone(), b).unwrap(),
                )
            })
            .collect();
        let bytes = safetensors::serialize(views, meta.metadata().clone()).unwrap();
        std::fs::write(&p, bytes).unwrap();
        return p.file_name().unwrap().to_str().unwrap().to_string();
    }
    panic!("{name} in no shard");
}

#[test]
fn a_scalar_scale_of_ten_thousand_elements_is_unusable_input() {
    use nvfp4_probe::checkpoint::Naming;
    use nvfp4_probe::synth::{synth_to_dir, Format, Preset, SynthOptions};
    for (format, tensor) in [
        (
            Format::ModelOptNvfp4,
            "layers.1.ffn.experts.0.w1.weight_scale_2",
        ),
        (
            Format::ModelOptNvfp4,
            "layers.1.ffn.experts.0.w1.input_scale",
        ),
        (
            Format::CtNvfp4,
            "layers.1.ffn.experts.0.w1.weight_global_scale",
        ),
    ] {
        let d = tempfile::tempdir().unwrap();
        let m = d.path().join("m");
        let mut so = SynthOptions::new(Preset::Tiny, format, Naming::Official, 0);
        so.layers = Some(3);
        synth_to_dir(&so, &m).unwrap();
        let shard = widen_scalar(&m, tensor);
        let json = d.path().join("run.json");
        for args in [
            vec!["run", "--backend", "cpu", "--quiet", "--seq-len", "8"],
            vec!["bisect", "--backend", "cpu", "--seq-len", "8"],
            vec!["inspect"],
        ] {
            let mut a = args.clone();
            a.extend_from_slice(&["--model", s(&m)]);
            if args[0] == "run" {
                a.extend_from_slice(&["--json", s(&json)]);
            }
            let o = probe(&a);
            refused(&o, &[&shard, tensor, "[1, 10000]"]);
            assert!(!json.exists(), "no partial output");
        }
    }
}

#[test]
fn a_bad_id_in_a_tokens_file_names_the_file() {
    let d = tempfile::tempdir().unwrap();
    let ids = d.path().join("my-ids.json");
    for (text, needle) in [
        ("[1, 2, 999999]", "999999"),
        ("[1, 2, 512]", "vocab"),
        ("[1, -2, 3]", "-2"),
        ("[1, 2.5, 3]", "2.5"),
        ("[1, \"x\"]", "x"),
    ] {
        std::fs::write(&ids, text).unwrap();
        let o = probe(&[
            "run",
            "--backend",
            "cpu",
            "--quiet",
            "--layers",
            "0..0",
            "--tokens",
            s(&ids),
        ]);
        refused(&o, &["my-ids.json", needle]);
    }
    let o = probe(&[
        "run",
        "--backend",
        "cpu",
        "--quiet",
        "--layers",
        "0..0",
        "--token-ids",
        "1,999999",
    ]);
    refused(&o, &["--token-ids", "999999"]);
}

#[test]
fn fault_targets_outside_the_layers_run_are_refused_naming_target_and_range() {
    let o = probe(&[
        "run",
        "--backend",
        "cpu",
        "--quiet",
        "--layers",
        "0..1",
        "--loader-fault",
        "inverted-input-scale@L3.ffn.experts",
    ]);
    refused(
        &o,
        &["inverted-input-scale@L3.ffn.experts", "--layers 0..1"],
    );
    let o = probe(&[
        "bisect",
        "--backend",
        "cpu",
        "--layers",
        "2..4",
        "--loader-fault",
        "inverted-input-scale@L1.ffn.experts",
    ]);
    refused(
        &o,
        &["inverted-input-scale@L1.ffn.experts", "--layers 2..4"],
    );
    let o = probe(&[
        "run",
        "--backend",
        "cpu",
        "--quiet",
        "--layers",
        "0..1",
        "--served-chunk",
        "16",
        "--engine-fault",
        "compressor-state-lost@L3",
    ]);
    refused(&o, &["compressor-state-lost@L3", "--layers 0..1"]);
    // inside the range it runs, and the fault shows
    let o = probe(&[
        "run",
        "--backend",
        "cpu",
        "--quiet",
        "--layers",
        "0..3",
        "--seq-len",
        "16",
        "--loader-fault",
        "inverted-input-scale@L3.ffn.experts",
    ]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}
