//! Severity by consequence and every divergent op attributed, on checkpoints whose attention
//! output projections are the bytes compressed-tensors 0.20 and ModelOpt 0.47 wrote themselves
//! (tests/data/producers), with faults planted by `synth --fault` and by editing stored scalars.
//! Expected values come from the checkpoints' own stored scales, not from the synthetic weights.

mod verdict_support;

use std::path::Path;

use nvfp4_probe::bisect::{self, BisectResult};
use nvfp4_probe::checkpoint::Checkpoint;
use nvfp4_probe::probe::findings::{Impact, Level, Source};
use nvfp4_probe::probe::{self, RunOptions};
use nvfp4_probe::synth::Format;
use verdict_support::*;

const T: usize = 32;

fn opts(ck: &Checkpoint, seed: u64) -> RunOptions {
    let vocab = ck.model_config().unwrap().vocab_size;
    RunOptions::new((0, 4), probe::synthetic_tokens(T, vocab, seed))
}

fn bisect_dir(d: &Path, seed: u64) -> BisectResult {
    let ck = Checkpoint::open(d).unwrap();
    bisect::bisect(&ck, &opts(&ck, seed)).unwrap()
}

fn show(r: &BisectResult) -> String {
    nvfp4_probe::probe::findings::terminal(&r.findings)
}

/// The producer's own f32 dequantization of `case.gaussian`.
fn producer_dequant(tag: &str) -> Vec<f32> {
    let buf = std::fs::read(producers().join("dequant-f32.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&buf).unwrap();
    st.tensor(&format!("case.gaussian:{tag}"))
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// The checkpoints carry the producers' bytes: wo_b decodes to 8 × each producer's own
/// dequantization, bit for bit; and with them the model runs clean (no finding at all).
#[test]
fn producer_wo_b_checkpoints_decode_the_producers_bytes_and_run_clean() {
    for (format, tag) in [(Format::CtNvfp4, "ct"), (Format::ModelOptNvfp4, "modelopt")] {
        let want: Vec<f32> = producer_dequant(tag).iter().map(|v| v * 8.0).collect();
        for seed in [0, 1] {
            let base = synth(format, seed, &[]);
            let d = with_producer_wo_b(base.path(), format);
            let ck = Checkpoint::open(d.path()).unwrap();
            for l in 0..5 {
                let w = ck
                    .weight(&format!("layers.{l}.attn.wo_b"))
                    .unwrap()
                    .dequantize()
                    .unwrap();
                assert_eq!(w.shape, vec![256, 512]);
                let same = w
                    .data
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits() || (*a == 0.0 && *b == 0.0));
                assert!(same, "{format:?} L{l}: wo_b is not the producer's bytes");
            }
            let r = bisect::bisect(&ck, &opts(&ck, seed)).unwrap();
            assert!(
                r.findings.is_empty(),
                "{format:?} seed {seed}:\n{}",
                show(&r)
            );
        }
    }
}

/// q_a and kv calibrated separately: their tensor scales differ, the engine keeps one (the max),
/// and the shard that lost the merge decodes by a constant factor — which the RMSNorm after it
/// removes. `run`, `bisect` and `lint` exit 0 with a warning naming the norm; `--strict` exits 1.
/// ModelOpt keeps max(d): q_a (d/1.28) decodes ×1.28, q_norm absorbs it. compressed-tensors keeps
/// max(g): with q_a's g ×1.5, kv decodes ×1/1.5, kv_norm absorbs it.
#[test]
fn fused_pair_scale_mismatch_absorbed_by_the_norm_is_a_warning() {
    for (format, tensor, factor, op, norm) in [
        (
            Format::ModelOptNvfp4,
            "layers.1.attn.wq_a.weight_scale_2",
            1.0 / 1.28,
            "L1.attn.q_a",
            "L1.attn.q_norm",
        ),
        (
            Format::CtNvfp4,
            "layers.1.attn.wq_a.weight_global_scale",
            1.5,
            "L1.attn.kv",
            "L1.attn.kv_norm",
        ),
    ] {
        let base = synth(format, 0, &[]);
        let prod = with_producer_wo_b(base.path(), format);
        let d = rewrite(prod.path(), |n, s, b| {
            if n == tensor {
                let v = f32_of(b) * factor;
                set_f32(b, v);
            }
            Some(s.to_vec())
        });
        let r = bisect_dir(d.path(), 0);
        let text = show(&r);
        // one absorbed divergence at the shard that lost the merge, named by its norm
        let div: Vec<_> = r
            .findings
            .iter()
            .filter(|f| f.source == Source::Divergence)
            .collect();
        assert_eq!(div.len(), 1, "{format:?}:\n{text}");
        let f = div[0];
        assert_eq!(f.ops, vec![op.to_string()], "{text}");
        assert_eq!(f.impact, Impact::Absorbed, "{text}");
        assert_eq!(f.level, Level::Warning);
        assert_eq!(f.absorbed_by, vec![norm.to_string()], "{text}");
        assert!(f.why.contains("RMSNorm"), "{}", f.why);
        // the parameter: the shard's own stored scale restores it; the merged one is the sibling's
        let own = if format == Format::ModelOptNvfp4 {
            scalar(d.path(), tensor)
        } else {
            1.0 / scalar(d.path(), "layers.1.attn.wkv.weight_global_scale")
        };
        let merged = if format == Format::ModelOptNvfp4 {
            scalar(d.path(), "layers.1.attn.wkv.weight_scale_2")
        } else {
            1.0 / scalar(d.path(), tensor)
        };
        let v = &f.values[0];
        assert_eq!(v.corrected, Some(own), "{text}");
        assert_eq!(v.current, Some(merged), "{text}");
        assert_eq!(f.kind.as_deref(), Some("weight-own-shard"));
        // a pure magnitude error: the cosine does not move, the rel-L2 does
        let (b, a) = (&v.before, v.after.as_ref().unwrap());
        assert!((b.cos.unwrap() - a.cos.unwrap()).abs() < 1e-3, "{text}");
        assert!(a.rel_l2.unwrap() < b.rel_l2.unwrap() / 2.0, "{text}");
        // the lint finding of the pair is a warning absorbed by the same norm
        assert!(
            r.findings.iter().any(|f| f.source == Source::Lint
                && f.impact == Impact::Absorbed
                && f.absorbed_by == vec![norm.to_string()]),
            "{text}"
        );
        assert!(
            r.findings.iter().all(|f| f.level == Level::Warning),
            "{text}"
        );

        // the commands: exit 0 with the warning; --strict exit 1
        for cmd in [["run", "--quiet"], ["bisect", "--search"]] {
            let mut args: Vec<&str> = cmd.to_vec();
            if cmd[0] == "bisect" {
                args.push("linear");
            }
            args.extend(["--seq-len", "32", "--backend", "cpu"]);
            let (code, out) = cli(&args, d.path());
            assert_eq!(code, 0, "{args:?}:\n{out}");
            assert!(out.contains("warning [absorbed]"), "{out}");
            assert!(out.contains(&format!("absorbed by {norm}")), "{out}");
            args.push("--strict");
            let (code, out) = cli(&args, d.path());
            assert_eq!(code, 1, "{args:?}:\n{out}");
        }
        let (code, out) = cli(&["lint"], d.path());
        assert_eq!(code, 0, "{out}");
        assert!(out.contains("fused.mismatch"), "{out}");
        let (code, _) = cli(&["lint", "--strict"], d.path());
        assert_eq!(code, 1);
    }
}

/// The absorbed pair plus two planted faults later in the model: a zero activation scale on
/// layer 1's shared expert (its output turns NaN) and a denormal one on layer 4's q_a (the fused
/// max takes kv's healthy scale, so nothing diverges: lint names it). A finding for each, with the
/// right parameter, and exit 1; the absorbed one stays a warning.
#[test]
fn two_planted_faults_beside_an_absorbed_one_each_get_a_finding() {
    let base = synth(Format::ModelOptNvfp4, 0, &[]);
    let prod = with_producer_wo_b(base.path(), Format::ModelOptNvfp4);
    let d = rewrite(prod.path(), |n, s, b| {
        match n {
            "layers.1.attn.wq_a.weight_scale_2" => {
                let v = f32_of(b) / 1.28;
                set_f32(b, v)
            }
            "layers.1.ffn.shared_experts.w1.input_scale"
            | "layers.1.ffn.shared_experts.w3.input_scale"
            | "layers.1.ffn.shared_experts.w2.input_scale" => set_f32(b, 0.0),
            "layers.4.attn.wq_a.input_scale" => set_f32(b, 1e-40),
            _ => {}
        }
        Some(s.to_vec())
    });
    let r = bisect_dir(d.path(), 0);
    let text = show(&r);
    assert!(r.has_findings(), "{text}");
    // the shared expert: harmful, its activation scale, restored by the calibrated value
    let shared = r
        .findings
        .iter()
        .find(|f| f.source == Source::Divergence && f.ops == vec!["L1.ffn.shared".to_string()])
        .unwrap_or_else(|| panic!("no finding at L1.ffn.shared:\n{text}"));
    assert_eq!(shared.impact, Impact::Harmful, "{text}");
    assert_eq!(shared.level, Level::Error);
    assert!(
        shared
            .tensors
            .iter()
            .any(|t| t.starts_with("layers.1.ffn.shared_experts.") && t.ends_with(".input_scale")),
        "{text}"
    );
    assert!(
        shared.parameter.as_deref().unwrap_or("").contains("input"),
        "{text}"
    );
    let v = &shared.values[0];
    assert_eq!(v.current, Some(f32::INFINITY), "{text}");
    assert!(
        v.corrected.is_some_and(|c| c.is_finite() && c > 0.0),
        "{text}"
    );
    let after = v.after.as_ref().unwrap();
    assert!(after.rel_l2.is_some_and(|e| e < 0.5), "{text}");
    // layer 4's q_a: the lint error names the denormal scale
    assert!(
        r.findings.iter().any(|f| f.source == Source::Lint
            && f.level == Level::Error
            && f.kind.as_deref() == Some("scale.global.denormal")
            && f.tensors == vec!["layers.4.attn.wq_a.input_scale".to_string()]
            && f.ops == vec!["L4.attn.q_a".to_string()]),
        "{text}"
    );
    // the absorbed pair is still there, a warning
    assert!(
        r.findings.iter().any(|f| f.source == Source::Divergence
            && f.ops == vec!["L1.attn.q_a".to_string()]
            && f.level == Level::Warning),
        "{text}"
    );
    // errors before warnings
    let first_warning = r.findings.iter().position(|f| f.level == Level::Warning);
    let last_error = r.findings.iter().rposition(|f| f.level == Level::Error);
    assert!(last_error < first_warning, "{text}");
    for cmd in ["run", "bisect"] {
        let (code, out) = cli(&[cmd, "--seq-len", "32", "--backend", "cpu"], d.path());
        assert_eq!(code, 1, "{cmd}:\n{out}");
        for t in [
            "layers.4.attn.wq_a.input_scale",
            "layers.1.ffn.shared_experts.w1.input_scale",
        ] {
            assert!(out.contains(t), "{cmd} does not name {t}:\n{out}");
        }
    }
}

/// Three faults in three layers at once, each attributed on its own, in both producers'
/// checkpoints: layer 1's shared expert with zero activation scales, layer 2's wo_b (the
/// producer's bytes) with its activation scale inverted, layer 3's routed experts with their
/// activation scales calibrated 64× too small.
#[test]
fn three_faults_in_three_layers_are_each_attributed() {
    for format in [Format::CtNvfp4, Format::ModelOptNvfp4] {
        let base = synth(
            format,
            1,
            &[
                "zero-input-scale@L1.ffn.shared",
                "inverted-input-scale@L2.attn.wo_b",
                "input-amax-x64@L3.ffn.experts",
            ],
        );
        let d = with_producer_wo_b(base.path(), format);
        let r = bisect_dir(d.path(), 1);
        let text = show(&r);
        for op in ["L1.ffn.shared", "L2.attn.wo_b", "L3.ffn.experts"] {
            let f = r
                .findings
                .iter()
                .find(|f| f.source == Source::Divergence && f.ops.iter().any(|o| o == op))
                .unwrap_or_else(|| panic!("{format:?}: no finding at {op}:\n{text}"));
            assert_eq!(f.level, Level::Error, "{op}:\n{text}");
            assert_eq!(f.impact, Impact::Harmful, "{op}:\n{text}");
            let kind = f
                .kind
                .as_deref()
                .unwrap_or_else(|| panic!("{format:?} {op} unexplained:\n{text}"));
            assert!(
                kind.starts_with("input-"),
                "{format:?} {op}: {kind}\n{text}"
            );
            assert!(
                f.tensors.iter().all(|t| t.contains("input")),
                "{op}: {:?}",
                f.tensors
            );
            let v = f.values.iter().find(|v| v.op == op).unwrap();
            let (b, a) = (&v.before, v.after.as_ref().unwrap());
            assert!(
                a.rel_l2.unwrap() < b.rel_l2.unwrap_or(f64::INFINITY),
                "{op}: {text}"
            );
        }
        // wo_b's inverted scale: the corrected value is the reciprocal of the one in use, and
        // the stored tensor is the one named
        let wo = r
            .findings
            .iter()
            .find(|f| f.ops.iter().any(|o| o == "L2.attn.wo_b"))
            .unwrap();
        assert_eq!(wo.kind.as_deref(), Some("input-reciprocal"), "{text}");
        let v = &wo.values[0];
        let (c, k) = (v.current.unwrap() as f64, v.corrected.unwrap() as f64);
        assert!((c * k - 1.0).abs() < 1e-5, "{c} · {k}");
        // each op's verdict counted once, and no other op diverges
        let ops: Vec<&String> = r
            .findings
            .iter()
            .filter(|f| f.source == Source::Divergence)
            .flat_map(|f| f.ops.iter())
            .collect();
        assert_eq!(ops.len(), 3, "{format:?}:\n{text}");
        assert_eq!(r.divergences.len(), 3);
        // the cost: every op searched once (three ops, no capture pass: the run kept their inputs)
        assert!(r.search.phases.iter().all(|p| p.name != "capture"));
        assert!(r.divergences.iter().all(|d| d.evals > 0));
    }
}

/// The same fault in several layers is one finding (one root cause), each op with its own values;
/// after the first op, the known verdict is tried first and the rest is not evaluated.
#[test]
fn the_same_fault_in_several_layers_is_one_finding() {
    let base = synth(
        Format::CtNvfp4,
        2,
        &[
            "inverted-input-scale@L1.attn.wo_b",
            "inverted-input-scale@L3.attn.wo_b",
        ],
    );
    let d = with_producer_wo_b(base.path(), Format::CtNvfp4);
    let r = bisect_dir(d.path(), 2);
    let text = show(&r);
    let f: Vec<_> = r
        .findings
        .iter()
        .filter(|f| f.source == Source::Divergence)
        .collect();
    assert_eq!(f.len(), 1, "{text}");
    assert_eq!(
        f[0].ops,
        vec!["L1.attn.wo_b".to_string(), "L3.attn.wo_b".to_string()]
    );
    assert_eq!(f[0].values.len(), 2);
    assert!(f[0].summary.starts_with("2 ops, one root cause"), "{text}");
    let (first, second) = (&r.divergences[0], &r.divergences[1]);
    assert!(second.note.is_some(), "{:?}", second.note);
    assert!(
        second.evals < first.evals,
        "{} vs {}",
        second.evals,
        first.evals
    );
}

/// The gate follows the run: a divergence absorbed downstream passes against a clean baseline
/// (its own comparisons are a warning of the run), `strict = true` in the tolerances file fails
/// it naming the op; a harmful one fails either way.
#[test]
fn gate_passes_an_absorbed_divergence_unless_strict() {
    let dir = tempfile::tempdir().unwrap();
    let base = synth(Format::ModelOptNvfp4, 0, &[]);
    let clean = with_producer_wo_b(base.path(), Format::ModelOptNvfp4);
    let absorbed = rewrite(clean.path(), |n, s, b| {
        if n == "layers.1.attn.wq_a.weight_scale_2" {
            let v = f32_of(b) / 1.28;
            set_f32(b, v);
        }
        Some(s.to_vec())
    });
    let harmful = rewrite(clean.path(), |n, s, b| {
        if n == "layers.1.attn.wo_b.input_scale" {
            let v = 1.0 / f32_of(b);
            set_f32(b, v);
        }
        Some(s.to_vec())
    });
    let json = |d: &Path, name: &str| {
        let p = dir.path().join(name);
        let (code, out) = cli(
            &[
                "run",
                "--quiet",
                "--seq-len",
                "32",
                "--backend",
                "cpu",
                "--json",
                p.to_str().unwrap(),
            ],
            d,
        );
        assert!(code == 0 || code == 1, "{out}");
        p
    };
    let (b, a, h) = (
        json(clean.path(), "base.json"),
        json(absorbed.path(), "absorbed.json"),
        json(harmful.path(), "harmful.json"),
    );
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&a).unwrap()).unwrap();
    let qa = v["ops"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["id"] == "L1.attn.q_a")
        .unwrap();
    assert_eq!(qa["divergent"], true);
    assert_eq!(qa["consequence"]["severity"], "absorbed");
    assert_eq!(qa["consequence"]["absorbed_by"][0], "L1.attn.q_norm");
    assert_eq!(v["summary"]["absorbed_ops"], 1);
    let strict = dir.path().join("strict.toml");
    std::fs::write(&strict, "strict = true\n").unwrap();
    let gate = |cur: &Path, tol: Option<&Path>| -> (i32, String) {
        let mut c = std::process::Command::new(assert_cmd::cargo::cargo_bin("nvfp4-probe"));
        c.args(["gate", "--baseline"])
            .arg(&b)
            .arg("--current")
            .arg(cur);
        if let Some(t) = tol {
            c.arg("--tolerances").arg(t);
        }
        let o = c.output().unwrap();
        (
            o.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&o.stdout).into_owned(),
        )
    };
    let (code, out) = gate(&a, None);
    assert_eq!(code, 0, "{out}");
    let (code, out) = gate(&a, Some(&strict));
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("L1.attn.q_a"), "{out}");
    let (code, out) = gate(&h, None);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("L1.attn.wo_b"), "{out}");
}
