//! `plot`: the three plots of a run JSON (amax per op, 1 − cos per op, layer × op-kind heatmap).

use crate::cli::PlotArgs;
use crate::output::{Guard, Outputs};
use crate::{Error, Result};

pub fn main(a: &PlotArgs) -> Result<i32> {
    let mut outs = Outputs::new(Guard::new().input(&a.run_json, "the input"));
    for f in crate::plot::plot_files(&a.out)? {
        outs.check(&f)?;
    }
    let text = std::fs::read_to_string(&a.run_json).map_err(|e| Error::io(&a.run_json, e))?;
    // validate with the input's name so a wrong file is reported as that file
    crate::gate::parse_run(&text, &a.run_json)?;
    crate::plot::plot_into(&text, &a.out, &mut outs)?;
    outs.publish_and_report()?;
    Ok(crate::error::EXIT_OK)
}
