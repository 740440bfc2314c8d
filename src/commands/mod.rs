//! One module per subcommand. Each returns its exit code (0 clean, 1 findings) or an [`Error`]
//! (exit 2).

use crate::cli::{Cli, Command};
use crate::Result;

pub mod bisect;
pub mod compare;
pub mod gate;
pub mod inspect;
pub mod lint;
pub mod plot;
pub mod run;
pub mod selftest;
pub mod synth;

pub fn dispatch(cli: Cli) -> Result<i32> {
    match cli.command {
        Command::Inspect(a) => inspect::main(&a),
        Command::Synth(a) => synth::main(&a),
        Command::Run(a) => run::main(&a),
        Command::Bisect(a) => bisect::main(&a),
        Command::Gate(a) => gate::main(&a),
        Command::Plot(a) => plot::main(&a),
        Command::Compare(a) => compare::main(&a),
        Command::Lint(a) => lint::main(&a),
        Command::Selftest(a) => selftest::main(&a),
    }
}
