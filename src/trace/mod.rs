//! Engine activation traces: name maps, readers, assembly into op outputs, and the comparison against
//! the oracle (issue: `compare`).

pub mod assemble;
pub mod compare;
pub mod engine_names;
pub mod family_names;
pub mod mapped;
pub mod names;
pub mod precision;
pub mod read;
