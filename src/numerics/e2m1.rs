//! FP4 E2M1: 1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit. No inf, no NaN.
//! Two codes per byte: the element with the even index is the LOW nibble.

/// Magnitudes of codes 0..8.
pub const LUT: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Decode one 4-bit code (only the low 4 bits are read). Code 0x8 decodes to -0.0.
#[inline]
pub fn decode(code: u8) -> f32 {
    let m = LUT[(code & 7) as usize];
    if code & 8 != 0 {
        -m
    } else {
        m
    }
}

/// Split a packed byte into (even element, odd element) codes.
#[inline]
pub fn unpack(byte: u8) -> (u8, u8) {
    (byte & 0x0F, byte >> 4)
}

/// Pack two codes: `even` goes to the low nibble.
#[inline]
pub fn pack(even: u8, odd: u8) -> u8 {
    (even & 0x0F) | ((odd & 0x0F) << 4)
}
