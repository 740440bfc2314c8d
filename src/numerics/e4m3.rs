//! FP8 E4M3FN (`float8_e4m3fn`): bias 7, subnormals, 0x7F/0xFF = NaN, no infinities, max 448.

/// Largest finite value.
pub const MAX: f32 = 448.0;

/// Decode one byte exactly (subnormals included; 0x7F/0xFF give NaN).
#[inline]
pub fn decode(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = ((b >> 3) & 0x0F) as i32;
    let m = (b & 0x07) as f32;
    if e == 0x0F && (b & 0x07) == 0x07 {
        return f32::NAN;
    }
    if e == 0 {
        sign * m * (2.0f32).powi(-9)
    } else {
        sign * (1.0 + m / 8.0) * (2.0f32).powi(e - 7)
    }
}

/// True for the two NaN bytes.
#[inline]
pub fn is_nan_byte(b: u8) -> bool {
    b & 0x7F == 0x7F
}
