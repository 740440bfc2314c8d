//! `run` and `bisect` never report clean over a lint error: on every bad-scale checkpoint `lint`
//! flags with an error, both exit 1 and name each tensor lint names. Many of these faults are
//! invisible to the op-by-op comparison — the oracle decodes the same broken scale (a zero or
//! infinite weight tensor scale), or the engine's fused max takes the sibling's healthy
//! activation scale — so the run's own lint of the layers it read is what catches them. Faults
//! come from `synth --fault` and from editing one stored scalar of a clean checkpoint, in the
//! ways `tests/lint_faults.rs` builds them.

mod verdict_support;

use nvfp4_probe::lint::{lint_dir, Rules, Severity};
use nvfp4_probe::synth::Format;
use verdict_support::*;

/// One stored scalar of a clean checkpoint replaced: (format, tensor, value).
fn scalar_cases() -> Vec<(Format, String, f32)> {
    let mut v = Vec::new();
    for (format, w, i) in [
        (Format::CtNvfp4, "weight_global_scale", "input_global_scale"),
        (Format::ModelOptNvfp4, "weight_scale_2", "input_scale"),
    ] {
        for (base, leaf, value) in [
            ("layers.1.attn.wq_a", w, 0.0),
            ("layers.2.attn.wq_b", w, f32::INFINITY),
            ("layers.3.ffn.shared_experts.w2", w, f32::NAN),
            ("layers.1.ffn.experts.2.w1", w, -2.0e-4),
            ("layers.4.attn.wo_b", w, 1e-40),
            ("layers.2.attn.wkv", i, 0.0),
            ("layers.3.attn.wq_b", i, f32::NAN),
            ("layers.1.ffn.shared_experts.w1", i, -1.0e-3),
            ("layers.4.ffn.experts.5.w2", i, 1e-40),
            ("layers.0.attn.wo_b", i, f32::INFINITY),
        ] {
            v.push((format, format!("{base}.{leaf}"), value));
        }
    }
    v
}

/// `synth --fault` cases lint flags with an error.
const SYNTH_CASES: &[(Format, &str)] = &[
    (Format::CtNvfp4, "nan-block-scale@L1.attn.q_b"),
    (Format::OfficialMixed, "nan-block-scale@L2.attn.q_b"),
    (Format::Mxfp4, "nan-block-scale@L3.ffn.expert.1.w2"),
    (
        Format::ModelOptNvfp4,
        "missing-input-scale@L3.ffn.expert.1.w2",
    ),
    (Format::ModelOptNvfp4, "double-scale@L2.attn.q_a"),
    (Format::CtNvfp4, "swizzled-scales@L1.ffn.expert.2.w1"),
];

fn check(label: &str, dir: &std::path::Path) {
    let rep = lint_dir(dir, None, &Rules::default()).unwrap();
    let errors: Vec<&str> = rep
        .findings
        .iter()
        .filter(|f| f.severity == Severity::Error)
        .map(|f| f.tensor.as_str())
        .collect();
    assert!(!errors.is_empty(), "{label}: lint finds no error");
    for cmd in [
        vec!["run", "--quiet", "--seq-len", "16", "--backend", "cpu"],
        vec!["bisect", "--seq-len", "16", "--backend", "cpu"],
    ] {
        let (code, out) = cli(&cmd, dir);
        assert_eq!(code, 1, "{label}: {} exit {code}:\n{out}", cmd[0]);
        for t in &errors {
            assert!(
                out.contains(t),
                "{label}: {} does not name `{t}`:\n{out}",
                cmd[0]
            );
        }
    }
}

#[test]
fn run_and_bisect_fail_and_name_every_lint_error_of_an_edited_scalar() {
    let clean: Vec<(Format, tempfile::TempDir)> = [Format::CtNvfp4, Format::ModelOptNvfp4]
        .into_iter()
        .map(|f| (f, synth(f, 0, &[])))
        .collect();
    for (format, tensor, value) in scalar_cases() {
        let base = &clean.iter().find(|(f, _)| *f == format).unwrap().1;
        let d = rewrite(base.path(), |n, s, b| {
            if n == tensor {
                set_f32(b, value);
            }
            Some(s.to_vec())
        });
        assert_eq!(
            scalar(d.path(), &tensor).to_bits(),
            value.to_bits(),
            "{tensor} not edited"
        );
        check(&format!("{format:?} {tensor} = {value}"), d.path());
    }
}

#[test]
fn run_and_bisect_fail_and_name_every_lint_error_of_a_synth_fault() {
    for (format, fault) in SYNTH_CASES {
        let d = synth(*format, 0, &[fault]);
        check(&format!("{format:?} {fault}"), d.path());
    }
}

/// The same bad scale outside the layers a run reads is not the run's finding: lint restricted
/// to the run's layers.
#[test]
fn a_lint_error_beyond_the_layers_run_is_not_the_runs() {
    let base = synth(Format::CtNvfp4, 0, &[]);
    let d = rewrite(base.path(), |n, s, b| {
        if n == "layers.4.attn.wq_b.weight_global_scale" {
            set_f32(b, f32::INFINITY);
        }
        Some(s.to_vec())
    });
    let (code, out) = cli(
        &[
            "run",
            "--quiet",
            "--seq-len",
            "16",
            "--backend",
            "cpu",
            "--layers",
            "0..2",
        ],
        d.path(),
    );
    assert_eq!(code, 0, "{out}");
    assert!(!out.contains("layers.4.attn.wq_b"), "{out}");
    let (code, out) = cli(
        &[
            "run",
            "--quiet",
            "--seq-len",
            "16",
            "--backend",
            "cpu",
            "--layers",
            "0..4",
        ],
        d.path(),
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("layers.4.attn.wq_b.weight_global_scale"),
        "{out}"
    );
}
