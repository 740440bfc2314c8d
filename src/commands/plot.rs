//! `plot`: the three plots of a run JSON (amax per op, 1 − cos per op, layer × op-kind heatmap).

use crate::cli::PlotArgs;
use crate::Result;

pub fn main(a: &PlotArgs) -> Result<i32> {
    // the gate's reader: the same checks, errors naming the input file
    let run = crate::gate::load_run(&a.run_json)?;
    for p in crate::plot::plot_value(&run, &a.out)? {
        println!("wrote {}", p.display());
    }
    Ok(crate::error::EXIT_OK)
}
