//! docs/NVFP4.md §9 test vectors TV1–TV13, plus the exhaustive E4M3 checks of §2.1. Expected bytes
//! and values are the spec's (measured on CUDA / the producer libraries), not this crate's.

use nvfp4_probe::numerics::nvfp4::Convention;
use nvfp4_probe::numerics::{bf16, e2m1, e4m3, nvfp4, swizzle};

const IDENTITY: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

fn ct_block(x: &[f32], g: f32) -> nvfp4::NvFp4Quant {
    nvfp4::quantize_ct_with_global(x, 1, 16, g)
}

fn mo_block(x: &[f32], d: f32) -> nvfp4::NvFp4Quant {
    nvfp4::quantize_modelopt_with_global(x, 1, 16, d)
}

#[test]
fn tv01_e2m1_encode() {
    let cases: [(f32, u8); 19] = [
        (0.0, 0x0),
        (-0.0, 0x8),
        (0.1, 0x0),
        (-0.1, 0x8),
        (0.25, 0x0),
        (0.2500001, 0x1),
        (0.75, 0x2),
        (1.0, 0x2),
        (1.25, 0x2),
        (1.75, 0x4),
        (2.5, 0x4),
        (3.5, 0x6),
        (5.0, 0x6),
        (5.0001, 0x7),
        (6.0, 0x7),
        (6.5, 0x7),
        (100.0, 0x7),
        (f32::INFINITY, 0x7),
        (f32::NEG_INFINITY, 0xF),
    ];
    for (x, c) in cases {
        assert_eq!(e2m1::encode(x), c, "x = {x}");
    }
}

#[test]
fn tv02_identity_block_g1() {
    let (s, p) = nvfp4::quantize_block_kernel(&IDENTITY, 1.0);
    assert_eq!(s, 0x38);
    assert_eq!(p, [0x10, 0x32, 0x54, 0x76, 0x98, 0xba, 0xdc, 0xfe]);
    let ct = ct_block(&IDENTITY, 1.0);
    assert_eq!(ct.scales, vec![0x38]);
    assert_eq!(
        ct.packed,
        vec![0x10, 0x32, 0x54, 0x76, 0x90, 0xba, 0xdc, 0xfe]
    );
    let d = nvfp4::dequantize(
        &ct.packed,
        &ct.scales,
        1.0,
        Convention::CompressedTensors,
        1,
        16,
    );
    assert_eq!(d, IDENTITY.to_vec());
}

#[test]
fn tv03_identity_block_g448() {
    assert_eq!(nvfp4::global_scale_ct(6.0), 448.0);
    let d = nvfp4::global_scale_modelopt(6.0);
    assert_eq!(d as f64, 0.002_232_142_956_927_418_7);
    assert_eq!(448.0f32 * d, 1.0);
    let (s, p) = nvfp4::quantize_block_kernel(&IDENTITY, 448.0);
    assert_eq!(s, 0x7E);
    assert_eq!(p, [0x10, 0x32, 0x54, 0x76, 0x98, 0xba, 0xdc, 0xfe]);
    let ct = ct_block(&IDENTITY, 448.0);
    assert_eq!(ct.scales, vec![0x7E]);
    let deq = nvfp4::dequantize(
        &ct.packed,
        &ct.scales,
        448.0,
        Convention::CompressedTensors,
        1,
        16,
    );
    assert_eq!(deq, IDENTITY.to_vec());
    let mo = mo_block(&IDENTITY, d);
    assert_eq!(mo.scales, vec![0x7E]);
    let deq = nvfp4::dequantize(&mo.packed, &mo.scales, d, Convention::ModelOpt, 1, 16);
    assert_eq!(deq, IDENTITY.to_vec());
}

#[test]
fn tv04_ties_g448() {
    let pos = [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0];
    let x: Vec<f32> = pos.iter().copied().chain(pos.iter().map(|v| -v)).collect();
    let want = [0x20, 0x42, 0x64, 0x76, 0xa8, 0xca, 0xec, 0xfe];
    let (s, p) = nvfp4::quantize_block_kernel(&x, 448.0);
    assert_eq!((s, p), (0x7E, want));
    let ct = ct_block(&x, 448.0);
    assert_eq!((ct.scales[0], ct.packed.as_slice()), (0x7E, &want[..]));
    let mo = mo_block(&x, nvfp4::global_scale_modelopt(6.0));
    assert_eq!((mo.scales[0], mo.packed.as_slice()), (0x7E, &want[..]));
}

#[test]
fn tv05_small_block_g448() {
    let x: Vec<f32> = [
        -0.01f32, 0.01, -0.1, 0.1, 0.3, -0.3, 0.2, -0.2, 0.0, -0.0, 0.05, -0.05, 0.12, -0.12, 0.15,
        -0.15,
    ]
    .iter()
    .map(|&v| bf16::round(v))
    .collect();
    assert_eq!(nvfp4::amax(&x), 0.30078125);
    let producer = [0x08, 0x4c, 0xf7, 0xe6, 0x00, 0xa2, 0xc4, 0xd5];
    let ct = ct_block(&x, 448.0);
    assert_eq!((ct.scales[0], ct.packed.as_slice()), (0x5B, &producer[..]));
    let mo = mo_block(&x, nvfp4::global_scale_modelopt(6.0));
    assert_eq!((mo.scales[0], mo.packed.as_slice()), (0x5B, &producer[..]));
    let (s, p) = nvfp4::quantize_block_kernel(&x, 448.0);
    assert_eq!(s, 0x5B);
    assert_eq!(p, [0x08, 0x4c, 0xf7, 0xe6, 0x80, 0xa2, 0xc4, 0xd5]);
    let deq = nvfp4::dequantize(
        &ct.packed,
        &ct.scales,
        448.0,
        Convention::CompressedTensors,
        1,
        16,
    );
    // Element 4 (0.3) has code 7: 6·22/448.
    assert_eq!(deq[4], 6.0 * (22.0f32 / 448.0));
    assert!((deq[4] as f64 - 0.294642857).abs() < 1e-8);
}

#[test]
fn tv06_rounding_g896() {
    let mut x = [0f32; 16];
    x[..8].copy_from_slice(&[3.0, 1.0, 0.3, -0.7, 2.2, 0.126, -0.125, 1.9]);
    let g = 896.0;
    let (s, p) = nvfp4::quantize_block_kernel(&x, g);
    assert_eq!(s, 0x7E);
    assert_eq!(p, [0x47, 0xb1, 0x16, 0x68, 0, 0, 0, 0]);
    let (deq, h) = nvfp4::fake_quant_activation(&x, 1, 16, g);
    assert_eq!(&deq[..8], &[3.0, 1.0, 0.25, -0.75, 2.0, 0.25, -0.0, 2.0]);
    assert!(deq[6].is_sign_negative());
    assert!(deq[8..].iter().all(|&v| v == 0.0));
    assert_eq!(h.blocks, 1);
    assert_eq!(h.scale_max, 1);
    assert_eq!(h.dead_zone, 1); // −0.125 → ±0
}

#[test]
fn tv07_scale_saturation_g1000() {
    let mut x = [0f32; 16];
    x[..8].copy_from_slice(&[6.0, 2.0, 1.0, 0.5, -6.0, -2.0, -1.0, -0.5]);
    let (s, p) = nvfp4::quantize_block_kernel(&x, 1000.0);
    assert_eq!(s, 0x7E);
    assert_eq!(p, [0x67, 0x24, 0xef, 0xac, 0, 0, 0, 0]);
    // An unclamped torch cast of the same scale is NaN (the §7.2 failure mode).
    assert_eq!(e4m3::encode_torch(1000.0 * (6.0 * nvfp4::RCP6)), 0x7F);
    let (deq, h) = nvfp4::fake_quant_activation(&x, 1, 16, 1000.0);
    assert_eq!(
        &deq[..8],
        &[2.688, 1.792, 0.896, 0.448, -2.688, -1.792, -0.896, -0.448]
    );
    assert_eq!(h.scale_max, 1);
    assert_eq!(h.clipped, 2);
    assert_eq!(h.scale_nan, 0);
}

#[test]
fn tv08_subnormal_scale_g1() {
    let mut x = [0f32; 16];
    x[..4].copy_from_slice(&[0.01, 0.005, -0.0025, 0.001]);
    let (s, p) = nvfp4::quantize_block_kernel(&x, 1.0);
    assert_eq!(s, 0x01);
    assert_eq!(p, [0x57, 0x1b, 0, 0, 0, 0, 0, 0]);
    let (deq, _) = nvfp4::fake_quant_activation(&x, 1, 16, 1.0);
    assert_eq!(
        &deq[..4],
        &[0.01171875, 0.005859375, -0.0029296875, 0.0009765625]
    );
}

#[test]
fn tv09_scale_underflow_g1() {
    let mut x = [0f32; 16];
    x[..4].copy_from_slice(&[0.005, -0.004, 0.001, -0.001]);
    let (s, p) = nvfp4::quantize_block_kernel(&x, 1.0);
    assert_eq!(s, 0x00);
    assert_eq!(p, [0x80, 0x80, 0, 0, 0, 0, 0, 0]);
    let (deq, h) = nvfp4::fake_quant_activation(&x, 1, 16, 1.0);
    assert!(deq.iter().all(|&v| v == 0.0));
    assert_eq!((h.scale_zero, h.dead_zone, h.elements), (1, 4, 16));
}

#[test]
fn tv10_zero_block() {
    let z = [0f32; 16];
    let (s, p) = nvfp4::quantize_block_kernel(&z, 448.0);
    assert_eq!((s, p), (0x00, [0u8; 8]));
    let ct = ct_block(&z, 448.0);
    assert_eq!((ct.scales[0], ct.packed.as_slice()), (0x20, &[0u8; 8][..]));
    let mo = mo_block(&z, nvfp4::global_scale_modelopt(6.0));
    assert_eq!((mo.scales[0], mo.packed.as_slice()), (0x38, &[0u8; 8][..]));
}

#[test]
fn tv11_swizzle_128x4() {
    assert_eq!(swizzle::offset_128x4(130, 5, 8), 1569);
    assert_eq!(swizzle::offset_128x4(1, 0, 8), 16);
    assert_eq!(swizzle::offset_128x4(32, 0, 8), 4);
    assert_eq!(swizzle::offset_128x4(0, 4, 8), 512);
    assert_eq!(swizzle::offset_128x4(0, 0, 8), 0);
    let lin: Vec<u8> = (0..200 * 10).map(|i| (i % 251 + 1) as u8).collect();
    let sw = swizzle::swizzle_128x4(&lin, 200, 10);
    assert_eq!(sw.len(), 256 * 12);
    assert_eq!(sw.iter().filter(|&&b| b == 0).count(), 256 * 12 - 2000);
    assert_eq!(sw[swizzle::offset_128x4(130, 5, 10)], lin[130 * 10 + 5]);
    assert_eq!(swizzle::unswizzle_128x4(&sw, 200, 10), lin);
}

#[test]
fn tv12_gemm_hand_computable() {
    let x = [1.0f32; 16];
    let w = [0.5f32; 16];
    let xa = nvfp4::quantize_activation(&x, 1, 16, 2688.0);
    let wa = nvfp4::quantize_activation(&w, 1, 16, 5376.0);
    assert_eq!(
        (xa.scales.as_slice(), xa.packed.as_slice()),
        (&[0x7E][..], &[0x77; 8][..])
    );
    assert_eq!(
        (wa.scales.as_slice(), wa.packed.as_slice()),
        (&[0x7E][..], &[0x77; 8][..])
    );
    let alpha = nvfp4::alpha_ct(2688.0, 5376.0);
    assert!((alpha as f64 - 6.920086e-8).abs() < 1e-13);
    let y = nvfp4::gemm_w4a4_reference(
        &xa.packed, &xa.scales, &wa.packed, &wa.scales, 1, 1, 16, alpha,
    );
    assert_eq!(y, vec![8.0]);
}

#[test]
fn tv13_gemm_two_blocks() {
    let mut x = vec![1.0f32, -2.0, 3.0, 0.25, 0.1, -0.6, 5.0, 6.0];
    x.extend([0.0; 7]);
    x.push(0.5);
    x.extend([0.01, 0.02, -0.03, 0.04]);
    x.extend([0.0; 11]);
    x.push(0.05);
    let x: Vec<f32> = x.into_iter().map(bf16::round).collect();
    let w1: Vec<f32> = (1..=16)
        .map(|i| {
            let v = bf16::round(i as f32 / 10.0);
            if i == 3 || i == 7 {
                -v
            } else {
                v
            }
        })
        .collect();
    let w: Vec<f32> = w1.iter().chain(w1.iter()).copied().collect();
    assert_eq!(nvfp4::amax(&w), 1.6015625);
    let xa = nvfp4::quantize_activation(&x, 1, 32, 448.0);
    assert_eq!(
        xa.packed,
        vec![0xc2, 0x05, 0x90, 0x76, 0, 0, 0, 0x10, 0x42, 0x6e, 0, 0, 0, 0, 0, 0x70]
    );
    assert_eq!(xa.scales, vec![0x7e, 0x47]);
    // The vector's weight bytes are the runtime kernel's (§9 conventions), with g_w from CT.
    let g_w = nvfp4::global_scale_ct(nvfp4::amax(&w));
    assert!((g_w - 1678.361).abs() < 1e-3);
    let wq = nvfp4::quantize_activation(&w, 1, 32, g_w);
    let wp = [0x11, 0x3a, 0x44, 0x5d, 0x65, 0x66, 0x76, 0x77];
    assert_eq!(&wq.packed[..8], &wp);
    assert_eq!(&wq.packed[8..], &wp);
    assert_eq!(wq.scales, vec![0x7e, 0x7e]);
    // compressed-tensors differs in one nibble: 0.2001953125 scales to exactly 0.75 there
    // (fl(s/g) divides cleanly) and rounds to even (1.0), while the kernel's rcp chain lands
    // one ulp below the tie (0.5).
    let ct = nvfp4::quantize_ct(&w, 1, 32);
    assert_eq!(ct.global, g_w);
    assert_eq!(ct.scales, wq.scales);
    assert_eq!(ct.packed[0], 0x21);
    assert_eq!(&ct.packed[1..8], &wp[1..]);
    let alpha = nvfp4::alpha_ct(448.0, g_w);
    let y = nvfp4::gemm_w4a4_reference(
        &xa.packed, &xa.scales, &wq.packed, &wq.scales, 1, 1, 32, alpha,
    );
    assert_eq!(y, vec![1.3046875]);
    // Unrounded: exact acc · alpha = 1.3073022.
    let xd = nvfp4::dequantize(&xa.packed, &xa.scales, 1.0, Convention::ModelOpt, 1, 32);
    let wd = nvfp4::dequantize(&wq.packed, &wq.scales, 1.0, Convention::ModelOpt, 1, 32);
    let acc: f64 = xd.iter().zip(&wd).map(|(&a, &b)| a as f64 * b as f64).sum();
    assert!(((acc as f32 * alpha) as f64 - 1.3073022).abs() < 1e-6);
}

// --- E4M3 exhaustive (§2.1) ---------------------------------------------------------------

#[test]
fn e4m3_decode_encode_identity_on_all_finite_bytes() {
    let mut n = 0;
    for b in 0u8..=255 {
        if e4m3::is_nan_byte(b) {
            continue;
        }
        n += 1;
        let v = e4m3::decode(b);
        assert_eq!(e4m3::encode_satfinite(v), b, "byte {b:#04x}");
        assert_eq!(e4m3::encode_torch(v), b, "byte {b:#04x}");
    }
    assert_eq!(n, 254);
}

/// Brute-force nearest-even reference over the 127 non-negative finite values.
fn nearest_even(a: f32) -> u8 {
    let mut best = 0u8;
    let mut bd = f64::INFINITY;
    for b in 0u8..=0x7E {
        let d = (e4m3::decode(b) as f64 - a as f64).abs();
        if d < bd || (d == bd && b % 2 == 0) {
            best = b;
            bd = d;
        }
    }
    best
}

#[test]
fn e4m3_rne_matches_brute_force_and_is_monotone() {
    // Every midpoint between neighbours, and the f32 values right beside each midpoint.
    for b in 0u8..0x7E {
        let mid = (e4m3::decode(b) + e4m3::decode(b + 1)) / 2.0; // exact in f32
        for x in [
            f32::from_bits(mid.to_bits() - 1),
            mid,
            f32::from_bits(mid.to_bits() + 1),
        ] {
            let want = nearest_even(x);
            assert_eq!(e4m3::encode_satfinite(x), want, "x = {x:e}");
            assert_eq!(e4m3::encode_satfinite(-x), want | 0x80, "x = -{x:e}");
        }
    }
    // A sweep of f32 values in [0, 470]: nearest-even and monotone.
    let top = 470.0f32.to_bits();
    let mut prev = 0f32;
    let mut bits = 0u32;
    let mut k = 0u32;
    while bits < top {
        let x = f32::from_bits(bits);
        let v = e4m3::decode(e4m3::encode_satfinite(x));
        assert!(v >= prev, "not monotone at {x:e}");
        prev = v;
        if k.is_multiple_of(64) && x <= 448.0 {
            assert_eq!(e4m3::encode_satfinite(x), nearest_even(x), "x = {x:e}");
        }
        k += 1;
        bits += 4099;
    }
}

#[test]
fn e4m3_boundaries() {
    let next = |x: f32| f32::from_bits(x.to_bits() + 1);
    assert_eq!(e4m3::encode_satfinite(448.0), 0x7E);
    assert_eq!(e4m3::encode_torch(448.0), 0x7E);
    assert_eq!(e4m3::encode_satfinite(464.0), 0x7E);
    assert_eq!(e4m3::encode_torch(464.0), 0x7E);
    assert_eq!(e4m3::encode_satfinite(next(464.0)), 0x7E);
    assert_eq!(e4m3::encode_torch(next(464.0)), 0x7F);
    assert_eq!(e4m3::encode_torch(-next(464.0)), 0xFF);
    assert_eq!(e4m3::encode_satfinite(1e30), 0x7E);
    assert_eq!(e4m3::encode_satfinite(f32::INFINITY), 0x7E);
    assert_eq!(e4m3::encode_satfinite(f32::NEG_INFINITY), 0xFE);
    assert_eq!(e4m3::encode_torch(f32::INFINITY), 0x7F);
    assert_eq!(e4m3::encode_torch(f32::NEG_INFINITY), 0xFF);
    assert_eq!(e4m3::encode_satfinite(f32::NAN), 0x7F);
    assert_eq!(e4m3::encode_torch(f32::NAN), 0x7F);
    // Subnormals: 2^-10 is a tie between 0 and 2^-9 → 0; 1.5·2^-10 → 0x01.
    assert_eq!(e4m3::encode_satfinite(2f32.powi(-10)), 0x00);
    assert_eq!(e4m3::encode_satfinite(1.5 * 2f32.powi(-10)), 0x01);
    assert_eq!(e4m3::encode_satfinite(3.0 * 2f32.powi(-10)), 0x02); // tie 1.5 → even 2
    assert_eq!(e4m3::encode_satfinite(2f32.powi(-6)), 0x08);
    assert_eq!(e4m3::encode_satfinite(15.5 * 2f32.powi(-10)), 0x08); // 7.75·2^-9 → 8·2^-9
    assert_eq!(e4m3::encode_satfinite(-0.0), 0x80);
    assert_eq!(e4m3::encode_satfinite(f32::from_bits(1)), 0x00);
    for (v, b) in [
        (1.0, 0x38),
        (0.125, 0x20),
        (0.5, 0x30),
        (2.0, 0x40),
        (22.0, 0x5B),
        (240.0, 0x77),
        (256.0, 0x78),
    ] {
        assert_eq!(e4m3::encode_satfinite(v), b);
    }
}
