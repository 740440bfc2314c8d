//! `--reference`: faults the checkpoint's own scales hide are found against the BF16 original
//! and named by cause; a clean conversion matches.

use nvfp4_probe::checkpoint::Naming;
use nvfp4_probe::lint::{lint_dir, Report, Rules, Severity};
use nvfp4_probe::served::faults::Fault;
use nvfp4_probe::synth::{synth_to_dir, Format, Preset, SynthOptions};
use tempfile::TempDir;

fn synth(format: Format, faults: &[&str]) -> TempDir {
    let d = TempDir::new().unwrap();
    let mut o = SynthOptions::new(Preset::Tiny, format, Naming::Official, 0);
    o.faults = faults.iter().map(|f| Fault::parse(f).unwrap()).collect();
    synth_to_dir(&o, d.path()).unwrap();
    d
}

fn refs(r: &Report) -> Vec<String> {
    r.findings
        .iter()
        .filter(|f| f.rule.starts_with("reference."))
        .map(|f| format!("{} {} {}", f.rule, f.tensor, f.evidence))
        .collect()
}

#[test]
fn hidden_faults_found_against_bf16() {
    let bf16 = synth(Format::Bf16, &[]);
    let cases: &[(Format, &str, &str, &str, &str)] = &[
        (
            Format::CtNvfp4,
            "nibble-swap@L1.ffn.expert.2.w1",
            "reference.packing",
            "layers.1.ffn.experts.2.w1.",
            "nibbles",
        ),
        (
            Format::Mxfp4,
            "nibble-swap@L3.ffn.expert.1.w2",
            "reference.packing",
            "layers.3.ffn.experts.1.w2.",
            "nibbles",
        ),
        (
            Format::CtNvfp4,
            "shifted-scale-rows@L1.ffn.expert.2.w1",
            "reference.block-scales",
            "layers.1.ffn.experts.2.w1.",
            "shifted down by one",
        ),
        (
            Format::ModelOptNvfp4,
            "shifted-scale-rows@L2.attn.q_b",
            "reference.block-scales",
            "layers.2.attn.wq_b.",
            "shifted down by one",
        ),
        (
            Format::Mxfp4,
            "swizzled-scales@L3.ffn.expert.1.w2",
            "reference.block-scales",
            "layers.3.ffn.experts.1.w2.",
            "swizzled",
        ),
        (
            Format::CtNvfp4,
            "inverted-weight-scale@L1.ffn.expert.2.w1",
            "reference.global-scale",
            "layers.1.ffn.experts.2.w1.",
            "reciprocal",
        ),
    ];
    for (format, fault, rule, tensor, cause) in cases {
        let d = synth(*format, &[fault]);
        let r = lint_dir(d.path(), Some(bf16.path()), &Rules::default()).unwrap();
        let hits: Vec<_> = r
            .findings
            .iter()
            .filter(|f| {
                f.rule == *rule && f.tensor.starts_with(tensor) && f.severity == Severity::Error
            })
            .collect();
        assert_eq!(hits.len(), 1, "{fault}: {:#?}", refs(&r));
        assert!(
            hits[0].evidence.contains(cause),
            "{fault}: {}",
            hits[0].evidence
        );
        // Only the faulted tensor differs from the reference.
        assert_eq!(refs(&r).len(), 1, "{fault}: {:#?}", refs(&r));
    }
}

#[test]
fn clean_conversions_match_their_reference() {
    let bf16 = synth(Format::Bf16, &[]);
    for format in [
        Format::CtNvfp4,
        Format::ModelOptNvfp4,
        Format::OfficialMixed,
        Format::Mxfp4,
    ] {
        let d = synth(format, &[]);
        let r = lint_dir(d.path(), Some(bf16.path()), &Rules::default()).unwrap();
        assert!(refs(&r).is_empty(), "{format:?}: {:#?}", refs(&r));
        assert_eq!(r.exit_code(), 0);
    }
}
