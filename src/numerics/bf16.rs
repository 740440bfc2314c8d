//! BF16 round-to-nearest-even, the rounding every "bf()" of the model spec means.

use half::bf16;

/// Round an f32 to the nearest BF16 (ties to even, NaN preserved) and return it widened to f32.
#[inline]
pub fn round(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// Round every element in place (in parallel from 64 Ki elements on: the GPU runner rounds every
/// op output of the BF16 paths on the host, millions of elements per op).
pub fn round_slice(xs: &mut [f32]) {
    const CHUNK: usize = 1 << 16;
    if xs.len() >= CHUNK {
        use rayon::prelude::*;
        xs.par_chunks_mut(CHUNK)
            .for_each(|c| c.iter_mut().for_each(|x| *x = round(*x)));
    } else {
        for x in xs.iter_mut() {
            *x = round(*x);
        }
    }
}

/// Whether every element is a BF16 value (NaN counts as one), in parallel from 64 Ki elements on.
pub fn all_exact(xs: &[f32]) -> bool {
    let exact = |c: &[f32]| c.iter().all(|&v| v.is_nan() || round(v) == v);
    if xs.len() >= 1 << 16 {
        use rayon::prelude::*;
        xs.par_chunks(1 << 16).all(exact)
    } else {
        exact(xs)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Bits-level reference: RNE on the upper 16 bits of the f32, written independently of `half`.
    fn rne_bits(x: f32) -> u16 {
        let b = x.to_bits();
        if x.is_nan() {
            return ((b >> 16) as u16) | 0x0040;
        }
        let lsb = (b >> 16) & 1;
        ((b + 0x7FFF + lsb) >> 16) as u16
    }

    #[test]
    fn ties_go_to_even() {
        // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: even is 1.
        assert_eq!(round(1.0 + 2f32.powi(-8)), 1.0);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
        assert_eq!(round(1.0 + 3.0 * 2f32.powi(-8)), 1.0 + 2f32.powi(-6));
        // Just above a tie rounds up.
        assert_eq!(
            round(f32::from_bits(0x3F80_8001)),
            f32::from_bits(0x3F81_0000)
        );
        assert_eq!(round(-1.0 - 2f32.powi(-8)), -1.0);
    }

    #[test]
    fn specials() {
        assert!(round(f32::NAN).is_nan());
        assert_eq!(round(f32::INFINITY), f32::INFINITY);
        assert_eq!(round(f32::NEG_INFINITY), f32::NEG_INFINITY);
        // Largest f32 rounds past the largest bf16 → inf.
        assert_eq!(round(f32::MAX), f32::INFINITY);
        assert_eq!(to_bits(-0.0), 0x8000);
        // f32 subnormal: bf16 keeps subnormals (same exponent range as f32).
        let sub = f32::from_bits(0x0001_8000); // halfway between bf16 0x0001 and 0x0002 → even 0x0002
        assert_eq!(to_bits(sub), 0x0002);
        let sub2 = f32::from_bits(0x0000_8000); // halfway between 0 and 0x0001 → 0
        assert_eq!(to_bits(sub2), 0x0000);
        assert_eq!(from_bits(0x3F80), 1.0);
    }

    #[test]
    fn slices_round_and_test_like_single_values() {
        // sizes below, at and above the parallel chunk, every value through the bit reference;
        // a sweep of bit patterns with NaN, ±inf, ±0, subnormals and ties among them
        for n in [1000usize, 1 << 16, (1 << 18) + 123] {
            let xs: Vec<f32> = (0..n as u32)
                .map(|i| match i % 97 {
                    0 => f32::NAN,
                    1 => f32::NEG_INFINITY,
                    2 => -0.0,
                    3 => f32::from_bits(0x0001_8000),
                    _ => f32::from_bits(i.wrapping_mul(0x9E37_79B9) ^ 0x8000),
                })
                .collect();
            let mut r = xs.clone();
            round_slice(&mut r);
            for (x, y) in xs.iter().zip(&r) {
                assert_eq!(y.to_bits() >> 16, rne_bits(*x) as u32, "{x:e}");
                assert_eq!(y.to_bits() & 0xFFFF, 0);
            }
            assert!(all_exact(&r));
            assert!(!all_exact(&xs));
            let mut one_off = r.clone();
            one_off[n - 1] = f32::from_bits(0x3F80_0001);
            assert!(!all_exact(&one_off), "the last element decides at n = {n}");
        }
    }

    #[test]
    fn matches_bit_reference_on_a_sweep() {
        let mut b: u32 = 1;
        while b < 0x7F80_0000 {
            for s in [0u32, 0x8000_0000] {
                let x = f32::from_bits(b | s);
                assert_eq!(to_bits(x), rne_bits(x), "bits {:#010x}", b | s);
            }
            b += 0x1357;
        }
    }
}
