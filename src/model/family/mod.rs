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

/// The ops of a family graph the CUDA backend has no device version of, for a clear refusal
/// (`--backend cuda` on such a model exits 2 naming them). `None` for V4.
pub fn cuda_unsupported(cfg: &ModelConfig) -> Option<String> {
    use super::op::OpKind;
    let f = cfg.family.as_ref()?;
    let host_only = |k: &OpKind| {
        matches!(
            k,
            OpKind::HeadNorm
                | OpKind::HeadRope
                | OpKind::GqaAttention
                | OpKind::LatentNorm
                | OpKind::MlaAttention
                | OpKind::Mlp
                | OpKind::GptOssExperts
        )
    };
    let mut names: Vec<String> = Vec::new();
    for op in graph::build(cfg, cfg.num_hidden_layers.saturating_sub(1), false) {
        let n = format!("`{:?}`", op.kind);
        if host_only(&op.kind) && !names.contains(&n) {
            names.push(n);
        }
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

    /// The CUDA refusal names the host-only ops of that family's graph, not another family's.
    #[test]
    fn the_cuda_refusal_names_the_family_s_own_host_only_ops() {
        let q = cuda_unsupported(&cfg("qwen3_moe")).unwrap();
        assert!(
            q.contains("qwen3-moe") && q.contains("`GqaAttention`") && q.contains("`HeadNorm`")
        );
        assert!(!q.contains("Mla"), "{q}");
        let v = cuda_unsupported(&cfg("deepseek_v3")).unwrap();
        assert!(v.contains("`MlaAttention`") && v.contains("`LatentNorm`") && v.contains("`Mlp`"));
        assert!(!v.contains("Gqa"), "{v}");
        let g = cuda_unsupported(&cfg("gpt_oss")).unwrap();
        assert!(
            g.contains("gpt-oss") && g.contains("`GqaAttention`") && g.contains("`GptOssExperts`"),
            "{g}"
        );
        assert!(!g.contains("HeadNorm") && !g.contains("Mla"), "{g}");
    }
}
