//! Shared builders for the checkpoint tests: a tiny DeepSeek-V4 config and weights in every
//! scheme, each with its expected f32 values computed here from the spec formulas
//! (docs/DSV4-LAYER.md §2.3, docs/NVFP4.md §3–§6) over hand-picked bytes, not by the crate's decoders.
#![allow(dead_code)]

use nvfp4_probe::checkpoint::{Dtype, ShardWriter};
use std::path::Path;

/// hidden 64, 2 layers (layer 0 CSA ratio 4, layer 1 window only), 4 experts of width 32.
pub const CONFIG: &str = r#"{
  "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 32,
  "num_attention_heads": 2, "head_dim": 32, "qk_rope_head_dim": 8,
  "q_lora_rank": 32, "o_groups": 1, "o_lora_rank": 32,
  "compress_ratios": [4, 0, 0], "n_routed_experts": 4, "num_experts_per_tok": 2,
  "moe_intermediate_size": 32, "index_n_heads": 2, "index_head_dim": 16, "num_hash_layers": 1
}"#;

pub const D: usize = 64;

/// CONFIG with an FP8 `quantization_config` of the given block size.
pub fn config_with_block(b: [usize; 2]) -> String {
    CONFIG.replacen(
        '{',
        &format!(r#"{{ "quantization_config": {{"quant_method": "fp8", "weight_block_size": [{}, {}]}},"#, b[0], b[1]),
        1,
    )
}
pub const I: usize = 32;

/// E4M3 bytes with their values, from the format definition (bias 7, 3 mantissa bits).
pub const E4M3: [(u8, f32); 9] = [
    (0x38, 1.0),
    (0x30, 0.5),
    (0x3C, 1.5),
    (0x41, 2.25),
    (0x66, 56.0),
    (0x7E, 448.0),
    (0x20, 0.125),
    (0x08, 0.015625),    // 2^-6, smallest normal
    (0x03, 0.005859375), // 3·2^-9, subnormal
];
/// UE8M0 bytes: 2^(b-127).
pub const UE8M0: [(u8, f32); 4] = [(127, 1.0), (126, 0.5), (130, 8.0), (120, 0.0078125)];
/// E2M1 magnitudes of codes 0..7; bit 3 is the sign.
pub const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
/// Non-NaN E4M3 weight bytes for FP8 tests with their values.
pub const FP8: [(u8, f32); 6] = [
    (0x38, 1.0),
    (0xB8, -1.0),
    (0x40, 2.0),
    (0x31, 0.5625),
    (0x7E, 448.0),
    (0x00, 0.0),
];

/// Deterministic generator (xorshift); never all zeros.
pub struct Rng(u64);
impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn e2m1(code: u8) -> f32 {
    let m = E2M1[(code & 7) as usize];
    if code & 8 != 0 {
        -m
    } else {
        m
    }
}

/// One checkpoint tensor: (leaf suffix, dtype, shape, bytes).
pub type Part = (String, Dtype, Vec<usize>, Vec<u8>);

/// A weight in some scheme and what it must dequantise to.
pub struct Built {
    pub parts: Vec<Part>,
    pub expected: Vec<f32>,
    pub out: usize,
    pub inp: usize,
}

pub fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
        .collect()
}
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// BF16 weight; values are multiples of 1/64 in [-2, 2), exact in BF16.
pub fn dense(out: usize, inp: usize, seed: u64) -> Built {
    let mut r = Rng::new(seed);
    let v: Vec<f32> = (0..out * inp)
        .map(|_| (r.below(256) as f32 - 128.0) / 64.0)
        .collect();
    Built {
        parts: vec![("weight".into(), Dtype::BF16, vec![out, inp], bf16_bytes(&v))],
        expected: v,
        out,
        inp,
    }
}

/// FP8 block weight: `scale` UE8M0 (official) or `weight_scale_inv` F32 (V3 style).
pub fn fp8(out: usize, inp: usize, block: [usize; 2], ue8m0: bool, seed: u64) -> Built {
    let mut r = Rng::new(seed);
    let w: Vec<(u8, f32)> = (0..out * inp).map(|_| FP8[r.below(FP8.len())]).collect();
    let (gr, gc) = (out.div_ceil(block[0]), inp.div_ceil(block[1]));
    let sc: Vec<(u8, f32)> = (0..gr * gc).map(|_| UE8M0[r.below(UE8M0.len())]).collect();
    let f32_scales: Vec<f32> = (0..gr * gc).map(|k| 0.001 + 0.0137 * k as f32).collect();
    let mut expected = vec![0f32; out * inp];
    for o in 0..out {
        for i in 0..inp {
            let s = if ue8m0 {
                sc[(o / block[0]) * gc + i / block[1]].1
            } else {
                f32_scales[(o / block[0]) * gc + i / block[1]]
            };
            expected[o * inp + i] = w[o * inp + i].1 * s;
        }
    }
    let wp = (
        "weight".to_string(),
        Dtype::F8_E4M3,
        vec![out, inp],
        w.iter().map(|x| x.0).collect(),
    );
    let sp = if ue8m0 {
        (
            "scale".to_string(),
            Dtype::F8_E8M0,
            vec![gr, gc],
            sc.iter().map(|x| x.0).collect(),
        )
    } else {
        (
            "weight_scale_inv".to_string(),
            Dtype::F32,
            vec![gr, gc],
            f32_bytes(&f32_scales),
        )
    };
    Built {
        parts: vec![wp, sp],
        expected,
        out,
        inp,
    }
}

/// Random codes packed low-nibble-first, with their signed values.
fn codes(out: usize, inp: usize, r: &mut Rng) -> (Vec<u8>, Vec<f32>) {
    let c: Vec<u8> = (0..out * inp).map(|_| r.below(16) as u8).collect();
    let packed = c.chunks(2).map(|p| p[0] | (p[1] << 4)).collect();
    (packed, c.iter().map(|&x| e2m1(x)).collect())
}

/// MXFP4 (official experts): I8 packed + F8_E8M0 `scale` [out, in/32].
pub fn mxfp4(out: usize, inp: usize, seed: u64) -> Built {
    let mut r = Rng::new(seed);
    let (packed, vals) = codes(out, inp, &mut r);
    let sc: Vec<(u8, f32)> = (0..out * inp / 32)
        .map(|_| UE8M0[r.below(UE8M0.len())])
        .collect();
    let expected = vals
        .iter()
        .enumerate()
        .map(|(k, v)| v * sc[k / 32].1)
        .collect();
    Built {
        parts: vec![
            ("weight".into(), Dtype::I8, vec![out, inp / 2], packed),
            (
                "scale".into(),
                Dtype::F8_E8M0,
                vec![out, inp / 32],
                sc.iter().map(|x| x.0).collect(),
            ),
        ],
        expected,
        out,
        inp,
    }
}

/// NVFP4 in ModelOpt form (`weight`, `weight_scale`, `weight_scale_2`, `input_scale`) or
/// compressed-tensors form (`weight_packed`, …, `weight_global_scale`, `input_global_scale`).
/// Expected values use each producer's own decode order: e2m1 · fl(s·d) or e2m1 · fl(s/g).
pub fn nvfp4(out: usize, inp: usize, ct: bool, with_input: bool, seed: u64) -> Built {
    let mut r = Rng::new(seed);
    let (packed, vals) = codes(out, inp, &mut r);
    let sc: Vec<(u8, f32)> = (0..out * inp / 16)
        .map(|_| E4M3[r.below(E4M3.len())])
        .collect();
    // Values of the kind the producers write (docs/NVFP4.md fixture table): not powers of two, so
    // the op order matters.
    let (g, d) = (30_927.102_f32, 3.233_41e-5_f32);
    let expected = vals
        .iter()
        .enumerate()
        .map(|(k, v)| {
            if ct {
                v * (sc[k / 16].1 / g)
            } else {
                v * (sc[k / 16].1 * d)
            }
        })
        .collect();
    let scales: Vec<u8> = sc.iter().map(|x| x.0).collect();
    let mut parts: Vec<Part> = if ct {
        vec![
            (
                "weight_packed".into(),
                Dtype::U8,
                vec![out, inp / 2],
                packed,
            ),
            (
                "weight_scale".into(),
                Dtype::F8_E4M3,
                vec![out, inp / 16],
                scales,
            ),
            (
                "weight_global_scale".into(),
                Dtype::F32,
                vec![1],
                f32_bytes(&[g]),
            ),
        ]
    } else {
        vec![
            ("weight".into(), Dtype::U8, vec![out, inp / 2], packed),
            (
                "weight_scale".into(),
                Dtype::F8_E4M3,
                vec![out, inp / 16],
                scales,
            ),
            ("weight_scale_2".into(), Dtype::F32, vec![], f32_bytes(&[d])),
        ]
    };
    if with_input {
        parts.push(if ct {
            (
                "input_global_scale".into(),
                Dtype::F32,
                vec![1],
                f32_bytes(&[448.0]),
            )
        } else {
            ("input_scale".into(), Dtype::F32, vec![], f32_bytes(&[0.25]))
        });
    }
    Built {
        parts,
        expected,
        out,
        inp,
    }
}

/// Official-naming layer-0 weights of the tiny config, one scheme per projection.
pub fn official_layer(block: [usize; 2]) -> Vec<(String, Built)> {
    vec![
        ("layers.0.attn.wq_a".into(), dense(32, D, 1)),
        ("layers.0.attn.wq_b".into(), fp8(64, 32, block, true, 2)),
        ("layers.0.attn.wkv".into(), fp8(32, D, block, false, 3)),
        ("layers.0.attn.wo_a".into(), nvfp4(32, 64, true, true, 4)),
        ("layers.0.attn.wo_b".into(), nvfp4(D, 32, false, true, 5)),
        ("layers.0.ffn.experts.0.w1".into(), mxfp4(I, D, 6)),
        (
            "layers.0.ffn.experts.1.w1".into(),
            nvfp4(I, D, false, false, 7),
        ),
        (
            "layers.0.ffn.experts.1.w2".into(),
            nvfp4(D, I, false, true, 8),
        ),
        (
            "layers.0.ffn.shared_experts.w2".into(),
            fp8(D, I, block, true, 9),
        ),
        ("head".into(), dense(32, D, 10)),
    ]
}

/// Non-linear tensors: norms, mHC, router table (official names).
pub fn extras() -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    let norm: Vec<f32> = (0..D).map(|k| 1.0 + k as f32 / 128.0).collect();
    let hc: Vec<f32> = (0..24 * 4 * D).map(|k| (k as f32 * 0.37).sin()).collect();
    let tid: Vec<u8> = (0..32i64 * 2).flat_map(|k| (k % 4).to_le_bytes()).collect();
    vec![
        (
            "layers.0.attn_norm.weight".into(),
            Dtype::BF16,
            vec![D],
            bf16_bytes(&norm),
        ),
        (
            "layers.0.attn.kv_norm.weight".into(),
            Dtype::BF16,
            vec![32],
            bf16_bytes(&norm[..32]),
        ),
        (
            "layers.0.hc_attn_fn".into(),
            Dtype::F32,
            vec![24, 4 * D],
            f32_bytes(&hc),
        ),
        (
            "layers.0.ffn.gate.tid2eid".into(),
            Dtype::I64,
            vec![32, 2],
            tid,
        ),
        (
            "embed.weight".into(),
            Dtype::BF16,
            vec![32, D],
            bf16_bytes(&vec![0.5; 32 * D]),
        ),
    ]
}

/// Flatten (base, Built) into named tensors with a naming function for `base.suffix`.
pub fn tensors(
    weights: &[(String, Built)],
    name: impl Fn(&str, &str) -> String,
) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    let mut v = Vec::new();
    for (base, b) in weights {
        for (suffix, dt, shape, bytes) in &b.parts {
            v.push((name(base, suffix), *dt, shape.clone(), bytes.clone()));
        }
    }
    v
}

pub fn write(
    dir: &Path,
    tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)],
    config: &str,
    max_shard: usize,
) {
    let mut w = ShardWriter::new(dir, max_shard).unwrap();
    for (n, d, s, b) in tensors {
        w.add(n, *d, s, b.clone()).unwrap();
    }
    w.finish(config).unwrap();
}

/// A safetensors file from a hand-written header (offsets as given, nothing checked).
pub fn raw_file(header: &str, data: &[u8]) -> Vec<u8> {
    let mut h = header.as_bytes().to_vec();
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend_from_slice(data);
    out
}

/// Bitwise equality that treats +0/-0 as equal (f32 ==) and reports the first mismatch.
pub fn assert_f32_eq(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g == w, "{what}: element {k}: got {g:e}, want {w:e}");
    }
}
