//! `inspect`: the weights of a checkpoint, their schemes, scales and health.
use crate::cli::InspectArgs;
use crate::Result;

pub fn main(_args: &InspectArgs) -> Result<i32> {
    Err(crate::Error::usage("inspect: not built yet"))
}
