//! compare + bisect: an engine trace that diverges where the checkpoint itself explains it gets bisect's
//! scale attribution (here a ModelOpt input_scale stored as its reciprocal for the experts of layer 1).

use assert_cmd::Command;
use nvfp4_probe::checkpoint::{Checkpoint, Naming};
use nvfp4_probe::probe::{run, synthetic_tokens, RunOptions};
use nvfp4_probe::served::faults::Fault;
use nvfp4_probe::synth::{synth_to_dir, Format, Preset, SynthOptions};
use nvfp4_probe::trace::read::{write, WriteDtype};

#[test]
fn trace_divergence_explained_by_the_checkpoint_gets_a_verdict() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    let mut so = SynthOptions::new(Preset::Tiny, Format::ModelOptNvfp4, Naming::Official, 4);
    so.faults = vec![Fault::parse("inverted-input-scale@L1.ffn.experts").unwrap()];
    synth_to_dir(&so, &model).unwrap();
    let ckpt = Checkpoint::open(&model).unwrap();
    let tokens = synthetic_tokens(24, ckpt.model_config().unwrap().vocab_size, 9);
    // the "engine": our served emulation on this checkpoint, dumped under op ids
    let res = run(
        &ckpt,
        &RunOptions {
            keep_outputs: true,
            ..RunOptions::new((0, 1), tokens.clone())
        },
    )
    .unwrap();
    let served: Vec<_> = res.outputs["served"]
        .iter()
        .filter(|(id, _)| id.starts_with("L0.") || id.starts_with("L1."))
        .cloned()
        .collect();
    let trace = dir.path().join("trace.safetensors");
    write(&trace, &served, WriteDtype::Bf16, Some(&tokens), &[]).unwrap();
    let json = dir.path().join("c.json");
    let out = Command::cargo_bin("nvfp4-probe")
        .unwrap()
        .args(["compare", "--names", "official", "--model"])
        .arg(&model)
        .arg("--trace")
        .arg(&trace)
        .arg("--json")
        .arg(&json)
        .assert()
        .code(1)
        .get_output()
        .stdout
        .clone();
    let text = String::from_utf8_lossy(&out);
    assert!(text.contains("L1.ffn.experts"), "{text}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let a = v["summary"]["attribution"]
        .as_str()
        .or(v["attribution"].as_str())
        .unwrap_or_default()
        .to_string();
    assert!(
        a.contains("L1.ffn.experts") && a.to_lowercase().contains("convention"),
        "attribution: {a}\n{v}"
    );
}
