//! Findings of one root cause, shown as one: the same rule, severity, op and fix over several
//! tensors (an inverted global scale on every expert of a layer gives one finding per expert and
//! projection, all with the same fix). The report keeps every finding; the renderings show a
//! group as one line with a compact name pattern (`layers.3.ffn.experts.{0–7}.{w1,w2,w3}.weight_scale_2`)
//! unless asked for each.

use serde::Serialize;

use super::{Finding, Severity};

/// One root cause: the findings that share rule, severity, op and fix, in report order.
#[derive(Clone, Debug, Serialize)]
pub struct Group<'a> {
    pub rule: &'a str,
    pub severity: Severity,
    pub op: Option<&'a str>,
    pub fix: &'a str,
    /// The tensors as one pattern.
    pub tensors: String,
    pub count: usize,
    /// The first finding's evidence (the others differ in their numbers only).
    pub evidence: &'a str,
    #[serde(skip)]
    pub members: Vec<&'a Finding>,
}

/// Group findings by (severity, rule, op, fix), keeping the order of first appearance.
pub fn group(findings: &[Finding]) -> Vec<Group<'_>> {
    let mut out: Vec<Group> = Vec::new();
    for f in findings {
        match out.iter_mut().find(|g| {
            g.severity == f.severity
                && g.rule == f.rule
                && g.op == f.op.as_deref()
                && g.fix == f.fix
        }) {
            Some(g) => g.members.push(f),
            None => out.push(Group {
                rule: &f.rule,
                severity: f.severity,
                op: f.op.as_deref(),
                fix: &f.fix,
                tensors: String::new(),
                count: 0,
                evidence: &f.evidence,
                members: vec![f],
            }),
        }
    }
    for g in &mut out {
        g.count = g.members.len();
        // each tensor once (two findings on one tensor name it once)
        let mut seen = std::collections::HashSet::new();
        let names: Vec<&str> = g
            .members
            .iter()
            .map(|f| f.tensor.as_str())
            .filter(|t| seen.insert(*t))
            .collect();
        g.tensors = pattern(&names);
    }
    out
}

/// A compact pattern of dotted names: components equal in all names stay as they are, numeric
/// ones that vary become ranges (`{0–7}`, `{0–3,5}`), others a set (`{w1,w2,w3}`). Names of
/// different depths are listed (the first few, then a count).
pub fn pattern(names: &[&str]) -> String {
    let Some(first) = names.first() else {
        return String::new();
    };
    if names.len() == 1 {
        return first.to_string();
    }
    let split: Vec<Vec<&str>> = names.iter().map(|n| n.split('.').collect()).collect();
    let depth = split[0].len();
    if split.iter().any(|s| s.len() != depth) {
        let shown: Vec<&str> = names.iter().take(3).copied().collect();
        return format!("{}, … ({} tensors)", shown.join(", "), names.len());
    }
    (0..depth)
        .map(|i| {
            let mut vals: Vec<&str> = split.iter().map(|s| s[i]).collect();
            vals.dedup();
            let mut uniq: Vec<&str> = Vec::new();
            for v in vals {
                if !uniq.contains(&v) {
                    uniq.push(v);
                }
            }
            if uniq.len() == 1 {
                return uniq[0].to_string();
            }
            let nums: Option<Vec<u64>> = uniq.iter().map(|v| v.parse().ok()).collect();
            match nums {
                Some(mut n) => {
                    n.sort_unstable();
                    format!("{{{}}}", ranges(&n))
                }
                None => format!("{{{}}}", uniq.join(",")),
            }
        })
        .collect::<Vec<_>>()
        .join(".")
}

/// `0–7`, `0–3,5,9–10` for sorted distinct numbers.
fn ranges(n: &[u64]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < n.len() {
        let mut j = i;
        while j + 1 < n.len() && n[j + 1] == n[j] + 1 {
            j += 1;
        }
        parts.push(if j > i + 1 {
            format!("{}–{}", n[i], n[j])
        } else if j == i + 1 {
            format!("{},{}", n[i], n[j])
        } else {
            n[i].to_string()
        });
        i = j + 1;
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(rule: &str, tensor: &str, fix: &str) -> Finding {
        Finding {
            rule: rule.into(),
            severity: Severity::Error,
            tensor: tensor.into(),
            file: "m.safetensors".into(),
            op: Some("L3.ffn.experts".into()),
            evidence: format!("evidence of {tensor}"),
            fix: fix.into(),
            absorbed_by: None,
        }
    }

    #[test]
    fn experts_of_one_layer_with_one_fix_are_one_group() {
        let mut fs = Vec::new();
        for e in 0..8 {
            for p in ["w1", "w2", "w3"] {
                fs.push(f(
                    "scale.convention",
                    &format!("layers.3.ffn.experts.{e}.{p}.weight_scale_2"),
                    "store the reciprocal",
                ));
            }
        }
        fs.push(f(
            "scale.nan",
            "layers.3.ffn.experts.2.w1.weight_scale",
            "other fix",
        ));
        let g = group(&fs);
        assert_eq!(g.len(), 2);
        assert_eq!(g[0].count, 24);
        assert_eq!(
            g[0].tensors,
            "layers.3.ffn.experts.{0–7}.{w1,w2,w3}.weight_scale_2"
        );
        assert_eq!(
            g[0].evidence,
            "evidence of layers.3.ffn.experts.0.w1.weight_scale_2"
        );
        assert_eq!(g[1].count, 1);
        assert_eq!(g[1].tensors, "layers.3.ffn.experts.2.w1.weight_scale");
    }

    #[test]
    fn different_fixes_or_ops_stay_apart_and_ranges_compress() {
        let fs = vec![
            f("r", "layers.1.attn.wq_a.weight_scale_2", "fix a"),
            f("r", "layers.2.attn.wq_a.weight_scale_2", "fix b"),
        ];
        assert_eq!(group(&fs).len(), 2);
        assert_eq!(ranges(&[0, 1, 2, 3, 5, 9, 10]), "0–3,5,9,10");
        assert_eq!(pattern(&["a.1.x", "a.3.x", "a.2.x"]), "a.{1–3}.x");
        assert_eq!(pattern(&["a.b", "a.b.c"]), "a.b, a.b.c, … (2 tensors)");
    }
}
