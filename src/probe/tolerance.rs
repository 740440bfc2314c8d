//! The isolated tolerance of an op: how far a *healthy* served op may sit from the BF16 oracle.
//!
//! The expected error depends on what the op computes (its class: one GEMM, a chain of GEMMs in a
//! MoE block, …), the quantized format of the weights it reads and the served profile's numerics
//! (W4A4 quantizes activations, W4A16 does not). It is data: one table
//! (`probes/isolated-tolerances.toml`, rows of class × format × profile → rel-L2) that the
//! built-in probe uses, and that a probe spec can put rows in front of. The numbers come from
//! measurement (`examples/isolated_tolerances.rs`: the isolated error of every op class under
//! every profile on clean checkpoints of several formats and seeds), with a margin stated there.

use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

use crate::checkpoint::Scheme;
use crate::glob::glob_match;
use crate::served::Profile;

/// The built-in table (`probes/isolated-tolerances.toml`).
pub const BUILTIN_TABLE: &str = include_str!("../../probes/isolated-tolerances.toml");

/// One row: a healthy op of `class` reading `format` weights under `profile` stays below `rel_l2`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct IsolatedRow {
    /// Glob over the op class (`Linear`, `Moe`, `Compressor`, …; `*` any).
    pub class: String,
    /// Glob over the weight format key: `nvfp4`, `mxfp4`, `fp8-block`.
    pub format: String,
    /// Glob over the served profile name (`blackwell-w4a4`, `hopper-w4a16`, `emulation`).
    pub profile: String,
    pub rel_l2: f64,
}

impl IsolatedRow {
    fn matches(&self, class: &str, format: &str, profile: Profile) -> bool {
        glob_match(&self.class, class)
            && glob_match(&self.format, format)
            && glob_match(&self.profile, profile.name())
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TableFile {
    row: Vec<IsolatedRow>,
}

/// The built-in rows, parsed once.
pub fn builtin_rows() -> &'static [IsolatedRow] {
    static ROWS: OnceLock<Vec<IsolatedRow>> = OnceLock::new();
    ROWS.get_or_init(|| {
        toml::from_str::<TableFile>(BUILTIN_TABLE)
            .expect("built-in isolated tolerance table parses")
            .row
    })
}

/// The format key a scheme label counts as (its `tolerance_key` in the format table:
/// `nvfp4-ct`/`nvfp4-modelopt` → `nvfp4`), None for unquantized weights.
pub fn scheme_key(scheme: &str) -> Option<&'static str> {
    Scheme::from_label(scheme).and_then(|s| s.spec().tolerance_key)
}

/// The coarsest quantized format among an op's weights (the format table's order: nvfp4, then
/// mxfp4, then fp8-block), None when it reads none.
pub fn format_key(weights: &[(String, String)]) -> Option<&'static str> {
    let keys: Vec<&str> = weights.iter().filter_map(|(_, s)| scheme_key(s)).collect();
    crate::checkpoint::formats::tolerance_keys()
        .into_iter()
        .find(|k| keys.contains(k))
}

/// Divergence thresholds. An op diverges (isolated) when its served output, fed the BF16 oracle's
/// inputs, is further from the BF16 oracle than both `noise_multiplier ×` the op's own
/// BF16-vs-FP32 spread and the expected error of a healthy served op of its class, weight format
/// and profile (the isolated tolerance table, `probe::tolerance`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Thresholds {
    pub noise_multiplier: f64,
    /// Absolute floor for ops whose numerics are identical to the oracle's.
    pub min_rel_l2: f64,
    /// Rows of the isolated tolerance table that come before the built-in ones
    /// (`probes/isolated-tolerances.toml`): `[[thresholds.isolated]] class, format, profile, rel_l2`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub isolated: Vec<IsolatedRow>,
    /// amax ratio outside [1/x, x] diverges.
    pub amax_ratio: f64,
    /// Propagated: the error "shows" once rel-L2 vs the BF16 oracle exceeds this.
    pub propagated_rel_l2: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            noise_multiplier: 8.0,
            min_rel_l2: 1e-3,
            isolated: Vec::new(),
            amax_ratio: 4.0,
            propagated_rel_l2: 0.5,
        }
    }
}

impl Thresholds {
    /// The expected isolated rel-L2 of a healthy op (the spec's own rows first, then the
    /// built-in table), None when no row matches.
    pub fn isolated_expected(&self, class: &str, format: &str, profile: Profile) -> Option<f64> {
        self.isolated
            .iter()
            .chain(builtin_rows())
            .find(|r| r.matches(class, format, profile))
            .map(|r| r.rel_l2)
    }
}

/// The format key of what an attention reads from an engine's FP8 KV cache
/// (`--served-chunk`: the keys of earlier prefill chunks).
pub const KV_CACHE_KEY: &str = "fp8-kv-cache";

/// An op's isolated tolerance and where it comes from:
/// max(noise_multiplier × its BF16-vs-FP32 noise on the same inputs, the table's expected error
/// of the formats it reads (its weights' and `cached`, the keys of an engine cache it reads,
/// e.g. [`KV_CACHE_KEY`]), min_rel_l2).
pub fn op_tolerance(
    th: &Thresholds,
    profile: Profile,
    class: &str,
    weights: &[(String, String)],
    cached: &[&'static str],
    noise_iso: f64,
) -> (f64, String) {
    let mut expected: Option<(f64, &str)> = None;
    let keys = weights
        .iter()
        .filter_map(|(_, s)| scheme_key(s))
        .chain(cached.iter().copied());
    for k in keys {
        if let Some(v) = th.isolated_expected(class, k, profile) {
            if expected.is_none_or(|(e, _)| v > e) {
                expected = Some((v, k));
            }
        }
    }
    let noise = th.noise_multiplier * noise_iso;
    let (mut tol, mut basis) = (th.min_rel_l2, "min_rel_l2".to_string());
    if let Some((e, k)) = expected {
        if e > tol {
            tol = e;
            basis = format!("{class} × {k} × {}", profile.name());
        }
    }
    if noise > tol {
        tol = noise;
        basis = format!("{} × BF16 noise", th.noise_multiplier);
    }
    (tol, basis)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_parses_and_covers_every_format_and_profile() {
        let th = Thresholds::default();
        for class in ["Linear", "Moe", "Compressor", "Indexer", "Attention"] {
            for f in ["nvfp4", "mxfp4", "fp8-block"] {
                for p in [
                    Profile::BlackwellW4a4,
                    Profile::HopperW4a16,
                    Profile::Emulation,
                ] {
                    let v = th.isolated_expected(class, f, p);
                    assert!(v.is_some_and(|v| v > 0.0 && v < 1.0), "{class} {f} {p:?}");
                }
            }
        }
    }

    #[test]
    fn spec_rows_come_first() {
        let mut th = Thresholds::default();
        let base = th
            .isolated_expected("Linear", "nvfp4", Profile::BlackwellW4a4)
            .unwrap();
        th.isolated.push(IsolatedRow {
            class: "Linear".into(),
            format: "nvfp4".into(),
            profile: "*".into(),
            rel_l2: base / 2.0,
        });
        assert_eq!(
            th.isolated_expected("Linear", "nvfp4", Profile::BlackwellW4a4),
            Some(base / 2.0)
        );
        assert_eq!(
            th.isolated_expected("Moe", "nvfp4", Profile::BlackwellW4a4),
            Thresholds::default().isolated_expected("Moe", "nvfp4", Profile::BlackwellW4a4)
        );
    }

    #[test]
    fn coarsest_format_decides() {
        let w = |s: &[&str]| -> Vec<(String, String)> {
            s.iter().map(|x| ("w".to_string(), x.to_string())).collect()
        };
        assert_eq!(format_key(&w(&["bf16", "fp8-block"])), Some("fp8-block"));
        assert_eq!(format_key(&w(&["fp8-block", "nvfp4-ct"])), Some("nvfp4"));
        assert_eq!(format_key(&w(&["bf16"])), None);
        let th = Thresholds::default();
        let (t, basis) = op_tolerance(
            &th,
            Profile::BlackwellW4a4,
            "Linear",
            &w(&["nvfp4-modelopt"]),
            &[],
            1e-4,
        );
        assert_eq!(
            Some(t),
            th.isolated_expected("Linear", "nvfp4", Profile::BlackwellW4a4)
        );
        assert!(basis.contains("nvfp4"), "{basis}");
        let (t, basis) = op_tolerance(
            &th,
            Profile::BlackwellW4a4,
            "Norm",
            &w(&["bf16"]),
            &[],
            1e-2,
        );
        assert_eq!(t, th.noise_multiplier * 1e-2);
        assert!(basis.contains("noise"), "{basis}");
    }

    #[test]
    fn an_attention_reading_the_fp8_kv_cache_has_its_row() {
        let th = Thresholds::default();
        let kv = th
            .isolated_expected("Attention", KV_CACHE_KEY, Profile::HopperW4a16)
            .expect("a row for the FP8 KV cache");
        let (t, basis) = op_tolerance(
            &th,
            Profile::HopperW4a16,
            "Attention",
            &[],
            &[KV_CACHE_KEY],
            1e-4,
        );
        assert_eq!(t, kv);
        assert!(basis.contains(KV_CACHE_KEY), "{basis}");
        // without the cache the attention's numerics are the oracle's: the floor
        let (t, _) = op_tolerance(&th, Profile::HopperW4a16, "Attention", &[], &[], 1e-5);
        assert_eq!(t, th.min_rel_l2);
    }
}
