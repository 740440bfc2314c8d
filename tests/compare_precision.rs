//! `compare` at the trace's true precision, on transformers' own traces of `tests/data/hf-tiny`:
//! the BF16 (autocast) runs, stored as F32, compare clean at every mapped op and are held to BF16
//! noise; the F32 runs stay clean and are held to F32; one op of the BF16 trace scaled by 1.25 is
//! caught at that op first; a tensor of an impossible shape is skipped with the reason while the
//! rest is still compared; nothing comparable at all is exit 2.

use std::path::{Path, PathBuf};

use nvfp4_probe::cli::{CompareArgs, TokenArgs};
use nvfp4_probe::commands::compare::{compare, CompareReport};
use nvfp4_probe::trace::precision::Precision;

fn data(f: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/hf-tiny")
        .join(f)
}

fn args(trace: &Path) -> CompareArgs {
    CompareArgs {
        model: Some(data("")),
        trace: trace.to_path_buf(),
        names: "hf".into(),
        tokens: TokenArgs::default(),
        json: None,
        markdown: None,
        seed: 0,
        mem: Default::default(),
    }
}

/// The trace's tensors as stored: (name, dtype, shape, bytes), and its metadata.
type Raw = (
    Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>,
    Option<std::collections::HashMap<String, String>>,
);

fn read_raw(p: &Path) -> Raw {
    let buf = std::fs::read(p).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&buf).unwrap();
    let st = safetensors::SafeTensors::deserialize(&buf).unwrap();
    let mut v: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    (v, meta.metadata().clone())
}

fn write_raw(p: &Path, raw: &Raw) {
    let views: Vec<(String, safetensors::tensor::TensorView)> = raw
        .0
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    let bytes = safetensors::serialize(views, raw.1.clone()).unwrap();
    std::fs::write(p, bytes).unwrap();
}

fn op<'a>(r: &'a CompareReport, id: &str) -> &'a nvfp4_probe::trace::compare::OpCompare {
    r.ops.iter().find(|o| o.op == id).unwrap()
}

#[test]
fn bf16_and_f32_traces_compare_clean_at_their_precision() {
    for (file, run) in [
        ("trace-300-bf16.safetensors", Precision::Bf16),
        ("trace-77-bf16.safetensors", Precision::Bf16),
        ("trace-300.safetensors", Precision::F32),
        ("trace-77.safetensors", Precision::F32),
    ] {
        let r = compare(&args(&data(file))).unwrap();
        let bad: Vec<String> = r
            .ops
            .iter()
            .filter(|o| o.diverges())
            .map(|o| format!("{} {:?}", o.op, o.reason))
            .collect();
        assert!(bad.is_empty(), "{file}: {bad:?}");
        assert!(r.ops.len() > 100, "{file}: {} ops", r.ops.len());
        assert!(
            r.summary.skipped.is_empty(),
            "{file}: {:?}",
            r.summary.skipped
        );
        assert_eq!(r.summary.run_precision, run.name(), "{file}");
        // every non-index op is held to the run's precision at least, and says so
        for o in r
            .ops
            .iter()
            .filter(|o| o.agreement.is_none() && o.op != "embed")
        {
            assert!(o.held_at.is_some_and(|h| h >= run), "{file} {}", o.op);
        }
        if run == Precision::Bf16 {
            // the linears carry BF16 values in the F32 container; the float32 mixing does not,
            // and is held to BF16 noise all the same (its inputs carried it)
            assert_eq!(op(&r, "L2.attn.q_b").carried, Some(Precision::Bf16));
            let comb = op(&r, "L0.attn.hc_pre.comb");
            assert_eq!(comb.carried, Some(Precision::F32));
            assert_eq!(comb.held_at, Some(Precision::Bf16));
            assert!(comb.tolerance > comb.vs_bf16.rel_l2.unwrap());
            assert_eq!(r.ops[0].dtype, "F32");
        } else {
            // an F32 run is held to F32: tolerances at the floor, far below one BF16 rounding
            let qb = op(&r, "L2.attn.q_b");
            assert_eq!(qb.held_at, Some(Precision::F32));
            assert!(qb.tolerance <= 1e-3 + 1e-12, "{}", qb.tolerance);
        }
    }
}

#[test]
fn a_scaled_op_in_the_bf16_trace_is_caught_there_first() {
    let dir = tempfile::tempdir().unwrap();
    let mut raw = read_raw(&data("trace-300-bf16.safetensors"));
    let name = "model.layers.2.self_attn.q_b_proj";
    let t = raw.0.iter_mut().find(|t| t.0 == name).unwrap();
    assert_eq!(t.1, safetensors::Dtype::F32);
    t.3 =
        t.3.chunks_exact(4)
            .flat_map(|c| (f32::from_le_bytes(c.try_into().unwrap()) * 1.25).to_le_bytes())
            .collect();
    let p = dir.path().join("scaled.safetensors");
    write_raw(&p, &raw);
    let r = compare(&args(&p)).unwrap();
    assert_eq!(
        r.summary.first_divergent.as_deref(),
        Some("L2.attn.q_b"),
        "{:?}",
        r.summary
    );
    assert_eq!(r.summary.divergent, 1, "{:?}", r.summary);
    let qb = op(&r, "L2.attn.q_b");
    // the scale shows as rel-L2 ≈ 0.25 against either oracle
    let e = qb.vs_fp32.rel_l2.unwrap();
    assert!((0.2..0.3).contains(&e), "{e}");
}

#[test]
fn a_tensor_of_impossible_shape_is_skipped_and_the_rest_compared() {
    let dir = tempfile::tempdir().unwrap();
    let mut raw = read_raw(&data("trace-300-bf16.safetensors"));
    let name = "model.layers.1.self_attn.kv_proj";
    let t = raw.0.iter_mut().find(|t| t.0 == name).unwrap();
    // one value short: no row width of the op divides it
    let n: usize = t.2.iter().product();
    t.2 = vec![n - 1];
    t.3.truncate((n - 1) * 4);
    let p = dir.path().join("bad-shape.safetensors");
    write_raw(&p, &raw);
    let r = compare(&args(&p)).unwrap();
    assert_eq!(r.summary.skipped.len(), 1, "{:?}", r.summary.skipped);
    let k = &r.summary.skipped[0];
    assert_eq!(k.trace_name, name);
    assert_eq!(k.op, "L1.attn.kv");
    assert!(k.reason.contains("do not make rows"), "{}", k.reason);
    assert!(r.ops.iter().all(|o| o.op != "L1.attn.kv"));
    assert!(r.ops.len() > 100);
    assert_eq!(r.summary.divergent, 0, "{:?}", r.summary);

    // the command: exit 0, the skip named
    let out = assert_cmd::Command::cargo_bin("nvfp4-probe")
        .unwrap()
        .args(["compare", "--names", "hf", "--model"])
        .arg(data(""))
        .arg("--trace")
        .arg(&p)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("skipped: {name} (op L1.attn.kv)")),
        "{text}"
    );

    // nothing comparable at all: exit 2 naming the file
    for t in raw.0.iter_mut() {
        if t.0 != "input_ids" && t.1 == safetensors::Dtype::F32 {
            let n: usize = t.2.iter().product();
            if n > 1 {
                t.2 = vec![n - 1];
                t.3.truncate((n - 1) * 4);
            }
        }
    }
    let p2 = dir.path().join("all-bad.safetensors");
    write_raw(&p2, &raw);
    let out = assert_cmd::Command::cargo_bin("nvfp4-probe")
        .unwrap()
        .args(["compare", "--names", "hf", "--model"])
        .arg(data(""))
        .arg("--trace")
        .arg(&p2)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("all-bad.safetensors"), "{err}");
}
