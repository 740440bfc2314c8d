//! Bisect's outputs: terminal lines, JSON (`nvfp4-probe.bisect/2`) and markdown.

use serde_json::json;

use super::{BisectResult, Ranked, Search, SearchReport, Step};
use crate::probe::findings;
use crate::report::RunMeta;

/// The JSON schema tag.
pub const SCHEMA: &str = "nvfp4-probe.bisect/2";

fn cos(c: &crate::metrics::Compare) -> String {
    c.cos.map_or("—".into(), |v| format!("{v:.4}"))
}
fn rel(c: &crate::metrics::Compare) -> String {
    c.rel_l2.map_or("—".into(), |v| format!("{v:.3e}"))
}
fn val(v: Option<f32>) -> String {
    v.map_or("—".into(), |x| format!("{x:.4e}"))
}

fn ranked_rows(r: &[Ranked]) -> Vec<[String; 7]> {
    r.iter()
        .map(|x| {
            let h = &x.hypothesis;
            [
                h.kind.clone(),
                h.unit.clone(),
                h.param.engine.clone(),
                format!("{} → {}", val(h.param.current), val(h.param.corrected)),
                cos(&x.after),
                rel(&x.after),
                if x.restores {
                    "yes".into()
                } else {
                    "no".into()
                },
            ]
        })
        .collect()
}

const HEAD: [&str; 7] = [
    "hypothesis",
    "weights",
    "engine parameter",
    "value",
    "cos after",
    "rel-L2 after",
    "restores",
];

/// The terminal table's header: [`HEAD`] in two lines where that makes a column narrower.
const HEAD_TERM: [&str; 7] = [
    "hypothesis",
    "weights",
    "engine\nparameter",
    "value",
    "cos\nafter",
    "rel-L2\nafter",
    "restores",
];

/// Human-readable lines for the terminal: the findings ordered by consequence, then the first
/// divergent op's detail (its hypotheses), the search and the cost; the table is laid out within
/// `width` columns (the command wraps the prose at the same width).
pub fn terminal(r: &BisectResult, width: usize) -> String {
    let mut out = findings::terminal(&r.findings);
    match &r.divergence {
        Some(d) => {
            out.push_str(&format!(
                "first divergent op (isolated): {} — {}\n",
                d.op,
                d.reason.as_deref().unwrap_or("")
            ));
            match &d.verdict {
                // its sentence leads the op's finding above
                Some(_) => {}
                None => {
                    out.push_str(&format!(
                        "no hypothesis explains it ({} tried; best rel-L2 {}, tolerance {:.3e})\n",
                        d.hypotheses_tried,
                        d.ranked.first().map_or("—".into(), |x| rel(&x.after)),
                        d.tolerance
                    ));
                    if let Some(h) = &d.health {
                        out.push_str(&format!(
                            "health of the op: {}\n",
                            serde_json::to_string(h).unwrap_or_default()
                        ));
                    }
                    for (sub, h) in &d.health_per_linear {
                        out.push_str(&format!(
                            "  {sub}: {}\n",
                            serde_json::to_string(h).unwrap_or_default()
                        ));
                    }
                    if let Some(a) = d.act_amax_over_calib {
                        out.push_str(&format!(
                            "  worst activation amax / calibrated amax: {a:.3e}\n"
                        ));
                    }
                }
            }
            out.push_str(&format!(
                "propagated: shows at {}{}\n",
                d.shows_at
                    .as_deref()
                    .unwrap_or("(nowhere in the reported layers)"),
                d.shows_at_layer_out
                    .as_ref()
                    .map(|o| format!(" (first layer output: {o})"))
                    .unwrap_or_default()
            ));
            if !d.ranked.is_empty() {
                let mut t = crate::output::term::table(width);
                t.set_header(HEAD_TERM.to_vec());
                for row in ranked_rows(&d.ranked) {
                    t.add_row(row.to_vec());
                }
                out.push_str(&format!("hypotheses at {} (best first):\n{t}\n", d.op));
            }
        }
        None => {
            out.push_str("no op diverges (isolated)\n");
            for a in &r.anomalies {
                out.push_str(&format!("anomaly: {}\n", a.sentence));
            }
        }
    }
    out.push_str(&search_lines(&r.search));
    out.push_str(&format!(
        "{} ops; run {:.2} s, bisect {:.2} s\n",
        r.ops, r.seconds_run, r.seconds_bisect
    ));
    out
}

fn mode(s: Search) -> &'static str {
    match s {
        Search::Auto => "auto",
        Search::Linear => "linear",
        Search::Layers => "layers",
    }
}

fn step_line(st: &Step) -> String {
    format!(
        "{} L{}..L{} → {}: {}{} ({} execs, {:.2} s)",
        st.kind,
        st.layers.0,
        st.layers.1,
        st.at.as_deref().unwrap_or("—"),
        st.broken.as_deref().unwrap_or("not broken"),
        st.rel_l2
            .filter(|_| st.broken.is_none())
            .map(|v| format!(", rel-L2 {v:.3e}"))
            .unwrap_or_default(),
        st.execs,
        st.seconds
    )
}

/// Which search ran, its steps and the cost per phase.
fn search_lines(s: &SearchReport) -> String {
    let mut out = format!(
        "search: {} (requested {}; {})\n",
        mode(s.ran),
        mode(s.requested),
        s.why
    );
    for st in &s.steps {
        out.push_str(&format!("  {}\n", step_line(st)));
    }
    if let Some(f) = &s.fell_back {
        out.push_str(&format!("  fell back to the linear search: {f}\n"));
    }
    let phases: Vec<String> = s
        .phases
        .iter()
        .map(|p| format!("{} {:.2} s / {} execs", p.name, p.seconds, p.execs))
        .collect();
    out.push_str(&format!(
        "  phases: {} (total {} op executions)\n",
        phases.join(", "),
        s.total_execs()
    ));
    out
}

/// `{"schema": "nvfp4-probe.bisect/2", ...}`.
pub fn json(meta: &RunMeta, r: &BisectResult) -> String {
    let v = json!({
        "schema": SCHEMA,
        "meta": meta,
        "summary": r.summary,
        "findings": r.findings,
        "exit": findings::exit_code(&r.findings),
        "divergences": r.divergences,
        "divergence": r.divergence,
        "verdict": r.divergence.as_ref().and_then(|d| d.verdict.as_ref()),
        "anomalies": r.anomalies,
        "ops": r.ops,
        "seconds_run": r.seconds_run,
        "seconds_bisect": r.seconds_bisect,
        "search": r.search,
        "op_executions": r.search.total_execs(),
    });
    serde_json::to_string_pretty(&v).unwrap_or_else(|_| "{}".into())
}

/// A markdown report.
pub fn markdown(meta: &RunMeta, r: &BisectResult) -> String {
    let mut s = format!(
        "# nvfp4-probe bisect\n\nLayers {}..{}, served profile `{}`, {} ops.\n\n",
        meta.layers[0], meta.layers[1], meta.served_profile, r.ops
    );
    s.push_str(&findings::markdown(&r.findings));
    s.push_str("\n## First divergent op\n\n");
    match &r.divergence {
        Some(d) => {
            s.push_str(&format!(
                "**First divergent op:** `{}` — {}\n\n",
                d.op,
                d.reason.as_deref().unwrap_or("")
            ));
            match &d.verdict {
                Some(v) => s.push_str(&format!("**Verdict:** {}\n\n", v.sentence)),
                None => s.push_str(&format!(
                    "**No hypothesis explains it** ({} tried). Health counters: `{}`\n\n",
                    d.hypotheses_tried,
                    d.health
                        .as_ref()
                        .map(|h| serde_json::to_string(h).unwrap_or_default())
                        .unwrap_or_default()
                )),
            }
            s.push_str(&format!(
                "**Propagated:** shows at `{}`{}\n\n",
                d.shows_at.as_deref().unwrap_or("—"),
                d.shows_at_layer_out
                    .as_ref()
                    .map(|o| format!(" (layer output `{o}`)"))
                    .unwrap_or_default()
            ));
            if !d.ranked.is_empty() {
                s.push_str(&format!(
                    "| {} |\n|{}\n",
                    HEAD.join(" | "),
                    "---|".repeat(HEAD.len())
                ));
                for row in ranked_rows(&d.ranked) {
                    s.push_str(&format!("| {} |\n", row.join(" | ")));
                }
                s.push('\n');
            }
        }
        None => {
            s.push_str("No op diverges (isolated).\n\n");
            for a in &r.anomalies {
                s.push_str(&format!("**Anomaly:** {}\n\n", a.sentence));
            }
        }
    }
    let se = &r.search;
    s.push_str(&format!(
        "## Search\n\n`{}` (requested `{}`; {}).\n\n",
        mode(se.ran),
        mode(se.requested),
        se.why
    ));
    for st in &se.steps {
        s.push_str(&format!("- {}\n", step_line(st)));
    }
    if let Some(f) = &se.fell_back {
        s.push_str(&format!("- fell back to the linear search: {f}\n"));
    }
    s.push_str("\n| phase | seconds | op executions |\n|---|---|---|\n");
    for p in &se.phases {
        s.push_str(&format!(
            "| {} | {:.2} | {} |\n",
            p.name, p.seconds, p.execs
        ));
    }
    s.push_str(&format!("| **total** | | {} |\n", se.total_execs()));
    s
}
