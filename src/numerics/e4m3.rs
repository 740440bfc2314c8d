//! FP8 E4M3FN (`float8_e4m3fn`): bias 7, subnormals, 0x7F/0xFF = NaN, no infinities, max 448.
//!
//! Two encoders because the stack disagrees only out of range (docs/NVFP4.md §2.1): the CUDA
//! kernels saturate (`__nv_fp8_e4m3(float)`, SATFINITE), torch's `.to(float8_e4m3fn)` turns
//! anything that rounds past 448 into NaN. A Python reference that forgets to clamp before the
//! torch cast produces NaN block scales; `encode_torch` reproduces that failure.

/// Largest finite value.
pub const MAX: f32 = 448.0;

/// Byte of +448.
pub const MAX_BYTE: u8 = 0x7E;

/// Canonical NaN byte.
pub const NAN_BYTE: u8 = 0x7F;

/// Decode one byte exactly (subnormals included; 0x7F/0xFF give NaN).
#[inline]
pub fn decode(b: u8) -> f32 {
    DECODE_LUT[b as usize]
}

const fn decode_slow(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = ((b >> 3) & 0x0F) as i32;
    let m = (b & 0x07) as f32;
    if e == 0x0F && (b & 0x07) == 0x07 {
        return f32::NAN;
    }
    // Powers of two built from bits so this stays a const fn (exact for every exponent used).
    if e == 0 {
        sign * m * f32::from_bits((127 - 9) << 23)
    } else {
        sign * (1.0 + m / 8.0) * f32::from_bits(((e - 7 + 127) as u32) << 23)
    }
}

const fn build_lut() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = decode_slow(i as u8);
        i += 1;
    }
    t
}

/// Every byte's value; decoding is on the hot path of every NVFP4 block.
pub static DECODE_LUT: [f32; 256] = build_lut();

/// True for the two NaN bytes.
#[inline]
pub fn is_nan_byte(b: u8) -> bool {
    b & 0x7F == 0x7F
}

/// Round |x| (finite, non-negative) to the nearest E4M3 magnitude, ties to even, and return
/// the unsigned code. The code may be 0x7F (or above, for |x| ≥ 480) when the value rounds past
/// 448: the callers decide whether that saturates or is NaN.
#[inline]
fn round_magnitude(a: f32) -> u32 {
    // Below the smallest normal (2^-6) the quantum is 2^-9: scale up exactly and round to an
    // integer. 8 (= 2^-6) comes out as code 0x08, the smallest normal, by construction.
    if a < 0.015625 {
        return (a * 512.0).round_ties_even() as u32;
    }
    if a >= 512.0 {
        return 0x80; // certainly out of range (sentinel above every finite code)
    }
    let bits = a.to_bits();
    let exp = (bits >> 23) as i32 - 127; // -6..=8
    let man = bits & 0x7F_FFFF;
    let keep = man >> 20;
    let rest = man & 0xF_FFFF;
    let half = 0x8_0000;
    let up = rest > half || (rest == half && (keep & 1) == 1);
    // A carry out of the 3 mantissa bits increments the exponent field, which is what we want.
    ((((exp + 7) as u32) << 3) | keep) + up as u32
}

/// `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)` = the `__nv_fp8_e4m3(float)`
/// constructor of the serving kernels: RNE including subnormals; anything rounding past 448
/// and +inf give 0x7E, −inf gives 0xFE, NaN gives 0x7F.
#[inline]
pub fn encode_satfinite(x: f32) -> u8 {
    if x.is_nan() {
        return NAN_BYTE;
    }
    let sign = ((x.to_bits() >> 31) as u8) << 7;
    let a = x.abs();
    let code = if a.is_infinite() {
        MAX_BYTE as u32
    } else {
        round_magnitude(a).min(MAX_BYTE as u32)
    };
    sign | code as u8
}

/// `torch.Tensor.to(torch.float8_e4m3fn)` (CPU and CUDA), also ml_dtypes and the NOSAT CUDA
/// path: RNE; (448, 464] → 448 (it rounds there), above 464 and ±inf → NaN (0x7F / 0xFF).
#[inline]
pub fn encode_torch(x: f32) -> u8 {
    if x.is_nan() {
        return NAN_BYTE;
    }
    let sign = ((x.to_bits() >> 31) as u8) << 7;
    let a = x.abs();
    let code = if a.is_infinite() {
        NAN_BYTE as u32
    } else {
        round_magnitude(a).min(NAN_BYTE as u32)
    };
    sign | code as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_lut_matches_formula() {
        // Independent formula via f64 powers.
        for b in 0u16..256 {
            let b = b as u8;
            let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
            let e = ((b >> 3) & 15) as i32;
            let m = (b & 7) as f64;
            let want = if e == 15 && b & 7 == 7 {
                f64::NAN
            } else if e == 0 {
                s * m * 2f64.powi(-9)
            } else {
                s * (1.0 + m / 8.0) * 2f64.powi(e - 7)
            };
            let got = decode(b) as f64;
            assert!(
                got == want || (got.is_nan() && want.is_nan()),
                "byte {b:#04x}"
            );
        }
        assert_eq!(decode(0x38), 1.0);
        assert_eq!(decode(0x20), 0.125);
        assert_eq!(decode(0x5B), 22.0);
        assert_eq!(decode(0x7E), 448.0);
        assert_eq!(decode(0x08), 0.015625);
        assert_eq!(decode(0x01), 0.001953125);
    }
}
