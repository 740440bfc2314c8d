//! The gate's library API against a hand-written run JSON (tests/data/gate/base.json, 38 ops of
//! layers 0..2) and planted regressions. Expected verdicts follow from the rules in the task
//! statement, worked out by hand for each planted value.

use nvfp4_probe::gate::{self, Tolerances};
use serde_json::{json, Value};

fn base() -> Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/gate/base.json"
    ))
    .unwrap();
    nvfp4_probe::run_json::parse_run(&text, "base.json").unwrap()
}

fn op_mut<'a>(run: &'a mut Value, id: &str) -> &'a mut Value {
    run["ops"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|o| o["id"] == id)
        .unwrap_or_else(|| panic!("no op {id}"))
}

fn get(run: &Value, id: &str, path: &[&str]) -> f64 {
    let mut v = run["ops"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["id"] == id)
        .unwrap();
    for p in path {
        v = &v[*p];
    }
    v.as_f64().unwrap()
}

fn gate_default(b: &Value, c: &Value) -> gate::GateReport {
    gate::compare(b, c, &Tolerances::default(), false).unwrap()
}

#[test]
fn identical_runs_pass() {
    let b = base();
    let r = gate_default(&b, &b.clone());
    assert!(r.passed());
    assert_eq!(r.exit_code(), 0);
    assert_eq!(r.ops.len(), 38);
    // cos, rel_l2, amax_ratio, divergent, 4× nan, 4× inf per op
    assert_eq!(r.checks.len(), 38 * 12);
    assert!(r.moved_worst_first().is_empty());
    assert!(r.missing_ops.is_empty() && r.new_ops.is_empty());
}

#[test]
fn cos_drop_at_one_op_fails_naming_it() {
    let b = base();
    let mut c = b.clone();
    let id = "L1.ffn.experts";
    let cb = get(&b, id, &["served_propagated_vs_bf16", "cos"]);
    op_mut(&mut c, id)["served_propagated_vs_bf16"]["cos"] = json!(cb - 0.01);
    let r = gate_default(&b, &c);
    assert!(!r.passed());
    assert_eq!(r.exit_code(), 1);
    let fails: Vec<_> = r.failures().collect();
    assert_eq!(fails.len(), 1, "{}", r.terminal());
    assert_eq!(fails[0].op, id);
    assert_eq!(fails[0].metric, "cos");
    assert_eq!(fails[0].source, "served_propagated_vs_bf16");
    // the drop is 0.01 (up to the f64 rounding of the subtraction); four digits rounded up
    let hint = fails[0].min_passing.as_deref().unwrap();
    let shown: f64 = hint.trim_start_matches("max_drop ≥ ").parse().unwrap();
    assert!((0.01..=0.01001).contains(&shown), "{hint}");
    let t = r.terminal();
    assert!(t.contains("FAIL L1.ffn.experts"), "{t}");
    assert!(
        t.contains(&format!("smallest passing tolerance: {hint}")),
        "{t}"
    );
    assert!(
        t.contains(&format!("baseline {}", gate::fmt_num(cb))),
        "{t}"
    );
}

#[test]
fn cos_allowance_is_the_larger_of_0002_and_three_times_the_noise_floor() {
    let b0 = base();
    let id = "L0.attn.q_b";
    let cb = get(&b0, id, &["served_propagated_vs_bf16", "cos"]);
    let verdict = |noise: f64, drop: f64| {
        let mut b = b0.clone();
        op_mut(&mut b, id)["bf16_vs_fp32"]["cos"] = json!(1.0 - noise);
        let mut c = b.clone();
        op_mut(&mut c, id)["served_propagated_vs_bf16"]["cos"] = json!(cb - drop);
        gate_default(&b, &c).passed()
    };
    // tiny noise: allowance 0.002
    assert!(verdict(1e-6, 0.0019));
    assert!(!verdict(1e-6, 0.0021));
    // noise 1e-3: allowance 3e-3
    assert!(verdict(1e-3, 0.0029));
    assert!(!verdict(1e-3, 0.0031));
    // an improvement is never a failure
    assert!(verdict(1e-6, -0.001));
}

#[test]
fn rel_l2_and_amax_ratio_defaults() {
    let b0 = base();
    let id = "L2.attn.wo_b";
    let rb = get(&b0, id, &["served_propagated_vs_bf16", "rel_l2"]);
    let ab = get(&b0, id, &["served_propagated_vs_bf16", "amax_ratio"]);
    let with = |field: &str, v: f64| {
        let mut c = b0.clone();
        op_mut(&mut c, id)["served_propagated_vs_bf16"][field] = json!(v);
        gate_default(&b0, &c)
    };
    let limit = 1.5 * rb + 1e-3;
    assert!(with("rel_l2", limit - 1e-6).passed());
    let r = with("rel_l2", limit + 1e-4);
    assert!(!r.passed());
    let f = r.failures().next().unwrap();
    assert_eq!((f.op.as_str(), f.metric.as_str()), (id, "rel_l2"));
    // needed ratio (cur − 1e-3)/base, rounded up to 4 digits
    let need = (limit + 1e-4 - 1e-3) / rb;
    let shown: f64 = f
        .min_passing
        .as_deref()
        .unwrap()
        .trim_start_matches("max_ratio ≥ ")
        .parse()
        .unwrap();
    assert!(shown >= need && shown < need * 1.001, "{shown} vs {need}");

    assert!(with("amax_ratio", ab * 1.9).passed());
    assert!(with("amax_ratio", ab * 0.55).passed());
    assert!(!with("amax_ratio", ab * 2.1).passed());
    assert!(!with("amax_ratio", ab * 0.45).passed());
}

#[test]
fn a_new_nan_anywhere_fails_naming_the_op_and_path() {
    let b = base();
    for path in ["oracle_fp32", "oracle_bf16", "served", "served_isolated"] {
        let mut c = b.clone();
        let op = op_mut(&mut c, "L2.attn.q_b");
        op["stats"][path]["nan"] = json!(7);
        let r = gate_default(&b, &c);
        let fails: Vec<_> = r.failures().collect();
        assert_eq!(fails.len(), 1, "{path}: {}", r.terminal());
        assert_eq!(fails[0].op, "L2.attn.q_b");
        assert_eq!(fails[0].metric, "nan");
        assert_eq!(fails[0].source, path);
    }
    // NaN in the served output also makes its cosine undefined: that fails too, with no tolerance
    let mut c = b.clone();
    let op = op_mut(&mut c, "L0.ffn.experts");
    op["stats"]["served"]["inf"] = json!(1);
    op["served_propagated_vs_bf16"]["cos"] = Value::Null;
    let r = gate_default(&b, &c);
    let fails: Vec<_> = r.failures().collect();
    assert_eq!(fails.len(), 2, "{}", r.terminal());
    assert!(fails.iter().all(|f| f.op == "L0.ffn.experts"));
    let cos = fails.iter().find(|f| f.metric == "cos").unwrap();
    assert_eq!(cos.min_passing, None);
    assert!(r.terminal().contains("none (current value undefined"));
}

#[test]
fn existing_nan_does_not_fail_but_more_does() {
    let mut b = base();
    op_mut(&mut b, "head")["stats"]["served"]["nan"] = json!(3);
    let mut c = b.clone();
    assert!(gate_default(&b, &c).passed());
    op_mut(&mut c, "head")["stats"]["served"]["nan"] = json!(4);
    assert!(!gate_default(&b, &c).passed());
}

#[test]
fn divergent_false_to_true_fails() {
    let b = base();
    let mut c = b.clone();
    op_mut(&mut c, "L1.attn.kv")["divergent"] = json!(true);
    let r = gate_default(&b, &c);
    let f: Vec<_> = r.failures().collect();
    assert_eq!(f.len(), 1);
    assert_eq!(
        (f[0].op.as_str(), f[0].metric.as_str()),
        ("L1.attn.kv", "divergent")
    );
    // true → false is a fix
    assert!(gate_default(&c, &b).passed());
}

#[test]
fn missing_op_fails_and_new_op_is_reported() {
    let b = base();
    let mut c = b.clone();
    let ops = c["ops"].as_array_mut().unwrap();
    ops.retain(|o| o["id"] != "L0.attn.kv");
    let mut extra = ops[3].clone();
    extra["id"] = json!("L0.attn.extra");
    ops.push(extra);
    let r = gate_default(&b, &c);
    assert!(!r.passed());
    assert_eq!(r.missing_ops, vec!["L0.attn.kv".to_string()]);
    assert_eq!(r.new_ops, vec!["L0.attn.extra".to_string()]);
    assert_eq!(
        r.failing_ops().into_iter().collect::<Vec<_>>(),
        vec!["L0.attn.kv"]
    );
    let t = r.terminal();
    assert!(
        t.contains("FAIL L0.attn.kv: in the baseline, missing from the current run"),
        "{t}"
    );
    assert!(
        t.contains("new op (not in the baseline): L0.attn.extra"),
        "{t}"
    );

    // a new op alone is not a failure
    let mut c2 = b.clone();
    c2["ops"].as_array_mut().unwrap().push(extra_op(&b));
    let r2 = gate_default(&b, &c2);
    assert!(r2.passed());
    assert_eq!(r2.new_ops.len(), 1);
}

fn extra_op(b: &Value) -> Value {
    let mut e = b["ops"][5].clone();
    e["id"] = json!("L9.new");
    e["layer"] = json!(9);
    e
}

#[test]
fn a_tolerance_file_changes_the_verdict() {
    let b = base();
    let mut c = b.clone();
    let cb = get(&b, "L1.ffn.experts", &["served_propagated_vs_bf16", "cos"]);
    op_mut(&mut c, "L1.ffn.experts")["served_propagated_vs_bf16"]["cos"] = json!(cb - 0.01);
    assert!(!gate_default(&b, &c).passed());

    // loosen for the experts only; a specific rule placed first wins over the built-in one
    let loose = Tolerances::from_toml(
        "[[rule]]\nops = \"L*.ffn.experts\"\nmetric = \"cos\"\nmax_drop = 0.02\n",
        "loose.toml",
    )
    .unwrap();
    assert!(gate::compare(&b, &c, &loose, false).unwrap().passed());

    // the same loosening aimed at other ops does not help
    let wrong = Tolerances::from_toml(
        "[[rule]]\nops = \"L*.attn.*\"\nmetric = \"cos\"\nmax_drop = 0.02\n",
        "wrong.toml",
    )
    .unwrap();
    assert!(!gate::compare(&b, &c, &wrong, false).unwrap().passed());

    // the suggested smallest tolerance, pasted into a rule, passes
    let r = gate_default(&b, &c);
    let hint = r.failures().next().unwrap().min_passing.clone().unwrap();
    let v = hint.trim_start_matches("max_drop ≥ ");
    let pasted = Tolerances::from_toml(
        &format!("[[rule]]\nops = \"L1.ffn.experts\"\nmetric = \"cos\"\nmax_drop = {v}\n"),
        "pasted.toml",
    )
    .unwrap();
    assert!(gate::compare(&b, &c, &pasted, false).unwrap().passed());

    // tighten: an absolute floor fails even an identical run
    let floor = get(&b, "L2.ffn.experts", &["served_propagated_vs_bf16", "cos"]);
    let tight = Tolerances::from_toml(
        &format!(
            "[[rule]]\nops = \"L2.ffn.experts\"\nmetric = \"cos\"\nmin = {}\n",
            floor + 1e-4
        ),
        "tight.toml",
    )
    .unwrap();
    let r = gate::compare(&b, &b, &tight, false).unwrap();
    let f: Vec<_> = r.failures().collect();
    assert_eq!(f.len(), 1);
    assert_eq!(f[0].op, "L2.ffn.experts");
    assert!(f[0].rule.contains("tight.toml rule #1"), "{}", f[0].rule);
    assert!(f[0].min_passing.as_deref().unwrap().starts_with("min ≤ "));

    // an absolute rule on another comparison, and `skip`
    let iso = Tolerances::from_toml(
        "[[rule]]\nops = \"L0.*\"\nmetric = \"rel_l2\"\ncompare = \"served_isolated_vs_bf16\"\nmax = 0.04\n",
        "iso.toml",
    )
    .unwrap();
    let r = gate::compare(&b, &b, &iso, false).unwrap();
    // hand count: layer-0 isolated rel-L2 above 0.04 are q_b 0.05, wo_b 0.05, experts 0.12, shared 0.09
    let mut failing: Vec<&str> = r.failing_ops().into_iter().collect();
    failing.sort();
    assert_eq!(
        failing,
        vec![
            "L0.attn.q_b",
            "L0.attn.wo_b",
            "L0.ffn.experts",
            "L0.ffn.shared"
        ]
    );
    let skip = Tolerances::from_toml(
        "[[rule]]\nops = \"L1.ffn.experts\"\nmetric = \"cos\"\nskip = true\n",
        "skip.toml",
    )
    .unwrap();
    assert!(gate::compare(&b, &c, &skip, false).unwrap().passed());
}

#[test]
fn fingerprint_mismatch_is_refused_unless_forced() {
    let b = base();
    for (obj, key) in [
        ("checkpoint", "config_sha256"),
        ("checkpoint", "header_sha256"),
        ("tokens", "sha256"),
    ] {
        let mut c = b.clone();
        c[obj][key] = json!("ffff");
        let e = gate::compare(&b, &c, &Tolerances::default(), false).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains(key), "{e}");
        assert!(e.to_string().contains("--force"), "{e}");
        let r = gate::compare(&b, &c, &Tolerances::default(), true).unwrap();
        assert!(r.passed());
        assert!(r.notes.iter().any(|n| n.contains(key)));
        assert!(r.summary_markdown().contains(key));
    }
}

#[test]
fn not_a_run_json_is_unusable_naming_the_file() {
    for text in [
        "{\"schema\": \"something-else/1\", \"ops\": []}",
        "[1,2]",
        "not json",
        "{\"schema\": \"nvfp4-probe.run/1\"}",
    ] {
        let e = nvfp4_probe::run_json::parse_run(text, "weird.json").unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("weird.json"), "{e}");
    }
    let b = base();
    let mut c = b.clone();
    op_mut(&mut c, "L0.attn.q_a")["served_propagated_vs_bf16"]["cos"] = json!("0.99");
    let e = gate::compare(&b, &c, &Tolerances::default(), false).unwrap_err();
    assert!(e.to_string().contains("L0.attn.q_a"), "{e}");
    assert!(e.to_string().contains("current"), "{e}");
}

#[test]
fn unknown_fields_are_ignored() {
    let b = base();
    let mut c = b.clone();
    c["future_field"] = json!({"x": 1});
    op_mut(&mut c, "head")["served_propagated_vs_bf16"]["ulp_p99"] = json!(12);
    op_mut(&mut c, "head")["new_block"] = json!([1, 2, 3]);
    assert!(gate_default(&b, &c).passed());
}

#[test]
fn rules_can_target_an_op_class() {
    let b = base();
    let t = Tolerances::from_toml(
        "[[rule]]\nclass = \"Moe\"\nmetric = \"cos\"\nmin = 0.99\n",
        "class.toml",
    )
    .unwrap();
    let r = gate::compare(&b, &b, &t, false).unwrap();
    let mut failing: Vec<&str> = r.failing_ops().into_iter().collect();
    failing.sort();
    // propagated cos of the fixture's MoE ops: 0.9885, 0.9651, 0.9288, all below 0.99;
    // no other class is touched
    assert_eq!(
        failing,
        vec!["L0.ffn.experts", "L1.ffn.experts", "L2.ffn.experts"]
    );
    assert_eq!(r.first_failing_op(), Some("L0.ffn.experts"));
    assert!(r
        .summary_markdown()
        .contains("first in execution order: `L0.ffn.experts`"));
}
