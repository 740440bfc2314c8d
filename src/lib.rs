//! nvfp4-probe: a layer-by-layer numerical probe for quantized DeepSeek-V4 checkpoints.
//!
//! Data flows one way: `checkpoint` (files, names, schemes) → `model` (the layer as a list of
//! ops) → `probe` (runs ops on numerics paths through a `backend`) → `metrics` → `report` /
//! `bisect` / `gate`. Nothing downstream calls back upstream.

pub mod checkpoint;
pub mod cli;
pub mod commands;
pub mod error;
pub mod gate;
pub mod metrics;
pub mod model;
pub mod numerics;
pub mod plot;
/// The runner (being wired up; only the fault catalogue is compiled so far).
pub mod probe {
    pub mod faults;
}
pub mod tensor;

pub use error::{Error, Result};
pub use tensor::Tensor;
