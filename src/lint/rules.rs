//! The rule catalogue and the `--rules` TOML that adjusts it.
//!
//! Rule ids are part of the JSON contract (`nvfp4-probe.lint/1`): CI filters and issue templates
//! key on them, so an id is never renamed, only added.

use std::collections::HashMap;
use std::path::Path;

use serde::Serialize;

use crate::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Info,
    Warning,
    Error,
}

impl Severity {
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Info => "info",
            Severity::Warning => "warning",
            Severity::Error => "error",
        }
    }
}

/// One rule: id, the severity it usually carries, what it catches.
#[derive(Clone, Copy, Debug)]
pub struct RuleInfo {
    pub id: &'static str,
    pub severity: Severity,
    pub summary: &'static str,
}

const fn r(id: &'static str, severity: Severity, summary: &'static str) -> RuleInfo {
    RuleInfo {
        id,
        severity,
        summary,
    }
}

use Severity::{Error as E, Info as I, Warning as W};

/// Every rule lint can report. Where a rule's severity depends on the size of the problem
/// (fused.mismatch, scale.input.spread, scale.global.sentinel, scale.block.zero-row) the
/// severity here is the most severe one it uses.
pub const RULES: &[RuleInfo] = &[
    r("scale.missing", E, "a quantized weight lacks a scale tensor (block, tensor or per-expert activation scale)"),
    r("scale.global.non-finite", E, "NaN/Inf weight or activation tensor scale"),
    r("scale.global.zero", E, "tensor scale 0: 1/0 = inf encode scale, alpha 0"),
    r("scale.global.negative", E, "negative tensor scale: every output of the op flips sign"),
    r("scale.global.denormal", E, "subnormal tensor scale: its reciprocal overflows to inf"),
    r("scale.global.sentinel", E, "a placeholder value (float min/max, 1.0 across a whole layer) where a calibrated scale belongs"),
    r("scale.block.nan", E, "NaN block-scale bytes (E4M3 0x7F/0xFF, UE8M0 0xFF, F32 NaN/Inf)"),
    r("scale.block.negative", E, "negative block scales (producers write non-negative scales)"),
    r("scale.block.zero-row", E, "a block-scale row all zero while the row's packed data is not"),
    r("scale.block.saturated", E, "most block scales pinned at 448: the tensor scale used at quantisation was too large (applied twice?)"),
    r("scale.convention", E, "a tensor scale that fits only the other producer's convention (reciprocal) or is off by 2688"),
    r("scale.input.implausible", E, "activation amax implied by the input scale impossible at the op's position (e.g. outside the RMSNorm bounds)"),
    r("scale.input.spread", E, "activation amax of one expert differs by orders of magnitude from the layer's other experts"),
    r("fused.mismatch", E, "members of a fused GEMM (w1/w3, q_a/kv, q/k/v) carry different tensor scales; engines keep one (a group of three names its odd member)"),
    r("layout.swizzled", E, "block scales stored in the 128×4 swizzled layout where linear belongs"),
    r("fp8.scale.non-pow2", E, "FP8 block scales that are not powers of two where the config declares UE8M0"),
    r("config.scheme", E, "quantization_config claims a scheme the tensors do not have, or one this tool does not read (run refuses it)"),
    r("config.degenerate", E, "a config value that makes an op degenerate (RMSNorm eps, RoPE theta, routed scaling 0, SwiGLU limit ≤ 0): named by key, not blamed on weights"),
    r("tensor.non-finite", E, "NaN/Inf in a plain (unquantized) tensor: router correction bias, norm weight, bias, sinks"),
    r("config.ignore", E, "ignore/exclude list disagrees with which weights are quantized"),
    r("tensor.invalid", E, "a weight whose headers cannot be read as any supported scheme"),
    r("weight.missing", E, "a layer the checkpoint holds lacks a weight or parameter its config requires (a whole expert, a projection, a norm)"),
    r("config.model", E, "config.json's model fields are outside the family's limits, of the wrong type, contradict each other or the tensors' shapes (run refuses them)"),
    r("router.bias.precision", W, "a router's e_score_correction_bias stored in BF16/F16: near ties in the top-k pick other experts"),
    r("scale.input.uncalibrated", W, "routed experts whose activation scale implies an amax of exactly 1.0: an observer that never saw a token, not a calibration"),
    r("kv.scale", E, "KV-cache k_scale/v_scale NaN, Inf, ≤ 0 or 1.0, or missing where the config declares a quantized KV cache"),
    r("tensor.keep-high-precision", E, "a router, norm, embedding, lm_head or MTP layer stored quantized (producers keep them in BF16)"),
    r("tp.scale-block", E, "lint --tp N: a tensor-parallel shard boundary falls inside a scale block"),
    r("reference.global-scale", E, "--reference: the tensor differs from the reference by a constant factor (a tensor scale)"),
    r("reference.block-scales", E, "--reference: per-row/per-block ratio pattern (scale rows shifted, swizzled, transposed)"),
    r("reference.packing", E, "--reference: right norm, cosine near 0 (nibble order, K order)"),
    r("reference.row-order", E, "--reference: a fused gate/up weight or its bias holds the reference's rows in another order (gpt-oss w13 stored de-interleaved, or interleaved twice)"),
    r("reference.mismatch", E, "--reference: the tensor differs from the reference and no single cause explains it"),
    r("reference.absent", I, "--reference: the weight has no counterpart in the reference"),
    r("reference.param", E, "--reference: a norm weight or bias differs from the reference's (or holds another parameter's values: swapped names)"),
];

pub fn rule_info(id: &str) -> Option<&'static RuleInfo> {
    RULES.iter().find(|r| r.id == id)
}

/// Numeric thresholds; every field can be set under `[thresholds]` in the rules file.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Thresholds {
    /// Plausible weight amax range implied by the scales.
    pub weight_amax_min: f64,
    pub weight_amax_max: f64,
    /// Plausible activation amax range where no norm bound applies.
    pub input_amax_min: f64,
    pub input_amax_max: f64,
    /// Factor by which a post-RMSNorm amax may fall outside the norm's hard bounds.
    pub norm_slack: f64,
    /// Expert activation amax vs the layer median: warning / error ratio.
    pub spread_warning: f64,
    pub spread_error: f64,
    /// Fused pair tensor-scale ratio above which it is a warning / an error.
    pub fused_warning: f64,
    pub fused_error: f64,
    /// Fraction of block scales at 448 that makes a tensor saturated.
    pub saturated_fraction: f64,
    /// Swizzle statistic: minimum gain in chance-adjusted R² of the unswizzled reading over the
    /// linear one, and the minimum adjusted R² of the unswizzled reading.
    pub swizzle_margin: f64,
    pub swizzle_min_r2: f64,
    /// --reference: cosine and norm-ratio tolerance below which a tensor matches.
    pub reference_cos: f64,
    pub reference_norm_tol: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            weight_amax_min: 1e-4,
            weight_amax_max: 1e4,
            input_amax_min: 1e-3,
            input_amax_max: 1e5,
            norm_slack: 2.0,
            spread_warning: 8.0,
            spread_error: 32.0,
            fused_warning: 1.0 + 1e-6,
            fused_error: 1.25,
            saturated_fraction: 0.5,
            swizzle_margin: 0.1,
            swizzle_min_r2: 0.15,
            reference_cos: 0.97,
            reference_norm_tol: 0.05,
        }
    }
}

/// Severity overrides (None = rule disabled) and thresholds.
#[derive(Clone, Debug, Default)]
pub struct Rules {
    pub overrides: HashMap<String, Option<Severity>>,
    pub thresholds: Thresholds,
    /// `lint --tp N`: the tensor-parallel size whose shards `tp.scale-block` checks (None: off).
    pub tp: Option<usize>,
}

impl Rules {
    /// The severity a finding gets: the override when there is one, else `default`;
    /// None when the rule is disabled.
    pub fn severity(&self, rule: &str, default: Severity) -> Option<Severity> {
        match self.overrides.get(rule) {
            Some(o) => *o,
            None => Some(default),
        }
    }

    pub fn from_file(path: &Path) -> Result<Rules> {
        let text = crate::input::read_text(path, "rules file", crate::input::SMALL_FILE_MAX)?;
        Rules::from_toml(&text).map_err(|m| Error::bad(path, None, m))
    }

    /// ```toml
    /// [severity]
    /// "fused.mismatch" = "warning"   # error | warning | info | off
    /// [thresholds]
    /// fused_error = 2.0
    /// ```
    pub fn from_toml(text: &str) -> std::result::Result<Rules, String> {
        let t: toml::Table =
            toml::from_str(text).map_err(|e| format!("rules file is not TOML: {e}"))?;
        let mut rules = Rules::default();
        for (k, val) in &t {
            match k.as_str() {
                "severity" => {
                    let tab = val.as_table().ok_or("[severity] must be a table")?;
                    for (id, s) in tab {
                        if rule_info(id).is_none() {
                            return Err(format!(
                                "unknown rule `{id}` (known: {})",
                                RULES.iter().map(|r| r.id).collect::<Vec<_>>().join(", ")
                            ));
                        }
                        let sev = match s.as_str() {
                            Some("error") => Some(Severity::Error),
                            Some("warning") => Some(Severity::Warning),
                            Some("info") => Some(Severity::Info),
                            Some("off") => None,
                            _ => {
                                return Err(format!(
                                    "severity of `{id}` must be \"error\", \"warning\", \"info\" or \"off\", found {s}"
                                ))
                            }
                        };
                        rules.overrides.insert(id.clone(), sev);
                    }
                }
                "thresholds" => {
                    let tab = val.as_table().ok_or("[thresholds] must be a table")?;
                    for (name, x) in tab {
                        let f = x
                            .as_float()
                            .or_else(|| x.as_integer().map(|i| i as f64))
                            .ok_or_else(|| format!("threshold `{name}` must be a number"))?;
                        if !f.is_finite() {
                            return Err(format!("threshold `{name}` must be finite"));
                        }
                        let th = &mut rules.thresholds;
                        let slot = match name.as_str() {
                            "weight_amax_min" => &mut th.weight_amax_min,
                            "weight_amax_max" => &mut th.weight_amax_max,
                            "input_amax_min" => &mut th.input_amax_min,
                            "input_amax_max" => &mut th.input_amax_max,
                            "norm_slack" => &mut th.norm_slack,
                            "spread_warning" => &mut th.spread_warning,
                            "spread_error" => &mut th.spread_error,
                            "fused_warning" => &mut th.fused_warning,
                            "fused_error" => &mut th.fused_error,
                            "saturated_fraction" => &mut th.saturated_fraction,
                            "swizzle_margin" => &mut th.swizzle_margin,
                            "swizzle_min_r2" => &mut th.swizzle_min_r2,
                            "reference_cos" => &mut th.reference_cos,
                            "reference_norm_tol" => &mut th.reference_norm_tol,
                            other => return Err(format!("unknown threshold `{other}`")),
                        };
                        *slot = f;
                    }
                }
                other => {
                    return Err(format!(
                        "unknown section `{other}` (known: severity, thresholds)"
                    ))
                }
            }
        }
        Ok(rules)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_overrides_and_thresholds() {
        let r = Rules::from_toml(
            "[severity]\n\"fused.mismatch\" = \"off\"\n\"scale.input.spread\" = \"info\"\n[thresholds]\nfused_error = 2\nnorm_slack = 3.5\n",
        )
        .unwrap();
        assert_eq!(r.severity("fused.mismatch", Severity::Error), None);
        assert_eq!(
            r.severity("scale.input.spread", Severity::Error),
            Some(Severity::Info)
        );
        assert_eq!(
            r.severity("scale.missing", Severity::Error),
            Some(Severity::Error)
        );
        assert_eq!(r.thresholds.fused_error, 2.0);
        assert_eq!(r.thresholds.norm_slack, 3.5);
        assert!(Rules::from_toml("[severity]\n\"no.such\" = \"off\"").is_err());
        assert!(Rules::from_toml("[thresholds]\nbogus = 1").is_err());
        assert!(Rules::from_toml("[severity]\n\"scale.missing\" = \"loud\"").is_err());
    }

    #[test]
    fn ids_unique() {
        for (i, a) in RULES.iter().enumerate() {
            assert!(RULES[i + 1..].iter().all(|b| b.id != a.id), "{}", a.id);
        }
    }
}
