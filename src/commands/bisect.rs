//! `bisect`: the first divergent op and the scale parameter responsible.

use crate::bisect::{self, render};
use crate::cli::BisectArgs;
use crate::error::{EXIT_FINDINGS, EXIT_OK};
use crate::report;
use crate::Result;

pub fn main(args: &BisectArgs) -> Result<i32> {
    let mut p = super::run::prepare(
        args.model.as_deref(),
        args.layers.as_deref(),
        &args.tokens,
        None,
        args.served.as_deref(),
        args.backend,
        &args.loader_faults,
        args.seed,
    )?;
    for out in [&args.json, &args.markdown].into_iter().flatten() {
        report::check_not_in_model_dir(out, p.model_dir.as_deref())?;
    }
    let mut r = bisect::bisect_with(&p.ckpt, &p.opts, args.search)?;
    r.set_strict(args.strict);
    p.meta.seconds = r.seconds_run + r.seconds_bisect;
    p.meta.bytes_read = p.ckpt.bytes_read();
    print!("{}", render::terminal(&r));
    if let Some(j) = &args.json {
        report::write_atomic(j, render::json(&p.meta, &r).as_bytes())?;
    }
    if let Some(md) = &args.markdown {
        report::write_atomic(md, render::markdown(&p.meta, &r).as_bytes())?;
    }
    Ok(if r.has_findings() {
        EXIT_FINDINGS
    } else {
        EXIT_OK
    })
}
