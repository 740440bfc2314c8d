//! reports/baseline.json is the built-in model's committed run; regenerating it must pass the gate, and a
//! run with a planted loader fault must fail it naming the faulty op.

use assert_cmd::Command;
use std::path::Path;

fn baseline() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("reports/baseline.json")
}

#[test]
fn regenerated_run_passes_the_gate_against_the_committed_baseline() {
    let dir = tempfile::tempdir().unwrap();
    let cur = dir.path().join("current.json");
    let summary = dir.path().join("summary.md");
    let junit = dir.path().join("junit.xml");
    // the README's regeneration command, written elsewhere
    Command::cargo_bin("nvfp4-probe")
        .unwrap()
        .args(["run", "--layers", "0..4", "--quiet", "--json"])
        .arg(&cur)
        .assert()
        .code(0);
    Command::cargo_bin("nvfp4-probe")
        .unwrap()
        .args(["gate", "--baseline"])
        .arg(baseline())
        .arg("--current")
        .arg(&cur)
        .arg("--summary")
        .arg(&summary)
        .arg("--junit")
        .arg(&junit)
        .assert()
        .code(0);
    let md = std::fs::read_to_string(&summary).unwrap();
    assert!(md.to_lowercase().contains("pass"), "{md}");
    let xml = std::fs::read_to_string(&junit).unwrap();
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(baseline()).unwrap()).unwrap();
    assert_eq!(
        xml.matches("<testcase").count(),
        v["ops"].as_array().unwrap().len()
    );
}

#[test]
fn planted_loader_fault_fails_the_gate_at_that_op() {
    let dir = tempfile::tempdir().unwrap();
    let cur = dir.path().join("current.json");
    Command::cargo_bin("nvfp4-probe")
        .unwrap()
        .args([
            "run",
            "--layers",
            "0..4",
            "--quiet",
            "--loader-fault",
            "missing-alpha@L3.ffn.experts",
            "--json",
        ])
        .arg(&cur)
        .assert()
        .code(1);
    let out = Command::cargo_bin("nvfp4-probe")
        .unwrap()
        .args(["gate", "--baseline"])
        .arg(baseline())
        .arg("--current")
        .arg(&cur)
        .assert()
        .code(1)
        .get_output()
        .stdout
        .clone();
    let text = String::from_utf8_lossy(&out);
    assert!(text.contains("L3.ffn.experts"), "{text}");
    // nothing before layer 3 regressed
    assert!(!text.contains("L2.ffn.experts"), "{text}");
}
