//! `lint`: find broken scales before anything runs (see `crate::lint`).

use crate::checkpoint::GuardCheckpoint;
use crate::cli::LintArgs;
use crate::lint::{lint_dir, to_json, to_markdown, to_text, Rules};
use crate::output::{Guard, Outputs};
use crate::Result;

/// Exit 0 clean (warnings allowed), 1 when any error is found; unusable input is an `Error` (2).
pub fn main(a: &LintArgs) -> Result<i32> {
    // neither checkpoint (model nor reference) nor the rules file is ever written
    let mut guard = Guard::new().model_dir(&a.model);
    if let Some(r) = &a.reference {
        guard = guard.model_dir(r);
    }
    if let Some(r) = &a.rules {
        guard = guard.input(r, "the rules file");
    }
    let mut outs = Outputs::new(guard);
    for p in [&a.json, &a.markdown].into_iter().flatten() {
        outs.check(p)?;
    }
    let mut rules = match &a.rules {
        Some(p) => Rules::from_file(p)?,
        None => Rules::default(),
    };
    rules.tp = a.tp.map(|n| n as usize);
    let mut rep = lint_dir(&a.model, a.reference.as_deref(), &rules)?;
    if a.strict {
        rep.strict();
    }
    if let Some(p) = &a.json {
        outs.file(p, to_json(&rep).as_bytes())?;
    }
    if let Some(p) = &a.markdown {
        outs.file(p, to_markdown(&rep).as_bytes())?;
    }
    print!("{}", to_text(&rep, a.verbose, crate::output::term::width()));
    outs.publish_and_report()?;
    Ok(rep.exit_code())
}
