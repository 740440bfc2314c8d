//! `plot`: the three plots of a run JSON (amax per op, 1 − cos per op, layer × op-kind heatmap).

use crate::cli::PlotArgs;
use crate::output::{Guard, Outputs};
use crate::Result;

pub fn main(a: &PlotArgs) -> Result<i32> {
    let mut outs = Outputs::new(Guard::new().input(&a.run_json, "the input"));
    for f in crate::plot::plot_files(&a.out)? {
        outs.check(&f)?;
    }
    // the gate's reader: the same checks, errors naming the input file
    let run = crate::run_json::load_run(&a.run_json)?;
    crate::plot::plot_into(&run, &a.out, &mut outs)?;
    outs.publish_and_report()?;
    Ok(crate::error::EXIT_OK)
}
