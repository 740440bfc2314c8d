//! reports/baseline.json is the built-in model's committed run; regenerating it must pass the gate, and a
//! run with a planted loader fault must fail it naming the faulty op. The committed reports must also
//! equal a fresh regeneration (no drift): see [`committed_reports_equal_a_fresh_regeneration`].

use assert_cmd::Command;
use serde_json::Value;
use std::path::{Path, PathBuf};

fn baseline() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("reports/baseline.json")
}

/// The regeneration command (README, "reports/"), with the output paths as arguments.
const REGENERATE: &str = "cargo run --release -- run --layers 0..4 --backend cpu \
     --json reports/baseline.json --markdown reports/baseline.md --plot reports/baseline.png";

/// Top-level run-JSON fields left out of the drift comparison, and why: `seconds` is wall time;
/// `device` names the host (its thread count); `bytes_read` is the loader's I/O accounting, which
/// depends on how far its prefetcher reads ahead, not on the numbers. Everything else — the
/// checkpoint and token fingerprints, the spec, every op's stats and metrics, the verdicts — is a
/// deterministic function of the code on the CPU backend (the CPU numerics do not depend on the
/// thread count) and must match exactly.
const EXCLUDED: [&str; 3] = ["seconds", "device", "bytes_read"];

/// Paths (JSON pointer style) where `a` and `b` differ, at most `limit`.
fn diff(a: &Value, b: &Value, path: &str, out: &mut Vec<String>, limit: usize) {
    if out.len() >= limit {
        return;
    }
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for k in x.keys().chain(y.keys().filter(|k| !x.contains_key(*k))) {
                if path.is_empty() && EXCLUDED.contains(&k.as_str()) {
                    continue;
                }
                match (x.get(k), y.get(k)) {
                    (Some(u), Some(v)) => diff(u, v, &format!("{path}/{k}"), out, limit),
                    _ => out.push(format!("{path}/{k}: present in only one")),
                }
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (u, v)) in x.iter().zip(y).enumerate() {
                // name ops by id, not by index
                let key = u["id"].as_str().map(String::from).unwrap_or(i.to_string());
                diff(u, v, &format!("{path}/{key}"), out, limit);
            }
        }
        _ if a != b => out.push(format!("{path}: committed {a} vs fresh {b}")),
        _ => {}
    }
}

/// Baseline drift is a failure: the README's regeneration command, run here into a temporary
/// directory, must reproduce `reports/baseline.json` (all fields but [`EXCLUDED`]),
/// `reports/baseline.md` and the three `reports/baseline-*.png` byte for byte.
#[test]
fn committed_reports_equal_a_fresh_regeneration() {
    let reports = Path::new(env!("CARGO_MANIFEST_DIR")).join("reports");
    let dir = tempfile::tempdir().unwrap();
    let p = |f: &str| -> PathBuf { dir.path().join(f) };
    Command::cargo_bin("nvfp4-probe")
        .unwrap()
        .args([
            "run",
            "--layers",
            "0..4",
            "--backend",
            "cpu",
            "--quiet",
            "--json",
        ])
        .arg(p("baseline.json"))
        .arg("--markdown")
        .arg(p("baseline.md"))
        .arg("--plot")
        .arg(p("baseline.png"))
        .assert()
        .code(0);
    let read = |d: &Path, f: &str| std::fs::read(d.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
    let json = |d: &Path| -> Value { serde_json::from_slice(&read(d, "baseline.json")).unwrap() };
    let mut moved = Vec::new();
    diff(&json(&reports), &json(dir.path()), "", &mut moved, 20);
    assert!(
        moved.is_empty(),
        "reports/baseline.json drifted from a fresh run (first {} differences):\n{}\nregenerate with:\n{REGENERATE}",
        moved.len(),
        moved.join("\n")
    );
    for f in [
        "baseline.md",
        "baseline-amax.png",
        "baseline-cos.png",
        "baseline-heatmap.png",
    ] {
        assert!(
            read(&reports, f) == read(dir.path(), f),
            "reports/{f} differs from a fresh regeneration; regenerate with:\n{REGENERATE}"
        );
    }
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
