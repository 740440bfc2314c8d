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
//! families' routers, gpt-oss's experts) are computed in [`ops`] against `OpEnv` and the path's
//! `Device`.

pub mod config;
pub mod graph;
pub mod kind;
pub mod ops;

pub use kind::{detect, Family, Kind, RopeStyle};

use super::ModelConfig;

/// The op kinds of the family graphs that have no CUDA version: none since every family op runs
/// on the path's `Device` (`device::family`, `kernels/layer.cu`). A family that adds a kind
/// before its kernel lists it here, and `--backend cuda` refuses it with [`cuda_unsupported`].
const HOST_ONLY: &[super::op::OpKind] = &[];

/// The ops of a family graph the CUDA backend has no device version of ([`HOST_ONLY`]), for a
/// clear refusal (`--backend cuda` on such a model exits 2 naming them; `auto` runs it on the
/// CPU). `None` for V4 and for every family whose ops all have one.
pub fn cuda_unsupported(cfg: &ModelConfig) -> Option<String> {
    unsupported_among(cfg, HOST_ONLY)
}

fn unsupported_among(cfg: &ModelConfig, host_only: &[super::op::OpKind]) -> Option<String> {
    let f = cfg.family.as_ref()?;
    let mut names: Vec<String> = Vec::new();
    for op in graph::build(cfg, cfg.num_hidden_layers.saturating_sub(1), false) {
        let n = format!("`{:?}`", op.kind);
        if host_only.contains(&op.kind) && !names.contains(&n) {
            names.push(n);
        }
    }
    if names.is_empty() {
        return None;
    }
    Some(format!(
        "the {} family's ops {} have no CUDA version yet; run it with `--backend cpu`",
        f.kind.label(),
        names.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(family: &str) -> ModelConfig {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/hf-families")
            .join(family)
            .join("config.json");
        ModelConfig::from_file(&p).unwrap()
    }

    /// Every family runs on CUDA now; a refusal (were a kind host-only) names that family's own
    /// host-only ops, not another family's.
    #[test]
    fn every_family_runs_on_cuda_and_a_refusal_names_the_family_s_own_ops() {
        use super::super::op::OpKind;
        for f in ["qwen3_moe", "deepseek_v3", "gpt_oss"] {
            assert_eq!(cuda_unsupported(&cfg(f)), None, "{f}");
        }
        let some = [
            OpKind::HeadNorm,
            OpKind::MlaAttention,
            OpKind::GptOssExperts,
        ];
        let q = unsupported_among(&cfg("qwen3_moe"), &some).unwrap();
        assert!(q.contains("qwen3-moe") && q.contains("`HeadNorm`"), "{q}");
        assert!(!q.contains("Mla") && !q.contains("GptOss"), "{q}");
        let v = unsupported_among(&cfg("deepseek_v3"), &some).unwrap();
        assert!(
            v.contains("`MlaAttention`") && !v.contains("HeadNorm"),
            "{v}"
        );
        let g = unsupported_among(&cfg("gpt_oss"), &some).unwrap();
        assert!(
            g.contains("gpt-oss") && g.contains("`GptOssExperts`"),
            "{g}"
        );
        assert!(!g.contains("HeadNorm") && !g.contains("Mla"), "{g}");
    }
}
