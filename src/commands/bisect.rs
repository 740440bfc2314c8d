//! `bisect`: the first divergent op and the scale parameter responsible.

use crate::bisect::{self, render};
use crate::cli::BisectArgs;
use crate::error::{EXIT_FINDINGS, EXIT_OK};
use crate::output::Outputs;
use crate::Result;

use super::run::{add_reference_findings, guard, guard_reference, reference_check};

pub fn main(args: &BisectArgs) -> Result<i32> {
    let inputs = [&args.tokens.tokens];
    let outputs = [&args.json, &args.markdown];
    // refused before anything is opened, and again with the checkpoint's shards known
    let early = Outputs::new(guard_reference(
        guard(args.model.as_deref(), None, &inputs),
        args.reference.as_deref(),
        None,
    ));
    for out in outputs.into_iter().flatten() {
        early.check(out)?;
    }
    let mut p = super::run::prepare(
        args.model.as_deref(),
        args.layers,
        &args.tokens,
        None,
        args.served.as_deref(),
        args.backend,
        &args.loader_faults,
        args.seed,
        &args.mem,
        &args.engine,
    )?;
    let (rck, refs) = reference_check(&p.ckpt, args.reference.as_deref(), p.opts.layers.1)?;
    let g = guard(p.model_dir.as_deref(), Some(&p.ckpt), &inputs);
    let mut outs = Outputs::new(guard_reference(g, args.reference.as_deref(), rck.as_ref()));
    for out in outputs.into_iter().flatten() {
        outs.check(out)?;
    }
    drop(rck);
    let mut r = bisect::bisect_with(&p.ckpt, &p.opts, args.search)?;
    // `--reference`: the weights against the original, among the findings (levels as without
    // --strict until set_strict)
    let divergent = r.divergences.iter().map(|d| d.op.as_str()).collect();
    let mut extra = Vec::new();
    add_reference_findings(&mut extra, &refs, &divergent, false);
    r.findings.extend(extra);
    r.set_strict(args.strict);
    p.meta.seconds = r.seconds_run + r.seconds_bisect;
    p.meta.bytes_read = p.ckpt.bytes_read();
    let width = crate::output::term::width();
    print!(
        "{}",
        crate::output::term::fit(&render::terminal(&r, width), width)
    );
    if let Some(j) = &args.json {
        outs.file(j, render::json(&p.meta, &r).as_bytes())?;
    }
    if let Some(md) = &args.markdown {
        outs.file(md, render::markdown(&p.meta, &r).as_bytes())?;
    }
    outs.publish_and_report()?;
    Ok(if r.has_findings() {
        EXIT_FINDINGS
    } else {
        EXIT_OK
    })
}
