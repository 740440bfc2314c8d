//! Hugging Face transformers' own DeepseekV4ForCausalLM, run on a `synth --format bf16 --naming hf` checkpoint
//! (loaded by transformers with no missing or unexpected keys), captured with probes/capture/hf_capture.py:
//! `compare --names hf` must find every mapped op within the oracle's BF16 noise.
//! Made with: `nvfp4-probe synth --preset tiny --format bf16 --naming hf --seed 11 --out M` and
//! `python3 probes/capture/hf_capture.py --model M --tokens tests/data/synth-hf-trace-150.tokens.json
//! --rows 0,1,2,63,127,128,129,149 --out tests/data/synth-hf-trace-150.safetensors`
//! (transformers 5.17.0, torch 2.11.0, CPU, float32; recaptured on the H200 machine 2026-12-02 for the structured tiny weights). The trace holds the weights' activations: it must be
//! captured again whenever the tiny preset's generated weights change (src/synth/gen.rs, plan.rs).

use assert_cmd::Command;
use nvfp4_probe::checkpoint::Naming;
use nvfp4_probe::synth::{synth_to_dir, Format, Preset, SynthOptions};

#[test]
fn transformers_trace_on_a_synth_checkpoint_compares_clean() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    synth_to_dir(
        &SynthOptions::new(Preset::Tiny, Format::Bf16, Naming::Hf, 11),
        &model,
    )
    .unwrap();
    let trace = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/synth-hf-trace-150.safetensors");
    let json = dir.path().join("c.json");
    Command::cargo_bin("nvfp4-probe")
        .unwrap()
        .args(["compare", "--names", "hf", "--model"])
        .arg(&model)
        .arg("--trace")
        .arg(&trace)
        .arg("--json")
        .arg(&json)
        .assert()
        .code(0)
        .stdout(predicates::str::contains("clean"));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let ops = v["ops"].as_array().unwrap();
    assert!(ops.len() > 100, "only {} ops compared", ops.len());
    // non-index ops against the FP32 oracle: transformers ran in float32 on the same BF16 weights
    let mut worst = 0f64;
    for o in ops.iter().filter(|o| o["agreement"].is_null()) {
        worst = worst.max(o["vs_fp32"]["rel_l2"].as_f64().unwrap());
    }
    assert!(worst < 1e-4, "worst rel-L2 vs the FP32 oracle {worst}");
}
