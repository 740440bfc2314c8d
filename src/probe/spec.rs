//! Probe specs (`probes/*.toml`): which layers and ops, which tokens, which served profile, and the
//! thresholds that decide divergence. Tolerances are data; the default spec is built in.

use serde::{Deserialize, Serialize};
use std::path::Path;

use crate::{Error, Result};

/// The built-in default spec (`probes/default.toml`).
pub const DEFAULT_SPEC: &str = include_str!("../../probes/default.toml");

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ProbeSpec {
    #[serde(default = "default_name")]
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// Inclusive layer range, e.g. "0..4".
    #[serde(default)]
    pub layers: Option<crate::model::layers::LayerRange>,
    /// Op-id globs to report (`*` = all); ops outside still run.
    #[serde(default = "all_ops")]
    pub ops: Vec<String>,
    #[serde(default)]
    pub served: Option<String>,
    #[serde(default)]
    pub tokens: TokenSpec,
    #[serde(default)]
    pub thresholds: Thresholds,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct TokenSpec {
    /// Explicit ids.
    #[serde(default)]
    pub ids: Option<Vec<u32>>,
    /// Synthetic sequence length (deterministic ids) when no ids are given.
    #[serde(default)]
    pub seq_len: Option<usize>,
    #[serde(default)]
    pub prompt: Option<String>,
}

/// The divergence thresholds a spec carries (defined with the tolerance table they extend).
pub use super::tolerance::Thresholds;

fn default_name() -> String {
    "custom".into()
}
fn all_ops() -> Vec<String> {
    vec!["*".into()]
}

impl ProbeSpec {
    pub fn builtin() -> ProbeSpec {
        Self::parse(DEFAULT_SPEC, Path::new("<built-in default probe>"))
            .expect("built-in spec parses")
    }
    pub fn parse(text: &str, origin: &Path) -> Result<ProbeSpec> {
        toml::from_str(text).map_err(|e| Error::bad(origin, None, format!("probe spec: {e}")))
    }
    pub fn from_file(path: &Path) -> Result<ProbeSpec> {
        let text = crate::input::read_text(path, "probe spec", crate::input::SMALL_FILE_MAX)?;
        Self::parse(&text, path)
    }
    /// Does `op` match one of the spec's op globs?
    pub fn selects(&self, op: &str) -> bool {
        self.ops.iter().any(|g| glob_match(g, op))
    }
}

pub use crate::glob::glob_match;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match("L*.ffn.experts", "L12.ffn.experts"));
        assert!(!glob_match("L*.ffn.experts", "L12.ffn.expert.3.w1"));
        assert!(glob_match("*", "embed"));
        assert!(glob_match("L1.attn.*", "L1.attn.q_a"));
        assert!(!glob_match("L1.attn.*", "L11.attn.q_a"));
    }

    #[test]
    fn builtin_and_files_parse() {
        let s = ProbeSpec::builtin();
        assert_eq!(s.name, "default");
        let chain = ProbeSpec::from_file(Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/probes/attn-moe-chain.toml"
        )))
        .unwrap();
        assert!(chain.selects("L0.attn.q_b"));
        assert!(!chain.selects("L0.attn.wo_b"));
        assert!(ProbeSpec::parse("bogus = 1", Path::new("x.toml")).is_err());
    }

    #[test]
    fn isolated_rows_parse_and_the_old_format_fields_are_refused_by_name() {
        let s = ProbeSpec::parse(
            "[[thresholds.isolated]]\nclass = \"Linear\"\nformat = \"nvfp4\"\nprofile = \"*\"\nrel_l2 = 0.1\n",
            Path::new("x.toml"),
        )
        .unwrap();
        assert_eq!(s.thresholds.isolated.len(), 1);
        assert_eq!(
            s.thresholds.noise_multiplier,
            Thresholds::default().noise_multiplier
        );
        let e = ProbeSpec::parse("[thresholds]\nchain_factor = 1.6\n", Path::new("old.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("chain_factor") && e.contains("old.toml"), "{e}");
    }
}
