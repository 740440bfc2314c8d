//! Plots from a hand-written run JSON: the three files appear under the expected names, are
//! non-empty, and are real PNG / SVG documents.

use assert_cmd::Command;
use nvfp4_probe::plot::plot_run;

const RUN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/gate/base.json");

fn run_text() -> String {
    std::fs::read_to_string(RUN).unwrap()
}

#[test]
fn png_plots_have_the_expected_names_and_are_pngs() {
    let d = tempfile::tempdir().unwrap();
    let written = plot_run(&run_text(), &d.path().join("current.png")).unwrap();
    let names: Vec<String> = written
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        ["current-amax.png", "current-cos.png", "current-heatmap.png"]
    );
    for p in &written {
        let bytes = std::fs::read(p).unwrap();
        assert!(
            bytes.len() > 10_000,
            "{} is only {} bytes",
            p.display(),
            bytes.len()
        );
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{}", p.display());
        // IHDR width and height: at least the minimum canvas
        let w = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
        let h = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
        assert!(w >= 900 && h >= 480, "{w}x{h}");
    }
}

#[test]
fn svg_plots_carry_titles_axis_labels_and_legends() {
    let d = tempfile::tempdir().unwrap();
    let written = plot_run(&run_text(), &d.path().join("r.svg")).unwrap();
    assert_eq!(written.len(), 3);
    let text: Vec<String> = written
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect();
    for (t, p) in text.iter().zip(&written) {
        assert!(t.starts_with("<svg"), "{}", p.display());
        assert!(t.trim_end().ends_with("</svg>"), "{}", p.display());
        // the y-axis description is rotated a quarter turn
        assert!(t.contains("rotate(270"), "{}", p.display());
    }
    assert!(
        text[0].contains("amax per op")
            && text[0].contains("oracle_fp32")
            && text[0].contains("served")
    );
    assert!(text[0].contains("L1.ffn.experts"));
    assert!(
        text[1].contains("1 − cos")
            && text[1].contains("noise floor")
            && text[1].contains("isolated")
    );
    assert!(
        text[2].contains("rel-L2") && text[2].contains("ffn.experts") && text[2].contains("L2")
    );
    // op kinds on the heatmap drop the layer prefix
    assert!(!text[2].contains(">L1.ffn.experts<"));
}

#[test]
fn a_run_with_non_finite_values_still_plots() {
    let mut v: serde_json::Value = serde_json::from_str(&run_text()).unwrap();
    for o in v["ops"].as_array_mut().unwrap().iter_mut().skip(10).take(3) {
        o["stats"]["served"]["nan"] = serde_json::json!(5);
        o["stats"]["served"]["amax"] = serde_json::Value::Null;
        o["served_propagated_vs_bf16"]["cos"] = serde_json::Value::Null;
        o["served_isolated_vs_bf16"]["rel_l2"] = serde_json::Value::Null;
        o["stats"]["served_isolated"]["inf"] = serde_json::json!(1);
    }
    let d = tempfile::tempdir().unwrap();
    let written = plot_run(&v.to_string(), &d.path().join("nf.svg")).unwrap();
    let heat = std::fs::read_to_string(&written[2]).unwrap();
    assert!(heat.contains("NaN/Inf"));
    let cos = std::fs::read_to_string(&written[1]).unwrap();
    assert!(cos.contains("cosine undefined"));
}

#[test]
fn bad_extension_and_bad_json_are_errors() {
    let d = tempfile::tempdir().unwrap();
    let e = plot_run(&run_text(), &d.path().join("x.jpg")).unwrap_err();
    assert!(e.to_string().contains(".png or .svg"), "{e}");
    assert!(plot_run("{\"schema\": \"other\"}", &d.path().join("x.png")).is_err());
}

#[test]
fn plot_command_writes_three_files() {
    let d = tempfile::tempdir().unwrap();
    Command::cargo_bin("nvfp4-probe")
        .unwrap()
        .args(["plot", RUN, "--out"])
        .arg(d.path().join("stem.png"))
        .assert()
        .code(0);
    for k in ["amax", "cos", "heatmap"] {
        let p = d.path().join(format!("stem-{k}.png"));
        assert!(std::fs::metadata(&p).unwrap().len() > 0, "{}", p.display());
    }
    Command::cargo_bin("nvfp4-probe")
        .unwrap()
        .args(["plot", "/nonexistent/run.json", "--out"])
        .arg(d.path().join("s.png"))
        .assert()
        .code(2)
        .stderr(predicates::str::contains("/nonexistent/run.json"));
}
