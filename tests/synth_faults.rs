//! Planted faults: each kind changes exactly the tensors of its target (compared with a clean
//! synth of the same seed), in the way its catalogue entry describes; faults that have no
//! checkpoint form or do not fit the target's format are refused.

use std::collections::{BTreeMap, BTreeSet};

use nvfp4_probe::checkpoint::{Checkpoint, Dtype, Naming};
use nvfp4_probe::numerics::{e4m3, swizzle, ue8m0};
use nvfp4_probe::served::faults::{Fault, FaultKind};
use nvfp4_probe::synth::{self, Format, Preset, SynthOptions};

const SEED: u64 = 5;

fn opts(format: Format, faults: &[&str]) -> SynthOptions {
    let mut o = SynthOptions::new(Preset::Tiny, format, Naming::Official, SEED);
    o.faults = faults.iter().map(|f| Fault::parse(f).unwrap()).collect();
    o
}

type Raw = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

fn raw(ck: &Checkpoint) -> Raw {
    ck.tensor_names()
        .into_iter()
        .map(|n| {
            let i = ck.info(&n).unwrap();
            let b = ck.bytes(&n).unwrap().to_vec();
            (n, (i.dtype, i.shape, b))
        })
        .collect()
}

/// Names whose dtype, shape or bytes differ, plus names present on one side only.
fn changed(a: &Raw, b: &Raw) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (n, v) in a {
        if b.get(n) != Some(v) {
            out.insert(n.clone());
        }
    }
    for n in b.keys() {
        if !a.contains_key(n) {
            out.insert(n.clone());
        }
    }
    out
}

fn f32_scalar(r: &Raw, n: &str) -> f32 {
    let b = &r[n].2;
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn set(v: &[&str]) -> BTreeSet<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        num += (*x as f64 - *y as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    (num / den).sqrt()
}

#[test]
fn compressed_tensors_faults() {
    let clean = raw(&synth::synth_to_memory(&opts(Format::CtNvfp4, &[])).unwrap());
    let o = opts(
        Format::CtNvfp4,
        &[
            "inverted-input-scale@L1.attn.q_b",
            "zero-input-scale@layers.1.attn.wq_a",
            "nan-input-scale@L3.ffn.shared",
            "swizzled-scales@L1.ffn.expert.2.w1",
            "double-scale@L2.ffn.expert.4.w3",
        ],
    );
    let ck = synth::synth_to_memory(&o).unwrap();
    let bad = raw(&ck);
    let s = "layers.3.ffn.shared_experts";
    let want = set(&[
        "layers.1.attn.wq_b.input_global_scale",
        "layers.1.attn.wq_a.input_global_scale",
        &format!("{s}.w1.input_global_scale"),
        &format!("{s}.w2.input_global_scale"),
        &format!("{s}.w3.input_global_scale"),
        "layers.1.ffn.experts.2.w1.weight_scale",
        "layers.2.ffn.experts.4.w3.weight_packed",
        "layers.2.ffn.experts.4.w3.weight_scale",
    ]);
    assert_eq!(changed(&clean, &bad), want);
    let n = "layers.1.attn.wq_b.input_global_scale";
    assert_eq!(f32_scalar(&bad, n), 1.0 / f32_scalar(&clean, n));
    assert_eq!(
        f32_scalar(&bad, "layers.1.attn.wq_a.input_global_scale"),
        0.0
    );
    assert!(f32_scalar(&bad, &format!("{s}.w2.input_global_scale")).is_nan());
    // Swizzled: the 128×4 layout of the clean bytes (256 × 16 scales: same size, permuted).
    let n = "layers.1.ffn.experts.2.w1.weight_scale";
    assert_eq!(bad[n].2, swizzle::swizzle_128x4(&clean[n].2, 256, 16));
    // Double scale: the weight no longer decodes to the generated one.
    let w = ck
        .weight("layers.2.ffn.experts.4.w3")
        .unwrap()
        .dequantize()
        .unwrap();
    let g = synth::generated(&o, "layers.2.ffn.experts.4.w3").unwrap();
    assert!(rel_l2(&w.data, &g.data) > 0.5);
}

#[test]
fn modelopt_faults() {
    let clean = raw(&synth::synth_to_memory(&opts(Format::ModelOptNvfp4, &[])).unwrap());
    let bad = raw(&synth::synth_to_memory(&opts(
        Format::ModelOptNvfp4,
        &[
            "inverted-weight-scale@L2.ffn.expert.3.w2",
            "missing-input-scale@L1.ffn.experts",
            "shifted-scale-rows@L1.attn.wo_b",
        ],
    ))
    .unwrap());
    let mut want = set(&[
        "layers.2.ffn.experts.3.w2.weight_scale_2",
        "layers.1.attn.wo_b.weight_scale",
    ]);
    for e in 0..8 {
        for p in ["w1", "w2", "w3"] {
            let n = format!("layers.1.ffn.experts.{e}.{p}.input_scale");
            assert!(!bad.contains_key(&n));
            want.insert(n);
        }
    }
    assert_eq!(changed(&clean, &bad), want);
    let n = "layers.2.ffn.experts.3.w2.weight_scale_2";
    assert_eq!(f32_scalar(&bad, n), 1.0 / f32_scalar(&clean, n));
    // wo_b [256, 512] → scales [256, 32]: row r holds the clean row r−1.
    let n = "layers.1.attn.wo_b.weight_scale";
    let (c, b) = (&clean[n].2, &bad[n].2);
    for r in 1..256 {
        assert_eq!(&b[r * 32..(r + 1) * 32], &c[(r - 1) * 32..r * 32]);
    }
    assert_ne!(b, c);
}

#[test]
fn official_mixed_faults() {
    let clean = raw(&synth::synth_to_memory(&opts(Format::OfficialMixed, &[])).unwrap());
    let o = opts(
        Format::OfficialMixed,
        &[
            "input-amax-x64@L2.ffn.expert.1.w1",
            "nan-block-scale@L1.attn.wo_b",
            "nan-block-scale@L3.ffn.expert.0.w2",
            "w13-scale-mismatch@L2.ffn.expert.5",
            "non-pow2-ue8m0@L1.attn.q_a",
        ],
    );
    let ck = synth::synth_to_memory(&o).unwrap();
    let bad = raw(&ck);
    let w3 = "layers.2.ffn.experts.5.w3";
    let want = set(&[
        "layers.2.ffn.experts.1.w1.input_scale",
        "layers.1.attn.wo_b.scale",
        "layers.3.ffn.experts.0.w2.weight_scale",
        &format!("{w3}.weight"),
        &format!("{w3}.weight_scale"),
        &format!("{w3}.weight_scale_2"),
        "layers.1.attn.wq_a.weight",
        "layers.1.attn.wq_a.scale",
    ]);
    assert_eq!(changed(&clean, &bad), want);
    let n = "layers.2.ffn.experts.1.w1.input_scale";
    assert_eq!(f32_scalar(&bad, n), f32_scalar(&clean, n) / 64.0);
    // UE8M0 NaN is 0xFF; E4M3 NaN is 0x7F.
    assert_eq!(bad["layers.1.attn.wo_b.scale"].2[0], 0xFF);
    assert!(e4m3::is_nan_byte(
        bad["layers.3.ffn.experts.0.w2.weight_scale"].2[0]
    ));
    // w13 mismatch: w3's tensor scale is 1.6× w1's, yet w3 decodes right by its own scales.
    let d1 = f32_scalar(&bad, "layers.2.ffn.experts.5.w1.weight_scale_2");
    let d3 = f32_scalar(&bad, &format!("{w3}.weight_scale_2"));
    assert_eq!(d3, d1 * 1.6);
    let w = ck.weight(w3).unwrap().dequantize().unwrap();
    let g = synth::generated(&o, w3).unwrap();
    assert!(rel_l2(&w.data, &g.data) < 0.15);
    // non-pow2: F32 scales, not all powers of two, still decoding to the weight.
    let (dt, shape, b) = &bad["layers.1.attn.wq_a.scale"];
    assert_eq!((*dt, shape.as_slice()), (Dtype::F32, &[2usize, 2][..]));
    let vals: Vec<f32> = b
        .chunks(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert!(vals.iter().any(|&v| !ue8m0::is_pow2(v)));
    let w = ck
        .weight("layers.1.attn.wq_a")
        .unwrap()
        .dequantize()
        .unwrap();
    let g = synth::generated(&o, "layers.1.attn.wq_a").unwrap();
    assert!(rel_l2(&w.data, &g.data) < 0.05);
    assert_eq!(ck.model_config().unwrap().num_hidden_layers, 5);
    assert_eq!(
        ck.quantization_config().unwrap()["scale_fmt"],
        "ue8m0",
        "the config still claims ue8m0"
    );
}

#[test]
fn mxfp4_nibble_swap() {
    let clean = raw(&synth::synth_to_memory(&opts(Format::Mxfp4, &[])).unwrap());
    let bad = raw(&synth::synth_to_memory(&opts(
        Format::Mxfp4,
        &["nibble-swap@L4.ffn.expert.0.w2"],
    ))
    .unwrap());
    let n = "layers.4.ffn.experts.0.w2.weight";
    assert_eq!(changed(&clean, &bad), set(&[n]));
    for (x, y) in clean[n].2.iter().zip(&bad[n].2) {
        assert_eq!(*y, x.rotate_right(4));
    }
}

fn refused(format: Format, f: &str) -> String {
    match synth::synth_to_memory(&opts(format, &[f])) {
        Ok(_) => panic!("{f} on {} was accepted", format.name()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn inapplicable_faults_are_refused() {
    let m = refused(Format::OfficialMixed, "missing-alpha@L1.ffn.experts");
    assert!(m.contains("loader-only"), "{m}");
    let m = refused(Format::OfficialMixed, "nibble-swap@L1.attn.q_a");
    assert!(m.contains("fp8-block"), "{m}");
    let m = refused(Format::CtNvfp4, "non-pow2-ue8m0@L1.attn.q_b");
    assert!(m.contains("UE8M0"), "{m}");
    let m = refused(Format::Bf16, "zero-input-scale@L1.attn.q_b");
    assert!(m.contains("bf16"), "{m}");
    let m = refused(Format::Mxfp4, "inverted-input-scale@L1.ffn.experts");
    assert!(m.contains("activation scale"), "{m}");
    let m = refused(Format::CtNvfp4, "w13-scale-mismatch@L1.attn.q_a");
    assert!(m.contains("w1/w3"), "{m}");
    let m = refused(Format::CtNvfp4, "nibble-swap@L9.attn.q_a");
    assert!(m.contains("matches no weight"), "{m}");
    // Every kind is either plantable somewhere or refused as loader-only.
    for k in FaultKind::ALL {
        assert!(!k.describe().is_empty());
    }
}
