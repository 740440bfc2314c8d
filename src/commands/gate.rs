//! `gate`: compare a run against a baseline run; exit 0 pass, 1 regression, 2 unusable input.

use crate::cli::GateArgs;
use crate::gate::{self, Tolerances};
use crate::output::{Guard, Outputs};
use crate::Result;

pub fn main(a: &GateArgs) -> Result<i32> {
    let mut guard = Guard::new()
        .input(&a.baseline, "the baseline")
        .input(&a.current, "the current run");
    if let Some(t) = &a.tolerances {
        guard = guard.input(t, "the tolerances file");
    }
    let mut outs = Outputs::new(guard);
    for p in [&a.summary, &a.junit].into_iter().flatten() {
        outs.check(p)?;
    }
    let base = crate::run_json::load_run(&a.baseline)?;
    let cur = crate::run_json::load_run(&a.current)?;
    let tol = match &a.tolerances {
        Some(p) => {
            let text = crate::input::read_text(p, "tolerances", crate::input::SMALL_FILE_MAX)?;
            Tolerances::from_toml(&text, p)?
        }
        None => Tolerances::default(),
    };
    let rep = gate::compare_named(&base, &a.baseline, &cur, &a.current, &tol, a.force)?;
    let width = crate::output::term::width();
    print!("{}", crate::output::term::fit(&rep.terminal(), width));
    if let Some(p) = &a.summary {
        outs.file(p, rep.summary_markdown().as_bytes())?;
    }
    if let Some(p) = &a.junit {
        outs.file(p, rep.junit_xml().as_bytes())?;
    }
    outs.publish_and_report()?;
    Ok(rep.exit_code())
}
