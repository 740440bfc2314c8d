//! `compare` on traces built from the oracle itself (hf-tiny, BF16 checkpoint made by transformers), written
//! under engine names, with planted corruptions: each must be found at the right op, and clean traces pass.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use assert_cmd::Command;
use nvfp4_probe::checkpoint::Checkpoint;
use nvfp4_probe::cli::{CompareArgs, TokenArgs};
use nvfp4_probe::commands::compare::{compare, CompareReport};
use nvfp4_probe::probe::{run, RunOptions};
use nvfp4_probe::trace::read::{write, WriteDtype};
use nvfp4_probe::Tensor;

const T: usize = 40;

fn model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf-tiny")
}

fn tokens() -> Vec<u32> {
    let all: Vec<u32> =
        serde_json::from_str(&std::fs::read_to_string(model().join("tokens-300.json")).unwrap())
            .unwrap();
    all[..T].to_vec()
}

/// The oracle's outputs on layers 0..=2: (fp32, bf16) by op id.
fn oracle() -> (HashMap<String, Tensor>, HashMap<String, Tensor>) {
    let ckpt = Checkpoint::open(&model()).unwrap();
    let res = run(
        &ckpt,
        &RunOptions {
            keep_outputs: true,
            ..RunOptions::new((0, 2), tokens())
        },
    )
    .unwrap();
    let m = |p: &str| res.outputs[p].iter().cloned().collect::<HashMap<_, _>>();
    (m("oracle_fp32"), m("oracle_bf16"))
}

/// Official module names of the ops the tests dump, layers 0..=2.
fn official(l: usize) -> Vec<(String, String)> {
    [
        ("hc_attn", "attn.hc_pre"),
        ("hc_attn:post", "attn.hc_pre.post"),
        ("hc_attn:comb", "attn.hc_pre.comb"),
        ("attn_norm", "attn.norm"),
        ("attn.wq_a", "attn.q_a"),
        ("attn.wkv", "attn.kv"),
        ("attn.q_norm", "attn.q_norm"),
        ("attn.kv_norm", "attn.kv_norm"),
        ("attn.wq_b", "attn.q_b"),
        ("attn.wo_a:input", "attn.core"),
        ("attn.wo_a", "attn.wo_a"),
        ("attn.wo_b", "attn.wo_b"),
        ("hc_ffn:input", "attn.hc_post"),
        ("hc_ffn", "ffn.hc_pre"),
        ("ffn_norm", "ffn.norm"),
        ("ffn.gate", "ffn.router"),
        ("ffn.gate:idx", "ffn.router.idx"),
        ("ffn.experts", "ffn.experts"),
        ("ffn.shared_experts", "ffn.shared"),
        ("ffn", "ffn.out"),
        ("", "out"),
    ]
    .iter()
    .map(|(n, o)| {
        let name = if n.is_empty() {
            format!("layers.{l}")
        } else {
            format!("layers.{l}.{n}")
        };
        (name, format!("L{l}.{o}"))
    })
    .collect()
}

fn official_trace(src: &HashMap<String, Tensor>) -> Vec<(String, Tensor)> {
    let mut v = vec![("embed".to_string(), src["embed"].clone())];
    for l in 0..=2 {
        for (name, op) in official(l) {
            v.push((name, src[&op].clone()));
        }
    }
    v
}

fn args(trace: &Path, names: &str) -> CompareArgs {
    CompareArgs {
        model: Some(model()),
        trace: trace.to_path_buf(),
        names: names.into(),
        tokens: TokenArgs::default(),
        json: None,
        markdown: None,
        seed: 0,
        mem: Default::default(),
    }
}

fn find<'a>(r: &'a CompareReport, op: &str) -> &'a nvfp4_probe::trace::compare::OpCompare {
    r.ops
        .iter()
        .find(|o| o.op == op)
        .unwrap_or_else(|| panic!("{op} not compared"))
}

/// Column-split a [T, W] tensor into `n` rank pieces.
fn columns(t: &Tensor, n: usize) -> Vec<Tensor> {
    let (r, w) = (t.shape[0], t.numel() / t.shape[0]);
    (0..n)
        .map(|k| {
            let c = w / n;
            let data: Vec<f32> = (0..r)
                .flat_map(|i| t.data[i * w + k * c..i * w + (k + 1) * c].iter().copied())
                .collect();
            Tensor::new(vec![r, c], data)
        })
        .collect()
}

#[test]
fn clean_bf16_trace_passes_and_fp32_trace_too() {
    let (fp, bf) = oracle();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bf16.safetensors");
    write(
        &p,
        &official_trace(&bf),
        WriteDtype::Bf16,
        Some(&tokens()),
        &[],
    )
    .unwrap();
    let r = compare(&args(&p, "official")).unwrap();
    assert_eq!(r.summary.first_divergent, None, "{:?}", r.summary);
    assert!(r.ops.len() >= 60, "{} ops", r.ops.len());
    assert_eq!(r.ops[0].dtype, "BF16");
    // an FP32 engine dump (the FP32 oracle's values) is clean too
    let p = dir.path().join("fp32.safetensors");
    write(
        &p,
        &official_trace(&fp),
        WriteDtype::F32,
        Some(&tokens()),
        &[],
    )
    .unwrap();
    let r = compare(&args(&p, "official")).unwrap();
    assert_eq!(r.summary.first_divergent, None, "{:?}", r.summary);
    assert!(find(&r, "L2.out").vs_fp32.rel_l2.unwrap() < 1e-6);
}

#[test]
fn nan_at_one_op_is_found_there() {
    let (_, bf) = oracle();
    let mut tr = official_trace(&bf);
    let (_, t) = tr
        .iter_mut()
        .find(|(n, _)| n == "layers.1.attn.wq_b")
        .unwrap();
    let c = t.cols();
    t.data[7 * c + 3] = f32::NAN;
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.safetensors");
    write(&p, &tr, WriteDtype::Bf16, Some(&tokens()), &[]).unwrap();
    let r = compare(&args(&p, "official")).unwrap();
    assert_eq!(r.summary.first_divergent.as_deref(), Some("L1.attn.q_b"));
    assert_eq!(find(&r, "L1.attn.q_b").verdict, "non-finite");
    assert_eq!(r.summary.divergent, 1);
}

/// Two ranks: q_b and the attention core column-split (rank 1's q_b with 2 padded zero heads), wo_a
/// column-split, MoE outputs as partial sums, everything else replicated.
fn tp_files(bf: &HashMap<String, Tensor>, dir: &Path, scale_rank1_q_b_of: Option<usize>) {
    let mut ranks: Vec<Vec<(String, Tensor)>> = vec![Vec::new(), Vec::new()];
    for (name, t) in official_trace(bf) {
        let col = ["attn.wq_b", "attn.wo_a:input", "attn.wo_a"]
            .iter()
            .any(|s| name.ends_with(s));
        let sum = name.ends_with("ffn.experts") || name.ends_with("ffn.shared_experts");
        if col {
            let mut parts = columns(&t, 2);
            if name.ends_with("attn.wq_b") {
                if scale_rank1_q_b_of.is_some_and(|l| name == format!("layers.{l}.attn.wq_b")) {
                    parts[1].data.iter_mut().for_each(|v| *v *= 2.0);
                }
                // pad rank 1 to 3 heads of 512 (1 real), as FlashMLA-style padding does
                let p = &parts[1];
                let w = p.cols();
                let data: Vec<f32> = (0..p.rows())
                    .flat_map(|i| {
                        p.data[i * w..(i + 1) * w]
                            .iter()
                            .copied()
                            .chain(std::iter::repeat_n(0.0, 2 * 512))
                    })
                    .collect();
                parts[1] = Tensor::new(vec![p.rows(), 3, 512], data);
            }
            for (k, p) in parts.into_iter().enumerate() {
                ranks[k].push((name.clone(), p));
            }
        } else if sum {
            // partial sums whose total is the BF16 value
            let a: Vec<f32> = t.data.iter().map(|v| (v * 0.25).round()).collect();
            let b: Vec<f32> = t.data.iter().zip(&a).map(|(v, x)| v - x).collect();
            ranks[0].push((name.clone(), Tensor::new(t.shape.clone(), a)));
            ranks[1].push((name.clone(), Tensor::new(t.shape.clone(), b)));
        } else {
            ranks[0].push((name.clone(), t.clone()));
            ranks[1].push((name, t));
        }
    }
    for (k, ts) in ranks.iter().enumerate() {
        write(
            &dir.join(format!("dump-tp{k}.safetensors")),
            ts,
            WriteDtype::F32,
            Some(&tokens()),
            &[],
        )
        .unwrap();
    }
}

#[test]
fn tp_sharded_files_join_clean() {
    let (_, bf) = oracle();
    let dir = tempfile::tempdir().unwrap();
    tp_files(&bf, dir.path(), None);
    let r = compare(&args(dir.path(), "official")).unwrap();
    assert_eq!(r.trace.ranks, 2);
    assert_eq!(r.summary.first_divergent, None, "{:?}", r.summary);
    let qb = find(&r, "L1.attn.q_b");
    assert!(qb.vs_bf16.rel_l2.unwrap() < 1e-6, "{:?}", qb.vs_bf16);
    assert!(qb.notes.iter().any(|n| n.contains("padded heads")));
    assert!(find(&r, "L2.ffn.experts").vs_bf16.rel_l2.unwrap() < 1e-6);
}

#[test]
fn scaled_tp_shard_is_found_at_its_op() {
    let (_, bf) = oracle();
    let dir = tempfile::tempdir().unwrap();
    tp_files(&bf, dir.path(), Some(1));
    let r = compare(&args(dir.path(), "official")).unwrap();
    assert_eq!(r.summary.first_divergent.as_deref(), Some("L1.attn.q_b"));
    assert_eq!(r.summary.divergent, 1, "{:?}", r.summary);
}

#[test]
fn split_residual_left_unrecombined_is_found_and_vllm_split_is_recombined() {
    let (_, bf) = oracle();
    let dir = tempfile::tempdir().unwrap();
    // an engine that keeps the residual split, dumped under the layer-output name: X₁ where X₂ belongs
    let mut tr = official_trace(&bf);
    for (n, t) in tr.iter_mut() {
        if n == "layers.1" {
            *t = bf["L1.attn.hc_post"].clone();
        }
    }
    let p = dir.path().join("split.safetensors");
    write(&p, &tr, WriteDtype::Bf16, Some(&tokens()), &[]).unwrap();
    let r = compare(&args(&p, "official")).unwrap();
    assert_eq!(r.summary.first_divergent.as_deref(), Some("L1.out"));
    assert!(r
        .summary
        .first_divergent_hint
        .as_deref()
        .unwrap_or("")
        .contains("split"));

    // vLLM's layer tuple (y₂, X₁, post_f, C_f), fused wq_a+wkv: recombined into L*.out, clean
    let mut v = vec![("model.embed_tokens".to_string(), bf["embed"].clone())];
    for l in 0..=2 {
        let s = |o: &str| bf[&format!("L{l}.{o}")].clone();
        let (qa, kv) = (s("attn.q_a"), s("attn.kv"));
        let (w1, w2) = (qa.cols(), kv.cols());
        let fused: Vec<f32> = (0..T)
            .flat_map(|i| {
                qa.data[i * w1..(i + 1) * w1]
                    .iter()
                    .chain(&kv.data[i * w2..(i + 1) * w2])
                    .copied()
            })
            .collect();
        let pre = format!("model.layers.{l}");
        v.push((
            format!("{pre}.attn.fused_wqa_wkv"),
            Tensor::new(vec![T, w1 + w2], fused),
        ));
        v.push((format!("{pre}.attn.wq_b"), s("attn.q_b")));
        v.push((format!("{pre}.ffn.norm_gate"), s("ffn.norm")));
        v.push((pre.clone(), s("ffn.out")));
        v.push((format!("{pre}:residual"), s("attn.hc_post")));
        v.push((format!("{pre}:post"), s("ffn.hc_pre.post")));
        v.push((format!("{pre}:comb"), s("ffn.hc_pre.comb")));
        v.push((format!("{pre}.attn.rotary_emb"), s("attn.q_a")));
    }
    let p = dir.path().join("vllm.safetensors");
    write(&p, &v, WriteDtype::F32, Some(&tokens()), &[]).unwrap();
    let r = compare(&args(&p, "vllm")).unwrap();
    assert_eq!(r.summary.first_divergent, None, "{:?}", r.summary);
    let out = find(&r, "L1.out");
    assert!(out.trace_name.starts_with("recombined("));
    // recombined in f32 from BF16 inputs: within BF16 rounding of the oracle's own output
    assert!(out.vs_bf16.rel_l2.unwrap() < 4e-3, "{:?}", out.vs_bf16);
    assert!(find(&r, "L2.attn.kv").vs_bf16.rel_l2.unwrap() == 0.0);
    assert!(find(&r, "L2.attn.q_a").vs_bf16.rel_l2.unwrap() == 0.0);
    assert_eq!(r.summary.unmapped.len(), 3);

    // the same split residual, stream 1 of X₁ corrupted: found at the recombined output
    let (_, t) = v
        .iter_mut()
        .find(|(n, _)| n == "model.layers.1:residual")
        .unwrap();
    let d = 128;
    for i in 0..T {
        t.data[i * 4 * d + d..i * 4 * d + 2 * d]
            .iter_mut()
            .for_each(|x| *x *= 3.0);
    }
    let p = dir.path().join("vllm-bad.safetensors");
    write(&p, &v, WriteDtype::F32, Some(&tokens()), &[]).unwrap();
    let r = compare(&args(&p, "vllm")).unwrap();
    assert_eq!(
        r.summary.first_divergent.as_deref(),
        Some("L1.attn.hc_post")
    );
    // the recombined output carries the error too (diluted by the mHC mixing weights)
    assert!(find(&r, "L1.out").vs_bf16.rel_l2.unwrap() > 4e-3);
}

#[test]
fn padded_batch_rows_metadata_and_user_map() {
    let (_, bf) = oracle();
    let dir = tempfile::tempdir().unwrap();
    // engine padded the batch to 48 rows (garbage past T); num_tokens says 40
    let mut ids = tokens();
    ids.extend([0u32; 8]);
    let pad = |t: &Tensor| {
        let w = t.numel() / t.shape[0];
        let mut d = t.data.clone();
        d.extend(std::iter::repeat_n(f32::NAN, 8 * w));
        let mut s = t.shape.clone();
        s[0] += 8;
        Tensor::new(s, d)
    };
    let tr = vec![
        ("eng.l0.qkv_a".to_string(), {
            let (qa, kv) = (&bf["L0.attn.q_a"], &bf["L0.attn.kv"]);
            let (w1, w2) = (qa.cols(), kv.cols());
            let d: Vec<f32> = (0..T)
                .flat_map(|i| {
                    qa.data[i * w1..(i + 1) * w1]
                        .iter()
                        .chain(&kv.data[i * w2..(i + 1) * w2])
                        .copied()
                })
                .collect();
            pad(&Tensor::new(vec![T, w1 + w2], d))
        }),
        ("eng.l0.q_up".to_string(), pad(&bf["L0.attn.q_b"])),
    ];
    let p = dir.path().join("padded.safetensors");
    write(
        &p,
        &tr,
        WriteDtype::Bf16,
        Some(&ids),
        &[("num_tokens", "40".into())],
    )
    .unwrap();
    let map = dir.path().join("map.toml");
    std::fs::write(
        &map,
        r#"[map]
"eng.l0.qkv_a" = [ { op = "L0.attn.q_a", split = { dim = -1, start = 0, len = 64 } },
                   { op = "L0.attn.kv", split = { dim = -1, start = 64, len = 512 } } ]
"eng.l0.q_up" = { op = "L0.attn.q_b", concat_dim = -1 }
"#,
    )
    .unwrap();
    let r = compare(&args(&p, map.to_str().unwrap())).unwrap();
    assert_eq!(r.summary.first_divergent, None, "{:?}", r.summary);
    assert_eq!(r.ops.len(), 3);
    assert!(r
        .ops
        .iter()
        .all(|o| o.rows == T && o.vs_bf16.rel_l2 == Some(0.0)));

    // rows metadata: only token rows 3, 17, 39 kept
    let keep = [3usize, 17, 39];
    let sub = |t: &Tensor| {
        let w = t.cols();
        Tensor::new(
            vec![keep.len(), w],
            keep.iter()
                .flat_map(|&r| t.data[r * w..(r + 1) * w].iter().copied())
                .collect::<Vec<f32>>(),
        )
    };
    let mut q = sub(&bf["L0.attn.q_b"]);
    let p = dir.path().join("rows.safetensors");
    write(
        &p,
        &[("layers.0.attn.wq_b".into(), q.clone())],
        WriteDtype::F32,
        Some(&tokens()),
        &[("rows", "3,17,39".into())],
    )
    .unwrap();
    let r = compare(&args(&p, "official")).unwrap();
    assert_eq!(r.summary.first_divergent, None);
    assert_eq!(r.ops[0].rows, 3);
    // the same rows labelled as the wrong rows diverge
    let c = q.cols();
    q.data.rotate_left(c);
    write(
        &p,
        &[("layers.0.attn.wq_b".into(), q)],
        WriteDtype::F32,
        Some(&tokens()),
        &[("rows", "3,17,39".into())],
    )
    .unwrap();
    let r = compare(&args(&p, "official")).unwrap();
    assert_eq!(r.summary.first_divergent.as_deref(), Some("L0.attn.q_b"));
}

#[test]
fn cli_exit_codes() {
    let (_, bf) = oracle();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.safetensors");
    write(
        &p,
        &official_trace(&bf),
        WriteDtype::Bf16,
        Some(&tokens()),
        &[],
    )
    .unwrap();
    let bin = || Command::cargo_bin("nvfp4-probe").unwrap();
    let json = dir.path().join("c.json");
    bin()
        .args(["compare", "--model"])
        .arg(model())
        .arg("--trace")
        .arg(&p)
        .arg("--json")
        .arg(&json)
        .assert()
        .code(0);
    let j: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(j["schema"], "nvfp4-probe.compare/1");
    assert!(j["summary"]["first_divergent"].is_null());
    // token options that differ from the trace's input_ids: unusable
    bin()
        .args(["compare", "--model"])
        .arg(model())
        .arg("--trace")
        .arg(&p)
        .args(["--token-ids", "1,2,3"])
        .assert()
        .code(2)
        .stderr(predicates::str::contains("input_ids"));
    // a shape that cannot be reconciled: names the file and the tensor
    let bad = dir.path().join("bad.safetensors");
    write(
        &bad,
        &[(
            "layers.0.attn.wq_a".into(),
            Tensor::new(vec![T, 7], vec![1.0; T * 7]),
        )],
        WriteDtype::F32,
        Some(&tokens()),
        &[],
    )
    .unwrap();
    bin()
        .args(["compare", "--model"])
        .arg(model())
        .arg("--trace")
        .arg(&bad)
        .assert()
        .code(2)
        .stderr(predicates::str::contains("bad.safetensors"))
        .stderr(predicates::str::contains("layers.0.attn.wq_a"));
    // a divergent trace exits 1
    let mut tr = official_trace(&bf);
    tr.iter_mut()
        .find(|(n, _)| n == "layers.2.ffn.shared_experts")
        .unwrap()
        .1
        .data
        .iter_mut()
        .for_each(|v| *v *= -1.0);
    write(&p, &tr, WriteDtype::Bf16, Some(&tokens()), &[]).unwrap();
    bin()
        .args(["compare", "--model"])
        .arg(model())
        .arg("--trace")
        .arg(&p)
        .assert()
        .code(1)
        .stdout(predicates::str::contains(
            "first divergent op: L2.ffn.shared",
        ));
}

#[test]
fn hf_trace_compares_clean_at_every_mapped_op() {
    let trace = model().join("trace-300.safetensors");
    let r = compare(&args(&trace, "hf")).unwrap();
    assert_eq!(r.summary.first_divergent, None, "{:?}", r.summary);
    assert!(r.ops.len() > 100, "{} ops", r.ops.len());
    for o in &r.ops {
        if o.agreement.is_none() {
            // an FP32 engine: within 1e-5 of the FP32 oracle, far inside the BF16 tolerance
            assert!(
                o.vs_fp32.rel_l2.unwrap() < 1e-5,
                "{}: {:?}",
                o.op,
                o.vs_fp32
            );
        }
    }
    assert!(r
        .summary
        .unmapped
        .iter()
        .all(|n| !n.starts_with("input_ids")));
}
