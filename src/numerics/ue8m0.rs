//! UE8M0 (MX scale, `float8_e8m0fnu`): unsigned biased exponent, value 2^(b-127); 0xFF = NaN.
//!
//! Encoders differ by tool (docs/NVFP4.md §2.2), and re-quantizers must pick the one of the
//! producer they emulate: torch rounds half-up on the significand, the CUDA intrinsics floor or
//! ceil the exponent. All encoders ignore the sign (the format has none; the tools read only the
//! exponent and mantissa bits).

/// Exponent bias.
pub const BIAS: i32 = 127;

/// Decode per the OCP MX spec (0x00 = 2^-127, 0xFF = NaN).
#[inline]
pub fn decode(b: u8) -> f32 {
    if b == 0xFF {
        f32::NAN
    } else {
        // 2^(b-127); 2^-127 is a subnormal f32, exact.
        (2.0f64).powi(b as i32 - 127) as f32
    }
}

/// FlashInfer's host decode builds `b << 23` as f32 bits: 0x00 → 0.0, 0xFF → +inf, otherwise
/// equal to [`decode`].
#[inline]
pub fn decode_flashinfer(b: u8) -> f32 {
    f32::from_bits((b as u32) << 23)
}

/// Which tool's float → UE8M0 rounding to reproduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Ue8m0Rounding {
    /// `torch.Tensor.to(float8_e8m0fnu)` (c10 `fp8e8m0fnu_from_fp32_value`): round up when the
    /// first dropped mantissa bit is set (significand ≥ 1.5 goes up); f32 subnormals round up
    /// only strictly above the midpoint. 0 → 0x00; inf/NaN and overflow → 0xFF (NaN).
    TorchHalfUp,
    /// `__nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundZero)`: floor(log2 x), clamped to
    /// [0x00, 0xFE]; inf → 0xFE, NaN → 0xFF.
    Floor,
    /// `__nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundPosInf)`: ceil(log2 x), clamped to
    /// [0x00, 0xFE]; inf → 0xFE, NaN → 0xFF.
    Ceil,
}

/// Encode `x` (its magnitude) to a UE8M0 byte under `rule`.
pub fn encode(x: f32, rule: Ue8m0Rounding) -> u8 {
    let bits = x.to_bits() & 0x7FFF_FFFF;
    let exp = bits >> 23;
    let man = bits & 0x7F_FFFF;
    match rule {
        Ue8m0Rounding::TorchHalfUp => {
            if exp == 0xFF {
                return 0xFF;
            }
            let g = man & 0x40_0000 != 0;
            let rs = man & 0x3F_FFFF != 0;
            let lsb = exp > 0;
            let up = g && (rs || lsb);
            (exp + up as u32) as u8 // exp ≤ 254 here, so at most 255 = NaN on overflow
        }
        Ue8m0Rounding::Floor => {
            if x.is_nan() {
                0xFF
            } else if exp == 0xFF {
                0xFE
            } else if exp == 0 {
                // Zero and f32 subnormals: floor(log2 x) ≤ -127 saturates to 2^-127.
                0x00
            } else {
                exp as u8
            }
        }
        Ue8m0Rounding::Ceil => {
            if x.is_nan() {
                0xFF
            } else if exp == 0xFF {
                0xFE
            } else if exp == 0 {
                // Subnormal f32 in (2^-127, 2^-126) → 2^-126; everything smaller (and 0) → 2^-127.
                if man > 0x40_0000 {
                    0x01
                } else {
                    0x00
                }
            } else {
                let e = exp + (man != 0) as u32;
                e.min(0xFE) as u8
            }
        }
    }
}

/// True when `x` is a power of two a UE8M0 byte can hold exactly (2^-127 ..= 2^127).
pub fn is_pow2(x: f32) -> bool {
    if x.is_nan() || x <= 0.0 || !x.is_finite() {
        return false;
    }
    let bits = x.to_bits();
    let exp = bits >> 23;
    let man = bits & 0x7F_FFFF;
    (exp > 0 && man == 0) || (exp == 0 && man == 0x40_0000)
}

/// Unbiased exponent of a (non-NaN) byte: value = 2^exponent(b).
#[inline]
pub fn exponent(b: u8) -> i32 {
    b as i32 - BIAS
}

/// Value 2^e as f32 for e in [-127, 127] (exact; 2^-127 is subnormal).
#[inline]
pub fn pow2(e: i32) -> f32 {
    (2.0f64).powi(e) as f32
}

#[cfg(test)]
mod tests {
    use super::*;
    use Ue8m0Rounding::*;

    /// docs/NVFP4.md §2.2 table, column by column.
    #[test]
    fn spec_table() {
        let rows: [(Ue8m0Rounding, [u8; 6]); 3] = [
            (TorchHalfUp, [0x00, 0x7F, 0x80, 0x7F, 0xFF, 0xFF]),
            (Floor, [0x00, 0x7F, 0x7F, 0x7E, 0xFE, 0xFF]),
            (Ceil, [0x00, 0x80, 0x80, 0x7F, 0xFE, 0xFF]),
        ];
        let inputs = [0.0f32, 1.4, 1.5, 0.75, f32::INFINITY, f32::NAN];
        for (rule, want) in rows {
            for (x, w) in inputs.iter().zip(want) {
                assert_eq!(encode(*x, rule), w, "{rule:?} x={x}");
            }
        }
        // Values that round past 2^127.
        assert_eq!(encode(f32::MAX, TorchHalfUp), 0xFF);
        assert_eq!(encode(f32::MAX, Ceil), 0xFE);
        assert_eq!(encode(f32::MAX, Floor), 0xFE);
    }

    #[test]
    fn powers_of_two_are_fixed_points() {
        for b in 0u8..=254 {
            let v = decode(b);
            assert!(is_pow2(v), "byte {b}");
            for rule in [TorchHalfUp, Floor, Ceil] {
                assert_eq!(encode(v, rule), b, "{rule:?} byte {b}");
            }
            if b > 0 {
                assert_eq!(decode_flashinfer(b), v);
            }
        }
        assert_eq!(decode_flashinfer(0), 0.0);
        assert_eq!(decode_flashinfer(0xFF), f32::INFINITY);
        assert!(decode(0xFF).is_nan());
        assert_eq!(decode(0).to_bits(), 0x0040_0000);
    }
}
