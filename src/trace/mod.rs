//! Engine activation traces: name maps and readers (issue: `compare`).

pub mod names;
