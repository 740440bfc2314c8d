//! Reading a run JSON (schema `nvfp4-probe.run/1`, written by `report`): the one reader of run
//! JSON files, shared by `gate`, `plot` and `run --plot`. Low in the crate: it knows the schema's
//! tag and op records, nothing of the runs that made them.

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::Value;

use crate::{Error, Result};

/// The schema tag of a run JSON.
pub const RUN_SCHEMA: &str = "nvfp4-probe.run/1";

/// Reads a run JSON and checks that it is one; any failure names the file (exit 2). The one
/// reader of run JSON files: `gate` and `plot` both go through it.
pub fn load_run(path: &Path) -> Result<Value> {
    let text = crate::input::read_text(path, "run JSON", crate::input::REPORT_FILE_MAX)?;
    parse_run(&text, path)
}

/// Parses run JSON text; `name` is the file named in errors.
pub fn parse_run(text: &str, name: impl AsRef<Path>) -> Result<Value> {
    let name = name.as_ref();
    let v: Value = crate::input::parse_json(name, text, "run JSON")?;
    check_run(&v, name)?;
    Ok(v)
}

/// The parts of the schema the gate relies on: the schema tag and an `ops` array of objects with ids.
pub fn check_run(v: &Value, name: &Path) -> Result<()> {
    match v.get("schema").and_then(Value::as_str) {
        Some(RUN_SCHEMA) => {}
        Some(other) => {
            return Err(Error::bad(
                name,
                None,
                format!("not a {RUN_SCHEMA} JSON (schema is `{other}`)"),
            ))
        }
        None => {
            return Err(Error::bad(
                name,
                None,
                format!("not a {RUN_SCHEMA} JSON (no `schema` field)"),
            ))
        }
    }
    let ops = v
        .get("ops")
        .and_then(Value::as_array)
        .ok_or_else(|| Error::bad(name, None, "`ops` is missing or not an array"))?;
    let mut seen = BTreeSet::new();
    for (i, op) in ops.iter().enumerate() {
        let id = op
            .get("id")
            .and_then(Value::as_str)
            .ok_or_else(|| Error::bad(name, None, format!("ops[{i}] has no string `id`")))?;
        if !seen.insert(id) {
            return Err(Error::bad(name, Some(id), "op id appears twice"));
        }
        check_op_numbers(op, name, id)?;
    }
    Ok(())
}

/// The op's layer from its `layer` field, else from an `L{n}.` id prefix.
pub fn layer_of(id: &str, op: &Value) -> Option<i64> {
    if let Some(l) = op.get("layer").and_then(Value::as_i64) {
        return Some(l);
    }
    let rest = id.strip_prefix('L')?;
    let (n, _) = rest.split_once('.')?;
    n.parse().ok()
}

/// Every number an op record carries must be a JSON number (or null where the runner writes an
/// undefined value): the gate's checks and the plots read the same fields, so a file with
/// `"amax": "12.5"` is refused by both alike, naming the op and the field.
fn check_op_numbers(op: &Value, name: &Path, id: &str) -> Result<()> {
    let bad = |field: String, v: &Value| {
        Err(Error::bad(
            name,
            Some(id),
            format!("`{field}` should be a number, found {v}"),
        ))
    };
    let numeric = |v: &Value| v.is_number() || v.is_null();
    for key in ["step", "layer", "tolerance", "act_amax_over_calib"] {
        if let Some(v) = op.get(key).filter(|v| !numeric(v)) {
            return bad(key.to_string(), v);
        }
    }
    for key in ["divergent", "shows"] {
        if let Some(v) = op.get(key).filter(|v| !numeric(v) && !v.is_boolean()) {
            return bad(key.to_string(), v);
        }
    }
    let Some(obj) = op.as_object() else {
        return Err(Error::bad(name, Some(id), "op record is not an object"));
    };
    // the comparison objects (`served_isolated_vs_bf16`, …) and each path's stats
    let mut groups: Vec<(String, &Value)> = obj
        .iter()
        .filter(|(k, _)| k.contains("_vs_"))
        .map(|(k, v)| (k.clone(), v))
        .collect();
    if let Some(stats) = op.get("stats") {
        let Some(paths) = stats.as_object() else {
            return bad("stats".into(), stats);
        };
        groups.extend(paths.iter().map(|(p, v)| (format!("stats.{p}"), v)));
    }
    for (g, v) in groups {
        match v {
            Value::Null => {}
            Value::Object(fields) => {
                if let Some((f, x)) = fields.iter().find(|(_, x)| !numeric(x)) {
                    return bad(format!("{g}.{f}"), x);
                }
                for (f, x) in fields {
                    if let Some(why) = x.as_f64().and_then(|x| impossible(f, x)) {
                        return Err(Error::bad(
                            name,
                            None,
                            format!("op `{id}`: `{g}.{f}` = {x} is impossible ({why})"),
                        ));
                    }
                }
            }
            other => return bad(g, other),
        }
    }
    Ok(())
}

/// Why a metric's value cannot come from a run, or `None` when it can: the ranges the metrics
/// (`src/metrics`) produce. A gate reading `rel_l2: -1` or `cos: 1.5` would otherwise pass or fail
/// on a number no run can write. Fields not listed (added later within `/1`) are not judged.
fn impossible(field: &str, x: f64) -> Option<&'static str> {
    match field {
        "cos" if !(-1.0..=1.0).contains(&x) => Some("a cosine lies in [-1, 1]"),
        "rel_l2" | "max_abs_err" | "amax_ratio" | "amax" | "mean_abs" if x < 0.0 => {
            Some("it is ≥ 0")
        }
        "sqnr_db" if x > 300.0 => Some("SQNR is capped at 300 dB"),
        "kl" | "kl_max" if x < 0.0 => Some("a KL divergence is ≥ 0"),
        "top1" | "top5" if !(0.0..=1.0).contains(&x) => Some("an agreement lies in [0, 1]"),
        "nan" | "inf" | "zeros" | "numel" | "new_non_finite" | "max_abs_idx"
            if x < 0.0 || x.fract() != 0.0 =>
        {
            Some("a count is a whole number ≥ 0")
        }
        _ => None,
    }
}
