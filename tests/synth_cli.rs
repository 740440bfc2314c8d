//! The `synth` command line: the fault catalogue, a written checkpoint, refusals with exit 2.

use assert_cmd::Command;
use nvfp4_probe::served::faults::FaultKind;

fn bin() -> Command {
    Command::cargo_bin("nvfp4-probe").unwrap()
}

#[test]
fn list_faults_lists_every_kind() {
    let out = bin().args(["synth", "--list-faults"]).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    // one entry per kind; a long description wraps onto indented lines (120 columns when piped)
    let mut entries: Vec<String> = Vec::new();
    for l in text.lines() {
        match (l.starts_with(' '), entries.last_mut()) {
            (true, Some(e)) => {
                e.push(' ');
                e.push_str(l.trim_start());
            }
            _ => entries.push(l.to_string()),
        }
    }
    assert!(text.lines().all(|l| l.chars().count() <= 120), "{text}");
    assert_eq!(entries.len(), FaultKind::every().count());
    for k in FaultKind::every() {
        assert!(
            entries
                .iter()
                .any(|l| l.starts_with(k.name()) && l.contains(k.describe())),
            "{} missing",
            k.name()
        );
    }
}

#[test]
fn writes_an_openable_checkpoint_with_a_fault() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("m");
    bin()
        .args([
            "synth",
            "--preset",
            "tiny",
            "--format",
            "modelopt-nvfp4",
            "--naming",
            "hf",
        ])
        .args([
            "--seed",
            "9",
            "--fault",
            "zero-input-scale@L1.ffn.expert.0.w1",
            "--out",
        ])
        .arg(&out)
        .assert()
        .success();
    let ck = nvfp4_probe::checkpoint::Checkpoint::open(&out).unwrap();
    assert!(out.join("hf_quant_config.json").is_file());
    let m = ck.weight_meta("layers.1.ffn.experts.0.w1").unwrap();
    assert_eq!(m.input_global, Some(0.0));
    assert_eq!(
        m.tensors.input_scale.as_deref(),
        Some("model.layers.1.mlp.experts.0.gate_proj.input_scale")
    );
}

#[test]
fn refusals_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    for (args, msg) in [
        (vec!["--fault", "missing-alpha@L1.attn.q_a"], "loader-only"),
        (
            vec!["--format", "bf16", "--fault", "nibble-swap@L1.ffn.experts"],
            "does not apply",
        ),
        (vec!["--fault", "bogus@L1.attn.q_a"], "unknown kind"),
        (vec!["--format", "fp3"], "unknown format"),
    ] {
        bin()
            .arg("synth")
            .args(&args)
            .arg("--out")
            .arg(dir.path().join("x"))
            .assert()
            .code(2)
            .stderr(predicates::str::contains(msg));
    }
}
