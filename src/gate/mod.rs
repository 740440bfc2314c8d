//! The CI gate: compare a run JSON against a committed baseline run JSON, per op and per metric,
//! with tolerances that are data (see [`Tolerances`]). Works on `serde_json::Value` so fields
//! added later within `nvfp4-probe.run/1` are ignored.
//!
//! Like Polygraphy, every check remembers the smallest tolerance that would have passed, so a
//! failing CI log says how far off the change is, not only that it is off.

mod render;
pub mod tolerances;

pub use tolerances::{glob_match, Direction, Metric, Relative, Rule, SourceKind, Tolerances};

use crate::{Error, Result};
use serde_json::Value;
use std::collections::{BTreeSet, HashMap};
use std::path::Path;

pub use crate::run_json::RUN_SCHEMA;
use crate::run_json::{check_run, layer_of};

/// A value read from an op record. `Null` is what the runner writes for an undefined number (a
/// cosine over NaN); `Absent` means the field is not there at all.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Val {
    Num(f64),
    Null,
    Absent,
}

impl Val {
    pub fn num(self) -> Option<f64> {
        match self {
            Val::Num(x) => Some(x),
            _ => None,
        }
    }
}

/// Which bound of a rule a check evaluated.
#[derive(Clone, Debug, PartialEq)]
pub enum Bound {
    Min(f64),
    Max(f64),
    Relative(Relative),
    /// The op is in the baseline but not in the current run.
    Present,
}

/// One evaluated (op, metric, source, bound).
#[derive(Clone, Debug)]
pub struct Check {
    pub op: String,
    /// `Some(n)` for ops of layer n; `None` for model-level ops (embed, head, …).
    pub layer: Option<i64>,
    /// `cos`, `rel_l2`, …, or `op` for a missing op.
    pub metric: String,
    /// The comparison (`served_propagated_vs_bf16`) or path (`served`) the value comes from.
    pub source: String,
    pub baseline: Val,
    pub current: Val,
    pub bound: Bound,
    /// Human-readable rule, e.g. `cos ≥ baseline − max(0.002, 3×noise 1.2e-5) = 2.0e-3 (built-in)`.
    pub rule: String,
    pub passed: bool,
    /// The smallest setting of the rule's parameter that would have passed, e.g. `max_drop ≥ 4.8e-2`;
    /// `None` when no setting passes (the current value is undefined or the op is missing).
    pub min_passing: Option<String>,
    /// How much of the allowance is used: ≤ 1 passes, > 1 fails; for ordering rows worst first.
    pub severity: f64,
}

impl Check {
    pub fn delta(&self) -> Option<f64> {
        Some(self.current.num()? - self.baseline.num()?)
    }
    /// The value changed, appeared, disappeared or the check failed: worth a table row.
    pub fn moved(&self) -> bool {
        !self.passed
            || match (self.baseline, self.current) {
                (Val::Num(a), Val::Num(b)) => a != b,
                (a, b) => a != b,
            }
    }
}

#[derive(Clone, Debug, Default)]
pub struct GateReport {
    pub baseline_name: String,
    pub current_name: String,
    /// Every check evaluated, in op order.
    pub checks: Vec<Check>,
    /// Ops of both runs: baseline order first, then ops only in the current run; with their layer.
    pub ops: Vec<(String, Option<i64>)>,
    pub missing_ops: Vec<String>,
    pub new_ops: Vec<String>,
    /// Things a reviewer should know that are not failures (forced fingerprint mismatch, …).
    pub notes: Vec<String>,
}

impl GateReport {
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.passed)
    }
    pub fn failures(&self) -> impl Iterator<Item = &Check> {
        self.checks.iter().filter(|c| !c.passed)
    }
    /// Ops with at least one failing check.
    pub fn failing_ops(&self) -> BTreeSet<&str> {
        self.failures().map(|c| c.op.as_str()).collect()
    }
    /// Failing checks, then moved passing ones; worst first within each group.
    pub fn moved_worst_first(&self) -> Vec<&Check> {
        let mut v: Vec<&Check> = self.checks.iter().filter(|c| c.moved()).collect();
        v.sort_by(|a, b| {
            a.passed
                .cmp(&b.passed)
                .then(b.severity.total_cmp(&a.severity))
                .then(a.op.cmp(&b.op))
        });
        v
    }
    pub fn exit_code(&self) -> i32 {
        if self.passed() {
            crate::error::EXIT_OK
        } else {
            crate::error::EXIT_FINDINGS
        }
    }
}

/// Compares two parsed run JSONs, naming them `baseline` and `current` in errors.
pub fn compare(base: &Value, cur: &Value, tol: &Tolerances, force: bool) -> Result<GateReport> {
    compare_named(
        base,
        Path::new("baseline"),
        cur,
        Path::new("current"),
        tol,
        force,
    )
}

const FINGERPRINTS: [(&str, &str, &str); 3] = [
    ("checkpoint", "config_sha256", "checkpoint config"),
    ("checkpoint", "header_sha256", "checkpoint tensor header"),
    ("tokens", "sha256", "token ids"),
];

/// [`compare`] with the file names to put in errors and reports.
pub fn compare_named(
    base: &Value,
    base_name: &Path,
    cur: &Value,
    cur_name: &Path,
    tol: &Tolerances,
    force: bool,
) -> Result<GateReport> {
    check_run(base, base_name)?;
    check_run(cur, cur_name)?;
    let mut rep = GateReport {
        baseline_name: base_name.display().to_string(),
        current_name: cur_name.display().to_string(),
        ..Default::default()
    };
    for (obj, key, what) in FINGERPRINTS {
        let b = base
            .get(obj)
            .and_then(|o| o.get(key))
            .and_then(Value::as_str);
        let c = cur
            .get(obj)
            .and_then(|o| o.get(key))
            .and_then(Value::as_str);
        if b != c {
            let msg = format!(
                "{what} fingerprint `{obj}.{key}` differs: baseline {} vs current {}",
                b.unwrap_or("(none)"),
                c.unwrap_or("(none)")
            );
            if force {
                rep.notes.push(format!("{msg} (compared anyway: --force)"));
            } else {
                return Err(Error::bad(
                    cur_name,
                    None,
                    format!(
                        "{msg}; the runs measure different things. Pass --force to compare anyway"
                    ),
                ));
            }
        }
    }
    // how the served path ran: a difference is said, not refused (a gate may compare a change
    // of profile or of the engine's chunked prefill on purpose)
    for key in [
        "served_profile",
        "backend",
        "loader_faults",
        "served_chunk",
        "engine_faults",
    ] {
        let show = |v: Option<&Value>| match v {
            None | Some(Value::Null) => "(none)".to_string(),
            Some(Value::Array(a)) if a.is_empty() => "(none)".to_string(),
            Some(Value::String(s)) => s.clone(),
            Some(v) => v.to_string(),
        };
        let (b, c) = (show(base.get(key)), show(cur.get(key)));
        if b != c {
            rep.notes
                .push(format!("`{key}` differs: baseline {b} vs current {c}"));
        }
    }

    let base_ops = ops_by_id(base);
    let cur_ops = ops_by_id(cur);
    for (id, op) in &base_ops.order {
        rep.ops.push((id.clone(), layer_of(id, op)));
    }
    for (id, op) in &cur_ops.order {
        if !base_ops.map.contains_key(id.as_str()) {
            rep.ops.push((id.clone(), layer_of(id, op)));
            rep.new_ops.push(id.clone());
        }
    }
    let ops = rep.ops.clone();
    for (id, layer) in ops {
        let b = base_ops.map.get(id.as_str()).copied();
        let c = cur_ops.map.get(id.as_str()).copied();
        match (b, c) {
            (Some(_), None) => {
                rep.missing_ops.push(id.clone());
                rep.checks.push(Check {
                    op: id.clone(),
                    layer,
                    metric: "op".into(),
                    source: String::new(),
                    baseline: Val::Num(1.0),
                    current: Val::Absent,
                    bound: Bound::Present,
                    rule: "every baseline op must be in the current run".into(),
                    passed: false,
                    min_passing: None,
                    severity: f64::INFINITY,
                });
            }
            (b, Some(c)) => check_op(&id, layer, b, c, tol, base_name, cur_name, &mut rep.checks)?,
            (None, None) => {}
        }
    }
    Ok(rep)
}

struct OpIndex<'a> {
    order: Vec<(String, &'a Value)>,
    map: HashMap<&'a str, &'a Value>,
}

fn ops_by_id(run: &Value) -> OpIndex<'_> {
    let mut order = Vec::new();
    let mut map = HashMap::new();
    for op in run
        .get("ops")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if let Some(id) = op.get("id").and_then(Value::as_str) {
            order.push((id.to_string(), op));
            map.insert(id, op);
        }
    }
    OpIndex { order, map }
}

fn class_of(op: &Value) -> &str {
    op.get("class").and_then(Value::as_str).unwrap_or("")
}

/// The (metric, source) slots an op record offers: every comparison object and every stats path.
fn sources(op: &Value, kind: SourceKind) -> Vec<String> {
    match kind {
        SourceKind::Comparison => op
            .as_object()
            .map(|o| {
                o.iter()
                    .filter(|(k, v)| k.contains("_vs_") && v.is_object())
                    .map(|(k, _)| k.clone())
                    .collect()
            })
            .unwrap_or_default(),
        SourceKind::Path => op
            .get("stats")
            .and_then(Value::as_object)
            .map(|o| o.keys().cloned().collect())
            .unwrap_or_default(),
        SourceKind::Op => vec!["*".into()],
    }
}

fn has_wildcard(s: &str) -> bool {
    s.contains('*') || s.contains('?')
}

/// Whether a run JSON op is a divergence whose error no later op sees.
fn absorbed(op: &Value) -> bool {
    op.get("consequence")
        .and_then(|c| c.get("severity"))
        .and_then(Value::as_str)
        == Some("absorbed")
}

/// `divergent` counts an op whose error is absorbed downstream (the run's
/// `consequence.severity = "absorbed"`) only when the tolerances are strict.
fn harmful_only(v: Val, op: &Value, metric: Metric, tol: &Tolerances) -> Val {
    if metric == Metric::Divergent && absorbed(op) && !tol.strict && v == Val::Num(1.0) {
        Val::Num(0.0)
    } else {
        v
    }
}

fn read_val(op: &Value, metric: Metric, source: &str, file: &Path, id: &str) -> Result<Val> {
    let v = match metric.source_kind() {
        SourceKind::Comparison => op.get(source).and_then(|c| c.get(metric.name())),
        SourceKind::Path => op
            .get("stats")
            .and_then(|s| s.get(source))
            .and_then(|p| p.get(metric.name())),
        SourceKind::Op => op.get(metric.name()),
    };
    match v {
        None => Ok(Val::Absent),
        Some(Value::Null) => Ok(Val::Null),
        Some(Value::Bool(b)) => Ok(Val::Num(if *b { 1.0 } else { 0.0 })),
        Some(Value::Number(n)) => n.as_f64().map(Val::Num).ok_or_else(|| {
            Error::bad(
                file,
                Some(id),
                format!("`{source}.{}` is not a number", metric.name()),
            )
        }),
        Some(other) => Err(Error::bad(
            file,
            Some(id),
            format!(
                "`{source}.{}` should be a number, found {other}",
                metric.name()
            ),
        )),
    }
}

/// The op's own BF16-vs-FP32 spread for a metric, from the baseline where it has one.
fn noise_of(metric: Metric, base: Option<&Value>, cur: &Value) -> f64 {
    let read = |op: &Value| -> Option<f64> {
        let c = op.get("bf16_vs_fp32")?;
        match metric {
            Metric::Cos => Some(1.0 - c.get("cos")?.as_f64()?),
            Metric::RelL2 => c.get("rel_l2")?.as_f64(),
            _ => None,
        }
    };
    base.and_then(read)
        .or_else(|| read(cur))
        .filter(|x| x.is_finite())
        .map(|x| x.max(0.0))
        .unwrap_or(0.0)
}

#[allow(clippy::too_many_arguments)]
fn check_op(
    id: &str,
    layer: Option<i64>,
    base: Option<&Value>,
    cur: &Value,
    tol: &Tolerances,
    base_name: &Path,
    cur_name: &Path,
    out: &mut Vec<Check>,
) -> Result<()> {
    let class = class_of(cur);
    // every concrete (metric, source) some rule could apply to
    let mut slots: BTreeSet<(Metric, String)> = BTreeSet::new();
    for r in &tol.rules {
        if !glob_match(&r.ops, id) || !r.class.as_deref().is_none_or(|c| glob_match(c, class)) {
            continue;
        }
        let kind = r.metric.source_kind();
        if has_wildcard(&r.source) {
            let mut avail = sources(cur, kind);
            if let Some(b) = base {
                avail.extend(sources(b, kind));
            }
            for s in avail {
                if glob_match(&r.source, &s) {
                    slots.insert((r.metric, s));
                }
            }
        } else {
            slots.insert((r.metric, r.source.clone()));
        }
    }
    // an op whose own error no later op sees (the run's `consequence.severity = "absorbed"`) is a
    // warning of the run: its own comparisons are not held unless the tolerances are strict
    let waived = !tol.strict && absorbed(cur);
    for (metric, source) in slots {
        if waived && metric.source_kind() == SourceKind::Comparison {
            continue;
        }
        let c = harmful_only(
            read_val(cur, metric, &source, cur_name, id)?,
            cur,
            metric,
            tol,
        );
        let b = match base {
            Some(b) => harmful_only(read_val(b, metric, &source, base_name, id)?, b, metric, tol),
            None => Val::Absent,
        };
        if b == Val::Absent && c == Val::Absent {
            continue; // neither run has this value: the rule does not apply to this op
        }
        let (mut have_min, mut have_max, mut have_rel) = (false, false, false);
        for r in tol
            .rules
            .iter()
            .filter(|r| r.matches(id, class, metric, &source))
        {
            if r.skip {
                have_min = true;
                have_max = true;
                have_rel = true;
            }
            let mut bounds = Vec::new();
            if let (Some(m), false) = (r.min, have_min) {
                have_min = true;
                bounds.push(Bound::Min(m));
            }
            if let (Some(m), false) = (r.max, have_max) {
                have_max = true;
                bounds.push(Bound::Max(m));
            }
            if let (Some(rel), false) = (&r.relative, have_rel) {
                have_rel = true;
                bounds.push(Bound::Relative(rel.clone()));
            }
            for bound in bounds {
                if matches!(bound, Bound::Relative(_)) && base.is_none() {
                    continue; // a new op has no baseline to be relative to
                }
                let noise = noise_of(metric, base, cur);
                out.push(evaluate(
                    id, layer, metric, &source, b, c, bound, noise, &r.origin,
                ));
            }
            if have_min && have_max && have_rel {
                break;
            }
        }
    }
    Ok(())
}

/// Short scientific-ish formatting for reports: enough digits to see a 1e-4 move in a cosine.
pub fn fmt_num(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if x.is_infinite() {
        if x > 0.0 { "inf" } else { "-inf" }.into()
    } else if x.fract() == 0.0 && x.abs() < 1e9 {
        format!("{x:.0}")
    } else if (1e-3..1e5).contains(&x.abs()) {
        let s = format!("{x:.6}");
        let s = s.trim_end_matches('0');
        s.trim_end_matches('.').to_string()
    } else {
        format!("{x:.3e}")
    }
}

/// Four significant digits, rounded away from failing: a suggested tolerance copied from the log
/// into a rule file must pass, so `≥` bounds round up and `≤` bounds round down.
pub fn fmt_round(x: f64, up: bool) -> String {
    if x == 0.0 || !x.is_finite() || (x.fract() == 0.0 && x.abs() < 1e9) {
        return fmt_num(x);
    }
    let e = x.abs().log10().floor() as i32;
    let scale = 10f64.powi(e - 3);
    let m = x / scale;
    let mut units = if up { m.ceil() } else { m.floor() };
    let show = |units: f64| {
        let v = units * scale;
        if (-3..5).contains(&e) {
            let decimals = (3 - e).max(0) as usize;
            format!("{v:.decimals$}")
        } else {
            format!("{v:.3e}")
        }
    };
    // the division and the decimal printing each round; step one unit until the text is safe
    for _ in 0..3 {
        let text = show(units);
        let back: f64 = text
            .parse()
            .unwrap_or(if up { f64::INFINITY } else { f64::NEG_INFINITY });
        if (up && back >= x) || (!up && back <= x) {
            return text;
        }
        units += if up { 1.0 } else { -1.0 };
    }
    show(units)
}

pub fn fmt_val(v: Val) -> String {
    match v {
        Val::Num(x) => fmt_num(x),
        Val::Null => "null (non-finite)".into(),
        Val::Absent => "absent".into(),
    }
}

#[allow(clippy::too_many_arguments)]
fn evaluate(
    id: &str,
    layer: Option<i64>,
    metric: Metric,
    source: &str,
    b: Val,
    c: Val,
    bound: Bound,
    noise: f64,
    origin: &str,
) -> Check {
    let m = metric.name();
    let mut check = Check {
        op: id.to_string(),
        layer,
        metric: m.to_string(),
        source: source.to_string(),
        baseline: b,
        current: c,
        bound: bound.clone(),
        rule: String::new(),
        passed: true,
        min_passing: None,
        severity: 0.0,
    };
    let allowance = |d: f64, k: Option<f64>| match k {
        Some(k) => (
            d.max(k * noise),
            format!(
                "max({}, {}×noise {})",
                fmt_num(d),
                fmt_num(k),
                fmt_num(noise)
            ),
        ),
        None => (d, fmt_num(d)),
    };
    check.rule = match &bound {
        Bound::Min(x) => format!("{m} ≥ {}", fmt_num(*x)),
        Bound::Max(x) => format!("{m} ≤ {}", fmt_num(*x)),
        Bound::Relative(Relative::Drop {
            d,
            noise_multiplier,
        }) => {
            let (eff, txt) = allowance(*d, *noise_multiplier);
            if noise_multiplier.is_some() {
                format!("{m} ≥ baseline − {txt} = baseline − {}", fmt_num(eff))
            } else {
                format!("{m} ≥ baseline − {txt}")
            }
        }
        Bound::Relative(Relative::Increase {
            d,
            noise_multiplier,
        }) => {
            let (eff, txt) = allowance(*d, *noise_multiplier);
            if noise_multiplier.is_some() {
                format!("{m} ≤ baseline + {txt} = baseline + {}", fmt_num(eff))
            } else if *d == 0.0 {
                format!("{m} ≤ baseline (no new)")
            } else {
                format!("{m} ≤ baseline + {txt}")
            }
        }
        Bound::Relative(Relative::Ratio { r, slack }) => {
            let s = if *slack > 0.0 {
                format!(" + {}", fmt_num(*slack))
            } else {
                String::new()
            };
            match metric.direction() {
                Direction::LowerBetter => format!("{m} ≤ {}×baseline{s}", fmt_num(*r)),
                Direction::HigherBetter => {
                    format!("{m} ≥ baseline/{}{}", fmt_num(*r), s.replace('+', "−"))
                }
                Direction::NearBaseline => format!("{m} within ×{} of baseline{s}", fmt_num(*r)),
            }
        }
        Bound::Present => String::new(),
    } + &format!(" ({origin})");

    // undefined or vanished current values fail every bound
    let cur = match c {
        Val::Num(x) => x,
        Val::Null | Val::Absent => {
            let base_defined = matches!(b, Val::Num(_));
            let relative = matches!(bound, Bound::Relative(_));
            if relative && !base_defined && c == Val::Null && b == Val::Null {
                return check; // undefined before and after: nothing to compare
            }
            if relative && b == Val::Absent {
                return check;
            }
            check.passed = false;
            check.severity = f64::INFINITY;
            return check;
        }
    };
    let (passed, needed, severity) = match &bound {
        Bound::Min(x) => (
            cur >= *x,
            format!("min ≤ {}", fmt_round(cur, false)),
            1.0 + (x - cur) / x.abs().max(1e-12),
        ),
        Bound::Max(x) => (
            cur <= *x,
            format!("max ≥ {}", fmt_round(cur, true)),
            1.0 + (cur - x) / x.abs().max(1e-12),
        ),
        Bound::Present => (false, String::new(), f64::INFINITY),
        Bound::Relative(rel) => {
            let Some(base) = b.num() else {
                // baseline undefined (NaN before): any defined value is an improvement
                return check;
            };
            match rel {
                Relative::Drop {
                    d,
                    noise_multiplier,
                } => {
                    let (eff, _) = allowance(*d, *noise_multiplier);
                    let need = (base - cur).max(0.0);
                    (
                        need <= eff,
                        format!("max_drop ≥ {}", fmt_round(need, true)),
                        ratio_used(need, eff),
                    )
                }
                Relative::Increase {
                    d,
                    noise_multiplier,
                } => {
                    let (eff, _) = allowance(*d, *noise_multiplier);
                    let need = (cur - base).max(0.0);
                    (
                        need <= eff,
                        format!("max_increase ≥ {}", fmt_round(need, true)),
                        ratio_used(need, eff),
                    )
                }
                Relative::Ratio { r, slack } => {
                    let up = if base > 0.0 {
                        ((cur - slack) / base).max(1.0)
                    } else if cur <= *slack {
                        1.0
                    } else {
                        f64::INFINITY
                    };
                    let down = if cur + slack > 0.0 {
                        (base / (cur + slack)).max(1.0)
                    } else if base <= 0.0 {
                        1.0
                    } else {
                        f64::INFINITY
                    };
                    let need = match metric.direction() {
                        Direction::LowerBetter => up,
                        Direction::HigherBetter => down,
                        Direction::NearBaseline => up.max(down),
                    };
                    let txt = if need.is_finite() {
                        format!("max_ratio ≥ {}", fmt_round(need, true))
                    } else {
                        String::new() // no ratio of a zero baseline reaches a non-zero value
                    };
                    (need <= *r, txt, ratio_used(need - 1.0, r - 1.0))
                }
            }
        }
    };
    check.passed = passed;
    check.min_passing = (!needed.is_empty()).then_some(needed);
    check.severity = severity;
    check
}

fn ratio_used(need: f64, allowed: f64) -> f64 {
    if allowed > 0.0 {
        need / allowed
    } else if need > 0.0 {
        f64::INFINITY
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn how_the_served_path_ran_is_noted_when_it_differs() {
        let run = |extra: Value| {
            let mut v = serde_json::json!({
                "schema": "nvfp4-probe.run/1",
                "served_profile": "blackwell-w4a4",
                "backend": "cpu",
                "loader_faults": [],
                "ops": []
            });
            for (k, x) in extra.as_object().unwrap() {
                v[k] = x.clone();
            }
            v
        };
        let base = run(serde_json::json!({}));
        let cur = run(
            serde_json::json!({"served_chunk": 1024, "engine_faults": ["compressor-state-lost"]}),
        );
        let rep = compare(&base, &cur, &Tolerances::default(), false).unwrap();
        assert!(
            rep.notes
                .iter()
                .any(|n| n == "`served_chunk` differs: baseline (none) vs current 1024"),
            "{:?}",
            rep.notes
        );
        assert!(
            rep.notes
                .iter()
                .any(|n| n.contains("`engine_faults` differs")
                    && n.contains("compressor-state-lost")),
            "{:?}",
            rep.notes
        );
        let same = compare(&base, &base, &Tolerances::default(), false).unwrap();
        assert!(same.notes.is_empty(), "{:?}", same.notes);
    }

    #[test]
    fn rounding_is_away_from_failing() {
        assert_eq!(fmt_round(0.0123456, true), "0.01235");
        assert_eq!(fmt_round(0.0123456, false), "0.01234");
        assert_eq!(fmt_round(0.01, true), "0.01000");
        assert_eq!(fmt_round(0.010000000000000009, true), "0.01001");
        assert_eq!(fmt_round(0.9876543, false), "0.9876");
        assert_eq!(fmt_round(2.5e-7, true), "2.500e-7");
        assert_eq!(fmt_round(123456.5, true), "1.235e5");
        assert_eq!(fmt_round(4.0, true), "4");
        for x in [0.0123456f64, 0.98765432, 3.3e-6, 17.25, 1.0000001] {
            assert!(fmt_round(x, true).parse::<f64>().unwrap() >= x);
            assert!(fmt_round(x, false).parse::<f64>().unwrap() <= x);
        }
    }
}
