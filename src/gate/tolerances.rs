//! Tolerances as data: an ordered list of rules, user rules first and the built-in defaults last.
//!
//! For each op, metric and comparison the first matching rule decides each of the three bounds
//! independently (absolute lower `min`, absolute upper `max`, the relative-to-baseline bound), so
//! a specific rule placed before a general one overrides it, and an absolute floor written by the
//! user does not switch off the built-in relative check. `skip = true` claims all three.

use crate::model::op::OpClass;
use crate::{Error, Result};
use serde::Deserialize;
use std::path::Path;

/// The comparison used when a rule does not name one: what the user would see at the output.
pub const DEFAULT_COMPARE: &str = "served_propagated_vs_bf16";

/// Which way is worse; decides the meaning of `max_ratio` and the sort order of moved rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    HigherBetter,
    LowerBetter,
    /// Both growth and shrinkage are suspicious (an amax ratio far from the baseline either way).
    NearBaseline,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Metric {
    Cos,
    RelL2,
    AmaxRatio,
    SqnrDb,
    /// NaN count in one path's stats.
    Nan,
    /// Inf count in one path's stats.
    Inf,
    /// The op's isolated verdict, as 0/1.
    Divergent,
    /// The head's mean next-token KL divergence (nats) of a head comparison.
    Kl,
    /// The head's fraction of positions whose top-1 tokens agree.
    Top1,
    /// The head's mean top-5 overlap.
    Top5,
}

/// The comparison the head's metrics (kl, top1, top5) are read from when a rule names none.
pub const HEAD_COMPARE: &str = "head_served_vs_bf16";

impl Metric {
    pub const ALL: [Metric; 10] = [
        Metric::Cos,
        Metric::RelL2,
        Metric::AmaxRatio,
        Metric::SqnrDb,
        Metric::Nan,
        Metric::Inf,
        Metric::Divergent,
        Metric::Kl,
        Metric::Top1,
        Metric::Top5,
    ];

    /// The comparison a rule of this metric reads when it names none.
    pub fn default_compare(self) -> &'static str {
        match self {
            Metric::Kl | Metric::Top1 | Metric::Top5 => HEAD_COMPARE,
            _ => DEFAULT_COMPARE,
        }
    }

    pub fn parse(s: &str) -> Option<Metric> {
        Metric::ALL.into_iter().find(|m| m.name() == s)
    }

    /// The spelling in rule files and in the run JSON.
    pub fn name(self) -> &'static str {
        match self {
            Metric::Cos => "cos",
            Metric::RelL2 => "rel_l2",
            Metric::AmaxRatio => "amax_ratio",
            Metric::SqnrDb => "sqnr_db",
            Metric::Nan => "nan",
            Metric::Inf => "inf",
            Metric::Divergent => "divergent",
            Metric::Kl => "kl",
            Metric::Top1 => "top1",
            Metric::Top5 => "top5",
        }
    }

    pub fn direction(self) -> Direction {
        match self {
            Metric::Cos | Metric::SqnrDb | Metric::Top1 | Metric::Top5 => Direction::HigherBetter,
            Metric::AmaxRatio => Direction::NearBaseline,
            _ => Direction::LowerBetter,
        }
    }

    /// Where the value lives in an op record.
    pub fn source_kind(self) -> SourceKind {
        match self {
            Metric::Nan | Metric::Inf => SourceKind::Path,
            Metric::Divergent => SourceKind::Op,
            _ => SourceKind::Comparison,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceKind {
    /// `op[comparison][metric]`, e.g. `op.served_propagated_vs_bf16.cos`.
    Comparison,
    /// `op.stats[path][metric]`, e.g. `op.stats.served.nan`.
    Path,
    /// A field of the op itself.
    Op,
}

/// The bound relative to the baseline value `b`; the current value is `c`.
#[derive(Clone, Debug, PartialEq)]
pub enum Relative {
    /// `c ≥ b − max(d, k·noise)`.
    Drop {
        d: f64,
        noise_multiplier: Option<f64>,
    },
    /// `c ≤ b + max(d, k·noise)`.
    Increase {
        d: f64,
        noise_multiplier: Option<f64>,
    },
    /// Lower-better: `c ≤ r·b + slack`; higher-better: `c ≥ b/r − slack`; near-baseline: both.
    Ratio { r: f64, slack: f64 },
}

#[derive(Clone, Debug, PartialEq)]
pub struct Rule {
    /// Glob over op ids (`*` any run of characters, `?` one character).
    pub ops: String,
    /// Glob over the op's class (`Linear`, `Moe`, …); `None` matches every class.
    pub class: Option<String>,
    pub metric: Metric,
    /// Glob over comparison names (for cos, rel_l2, amax_ratio, sqnr_db) or path names (nan, inf).
    pub source: String,
    pub min: Option<f64>,
    pub max: Option<f64>,
    pub relative: Option<Relative>,
    pub skip: bool,
    /// Where the rule came from, for messages: `built-in` or `FILE rule #N`.
    pub origin: String,
}

impl Rule {
    pub fn matches(&self, op: &str, class: &str, metric: Metric, source: &str) -> bool {
        self.metric == metric
            && glob_match(&self.ops, op)
            && self.class.as_deref().is_none_or(|c| glob_match(c, class))
            && glob_match(&self.source, source)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Tolerances {
    /// In priority order: earlier rules win.
    pub rules: Vec<Rule>,
    /// `strict = true` at the top of the file: a divergent op whose error is absorbed downstream
    /// (`consequence.severity = "absorbed"` in the run JSON) counts as divergent for the
    /// `divergent` metric. By default only harmful divergences count, as `run` exits 0 on them.
    pub strict: bool,
}

impl Default for Tolerances {
    /// The built-in gate: cos may drop by max(0.002, 3× the op's BF16-vs-FP32 spread), rel-L2 may
    /// grow to 1.5× + 1e-3, amax ratio stays within ×2, no new NaN/Inf in any path, no op turns
    /// divergent.
    fn default() -> Self {
        Tolerances {
            rules: builtin_rules(),
            strict: false,
        }
    }
}

fn builtin_rules() -> Vec<Rule> {
    let rule = |metric: Metric, source: &str, relative: Relative| Rule {
        ops: "*".into(),
        class: None,
        metric,
        source: source.into(),
        min: None,
        max: None,
        relative: Some(relative),
        skip: false,
        origin: "built-in".into(),
    };
    vec![
        rule(
            Metric::Cos,
            DEFAULT_COMPARE,
            Relative::Drop {
                d: 0.002,
                noise_multiplier: Some(3.0),
            },
        ),
        rule(
            Metric::RelL2,
            DEFAULT_COMPARE,
            Relative::Ratio {
                r: 1.5,
                slack: 1e-3,
            },
        ),
        rule(
            Metric::AmaxRatio,
            DEFAULT_COMPARE,
            Relative::Ratio { r: 2.0, slack: 0.0 },
        ),
        rule(
            Metric::Nan,
            "*",
            Relative::Increase {
                d: 0.0,
                noise_multiplier: None,
            },
        ),
        rule(
            Metric::Inf,
            "*",
            Relative::Increase {
                d: 0.0,
                noise_multiplier: None,
            },
        ),
        rule(
            Metric::Divergent,
            "*",
            Relative::Increase {
                d: 0.0,
                noise_multiplier: None,
            },
        ),
        // the model's output: next-token agreement may not drop by more than 5 points, KL may
        // not double (plus 1e-3 nats)
        rule(
            Metric::Top1,
            HEAD_COMPARE,
            Relative::Drop {
                d: 0.05,
                noise_multiplier: None,
            },
        ),
        rule(
            Metric::Top5,
            HEAD_COMPARE,
            Relative::Drop {
                d: 0.05,
                noise_multiplier: None,
            },
        ),
        rule(
            Metric::Kl,
            HEAD_COMPARE,
            Relative::Ratio {
                r: 2.0,
                slack: 1e-3,
            },
        ),
    ]
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    /// `false` drops the built-in rules: only the file's rules are checked.
    #[serde(default = "yes")]
    defaults: bool,
    /// Absorbed divergences count as divergent.
    #[serde(default)]
    strict: bool,
    #[serde(default)]
    rule: Vec<RawRule>,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    #[serde(default)]
    ops: Option<String>,
    #[serde(default)]
    class: Option<String>,
    metric: String,
    #[serde(default)]
    compare: Option<String>,
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    min: Option<f64>,
    #[serde(default)]
    max: Option<f64>,
    #[serde(default)]
    max_drop: Option<f64>,
    #[serde(default)]
    max_increase: Option<f64>,
    #[serde(default)]
    max_ratio: Option<f64>,
    #[serde(default)]
    slack: Option<f64>,
    #[serde(default)]
    noise_multiplier: Option<f64>,
    #[serde(default)]
    skip: bool,
}

/// Comparisons and paths of `nvfp4-probe.run/1`. A literal name in a rule must be one of these
/// (a typo would otherwise silently check nothing); a glob may match names added later.
pub const COMPARISONS: [&str; 8] = [
    "bf16_vs_fp32",
    "served_isolated_vs_bf16",
    "served_isolated_vs_fp32",
    "served_propagated_vs_bf16",
    "served_propagated_vs_fp32",
    "head_served_vs_bf16",
    "head_served_vs_fp32",
    "head_bf16_vs_fp32",
];
pub const PATHS: [&str; 4] = ["oracle_fp32", "oracle_bf16", "served", "served_isolated"];

fn known(name: &str, list: &[&str], what: &str) -> std::result::Result<(), String> {
    if name.contains('*') || name.contains('?') || list.contains(&name) {
        Ok(())
    } else {
        Err(format!(
            "unknown {what} `{name}` (known: {}; globs allowed)",
            list.join(", ")
        ))
    }
}

/// A rule's `class` must name an op class of the run JSON, or be a glob matching at least one:
/// `class = "moe"` (the class is `Moe`) would otherwise match no op and the rule check nothing.
fn known_class(class: &str) -> std::result::Result<(), String> {
    let names = OpClass::ALL.map(OpClass::name);
    if names.iter().any(|n| glob_match(class, n)) {
        return Ok(());
    }
    let hint = names
        .iter()
        .find(|n| n.eq_ignore_ascii_case(class))
        .map(|n| format!("; did you mean `{n}`? classes are case-sensitive"))
        .unwrap_or_default();
    Err(format!(
        "unknown op class `{class}`: it matches no op (known classes: {}; globs allowed{hint})",
        names.join(", ")
    ))
}

/// The path whose stats a comparison's first operand comes from, so `metric = "nan"` with
/// `compare = "served_isolated_vs_bf16"` counts NaN in the isolated served output.
pub fn comparison_path(compare: &str) -> Option<&'static str> {
    if compare.starts_with("served_propagated") {
        Some("served")
    } else if compare.starts_with("served_isolated") {
        Some("served_isolated")
    } else if compare.starts_with("bf16_vs") {
        Some("oracle_bf16")
    } else {
        None
    }
}

impl Tolerances {
    /// Parses a rule file; `origin` names it in errors and in every rule's description. The
    /// file's rules come before the built-in ones unless it says `defaults = false`.
    pub fn from_toml(text: &str, origin: impl AsRef<Path>) -> Result<Tolerances> {
        let origin = origin.as_ref();
        let raw: RawFile = toml::from_str(text)
            .map_err(|e| Error::bad(origin, None, format!("tolerance file: {e}")))?;
        let mut rules = Vec::with_capacity(raw.rule.len() + 6);
        for (i, r) in raw.rule.into_iter().enumerate() {
            let label = format!("{} rule #{}", origin.display(), i + 1);
            rules.push(
                convert(r, &label)
                    .map_err(|m| Error::bad(origin, None, format!("rule #{}: {m}", i + 1)))?,
            );
        }
        if raw.defaults {
            rules.extend(builtin_rules());
        }
        Ok(Tolerances {
            rules,
            strict: raw.strict,
        })
    }
}

fn check_finite(name: &str, v: Option<f64>) -> std::result::Result<(), String> {
    match v {
        Some(x) if !x.is_finite() => Err(format!("`{name}` must be finite, got {x}")),
        _ => Ok(()),
    }
}

fn convert(r: RawRule, origin: &str) -> std::result::Result<Rule, String> {
    let metric = Metric::parse(&r.metric).ok_or_else(|| {
        format!(
            "unknown metric `{}` (expected one of {})",
            r.metric,
            Metric::ALL.map(|m| m.name()).join(", ")
        )
    })?;
    for (n, v) in [
        ("min", r.min),
        ("max", r.max),
        ("max_drop", r.max_drop),
        ("max_increase", r.max_increase),
        ("max_ratio", r.max_ratio),
        ("slack", r.slack),
        ("noise_multiplier", r.noise_multiplier),
    ] {
        check_finite(n, v)?;
    }
    for (n, v) in [
        ("max_drop", r.max_drop),
        ("max_increase", r.max_increase),
        ("slack", r.slack),
        ("noise_multiplier", r.noise_multiplier),
    ] {
        if v.is_some_and(|x| x < 0.0) {
            return Err(format!("`{n}` must be ≥ 0"));
        }
    }
    let source = match metric.source_kind() {
        SourceKind::Comparison => {
            if r.path.is_some() {
                return Err(format!(
                    "`path` applies to nan/inf only; `{}` uses `compare`",
                    metric.name()
                ));
            }
            r.compare
                .clone()
                .unwrap_or_else(|| metric.default_compare().to_string())
        }
        SourceKind::Path => match (&r.path, &r.compare) {
            (Some(_), Some(_)) => return Err("give `path` or `compare`, not both".into()),
            (Some(p), None) => p.clone(),
            (None, Some(c)) => comparison_path(c)
                .ok_or_else(|| {
                    format!(
                        "comparison `{c}` has no single path for `{}`",
                        metric.name()
                    )
                })?
                .to_string(),
            (None, None) => comparison_path(DEFAULT_COMPARE)
                .unwrap_or("served")
                .to_string(),
        },
        SourceKind::Op => {
            if r.path.is_some() || r.compare.is_some() {
                return Err(format!(
                    "`{}` takes neither `path` nor `compare`",
                    metric.name()
                ));
            }
            "*".to_string()
        }
    };
    if let Some(c) = &r.class {
        known_class(c)?;
    }
    match metric.source_kind() {
        SourceKind::Comparison => known(&source, &COMPARISONS, "comparison")?,
        SourceKind::Path => known(&source, &PATHS, "path")?,
        SourceKind::Op => {}
    }
    let relatives = [
        r.max_drop.is_some(),
        r.max_increase.is_some(),
        r.max_ratio.is_some(),
    ]
    .iter()
    .filter(|b| **b)
    .count();
    if relatives > 1 {
        return Err("at most one of `max_drop`, `max_increase`, `max_ratio` per rule".into());
    }
    if r.noise_multiplier.is_some() {
        if r.max_drop.is_none() && r.max_increase.is_none() {
            return Err("`noise_multiplier` goes with `max_drop` or `max_increase`".into());
        }
        if !matches!(metric, Metric::Cos | Metric::RelL2) {
            return Err("`noise_multiplier` is defined for cos and rel_l2 only (their BF16-vs-FP32 noise floor)".into());
        }
    }
    if r.slack.is_some() && r.max_ratio.is_none() {
        return Err("`slack` goes with `max_ratio`".into());
    }
    let relative = if let Some(d) = r.max_drop {
        Some(Relative::Drop {
            d,
            noise_multiplier: r.noise_multiplier,
        })
    } else if let Some(d) = r.max_increase {
        Some(Relative::Increase {
            d,
            noise_multiplier: r.noise_multiplier,
        })
    } else if let Some(ratio) = r.max_ratio {
        if ratio < 1.0 {
            return Err(format!("`max_ratio` must be ≥ 1, got {ratio}"));
        }
        Some(Relative::Ratio {
            r: ratio,
            slack: r.slack.unwrap_or(0.0),
        })
    } else {
        None
    };
    if !r.skip && r.min.is_none() && r.max.is_none() && relative.is_none() {
        return Err(
            "a rule needs a bound (min, max, max_drop, max_increase, max_ratio) or `skip = true`"
                .into(),
        );
    }
    if r.skip && (r.min.is_some() || r.max.is_some() || relative.is_some()) {
        return Err("`skip = true` cannot carry bounds".into());
    }
    if let (Some(lo), Some(hi)) = (r.min, r.max) {
        if lo > hi {
            return Err(format!("`min` {lo} > `max` {hi}"));
        }
    }
    Ok(Rule {
        ops: r.ops.unwrap_or_else(|| "*".into()),
        class: r.class,
        metric,
        source,
        min: r.min,
        max: r.max,
        relative,
        skip: r.skip,
        origin: origin.to_string(),
    })
}

pub use crate::glob::glob_match;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob_examples() {
        assert!(glob_match("L*.ffn.experts", "L12.ffn.experts"));
        assert!(!glob_match("L*.ffn.experts", "L12.ffn.experts.w2"));
        assert!(glob_match("*", "embed"));
        assert!(glob_match("*", ""));
        assert!(glob_match("L?.attn.*", "L3.attn.q_a"));
        assert!(!glob_match("L?.attn.*", "L13.attn.q_a"));
        assert!(glob_match("*experts*", "L1.ffn.experts"));
        assert!(!glob_match("head", "hc_head"));
        assert!(glob_match("a*b*c", "aXbYbZc"));
        assert!(!glob_match("a*b*c", "aXbYbZ"));
    }

    #[test]
    fn rules_parse_and_come_before_defaults() {
        let t = Tolerances::from_toml(
            r#"
            [[rule]]
            ops = "L*.ffn.experts"
            metric = "cos"
            min = 0.98
            [[rule]]
            ops = "*"
            metric = "nan"
            compare = "served_isolated_vs_bf16"
            max = 0
            "#,
            "t.toml",
        )
        .unwrap();
        assert_eq!(t.rules.len(), 2 + Tolerances::default().rules.len());
        assert_eq!(t.rules[0].min, Some(0.98));
        assert_eq!(t.rules[0].source, DEFAULT_COMPARE);
        assert_eq!(t.rules[1].source, "served_isolated");
        assert_eq!(t.rules[0].origin, "t.toml rule #1");
        assert_eq!(t.rules[2].origin, "built-in");
    }

    #[test]
    fn strict_is_read_from_the_top_of_the_file() {
        assert!(!Tolerances::default().strict);
        assert!(!Tolerances::from_toml("", "t.toml").unwrap().strict);
        let t = Tolerances::from_toml("strict = true\n", "t.toml").unwrap();
        assert!(t.strict);
        assert_eq!(t.rules, Tolerances::default().rules);
    }

    #[test]
    fn defaults_can_be_dropped() {
        let t = Tolerances::from_toml(
            "defaults = false\n[[rule]]\nmetric = \"rel_l2\"\nmax = 0.1\n",
            "t.toml",
        )
        .unwrap();
        assert_eq!(t.rules.len(), 1);
    }

    #[test]
    fn bad_rules_are_errors_naming_the_file() {
        for bad in [
            "[[rule]]\nmetric = \"cosine\"\nmin = 0.9\n",
            "[[rule]]\nmetric = \"cos\"\n",
            "[[rule]]\nmetric = \"cos\"\nmax_dorp = 0.1\n",
            "[[rule]]\nmetric = \"cos\"\nmax_drop = 0.1\nmax_ratio = 2\n",
            "[[rule]]\nmetric = \"amax_ratio\"\nmax_ratio = 0.5\n",
            "[[rule]]\nmetric = \"sqnr_db\"\nmax_drop = 1\nnoise_multiplier = 2\n",
            "[[rule]]\nmetric = \"cos\"\nmin = 0.99\nmax = 0.9\n",
            "[[rule]]\nmetric = \"cos\"\nmin = nan\n",
            "[[rule]]\nmetric = \"cos\"\ncompare = \"served_isolated_vs_bf61\"\nmin = 0.9\n",
            "[[rule]]\nmetric = \"nan\"\npath = \"serverd\"\nmax = 0\n",
            "[[rule]]\nclass = \"moe\"\nmetric = \"cos\"\nmin = 0.9\n",
            "[[rule]]\nclass = \"X*\"\nmetric = \"cos\"\nmin = 0.9\n",
            "not toml at all [",
        ] {
            let e = Tolerances::from_toml(bad, "bad.toml").unwrap_err();
            assert!(e.to_string().contains("bad.toml"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn classes_are_the_run_json_spelling_and_globs_must_match_one() {
        for c in OpClass::ALL {
            assert_eq!(serde_json::to_value(c).unwrap(), c.name());
        }
        for ok in ["Moe", "M*", "*", "Linear"] {
            let t = format!("[[rule]]\nclass = \"{ok}\"\nmetric = \"cos\"\nmin = 0.9\n");
            Tolerances::from_toml(&t, "t.toml").unwrap();
        }
        let e = Tolerances::from_toml(
            "[[rule]]\nclass = \"moe\"\nmetric = \"cos\"\nmin = 0.9\n",
            "t.toml",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("t.toml") && e.contains("`moe`") && e.contains("Moe"),
            "{e}"
        );
        assert!(e.contains("Linear") && e.contains("Attention"), "{e}");
    }
}
