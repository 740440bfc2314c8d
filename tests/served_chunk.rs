//! `--served-chunk N`: the served path prefilled as an engine's chunked prefill does
//! (`probe::prefill`), and `--engine-fault` at its chunk boundaries.
//! - A healthy chunked prefill diverges nowhere; the served attention reads the earlier chunks'
//!   keys from the FP8 KV cache (checked against a naive attention written here from the spec,
//!   with the cache's rounding from `numerics::fp8_block`'s test-vector-checked quantizer), the
//!   indexer scores earlier chunks' keys from its FP8 cache, the compressors carry their state
//!   exactly (their records equal the unchunked run's), and one chunk as long as the prompt is
//!   the unchunked run.
//! - Each engine fault diverges at the op after a boundary, and bisect attributes it to the state
//!   carried across the chunks (`prefill-chunk-state`) at the right layer.
//! - With `--chunk` (the run's own token chunks, cut elsewhere) every record is the same.
//! - Bad flags exit 2.

use assert_cmd::Command;
use nvfp4_probe::model::build_graph;
use nvfp4_probe::numerics::bf16;
use nvfp4_probe::numerics::fp8_block::{fake_quant_kv_cache, KV_GROUP};
use nvfp4_probe::probe::{run, synthetic_tokens, RunOptions, RunResult};
use nvfp4_probe::served::engine::{EngineFault, Prefill};
use serde_json::Value;

fn bin() -> Command {
    Command::cargo_bin("nvfp4-probe").unwrap()
}

fn run_opts(t: usize, prefill: Option<Prefill>, chunk: Option<usize>, keep: bool) -> RunResult {
    let ck = nvfp4_probe::synth::builtin(0).expect("built-in model");
    let cfg = ck.model_config().expect("config").clone();
    let opts = RunOptions {
        keep_outputs: keep,
        prefill,
        chunk,
        ..RunOptions::new((0, 4), synthetic_tokens(t, cfg.vocab_size, 5))
    };
    run(&ck, &opts).expect("run")
}

fn prefill(n: usize, faults: &[&str]) -> Option<Prefill> {
    let f = faults
        .iter()
        .map(|s| EngineFault::parse(s).unwrap())
        .collect();
    Some(Prefill::new(n, f).unwrap())
}

fn records(r: &RunResult) -> Vec<Value> {
    serde_json::to_value(&r.records)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

fn rec<'a>(recs: &'a [Value], id: &str) -> &'a Value {
    recs.iter().find(|r| r["id"] == id).expect(id)
}

/// The records without what a run in token chunks does not follow (a divergent op's consumers).
fn without_consequence(mut v: Vec<Value>) -> Vec<Value> {
    for r in &mut v {
        r.as_object_mut().unwrap().remove("consequence");
    }
    v
}

#[test]
fn a_healthy_chunked_prefill_diverges_nowhere_and_only_the_attention_changes() {
    let whole = run_opts(300, None, None, false);
    let sc = run_opts(300, prefill(64, &[]), None, false);
    assert!(sc.records.iter().all(|r| !r.divergent), "no divergent op");
    let (w, s) = (records(&whole), records(&sc));
    for l in 0..5 {
        // the attention reads the earlier chunks' keys from the FP8 cache: its served numerics
        // change, within the cache's tolerance row
        let a = rec(&s, &format!("L{l}.attn.core"));
        let iso = a["served_isolated_vs_bf16"]["rel_l2"].as_f64().unwrap();
        assert!(iso > 1e-3, "L{l} attention: iso {iso}");
        assert!(
            a["tolerance_basis"]
                .as_str()
                .unwrap()
                .contains("fp8-kv-cache"),
            "{}",
            a["tolerance_basis"]
        );
        // the compressors carry their state exactly: fed the oracle's inputs (isolated), they
        // compute what they compute over the whole prompt
        let id = format!("L{l}.attn.compressor");
        if let Some(x) = s.iter().find(|r| r["id"] == id.as_str()) {
            let y = rec(&w, &id);
            let iso = "served_isolated_vs_bf16";
            assert_eq!(x[iso], y[iso], "{id}");
            let st = |r: &Value| r["stats"]["served_isolated"].clone();
            assert_eq!(st(x), st(y), "{id}");
        }
        // the indexer scores the earlier chunks' keys as its FP8 cache gives them back: some
        // near-tied choices change, most do not
        let id = format!("L{l}.attn.indexer");
        if let Some(x) = s.iter().find(|r| r["id"] == id.as_str()) {
            let (a, b) = (
                x["agreement"]["served_isolated"].as_f64().unwrap(),
                rec(&w, &id)["agreement"]["served_isolated"]
                    .as_f64()
                    .unwrap(),
            );
            assert!(a != b && a > 0.85, "{id}: agreement {a} chunked, {b} whole");
        }
    }
    // before the first attention every op is the unchunked run's
    let first = s.iter().position(|r| r["id"] == "L0.attn.core").unwrap();
    for (a, b) in s[..first].iter().zip(&w[..first]) {
        assert_eq!(a, b, "{}", b["id"]);
    }
    // one engine chunk as long as the prompt is the unchunked prefill
    let one = records(&run_opts(300, prefill(300, &[]), None, false));
    for (a, b) in one.iter().zip(&w) {
        assert_eq!(a, b, "one engine chunk: {}", b["id"]);
    }
}

/// The served attention of layer 0 (window only, 4 heads of 512, window 128 > T) under
/// `--served-chunk 16` over 40 tokens against a naive attention: for a query in chunk c the keys
/// of earlier chunks rounded as the FP8 cache stores them, its own chunk's keys as they are,
/// scores in f64, the sink, then BF16. Checked on the non-RoPE dims (the inverse RoPE leaves
/// them alone).
#[test]
fn the_attention_reads_earlier_chunks_keys_from_the_fp8_cache() {
    let (t, n) = (40usize, 16usize);
    let r = run_opts(t, prefill(n, &[]), None, true);
    let ck = nvfp4_probe::synth::builtin(0).expect("built-in model");
    let cfg = ck.model_config().expect("config").clone();
    let ops = build_graph(&cfg, 0, false);
    let core = ops.iter().find(|o| o.id == "L0.attn.core").unwrap();
    assert_eq!(cfg.ratio(0), 0, "layer 0 is window only");
    let served = &r.outputs["served"];
    let get = |id: &str| served.iter().find(|(i, _)| i == id).expect(id).1.clone();
    let (q, kv, out) = (
        get(&core.inputs[0]),
        get(&core.inputs[1]),
        get(&core.outputs[0]),
    );
    let (h, dh) = (cfg.num_attention_heads, cfg.head_dim);
    let nope = cfg.nope_dim();
    let sink = ck.tensor_f32("layers.0.attn.attn_sink").unwrap();
    let cached = fake_quant_kv_cache(&kv.data, t, dh, nope, KV_GROUP);
    let scale = (dh as f64).powf(-0.5);
    let (mut checked, mut off) = (0usize, 0usize);
    for ti in 0..t {
        let c0 = ti / n * n;
        let key = |j: usize| -> &[f32] {
            let src = if j < c0 { &cached } else { &kv.data };
            &src[j * dh..(j + 1) * dh]
        };
        for hh in 0..h {
            let qv = &q.data[ti * h * dh + hh * dh..ti * h * dh + (hh + 1) * dh];
            let lg: Vec<f64> = (0..=ti)
                .map(|j| {
                    qv.iter()
                        .zip(key(j))
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let s = sink.data[hh] as f64;
            let m = lg.iter().copied().fold(s, f64::max);
            let den: f64 = lg.iter().map(|l| (l - m).exp()).sum::<f64>() + (s - m).exp();
            for d in 0..nope {
                let v: f64 = (0..=ti)
                    .map(|j| (lg[j] - m).exp() * key(j)[d] as f64)
                    .sum::<f64>()
                    / den;
                let want = bf16::round(v as f32);
                let got = out.data[ti * h * dh + hh * dh + d];
                checked += 1;
                // one BF16 ulp for the order of the sums
                if (got - want).abs() > want.abs() * 2f32.powi(-7) + 1e-30 {
                    off += 1;
                }
            }
        }
    }
    assert_eq!(
        off, 0,
        "{off} of {checked} values off by more than one BF16 ulp"
    );
    assert!(
        kv.data != cached,
        "the cache's rounding changes the keys (else this test shows nothing)"
    );
}

#[test]
fn engine_faults_diverge_after_a_boundary_and_bisect_names_the_chunk_state() {
    // chunks of 100: every compressor has a block pending at 100 and 200 (ratio 16 and 4)
    let r = run_opts(
        300,
        prefill(100, &["compressor-state-lost@L3"]),
        None,
        false,
    );
    let div: Vec<&str> = r
        .records
        .iter()
        .filter(|x| x.divergent)
        .map(|x| x.id.as_str())
        .collect();
    assert_eq!(div, ["L3.attn.compressor"]);
    for (fault, op) in [
        ("compressor-state-lost@L3", "L3.attn.compressor"),
        ("window-context-zeroed@L2", "L2.attn.core"),
        ("rope-position-reset@L1", "L1.attn.q_rope"),
    ] {
        let d = tempfile::tempdir().unwrap();
        let jp = d.path().join("bisect.json");
        let out = bin()
            .args(["bisect", "--seq-len", "300", "--served-chunk", "100"])
            .args(["--engine-fault", fault, "--json"])
            .arg(&jp)
            .output()
            .unwrap();
        // exit 1, or 0 when the run measured the fault harmless at the model's output (the
        // only other proof of absorption besides a factor before an RMSNorm)
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.code() == Some(1)
                || (out.status.code() == Some(0)
                    && text.contains("measured at the model's output")),
            "{fault}: {:?}\n{text}",
            out.status.code()
        );
        let j: Value = serde_json::from_slice(&std::fs::read(&jp).unwrap()).unwrap();
        let v = &j["divergences"][0]["verdict"];
        assert_eq!(j["divergences"][0]["op"], op, "{fault}: {j}");
        assert_eq!(v["kind"], "prefill-chunk-state", "{fault}");
        assert_eq!(v["param"]["family"], "chunk-state", "{fault}");
        assert_eq!(j["meta"]["served_chunk"], 100);
        assert_eq!(j["meta"]["engine_faults"][0], fault);
    }
}

#[test]
fn the_runs_own_token_chunks_do_not_change_a_chunked_prefill() {
    let f = [
        "compressor-state-lost",
        "window-context-zeroed@L1",
        "rope-position-reset@L2",
    ];
    let base = without_consequence(records(&run_opts(300, prefill(64, &f), None, false)));
    for chunk in [50usize, 128] {
        let r = run_opts(300, prefill(64, &f), Some(chunk), false);
        assert_eq!(without_consequence(records(&r)), base, "--chunk {chunk}");
    }
}

#[test]
fn bad_prefill_flags_exit_2() {
    for (args, msg) in [
        (vec!["--served-chunk", "0"], "at least 1"),
        (
            vec!["--engine-fault", "compressor-state-lost"],
            "--served-chunk",
        ),
        (
            vec!["--served-chunk", "8", "--engine-fault", "stale"],
            "unknown kind",
        ),
        (
            vec![
                "--served-chunk",
                "8",
                "--engine-fault",
                "compressor-state-lost@L9",
            ],
            "layers",
        ),
    ] {
        let out = bin()
            .args(["run", "--seq-len", "16", "--quiet"])
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(msg), "{args:?}: {err}");
    }
}
