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
/// (`consequence`); `latent` is a lint error whose op the run does not show diverging and that no
/// measurement decides (a `fused.mismatch` is decided: [`measure_fused_lint`]).
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

/// A routed-experts op whose own experts diverge one by one (each on its rows, against a
/// tolerance from its row count), as one finding naming them: the op's average over every
/// expert hides one broken expert among many healthy ones. Harmful: the tokens routed to it get a
/// wrong FFN output, and nothing proves that harmless.
pub fn expert_finding(r: &OpRecord) -> Option<Finding> {
    let bad: Vec<&crate::probe::experts::ExpertRecord> =
        r.experts.as_ref()?.iter().filter(|e| e.divergent).collect();
    if bad.is_empty() {
        return None;
    }
    let ids: Vec<String> = bad.iter().map(|e| e.expert.to_string()).collect();
    let reached = r
        .experts
        .as_ref()
        .map_or(0, |v| v.iter().filter(|e| e.rows > 0).count());
    let tensors: Vec<String> = r
        .weights
        .iter()
        .map(|(b, _)| b.clone())
        .filter(|b| {
            bad.iter()
                .any(|e| b.contains(&format!(".experts.{}.", e.expert)))
        })
        .collect();
    let first = bad[0];
    let op_err = r
        .served_isolated_vs_bf16
        .rel_l2
        .map_or("undefined".into(), |x| format!("{x:.3e}"));
    Some(Finding {
        source: Source::Divergence,
        impact: Impact::Harmful,
        level: Level::Error,
        ops: vec![r.id.clone()],
        tensors,
        parameter: None,
        kind: Some("expert".into()),
        summary: format!(
            "{} expert{} {} diverge{} on {} own rows: expert {}: {}",
            r.id,
            if bad.len() > 1 { "s" } else { "" },
            ids.join(", "),
            if bad.len() > 1 { "" } else { "s" },
            if bad.len() > 1 { "their" } else { "its" },
            first.expert,
            first.reason.as_deref().unwrap_or("beyond its tolerance")
        ),
        values: Vec::new(),
        absorbed_by: Vec::new(),
        why: format!(
            "{} of the {reached} experts tokens reached; the whole op's isolated rel-L2 {op_err} (tolerance {:.3e}) averages it with the healthy ones, but every token routed to {} gets a wrong FFN output",
            bad.len(),
            r.tolerance,
            if bad.len() > 1 { "them" } else { "it" }
        ),
        fix: Some(format!(
            "`nvfp4-probe bisect` names the parameter; check expert {}'s scales against its siblings (`nvfp4-probe inspect --filter '*experts.{}.*'`)",
            first.expert, first.expert
        )),
    })
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

/// A `fused.mismatch` lint error is decided by the served profile: the served path applies the
/// engine's fused-scale rule to every fused group (`served::fused`), so the run measured what the
/// engine does with the differing scales at the finding's op. Where that op diverged the finding
/// is already harmful; where it ran and did not diverge, it is absorbed by measurement (a warning
/// with the op's numbers; `--strict` makes it an error) instead of latent. It stays latent where
/// no measurement decides: its op is not among `records`, or no weight of the op belongs to a
/// fused group the served path merges.
pub fn measure_fused_lint(findings: &mut [Finding], records: &[OpRecord], strict: bool) {
    for f in findings.iter_mut() {
        if f.source != Source::Lint
            || f.impact != Impact::Latent
            || f.kind.as_deref() != Some("fused.mismatch")
        {
            continue;
        }
        let Some(r) = f
            .ops
            .first()
            .and_then(|o| records.iter().find(|r| &r.id == o))
        else {
            continue;
        };
        if r.divergent
            || !r
                .weights
                .iter()
                .any(|(b, s)| s.starts_with("nvfp4") && crate::served::fused::group(b).is_some())
        {
            continue;
        }
        let c = &r.served_isolated_vs_bf16;
        let rel = c.rel_l2.map_or("—".to_string(), |v| format!("{v:.3e}"));
        f.impact = Impact::Absorbed;
        f.why = format!(
            "measured: the served path keeps the engine's one scale for the fused group (docs/NVFP4.md §3.4) and {} stays within its tolerance (isolated rel-L2 {rel} ≤ {:.3e}), so the differing scales are absorbed at this prompt — {}",
            r.id, r.tolerance, f.why
        );
        f.values.push(OpValue {
            op: r.id.clone(),
            tensor: None,
            current: None,
            corrected: None,
            before: c.clone(),
            after: None,
        });
        f.set_strict(strict);
    }
}

/// `--reference`: the comparison of the weights the run read with the original
/// (`lint::reference::compare_layers`) as findings, like the lint's (source `lint`, kind the
/// `reference.*` rule): a weight that decodes off its reference is an error even when nothing
/// diverges (the oracle reads the same stored scale). One whose stored tensor scale is the cause
/// names that tensor, the factor and the value that reproduces the reference.
pub fn reference_findings(
    refs: &[lint::reference::RefFinding],
    divergent: &std::collections::HashSet<&str>,
    strict: bool,
) -> Vec<Finding> {
    let mut out: Vec<(Finding, usize)> = Vec::new();
    for r in refs {
        let l = &r.finding;
        let diverged = l.op.as_deref().is_some_and(|o| divergent.contains(o));
        let Some(mut f) = lint_finding(l, diverged, strict) else {
            continue;
        };
        let op = l.op.as_deref().unwrap_or("the run");
        f.summary = match (&r.scale, r.factor) {
            (Some((tensor, leaf, stored, right)), _) => {
                f.tensors = vec![tensor.clone(), l.tensor.clone()];
                f.parameter = Some(leaf.to_string());
                format!(
                    "reference: `{tensor}` makes `{}` decode ×{} of the original's at {op} (stored {stored}, {right} reproduces it)",
                    l.tensor,
                    lint::reference::factor_text(r.factor.unwrap_or(1.0))
                )
            }
            (None, Some(n)) => format!(
                "reference: `{}` decodes ×{} of the original's at {op}",
                l.tensor,
                lint::reference::factor_text(n)
            ),
            (None, None) => format!(
                "reference {}: `{}` differs from the original's at {op}",
                l.rule, l.tensor
            ),
        };
        // one root cause over many weights of an op (every expert's scale): one finding
        match out.iter_mut().find(|(g, _)| {
            g.kind == f.kind && g.ops == f.ops && g.impact == f.impact && g.fix == f.fix
        }) {
            Some((g, n)) => {
                g.tensors.extend(f.tensors);
                *n += 1;
            }
            None => out.push((f, 1)),
        }
    }
    out.into_iter()
        .map(|(mut f, n)| {
            if n > 1 {
                f.summary = format!("{n} weights — {} (each named in `tensors`)", f.summary);
            }
            f
        })
        .collect()
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
        .filter(|r| {
            r.divergent
                || r.experts
                    .as_ref()
                    .is_some_and(|v| v.iter().any(|e| e.divergent))
        })
        .map(|r| r.id.as_str())
        .collect();
    v.extend(res.records.iter().filter_map(expert_finding));
    let mut lint_v = lint_findings(lint, &divergent, strict);
    let anomalies = oracle_anomalies(&res.records, strict);
    // a degenerate config value (norm eps, routed scaling) zeroes ops on every path: their
    // oracle anomalies are its measured effect, not broken weights
    match lint_v
        .iter_mut()
        .find(|f| f.kind.as_deref() == Some("config.degenerate"))
    {
        Some(cf) if !anomalies.is_empty() => {
            cf.impact = Impact::Harmful;
            cf.why = format!(
                "{}; measured: the oracle's output is degenerate (zero or NaN/Inf) at {} op(s), first {}",
                cf.why,
                anomalies.len(),
                anomalies[0].ops.first().map_or("?", String::as_str)
            );
        }
        _ => v.extend(anomalies),
    }
    measure_fused_lint(&mut lint_v, &res.records, strict);
    v.extend(lint_v);
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
