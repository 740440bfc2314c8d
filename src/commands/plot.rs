//! `plot`: the three plots of a run JSON (amax per op, 1 − cos per op, layer × op-kind heatmap).

use crate::cli::PlotArgs;
use crate::{Error, Result};

pub fn main(a: &PlotArgs) -> Result<i32> {
    let text = std::fs::read_to_string(&a.run_json).map_err(|e| Error::io(&a.run_json, e))?;
    // validate with the input's name so a wrong file is reported as that file
    crate::gate::parse_run(&text, &a.run_json)?;
    for p in crate::plot::plot_run(&text, &a.out)? {
        println!("wrote {}", p.display());
    }
    Ok(crate::error::EXIT_OK)
}
