//! nvfp4-probe: a layer-by-layer numerical probe for quantized DeepSeek-V4 checkpoints.
//!
//! Data flows one way: `checkpoint` (files, names, schemes) → `model` (the layer as a list of
//! ops) → `probe` (runs ops on numerics paths through a `backend`) → `metrics` → `report` /
//! `bisect` / `gate`. Nothing downstream calls back upstream.

pub mod backend;
pub mod bisect;
pub mod checkpoint;
pub mod cli;
pub mod commands;
pub mod device;
pub mod error;
pub mod gate;
pub mod glob;
pub mod input;
pub mod lint;
pub mod metrics;
pub mod model;
pub mod numerics;
pub mod output;
pub mod plot;
pub mod probe;
pub mod profile;
pub mod report;
pub mod run_json;
pub mod selftest;
pub mod served;
pub mod synth;
pub mod tensor;
pub mod tokenize;
pub mod trace;

pub use error::{Error, Result};
pub use tensor::Tensor;
