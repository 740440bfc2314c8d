//! `gate`: compare a run against a baseline run; exit 0 pass, 1 regression, 2 unusable input.

use crate::cli::GateArgs;
use crate::gate::{self, Tolerances};
use crate::{Error, Result};
use std::path::Path;

pub fn main(a: &GateArgs) -> Result<i32> {
    let base = gate::load_run(&a.baseline)?;
    let cur = gate::load_run(&a.current)?;
    let tol = match &a.tolerances {
        Some(p) => {
            let text = crate::input::read_text(p, "tolerances", crate::input::SMALL_FILE_MAX)?;
            Tolerances::from_toml(&text, p)?
        }
        None => Tolerances::default(),
    };
    let rep = gate::compare_named(&base, &a.baseline, &cur, &a.current, &tol, a.force)?;
    print!("{}", rep.terminal());
    if let Some(p) = &a.summary {
        write(p, &rep.summary_markdown())?;
    }
    if let Some(p) = &a.junit {
        write(p, &rep.junit_xml())?;
    }
    Ok(rep.exit_code())
}

fn write(p: &Path, text: &str) -> Result<()> {
    std::fs::write(p, text).map_err(|e| Error::io(p, e))
}
