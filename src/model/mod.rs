//! The DeepSeek-V4 layer as data: config, op graph with stable ids, and the math of each op.

pub mod attn;
pub mod config;
pub mod env;
pub mod exec;
pub mod family;
pub mod graph;
pub mod layers;
pub mod limits;
mod load;
pub mod mem_env;
pub mod op;
pub mod rope;

pub use config::ModelConfig;
pub use exec::{exec, run_graph, OpEnv};
pub use graph::{build_graph, Op, OpClass, OpKind};
pub use mem_env::MemEnv;
