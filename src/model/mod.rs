//! The DeepSeek-V4 layer as data: config, op graph with stable ids, and the math of each op.

pub mod config;

pub use config::ModelConfig;
