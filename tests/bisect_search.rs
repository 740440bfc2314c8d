//! The layer search against the linear search on the tiny model.

use nvfp4_probe::bisect::{self, BisectResult, Search};
use nvfp4_probe::checkpoint::{Checkpoint, Naming};
use nvfp4_probe::probe::faults::{Fault, FaultKind};
use nvfp4_probe::probe::scan::{self, ShowRule};
use nvfp4_probe::probe::served::Profile;
use nvfp4_probe::probe::spec::ProbeSpec;
use nvfp4_probe::probe::{synthetic_tokens, RunOptions};
use nvfp4_probe::synth::{self, Format, Preset, SynthOptions};

const T: usize = 32;

fn opts(last: usize, faults: Vec<Fault>, tseed: u64) -> RunOptions {
    RunOptions {
        layers: (0, last),
        tokens: synthetic_tokens(T, 512, tseed),
        profile: Profile::BlackwellW4a4,
        loader_faults: faults,
        spec: ProbeSpec::builtin(),
        keep_outputs: false,
        progress: false,
        overrides: Vec::new(),
        stop_after: None,
    }
}

fn ckpt(format: Format, seed: u64) -> Checkpoint {
    synth::synth_to_memory(&SynthOptions::new(
        Preset::Tiny,
        format,
        Naming::Official,
        seed,
    ))
    .unwrap()
}

#[test]
#[ignore]
fn bisect_search_noise_levels() {
    for f in [Format::CtNvfp4] {
        for seed in [1u64] {
            let c = ckpt(f, seed);
            for tseed in [0u64, 7, 11] {
                let o = opts(4, vec![], tseed);
                let rule = ShowRule::from_thresholds(&o.spec.thresholds);
                let sc = scan::scan(&c, &o, &rule, false).unwrap();
                let v: Vec<String> = sc
                    .outs
                    .iter()
                    .map(|x| {
                        format!(
                            "{:.3}/{:.3}/{:.2}",
                            x.vs_bf16.rel_l2.unwrap_or(-1.0),
                            x.vs_bf16.cos.unwrap_or(-1.0),
                            x.vs_bf16.amax_ratio.unwrap_or(-1.0)
                        )
                    })
                    .collect();
                println!("clean {f:?} s{seed} t{tseed}: {}", v.join("  "));
            }
        }
    }
    let c = ckpt(Format::CtNvfp4, 3);
    for kind in [
        FaultKind::InvertedInputScale,
        FaultKind::MissingAlpha,
        FaultKind::ZeroInputScale,
        FaultKind::InvertedWeightScale,
    ] {
        for tgt in ["L1.attn.q_b", "L2.attn.wo_b", "L3.attn.kv", "L1.ffn.shared"] {
            let o = opts(
                4,
                vec![Fault {
                    kind,
                    target: tgt.into(),
                }],
                7,
            );
            let rule = ShowRule::from_thresholds(&o.spec.thresholds);
            let Ok(sc) = scan::scan(&c, &o, &rule, false) else {
                continue;
            };
            let v: Vec<String> = sc
                .outs
                .iter()
                .map(|x| {
                    format!(
                        "{:.3}/{:.3}/{:.2}{}",
                        x.vs_bf16.rel_l2.unwrap_or(-1.0),
                        x.vs_bf16.cos.unwrap_or(-1.0),
                        x.vs_bf16.amax_ratio.unwrap_or(-1.0),
                        if x.broken.is_some() { "!" } else { "" }
                    )
                })
                .collect();
            println!("{} @{tgt}: {}", kind.name(), v.join("  "));
        }
    }
}
