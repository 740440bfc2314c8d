//! The three renderings of a report: JSON (`nvfp4-probe.lint/1`), markdown for a GitHub issue,
//! and the terminal summary.

use serde::Serialize;

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
    for sev in [Severity::Error, Severity::Warning, Severity::Info] {
        let fs: Vec<&Finding> = r.findings.iter().filter(|f| f.severity == sev).collect();
        if fs.is_empty() {
            continue;
        }
        s.push_str(&format!("#### {} ({})\n\n", icon(sev), fs.len()));
        s.push_str("| rule | tensor | op | evidence | fix |\n|---|---|---|---|---|\n");
        for f in fs {
            s.push_str(&format!(
                "| `{}` | `{}` | {} | {} | {} |\n",
                f.rule,
                cell(&f.tensor),
                f.op.as_deref()
                    .map(|o| format!("`{o}`"))
                    .unwrap_or_default(),
                cell(&f.evidence),
                cell(&f.fix)
            ));
        }
        s.push('\n');
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

/// Terminal output: one block per finding, then the verdict.
pub fn to_text(r: &Report) -> String {
    let mut s = String::new();
    for f in &r.findings {
        s.push_str(&format!(
            "{:<7} {:<24} {}{}\n        {}\n        fix: {}\n",
            f.severity.as_str(),
            f.rule,
            f.tensor,
            f.op.as_deref()
                .map(|o| format!("  [{o}]"))
                .unwrap_or_default(),
            f.evidence,
            f.fix
        ));
    }
    s.push_str(&format!(
        "lint: {} error(s), {} warning(s), {} note(s) over {} weights of {} ({:.2} s, {:.1} MB read)\n",
        r.count(Severity::Error),
        r.count(Severity::Warning),
        r.count(Severity::Info),
        r.weights,
        r.model.display(),
        r.seconds,
        r.bytes_read as f64 / 1e6
    ));
    s
}
