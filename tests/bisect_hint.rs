//! `bisect` on a broken scale the oracle shares (nothing diverges, an anomaly) names the stored
//! tensor to look at — the one plain `lint` names — not just "check with lint".

use std::process::Command;

use nvfp4_probe::checkpoint::Naming;
use nvfp4_probe::served::faults::Fault;
use nvfp4_probe::synth::{synth_to_dir, Format, Preset, SynthOptions};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_nvfp4-probe"))
}

fn stdout(args: &[&str], model: &std::path::Path) -> (Option<i32>, String) {
    let o = bin().args(args).arg("--model").arg(model).output().unwrap();
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
    )
}

#[test]
fn nan_block_scale_anomaly_names_the_tensor_lint_names() {
    let d = tempfile::tempdir().unwrap();
    let mut so = SynthOptions::new(Preset::Tiny, Format::CtNvfp4, Naming::Official, 5);
    so.faults = vec![Fault::parse("nan-block-scale@L1.attn.q_b").unwrap()];
    synth_to_dir(&so, d.path()).unwrap();
    let (code, lint) = stdout(&["lint"], d.path());
    assert_eq!(code, Some(1), "{lint}");
    let tensor = "layers.1.attn.wq_b.weight_scale";
    assert!(lint.contains(tensor), "{lint}");
    let (code, out) = stdout(
        &[
            "bisect",
            "--layers",
            "0..1",
            "--seq-len",
            "16",
            "--backend",
            "cpu",
        ],
        d.path(),
    );
    assert_eq!(code, Some(1), "{out}");
    // the line with its continuations (terminal output wraps at 120 columns, indenting them)
    let mut lines = out
        .lines()
        .skip_while(|l| !l.starts_with("anomaly: L1.attn.q_b"));
    let mut line = lines
        .next()
        .unwrap_or_else(|| panic!("no anomaly at L1.attn.q_b: {out}"))
        .to_string();
    for l in lines.take_while(|l| l.starts_with("  ")) {
        line.push(' ');
        line.push_str(l.trim_start());
    }
    assert!(line.contains(&format!("`{tensor}`")), "{line}");
    assert!(line.contains("block scales are NaN"), "{line}");
    assert!(
        line.contains(&format!("lint --model {}", d.path().display())),
        "{line}"
    );
}
