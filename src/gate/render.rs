//! The three faces of a gate result: the CI log (terminal), the PR comment / step summary
//! (markdown) and the test-report panel (JUnit XML).

use super::{fmt_num, fmt_val, Bound, Check, GateReport, Val};
use std::fmt::Write;

/// Rows beyond this go to the log only: a PR comment with thousands of rows helps nobody.
const MARKDOWN_ROWS: usize = 50;

impl Check {
    /// `cos [served_propagated_vs_bf16]`, or `op` for presence checks.
    pub fn metric_label(&self) -> String {
        if self.source.is_empty() || self.source == "*" {
            self.metric.clone()
        } else {
            format!("{} [{}]", self.metric, self.source)
        }
    }

    fn passing_text(&self) -> String {
        match (&self.min_passing, &self.bound, self.current) {
            (Some(s), _, _) => s.clone(),
            (None, Bound::Present, _) => "none (op missing from the current run)".into(),
            (None, _, Val::Null) => "none (current value undefined: non-finite values)".into(),
            (None, _, Val::Absent) => "none (value missing from the current run)".into(),
            (None, _, _) => "none (baseline is 0)".into(),
        }
    }

    /// One line for logs and JUnit messages.
    pub fn one_line(&self) -> String {
        if matches!(self.bound, Bound::Present) {
            return format!(
                "{}: op is in the baseline but missing from the current run",
                self.op
            );
        }
        let delta = self
            .delta()
            .map(|d| format!(" (Δ {})", signed(d)))
            .unwrap_or_default();
        format!(
            "{} {}: current {} vs baseline {}{delta}; rule {}; would pass with {}",
            self.op,
            self.metric_label(),
            fmt_val(self.current),
            fmt_val(self.baseline),
            self.rule,
            self.passing_text()
        )
    }
}

fn signed(d: f64) -> String {
    if d > 0.0 {
        format!("+{}", fmt_num(d))
    } else {
        fmt_num(d)
    }
}

impl GateReport {
    /// The earliest failing op in baseline execution order: where a reviewer starts reading.
    pub fn first_failing_op(&self) -> Option<&str> {
        let failing = self.failing_ops();
        self.ops
            .iter()
            .map(|(id, _)| id.as_str())
            .find(|id| failing.contains(id))
    }

    fn counts_line(&self) -> String {
        let failing_ops = self.failing_ops().len();
        format!(
            "{} ops compared, {} checks, {} failing in {} ops, {} moved, {} missing, {} new",
            self.ops.len() - self.new_ops.len(),
            self.checks.len(),
            self.failures().count(),
            failing_ops,
            self.checks.iter().filter(|c| c.moved()).count(),
            self.missing_ops.len(),
            self.new_ops.len()
        )
    }

    /// The CI log: verdict, every failing row in full (Polygraphy style), new ops, counts.
    pub fn terminal(&self) -> String {
        let mut s = String::new();
        let verdict = if self.passed() { "PASS" } else { "FAIL" };
        let _ = writeln!(
            s,
            "gate: {verdict}: current {} against baseline {}",
            self.current_name, self.baseline_name
        );
        for n in &self.notes {
            let _ = writeln!(s, "note: {n}");
        }
        for c in self.moved_worst_first().into_iter().filter(|c| !c.passed) {
            if matches!(c.bound, Bound::Present) {
                let _ = writeln!(
                    s,
                    "FAIL {}: in the baseline, missing from the current run",
                    c.op
                );
                continue;
            }
            let _ = writeln!(s, "FAIL {}  {}", c.op, c.metric_label());
            let delta = c
                .delta()
                .map(|d| format!("  Δ {}", signed(d)))
                .unwrap_or_default();
            let _ = writeln!(
                s,
                "     current {}  baseline {}{delta}",
                fmt_val(c.current),
                fmt_val(c.baseline)
            );
            let _ = writeln!(s, "     rule: {}", c.rule);
            let _ = writeln!(s, "     smallest passing tolerance: {}", c.passing_text());
        }
        for n in &self.new_ops {
            let _ = writeln!(s, "new op (not in the baseline): {n}");
        }
        let _ = writeln!(s, "{}", self.counts_line());
        s
    }

    /// Markdown for `$GITHUB_STEP_SUMMARY` or a PR comment.
    pub fn summary_markdown(&self) -> String {
        let mut s = String::new();
        let failing = self.failures().count();
        if self.passed() {
            let _ = writeln!(s, "### nvfp4-probe gate: ✅ PASS\n");
            let _ = writeln!(s, "No numerical regression against the baseline.\n");
        } else {
            let _ = writeln!(s, "### nvfp4-probe gate: ❌ FAIL\n");
            let _ = writeln!(
                s,
                "**{failing} failing check{} in {} op{}** ; first in execution order: `{}`.\n",
                if failing == 1 { "" } else { "s" },
                self.failing_ops().len(),
                if self.failing_ops().len() == 1 {
                    ""
                } else {
                    "s"
                },
                md_code(self.first_failing_op().unwrap_or(""))
            );
        }
        let _ = writeln!(
            s,
            "Baseline `{}`, current `{}`.\n",
            md_code(&self.baseline_name),
            md_code(&self.current_name)
        );
        for n in &self.notes {
            let _ = writeln!(s, "> **Note:** {}\n", md_cell(n));
        }
        let moved = self.moved_worst_first();
        if moved.is_empty() {
            let _ = writeln!(s, "No op moved.\n");
        } else {
            let _ = writeln!(
                s,
                "| | op | metric | baseline | current | Δ | rule | min passing tol |"
            );
            let _ = writeln!(s, "|---|---|---|---|---|---:|---|---|");
            for c in moved.iter().take(MARKDOWN_ROWS) {
                let mark = if c.passed { "" } else { "❌" };
                let delta = c.delta().map(signed).unwrap_or_else(|| "—".into());
                let (base, cur) = if matches!(c.bound, Bound::Present) {
                    ("present".to_string(), "missing".to_string())
                } else {
                    (fmt_val(c.baseline), fmt_val(c.current))
                };
                let _ = writeln!(
                    s,
                    "| {mark} | `{}` | {} | {} | {} | {} | {} | {} |",
                    md_code(&c.op),
                    md_cell(&c.metric_label()),
                    md_cell(&base),
                    md_cell(&cur),
                    delta,
                    md_cell(&c.rule),
                    md_cell(&c.passing_text())
                );
            }
            if moved.len() > MARKDOWN_ROWS {
                let _ = writeln!(
                    s,
                    "\n…and {} more moved rows (all failing rows are in the job log).",
                    moved.len() - MARKDOWN_ROWS
                );
            }
            s.push('\n');
        }
        if !self.missing_ops.is_empty() {
            let _ = writeln!(s, "**Missing ops:** {}\n", code_list(&self.missing_ops));
        }
        if !self.new_ops.is_empty() {
            let _ = writeln!(
                s,
                "**New ops (not gated against a baseline):** {}\n",
                code_list(&self.new_ops)
            );
        }
        let _ = writeln!(s, "**Counts:** {}.", self.counts_line());
        s
    }

    /// JUnit XML: one `<testcase>` per op (classname = `L{n}` or `model`), a `<failure>` for each
    /// op with a failing check.
    pub fn junit_xml(&self) -> String {
        let mut by_op: std::collections::HashMap<&str, Vec<&Check>> = Default::default();
        for c in self.moved_worst_first().into_iter().filter(|c| !c.passed) {
            by_op.entry(c.op.as_str()).or_default().push(c);
        }
        let tests = self.ops.len();
        let failures = by_op.len();
        let mut s = String::new();
        s.push_str("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
        let _ = writeln!(
            s,
            "<testsuites name=\"nvfp4-probe gate\" tests=\"{tests}\" failures=\"{failures}\" errors=\"0\">"
        );
        let _ = writeln!(
            s,
            "  <testsuite name=\"nvfp4-probe gate\" tests=\"{tests}\" failures=\"{failures}\" errors=\"0\" skipped=\"0\">"
        );
        let _ = writeln!(s, "    <properties>");
        for (k, v) in [
            ("baseline", &self.baseline_name),
            ("current", &self.current_name),
        ] {
            let _ = writeln!(
                s,
                "      <property name=\"{k}\" value=\"{}\"/>",
                xml_escape(v)
            );
        }
        for n in &self.notes {
            let _ = writeln!(
                s,
                "      <property name=\"note\" value=\"{}\"/>",
                xml_escape(n)
            );
        }
        let _ = writeln!(s, "    </properties>");
        for (op, layer) in &self.ops {
            let classname = layer
                .map(|l| format!("L{l}"))
                .unwrap_or_else(|| "model".into());
            let open = format!(
                "    <testcase name=\"{}\" classname=\"{}\" time=\"0\"",
                xml_escape(op),
                xml_escape(&classname)
            );
            match by_op.get(op.as_str()) {
                None if self.new_ops.contains(op) => {
                    let _ = writeln!(s, "{open}>");
                    let _ = writeln!(
                        s,
                        "      <system-out>new op: not in the baseline</system-out>"
                    );
                    let _ = writeln!(s, "    </testcase>");
                }
                None => {
                    let _ = writeln!(s, "{open}/>");
                }
                Some(fails) => {
                    let _ = writeln!(s, "{open}>");
                    let body: Vec<String> = fails.iter().map(|c| c.one_line()).collect();
                    let _ = writeln!(
                        s,
                        "      <failure message=\"{}\" type=\"numerical-regression\">{}</failure>",
                        xml_escape(&body[0]),
                        xml_escape(&body.join("\n"))
                    );
                    let _ = writeln!(s, "    </testcase>");
                }
            }
        }
        let _ = writeln!(s, "  </testsuite>");
        let _ = writeln!(s, "</testsuites>");
        s
    }
}

/// Escapes for both text and attribute values; drops the control characters XML 1.0 forbids.
pub fn xml_escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&apos;"),
            '\n' => o.push_str("&#10;"),
            '\t' | '\r' => o.push(' '),
            c if (c as u32) < 0x20 || c == '\u{FFFE}' || c == '\u{FFFF}' => o.push('\u{FFFD}'),
            c => o.push(c),
        }
    }
    o
}

/// A table cell: pipes would split the cell, newlines the row, `<` could open HTML.
fn md_cell(s: &str) -> String {
    s.replace('|', "\\|")
        .replace('\n', " ")
        .replace('<', "&lt;")
}

/// Content of an inline code span: backticks cannot be escaped inside one, so they are replaced.
fn md_code(s: &str) -> String {
    s.replace('`', "'").replace('|', "\\|").replace('\n', " ")
}

fn code_list(v: &[String]) -> String {
    v.iter()
        .map(|s| format!("`{}`", md_code(s)))
        .collect::<Vec<_>>()
        .join(", ")
}
