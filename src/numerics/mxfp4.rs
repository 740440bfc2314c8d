//! MXFP4 (OCP MX): E2M1 elements in 32-element blocks, UE8M0 scale, no tensor scale.

use super::{e2m1, ue8m0};

/// Elements per block.
pub const BLOCK: usize = 32;

/// Dequantise a packed `[rows, cols/2]` tensor with `[rows, cols/32]` UE8M0 scale bytes.
pub fn dequantize(packed: &[u8], scales: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    assert_eq!(cols % BLOCK, 0);
    assert_eq!(packed.len(), rows * cols / 2);
    assert_eq!(scales.len(), rows * cols / BLOCK);
    let nb = cols / BLOCK;
    let mut out = vec![0f32; rows * cols];
    for r in 0..rows {
        for b in 0..nb {
            let s = ue8m0::decode(scales[r * nb + b]);
            let base = r * cols + b * BLOCK;
            for i in 0..BLOCK / 2 {
                let (lo, hi) = e2m1::unpack(packed[base / 2 + i]);
                out[base + 2 * i] = e2m1::decode(lo) * s;
                out[base + 2 * i + 1] = e2m1::decode(hi) * s;
            }
        }
    }
    out
}
