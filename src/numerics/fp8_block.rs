//! Block-FP8 weights (DeepSeek style): E4M3 weight, one scale per `bm × bn` block (128×128 by
//! default). The scale is a dequant MULTIPLIER whether stored as f32 (`weight_scale_inv`) or as
//! UE8M0 bytes (`.scale` in the official V4 checkpoints).

use super::{e4m3, ue8m0};

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

/// How a block-FP8 weight's scale is stored and therefore rounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Fp8ScaleFmt {
    /// f32 `weight_scale_inv` = amax/448 (DeepSeek-V3 style).
    F32,
    /// Power of two rounded up, `2^ceil(log2(amax/448))` (`scale_fmt: ue8m0`, and vLLM's
    /// DeepGEMM re-quantisation at load time).
    Ue8m0,
}

/// Which runtime activation quantiser (per token, per 128-element group) to emulate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ActScale {
    /// DeepSeek `act_quant(..., scale_fmt="ue8m0")`: a = max(amax, 1e-4),
    /// s = 2^ceil(log2(a · fl(1/448))) (the kernel multiplies by `fp8_max_inv`; the ceil is the
    /// same as for a/448 at every a, see the tests).
    DeepSeekPow2,
    /// vLLM `per_token_group_quant_fp8` (Triton): s = max(amax, 1e-10) / 448.
    VllmF32,
}

/// 2^ceil(log2 v) for positive finite v, as f32 (exact bit-level ceil, not a libm log2).
fn pow2_ceil(v: f32) -> f32 {
    ue8m0::decode(ue8m0::encode(v, ue8m0::Ue8m0Rounding::Ceil))
}

/// Quantise a row-major `[rows, cols]` weight to block FP8: one scale per `bm × bn` block
/// (partial edge blocks allowed), E4M3 elements `e4m3_satfinite(x / s)`. F32: s = amax/448;
/// UE8M0: s = 2^ceil(log2(amax/448)); an all-zero block gets s = 1. Returns (E4M3 bytes
/// `[rows, cols]`, scale multipliers `[ceil(rows/bm), ceil(cols/bn)]`), the inputs of
/// [`dequantize`].
///
/// # Panics
/// If `w.len() != rows·cols` or a block dimension is 0.
pub fn quantize_weight(
    w: &[f32],
    rows: usize,
    cols: usize,
    bm: usize,
    bn: usize,
    fmt: Fp8ScaleFmt,
) -> (Vec<u8>, Vec<f32>) {
    assert_eq!(w.len(), rows * cols, "data length vs [{rows}, {cols}]");
    assert!(bm > 0 && bn > 0, "block dims must be positive");
    let (sr, sc) = (rows.div_ceil(bm), cols.div_ceil(bn));
    let mut scales = vec![1f32; sr * sc];
    for br in 0..sr {
        for bc in 0..sc {
            let mut a = 0f32;
            for r in br * bm..((br + 1) * bm).min(rows) {
                for c in bc * bn..((bc + 1) * bn).min(cols) {
                    a = a.max(w[r * cols + c].abs());
                }
            }
            if a > 0.0 {
                scales[br * sc + bc] = match fmt {
                    Fp8ScaleFmt::F32 => a / e4m3::MAX,
                    Fp8ScaleFmt::Ue8m0 => pow2_ceil(a / e4m3::MAX),
                };
            }
        }
    }
    let mut q = vec![0u8; rows * cols];
    for r in 0..rows {
        let srow = &scales[(r / bm) * sc..(r / bm + 1) * sc];
        for c in 0..cols {
            q[r * cols + c] = e4m3::encode_satfinite(w[r * cols + c] / srow[c / bn]);
        }
    }
    (q, scales)
}

/// Group size of the runtime activation quantisation.
pub const ACT_GROUP: usize = 128;

/// Quantise-dequantise a row-major `[rows, cols]` activation per token and per 128-element
/// group (a shorter last group is allowed): `q = e4m3_satfinite(clamp(x/s, ±448))`,
/// `x̂ = e4m3(q)·s` in f32, with s per [`ActScale`].
///
/// # Panics
/// If `x.len() != rows·cols`.
pub fn fake_quant_act_1x128(x: &[f32], rows: usize, cols: usize, which: ActScale) -> Vec<f32> {
    fake_quant_groups(x, rows, cols, cols, ACT_GROUP, |a| {
        Some(match which {
            ActScale::DeepSeekPow2 => deepseek_pow2_scale(a),
            ActScale::VllmF32 => a.max(1e-10) / e4m3::MAX,
        })
    })
}

/// DeepSeek's power-of-two FP8 scale of a group of amax `a`: 2^ceil(log2(max(a, 1e-4) · fl(1/448))).
fn deepseek_pow2_scale(a: f32) -> f32 {
    pow2_ceil(a.max(1e-4) * (1.0f32 / e4m3::MAX))
}

/// Quantise-dequantise columns [0, width) of `[rows, cols]` per row and per `group` elements (a
/// shorter last group is allowed) with the scale `scale(amax)` gives the group: `x̂ =
/// e4m3(e4m3_satfinite(clamp(x/s, ±448)))·s`; None leaves the group 0. Columns [width, cols) are
/// copied.
fn fake_quant_groups(
    x: &[f32],
    rows: usize,
    cols: usize,
    width: usize,
    group: usize,
    scale: impl Fn(f32) -> Option<f32>,
) -> Vec<f32> {
    assert_eq!(x.len(), rows * cols, "data length vs [{rows}, {cols}]");
    let mut out = vec![0f32; x.len()];
    if cols == 0 {
        return out;
    }
    for (xr, or) in x.chunks_exact(cols).zip(out.chunks_exact_mut(cols)) {
        or[width..].copy_from_slice(&xr[width..]);
        for (xg, og) in xr[..width].chunks(group).zip(or[..width].chunks_mut(group)) {
            let Some(s) = scale(xg.iter().fold(0f32, |m, v| m.max(v.abs()))) else {
                continue;
            };
            for (&xv, o) in xg.iter().zip(og.iter_mut()) {
                let q = e4m3::encode_satfinite((xv / s).clamp(-e4m3::MAX, e4m3::MAX));
                *o = e4m3::decode(q) * s;
            }
        }
    }
    out
}

/// Elements per scale of an MXFP8 activation ([`fake_quant_act_mxfp8`]).
pub const MX_GROUP: usize = 32;

/// MXFP8 activation quantize-dequantize as TensorRT-LLM's / FlashInfer's `mxfp8_quantize` does it
/// in front of an MXFP4 × MXFP8 MoE GEMM (gpt-oss W4A8 on Blackwell): per row, per 32 elements,
/// s = 2^ceil(log2(amax · rcp(448))) with the kernel's approximate reciprocal
/// (`reciprocal_approximate_ftz`, [`super::nvfp4::rcp_approx`]), UE8M0 rounded up, no floor;
/// q = e4m3_satfinite(x / s) (s is a power of two: the same as x · (1/s)); out = q · s; a block
/// whose amax is 0 stays 0.
pub fn fake_quant_act_mxfp8(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let rcp448 = super::nvfp4::rcp_approx(e4m3::MAX);
    fake_quant_groups(x, rows, cols, cols, MX_GROUP, |a| {
        (a != 0.0).then(|| pow2_ceil(a * rcp448))
    })
}

/// Columns per scale of an engine's FP8 KV cache ([`fake_quant_kv_cache`]): vLLM's
/// `fp8_ds_mla` layout of the attention's keys.
pub const KV_GROUP: usize = 64;

/// Columns per scale of the indexer's FP8 key cache (one scale per 128-wide key, as vLLM's
/// sparse-attention indexer stores it).
pub const INDEXER_KEY_GROUP: usize = 128;

/// What an engine's FP8 cache gives back for rows x `[rows, cols]`: columns [0, nope)
/// quantize-dequantized per token and per `group` columns with DeepSeek's power-of-two scale (as
/// [`fake_quant_act_1x128`] with [`ActScale::DeepSeekPow2`]), columns [nope, cols) as they are.
/// The attention's KV cache (vLLM's `fp8_ds_mla`, docs/DSV4-LAYER.md §3.4 step 5): nope = 448,
/// group [`KV_GROUP`], the RoPE part stored BF16; the indexer's keys: every column, group
/// [`INDEXER_KEY_GROUP`].
///
/// # Panics
/// If `x.len() != rows·cols`, `nope > cols` or `group == 0`.
pub fn fake_quant_kv_cache(
    x: &[f32],
    rows: usize,
    cols: usize,
    nope: usize,
    group: usize,
) -> Vec<f32> {
    assert!(nope <= cols, "nope {nope} > cols {cols}");
    assert!(group > 0, "group 0");
    fake_quant_groups(x, rows, cols, nope, group, |a| Some(deepseek_pow2_scale(a)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// MXFP8 by hand (E4M3 per 32, TensorRT-LLM's rounded-up UE8M0 scale). amax 1 → s = 2^-8
    /// (1/448 = 2^-8.8): 0.3 · 256 = 76.8 → E4M3 80 → 0.3125, and 2.2e-5 · 256 = 2.88 subnormal
    /// steps of 2^-9 → 3 → 3 · 2^-17. amax 1.75 = 448 · 2^-8 keeps s = 2^-8 (1.75 · rcp(448)
    /// lands on 2^-8 exactly); one ulp more takes s = 2^-7, where 2.2e-5 is 1.44 steps → 2^-16.
    /// amax 1e-8: s = 2^-35 (no floor; DeepSeek's 1x128 floors the amax at 1e-4), 343.6 → 352.
    /// A zero block stays zero; the last block is partial; rows are independent.
    #[test]
    fn mxfp8_activation_matches_hand_values() {
        let tiny = 2.2e-5f32;
        let mut x = vec![0f32; 72];
        x[..4].copy_from_slice(&[1.0, 0.3, -0.3, tiny]);
        x[32] = 1.75;
        x[33] = tiny;
        x[64] = 1e-8;
        let y = fake_quant_act_mxfp8(&x, 1, 72);
        let step = |e: i32| 2f32.powi(e);
        assert_eq!(&y[..4], &[1.0, 0.3125, -0.3125, 3.0 * step(-17)]);
        assert_eq!((y[32], y[33]), (1.75, 3.0 * step(-17)));
        assert_eq!(y[64], 352.0 * step(-35));
        assert!(y[4..32]
            .iter()
            .chain(&y[34..64])
            .chain(&y[65..])
            .all(|&v| v == 0.0));
        x[32] = f32::from_bits(1.75f32.to_bits() + 1);
        let y = fake_quant_act_mxfp8(&x, 1, 72);
        assert_eq!((y[32], y[33]), (1.75, step(-16)));
        assert!(fake_quant_act_mxfp8(&[0.0; 40], 1, 40)
            .iter()
            .all(|&v| v == 0.0));
        // amax 100 in the second row: s = 2^ceil(log2(100/448)) = 2^-2; 100 · 4 = 400 lies halfway
        // between 384 and 416 → 384 (even mantissa) → 96; 0.3 · 4 = 1.2 → 1.25 → 0.3125
        let two = fake_quant_act_mxfp8(&[1.0, 0.3, 100.0, 0.3], 2, 2);
        assert_eq!(two, [1.0, 0.3125, 96.0, 0.3125]);
    }

    #[test]
    fn kv_cache_rounds_the_nope_part_per_64_and_keeps_the_rope_part() {
        // row 0: a group of 64 with amax 448·2 → s = 2, then 64 values of amax 1 → s = 2^-8
        // (1/448 rounded up to a power of two); the rope part (last 4) untouched
        let (nope, cols) = (128, 132);
        let mut x = vec![0f32; cols];
        x[0] = 896.0;
        x[1] = 3.0; // 3/2 = 1.5 exactly representable
        x[2] = 2.3; // 1.15 → e4m3 1.125 → 2.25
        x[64] = 1.0;
        x[65] = 0.3; // 0.3·256 = 76.8 → e4m3 (step 8 in [64, 128)) 80 → 0.3125
        x[128..132].copy_from_slice(&[0.1, -7.7, 1e-3, 123.456]);
        let y = fake_quant_kv_cache(&x, 1, cols, nope, KV_GROUP);
        assert_eq!(y[0], 896.0);
        assert_eq!(y[1], 3.0);
        assert_eq!(y[2], 2.25);
        assert_eq!(y[64], 1.0);
        assert_eq!(y[65], 0.3125);
        assert_eq!(&y[128..], &x[128..]);
        // the nope part of a group equals the 1×128 quantizer applied to that group alone
        let g = fake_quant_act_1x128(&x[64..128], 1, 64, ActScale::DeepSeekPow2);
        assert_eq!(&y[64..128], &g[..]);
        // the indexer's keys: every column, one scale per 128 = the 1×128 quantizer
        let k = fake_quant_kv_cache(&x[..128], 1, 128, 128, INDEXER_KEY_GROUP);
        let a = fake_quant_act_1x128(&x[..128], 1, 128, ActScale::DeepSeekPow2);
        assert_eq!(k, a);
        // 0.3 beside 896 in one group of 128 (scale 2): 0.15 → e4m3 0.15625 → 0.3125
        assert_eq!(k[65], 0.3125);
    }

    #[test]
    fn deepseek_scale_multiply_equals_divide_for_ceil() {
        // The kernel computes a·fl(1/448); the spec writes a/448. Their ceil(log2) agree on
        // every f32 within a few thousand ulps of each power-of-two boundary 448·2^j.
        let inv = 1.0f32 / 448.0;
        for j in -20..20 {
            let edge = 448.0f32 * 2f32.powi(j);
            let mut b = edge.to_bits() - 2000;
            while b < edge.to_bits() + 2000 {
                let a = f32::from_bits(b);
                assert_eq!(pow2_ceil(a * inv), pow2_ceil(a / 448.0), "a = {a:e}");
                b += 1;
            }
        }
    }

    #[test]
    fn weight_block_examples() {
        // 2 × 3 weight, blocks 1 × 2: block amaxes 448·0.5 (F32 s = 0.5) and 3 (s = 3/448), etc.
        let w = [224.0f32, -112.0, 3.0, 0.0, 0.0, -1.0];
        let (q, s) = quantize_weight(&w, 2, 3, 1, 2, Fp8ScaleFmt::F32);
        assert_eq!(s, vec![0.5, 3.0 / 448.0, 1.0, 1.0 / 448.0]);
        assert_eq!(q[0], 0x7E); // 448
        assert_eq!(q[1], 0xF6); // −224
        assert_eq!(q[2], 0x7E);
        assert_eq!(&q[3..5], &[0, 0]);
        assert_eq!(q[5], 0xFE);
        let d = dequantize(&q, &s, 2, 3, 1, 2);
        assert_eq!(d[..2], [224.0, -112.0]);
        // UE8M0: 224/448 = 0.5 exactly → s = 0.5; 3/448 → 2^-7 (3/448 = 0.0067 ≤ 0.0078125).
        let (_, s) = quantize_weight(&w, 2, 3, 1, 2, Fp8ScaleFmt::Ue8m0);
        assert_eq!(s, vec![0.5, 2f32.powi(-7), 1.0, 2f32.powi(-8)]);
    }

    #[test]
    fn act_quant_groups_and_eps() {
        // One row of 130: a full group with amax 448 (s = 1 both ways) and a partial group of 2.
        let mut x = vec![0f32; 130];
        x[0] = 448.0;
        x[1] = 1.0 + 1.0 / 16.0; // tie between 1.0 and 1.125 at s = 1 → even (1.0)
        x[128] = 0.0;
        x[129] = 0.0;
        let ds = fake_quant_act_1x128(&x, 1, 130, ActScale::DeepSeekPow2);
        assert_eq!(ds[0], 448.0);
        assert_eq!(ds[1], 1.0);
        assert_eq!(&ds[128..], &[0.0, 0.0]);
        let vl = fake_quant_act_1x128(&x, 1, 130, ActScale::VllmF32);
        assert_eq!(vl[0], 448.0);
        assert_eq!(vl[1], 1.0);
        // Group amax 1e-5 < 1e-4 under DeepSeek: s = 2^ceil(log2(1e-4/448)) = 2^-22, so
        // 1e-5 = 41.94·2^-22, and E4M3 steps by 4 in [32, 64): nearest is 40·2^-22.
        let y = fake_quant_act_1x128(&[1e-5], 1, 1, ActScale::DeepSeekPow2);
        assert_eq!(y[0], 40.0 * 2f32.powi(-22));
    }
}
