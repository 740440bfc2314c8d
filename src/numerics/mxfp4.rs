//! MXFP4 (OCP MX): E2M1 elements in 32-element blocks, UE8M0 scale, no tensor scale.

use super::{e2m1, ue8m0};

/// Elements per block.
pub const BLOCK: usize = 32;

/// Dequantise a packed `[rows, cols/2]` tensor with `[rows, cols/32]` UE8M0 scale bytes.
pub fn dequantize(packed: &[u8], scales: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    assert_eq!(cols % BLOCK, 0);
    assert_eq!(packed.len(), rows * cols / 2);
    assert_eq!(scales.len(), rows * cols / BLOCK);
    let nb = cols / BLOCK;
    let mut out = vec![0f32; rows * cols];
    for r in 0..rows {
        for b in 0..nb {
            let s = ue8m0::decode(scales[r * nb + b]);
            let base = r * cols + b * BLOCK;
            for i in 0..BLOCK / 2 {
                let (lo, hi) = e2m1::unpack(packed[base / 2 + i]);
                out[base + 2 * i] = e2m1::decode(lo) * s;
                out[base + 2 * i + 1] = e2m1::decode(hi) * s;
            }
        }
    }
    out
}

/// Which producer's scale-exponent choice to reproduce (docs/NVFP4.md §6.2). Decoders don't care;
/// re-quantizers do, because the rules differ on where a block starts clipping.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Mxfp4Rule {
    /// OCP MX spec: e = floor(log2 amax) − 2 (amax/2^e up to ~8 clips to 6).
    Ocp,
    /// compressed-tensors / vLLM `reference_mxfp4` / torchao EVEN: add 0.25 to the significand
    /// of amax (round to a power of two at ≥ 1.75), truncate, then floor(log2) − 2.
    Even,
    /// ModelOpt `MXFP4QTensor`, FlashInfer `mxfp4_quantize`: e = ceil(log2(fl(amax/6))); never clips.
    Ceil,
    /// vLLM MXFP4 activation quant before PR #43557: exponent bits of fl(amax/6), i.e.
    /// floor(log2(amax/6)); clips up to 12 → 6.
    TruncDiv6,
}

/// Biased UE8M0 scale byte of a 32-element block with max |x| = `amax` under `rule`, clamped
/// to [0x00, 0xFE]. amax = 0 (and f32-subnormal amax) gives 0x00 (2^-127); NaN gives 0xFF;
/// +inf gives 0xFE.
pub fn scale_exponent(amax: f32, rule: Mxfp4Rule) -> u8 {
    if amax.is_nan() {
        return 0xFF;
    }
    let a = amax.abs();
    if a.is_infinite() {
        return 0xFE;
    }
    let clamp = |e: i32| (e + ue8m0::BIAS).clamp(0, 254) as u8;
    match rule {
        Mxfp4Rule::Ocp => {
            let exp = (a.to_bits() >> 23) as i32;
            if exp == 0 {
                0
            } else {
                clamp(exp - 127 - 2)
            }
        }
        Mxfp4Rule::Even => {
            let bits = (a.to_bits() + 0x20_0000) & 0xFF80_0000;
            let exp = (bits >> 23) as i32;
            if exp == 0 {
                0
            } else if exp == 0xFF {
                // The rounding overflowed to inf: log2 = inf, clamped to the largest exponent.
                0xFE
            } else {
                clamp(exp - 127 - 2)
            }
        }
        Mxfp4Rule::Ceil => ue8m0::encode(a / 6.0, ue8m0::Ue8m0Rounding::Ceil),
        Mxfp4Rule::TruncDiv6 => ue8m0::encode(a / 6.0, ue8m0::Ue8m0Rounding::Floor),
    }
}

/// Quantise a row-major `[rows, cols]` tensor to MXFP4: per 32-element block, scale byte from
/// [`scale_exponent`], elements `x / 2^(byte−127)` (exact power-of-two scaling) rounded to E2M1
/// with ties to even, saturating at ±6, sign bit `x < 0` (compressed-tensors convention).
/// Returns (packed `[rows, cols/2]`, scale bytes `[rows, cols/32]`).
///
/// # Panics
/// If `cols` is not a multiple of 32 or `w.len() != rows·cols`.
pub fn quantize(w: &[f32], rows: usize, cols: usize, rule: Mxfp4Rule) -> (Vec<u8>, Vec<u8>) {
    assert_eq!(cols % BLOCK, 0, "MXFP4 needs cols multiple of {BLOCK}");
    assert_eq!(w.len(), rows * cols, "data length vs [{rows}, {cols}]");
    let mut packed = vec![0u8; rows * cols / 2];
    let mut scales = vec![0u8; rows * cols / BLOCK];
    for (xb, (pb, sb)) in w
        .chunks_exact(BLOCK)
        .zip(packed.chunks_exact_mut(BLOCK / 2).zip(scales.iter_mut()))
    {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let b = scale_exponent(amax, rule);
        *sb = b;
        // f64 keeps x·2^(127−b) exact even where 2^(127−b) is not a normal f32; the product has
        // ≤ 24 significant bits so the cast back is exact unless it overflows (→ inf → 6).
        let inv = if b == 0xFF {
            f64::NAN
        } else {
            2f64.powi(ue8m0::BIAS - b as i32)
        };
        for (i, p) in pb.iter_mut().enumerate() {
            let lo = e2m1::encode_producer((xb[2 * i] as f64 * inv) as f32);
            let hi = e2m1::encode_producer((xb[2 * i + 1] as f64 * inv) as f32);
            *p = e2m1::pack(lo, hi);
        }
    }
    (packed, scales)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/NVFP4.md §6.2: measured compressed-tensors (Even) vs ModelOpt (Ceil) scale bytes.
    #[test]
    fn ct_vs_modelopt_examples() {
        let cases: [(f32, u8, u8); 9] = [
            (1.74, 125, 126),
            (6.1, 127, 128),
            (1.0, 125, 125),
            (1.5, 125, 125),
            (1.75, 126, 126),
            (2.0, 126, 126),
            (3.0, 126, 126),
            (5.9, 127, 127),
            (6.0, 127, 127),
        ];
        for (a, ct, mo) in cases {
            assert_eq!(scale_exponent(a, Mxfp4Rule::Even), ct, "Even {a}");
            assert_eq!(scale_exponent(a, Mxfp4Rule::Ceil), mo, "Ceil {a}");
        }
        for (a, same) in [(7.0f32, 128u8), (0.3, 123)] {
            assert_eq!(scale_exponent(a, Mxfp4Rule::Even), same, "Even {a}");
            assert_eq!(scale_exponent(a, Mxfp4Rule::Ceil), same, "Ceil {a}");
        }
    }

    #[test]
    fn ocp_and_trunc_rules() {
        // OCP: floor(log2 6) − 2 = 0; floor(log2 7.9) − 2 = 0; floor(log2 8) − 2 = 1.
        assert_eq!(scale_exponent(6.0, Mxfp4Rule::Ocp), 127);
        assert_eq!(scale_exponent(7.9, Mxfp4Rule::Ocp), 127);
        assert_eq!(scale_exponent(8.0, Mxfp4Rule::Ocp), 128);
        // Trunc: floor(log2(11.9/6)) = 0 → amax/1 = 11.9 clips to 6.
        assert_eq!(scale_exponent(11.9, Mxfp4Rule::TruncDiv6), 127);
        assert_eq!(scale_exponent(12.0, Mxfp4Rule::TruncDiv6), 128);
        for r in [
            Mxfp4Rule::Ocp,
            Mxfp4Rule::Even,
            Mxfp4Rule::Ceil,
            Mxfp4Rule::TruncDiv6,
        ] {
            assert_eq!(scale_exponent(0.0, r), 0);
            assert_eq!(scale_exponent(f32::NAN, r), 0xFF);
        }
    }

    #[test]
    fn quantize_block_examples() {
        // Block with amax 1.74 under Even: scale 2^-2, 1.74·4 = 6.96 → clips to 6 (code 7).
        let mut w = vec![0f32; 32];
        w[0] = 1.74;
        w[1] = -0.5; // ·4 = −2 → 0xC
        w[2] = 0.3125; // ·4 = 1.25 → tie → 1 (0x2)
        w[3] = -0.01; // → 0x8 (negative rounding to zero)
        let (p, s) = quantize(&w, 1, 32, Mxfp4Rule::Even);
        assert_eq!(s, vec![125]);
        assert_eq!(&p[..2], &[0xC7, 0x82]);
        assert!(p[2..].iter().all(|&b| b == 0));
        let d = dequantize(&p, &s, 1, 32);
        assert_eq!(&d[..3], &[1.5, -0.5, 0.25]);
        // Ceil never clips: amax 1.74 → 2^-1, 1.74·2 = 3.48 → 3.
        let (p, s) = quantize(&w, 1, 32, Mxfp4Rule::Ceil);
        assert_eq!(s, vec![126]);
        assert_eq!(p[0] & 0xF, 0x5);
    }
}
