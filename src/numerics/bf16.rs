//! BF16 round-to-nearest-even, the rounding every "bf()" of the model spec means.

use half::bf16;

/// Round an f32 to the nearest BF16 (ties to even, NaN preserved) and return it widened to f32.
#[inline]
pub fn round(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// Round every element in place.
pub fn round_slice(xs: &mut [f32]) {
    for x in xs.iter_mut() {
        *x = round(*x);
    }
}

/// Decode raw BF16 bits.
#[inline]
pub fn from_bits(b: u16) -> f32 {
    bf16::from_bits(b).to_f32()
}

/// Encode to raw BF16 bits (RNE).
#[inline]
pub fn to_bits(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}
