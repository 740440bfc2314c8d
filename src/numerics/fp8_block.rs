//! Block-FP8 weights (DeepSeek style): E4M3 weight, one scale per `bm × bn` block (128×128 by
//! default). The scale is a dequant MULTIPLIER whether stored as f32 (`weight_scale_inv`) or as
//! UE8M0 bytes (`.scale` in the official V4 checkpoints).

use super::e4m3;

/// Dequantise `[rows, cols]` E4M3 bytes with a row-major `[ceil(rows/bm), ceil(cols/bn)]`
/// grid of f32 multipliers (already decoded from f32 or UE8M0).
pub fn dequantize(
    w: &[u8],
    scales: &[f32],
    rows: usize,
    cols: usize,
    bm: usize,
    bn: usize,
) -> Vec<f32> {
    assert_eq!(w.len(), rows * cols);
    let sc = cols.div_ceil(bn);
    assert_eq!(scales.len(), rows.div_ceil(bm) * sc);
    let mut out = vec![0f32; rows * cols];
    for r in 0..rows {
        let srow = &scales[(r / bm) * sc..(r / bm + 1) * sc];
        for c in 0..cols {
            out[r * cols + c] = e4m3::decode(w[r * cols + c]) * srow[c / bn];
        }
    }
    out
}
