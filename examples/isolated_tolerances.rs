//! Measures what a healthy served op's isolated error is, to derive the default tolerances from.
//!
//! For every clean synthetic checkpoint format × seed × token set and every served profile, one
//! `probe::run` over all layers; each reported op's isolated error (the served numerics on the
//! BF16 oracle's inputs, rel-L2 against the BF16 oracle) is collected under its (op class, weight
//! format, profile) key. Printed: the number of op measurements, the median, the maximum, and the
//! tolerance the built-in table gives that key, with the margin max → tolerance. The served
//! numerics are those of the serving kernels (vLLM/FlashInfer's NVFP4 activation quantization op
//! order, Marlin's BF16 activations, DeepSeek's FP8 1×128), at the activation scales calibrated by
//! the synthetic model's own forward.
//!
//! `cargo run --release --example isolated_tolerances [SEEDS] [TOKENS]` (defaults 3 seeds, T = 64
//! and T = 32).

use std::collections::BTreeMap;

use nvfp4_probe::checkpoint::Naming;
use nvfp4_probe::probe::{self, RunOptions};
use nvfp4_probe::served::Profile;
use nvfp4_probe::synth::{synth_to_memory, Format, Preset, SynthOptions};

fn main() -> nvfp4_probe::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let seeds: u64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(3);
    let lens: Vec<usize> = args
        .get(2)
        .map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| vec![64, 32]);
    let profiles = [
        Profile::BlackwellW4a4,
        Profile::HopperW4a16,
        Profile::Emulation,
    ];
    // (class, format, profile) → isolated rel-L2 of every op measured there
    let mut seen: BTreeMap<(String, String, String), Vec<f64>> = BTreeMap::new();
    let spec = nvfp4_probe::probe::spec::ProbeSpec::builtin();
    for format in [
        Format::CtNvfp4,
        Format::ModelOptNvfp4,
        Format::OfficialMixed,
        Format::Mxfp4,
    ] {
        for seed in 0..seeds {
            let ck = synth_to_memory(&SynthOptions::new(
                Preset::Tiny,
                format,
                Naming::Official,
                seed,
            ))?;
            let cfg = ck.model_config()?.clone();
            let last = cfg.num_hidden_layers - 1;
            for &t in &lens {
                let tokens = probe::synthetic_tokens(t, cfg.vocab_size, seed * 31 + t as u64);
                for profile in profiles {
                    let opts = RunOptions {
                        profile,
                        ..RunOptions::new((0, last), tokens.clone())
                    };
                    let res = probe::run(&ck, &opts)?;
                    for r in &res.records {
                        let Some(fmt) = probe::tolerance::format_key(&r.weights) else {
                            continue;
                        };
                        let Some(e) = r.served_isolated_vs_bf16.rel_l2 else {
                            continue;
                        };
                        if r.agreement.is_some() {
                            continue;
                        }
                        seen.entry((r.class.clone(), fmt.to_string(), profile.name().into()))
                            .or_default()
                            .push(e);
                    }
                }
            }
        }
    }
    println!("| op class | weights | profile | ops measured | median | max | tolerance | max → tolerance |");
    println!("|---|---|---|---|---|---|---|---|");
    for ((class, fmt, prof), mut v) in seen {
        v.sort_by(|a, b| a.total_cmp(b));
        let med = v[v.len() / 2];
        let max = v[v.len() - 1];
        let profile = Profile::parse(&prof)?;
        let tol = spec
            .thresholds
            .isolated_expected(&class, &fmt, profile)
            .unwrap_or(f64::NAN);
        println!(
            "| {class} | {fmt} | {prof} | {} | {med:.3e} | {max:.3e} | {tol} | ×{:.2} |",
            v.len(),
            tol / max
        );
    }
    Ok(())
}
