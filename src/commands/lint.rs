//! `lint`: find broken scales before anything runs (see `crate::lint`).

use crate::checkpoint::writer::write_file;
use crate::cli::LintArgs;
use crate::lint::{lint_dir, to_json, to_markdown, to_text, Rules};
use crate::Result;

/// Exit 0 clean (warnings allowed), 1 when any error is found; unusable input is an `Error` (2).
pub fn main(a: &LintArgs) -> Result<i32> {
    let rules = match &a.rules {
        Some(p) => Rules::from_file(p)?,
        None => Rules::default(),
    };
    let mut rep = lint_dir(&a.model, a.reference.as_deref(), &rules)?;
    if a.strict {
        rep.strict();
    }
    if let Some(p) = &a.json {
        write_file(p, to_json(&rep).as_bytes())?;
    }
    if let Some(p) = &a.markdown {
        write_file(p, to_markdown(&rep).as_bytes())?;
    }
    print!("{}", to_text(&rep, a.verbose));
    Ok(rep.exit_code())
}
