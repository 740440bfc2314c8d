//! Model families beyond DeepSeek-V4 (issue 23): Qwen3-MoE, DeepSeek-V3/R1 and gpt-oss, each a
//! model definition behind the same op-graph contract as V4 (stable op ids, the same three
//! numerics paths through `OpEnv`), so the runner, lint, bisect, compare and gate never ask which
//! family they run.
//!
//! A family is detected from `config.json` (`model_type` / `architectures`, [`detect`]); its
//! fields are read with limits ([`config`]) into a [`Family`] that rides on the
//! [`ModelConfig`](super::ModelConfig) (`cfg.family`, `None` for V4), whose shared fields
//! (hidden size, heads, experts, norm eps) it fills so that what sizes a run reads them as for V4.
//! The op graph of each family is built here ([`graph`]), and the ops V4 does not have
//! (per-head norms, half-split RoPE, GQA attention with sinks and windows, dense MLPs, the
//! families' routers) are computed in [`ops`] against `OpEnv` and the path's `Device`.

pub mod config;
pub mod graph;
pub mod ops;

pub use config::{detect, Family, Kind, RopeStyle};

use super::ModelConfig;

/// The first op of a family graph the CUDA backend has no device version of, for a clear refusal
/// (`--backend cuda` on such a model exits 2 naming it). `None` for V4.
pub fn cuda_unsupported(cfg: &ModelConfig) -> Option<String> {
    let f = cfg.family.as_ref()?;
    Some(format!(
        "the {} family's per-head norm, RoPE and GQA attention ops (`HeadNorm`, `HeadRope`, `GqaAttention`) have no CUDA version yet; run it with `--backend cpu`",
        f.kind.label()
    ))
}
