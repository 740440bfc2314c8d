//! A run's findings, ordered by consequence, and the exit code they give.
//!
//! Three sources: ops whose own numerics diverge (with the severity their consequence gives them,
//! [`super::consequence`]); the static lint of the weights the run read (a lint error is a finding
//! even when nothing diverges: the oracle decodes the same broken scale, so a zero or infinite
//! global scale never shows as a divergence); and oracle anomalies — an op with weights whose
//! oracle output is identically zero or non-finite although its input is neither, which names
//! its weights. Harmful findings, lint errors and anomalies are errors (exit 1); absorbed ones
//! are warnings (exit 0) unless the run is strict.

use serde::Serialize;

use super::consequence::Severity;
use super::{OpRecord, RunResult};
use crate::lint;
use crate::metrics::{Compare, Stats};

/// Where a finding comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// An op's own (isolated) error exceeds its tolerance.
    Divergence,
    /// A static check of the checkpoint's scales (`nvfp4-probe lint`).
    Lint,
    /// The oracle itself is off: it decodes the same broken bytes, so nothing diverges.
    Anomaly,
}

/// Whether a finding fails the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    Warning,
    Error,
}

/// What a finding does, for ordering and wording: harmful and absorbed are measured
/// (`consequence`); `latent` is a lint error whose op the run does not show diverging (the
/// engine's numerics happen to mask it, e.g. the fused max takes the sibling's healthy scale).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Impact {
    Harmful,
    Latent,
    Absorbed,
}

impl Impact {
    pub fn as_str(self) -> &'static str {
        match self {
            Impact::Harmful => "harmful",
            Impact::Latent => "latent",
            Impact::Absorbed => "absorbed",
        }
    }
}

/// One op of a finding: what was wrong there and, when a hypothesis explains it (bisect), the
/// parameter's current and corrected value and the op's agreement before and after.
#[derive(Clone, Debug, Serialize)]
pub struct OpValue {
    pub op: String,
    /// The checkpoint tensor holding the parameter (bisect) or the weights the op reads.
    pub tensor: Option<String>,
    pub current: Option<f32>,
    pub corrected: Option<f32>,
    /// The served op vs the BF16 oracle, as measured.
    pub before: Compare,
    /// With the corrected value (bisect).
    pub after: Option<Compare>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    pub source: Source,
    pub impact: Impact,
    pub level: Level,
    /// The ops of this root cause (one op, or the same fault at several ops).
    pub ops: Vec<String>,
    /// Checkpoint tensors (or weight bases) it names.
    pub tensors: Vec<String>,
    /// The engine parameter, when known (`input_global_scale_inv`, `w13_weight_scale_2`, …).
    pub parameter: Option<String>,
    /// A hypothesis kind (bisect) or a lint rule.
    pub kind: Option<String>,
    /// One line.
    pub summary: String,
    pub values: Vec<OpValue>,
    /// The ops that absorb it.
    pub absorbed_by: Vec<String>,
    /// Why harmful (where it shows), why absorbed (which op removes it and how), or the evidence.
    pub why: String,
    pub fix: Option<String>,
}

impl Finding {
    /// `--strict`: an absorbed finding is an error too.
    pub fn set_strict(&mut self, strict: bool) {
        if self.impact == Impact::Absorbed {
            self.level = if strict { Level::Error } else { Level::Warning };
        }
    }
}

/// Order by consequence: errors first; harmful before latent before absorbed; NaN/Inf and larger
/// downstream effects first; then by the first op's step.
pub fn sort(v: &mut [Finding], step_of: impl Fn(&str) -> usize) {
    let weight = |f: &Finding| -> f64 {
        if f.why.contains("NaN") {
            return f64::INFINITY;
        }
        f.values
            .iter()
            .filter_map(|v| v.before.rel_l2)
            .fold(0.0, f64::max)
    };
    v.sort_by(|a, b| {
        b.level
            .cmp(&a.level)
            .then(a.impact.cmp(&b.impact))
            .then(weight(b).total_cmp(&weight(a)))
            .then(
                step_of(a.ops.first().map_or("", String::as_str))
                    .cmp(&step_of(b.ops.first().map_or("", String::as_str))),
            )
    });
}

/// The exit code of a list of findings: 1 when any is an error.
pub fn exit_code(findings: &[Finding]) -> i32 {
    if findings.iter().any(|f| f.level == Level::Error) {
        crate::error::EXIT_FINDINGS
    } else {
        crate::error::EXIT_OK
    }
}

/// A divergent op as a finding (its consequence decides its impact).
pub fn divergence_finding(r: &OpRecord, strict: bool) -> Finding {
    let (impact, why, absorbed_by) = match &r.consequence {
        Some(c) if c.severity == Severity::Absorbed => {
            (Impact::Absorbed, c.why.clone(), c.absorbed_by.clone())
        }
        Some(c) => (Impact::Harmful, c.why.clone(), Vec::new()),
        None => (
            Impact::Harmful,
            "not analysed downstream".into(),
            Vec::new(),
        ),
    };
    let mut f = Finding {
        source: Source::Divergence,
        impact,
        level: if impact == Impact::Absorbed {
            Level::Warning
        } else {
            Level::Error
        },
        ops: vec![r.id.clone()],
        tensors: r.weights.iter().map(|(b, _)| b.clone()).collect(),
        parameter: None,
        kind: None,
        summary: format!(
            "{} diverges: {}",
            r.id,
            r.reason.as_deref().unwrap_or("beyond its tolerance")
        ),
        values: vec![OpValue {
            op: r.id.clone(),
            tensor: None,
            current: None,
            corrected: None,
            before: r.served_isolated_vs_bf16.clone(),
            after: None,
        }],
        absorbed_by,
        why,
        fix: Some(format!(
            "`nvfp4-probe bisect` names the parameter{}",
            if impact == Impact::Absorbed {
                " (absorbed: a latent fault that an engine without the absorbing op would show)"
            } else {
                ""
            }
        )),
    };
    f.set_strict(strict);
    f
}

/// A lint error (or an absorbed lint warning) of the layers the run read, as a finding. `diverged`
/// tells whether the finding's op diverged in the run (then the divergence carries the measured
/// impact and the lint error is harmful too).
pub fn lint_finding(l: &lint::Finding, diverged: bool, strict: bool) -> Option<Finding> {
    let absorbed = l.absorbed_by.is_some() && l.severity < lint::Severity::Error;
    if l.severity < lint::Severity::Error && !absorbed {
        return None;
    }
    let impact = if absorbed {
        Impact::Absorbed
    } else if diverged {
        Impact::Harmful
    } else {
        Impact::Latent
    };
    let mut f = Finding {
        source: Source::Lint,
        impact,
        level: if absorbed {
            Level::Warning
        } else {
            Level::Error
        },
        ops: l.op.iter().cloned().collect(),
        tensors: vec![l.tensor.clone()],
        parameter: None,
        kind: Some(l.rule.clone()),
        summary: format!("lint {}: `{}`", l.rule, l.tensor),
        values: Vec::new(),
        absorbed_by: l.absorbed_by.iter().cloned().collect(),
        why: l.evidence.clone(),
        fix: Some(l.fix.clone()),
    };
    f.set_strict(strict);
    Some(f)
}

/// The lint findings of the layers a run read as findings, one per root cause (same rule, op,
/// impact and fix: the three input scales of one shared expert are one finding naming three
/// tensors). `divergent` are the ops that diverged in the run.
pub fn lint_findings(
    lint: &[lint::Finding],
    divergent: &std::collections::HashSet<&str>,
    strict: bool,
) -> Vec<Finding> {
    let mut out: Vec<Finding> = Vec::new();
    for l in lint {
        let diverged = l.op.as_deref().is_some_and(|o| divergent.contains(o));
        let Some(f) = lint_finding(l, diverged, strict) else {
            continue;
        };
        if let Some(g) = out
            .iter_mut()
            .find(|g| g.kind == f.kind && g.ops == f.ops && g.impact == f.impact && g.fix == f.fix)
        {
            g.tensors.extend(f.tensors);
            g.summary = format!(
                "lint {}: {}",
                g.kind.as_deref().unwrap_or(""),
                g.tensors
                    .iter()
                    .map(|t| format!("`{t}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            continue;
        }
        out.push(f);
    }
    out
}

/// The main data input of an op id, by the graph's conventions (None for ops that mix several).
pub fn input_of(id: &str) -> Option<String> {
    let (l, rest) = id.split_once('.')?;
    let inp = match rest {
        "attn.q_a" | "attn.kv" => "attn.norm",
        "attn.q_b" => "attn.q_norm",
        "attn.wo_a" => "attn.core",
        "attn.wo_b" => "attn.wo_a",
        "ffn.experts" | "ffn.shared" | "ffn.router" => "ffn.norm",
        "attn.compressor" | "attn.indexer" => "attn.norm",
        _ => return None,
    };
    Some(format!("{l}.{inp}"))
}

fn zero(s: &Stats) -> bool {
    s.numel > 0 && s.zeros == s.numel
}

/// Ops with weights whose BF16 oracle output is identically zero or non-finite while their input
/// (when the run measured it) is neither: the oracle decodes the same broken bytes, so no
/// divergence shows them. The first such op of each chain only (its consumers inherit it).
pub fn oracle_anomalies(records: &[OpRecord], strict: bool) -> Vec<Finding> {
    let by_id: std::collections::HashMap<&str, &OpRecord> =
        records.iter().map(|r| (r.id.as_str(), r)).collect();
    let mut out = Vec::new();
    for r in records {
        if r.weights.is_empty() || r.agreement.is_some() {
            continue;
        }
        let Some(o) = r.stats.get("oracle_bf16") else {
            continue;
        };
        let what = if o.non_finite() {
            "non-finite (NaN/Inf)"
        } else if zero(o) {
            "identically zero"
        } else {
            continue;
        };
        let input = input_of(&r.id).and_then(|i| by_id.get(i.as_str()).copied());
        if let Some(i) = input.and_then(|i| i.stats.get("oracle_bf16")) {
            if i.non_finite() || zero(i) {
                continue;
            }
        }
        let weights: Vec<String> = r.weights.iter().map(|(b, _)| b.clone()).collect();
        let mut f = Finding {
            source: Source::Anomaly,
            impact: Impact::Harmful,
            level: Level::Error,
            ops: vec![r.id.clone()],
            tensors: weights.clone(),
            parameter: None,
            kind: Some(if o.non_finite() { "oracle-non-finite" } else { "oracle-zero" }.into()),
            summary: format!(
                "{}: the BF16 oracle's output is {what} on {} input — the weights {} decode to it",
                r.id,
                if input.is_some() { "a finite, non-zero" } else { "its" },
                weights.join(", ")
            ),
            values: Vec::new(),
            absorbed_by: Vec::new(),
            why: "served and oracle decode the same bytes, so nothing diverges; the scales of these weights are broken (see the lint findings, or `nvfp4-probe lint --reference DIR`)".into(),
            fix: Some("re-export the weight's scales".into()),
        };
        f.set_strict(strict);
        out.push(f);
    }
    out
}

/// Everything a run found: divergences, the static lint of what it read, oracle anomalies; sorted.
pub fn run_findings(res: &RunResult, lint: &[lint::Finding], strict: bool) -> Vec<Finding> {
    let mut v: Vec<Finding> = res
        .records
        .iter()
        .filter(|r| r.divergent)
        .map(|r| divergence_finding(r, strict))
        .collect();
    let divergent: std::collections::HashSet<&str> = res
        .records
        .iter()
        .filter(|r| r.divergent)
        .map(|r| r.id.as_str())
        .collect();
    v.extend(lint_findings(lint, &divergent, strict));
    v.extend(oracle_anomalies(&res.records, strict));
    let steps: std::collections::HashMap<&str, usize> = res
        .records
        .iter()
        .map(|r| (r.id.as_str(), r.step))
        .collect();
    sort(&mut v, |op| steps.get(op).copied().unwrap_or(usize::MAX));
    v
}

/// Terminal lines: one block per finding.
pub fn terminal(findings: &[Finding]) -> String {
    let mut s = String::new();
    if findings.is_empty() {
        return "findings: none\n".into();
    }
    let (e, w) = (
        findings.iter().filter(|f| f.level == Level::Error).count(),
        findings
            .iter()
            .filter(|f| f.level == Level::Warning)
            .count(),
    );
    s.push_str(&format!(
        "findings: {e} error(s), {w} warning(s) (ordered by consequence)\n"
    ));
    for (i, f) in findings.iter().enumerate() {
        let lvl = match f.level {
            Level::Error => "error",
            Level::Warning => "warning",
        };
        s.push_str(&format!(
            "{}. {lvl} [{}{}] {}\n",
            i + 1,
            f.impact.as_str(),
            match f.source {
                Source::Divergence => "",
                Source::Lint => ", lint",
                Source::Anomaly => ", oracle anomaly",
            },
            f.summary
        ));
        for v in &f.values {
            if v.current.is_some() || v.after.is_some() {
                s.push_str(&format!("   {}\n", value_line(v)));
            }
        }
        s.push_str(&format!("   {}\n", why_line(f)));
        if let Some(fix) = &f.fix {
            s.push_str(&format!("   fix: {fix}\n"));
        }
    }
    s
}

/// "absorbed by OP: how" for a measured absorption (its `why` names each absorbing op), else the
/// finding's why (a lint finding's evidence names the absorbing op itself).
fn why_line(f: &Finding) -> String {
    if f.impact == Impact::Absorbed && f.source == Source::Divergence {
        format!("absorbed by {}", f.why)
    } else if f.impact == Impact::Harmful && f.source == Source::Divergence {
        format!("harmful: {}", f.why)
    } else {
        f.why.clone()
    }
}

fn val(v: Option<f32>) -> String {
    v.map_or("—".into(), |x| format!("{x:.4e}"))
}

fn cr(c: &Compare) -> String {
    format!(
        "cos {} rel-L2 {}",
        c.cos.map_or("—".into(), |v| format!("{v:.4}")),
        c.rel_l2.map_or("—".into(), |v| format!("{v:.3e}"))
    )
}

/// `op: tensor current → corrected; cos … → …`.
pub fn value_line(v: &OpValue) -> String {
    let mut s = v.op.clone();
    if let Some(t) = &v.tensor {
        s.push_str(&format!(" `{t}`"));
    }
    if v.current.is_some() || v.corrected.is_some() {
        s.push_str(&format!(": {} → {}", val(v.current), val(v.corrected)));
    }
    match &v.after {
        Some(a) => s.push_str(&format!("; {} → {}", cr(&v.before), cr(a))),
        None => s.push_str(&format!("; {}", cr(&v.before))),
    }
    s
}

/// A markdown section.
pub fn markdown(findings: &[Finding]) -> String {
    let mut s = String::from("## Findings\n\n");
    if findings.is_empty() {
        s.push_str("None.\n");
        return s;
    }
    s.push_str("| # | level | impact | source | ops | summary | absorbed by / why | fix |\n|---|---|---|---|---|---|---|---|\n");
    let cell = |x: &str| x.replace('|', "\\|").replace('\n', " ");
    for (i, f) in findings.iter().enumerate() {
        let mut summary = f.summary.clone();
        for v in &f.values {
            if v.current.is_some() || v.after.is_some() {
                summary.push_str(&format!("<br>{}", value_line(v)));
            }
        }
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
            i + 1,
            match f.level {
                Level::Error => "error",
                Level::Warning => "warning",
            },
            f.impact.as_str(),
            match f.source {
                Source::Divergence => "divergence",
                Source::Lint => "lint",
                Source::Anomaly => "anomaly",
            },
            f.ops
                .iter()
                .map(|o| format!("`{o}`"))
                .collect::<Vec<_>>()
                .join(", "),
            cell(&summary),
            cell(&why_line(f)),
            cell(f.fix.as_deref().unwrap_or(""))
        ));
    }
    s
}
