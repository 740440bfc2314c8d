//! MXFP8, the format added through the format table alone (src/checkpoint/formats/mxfp8.rs):
//! decode vectors worked out by hand from the OCP MX v1.0 spec (E4M3 elements, bias 7; E8M0
//! scales 2^(b−127), 0xFF NaN), detection and bad shapes, a synth → lint → run round trip on the
//! CPU backend against the BF16 synth of the same seed, and a planted NaN scale byte that lint
//! names.

mod checkpoint_common;

use std::process::Command;

use checkpoint_common::{write, CONFIG};
use nvfp4_probe::checkpoint::{Checkpoint, Dtype, Naming};
use nvfp4_probe::lint::{lint_dir, Rules, Severity};
use nvfp4_probe::served::faults::Fault;
use nvfp4_probe::synth::{synth_to_dir, Choice, Format, Preset, SynthOptions};
use tempfile::TempDir;

const BASE: &str = "layers.0.attn.wq_a"; // [q_lora_rank 32, hidden 64] in CONFIG

/// Row 0: block 0 scale 2^1, block 1 scale 2^-7; row 1: block 0 NaN scale, block 1 2^-127;
/// other rows: scale 1 and element 1.0.
fn vectors() -> (Vec<u8>, Vec<u8>) {
    let mut codes = vec![0x38u8; 32 * 64];
    let mut scales = vec![127u8; 32 * 2];
    // row 0, block 0 (scale byte 128 = 2.0)
    codes[..6].copy_from_slice(&[0x38, 0x3C, 0xB8, 0x7E, 0x01, 0x80]);
    // row 0, block 1 (scale byte 120 = 2^-7)
    codes[32..35].copy_from_slice(&[0x40, 0x7E, 0x08]);
    scales[0] = 128;
    scales[1] = 120;
    // row 1: NaN scale, then the smallest scale
    scales[2] = 0xFF;
    scales[3] = 0x00;
    codes[64 + 32] = 0x7E;
    (codes, scales)
}

fn checkpoint(scale_shape: Vec<usize>, scale_dtype: Dtype) -> TempDir {
    let (codes, mut scales) = vectors();
    scales.resize(scale_shape.iter().product(), 127);
    let d = TempDir::new().unwrap();
    let t = vec![
        (
            format!("{BASE}.weight"),
            Dtype::F8_E4M3,
            vec![32, 64],
            codes,
        ),
        (
            format!("{BASE}.weight_scale"),
            scale_dtype,
            scale_shape,
            scales,
        ),
    ];
    write(d.path(), &t, CONFIG, 1 << 20);
    d
}

#[test]
fn decode_vectors_from_the_ocp_spec() {
    for dt in [Dtype::U8, Dtype::F8_E8M0] {
        let d = checkpoint(vec![32, 2], dt);
        let ck = Checkpoint::open(d.path()).unwrap();
        let meta = ck.weight_meta(BASE).unwrap();
        assert_eq!(meta.scheme_label(), "mxfp8");
        assert_eq!((meta.out_features, meta.in_features), (32, 64));
        assert_eq!(
            meta.tensors.block_scale.as_deref(),
            Some("layers.0.attn.wq_a.weight_scale")
        );
        let w = ck.weight(BASE).unwrap().dequantize().unwrap();
        let v = &w.data;
        // row 0, block 0: E4M3 value × 2
        let want0 = [2.0, 3.0, -2.0, 896.0, 0.00390625, -0.0];
        for (k, &x) in want0.iter().enumerate() {
            assert_eq!(v[k], x, "row 0 element {k}");
        }
        assert!(v[5].is_sign_negative(), "0x80 is −0");
        assert_eq!(v[6], 2.0); // 0x38 = 1.0, × 2
                               // row 0, block 1: × 2^-7
        assert_eq!(v[32], 0.015625); // 0x40 = 2
        assert_eq!(v[33], 3.5); // 0x7E = 448
        assert_eq!(v[34], 1.0 / 8192.0); // 0x08 = 2^-6 → 2^-13
        assert_eq!(v[35], 0.0078125);
        // row 1: a NaN scale poisons its block, 2^-127 scales the next one
        assert!(v[64..96].iter().all(|x| x.is_nan()));
        assert_eq!(v[96], 448.0 * 5.877_472e-39); // 1.75 · 2^-119
        assert_eq!(v[97], 5.877_472e-39); // 2^-127
                                          // every other row: 1.0 × 2^0
        assert!(v[128..].iter().all(|&x| x == 1.0));
    }
}

#[test]
fn a_scale_grid_of_the_wrong_shape_is_a_bad_input_naming_the_tensor() {
    let d = checkpoint(vec![32, 4], Dtype::U8);
    let ck = Checkpoint::open(d.path()).unwrap();
    let e = ck.weight_meta(BASE).unwrap_err();
    assert_eq!(e.exit_code(), 2);
    let msg = e.to_string();
    assert!(msg.contains("layers.0.attn.wq_a.weight_scale"), "{msg}");
    assert!(msg.contains("MXFP8 block scale [out, in/32]"), "{msg}");
}

fn synth(format: impl Into<Choice>, faults: &[&str]) -> TempDir {
    let d = TempDir::new().unwrap();
    let mut o = SynthOptions::new(Preset::Tiny, format, Naming::Official, 3);
    o.faults = faults.iter().map(|f| Fault::parse(f).unwrap()).collect();
    synth_to_dir(&o, d.path()).unwrap();
    d
}

#[test]
fn synth_lint_and_run_round_trip() {
    let fmt = Choice::parse("mxfp8").unwrap();
    assert_eq!(fmt.name(), "mxfp8");
    let m8 = synth(fmt, &[]);
    let bf = synth(Format::Bf16, &[]);
    // what synth wrote reads back as the generated weights to E4M3 precision (against the BF16
    // synth of the same seed: both round the same generated values)
    let (c8, cb) = (
        Checkpoint::open(m8.path()).unwrap(),
        Checkpoint::open(bf.path()).unwrap(),
    );
    let mut n_mx = 0;
    for base in c8.weight_bases() {
        let (q, b) = (c8.weight(&base).unwrap(), cb.weight(&base).unwrap());
        let (q, b) = (q.dequantize().unwrap().data, b.dequantize().unwrap().data);
        if c8.weight_scheme(&base) != Some("mxfp8") {
            assert_eq!(q, b, "{base}: a BF16 weight of both");
            continue;
        }
        n_mx += 1;
        for (k, (&x, &y)) in q.iter().zip(&b).enumerate() {
            // the block's scale X < 2·amax/448 (no element clips); |q − w| ≤ 2^-4 |w| for E4M3
            // normals, ≤ 2^-10 X below them; |b − w| ≤ 2^-9 |w| (BF16)
            let blk = &b[k / 32 * 32..k / 32 * 32 + 32];
            let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
            let tol = y.abs() * (1.0 / 16.0 + 1.0 / 256.0) + amax * 1.01 / (448.0 * 512.0);
            assert!((x - y).abs() <= tol, "{base}[{k}]: {x} vs {y}");
        }
    }
    assert!(n_mx > 50, "{n_mx} MXFP8 weights");
    // the config says what the tensors are: lint is clean
    let r = lint_dir(m8.path(), None, &Rules::default()).unwrap();
    let bad: Vec<_> = r
        .findings
        .iter()
        .filter(|f| f.severity >= Severity::Warning)
        .map(|f| format!("{} {}", f.rule, f.evidence))
        .collect();
    assert!(bad.is_empty(), "{bad:?}");
    // run on the CPU backend: served under the FP8-activation recipe, within tolerance
    let json = m8.path().with_extension("run.json");
    let o = Command::new(env!("CARGO_BIN_EXE_nvfp4-probe"))
        .args([
            "run",
            "--backend",
            "cpu",
            "--layers",
            "0..1",
            "--seq-len",
            "16",
        ])
        .arg("--model")
        .arg(m8.path())
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    std::fs::remove_file(&json).unwrap();
    let ops = v["ops"].as_array().unwrap();
    let qa = ops.iter().find(|o| o["id"] == "L0.attn.q_a").unwrap();
    assert_eq!(qa["weights"][0][1], "mxfp8");
    assert_eq!(qa["tolerance_basis"], "Linear × fp8-block × blackwell-w4a4");
    // the served linear differs from the oracle (FP8 weights and activations), but not by much
    let rel = qa["served_isolated_vs_bf16"]["rel_l2"].as_f64().unwrap();
    assert!(rel > 1e-3 && rel < 0.058, "{rel}");
    assert_eq!(v["summary"]["divergent_ops"], 0);
}

#[test]
fn a_nan_scale_byte_is_found_and_named() {
    let d = synth(
        Choice::parse("mxfp8").unwrap(),
        &["nan-block-scale@L1.attn.q_b"],
    );
    let ck = Checkpoint::open(d.path()).unwrap();
    let sc = ck
        .canonical_bytes("layers.1.attn.wq_b.weight_scale")
        .unwrap();
    assert_eq!(sc[0], 0xFF, "E8M0 NaN planted in the stored scale bytes");
    let r = lint_dir(d.path(), None, &Rules::default()).unwrap();
    let f = r
        .findings
        .iter()
        .find(|f| f.rule == "scale.block.nan")
        .expect("scale.block.nan fires");
    assert_eq!(f.severity, Severity::Error);
    assert!(
        f.tensor.contains("layers.1.attn.wq_b.weight_scale"),
        "{}",
        f.tensor
    );
    assert!(f.evidence.contains("UE8M0"), "{}", f.evidence);
    assert!(f.evidence.contains("byte 0xFF"), "{}", f.evidence);
    assert_eq!(r.exit_code(), 1);
    // and a fault MXFP8 cannot have is refused up front
    let mut o = SynthOptions::new(
        Preset::Tiny,
        Choice::parse("mxfp8").unwrap(),
        Naming::Official,
        3,
    );
    o.faults = vec![Fault::parse("nibble-swap@L1.attn.q_b").unwrap()];
    let e = synth_to_dir(&o, TempDir::new().unwrap().path()).unwrap_err();
    assert_eq!(e.exit_code(), 2);
}

/// compressed-tensors 0.20.0's own MXFP8 bytes of the six producer matrices
/// (tests/data/producers-mxfp8, its README) decode through the table's reference to exactly
/// compressed-tensors' own decompression of them, value by value (f32 `==`, −0 included).
#[test]
fn compressed_tensors_mxfp8_bytes_decode_exactly() {
    use nvfp4_probe::checkpoint::formats::{decode_blocked, mxfp8};
    use safetensors::SafeTensors;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/producers-mxfp8");
    let packed = std::fs::read(dir.join("ct-mxfp8.safetensors")).unwrap();
    let deq = std::fs::read(dir.join("ct-mxfp8-dequant.safetensors")).unwrap();
    let (p, d) = (
        SafeTensors::deserialize(&packed).unwrap(),
        SafeTensors::deserialize(&deq).unwrap(),
    );
    let dec = mxfp8::SPEC.decode.as_ref().unwrap();
    let mut modules = 0;
    for (name, w) in p.tensors() {
        let Some(m) = name.strip_suffix(".weight") else {
            continue;
        };
        let s = p.tensor(&format!("{m}.weight_scale")).unwrap();
        assert_eq!(w.dtype(), safetensors::Dtype::F8_E4M3, "{m}");
        assert_eq!(s.dtype(), safetensors::Dtype::U8, "{m}");
        let (rows, cols) = (w.shape()[0], w.shape()[1]);
        assert_eq!(s.shape(), &[rows, cols / 32][..], "{m}");
        let ours = decode_blocked(dec, w.data(), s.data(), rows, cols);
        let want: Vec<f32> = d
            .tensor(&format!("{m}:ct"))
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(ours.len(), want.len(), "{m}");
        let bad = ours
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            bad, 0,
            "{m}: {bad} values differ from compressed-tensors' decompression"
        );
        modules += 1;
    }
    assert_eq!(modules, 6);
}
