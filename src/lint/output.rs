//! The three renderings of a report: JSON (`nvfp4-probe.lint/1`), markdown for a GitHub issue,
//! and the terminal summary.

use serde::Serialize;

use super::group::{group, Group};
use super::{Finding, Report, Severity, SCHEMA};

#[derive(Serialize)]
struct Json<'a> {
    schema: &'static str,
    model: String,
    reference: Option<String>,
    weights: usize,
    errors: usize,
    warnings: usize,
    bytes_read: u64,
    seconds: f64,
    findings: &'a [Finding],
    /// The findings by root cause (same rule, severity, op and fix), as the text and markdown show them.
    groups: Vec<Group<'a>>,
}

pub fn to_json(r: &Report) -> String {
    let j = Json {
        schema: SCHEMA,
        model: r.model.display().to_string(),
        reference: r.reference.as_ref().map(|p| p.display().to_string()),
        weights: r.weights,
        errors: r.count(Severity::Error),
        warnings: r.count(Severity::Warning),
        bytes_read: r.bytes_read,
        seconds: r.seconds,
        findings: &r.findings,
        groups: group(&r.findings),
    };
    serde_json::to_string_pretty(&j).unwrap_or_else(|_| "{}".into())
}

fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

fn icon(s: Severity) -> &'static str {
    match s {
        Severity::Error => "🛑 error",
        Severity::Warning => "⚠️ warning",
        Severity::Info => "ℹ️ info",
    }
}

/// Markdown meant to be pasted into a GitHub issue: a one-line verdict, a table per severity
/// (tensor in code spans so the names survive), and the fixes.
pub fn to_markdown(r: &Report) -> String {
    let (e, w, i) = (
        r.count(Severity::Error),
        r.count(Severity::Warning),
        r.count(Severity::Info),
    );
    let mut s = String::new();
    s.push_str("### nvfp4-probe lint\n\n");
    s.push_str(&format!("**Model:** `{}`", r.model.display()));
    if let Some(rf) = &r.reference {
        s.push_str(&format!("  \n**Reference:** `{}`", rf.display()));
    }
    s.push_str(&format!(
        "  \n**Result:** {} — {e} error(s), {w} warning(s), {i} note(s) over {} weights ({:.2} s, {:.1} MB read)\n\n",
        if e > 0 { "❌ fails" } else { "✅ passes" },
        r.weights,
        r.seconds,
        r.bytes_read as f64 / 1e6
    ));
    if r.findings.is_empty() {
        s.push_str("No findings.\n");
        return s;
    }
    let groups = group(&r.findings);
    for sev in [Severity::Error, Severity::Warning, Severity::Info] {
        let gs: Vec<&Group> = groups.iter().filter(|g| g.severity == sev).collect();
        if gs.is_empty() {
            continue;
        }
        let n: usize = gs.iter().map(|g| g.count).sum();
        s.push_str(&format!("#### {} ({n})\n\n", icon(sev)));
        s.push_str("| rule | tensor | op | evidence | fix |\n|---|---|---|---|---|\n");
        for g in &gs {
            s.push_str(&format!(
                "| `{}` | {}`{}` | {} | {}{} | {} |\n",
                g.rule,
                group_count(g).map(|c| format!("{c}: ")).unwrap_or_default(),
                cell(&g.tensors),
                g.op.map(|o| format!("`{o}`")).unwrap_or_default(),
                cell(g.evidence),
                if g.count > 1 {
                    " (first of the group)"
                } else {
                    ""
                },
                cell(g.fix)
            ));
        }
        s.push('\n');
        for g in gs.iter().filter(|g| g.count > 1) {
            s.push_str(&format!(
                "<details><summary>{} weights of <code>{}</code></summary>\n\n",
                g.count, g.rule
            ));
            for f in &g.members {
                s.push_str(&format!("- `{}`: {}\n", f.tensor, cell(&f.evidence)));
            }
            s.push_str("\n</details>\n\n");
        }
    }
    let mut files: Vec<&str> = r.findings.iter().map(|f| f.file.as_str()).collect();
    files.sort();
    files.dedup();
    s.push_str("<details><summary>files</summary>\n\n");
    for f in files {
        s.push_str(&format!("- `{f}`\n"));
    }
    s.push_str("\n</details>\n");
    s
}

/// How many a group covers: `24 weights`; the same tensor found more than once is counted once
/// (`2 weights` always names two), `2 findings` on one tensor. None for a single finding.
fn group_count(g: &Group) -> Option<String> {
    let mut names: Vec<&str> = g.members.iter().map(|f| f.tensor.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    match (names.len(), g.count) {
        (_, 1) => None,
        (1, n) => Some(format!("{n} findings")),
        (d, n) if d < n => Some(format!("{d} weights ({n} findings)")),
        (d, _) => Some(format!("{d} weights")),
    }
}

/// The head of a group: its count ([`group_count`]) and its tensors as one pattern.
fn group_head(g: &Group) -> String {
    match group_count(g) {
        Some(c) => format!("{c}: {}", g.tensors),
        None => g.tensors.clone(),
    }
}

/// Terminal output: one block per root cause (findings of the same rule, op and fix over several
/// tensors are one block, `verbose` lists each tensor with its own evidence), then the verdict.
/// Lines longer than `width` are wrapped, their continuations indented under the evidence.
pub fn to_text(r: &Report, verbose: bool, width: usize) -> String {
    use crate::output::term::wrap_with;
    let mut s = String::new();
    let put = |s: &mut String, line: String| {
        for l in wrap_with(&line, width, 8) {
            s.push_str(&l);
            s.push('\n');
        }
    };
    for g in group(&r.findings) {
        let head = group_head(&g);
        put(
            &mut s,
            format!(
                "{:<7} {:<24} {}{}",
                g.severity.as_str(),
                g.rule,
                head,
                g.op.map(|o| format!("  [{o}]")).unwrap_or_default(),
            ),
        );
        if verbose && g.count > 1 {
            for f in &g.members {
                put(&mut s, format!("        {}: {}", f.tensor, f.evidence));
            }
        } else if g.count > 1 {
            put(
                &mut s,
                format!(
                    "        {} (first of {}; --verbose lists each)",
                    g.evidence, g.count
                ),
            );
        } else {
            put(&mut s, format!("        {}", g.evidence));
        }
        put(&mut s, format!("        fix: {}", g.fix));
    }
    let groups = group(&r.findings).len();
    let verdict = format!(
        "lint: {} error(s), {} warning(s), {} note(s){} over {} weights of {} ({:.2} s, {:.1} MB read)",
        r.count(Severity::Error),
        r.count(Severity::Warning),
        r.count(Severity::Info),
        if groups < r.findings.len() {
            format!(" in {groups} root cause(s)")
        } else {
            String::new()
        },
        r.weights,
        r.model.display(),
        r.seconds,
        r.bytes_read as f64 / 1e6
    );
    for l in crate::output::term::wrap_with(&verdict, width, 6) {
        s.push_str(&l);
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(tensor: &str) -> Finding {
        Finding {
            rule: "config.ignore".into(),
            severity: Severity::Warning,
            tensor: tensor.into(),
            file: "config.json".into(),
            op: None,
            evidence: format!("evidence of {tensor}"),
            fix: "fix".into(),
            absorbed_by: None,
        }
    }

    /// `N weights:` counts the names it shows: one tensor found twice is named once, as two
    /// findings, not as "2 weights".
    #[test]
    fn a_group_counts_distinct_weights() {
        let twice = [f("model.norm"), f("model.norm")];
        let g = &group(&twice)[0];
        assert_eq!(group_head(g), "2 findings: model.norm");
        let two = [f("model.norm"), f("lm_head"), f("lm_head")];
        let g = &group(&two)[0];
        assert!(
            group_head(g).starts_with("2 weights (3 findings): "),
            "{}",
            group_head(g)
        );
        let one = [f("lm_head")];
        assert_eq!(group_head(&group(&one)[0]), "lm_head");
    }
}
