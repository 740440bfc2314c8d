//! Property tests for the number formats. Every property is a mathematical law of the format
//! (idempotence, monotonicity, inverse layouts) or an equality between two independent paths.

use nvfp4_probe::numerics::{e2m1, e4m3, nvfp4, swizzle};
use proptest::prelude::*;

/// Finite f32 of any magnitude and sign (bit patterns, so subnormals and huge values occur).
fn finite_f32() -> impl Strategy<Value = f32> {
    any::<u32>()
        .prop_map(f32::from_bits)
        .prop_filter("finite", |x| x.is_finite())
}

/// Values in the range that matters for scaled E2M1 inputs, ties included.
fn e2m1_range() -> impl Strategy<Value = f32> {
    prop_oneof![
        -8.0f32..8.0,
        prop::sample::select(vec![
            0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, -0.0
        ]),
        finite_f32(),
    ]
}

/// Activation-like data: Gaussian-ish magnitudes spread over several binades, with outliers.
fn activation(len: usize) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(
        prop_oneof![
            8 => -3.0f32..3.0,
            1 => -200.0f32..200.0,
            1 => -1e-3f32..1e-3,
            1 => Just(0.0f32),
        ],
        len,
    )
    .prop_filter("not all zero", |v| v.iter().any(|&x| x != 0.0))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn e2m1_encode_is_idempotent(x in e2m1_range()) {
        let c = e2m1::encode(x);
        prop_assert_eq!(e2m1::encode(e2m1::decode(c)), c);
        let p = e2m1::encode_producer(x);
        prop_assert_eq!(e2m1::decode(e2m1::encode_producer(e2m1::decode(p))), e2m1::decode(p));
        // Both encoders agree on the value; they differ at most in the sign of zero.
        prop_assert_eq!(e2m1::decode(c), e2m1::decode(p));
    }

    #[test]
    fn e2m1_encode_is_monotone(a in e2m1_range(), b in e2m1_range()) {
        let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
        prop_assert!(e2m1::decode(e2m1::encode(lo)) <= e2m1::decode(e2m1::encode(hi)));
        prop_assert!(e2m1::decode(e2m1::encode_producer(lo)) <= e2m1::decode(e2m1::encode_producer(hi)));
    }

    #[test]
    fn e2m1_encode_is_nearest(x in -6.0f32..6.0) {
        let v = e2m1::decode(e2m1::encode(x));
        let best = (0u8..16).map(|c| (e2m1::decode(c) - x).abs()).fold(f32::INFINITY, f32::min);
        prop_assert_eq!((v - x).abs(), best);
    }

    #[test]
    fn e4m3_encode_is_idempotent(x in finite_f32()) {
        let b = e4m3::encode_satfinite(x);
        prop_assert_eq!(e4m3::encode_satfinite(e4m3::decode(b)), b);
        let t = e4m3::encode_torch(x);
        if x.abs() <= 464.0 {
            prop_assert_eq!(t, b);
        } else {
            prop_assert!(e4m3::is_nan_byte(t));
        }
    }

    #[test]
    fn e4m3_encode_is_monotone(a in finite_f32(), b in finite_f32()) {
        let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
        prop_assert!(e4m3::decode(e4m3::encode_satfinite(lo)) <= e4m3::decode(e4m3::encode_satfinite(hi)));
    }

    #[test]
    fn swizzle_round_trips(rows in 1usize..300, cols in 1usize..24, seed in any::<u64>()) {
        let lin: Vec<u8> = (0..rows * cols)
            .map(|i| ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed) as u8 | 1)
            .collect();
        let s = swizzle::swizzle_128x4(&lin, rows, cols);
        let (rp, cp) = swizzle::padded_128x4(rows, cols);
        prop_assert_eq!(s.len(), rp * cp);
        // Every input byte is non-zero, so exactly rows·cols slots are filled.
        prop_assert_eq!(s.iter().filter(|&&b| b != 0).count(), rows * cols);
        prop_assert_eq!(swizzle::unswizzle_128x4(&s, rows, cols), lin.clone());
        let s8 = swizzle::swizzle_8x4(&lin, rows, cols);
        prop_assert_eq!(s8.iter().filter(|&&b| b != 0).count(), rows * cols);
        prop_assert_eq!(swizzle::unswizzle_8x4(&s8, rows, cols), lin);
    }

    /// The fused fake-quant equals decoding the kernel's bytes: e2m1 · s_b / g per element.
    #[test]
    fn fake_quant_equals_decode_of_quantize(
        rows in 1usize..6,
        nb in 1usize..6,
        seed_x in activation(6 * 6 * 16),
        amax_calib in prop_oneof![0.01f32..1000.0, Just(6.0f32)],
    ) {
        let cols = nb * 16;
        let x: Vec<f32> = seed_x[..rows * cols].iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
        let g = nvfp4::global_scale_ct(amax_calib);
        let q = nvfp4::quantize_activation(&x, rows, cols, g);
        let (fq, h) = nvfp4::fake_quant_activation(&x, rows, cols, g);
        prop_assert_eq!(h.elements as usize, rows * cols);
        prop_assert_eq!(h.blocks as usize, rows * nb);
        for (e, &got) in fq.iter().enumerate() {
            let byte = q.packed[e / 2];
            let code = if e % 2 == 0 { byte & 0xF } else { byte >> 4 };
            let want = (e2m1::decode(code) * e4m3::decode(q.scales[e / 16])) / g;
            prop_assert_eq!(got.to_bits(), want.to_bits(), "element {}", e);
        }
        let zero = q.scales.iter().filter(|&&b| b == 0).count() as u64;
        prop_assert_eq!(h.scale_zero, zero);
    }

    /// With finite g and NaN-free finite data the kernel never writes a NaN scale byte, however
    /// far g is from the data's range.
    #[test]
    fn kernel_never_emits_nan_scale(
        block in prop::collection::vec(finite_f32(), 16),
        g in prop_oneof![finite_f32().prop_map(f32::abs), 1e-30f32..1e30],
    ) {
        let (s, _) = nvfp4::quantize_block_kernel(&block, g);
        prop_assert!(!e4m3::is_nan_byte(s), "scale {:#x}", s);
        prop_assert!(s & 0x80 == 0);
    }
}

/// The parallel path (≥ 2^15 elements) gives the same bytes and counters as the serial one.
#[test]
fn parallel_and_serial_paths_agree() {
    let (rows, cols) = (300, 256);
    let mut state = 0x1234_5678_u64;
    let x: Vec<f32> = (0..rows * cols)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let u = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            half::bf16::from_f32(u * 10.0).to_f32()
        })
        .collect();
    let g = nvfp4::global_scale_ct(4.0);
    let big = nvfp4::quantize_activation(&x, rows, cols, g);
    let (fq, h) = nvfp4::fake_quant_activation(&x, rows, cols, g);
    let mut hs = nvfp4::QuantHealth::default();
    for r in 0..rows {
        let xr = &x[r * cols..(r + 1) * cols];
        let small = nvfp4::quantize_activation(xr, 1, cols, g);
        assert_eq!(small.packed, big.packed[r * cols / 2..(r + 1) * cols / 2]);
        assert_eq!(small.scales, big.scales[r * cols / 16..(r + 1) * cols / 16]);
        let (f, hr) = nvfp4::fake_quant_activation(xr, 1, cols, g);
        assert_eq!(f, fq[r * cols..(r + 1) * cols]);
        hs.add(&hr);
    }
    assert_eq!(h, hs);
    assert!(
        h.clipped > 0 && h.scale_max > 0,
        "amax 5 > calibrated 4 should clip: {h:?}"
    );
}
