//! FP4 E2M1: 1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit. No inf, no NaN.
//! Two codes per byte: the element with the even index is the LOW nibble.
//!
//! Two encoders exist because producers disagree only on the sign bit of zero results
//! (docs/NVFP4.md §1.3): the serving kernels copy the f32 sign bit, the checkpoint producers test
//! `x < 0`. The magnitude rule (round to nearest, ties to the even code, saturate at 6) is the
//! same everywhere.

/// Magnitudes of codes 0..8.
pub const LUT: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Twice the magnitude of codes 0..8, so that products of two codes are exact integers
/// (used by the integer GEMM reference).
pub const LUT_X2: [i32; 8] = [0, 1, 2, 3, 4, 6, 8, 12];

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

/// Magnitude code (0..=7) of `a = |y|` under round-to-nearest, ties to the even code,
/// saturating at 6. The thresholds are the midpoints of the E2M1 grid; the comparison kind
/// (`<=` vs `<`) at each midpoint picks the neighbour with the even mantissa bit.
/// NaN maps to 7 (what the CUDA conversion does); +inf saturates to 7.
#[inline]
#[allow(clippy::neg_cmp_op_on_partial_ord)]
pub fn encode_magnitude(a: f32) -> u8 {
    // Branch-free: count the midpoints that `a` lies beyond. Negated comparisons make every
    // term 1 for NaN, so NaN lands on 7 without a separate test.
    (!(a <= 0.25)) as u8
        + (!(a < 0.75)) as u8
        + (!(a <= 1.25)) as u8
        + (!(a < 1.75)) as u8
        + (!(a <= 2.5)) as u8
        + (!(a < 3.5)) as u8
        + (!(a <= 5.0)) as u8
}

/// Serving-kernel encoder (`cvt.rn.satfinite.e2m1x2.f32` / `__nv_cvt_float_to_fp4`): the sign
/// bit is copied from the f32 sign bit, so −0.0 and tiny negatives give 0x8; NaN gives 0x7.
#[inline]
pub fn encode(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7;
    }
    let sign = ((x.to_bits() >> 31) as u8) << 3;
    sign | encode_magnitude(x.abs())
}

/// Checkpoint-producer encoder (compressed-tensors and ModelOpt NVFP4): sign bit = `x < 0`, so
/// −0.0 gives 0x0 but a negative value that rounds to zero gives 0x8. NaN (not defined by the
/// producers) gives 0x7.
#[inline]
pub fn encode_producer(x: f32) -> u8 {
    let sign = if x < 0.0 { 0x8 } else { 0x0 };
    sign | encode_magnitude(x.abs())
}

/// Pack a row of codes, two per byte, low nibble first. An odd trailing code gets a zero high
/// nibble.
pub fn pack_row(codes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(codes.len().div_ceil(2));
    let mut it = codes.chunks_exact(2);
    for p in &mut it {
        out.push(pack(p[0], p[1]));
    }
    if let [last] = it.remainder() {
        out.push(pack(*last, 0));
    }
    out
}

/// Unpack the first `n` codes of a packed row. Codes past the end of `bytes` (when
/// `n > 2·bytes.len()`) are not invented: the result is then shorter than `n`.
pub fn unpack_row(bytes: &[u8], n: usize) -> Vec<u8> {
    let n = n.min(bytes.len() * 2);
    let mut out = Vec::with_capacity(n);
    for &b in bytes.iter().take(n.div_ceil(2)) {
        let (lo, hi) = unpack(b);
        out.push(lo);
        if out.len() < n {
            out.push(hi);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/NVFP4.md §1.3 table: every tie and its neighbours.
    #[test]
    fn rounding_table_ties_to_even() {
        let cases: [(f32, u8); 16] = [
            (0.25, 0),
            (0.75, 2),
            (1.25, 2),
            (1.75, 4),
            (2.5, 4),
            (3.5, 6),
            (5.0, 6),
            (0.2499, 0),
            (0.2501, 1),
            (0.7499, 1),
            (1.2501, 3),
            (1.7499, 3),
            (2.5001, 5),
            (3.4999, 5),
            (5.0001, 7),
            (1e30, 7),
        ];
        for (v, c) in cases {
            assert_eq!(encode_magnitude(v), c, "|y| = {v}");
            assert_eq!(encode(v), c, "y = {v}");
            assert_eq!(encode(-v), c | 8, "y = -{v}");
            assert_eq!(encode_producer(-v), c | 8, "y = -{v}");
        }
    }

    #[test]
    fn sign_of_zero_differs_by_producer() {
        assert_eq!(encode(-0.0), 0x8);
        assert_eq!(encode_producer(-0.0), 0x0);
        assert_eq!(encode(-0.1), 0x8);
        assert_eq!(encode_producer(-0.1), 0x8);
        assert_eq!(encode(f32::NAN), 0x7);
        assert_eq!(encode(-f32::NAN), 0x7);
        assert_eq!(encode(f32::NEG_INFINITY), 0xF);
    }

    #[test]
    fn every_code_round_trips() {
        for c in 0u8..16 {
            if c == 0x8 {
                assert_eq!(encode(decode(c)), 0x8);
                assert_eq!(encode_producer(decode(c)), 0x0);
            } else {
                assert_eq!(encode(decode(c)), c);
                assert_eq!(encode_producer(decode(c)), c);
            }
        }
    }

    #[test]
    fn row_packing_low_nibble_first() {
        assert_eq!(pack_row(&[1, 2, 3, 4, 5]), vec![0x21, 0x43, 0x05]);
        assert_eq!(unpack_row(&[0x21, 0x43, 0x05], 5), vec![1, 2, 3, 4, 5]);
        assert_eq!(unpack_row(&[0x21, 0x43], 4), vec![1, 2, 3, 4]);
        assert_eq!(unpack_row(&[0x21], 7), vec![1, 2]);
    }
}
