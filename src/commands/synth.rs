//! `synth`: write a synthetic DeepSeek-V4 checkpoint, or one of another model family
//! (`--family`), see `crate::synth`.

use crate::checkpoint::Naming;
use crate::cli::SynthArgs;
use crate::served::faults::Fault;
use crate::synth::{self, plan, Choice, Preset, SynthOptions};
use crate::{Error, Result};

pub fn main(a: &SynthArgs) -> Result<i32> {
    if a.list_faults {
        // one fault a line: the name, then its description wrapped under the description column
        let width = crate::output::term::width();
        for line in synth::fault_catalogue().lines() {
            let indent = line.find("  ").map_or(4, |i| {
                i + line[i..].chars().take_while(|c| *c == ' ').count()
            });
            for l in crate::output::term::wrap_with(line, width, indent.clamp(4, 40)) {
                println!("{l}");
            }
        }
        return Ok(0);
    }
    let out = a
        .out
        .as_ref()
        .ok_or_else(|| Error::usage("synth: --out DIR is required"))?;
    let opts = options(a)?;
    // nothing of the checkpoint's size is allocated, and no directory made, before its
    // estimate fits what the machine offers
    memory_check(&opts, &a.preset)?;
    let (st, files) = synth::synth_to_dir_with(&opts, out, a.force)?;
    for f in &files {
        println!("wrote {}", out.join(f).display());
    }
    eprintln!(
        "synth: {}{} {} ({} naming, seed {}) → {}: {} tensors, {:.1} MB in {:.2} s ({:.0} MB/s){}",
        opts.family
            .map_or(String::new(), |k| format!("{} ", k.label())),
        a.preset,
        opts.format.name(),
        opts.naming.as_str(),
        opts.seed,
        out.display(),
        st.tensors,
        st.bytes as f64 / 1e6,
        st.seconds,
        st.mb_per_s(),
        if opts.faults.is_empty() {
            String::new()
        } else {
            format!(
                "; faults: {}",
                opts.faults
                    .iter()
                    .map(|f| format!("{}@{}", f.kind.name(), f.target))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    );
    Ok(0)
}

/// Refuse (exit 2) a synth whose estimated peak memory exceeds the host's limit (the least of
/// MemAvailable, the cgroup's room and RLIMIT_AS's room, as a run's budget).
fn memory_check(opts: &SynthOptions, preset: &str) -> Result<()> {
    use crate::probe::budget::{gib, host_limit};
    let m = synth::memory_estimate(opts)?;
    let limit = host_limit();
    if m.total() > limit.bytes {
        return Err(Error::usage(format!(
            "synth --preset {preset} ({}{}) needs an estimated {} of host memory (tensors being made {}, shard buffers {}; {} written) but the limit is {} ({}); choose a smaller preset or --layers, or give it more memory",
            opts.family.map_or(String::new(), |k| format!("{} ", k.label())),
            opts.format.name(),
            gib(m.total()),
            gib(m.generation),
            gib(m.shards),
            gib(m.written),
            gib(limit.bytes),
            limit.source
        )));
    }
    Ok(())
}

/// The synth options the command line asks for.
fn options(a: &SynthArgs) -> Result<SynthOptions> {
    let family = a.family.as_deref().map(synth::family::parse).transpose()?;
    let naming = match (&a.naming, family) {
        (Some(n), _) => plan::parse_naming(n)?,
        (None, Some(_)) => Naming::Hf,
        (None, None) => Naming::Official,
    };
    Ok(SynthOptions {
        family,
        preset: Preset::parse(&a.preset)?,
        format: Choice::parse(&a.format)?,
        naming,
        seed: a.seed,
        layers: a.layers,
        faults: a
            .faults
            .iter()
            .map(|f| Fault::parse(f))
            .collect::<Result<_>>()?,
    })
}
