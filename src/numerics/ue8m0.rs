//! UE8M0 (MX scale, `float8_e8m0fnu`): unsigned biased exponent, value 2^(b-127); 0xFF = NaN.

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
