//! NVFP4: E2M1 elements in 16-element blocks along K, one E4M3 scale per block, one FP32
//! tensor scale. Two conventions for the tensor scale (docs/NVFP4.md §3):
//! compressed-tensors stores the ENCODE scale g = 2688/amax (a divisor),
//! ModelOpt stores the DECODE scale d = amax/2688 (a multiplier).

use super::{bf16, e2m1, e4m3};

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

// ---------------------------------------------------------------------------------------------
// Tensor (global) scales.

/// `2688 = 448 · 6`: the largest E4M3 scale times the largest E2M1 magnitude.
pub const FP4_FP8_MAX: f32 = 2688.0;

/// compressed-tensors `weight_global_scale` / `input_global_scale` (encode scale g). torch
/// evaluates `2688.0 / amax_tensor` as `amax.reciprocal() * 2688`, so this is
/// `fl(fl(1/amax) · 2688)`, which differs from `fl(2688/amax)` by one ulp for some amax
/// (2.5 → 1075.2001, not 1075.2). amax = 0 gives +inf, as the producer does.
#[inline]
pub fn global_scale_ct(amax: f32) -> f32 {
    (1.0f32 / amax) * FP4_FP8_MAX
}

/// ModelOpt `weight_scale_2` / `input_scale` (decode scale d) = `fl(amax / 2688)`.
#[inline]
pub fn global_scale_modelopt(amax: f32) -> f32 {
    amax / FP4_FP8_MAX
}

/// vLLM's GEMM epilogue factor for a compressed-tensors layer: `fl(1/g_x) · fl(1/g_w)`, the
/// product of the two f32 reciprocals it computes at load time (docs/NVFP4.md §3.5).
#[inline]
pub fn alpha_ct(g_x: f32, g_w: f32) -> f32 {
    (1.0f32 / g_x) * (1.0f32 / g_w)
}

/// vLLM's GEMM epilogue factor for a ModelOpt layer: `d_x · d_w`.
#[inline]
pub fn alpha_modelopt(d_x: f32, d_w: f32) -> f32 {
    d_x * d_w
}

/// max |x| over a slice. NaN elements are skipped (like `fmaxf` on the GPU); 0 for an empty or
/// all-NaN slice.
#[inline]
pub fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// The runtime kernel's block maximum: |x[0]|, then `max` with each further |x[i]| — `__hmax2` /
/// `fmaxf` semantics, which return the other operand when one is NaN and NaN when both are. So a
/// NaN element is skipped, but a block of NaN only has maximum NaN (its scale byte becomes NaN,
/// 0x7F, as on the GPU), where [`amax`] would say 0.
#[inline]
pub fn block_vmax(x: &[f32]) -> f32 {
    x.iter().map(|v| v.abs()).reduce(f32::max).unwrap_or(0.0)
}

// ---------------------------------------------------------------------------------------------
// Offline (checkpoint) quantisers: one per producer, each in that producer's f32 op order.

/// An NVFP4-quantised weight as a checkpoint stores it: packed `[rows, cols/2]` (low nibble =
/// even element), linear `[rows, cols/16]` E4M3 scale bytes, and the tensor scale in the
/// producer's own convention (CT: encode g; ModelOpt: decode d).
#[derive(Clone, Debug, PartialEq)]
pub struct NvFp4Quant {
    pub packed: Vec<u8>,
    pub scales: Vec<u8>,
    pub global: f32,
}

fn check_shape(len: usize, rows: usize, cols: usize) {
    assert!(
        cols.is_multiple_of(BLOCK),
        "NVFP4 needs cols ({cols}) to be a multiple of {BLOCK}"
    );
    assert_eq!(len, rows * cols, "data length vs [{rows}, {cols}]");
}

/// compressed-tensors 0.20 (`NVFP4PackedCompressor`) re-encoder: g from [`global_scale_ct`],
/// then [`quantize_ct_with_global`].
///
/// # Panics
/// If `cols` is not a multiple of 16 or `w.len() != rows·cols` (shape is the caller's
/// contract; validate checkpoint shapes before calling).
pub fn quantize_ct(w: &[f32], rows: usize, cols: usize) -> NvFp4Quant {
    quantize_ct_with_global(w, rows, cols, global_scale_ct(amax(w)))
}

/// compressed-tensors with a given encode scale g (e.g. one shared by fused q/k/v shards).
/// Per block: `sf = fl(g · fl(v/6))`, clamp ±448, E4M3 RNE, a 0 result (all-zero or
/// underflowing block) becomes 0.125 (0x20); elements `y = fl(x / fl(s/g))`, clamp ±6, E2M1
/// RNE with sign bit `y < 0`. An all-zero tensor (g = inf) gives NaN scale bytes, as the
/// producer would; the library's later versions may substitute g = 1 [unverified].
pub fn quantize_ct_with_global(w: &[f32], rows: usize, cols: usize, g: f32) -> NvFp4Quant {
    check_shape(w.len(), rows, cols);
    let nb = rows * cols / BLOCK;
    let mut packed = vec![0u8; rows * cols / 2];
    let mut scales = vec![0u8; nb];
    for (xb, (pb, sb)) in w
        .chunks_exact(BLOCK)
        .zip(packed.chunks_exact_mut(BLOCK / 2).zip(scales.iter_mut()))
    {
        let v = amax(xb);
        let sf = (g * (v / 6.0)).clamp(-e4m3::MAX, e4m3::MAX);
        let mut code = e4m3::encode_satfinite(sf);
        if code == 0x00 || code == 0x80 {
            code = 0x20;
        }
        *sb = code;
        let q = e4m3::decode(code) / g;
        for (i, p) in pb.iter_mut().enumerate() {
            let lo = e2m1::encode_producer((xb[2 * i] / q).clamp(-6.0, 6.0));
            let hi = e2m1::encode_producer((xb[2 * i + 1] / q).clamp(-6.0, 6.0));
            *p = e2m1::pack(lo, hi);
        }
    }
    NvFp4Quant {
        packed,
        scales,
        global: g,
    }
}

/// ModelOpt 0.47 (`NVFP4QTensor.quantize`) re-encoder: d from [`global_scale_modelopt`], then
/// [`quantize_modelopt_with_global`].
///
/// # Panics
/// Same shape contract as [`quantize_ct`].
pub fn quantize_modelopt(w: &[f32], rows: usize, cols: usize) -> NvFp4Quant {
    quantize_modelopt_with_global(w, rows, cols, global_scale_modelopt(amax(w)))
}

/// ModelOpt with a given decode scale d. Per block: `ps = fl(v / fl(6·d))`, 0 → 1.0 (0x38),
/// clamp to [2^-9, 448] (so underflow gives 0x01, not 0), E4M3 RNE; elements
/// `y = fl(x / fl(s·d))`, E2M1 RNE (searchsorted + tie fix-up, saturating) with sign `y < 0`.
/// An all-zero tensor (d = 0) gives NaN scale bytes (0/0), as the producer would.
pub fn quantize_modelopt_with_global(w: &[f32], rows: usize, cols: usize, d: f32) -> NvFp4Quant {
    check_shape(w.len(), rows, cols);
    let nb = rows * cols / BLOCK;
    let mut packed = vec![0u8; rows * cols / 2];
    let mut scales = vec![0u8; nb];
    let six_d = 6.0f32 * d;
    const MIN_SUB: f32 = 0.001953125; // 2^-9
    for (xb, (pb, sb)) in w
        .chunks_exact(BLOCK)
        .zip(packed.chunks_exact_mut(BLOCK / 2).zip(scales.iter_mut()))
    {
        let v = amax(xb);
        let mut ps = v / six_d;
        if ps == 0.0 {
            ps = 1.0;
        }
        let ps = ps.clamp(MIN_SUB, e4m3::MAX);
        let code = e4m3::encode_satfinite(ps);
        *sb = code;
        let q = e4m3::decode(code) * d;
        for (i, p) in pb.iter_mut().enumerate() {
            let lo = e2m1::encode_producer(xb[2 * i] / q);
            let hi = e2m1::encode_producer(xb[2 * i + 1] / q);
            *p = e2m1::pack(lo, hi);
        }
    }
    NvFp4Quant {
        packed,
        scales,
        global: d,
    }
}

// ---------------------------------------------------------------------------------------------
// Serving kernel (vLLM `scaled_fp4_quant` / FlashInfer `fp4_quantize`), docs/NVFP4.md §3.2.

/// `rcp.approx.ftz.f32(6.0)` as measured on the GPU; equal to the correctly rounded fl(1/6).
pub const RCP6: f32 = f32::from_bits(0x3E2A_AAAB);

#[inline]
fn ftz(x: f32) -> f32 {
    if x.is_subnormal() {
        0.0f32.copysign(x)
    } else {
        x
    }
}

/// `rcp.approx.ftz.f32` minus the correctly rounded reciprocal, measured on an H200 (sm_90) for
/// every mantissa of [1, 2): 2 bits per mantissa (0 = equal, 1 = one ulp larger, 2 = one ulp
/// smaller), low bits first. The deviation depends on the mantissa alone: a sweep of 21 binades
/// found the same 1,108,522 deviating mantissas in each (`nvfp4-probe selftest --rcp-table`).
static RCP_DEVIATION: &[u8; 1 << 21] = include_bytes!("rcp_approx_sm90.bin");

/// Emulation of PTX `rcp.approx.ftz.f32` as the H200 computes it, bit for bit: subnormal inputs
/// and outputs flush to (signed) zero, 1/±0 = ±inf, 1/±inf = ±0; for normal inputs the
/// correctly rounded reciprocal moved by the measured one-ulp deviation of the input's mantissa
/// (13 % of mantissas deviate). Unverified on Blackwell (sm_100), whose MUFU may round differently.
#[inline]
pub fn rcp_approx(x: f32) -> f32 {
    let x = ftz(x);
    let c = 1.0 / x;
    if !x.is_normal() || !c.is_normal() {
        return ftz(c);
    }
    let m = (x.to_bits() & 0x7F_FFFF) as usize;
    match (RCP_DEVIATION[m >> 2] >> (2 * (m & 3))) & 3 {
        1 => f32::from_bits(c.to_bits() + 1),
        2 => f32::from_bits(c.to_bits() - 1),
        _ => c,
    }
}

/// One block's scale computation in kernel order: returns (scale byte, decoded scale,
/// element multiplier `osc`). `rcp_g` is `rcp_approx(g)`, hoisted by the callers.
#[inline(always)]
fn kernel_scale(vmax: f32, g: f32, rcp_g: f32) -> (u8, f32, f32) {
    let sf = g * (vmax * RCP6);
    let code = e4m3::encode_satfinite(sf);
    let sfq = e4m3::decode(code);
    let osc = if sfq == 0.0 {
        0.0
    } else {
        rcp_approx(sfq * rcp_g)
    };
    (code, sfq, osc)
}

/// Quantise one block of (up to) 16 activations exactly as the vLLM/FlashInfer kernel does,
/// with encode scale `g` (= 2688/amax_calib). Inputs are the bf16/fp16 values widened to f32;
/// missing elements (a slice shorter than 16) are read as 0 like the kernel's padding, extra
/// elements are ignored. A zero block gets scale byte 0x00; scales saturate at 448 (0x7E).
/// `g = inf` reproduces the missing-`input_scale` failure (0·inf = NaN scale for zero blocks).
pub fn quantize_block_kernel(x: &[f32], g: f32) -> (u8, [u8; 8]) {
    let mut buf = [0f32; BLOCK];
    let n = x.len().min(BLOCK);
    buf[..n].copy_from_slice(&x[..n]);
    let vmax = block_vmax(&buf);
    let (code, _, osc) = kernel_scale(vmax, g, rcp_approx(g));
    let mut packed = [0u8; 8];
    for (i, p) in packed.iter_mut().enumerate() {
        *p = e2m1::pack(
            e2m1::encode(buf[2 * i] * osc),
            e2m1::encode(buf[2 * i + 1] * osc),
        );
    }
    (code, packed)
}

/// Runtime-quantised activation: packed `[rows, cols/2]` and linear `[rows, cols/16]` scale
/// bytes (swizzle with [`super::swizzle`] if a layout-faithful buffer is needed).
#[derive(Clone, Debug, PartialEq)]
pub struct NvFp4Act {
    pub packed: Vec<u8>,
    pub scales: Vec<u8>,
}

/// Health counters of a runtime quantisation: the observables of docs/NVFP4.md §7.2.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QuantHealth {
    /// Blocks quantised.
    pub blocks: u64,
    /// Blocks with scale byte 0x00 (underflow or all-zero: the whole block decodes to 0).
    pub scale_zero: u64,
    /// Blocks with scale byte 0x7E (saturated at 448: the block's elements clip).
    pub scale_max: u64,
    /// Blocks with a NaN scale byte (0x7F/0xFF; only with a non-finite g).
    pub scale_nan: u64,
    /// Elements whose scaled value |y| exceeded 6 and were clipped.
    pub clipped: u64,
    /// Non-zero inputs that quantised to a zero code (the "dead zone").
    pub dead_zone: u64,
    /// Elements quantised.
    pub elements: u64,
}

impl QuantHealth {
    /// Accumulate another set of counters.
    pub fn add(&mut self, o: &Self) {
        self.blocks += o.blocks;
        self.scale_zero += o.scale_zero;
        self.scale_max += o.scale_max;
        self.scale_nan += o.scale_nan;
        self.clipped += o.clipped;
        self.dead_zone += o.dead_zone;
        self.elements += o.elements;
    }
}

/// Below this many elements the rayon split costs more than it saves.
const PAR_MIN: usize = 1 << 15;

fn rows_per_task(rows: usize, cols: usize) -> usize {
    (PAR_MIN / cols.max(1)).clamp(1, rows.max(1))
}

/// Quantise a row-major `[rows, cols]` activation (bf16 values in f32) with the serving kernel,
/// row by row, 16 elements per block.
///
/// # Panics
/// If `cols` is not a multiple of 16 or `x.len() != rows·cols`.
pub fn quantize_activation(x: &[f32], rows: usize, cols: usize, g: f32) -> NvFp4Act {
    check_shape(x.len(), rows, cols);
    let mut packed = vec![0u8; rows * cols / 2];
    let mut scales = vec![0u8; rows * cols / BLOCK];
    let rcp_g = rcp_approx(g);
    let work = |xs: &[f32], ps: &mut [u8], ss: &mut [u8]| {
        for (xb, (pb, sb)) in xs
            .chunks_exact(BLOCK)
            .zip(ps.chunks_exact_mut(BLOCK / 2).zip(ss.iter_mut()))
        {
            let (code, _, osc) = kernel_scale(block_vmax(xb), g, rcp_g);
            *sb = code;
            for (i, p) in pb.iter_mut().enumerate() {
                *p = e2m1::pack(
                    e2m1::encode(xb[2 * i] * osc),
                    e2m1::encode(xb[2 * i + 1] * osc),
                );
            }
        }
    };
    if rows * cols < PAR_MIN {
        work(x, &mut packed, &mut scales);
    } else {
        use rayon::prelude::*;
        let rt = rows_per_task(rows, cols);
        x.par_chunks(rt * cols)
            .zip(packed.par_chunks_mut(rt * cols / 2))
            .zip(scales.par_chunks_mut(rt * cols / BLOCK))
            .for_each(|((xs, ps), ss)| work(xs, ps, ss));
    }
    NvFp4Act { packed, scales }
}

fn fake_quant_rows(xs: &[f32], out: &mut [f32], g: f32, rcp_g: f32) -> QuantHealth {
    let mut h = QuantHealth::default();
    for (xb, ob) in xs.chunks_exact(BLOCK).zip(out.chunks_exact_mut(BLOCK)) {
        let (code, sfq, osc) = kernel_scale(block_vmax(xb), g, rcp_g);
        h.blocks += 1;
        match code {
            0x00 => h.scale_zero += 1,
            0x7E => h.scale_max += 1,
            c if e4m3::is_nan_byte(c) => h.scale_nan += 1,
            _ => {}
        }
        // e2m1·s is exact in f32 (2 + 4 significant bits), so one division gives the single
        // rounding of e2m1·s/g; the 8 magnitudes are shared by the block.
        let mut mags = [0f32; 8];
        for (m, l) in mags.iter_mut().zip(e2m1::LUT) {
            *m = (l * sfq) / g;
        }
        let (mut clipped, mut dead) = (0u32, 0u32);
        for (&xv, o) in xb.iter().zip(ob.iter_mut()) {
            let y = xv * osc;
            let c = e2m1::encode(y);
            clipped += (y.abs() > 6.0) as u32;
            dead += (c & 7 == 0 && xv != 0.0) as u32;
            let m = mags[(c & 7) as usize];
            *o = if c & 8 != 0 { -m } else { m };
        }
        h.clipped += clipped as u64;
        h.dead_zone += dead as u64;
    }
    h.elements = xs.len() as u64;
    h
}

/// Quantise-dequantise an activation with the serving kernel: returns
/// `x̂ = e2m1 · s_b / g` (f32, one rounding) and the health counters. Equal to decoding
/// [`quantize_activation`]'s bytes, without materialising them.
///
/// # Panics
/// If `cols` is not a multiple of 16 or `x.len() != rows·cols`.
pub fn fake_quant_activation(
    x: &[f32],
    rows: usize,
    cols: usize,
    g: f32,
) -> (Vec<f32>, QuantHealth) {
    let mut out = vec![0f32; x.len()];
    let h = fake_quant_activation_into(x, rows, cols, g, &mut out);
    (out, h)
}

/// [`fake_quant_activation`] into a caller-owned buffer (`out.len() == rows·cols`), for loops
/// that run it on every linear and want no allocation.
pub fn fake_quant_activation_into(
    x: &[f32],
    rows: usize,
    cols: usize,
    g: f32,
    out: &mut [f32],
) -> QuantHealth {
    check_shape(x.len(), rows, cols);
    assert_eq!(out.len(), x.len(), "output buffer length");
    let rcp_g = rcp_approx(g);
    if rows * cols < PAR_MIN {
        fake_quant_rows(x, out, g, rcp_g)
    } else {
        use rayon::prelude::*;
        let rt = rows_per_task(rows, cols);
        x.par_chunks(rt * cols)
            .zip(out.par_chunks_mut(rt * cols))
            .map(|(xs, os)| fake_quant_rows(xs, os, g, rcp_g))
            .reduce(QuantHealth::default, |mut a, b| {
                a.add(&b);
                a
            })
    }
}

// ---------------------------------------------------------------------------------------------
// W4A4 GEMM reference, docs/NVFP4.md §4.3.

/// Codes of a packed `[rows, k/2]` tensor as signed 2·e2m1 integers (row-major `[rows, k]`).
fn codes_x2(packed: &[u8]) -> Vec<i8> {
    let mut out = Vec::with_capacity(packed.len() * 2);
    for &b in packed {
        for c in [b & 0xF, b >> 4] {
            let m = e2m1::LUT_X2[(c & 7) as usize] as i8;
            out.push(if c & 8 != 0 { -m } else { m });
        }
    }
    out
}

/// Emulated Blackwell W4A4 NVFP4 GEMM `y[m, n] = Σ_k x[m, k]·w[n, k]` from quantised operands:
/// x packed `[m, k/2]` + linear scales `[m, k/16]`, w packed `[n, k/2]` + linear scales
/// `[n, k/16]`. Every per-block partial `(s_x·s_w)·Σ e2m1_x·e2m1_w` is exact; partials are
/// summed in f64 across blocks; the result is `bf16_rne(f32(acc) · alpha)` returned as f32,
/// row-major `[m, n]`. The tensor core's own accumulation order is undocumented, so rare 1-ulp
/// bf16 differences to the hardware are expected.
///
/// # Panics
/// If `k` is not a multiple of 16 or a buffer length disagrees with (m, n, k).
#[allow(clippy::too_many_arguments)]
pub fn gemm_w4a4_reference(
    x_packed: &[u8],
    x_scales: &[u8],
    w_packed: &[u8],
    w_scales: &[u8],
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
) -> Vec<f32> {
    assert!(
        k.is_multiple_of(BLOCK),
        "k ({k}) must be a multiple of {BLOCK}"
    );
    let kb = k / BLOCK;
    assert_eq!(x_packed.len(), m * k / 2, "x packed length");
    assert_eq!(w_packed.len(), n * k / 2, "w packed length");
    assert_eq!(x_scales.len(), m * kb, "x scales length");
    assert_eq!(w_scales.len(), n * kb, "w scales length");
    let xc = codes_x2(x_packed);
    let wc = codes_x2(w_packed);
    let xs: Vec<f64> = x_scales.iter().map(|&b| e4m3::decode(b) as f64).collect();
    let ws: Vec<f64> = w_scales.iter().map(|&b| e4m3::decode(b) as f64).collect();
    let mut out = vec![0f32; m * n];
    let row = |i: usize, orow: &mut [f32]| {
        let xr = &xc[i * k..(i + 1) * k];
        let xsr = &xs[i * kb..(i + 1) * kb];
        for (j, o) in orow.iter_mut().enumerate() {
            let wr = &wc[j * k..(j + 1) * k];
            let wsr = &ws[j * kb..(j + 1) * kb];
            let mut acc = 0f64;
            for b in 0..kb {
                let mut s: i32 = 0;
                for t in b * BLOCK..(b + 1) * BLOCK {
                    s += xr[t] as i32 * wr[t] as i32;
                }
                // s counts quarters (each operand was doubled).
                acc += (xsr[b] * wsr[b]) * (s as f64 * 0.25);
            }
            *o = bf16::round((acc as f32) * alpha);
        }
    };
    if m * n * k < PAR_MIN * 16 || n == 0 {
        for (i, orow) in out.chunks_mut(n.max(1)).enumerate().take(m) {
            row(i, orow);
        }
    } else {
        use rayon::prelude::*;
        out.par_chunks_mut(n)
            .enumerate()
            .for_each(|(i, orow)| row(i, orow));
    }
    out
}

/// W4A16 (Hopper/Marlin) reference per docs/NVFP4.md §4.3: bf16 activations `[m, k]` against a
/// dequantised NVFP4 weight, `bf16_rne(f32(Σ_k x·e2m1·s_w) · d_w)` with f64 accumulation.
///
/// # Panics
/// If `k` is not a multiple of 16 or a buffer length disagrees with (m, n, k).
#[allow(clippy::too_many_arguments)]
pub fn gemm_w4a16_reference(
    x: &[f32],
    w_packed: &[u8],
    w_scales: &[u8],
    m: usize,
    n: usize,
    k: usize,
    d_w: f32,
) -> Vec<f32> {
    assert!(
        k.is_multiple_of(BLOCK),
        "k ({k}) must be a multiple of {BLOCK}"
    );
    let kb = k / BLOCK;
    assert_eq!(x.len(), m * k, "x length");
    assert_eq!(w_packed.len(), n * k / 2, "w packed length");
    assert_eq!(w_scales.len(), n * kb, "w scales length");
    // e2m1·s_w is exact in bf16, so the dequantised weight carries no rounding.
    let wc = codes_x2(w_packed);
    let wd: Vec<f64> = wc
        .iter()
        .enumerate()
        .map(|(t, &c)| c as f64 * 0.5 * e4m3::decode(w_scales[t / BLOCK]) as f64)
        .collect();
    let mut out = vec![0f32; m * n];
    for i in 0..m {
        let xr = &x[i * k..(i + 1) * k];
        for j in 0..n {
            let wr = &wd[j * k..(j + 1) * k];
            let acc: f64 = xr.iter().zip(wr).map(|(&a, &b)| a as f64 * b).sum();
            out[i * n + j] = bf16::round((acc as f32) * d_w);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rcp6_is_correctly_rounded_sixth() {
        assert_eq!(RCP6, 1.0f32 / 6.0);
        assert_eq!(rcp_approx(6.0), RCP6);
        assert_eq!(RCP6.to_bits(), 0x3E2A_AAAB);
    }

    #[test]
    fn block_maximum_skips_nan_but_a_nan_block_has_a_nan_scale() {
        let mut x = [0.5f32; 16];
        x[3] = f32::NAN;
        x[9] = -3.0;
        assert_eq!(block_vmax(&x), 3.0);
        let mut q = quantize_activation(&x, 1, 16, 1.0);
        assert!(!e4m3::is_nan_byte(q.scales[0]));
        // a whole block of NaN: maximum NaN, scale byte NaN (the GPU's fmaxf chain), where the
        // NaN-skipping tensor amax gives 0
        let nan = [f32::NAN; 16];
        assert!(block_vmax(&nan).is_nan());
        assert_eq!(amax(&nan), 0.0);
        q = quantize_activation(&nan, 1, 16, 1.0);
        assert!(e4m3::is_nan_byte(q.scales[0]), "{:#x}", q.scales[0]);
        let (_, h) = fake_quant_activation(&nan, 1, 16, 1.0);
        assert_eq!(h.scale_nan, 1);
        // the kernel's padding reads zeros: a short all-NaN block has maximum 0
        assert_eq!(quantize_block_kernel(&nan[..8], 1.0).0, 0x00);
        assert!(e4m3::is_nan_byte(quantize_block_kernel(&nan, 1.0).0));
    }

    #[test]
    fn rcp_approx_flushes_subnormals() {
        assert_eq!(rcp_approx(2.0), 0.5);
        assert_eq!(rcp_approx(f32::from_bits(1)), f32::INFINITY); // input flushed to +0
        assert_eq!(rcp_approx(-f32::from_bits(1)), f32::NEG_INFINITY);
        assert_eq!(rcp_approx(f32::MAX), 0.0); // 1/MAX is subnormal → flushed
        assert_eq!(rcp_approx(f32::INFINITY), 0.0);
        assert!(rcp_approx(f32::NAN).is_nan());
        assert_eq!(rcp_approx(2f32.powi(126)), 2f32.powi(-126)); // smallest normal survives
    }

    /// Fixture README: for amax 2.5 the torch form fl(fl(1/amax)·2688) is 1075.2001, one ulp
    /// above fl(2688/amax) = 1075.2.
    #[test]
    fn ct_global_scale_uses_reciprocal_form() {
        let g = global_scale_ct(2.5);
        assert_eq!(2688.0f32 / 2.5, 1075.2);
        assert_eq!(g.to_bits(), 1075.2f32.to_bits() + 1);
        assert_eq!(global_scale_modelopt(6.0), 6.0 / 2688.0);
    }

    #[test]
    fn gemm_matches_dequantised_f64_dot() {
        // Two rows × three cols, k = 48: compare with an f64 dot of the dequantised operands.
        let x: Vec<f32> = (0..96)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.13)
            .collect();
        let w: Vec<f32> = (0..144)
            .map(|i| ((i * 53 % 29) as f32 - 14.0) * 0.01)
            .collect();
        let gx = global_scale_ct(amax(&x));
        let xq = quantize_activation(&x, 2, 48, gx);
        let wq = quantize_ct(&w, 3, 48);
        let alpha = alpha_ct(gx, wq.global);
        let y = gemm_w4a4_reference(
            &xq.packed, &xq.scales, &wq.packed, &wq.scales, 2, 3, 48, alpha,
        );
        let xd = dequantize(&xq.packed, &xq.scales, 1.0, Convention::ModelOpt, 2, 48);
        let wd = dequantize(&wq.packed, &wq.scales, 1.0, Convention::ModelOpt, 3, 48);
        for i in 0..2 {
            for j in 0..3 {
                let acc: f64 = (0..48)
                    .map(|t| xd[i * 48 + t] as f64 * wd[j * 48 + t] as f64)
                    .sum();
                let want = bf16::round((acc as f32) * alpha);
                assert_eq!(y[i * 3 + j], want, "({i},{j})");
                assert!(want != 0.0);
            }
        }
        // W4A16 with bf16-exact x: same structure, d_w = 1/g_w.
        let xb: Vec<f32> = x.iter().map(|&v| bf16::round(v)).collect();
        let y16 = gemm_w4a16_reference(&xb, &wq.packed, &wq.scales, 2, 3, 48, 1.0 / wq.global);
        for i in 0..2 {
            for j in 0..3 {
                let acc: f64 = (0..48)
                    .map(|t| xb[i * 48 + t] as f64 * wd[j * 48 + t] as f64)
                    .sum();
                assert_eq!(
                    y16[i * 3 + j],
                    bf16::round((acc as f32) * (1.0 / wq.global))
                );
            }
        }
    }

    #[test]
    fn rcp_deviation_table_matches_the_h200_sweep() {
        // The H200 sweep (selftest, 2^-8..2^12) counted 23,278,962 deviating inputs in 21 binades:
        // 1,108,522 per binade, 733,799 one ulp up and 374,723 one ulp down.
        let (mut up, mut down) = (0u32, 0u32);
        for m in 0u32..1 << 23 {
            let x = f32::from_bits(0x3F80_0000 | m);
            let d = rcp_approx(x).to_bits() as i64 - (1.0 / x).to_bits() as i64;
            match d {
                1 => up += 1,
                -1 => down += 1,
                0 => {}
                _ => panic!("deviation {d} at mantissa {m:#x}"),
            }
        }
        assert_eq!((up, down), (733_799, 374_723));
        // the first deviating mantissas the device reported, and the sign symmetry
        let x = f32::from_bits(0x3F80_0000 | 1449);
        assert_eq!(rcp_approx(x).to_bits(), (1.0 / x).to_bits() - 1);
        assert_eq!(rcp_approx(-x), -rcp_approx(x));
        // the same deviation one binade up, and the flush rules
        assert_eq!(
            rcp_approx(2.0 * x).to_bits(),
            (1.0 / (2.0 * x)).to_bits() - 1
        );
        assert_eq!(rcp_approx(0.0), f32::INFINITY);
        assert_eq!(rcp_approx(f32::from_bits(1)), f32::INFINITY);
        assert_eq!(rcp_approx(f32::INFINITY), 0.0);
        assert_eq!(rcp_approx(3.0e38), 0.0);
        assert!(rcp_approx(f32::NAN).is_nan());
    }
}
