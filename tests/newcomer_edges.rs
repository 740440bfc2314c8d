//! Issue 44's "newcomer's hour": what an outside tester met in the first hour. Every command's
//! terminal output fits 120 columns when stdout is not a terminal; the markdown report opens
//! with the findings; the plots draw the tolerance and mark divergent ops; the help names no
//! source code; lint does not warn about an ignore list naming the unquantized embedding; bisect
//! names an HF checkpoint's weights as the checkpoint does.

use assert_cmd::Command;
use std::path::{Path, PathBuf};

fn bin() -> Command {
    Command::cargo_bin("nvfp4-probe").unwrap()
}

/// Runs the binary with stdout captured (not a terminal) and returns (exit code, stdout).
fn run(args: &[&str], cwd: &Path) -> (i32, String) {
    let out = bin().current_dir(cwd).args(args).output().expect("run");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).expect("UTF-8 stdout"),
    )
}

/// Every line of `text` at most 120 characters (not bytes: the tables' borders are 3 bytes each).
fn assert_fits(what: &str, text: &str) {
    let long: Vec<(usize, &str)> = text
        .lines()
        .map(|l| (l.chars().count(), l))
        .filter(|(n, _)| *n > 120)
        .collect();
    assert!(
        long.is_empty(),
        "{what}: {} line(s) over 120 columns, e.g. {} columns:\n{}",
        long.len(),
        long[0].0,
        long[0].1
    );
}

fn synth(dir: &Path, args: &[&str]) -> PathBuf {
    let out = dir.join(args.join("_").replace(['@', '.', '-'], "_"));
    let mut a: Vec<&str> = vec!["synth"];
    a.extend(args);
    let o = out.to_str().unwrap();
    a.extend(["--out", o]);
    bin().args(&a).assert().success();
    out
}

fn repo(rel: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(rel)
        .to_str()
        .unwrap()
        .to_string()
}

const FAULT: &str = "inverted-input-scale@L3.ffn.experts";

#[test]
fn run_and_bisect_and_gate_fit_120_columns() {
    let d = tempfile::tempdir().unwrap();
    let (code, s) = run(&["run", "--layers", "0..4", "--backend", "cpu"], d.path());
    assert_eq!(code, 0, "{s}");
    assert!(s.contains("┌") && s.contains("L4.attn.indexer"), "{s}");
    assert!(
        s.replace('\n', " ").contains("status: DIVERGES ="),
        "the legend: {s}"
    );
    assert_fits("run", &s);
    // one line per op: a table row is never wrapped on the default width
    let rows = s.lines().filter(|l| l.starts_with("│ L")).count();
    assert_eq!(rows, 5 * 20 + 6, "{s}");

    let json = d.path().join("f.json");
    let (code, s) = run(
        &[
            "run",
            "--layers",
            "0..4",
            "--backend",
            "cpu",
            "--loader-fault",
            FAULT,
            "--json",
            json.to_str().unwrap(),
        ],
        d.path(),
    );
    assert_eq!(code, 1, "{s}");
    assert!(s.contains("DIVERGES"), "{s}");
    assert_fits("run with a fault", &s);

    let (code, s) = run(
        &[
            "gate",
            "--baseline",
            &repo("reports/baseline.json"),
            "--current",
            json.to_str().unwrap(),
        ],
        d.path(),
    );
    assert_eq!(code, 1, "{s}");
    assert!(s.contains("FAIL L3.ffn.experts"), "{s}");
    assert_fits("gate", &s);

    let (code, s) = run(
        &[
            "bisect",
            "--layers",
            "0..4",
            "--backend",
            "cpu",
            "--loader-fault",
            FAULT,
        ],
        d.path(),
    );
    assert_eq!(code, 1, "{s}");
    assert!(
        s.contains("hypotheses at L3.ffn.experts") && s.contains("┌"),
        "{s}"
    );
    assert_fits("bisect", &s);
}

#[test]
fn lint_and_inspect_fit_120_columns() {
    let d = tempfile::tempdir().unwrap();
    for (ck, rule) in [
        (
            synth(
                d.path(),
                &[
                    "--family",
                    "qwen3-moe",
                    "--format",
                    "ct-nvfp4",
                    "--fault",
                    "inverted-input-scale@L1.ffn.experts",
                ],
            ),
            "scale.convention",
        ),
        (
            synth(
                d.path(),
                &[
                    "--family",
                    "qwen3-moe",
                    "--format",
                    "modelopt-nvfp4",
                    "--fault",
                    "w13-scale-mismatch@L1.ffn.experts",
                ],
            ),
            "fused.mismatch",
        ),
        (
            synth(
                d.path(),
                &[
                    "--format",
                    "ct-nvfp4",
                    "--fault",
                    "swizzled-scales@L2.ffn.experts",
                ],
            ),
            "layout.swizzled",
        ),
    ] {
        let m = ck.to_str().unwrap();
        for verbose in [false, true] {
            let mut a = vec!["lint", "--model", m];
            if verbose {
                a.push("--verbose");
            }
            let (code, s) = run(&a, d.path());
            assert_eq!(code, 1, "{s}");
            assert!(s.contains(rule) && s.contains("fix: "), "{s}");
            assert_fits(&format!("lint {m} (verbose {verbose})"), &s);
        }
        for a in [
            vec!["inspect", "--model", m],
            vec!["inspect", "--model", m, "--all"],
        ] {
            let (code, s) = run(&a, d.path());
            assert_eq!(code, 0, "{s}");
            assert!(s.contains("┌"), "{s}");
            assert_fits(&format!("{a:?}"), &s);
        }
    }
}

#[test]
fn synth_fault_list_fits_120_columns() {
    let d = tempfile::tempdir().unwrap();
    let (code, s) = run(&["synth", "--list-faults"], d.path());
    assert_eq!(code, 0, "{s}");
    assert!(s.contains("missing-block-scales") && s.contains("inverted-input-scale"));
    assert_fits("synth --list-faults", &s);
}

#[test]
fn compare_fits_120_columns() {
    let d = tempfile::tempdir().unwrap();
    let (code, s) = run(
        &[
            "compare",
            "--model",
            &repo("tests/data/hf-tiny"),
            "--trace",
            &repo("tests/data/hf-tiny/trace-77-bf16.safetensors"),
            "--names",
            "hf",
        ],
        d.path(),
    );
    assert_eq!(code, 0, "{s}");
    assert!(
        s.contains("model.layers.4") && s.contains("clean: all"),
        "{s}"
    );
    assert_fits("compare", &s);
}

/// The report's findings (and the first divergent op) come before the tables.
#[test]
fn the_markdown_report_opens_with_the_findings() {
    let d = tempfile::tempdir().unwrap();
    let md = d.path().join("r.md");
    let (code, _) = run(
        &[
            "run",
            "--layers",
            "0..4",
            "--backend",
            "cpu",
            "--quiet",
            "--loader-fault",
            FAULT,
            "--markdown",
            md.to_str().unwrap(),
        ],
        d.path(),
    );
    assert_eq!(code, 1);
    let m = std::fs::read_to_string(&md).unwrap();
    let at = |s: &str| m.find(s).unwrap_or_else(|| panic!("no `{s}` in\n{m}"));
    let first_table = at("| Step | Op |");
    assert!(at("first divergent op (isolated): L3.ffn.experts") < first_table);
    assert!(at("## Findings") < first_table);
    let finding = m[at("## Findings")..first_table].to_string();
    assert!(
        finding.contains("`L3.ffn.experts`") && finding.contains("harmful"),
        "{finding}"
    );
    assert!(at("## Findings") < at("## Details"));
    assert_eq!(m.matches("## Findings").count(), 1);
}

/// The cos plot draws each op's tolerance and marks the divergent op; the heat map outlines its
/// cell; a clean run's plots mark nothing.
#[test]
fn plots_draw_the_tolerance_and_mark_divergent_ops() {
    let d = tempfile::tempdir().unwrap();
    for (fault, stem) in [(Some(FAULT), "bad"), (None, "good")] {
        let plot = d.path().join(format!("{stem}.svg"));
        let mut a = vec![
            "run",
            "--layers",
            "0..4",
            "--backend",
            "cpu",
            "--quiet",
            "--plot",
            plot.to_str().unwrap(),
        ];
        if let Some(f) = fault {
            a.extend(["--loader-fault", f]);
        }
        run(&a, d.path());
        let read = |k: &str| {
            std::fs::read_to_string(d.path().join(format!("{stem}-{k}.svg")))
                .unwrap_or_else(|e| panic!("{stem}-{k}: {e}"))
        };
        let (cos, heat, amax) = (read("cos"), read("heatmap"), read("amax"));
        assert!(
            cos.contains("tolerance"),
            "{stem}: no tolerance in the cos plot"
        );
        // the divergent op's red marks (rgb 200,0,0) and their legend entry
        let red = |svg: &str| svg.contains("#C80000") || svg.contains("rgb(200,0,0)");
        let marked = fault.is_some();
        for (what, svg) in [("cos", &cos), ("heatmap", &heat), ("amax", &amax)] {
            assert_eq!(svg.contains("diverges"), marked, "{stem} {what}: legend");
            assert_eq!(red(svg), marked, "{stem} {what}: red marks");
        }
    }
}

/// `nvfp4-probe help` and every subcommand's `--help` speak to users: no Rust paths, no
/// constants, no notes about tests, no PTX instruction names; they say which model families
/// are served, what `--served` profiles do, and `selftest --backend` offers what it accepts.
#[test]
fn help_texts_name_no_source_code() {
    let subs = [
        "run", "inspect", "synth", "lint", "bisect", "gate", "plot", "compare", "selftest",
    ];
    let mut all = Vec::new();
    let top = String::from_utf8(bin().arg("--help").output().unwrap().stdout).unwrap();
    let help = String::from_utf8(bin().arg("help").output().unwrap().stdout).unwrap();
    for s in subs {
        assert!(help.contains(s), "`help` lists no {s}");
        let h = String::from_utf8(bin().args([s, "--help"]).output().unwrap().stdout).unwrap();
        assert!(h.contains("Usage:"), "{s} --help: {h}");
        all.push((s.to_string(), h));
    }
    all.push(("--help".into(), top.clone()));
    all.push(("help".into(), help));
    let constant = regex::Regex::new(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]+\b").unwrap();
    for (what, h) in &all {
        for bad in [
            "::",
            "a test keeps",
            "rcp.approx",
            ".rs`",
            "src/",
            "crate",
            "TODO",
        ] {
            assert!(!h.contains(bad), "{what} help contains `{bad}`:\n{h}");
        }
        for m in constant.find_iter(h) {
            // an environment variable the user sets, a value's placeholder, is no source name
            assert!(
                h[..m.start()].ends_with(['$', '<']),
                "{what} help names the constant `{}`",
                m.as_str()
            );
        }
    }
    for fam in ["Qwen3-MoE", "DeepSeek-V3", "gpt-oss"] {
        assert!(top.contains(fam), "top-level help omits {fam}");
        let synth = &all.iter().find(|(s, _)| s == "synth").unwrap().1;
        assert!(
            synth.to_lowercase().contains(&fam.to_lowercase()),
            "synth help omits {fam}"
        );
    }
    let run_help = &all[0].1;
    for p in ["blackwell-w4a4 (", "hopper-w4a16 (", "emulation ("] {
        assert!(run_help.contains(p), "run --help does not explain {p}");
    }
    let selftest = &all.iter().find(|(s, _)| s == "selftest").unwrap().1;
    assert!(
        selftest.contains("- cuda:") && !selftest.contains("- cpu:"),
        "{selftest}"
    );
}

/// Releases list the unquantized embedding and head in their ignore list: that is normal, no
/// warning. An entry naming no module still warns.
#[test]
fn lint_accepts_an_ignore_list_naming_the_embedding() {
    let d = tempfile::tempdir().unwrap();
    let ck = synth(d.path(), &["--family", "qwen3-moe", "--format", "ct-nvfp4"]);
    let cfg = ck.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    let ign = c["quantization_config"]["ignore"].as_array_mut().unwrap();
    ign.extend([
        "model.embed_tokens".into(),
        "lm_head".into(),
        "model.norm".into(),
    ]);
    std::fs::write(&cfg, serde_json::to_string(&c).unwrap()).unwrap();
    let (code, s) = run(&["lint", "--model", ck.to_str().unwrap()], d.path());
    assert_eq!(code, 0, "{s}");
    assert!(!s.contains("config.ignore"), "{s}");
    assert!(s.contains("0 warning(s)"), "{s}");
    // a stale entry still warns
    let ign = c["quantization_config"]["ignore"].as_array_mut().unwrap();
    ign.push("model.layers.9.mlp.gate".into());
    std::fs::write(&cfg, serde_json::to_string(&c).unwrap()).unwrap();
    let (_, s) = run(&["lint", "--model", ck.to_str().unwrap()], d.path());
    assert!(
        s.contains("config.ignore") && s.contains("model.layers.9.mlp.gate"),
        "{s}"
    );
    assert!(!s.contains("embed_tokens"), "{s}");
}

/// bisect's hypotheses name an HF checkpoint's weights as the checkpoint does (`gate_proj`,
/// not DeepSeek's `w1`).
#[test]
fn bisect_names_the_checkpoints_own_weights() {
    let d = tempfile::tempdir().unwrap();
    let ck = synth(d.path(), &["--family", "qwen3-moe", "--format", "ct-nvfp4"]);
    let (code, s) = run(
        &[
            "bisect",
            "--model",
            ck.to_str().unwrap(),
            "--backend",
            "cpu",
            "--loader-fault",
            "inverted-input-scale@L1.ffn.experts",
        ],
        d.path(),
    );
    assert_eq!(code, 1, "{s}");
    let table = &s[s.find("hypotheses at").expect(&s)..];
    assert!(table.contains("gate_proj"), "{table}");
    for v4 in ["(w1", "w1,", "(w2", "(w3"] {
        assert!(!s.contains(v4), "`{v4}` in\n{s}");
    }
    assert_fits("bisect of a Qwen3 checkpoint", &s);
}

/// A trace without `input_ids` is refused with what to pass, `--seq-len` included.
#[test]
fn a_trace_without_input_ids_says_what_to_pass() {
    use nvfp4_probe::trace::read::{write, WriteDtype};
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("t.safetensors");
    let t = nvfp4_probe::Tensor::new(vec![64, 8], vec![0.5f32; 64 * 8]);
    write(&p, &[("embed".to_string(), t)], WriteDtype::F32, None, &[]).unwrap();
    let out = bin()
        .current_dir(d.path())
        .args(["compare", "--trace", p.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("input_ids") && err.contains("--seq-len N"),
        "{err}"
    );
}
