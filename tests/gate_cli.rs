//! `nvfp4-probe gate` end to end: exit codes, the markdown summary and the JUnit XML, the latter
//! checked with a small independent XML well-formedness parser written here.

use assert_cmd::Command;
use predicates::prelude::PredicateBooleanExt;
use predicates::str::contains;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

const BASE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/gate/base.json");

fn base() -> Value {
    serde_json::from_str(&std::fs::read_to_string(BASE).unwrap()).unwrap()
}

fn op_mut<'a>(run: &'a mut Value, id: &str) -> &'a mut Value {
    run["ops"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|o| o["id"] == id)
        .unwrap()
}

fn write(dir: &Path, name: &str, v: &Value) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, serde_json::to_string(v).unwrap()).unwrap();
    p
}

fn gate() -> Command {
    Command::cargo_bin("nvfp4-probe").unwrap()
}

/// A run with a cos regression at `L1.ffn.experts`, a new NaN at `L2.attn.q_b` and
/// `L0.attn.kv` missing.
fn regressed() -> Value {
    let mut c = base();
    let o = op_mut(&mut c, "L1.ffn.experts");
    let cos = o["served_propagated_vs_bf16"]["cos"].as_f64().unwrap();
    o["served_propagated_vs_bf16"]["cos"] = json!(cos - 0.01);
    op_mut(&mut c, "L2.attn.q_b")["stats"]["served"]["nan"] = json!(4);
    c["ops"]
        .as_array_mut()
        .unwrap()
        .retain(|o| o["id"] != "L0.attn.kv");
    c
}

#[test]
fn identical_runs_exit_0() {
    let d = tempfile::tempdir().unwrap();
    let cur = write(d.path(), "cur.json", &base());
    gate()
        .args(["gate", "--baseline", BASE, "--current"])
        .arg(&cur)
        .assert()
        .code(0)
        .stdout(contains("gate: PASS"));
}

#[test]
fn regression_exits_1_naming_each_op_with_the_smallest_passing_tolerance() {
    let d = tempfile::tempdir().unwrap();
    let cur = write(d.path(), "cur.json", &regressed());
    let out = gate()
        .args(["gate", "--baseline", BASE, "--current"])
        .arg(&cur)
        .assert()
        .code(1)
        .get_output()
        .stdout
        .clone();
    let out = String::from_utf8(out).unwrap();
    for needle in [
        "FAIL L1.ffn.experts  cos [served_propagated_vs_bf16]",
        "smallest passing tolerance: max_drop ≥ 0.0100",
        "FAIL L2.attn.q_b  nan [served]",
        "smallest passing tolerance: max_increase ≥ 4",
        "FAIL L0.attn.kv: in the baseline, missing from the current run",
        "rule: cos ≥ baseline − max(0.002, 3×noise",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in\n{out}");
    }
}

#[test]
fn tolerance_file_changes_the_exit_code() {
    let d = tempfile::tempdir().unwrap();
    let mut c = base();
    let o = op_mut(&mut c, "L1.ffn.experts");
    let cos = o["served_propagated_vs_bf16"]["cos"].as_f64().unwrap();
    o["served_propagated_vs_bf16"]["cos"] = json!(cos - 0.01);
    let cur = write(d.path(), "cur.json", &c);
    gate()
        .args(["gate", "--baseline", BASE, "--current"])
        .arg(&cur)
        .assert()
        .code(1);
    let tol = d.path().join("tol.toml");
    std::fs::write(
        &tol,
        "[[rule]]\nops = \"L*.ffn.experts\"\nmetric = \"cos\"\nmax_drop = 0.02\n",
    )
    .unwrap();
    gate()
        .args(["gate", "--baseline", BASE, "--current"])
        .arg(&cur)
        .arg("--tolerances")
        .arg(&tol)
        .assert()
        .code(0);
    // a broken tolerance file is unusable input naming the file
    std::fs::write(&tol, "[[rule]]\nmetric = \"cosine\"\nmin = 1\n").unwrap();
    gate()
        .args(["gate", "--baseline", BASE, "--current"])
        .arg(&cur)
        .arg("--tolerances")
        .arg(&tol)
        .assert()
        .code(2)
        .stderr(contains("tol.toml"));
}

#[test]
fn fingerprint_mismatch_exits_2_unless_forced() {
    let d = tempfile::tempdir().unwrap();
    let mut c = base();
    c["tokens"]["sha256"] = json!("00ff");
    let cur = write(d.path(), "cur.json", &c);
    gate()
        .args(["gate", "--baseline", BASE, "--current"])
        .arg(&cur)
        .assert()
        .code(2)
        .stderr(contains("tokens.sha256").and(contains("--force")));
    gate()
        .args(["gate", "--force", "--baseline", BASE, "--current"])
        .arg(&cur)
        .assert()
        .code(0)
        .stdout(contains("note: token ids fingerprint"));
}

#[test]
fn not_a_run_json_exits_2_naming_the_file() {
    let d = tempfile::tempdir().unwrap();
    let bad = d.path().join("bogus.json");
    std::fs::write(&bad, "{\"schema\": \"nvfp4-probe.lint/1\"}").unwrap();
    gate()
        .args(["gate", "--baseline", BASE, "--current"])
        .arg(&bad)
        .assert()
        .code(2)
        .stderr(contains("bogus.json").and(contains("nvfp4-probe.run/1")));
    gate()
        .args(["gate", "--current", BASE, "--baseline"])
        .arg(d.path().join("nope.json"))
        .assert()
        .code(2)
        .stderr(contains("nope.json"));
}

#[test]
fn summary_markdown_has_a_proper_table() {
    let d = tempfile::tempdir().unwrap();
    let cur = write(d.path(), "cur.json", &regressed());
    let md = d.path().join("summary.md");
    gate()
        .args(["gate", "--baseline", BASE, "--current"])
        .arg(&cur)
        .arg("--summary")
        .arg(&md)
        .assert()
        .code(1);
    let text = std::fs::read_to_string(&md).unwrap();
    assert!(text.lines().next().unwrap().contains("FAIL"), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    let h = lines
        .iter()
        .position(|l| l.starts_with("| ") && l.contains("| op |"))
        .expect("table header");
    let cols = |l: &str| l.replace("\\|", "").matches('|').count();
    let header = lines[h];
    for name in [
        "op",
        "metric",
        "baseline",
        "current",
        "Δ",
        "rule",
        "min passing tol",
    ] {
        assert!(header.contains(&format!("| {name} |")), "{header}");
    }
    let sep = lines[h + 1];
    assert!(sep.chars().all(|c| "|-: ".contains(c)), "{sep}");
    assert_eq!(cols(sep), cols(header));
    let rows: Vec<&str> = lines[h + 2..]
        .iter()
        .take_while(|l| l.starts_with('|'))
        .copied()
        .collect();
    // cos at L1.ffn.experts, nan at L2.attn.q_b, L0.attn.kv missing; nothing else moved
    assert_eq!(rows.len(), 3, "{text}");
    for r in &rows {
        assert_eq!(cols(r), cols(header), "{r}");
    }
    assert!(rows
        .iter()
        .any(|r| r.contains("`L1.ffn.experts`") && r.contains("max_drop ≥")));
    assert!(rows
        .iter()
        .any(|r| r.contains("`L0.attn.kv`") && r.contains("missing")));
    assert!(text.contains("**Counts:**"), "{text}");
}

// ---- a minimal XML 1.0 well-formedness parser (elements, attributes, text, entities) ----

#[derive(Debug)]
struct Element {
    name: String,
    attrs: Vec<(String, String)>,
    children: Vec<Element>,
    text: String,
}

fn unescape(s: &str) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find('&') {
        out.push_str(&rest[..i]);
        let end = rest[i..].find(';').ok_or("unterminated entity")? + i;
        let ent = &rest[i + 1..end];
        let ch = match ent {
            "amp" => '&',
            "lt" => '<',
            "gt" => '>',
            "quot" => '"',
            "apos" => '\'',
            e if e.starts_with("#x") => {
                char::from_u32(u32::from_str_radix(&e[2..], 16).map_err(|_| "bad ref")?)
                    .ok_or("bad char")?
            }
            e if e.starts_with('#') => {
                char::from_u32(e[1..].parse().map_err(|_| "bad ref")?).ok_or("bad char")?
            }
            e => return Err(format!("unknown entity &{e};")),
        };
        out.push(ch);
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    if out
        .chars()
        .any(|c| (c as u32) < 0x20 && !matches!(c, '\t' | '\n' | '\r'))
    {
        return Err("control character".into());
    }
    Ok(out)
}

fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-.:".contains(c))
}

fn parse_xml(doc: &str) -> Result<Element, String> {
    let mut s = doc.trim_start();
    if s.starts_with("<?xml") {
        s = &s[s.find("?>").ok_or("bad declaration")? + 2..];
    }
    let mut stack: Vec<Element> = Vec::new();
    let mut root: Option<Element> = None;
    loop {
        let lt = match s.find('<') {
            Some(i) => i,
            None => {
                if !s.trim().is_empty() {
                    return Err("text after root".into());
                }
                break;
            }
        };
        let text = &s[..lt];
        let t = unescape(text)?;
        match stack.last_mut() {
            Some(e) => e.text.push_str(&t),
            None if !t.trim().is_empty() => return Err("text outside root".into()),
            None => {}
        }
        s = &s[lt..];
        let gt = s.find('>').ok_or("unterminated tag")?;
        let tag = &s[1..gt];
        s = &s[gt + 1..];
        if let Some(name) = tag.strip_prefix('/') {
            let e = stack.pop().ok_or("close without open")?;
            if e.name != name.trim() {
                return Err(format!("</{name}> closes <{}>", e.name));
            }
            match stack.last_mut() {
                Some(p) => p.children.push(e),
                None => {
                    if root.is_some() {
                        return Err("two roots".into());
                    }
                    root = Some(e)
                }
            }
            continue;
        }
        if root.is_some() {
            return Err("element after root".into());
        }
        let (body, selfclose) = match tag.strip_suffix('/') {
            Some(b) => (b, true),
            None => (tag, false),
        };
        // attribute values may not contain '<' (checked) and are double-quoted here
        if body.contains('<') {
            return Err(format!("raw < in tag {body}"));
        }
        let name_end = body.find(char::is_whitespace).unwrap_or(body.len());
        let name = &body[..name_end];
        if !is_name(name) {
            return Err(format!("bad element name {name:?}"));
        }
        let mut attrs = Vec::new();
        let mut rest = body[name_end..].trim_start();
        while !rest.is_empty() {
            let eq = rest.find('=').ok_or("attribute without =")?;
            let an = rest[..eq].trim();
            if !is_name(an) {
                return Err(format!("bad attribute name {an:?}"));
            }
            let after = rest[eq + 1..].trim_start();
            let q = after.chars().next().ok_or("no value")?;
            if q != '"' && q != '\'' {
                return Err("unquoted attribute".into());
            }
            let close = after[1..].find(q).ok_or("unterminated attribute")? + 1;
            let val = unescape(&after[1..close])?;
            if attrs.iter().any(|(n, _): &(String, String)| n == an) {
                return Err(format!("duplicate attribute {an}"));
            }
            attrs.push((an.to_string(), val));
            rest = after[close + 1..].trim_start();
        }
        let e = Element {
            name: name.to_string(),
            attrs,
            children: vec![],
            text: String::new(),
        };
        if selfclose {
            match stack.last_mut() {
                Some(p) => p.children.push(e),
                None => root = Some(e),
            }
        } else {
            stack.push(e);
        }
    }
    if !stack.is_empty() {
        return Err("unclosed element".into());
    }
    root.ok_or_else(|| "no root".into())
}

impl Element {
    fn attr(&self, n: &str) -> Option<&str> {
        self.attrs
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.as_str())
    }
}

#[test]
fn the_test_parser_rejects_malformed_xml() {
    for bad in [
        "<a><b></a></b>",
        "<a x=\"1\" x=\"2\"/>",
        "<a>&foo;</a>",
        "<a>x & y</a>",
        "<a x=1/>",
        "<a>",
        "<a/><b/>",
        "<a x=\"<\"/>",
    ] {
        assert!(parse_xml(bad).is_err(), "{bad}");
    }
    let ok = parse_xml("<?xml version=\"1.0\"?><a q='&lt;&amp;'><b/>t&#10;</a>").unwrap();
    assert_eq!(ok.attr("q"), Some("<&"));
    assert_eq!(ok.children.len(), 1);
}

#[test]
fn junit_is_well_formed_with_one_testcase_per_op() {
    let d = tempfile::tempdir().unwrap();
    // an op id full of XML metacharacters, present in both runs and regressed in the current one
    let weird = "L0.<odd>&\"quoted\"'op'";
    let mut b = base();
    let mut extra = b["ops"][3].clone();
    extra["id"] = json!(weird);
    b["ops"].as_array_mut().unwrap().push(extra);
    let mut c = regressed();
    let mut extra = b["ops"][3].clone();
    extra["id"] = json!(weird);
    extra["stats"]["served_isolated"]["inf"] = json!(2);
    c["ops"].as_array_mut().unwrap().push(extra);
    let basep = write(d.path(), "base.json", &b);
    let cur = write(d.path(), "cur.json", &c);
    let xml = d.path().join("junit.xml");
    gate()
        .args(["gate", "--baseline"])
        .arg(&basep)
        .arg("--current")
        .arg(&cur)
        .arg("--junit")
        .arg(&xml)
        .assert()
        .code(1);
    let text = std::fs::read_to_string(&xml).unwrap();
    let root = parse_xml(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(root.name, "testsuites");
    let suite = &root.children[0];
    assert_eq!(suite.name, "testsuite");
    let cases: Vec<&Element> = suite
        .children
        .iter()
        .filter(|e| e.name == "testcase")
        .collect();
    let n_ops = b["ops"].as_array().unwrap().len();
    assert_eq!(cases.len(), n_ops);
    assert_eq!(suite.attr("tests"), Some(n_ops.to_string().as_str()));
    let failing: Vec<&str> = cases
        .iter()
        .filter(|c| c.children.iter().any(|e| e.name == "failure"))
        .map(|c| c.attr("name").unwrap())
        .collect();
    assert_eq!(failing.len(), 4, "{failing:?}");
    for op in ["L1.ffn.experts", "L2.attn.q_b", "L0.attn.kv", weird] {
        assert!(failing.contains(&op), "{op} not failing: {failing:?}");
    }
    assert_eq!(suite.attr("failures"), Some("4"));
    let w = cases
        .iter()
        .find(|c| c.attr("name") == Some(weird))
        .unwrap();
    assert_eq!(w.attr("classname"), Some("L0"));
    let f = &w.children[0];
    assert!(f.attr("message").unwrap().contains(weird));
    assert!(f.attr("message").unwrap().contains("inf [served_isolated]"));
    let embed = cases
        .iter()
        .find(|c| c.attr("name") == Some("embed"))
        .unwrap();
    assert_eq!(embed.attr("classname"), Some("model"));
}
