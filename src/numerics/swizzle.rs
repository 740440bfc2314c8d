//! Swizzled scale-factor layouts of the serving kernels (docs/NVFP4.md §5). Checkpoints store scales
//! linear; only engines swizzle. `rows` is M (activations) or N (weights); `cols` is the number
//! of scale columns (K/16 for NVFP4, K/32 for MX). Padding bytes are zero because the kernels
//! read them (uninitialised padding once caused NaN contamination, vLLM PR #37564).

/// Padded (rows, cols) of the 128×4 layout.
#[inline]
pub fn padded_128x4(rows: usize, cols: usize) -> (usize, usize) {
    (rows.div_ceil(128) * 128, cols.div_ceil(4) * 4)
}

/// Padded (rows, cols) of the 8×4 layout.
#[inline]
pub fn padded_8x4(rows: usize, cols: usize) -> (usize, usize) {
    (rows.div_ceil(8) * 8, cols.div_ceil(4) * 4)
}

/// Byte offset of scale (r, c) in the CUTLASS `SfKMajorAtom` 128×4 layout; `cols` is the
/// unpadded scale-column count.
#[inline]
pub fn offset_128x4(r: usize, c: usize, cols: usize) -> usize {
    let cp4 = cols.div_ceil(4);
    ((r / 128) * cp4 + c / 4) * 512 + (r % 32) * 16 + ((r / 32) % 4) * 4 + (c % 4)
}

/// Byte offset of scale (r, c) in the TRT-LLM 8×4 layout.
#[inline]
pub fn offset_8x4(r: usize, c: usize, cols: usize) -> usize {
    let cp4 = cols.div_ceil(4);
    (r / 8) * cp4 * 32 + (c / 4) * 32 + (r % 8) * 4 + (c % 4)
}

fn swizzle_with(
    linear: &[u8],
    rows: usize,
    cols: usize,
    padded: (usize, usize),
    off: fn(usize, usize, usize) -> usize,
) -> Vec<u8> {
    assert_eq!(
        linear.len(),
        rows * cols,
        "scale length vs [{rows}, {cols}]"
    );
    let mut out = vec![0u8; padded.0 * padded.1];
    for r in 0..rows {
        for c in 0..cols {
            out[off(r, c, cols)] = linear[r * cols + c];
        }
    }
    out
}

fn unswizzle_with(
    buf: &[u8],
    rows: usize,
    cols: usize,
    padded: (usize, usize),
    off: fn(usize, usize, usize) -> usize,
) -> Vec<u8> {
    assert_eq!(buf.len(), padded.0 * padded.1, "swizzled buffer length");
    let mut out = vec![0u8; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            out[r * cols + c] = buf[off(r, c, cols)];
        }
    }
    out
}

/// Linear `[rows, cols]` → 128×4-swizzled buffer of `ceil(rows/128)·128 × ceil(cols/4)·4`
/// bytes, padding zero.
///
/// # Panics
/// If `linear.len() != rows·cols`.
pub fn swizzle_128x4(linear: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    swizzle_with(linear, rows, cols, padded_128x4(rows, cols), offset_128x4)
}

/// Inverse of [`swizzle_128x4`]: drops the padding.
///
/// # Panics
/// If `buf` is not exactly the padded size.
pub fn unswizzle_128x4(buf: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    unswizzle_with(buf, rows, cols, padded_128x4(rows, cols), offset_128x4)
}

/// Linear `[rows, cols]` → 8×4-swizzled buffer of `ceil(rows/8)·8 × ceil(cols/4)·4` bytes.
///
/// # Panics
/// If `linear.len() != rows·cols`.
pub fn swizzle_8x4(linear: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    swizzle_with(linear, rows, cols, padded_8x4(rows, cols), offset_8x4)
}

/// Inverse of [`swizzle_8x4`].
///
/// # Panics
/// If `buf` is not exactly the padded size.
pub fn unswizzle_8x4(buf: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    unswizzle_with(buf, rows, cols, padded_8x4(rows, cols), offset_8x4)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The spec's inverse formula, written separately, must undo `offset_128x4` on every slot.
    #[test]
    fn offset_128x4_is_a_bijection_matching_the_spec_inverse() {
        let (rows, cols) = (256, 12);
        let (rp, cp) = padded_128x4(rows, cols);
        let mut seen = vec![false; rp * cp];
        for r in 0..rp {
            for c in 0..cp {
                let o = offset_128x4(r, c, cols);
                assert!(!seen[o]);
                seen[o] = true;
                let (tile, t) = (o / 512, o % 512);
                let rr = (tile / (cp / 4)) * 128 + ((t / 4) % 4) * 32 + t / 16;
                let cc = (tile % (cp / 4)) * 4 + t % 4;
                assert_eq!((rr, cc), (r, c));
            }
        }
    }

    #[test]
    fn padding_is_zero_8x4() {
        let lin: Vec<u8> = (1..=15).collect(); // 3 × 5
        let sw = swizzle_8x4(&lin, 3, 5);
        assert_eq!(sw.len(), 8 * 8);
        assert_eq!(sw.iter().filter(|&&b| b != 0).count(), 15);
        // (r=1, c=4): (0)·2·32 + 1·32 + 1·4 + 0 = 36.
        assert_eq!(sw[36], lin[5 + 4]);
        assert_eq!(unswizzle_8x4(&sw, 3, 5), lin);
    }
}
