//! NVFP4: E2M1 elements in 16-element blocks along K, one E4M3 scale per block, one FP32
//! tensor scale. Two conventions for the tensor scale (NVFP4.md §3):
//! compressed-tensors stores the ENCODE scale g = 2688/amax (a divisor),
//! ModelOpt stores the DECODE scale d = amax/2688 (a multiplier).

use super::{e2m1, e4m3};

/// Elements per block.
pub const BLOCK: usize = 16;

/// Which producer's decode order to use for dequantisation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Convention {
    /// `e2m1 · fl(s / g)` with g the stored `weight_global_scale` (compressed-tensors).
    CompressedTensors,
    /// `e2m1 · fl(s · d)` with d the stored `weight_scale_2` (ModelOpt).
    ModelOpt,
}

/// Dequantise a packed `[rows, cols/2]` NVFP4 tensor with linear `[rows, cols/16]` E4M3 scale
/// bytes and the stored tensor scale, in the given producer's op order. Bit-exact against the
/// producers' own f32 dequantisation.
pub fn dequantize(
    packed: &[u8],
    scales: &[u8],
    global: f32,
    conv: Convention,
    rows: usize,
    cols: usize,
) -> Vec<f32> {
    assert_eq!(cols % BLOCK, 0);
    assert_eq!(packed.len(), rows * cols / 2);
    assert_eq!(scales.len(), rows * cols / BLOCK);
    let mut out = vec![0f32; rows * cols];
    let nb = cols / BLOCK;
    for r in 0..rows {
        for b in 0..nb {
            let s = e4m3::decode(scales[r * nb + b]);
            let q = match conv {
                Convention::CompressedTensors => s / global,
                Convention::ModelOpt => s * global,
            };
            let base = r * cols + b * BLOCK;
            for i in 0..BLOCK / 2 {
                let (lo, hi) = e2m1::unpack(packed[base / 2 + i]);
                out[base + 2 * i] = e2m1::decode(lo) * q;
                out[base + 2 * i + 1] = e2m1::decode(hi) * q;
            }
        }
    }
    out
}
