//! `nvfp4-probe selftest --backend cuda`: every device kernel against the CPU reference on fresh
//! random inputs (never zeros), each output buffer poisoned with 0xFF bytes (NaN for f32) before
//! the kernel writes it, then whole runs on both backends compared op by op (V4's, and each model
//! family's tiny model: [`family::runs`]).
//!
//! Format conversions, quantization and health counters must match bit for bit; f32 reductions
//! to 1e-6 relative; GEMMs to the rounding of a different summation order.

use crate::backend::cuda::{ActQuantOut, Gpu, Nvfp4Decode, H_SLOTS};
use crate::metrics::{Compare, Stats};
use crate::model::mem_env::Rng;
use crate::numerics::nvfp4::{self, Convention};
use crate::numerics::{bf16, e2m1, e4m3, fp8_block, mxfp4, ue8m0};
use crate::probe::RunResult;
use crate::Result;

pub mod family;
mod layer;
mod long;
mod moe;

/// One line of the self-test table.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Check {
    pub name: String,
    pub cases: usize,
    pub mismatches: usize,
    /// Worst relative error where a tolerance applies (0 for bit-exact checks).
    pub worst: f64,
    pub tolerance: f64,
    pub note: String,
}

impl Check {
    pub fn pass(&self) -> bool {
        self.mismatches == 0 && self.worst <= self.tolerance
    }
}

fn same_bits(a: f32, b: f32) -> bool {
    (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits()
}

fn exact(name: &str, got: &[f32], want: &[f32]) -> Check {
    let mm = got
        .iter()
        .zip(want)
        .filter(|(a, b)| !same_bits(**a, **b))
        .count()
        + got.len().abs_diff(want.len());
    Check {
        name: name.into(),
        cases: want.len(),
        mismatches: mm,
        worst: 0.0,
        tolerance: 0.0,
        note: String::new(),
    }
}

/// BF16 bit patterns, every NaN pattern counting as equal (the GPU's arithmetic produces the
/// canonical NaN 0x7FFFFFFF where the CPU propagates the input's payload).
fn exact_bf16(name: &str, got: &[u16], want: &[u16]) -> Check {
    let a: Vec<f32> = got.iter().map(|&h| bf16::from_bits(h)).collect();
    let b: Vec<f32> = want.iter().map(|&h| bf16::from_bits(h)).collect();
    exact(name, &a, &b)
}

fn exact_u<T: PartialEq>(name: &str, got: &[T], want: &[T]) -> Check {
    let mm = got.iter().zip(want).filter(|(a, b)| a != b).count() + got.len().abs_diff(want.len());
    Check {
        name: name.into(),
        cases: want.len(),
        mismatches: mm,
        worst: 0.0,
        tolerance: 0.0,
        note: String::new(),
    }
}

/// Relative L2 of got vs want (NaN positions must agree).
fn close(name: &str, got: &[f32], want: &[f32], tol: f64) -> Check {
    let mut nan_mm = 0;
    let (mut ne, mut nr) = (0f64, 0f64);
    for (a, b) in got.iter().zip(want) {
        if a.is_nan() != b.is_nan() {
            nan_mm += 1;
            continue;
        }
        if a.is_finite() && b.is_finite() {
            ne += (*a as f64 - *b as f64).powi(2);
            nr += (*b as f64).powi(2);
        }
    }
    Check {
        name: name.into(),
        cases: want.len(),
        mismatches: nan_mm + got.len().abs_diff(want.len()),
        worst: if nr > 0.0 {
            (ne / nr).sqrt()
        } else {
            ne.sqrt()
        },
        tolerance: tol,
        note: "rel-L2".into(),
    }
}

fn rel(a: f64, b: f64) -> f64 {
    if a == b {
        0.0
    } else {
        (a - b).abs() / a.abs().max(b.abs()).max(1e-300)
    }
}

/// Random f32 values spread over many binades, with signed zeros, subnormals, exact grid
/// midpoints of E4M3 and E2M1, the saturation edges, inf and NaN.
fn nasty_floats(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(n);
    while v.len() < n {
        let k = rng.below(12);
        let x: f32 = match k {
            0 => (rng.normal() * 10f64.powf(rng.uniform() * 12.0 - 6.0)) as f32,
            1 => {
                // E2M1 midpoints and their neighbours
                let m = [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0][rng.below(9)];
                let b = m.to_bits() as i64 + rng.below(3) as i64 - 1;
                f32::from_bits(b as u32)
            }
            2 => {
                // E4M3 midpoints: halfway between consecutive codes
                let c = rng.below(126) as u8;
                let a = e4m3::decode(c);
                let b = e4m3::decode(c + 1);
                let mid = (a + b) / 2.0;
                f32::from_bits((mid.to_bits() as i64 + rng.below(3) as i64 - 1) as u32)
            }
            3 => [0.0f32, -0.0, 448.0, 464.0, 480.0, -449.0, 1e-30, -3e-39][rng.below(8)],
            4 => f32::from_bits(rng.next_u64() as u32 & 0x007F_FFFF), // subnormal
            5 => {
                if rng.below(4) == 0 {
                    f32::NAN
                } else if rng.below(2) == 0 {
                    f32::INFINITY
                } else {
                    f32::NEG_INFINITY
                }
            }
            _ => (rng.normal() * 3.0) as f32,
        };
        v.push(if rng.below(2) == 0 { x } else { -x });
    }
    v
}

fn bytes(rng: &mut Rng, n: usize) -> Vec<u8> {
    (0..n).map(|_| rng.next_u64() as u8).collect()
}

/// E4M3 scale bytes for the NVFP4 dequantization checks: random realistic magnitudes of both
/// signs, with every 13th byte one of the special codes: NaN (0x7F, 0xFF), zero (0x00, -0 0x80),
/// the maximum ±448 (0x7E, 0xFE) and the subnormals 0x01, 0x07, 0x87.
fn nvfp4_scale_bytes(rng: &mut Rng, n: usize) -> Vec<u8> {
    const SPECIAL: [u8; 9] = [0x7F, 0xFF, 0x00, 0x80, 0x7E, 0xFE, 0x01, 0x07, 0x87];
    (0..n)
        .map(|i| {
            if i % 13 == 6 {
                SPECIAL[rng.below(SPECIAL.len())]
            } else {
                let b = (0x20 + rng.below(0x5E)) as u8;
                if rng.below(8) == 0 {
                    b | 0x80
                } else {
                    b
                }
            }
        })
        .collect()
}

/// bf16-valued activations, rows at very different magnitudes, some all-zero blocks, one NaN
/// element and one all-NaN block.
fn activations(rng: &mut Rng, m: usize, k: usize, nan: bool) -> Vec<f32> {
    let mut x = vec![0f32; m * k];
    for r in 0..m {
        let s = 10f64.powf(rng.uniform() * 6.0 - 3.0);
        for c in 0..k {
            let v = if (c / 16) % 11 == 3 && r % 2 == 0 {
                0.0
            } else {
                (rng.normal() * s) as f32
            };
            x[r * k + c] = bf16::round(if c % 173 == 7 { v * 300.0 } else { v });
        }
    }
    if nan && m * k > 40 {
        x[37] = f32::NAN;
        if m > 1 && k >= 48 {
            // a whole 16-element block of NaN in row 1: its maximum is NaN, not 0 (scale 0x7F)
            x[k + 32..k + 48].fill(f32::NAN);
        }
    }
    x
}

struct T<'a> {
    g: &'a mut Gpu,
}

impl T<'_> {
    fn up<X: Copy>(&self, v: &[X]) -> Result<crate::backend::cuda::Buf> {
        self.g.upload(v)
    }
    /// A poisoned output buffer.
    fn out(&self, bytes: usize) -> Result<crate::backend::cuda::Buf> {
        let b = self.g.alloc(bytes)?;
        self.g.memset(b.ptr, 0xFF, bytes)?;
        Ok(b)
    }
    fn get_f32(&self, b: &crate::backend::cuda::Buf, n: usize) -> Result<Vec<f32>> {
        self.g.download(b.ptr, n)
    }
    fn get_u8(&self, b: &crate::backend::cuda::Buf, n: usize) -> Result<Vec<u8>> {
        self.g.download(b.ptr, n)
    }
    fn get_u16(&self, b: &crate::backend::cuda::Buf, n: usize) -> Result<Vec<u16>> {
        self.g.download(b.ptr, n)
    }
}

/// Run every kernel check. `scale` multiplies the tensor sizes.
pub fn kernels(g: &mut Gpu, scale: usize, seed: u64) -> Result<Vec<Check>> {
    let mut rng = Rng::new(seed ^ 0x5E1F_7E57);
    let mut t = T { g };
    let s = scale.max(1);
    let mut out = Vec::new();

    // ---- decoders: every byte, several times over ----
    let all: Vec<u8> = (0..256 * 16 * s).map(|i| i as u8).collect();
    let n = all.len();
    let b = t.up(&all)?;
    for (fmt, name, f) in [
        (0, "decode e4m3 (all bytes)", e4m3::decode as fn(u8) -> f32),
        (1, "decode ue8m0 (all bytes)", ue8m0::decode),
        (2, "decode e2m1 (all nibbles)", e2m1::decode),
    ] {
        let o = t.out(n * 4)?;
        t.g.kern()
            .decode_bytes(n as u64, b.ptr, n as u64, fmt, o.ptr)?;
        let want: Vec<f32> = all.iter().map(|&x| f(x)).collect();
        out.push(exact(name, &t.get_f32(&o, n)?, &want));
    }
    let bits: Vec<u16> = (0..=u16::MAX).collect();
    let b16 = t.up(&bits)?;
    let o = t.out(bits.len() * 4)?;
    t.g.kern()
        .decode_bytes(bits.len() as u64, b16.ptr, bits.len() as u64, 3, o.ptr)?;
    let want: Vec<f32> = bits.iter().map(|&h| bf16::from_bits(h)).collect();
    out.push(exact(
        "decode bf16 (all 65536)",
        &t.get_f32(&o, bits.len())?,
        &want,
    ));
    let o = t.out(bits.len() * 4)?;
    t.g.kern()
        .decode_bytes(bits.len() as u64, b16.ptr, bits.len() as u64, 4, o.ptr)?;
    let want: Vec<f32> = bits
        .iter()
        .map(|&h| half::f16::from_bits(h).to_f32())
        .collect();
    out.push(exact(
        "decode f16 (all 65536)",
        &t.get_f32(&o, bits.len())?,
        &want,
    ));

    // ---- encoders on nasty values ----
    let xs = nasty_floats(&mut rng, 200_000 * s);
    let n = xs.len();
    let xb = t.up(&xs)?;
    for (fmt, name) in [
        (0, "encode e4m3 satfinite"),
        (1, "encode e2m1 (kernel sign rule)"),
    ] {
        let o = t.out(n)?;
        t.g.kern()
            .encode_floats(n as u64, xb.ptr, n as u64, fmt, o.ptr)?;
        let want: Vec<u8> = xs
            .iter()
            .map(|&x| {
                if fmt == 0 {
                    e4m3::encode_satfinite(x)
                } else {
                    e2m1::encode(x)
                }
            })
            .collect();
        out.push(exact_u(name, &t.get_u8(&o, n)?, &want));
    }
    let o = t.out(n * 2)?;
    t.g.kern()
        .encode_floats(n as u64, xb.ptr, n as u64, 2, o.ptr)?;
    let want: Vec<u16> = xs.iter().map(|&x| bf16::to_bits(x)).collect();
    out.push(exact_u("encode bf16 RNE", &t.get_u16(&o, n)?, &want));

    // ---- rcp.approx.ftz vs the CPU emulation: random values, then every mantissa of 5 binades ----
    let mut rx = xs.clone();
    for e in [-20i32, -1, 0, 7, 100] {
        rx.extend((0u32..1 << 23).map(|m| f32::from_bits(((e + 127) as u32) << 23 | m)));
    }
    let n = rx.len();
    let rb = t.up(&rx)?;
    let o = t.out(n * 4)?;
    t.g.kern()
        .rcp_approx_map(n as u64, rb.ptr, n as u64, o.ptr)?;
    let want: Vec<f32> = rx.iter().map(|&x| nvfp4::rcp_approx(x)).collect();
    let mut c = exact(
        "rcp.approx.ftz vs CPU emulation (random + all mantissas of 5 binades)",
        &t.get_f32(&o, n)?,
        &want,
    );
    let (sweep_mm, _) = rcp_sweep(t.g, -8..=12)?;
    c.note = format!(
        "for reference: {sweep_mm} of {} inputs of 2^-8..2^12 differ from the correctly rounded reciprocal",
        21u64 << 23
    );
    out.push(c);

    // ---- NVFP4 weight dequantization, both conventions, f32 and BF16 output ----
    // Both kernel variants (v1, and v2 with " v2" in the check name) against the CPU reference,
    // then v2 against v1 on the raw output bits (NaN payloads included). An odd block count
    // (33 blocks per row, an odd row count) leaves a partial last step for v2; the scale bytes
    // include NaN (0x7F, 0xFF), zero (0x00, 0x80), max (0x7E, 0xFE) and subnormal codes, and the
    // random packed bytes every E2M1 nibble (-0 = 8 included).
    let (rows, cols) = (96 * s + 1, 528);
    let packed = bytes(&mut rng, rows * cols / 2);
    let scales = nvfp4_scale_bytes(&mut rng, rows * cols / 16);
    let pb = t.up(&packed)?;
    let sb = t.up(&scales)?;
    let nb = (rows * cols / 16) as u64;
    let mut want_swapped = Vec::with_capacity(rows * cols);
    for (i, &byte) in packed.iter().enumerate() {
        let sc = e4m3::decode(scales[i / 8]);
        let (lo, hi) = e2m1::unpack(byte);
        for c in [hi, lo] {
            want_swapped.push(bf16::to_bits((e2m1::decode(c) * sc) * 0.37));
        }
    }
    let prev_v2 = t.g.v2;
    // (check name, raw output bits) of the v1 run, for the v2 = v1 comparison
    let mut raw_v1: Vec<(String, Vec<u32>)> = Vec::new();
    for (v2, sfx) in [(false, ""), (true, " v2")] {
        t.g.v2 = v2;
        let run = |t: &mut T, out: &mut Vec<Check>| -> Result<Vec<(String, Vec<u32>)>> {
            let mut raw = Vec::new();
            for (conv, cname, global) in [
                (Convention::CompressedTensors, "ct", 1234.567f32),
                (Convention::ModelOpt, "modelopt", 3.1e-4f32),
            ] {
                let want = nvfp4::dequantize(&packed, &scales, global, conv, rows, cols);
                let ci = if conv == Convention::CompressedTensors {
                    0
                } else {
                    1
                };
                let dec = |out_bf16| Nvfp4Decode {
                    global,
                    conv: ci,
                    post: None,
                    swap: false,
                    out_bf16,
                };
                let o = t.out(rows * cols * 4)?;
                t.g.dequant_nvfp4(pb.ptr, sb.ptr, nb, dec(false), o.ptr)?;
                let got = t.get_f32(&o, rows * cols)?;
                let name = format!("dequant nvfp4 {cname} -> f32");
                out.push(exact(&format!("{name}{sfx}"), &got, &want));
                raw.push((name, got.iter().map(|v| v.to_bits()).collect()));
                let o = t.out(rows * cols * 2)?;
                t.g.dequant_nvfp4(pb.ptr, sb.ptr, nb, dec(true), o.ptr)?;
                let w16: Vec<u16> = want.iter().map(|&v| bf16::to_bits(v)).collect();
                let got = t.get_u16(&o, rows * cols)?;
                let name = format!("dequant nvfp4 {cname} -> bf16");
                out.push(exact_bf16(&format!("{name}{sfx}"), &got, &w16));
                raw.push((name, got.iter().map(|&h| h as u32).collect()));
            }
            // served operand e2m1·s (bf16 exact) with nibbles swapped, as a layout fault reads it
            let o = t.out(rows * cols * 2)?;
            let dec = Nvfp4Decode {
                global: 1.0,
                conv: 2,
                post: Some(0.37),
                swap: true,
                out_bf16: true,
            };
            t.g.dequant_nvfp4(pb.ptr, sb.ptr, nb, dec, o.ptr)?;
            let got = t.get_u16(&o, rows * cols)?;
            let name = "dequant nvfp4 served operand (swapped, x d_w) -> bf16".to_string();
            out.push(exact_bf16(&format!("{name}{sfx}"), &got, &want_swapped));
            raw.push((name, got.iter().map(|&h| h as u32).collect()));
            Ok(raw)
        };
        let r = run(&mut t, &mut out);
        t.g.v2 = prev_v2;
        let raw = r?;
        if !v2 {
            raw_v1 = raw;
        } else {
            for ((name, a), (_, b)) in raw.iter().zip(&raw_v1) {
                out.push(exact_u(&format!("{name} v2 = v1 (raw bits)"), a, b));
            }
        }
    }

    // ---- MXFP4 (32-element blocks: the first rows·mcols/2 packed bytes) ----
    let mcols = cols / 32 * 32;
    let mxs: Vec<u8> = (0..rows * mcols / 32)
        .map(|i| {
            if i % 53 == 1 {
                0xFF
            } else {
                (100 + rng.below(50)) as u8
            }
        })
        .collect();
    let mb = t.up(&mxs)?;
    let o = t.out(rows * mcols * 4)?;
    let nb32 = (rows * mcols / 32) as u64;
    t.g.kern()
        .dequant_mxfp4(nb32, pb.ptr, mb.ptr, nb32, 0, o.ptr)?;
    out.push(exact(
        "dequant mxfp4 -> f32",
        &t.get_f32(&o, rows * mcols)?,
        &mxfp4::dequantize(&packed[..rows * mcols / 2], &mxs, rows, mcols),
    ));

    // ---- FP8 block (edge blocks) ----
    let (fr, fc) = (200 * s, 300);
    let w8: Vec<u8> = bytes(&mut rng, fr * fc)
        .into_iter()
        .map(|b| if b & 0x7F == 0x7F { 0x3C } else { b })
        .collect();
    let nsc = fr.div_ceil(128) * fc.div_ceil(128);
    let sc: Vec<f32> = (0..nsc)
        .map(|_| (rng.uniform() * 0.01 + 1e-4) as f32)
        .collect();
    let (wb, scb) = (t.up(&w8)?, t.up(&sc)?);
    let o = t.out(fr * fc * 4)?;
    t.g.kern().dequant_fp8_block(
        (fr * fc) as u64,
        wb.ptr,
        scb.ptr,
        fr as u64,
        fc as u64,
        128,
        128,
        0,
        0,
        o.ptr,
    )?;
    out.push(exact(
        "dequant fp8 block 128x128 -> f32",
        &t.get_f32(&o, fr * fc)?,
        &fp8_block::dequantize(&w8, &sc, fr, fc, 128, 128),
    ));

    // ---- the generic decode of the format table (`dequant_blocked`) ----
    // Every format of the table with byte codes and byte scales in row blocks and no tensor
    // scale (MXFP8, MXFP4) against the host reference `formats::decode_blocked`, random bytes
    // (NaN codes and scales included), f32 output.
    for spec in crate::checkpoint::formats::TABLE {
        use crate::checkpoint::formats::{Block, Elem, Global, ScaleCode};
        let Some(d) = spec.decode else { continue };
        let Block::Row(bn) = d.block else { continue };
        if d.global != Global::None || d.scale == ScaleCode::F32 {
            continue;
        }
        let (rows, cols) = (37 * s, 4 * bn);
        let per = d.elem.per_byte();
        let codes = bytes(&mut rng, rows * cols / per);
        let scales: Vec<u8> = (0..rows * cols / bn)
            .map(|i| {
                if i % 97 == 5 {
                    0xFF
                } else {
                    (100 + rng.below(50)) as u8
                }
            })
            .collect();
        let (cb, sb) = (t.up(&codes)?, t.up(&scales)?);
        let o = t.out(rows * cols * 4)?;
        let (elem, scode) = (
            (d.elem == Elem::E2m1Packed) as i32,
            (d.scale == ScaleCode::Ue8m0) as i32,
        );
        let nk = (rows * cols) as u64;
        t.g.kern().dequant_blocked(
            nk,
            cb.ptr,
            elem,
            sb.ptr,
            scode,
            rows as u64,
            cols as u64,
            1,
            bn as u64,
            0,
            1.0,
            0,
            o.ptr,
        )?;
        out.push(exact(
            &format!("dequant_blocked {} -> f32", spec.label),
            &t.get_f32(&o, rows * cols)?,
            &crate::checkpoint::formats::decode_blocked(&d, &codes, &scales, rows, cols),
        ));
    }

    // ---- NVFP4 activation quantization (serving kernel op order) ----
    // Both kernel variants (v1, and v2 with " v2" in the check name) against the CPU reference,
    // then v2 against v1 on the raw output bits. [m, k] = [64 s + 1, 1040]: an odd number of
    // 16-element blocks, so v2's last step is partial. Inputs: bf16-valued activations with
    // all-zero blocks (scale byte 0x00), one NaN element, and a few ±inf and -0.0 elements
    // (saturated 0x7E blocks, negative-zero codes); g = inf gives NaN scale bytes (0x7F) for
    // the zero blocks. The quantize-dequantize output is rounded to BF16 in every other case.
    let prev_v2 = t.g.v2;
    for (ci, (gi, gname)) in [
        (1.0f32, "calibrated"),
        (64.0, "x64 (saturating)"),
        (1.0 / 512.0, "1/512 (underflowing)"),
        (f32::INFINITY, "inf (NaN scales)"),
    ]
    .into_iter()
    .enumerate()
    {
        let (m, k) = (64 * s + 1, 1040);
        let mut x = activations(&mut rng, m, k, true);
        let gx = 2688.0 / nvfp4::amax(&x) * gi;
        for _ in 0..(m * k / 500).max(4) {
            let i = rng.below(m * k);
            x[i] = [-0.0f32, f32::INFINITY, f32::NEG_INFINITY, -0.0][rng.below(4)];
        }
        let amax = nvfp4::amax(&x);
        let xhat_bf16 = ci % 2 == 1;
        let xb = t.up(&x)?;
        let nb = (m * k / 16) as u64;
        let want = nvfp4::quantize_activation(&x, m, k, gx);
        let (mut fake, health) = nvfp4::fake_quant_activation(&x, m, k, gx);
        if xhat_bf16 {
            for v in fake.iter_mut() {
                *v = bf16::round(*v);
            }
        }
        let mut xq = Vec::with_capacity(m * k);
        for (i, &byte) in want.packed.iter().enumerate() {
            let sc = e4m3::decode(want.scales[i / 8]);
            let (lo, hi) = e2m1::unpack(byte);
            xq.push(bf16::to_bits(e2m1::decode(lo) * sc));
            xq.push(bf16::to_bits(e2m1::decode(hi) * sc));
        }
        let want_h = [
            health.blocks,
            health.scale_zero,
            health.scale_max,
            health.scale_nan,
            health.clipped,
            health.dead_zone,
            health.elements,
            amax.to_bits() as u64,
        ];
        let xh = if xhat_bf16 { " (xhat bf16)" } else { "" };
        let mut raw_v1: Vec<(String, Vec<u64>)> = Vec::new();
        let prev_k = t.g.aq_kernel;
        for (v2, kname, sfx) in [
            (false, "", ""),
            (true, "act_quant_nvfp4_v2", " v2"),
            (true, "act_quant_nvfp4_v3", " v3"),
        ] {
            t.g.v2 = v2;
            if v2 {
                t.g.aq_kernel = kname;
            }
            let run = |t: &mut T, out: &mut Vec<Check>| -> Result<Vec<(String, Vec<u64>)>> {
                let (po, so, qo, ho) = (
                    t.out(m * k / 2)?,
                    t.out(m * k / 16)?,
                    t.out(m * k * 2)?,
                    t.out(m * k * 4)?,
                );
                let hb = t.g.alloc(H_SLOTS * 8)?;
                t.g.memset(hb.ptr, 0, H_SLOTS * 8)?;
                let outs = ActQuantOut {
                    packed: po.ptr,
                    scales: so.ptr,
                    xq16: qo.ptr,
                    xhat: ho.ptr,
                    xhat_bf16,
                    health: hb.ptr,
                };
                t.g.act_quant_nvfp4(xb.ptr, nb, gx, outs)?;
                let mut raw = Vec::new();
                let name = format!("act quant nvfp4 packed codes, g {gname}");
                let got = t.get_u8(&po, m * k / 2)?;
                out.push(exact_u(&format!("{name}{sfx}"), &got, &want.packed));
                raw.push((name, got.iter().map(|&v| v as u64).collect()));
                let name = format!("act quant nvfp4 scale bytes, g {gname}");
                let got = t.get_u8(&so, m * k / 16)?;
                out.push(exact_u(&format!("{name}{sfx}"), &got, &want.scales));
                raw.push((name, got.iter().map(|&v| v as u64).collect()));
                let name = format!("act quant nvfp4 GEMM operand e2m1*s (bf16), g {gname}");
                let got = t.get_u16(&qo, m * k)?;
                out.push(exact_bf16(&format!("{name}{sfx}"), &got, &xq));
                raw.push((name, got.iter().map(|&v| v as u64).collect()));
                let name = format!("act quant nvfp4 quantize-dequantize{xh}, g {gname}");
                let got = t.get_f32(&ho, m * k)?;
                out.push(exact(&format!("{name}{sfx}"), &got, &fake));
                raw.push((name, got.iter().map(|v| v.to_bits() as u64).collect()));
                let name = format!("act quant nvfp4 health counters + amax, g {gname}");
                let h: Vec<u64> = t.g.download(hb.ptr, H_SLOTS)?;
                let mut c = exact_u(&format!("{name}{sfx}"), &h, &want_h);
                c.note = format!(
                    "blocks {} zero {} max {} nan {} clipped {} dead {}",
                    health.blocks,
                    health.scale_zero,
                    health.scale_max,
                    health.scale_nan,
                    health.clipped,
                    health.dead_zone
                );
                out.push(c);
                raw.push((name, h));
                Ok(raw)
            };
            let r = run(&mut t, &mut out);
            t.g.v2 = prev_v2;
            t.g.aq_kernel = prev_k;
            let raw = r?;
            if !v2 {
                raw_v1 = raw;
            } else {
                for ((name, a), (_, b)) in raw.iter().zip(&raw_v1) {
                    out.push(exact_u(&format!("{name}{sfx} = v1 (raw bits)"), a, b));
                }
            }
        }
    }

    // ---- FP8 1x128 activation quantization ----
    let (m, k) = (48 * s, 640 + 64);
    let x = activations(&mut rng, m, k, true);
    let xb = t.up(&x)?;
    for (np, name) in [
        (0, "act quant fp8 1x128 (pow2 scales)"),
        (1, "act quant fp8 1x128 (non-pow2 fault)"),
    ] {
        let o = t.out(m * k * 4)?;
        t.g.kern().act_quant_fp8(
            (m * k.div_ceil(128)) as u64,
            xb.ptr,
            m as u64,
            k as u64,
            np,
            o.ptr,
        )?;
        let want = if np == 0 {
            fp8_block::fake_quant_act_1x128(&x, m, k, fp8_block::ActScale::DeepSeekPow2)
        } else {
            crate::served::fake_quant_fp8_non_pow2(&x, m, k)
        };
        out.push(exact(name, &t.get_f32(&o, m * k)?, &want));
    }

    // ---- MXFP8 activation quantization (gpt-oss W4A8) ----
    // 690 columns: a partial last group; blocks whose amax is 448·2^j exactly (the rounded-up
    // scale's boundary, where the approximate reciprocal decides), all zero, and below 1e-4
    // (no floor, unlike DeepSeek's 1x128)
    let (m, k) = (48 * s, 690);
    let mut x = activations(&mut rng, m, k, true);
    for r in 0..m {
        let g = (r % 21) * 32;
        match r % 4 {
            0 => {
                x[r * k + g..r * k + g + 32]
                    .iter_mut()
                    .for_each(|v| *v = bf16::round(*v * 1e-3));
                x[r * k + g] = 1.75 * 2f32.powi(r as i32 % 9 - 4);
            }
            1 => x[r * k + g..r * k + g + 32].fill(0.0),
            2 => x[r * k + g..r * k + g + 32]
                .iter_mut()
                .for_each(|v| *v = bf16::round(*v * 1e-6)),
            _ => {}
        }
    }
    let xb = t.up(&x)?;
    let o = t.out(m * k * 4)?;
    t.g.kern().act_quant_mxfp8(
        (m * k.div_ceil(32)) as u64,
        xb.ptr,
        m as u64,
        k as u64,
        o.ptr,
    )?;
    out.push(exact(
        "act quant mxfp8 1x32 (UE8M0 rounded up)",
        &t.get_f32(&o, m * k)?,
        &fp8_block::fake_quant_act_mxfp8(&x, m, k),
    ));

    // ---- BF16 rounding and the GEMM epilogue ----
    let n = xs.len();
    let xb = t.up(&xs)?;
    t.g.kern()
        .scale_round(n as u64, xb.ptr, n as u64, 0.731, 1)?;
    let want: Vec<f32> = xs.iter().map(|&v| bf16::round(v * 0.731)).collect();
    out.push(exact(
        "epilogue bf16(y * alpha)",
        &t.get_f32(&xb, n)?,
        &want,
    ));

    // ---- fused statistics ----
    // `fused_stats` reads four values per load when both tensors are 16-byte aligned (four grid
    // strides' loads at once while four remain: n beyond 4 × 4 × 256 threads × 2 blocks per SM
    // on any GPU up to 256 SMs, with values of every kind on either side of that boundary), one
    // value per load otherwise (the last case: views one element in) and for the n % 4 tail
    for (name, poison, off) in [
        ("fused stats + compare (finite)", false, 0usize),
        ("fused stats + compare (NaN/Inf)", true, 0),
        ("fused stats + compare (NaN/Inf, unaligned views)", true, 1),
    ] {
        let n = 4_000_037 * s;
        let r: Vec<f32> = (0..n).map(|_| (rng.normal() * 2.0) as f32).collect();
        let mut x: Vec<f32> = r
            .iter()
            .map(|&v| v + (rng.normal() * 0.01) as f32)
            .collect();
        // entries equal to the reference's (an index selection's agreement counts them)
        for i in (5..n).step_by(7) {
            x[i] = r[i];
        }
        x[12345] = 0.0;
        if poison {
            x[777] = f32::NAN;
            x[999] = f32::INFINITY;
            x[2_900_001] = f32::NEG_INFINITY;
            x[n - 3] = f32::NAN;
        }
        x[3_100_003] = 0.0;
        let (xb, rb) = (t.up(&x)?, t.up(&r)?);
        let at = (4 * off) as u64;
        let (st, cmp) = t.g.stats_compare(xb.ptr + at, Some(rb.ptr + at), n - off)?;
        let cmp = cmp.unwrap_or_default();
        let (x, r) = (&x[off..], &r[off..]);
        let (ws, wc) = (Stats::of(x), Compare::of(x, r));
        let counts_ok = st.nan == ws.nan
            && st.inf == ws.inf
            && st.zeros == ws.zeros
            && st.amax == ws.amax
            && cmp.new_non_finite == wc.new_non_finite
            && cmp.equal == wc.equal
            && cmp.cos.is_some() == wc.cos.is_some()
            && cmp.max_abs_idx == wc.max_abs_idx;
        let opt = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) => rel(a, b),
            (None, None) => 0.0,
            _ => f64::INFINITY,
        };
        let worst = [
            rel(st.mean_abs, ws.mean_abs),
            opt(cmp.cos.map(|c| 1.0 - c), wc.cos.map(|c| 1.0 - c)),
            opt(cmp.rel_l2, wc.rel_l2),
            opt(cmp.amax_ratio, wc.amax_ratio),
            opt(cmp.max_abs_err, wc.max_abs_err),
        ]
        .into_iter()
        .fold(0.0, f64::max);
        out.push(Check {
            name: name.into(),
            cases: n - off,
            mismatches: (!counts_ok) as usize,
            worst,
            tolerance: 1e-6,
            note: format!(
                "counts/amax/argmax/equal entries exact; 1-cos {:.3e}, rel-L2 {:.3e}",
                wc.one_minus_cos(),
                wc.rel_l2.unwrap_or(f64::NAN)
            ),
        });
    }

    // ---- GEMMs ----
    let (m, k, nn) = (37, 1024 + 96, 300 * s);
    let x: Vec<f32> = (0..m * k)
        .map(|_| bf16::round(rng.normal() as f32))
        .collect();
    let w: Vec<f32> = (0..nn * k)
        .map(|_| bf16::round(rng.normal() as f32))
        .collect();
    let want = crate::device::gemm::matmul_nt(&x, &w, m, k, nn);
    let (xb, wb) = (t.up(&x)?, t.up(&w)?);
    use crate::backend::cuda::Ty;
    // the default GEMM: f64 accumulation, bit-equal to the CPU reference
    let o = t.out(m * nn * 4)?;
    t.g.gemm(Ty::F32, xb.ptr, k, wb.ptr, o.ptr, nn, m, nn, k)?;
    out.push(exact(
        "GEMM f64-accumulated (DGEMM) vs CPU reference",
        &t.get_f32(&o, m * nn)?,
        &want,
    ));
    for ms in [1usize, 3, 8] {
        let o = t.out(ms * nn * 4)?;
        t.g.gemm(Ty::F32, xb.ptr, k, wb.ptr, o.ptr, nn, ms, nn, k)?;
        out.push(exact(
            &format!("GEMM f64-accumulated few-row kernel, m={ms}, vs CPU reference"),
            &t.get_f32(&o, ms * nn)?,
            &want[..ms * nn],
        ));
    }
    // rows in blocks of GEMM_ROWS: a call over 2·GEMM_ROWS + 37 rows gives its middle block and
    // its tail the bits of calls over those rows alone (what makes `--chunk` runs equal to whole
    // ones on the device)
    {
        let gr = crate::backend::cuda::GEMM_ROWS;
        let m2 = 2 * gr + 37;
        let x2: Vec<f32> = (0..m2 * k)
            .map(|_| bf16::round(rng.normal() as f32))
            .collect();
        let xb2 = t.up(&x2)?;
        let o = t.out(m2 * nn * 4)?;
        t.g.gemm(Ty::F32, xb2.ptr, k, wb.ptr, o.ptr, nn, m2, nn, k)?;
        let whole = t.get_f32(&o, m2 * nn)?;
        for (r0, mr) in [(gr, gr), (2 * gr, 37)] {
            let o = t.out(mr * nn * 4)?;
            let xr = xb2.ptr + (r0 * k * 4) as u64;
            t.g.gemm(Ty::F32, xr, k, wb.ptr, o.ptr, nn, mr, nn, k)?;
            out.push(exact(
                &format!(
                    "GEMM f64-accumulated rows {r0}..{} alone = within {m2} rows",
                    r0 + mr
                ),
                &t.get_f32(&o, mr * nn)?,
                &whole[r0 * nn..(r0 + mr) * nn],
            ));
        }
    }
    // the hardware GEMMs (with `exact64` off)
    let o = t.out(m * nn * 4)?;
    t.g.gemm_native(Ty::F32, xb.ptr, k, wb.ptr, o.ptr, nn, m, nn, k)?;
    out.push(close(
        "GEMM f32 (pedantic, no TF32)",
        &t.get_f32(&o, m * nn)?,
        &want,
        1e-6,
    ));
    let x16: Vec<u16> = x.iter().map(|&v| bf16::to_bits(v)).collect();
    let w16: Vec<u16> = w.iter().map(|&v| bf16::to_bits(v)).collect();
    let (xb, wb) = (t.up(&x16)?, t.up(&w16)?);
    let o = t.out(m * nn * 4)?;
    t.g.gemm_native(Ty::Bf16, xb.ptr, k, wb.ptr, o.ptr, nn, m, nn, k)?;
    out.push(close(
        "GEMM bf16 x bf16 -> f32 (tensor cores)",
        &t.get_f32(&o, m * nn)?,
        &want,
        1e-6,
    ));
    let o = t.out(m * nn * 4)?;
    t.g.gemm(Ty::Bf16, xb.ptr, k, wb.ptr, o.ptr, nn, m, nn, k)?;
    out.push(exact(
        "GEMM f64-accumulated on BF16 operands vs CPU reference",
        &t.get_f32(&o, m * nn)?,
        &want,
    ));

    // ---- MoE: gather, combine ----
    // a width past one 256-column block of the gather's grid, not a multiple of it
    let (tt, d) = (50, 300);
    let x: Vec<f32> = (0..tt * d).map(|_| rng.normal() as f32).collect();
    let idx: Vec<i32> = (0..120).map(|_| rng.below(tt) as i32).collect();
    let (xb, ib) = (t.up(&x)?, t.up(&idx)?);
    let o = t.out(idx.len() * d * 4)?;
    t.g.gather_rows(xb.ptr, ib.ptr, idx.len(), d, o.ptr)?;
    let want: Vec<f32> = idx
        .iter()
        .flat_map(|&r| x[r as usize * d..(r as usize + 1) * d].to_vec())
        .collect();
    out.push(exact(
        "expert gather",
        &t.get_f32(&o, idx.len() * d)?,
        &want,
    ));
    // SwiGLU with its clamp: bit for bit in the layer checks (`Gpu::swiglu`, selftest/layer.rs);
    // here the experts' form, which stores (rounds) the gate and up projections itself
    let n_g = 4099;
    let gt: Vec<f32> = (0..n_g).map(|_| 4.0 * rng.normal() as f32).collect();
    let up: Vec<f32> = (0..n_g).map(|_| 4.0 * rng.normal() as f32).collect();
    let (gb, ub) = (t.up(&gt)?, t.up(&up)?);
    let o = t.out(n_g * 4)?;
    t.g.swiglu_clamp(gb.ptr, ub.ptr, n_g, 7.0, true, true, o.ptr)?;
    let bf = crate::numerics::bf16::round;
    let want: Vec<f32> = gt
        .iter()
        .zip(&up)
        .map(|(&x, &u)| bf(crate::device::ops::silu(bf(x).min(7.0)) * bf(u).clamp(-7.0, 7.0)))
        .collect();
    out.push(exact(
        "expert SwiGLU, gate and up stored by the kernel, clamp 7",
        &t.get_f32(&o, n_g)?,
        &want,
    ));
    let k_slots = 3;
    let rows_y = 90;
    let y: Vec<f32> = (0..rows_y * d).map(|_| rng.normal() as f32).collect();
    let mut srow = vec![-1i32; tt * k_slots];
    let mut sw = vec![0f32; tt * k_slots];
    for (i, (r, w)) in srow.iter_mut().zip(sw.iter_mut()).enumerate() {
        if i % 7 != 3 {
            *r = rng.below(rows_y) as i32;
            *w = rng.uniform() as f32;
        }
    }
    let (yb, rb, wb) = (t.up(&y)?, t.up(&srow)?, t.up(&sw)?);
    let o = t.out(tt * d * 4)?;
    t.g.kern().moe_combine(
        (tt * d) as u64,
        yb.ptr,
        rb.ptr,
        wb.ptr,
        tt as u64,
        k_slots as u64,
        d as u64,
        o.ptr,
    )?;
    let mut want = vec![0f32; tt * d];
    for ti in 0..tt {
        for j in 0..k_slots {
            let r = srow[ti * k_slots + j];
            if r >= 0 {
                for c in 0..d {
                    want[ti * d + c] += sw[ti * k_slots + j] * y[r as usize * d + c];
                }
            }
        }
    }
    out.push(exact(
        "expert combine (CPU order)",
        &t.get_f32(&o, tt * d)?,
        &want,
    ));
    drop(o);
    layer::checks(t.g, &mut rng, s, &mut out)?;
    long::checks(t.g, &mut rng, s, &mut out)?;
    moe::checks(t.g, &mut rng, s, &mut out)?;
    family::checks(t.g, &mut rng, s, &mut out)?;
    Ok(out)
}

/// Count, over whole binades, where rcp.approx.ftz differs from the correctly rounded reciprocal.
fn rcp_sweep(g: &mut Gpu, exps: std::ops::RangeInclusive<i32>) -> Result<(u64, Vec<String>)> {
    let cnt = g.alloc(8)?;
    g.memset(cnt.ptr, 0, 8)?;
    let cap = 8u32;
    let first = g.alloc(cap as usize * 4)?;
    for e in exps {
        g.kern().rcp_sweep(1 << 23, e, cnt.ptr, first.ptr, cap)?;
    }
    let c: Vec<u64> = g.download(cnt.ptr, 1)?;
    let f: Vec<u32> = g.download(first.ptr, cap as usize)?;
    let ex = f
        .iter()
        .take(c[0].min(cap as u64) as usize)
        .map(|&b| format!("{:e} (0x{b:08X})", f32::from_bits(b)))
        .collect();
    Ok((c[0], ex))
}

/// Per-op agreement of two runs of the same job (CPU and CUDA backends).
#[derive(Clone, Debug, serde::Serialize)]
pub struct RunAgreement {
    pub ops: usize,
    /// Ops whose amax differs beyond 1e-4 relative, or whose NaN/Inf counts differ, in any path.
    pub stat_mismatches: Vec<String>,
    /// Worst |Δcos| over ops and comparisons.
    pub worst_cos_delta: f64,
    pub worst_cos_op: String,
    pub worst_amax_rel: f64,
    pub divergent_cpu: usize,
    pub divergent_gpu: usize,
}

/// The fields that differ between the op records of two runs of the same job, as
/// "op id: field path: a vs b". Integers, strings, booleans and amaxes must be equal; other floats
/// (means, cosines, norms: f64 sums whose atomic order on the GPU varies from run to run) within
/// 1e-9 relative (as `probes/device/run_diff.py`).
pub fn differing_ops(a: &[crate::probe::OpRecord], b: &[crate::probe::OpRecord]) -> Vec<String> {
    use serde_json::Value;
    fn walk(path: &str, x: &Value, y: &Value, out: &mut Vec<String>) {
        match (x, y) {
            (Value::Object(p), Value::Object(q)) => {
                for k in p.keys().chain(q.keys().filter(|k| !p.contains_key(*k))) {
                    let (u, v) = (&p.get(k).cloned().unwrap_or(Value::Null), q.get(k));
                    walk(&format!("{path}.{k}"), u, v.unwrap_or(&Value::Null), out);
                }
            }
            (Value::Array(p), Value::Array(q)) if p.len() == q.len() => {
                for (i, (u, v)) in p.iter().zip(q).enumerate() {
                    walk(&format!("{path}[{i}]"), u, v, out);
                }
            }
            (Value::Number(u), Value::Number(v)) if u != v => {
                let exact = path.ends_with(".amax") || !(u.is_f64() && v.is_f64());
                let (u, v) = (
                    u.as_f64().unwrap_or(f64::NAN),
                    v.as_f64().unwrap_or(f64::NAN),
                );
                if exact || (u - v).abs() > 1e-9 * u.abs().max(v.abs()) + 1e-12 {
                    out.push(format!("{path}: {u} vs {v}"));
                }
            }
            (Value::Number(_), Value::Number(_)) => {}
            _ if x != y => out.push(format!("{path}: {x} vs {y}")),
            _ => {}
        }
    }
    if a.len() != b.len() {
        return vec![format!("{} ops against {}", a.len(), b.len())];
    }
    let mut out = Vec::new();
    for (x, y) in a.iter().zip(b) {
        let (u, v) = (serde_json::to_value(x), serde_json::to_value(y));
        match (u, v) {
            (Ok(u), Ok(v)) => walk(&x.id, &u, &v, &mut out),
            _ => out.push(format!("{}: record not serializable", x.id)),
        }
    }
    out
}

/// Compare two run results op by op: NaN/Inf counts exactly, amax and cosines within tolerance.
pub fn compare_runs(cpu: &RunResult, gpu: &RunResult) -> RunAgreement {
    let mut a = RunAgreement {
        ops: cpu.records.len(),
        stat_mismatches: Vec::new(),
        worst_cos_delta: 0.0,
        worst_cos_op: String::new(),
        worst_amax_rel: 0.0,
        divergent_cpu: cpu.records.iter().filter(|r| r.divergent).count(),
        divergent_gpu: gpu.records.iter().filter(|r| r.divergent).count(),
    };
    if cpu.records.len() != gpu.records.len() {
        a.stat_mismatches.push(format!(
            "op count {} vs {}",
            cpu.records.len(),
            gpu.records.len()
        ));
        return a;
    }
    for (c, g) in cpu.records.iter().zip(&gpu.records) {
        for (path, sc) in &c.stats {
            let Some(sg) = g.stats.get(path) else {
                a.stat_mismatches.push(format!("{} {path}: missing", c.id));
                continue;
            };
            let ar = rel(sc.amax, sg.amax);
            a.worst_amax_rel = a.worst_amax_rel.max(ar);
            if sc.nan != sg.nan || sc.inf != sg.inf || ar > 1e-4 {
                a.stat_mismatches.push(format!(
                    "{} {path}: amax {:.6e} vs {:.6e}, NaN {} vs {}, Inf {} vs {}",
                    c.id, sc.amax, sg.amax, sc.nan, sg.nan, sc.inf, sg.inf
                ));
            }
        }
        for (x, y) in [
            (&c.bf16_vs_fp32, &g.bf16_vs_fp32),
            (&c.served_isolated_vs_bf16, &g.served_isolated_vs_bf16),
            (&c.served_propagated_vs_bf16, &g.served_propagated_vs_bf16),
            (&c.served_isolated_vs_fp32, &g.served_isolated_vs_fp32),
        ] {
            let d = match (x.cos, y.cos) {
                (Some(p), Some(q)) => (p - q).abs(),
                (None, None) => 0.0,
                _ => f64::INFINITY,
            };
            if d > a.worst_cos_delta {
                a.worst_cos_delta = d;
                a.worst_cos_op = c.id.clone();
            }
        }
    }
    a
}

/// One kernel-bandwidth measurement.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchLine {
    pub what: String,
    /// Bytes read plus bytes written per call.
    pub bytes: u64,
    pub median_ms: f64,
    pub gb_per_s: f64,
    /// Against the measured device-to-device copy (read + write) bandwidth.
    pub vs_d2d: f64,
}

fn time_ms(g: &Gpu, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let err = |e| crate::Error::Backend(format!("cuda: event: {e:?}"));
    f()?; // warm-up
    g.sync()?;
    let mut ts = Vec::new();
    for _ in 0..reps {
        let flag = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let a = g.ctx.new_event(flag).map_err(err)?;
        let b = g.ctx.new_event(flag).map_err(err)?;
        a.record(&g.stream).map_err(err)?;
        f()?;
        b.record(&g.stream).map_err(err)?;
        b.synchronize().map_err(err)?;
        ts.push(a.elapsed_ms(&b).map_err(err)? as f64);
    }
    ts.sort_by(f64::total_cmp);
    Ok(ts[ts.len() / 2])
}

/// Bandwidth of the dequantization and activation-quantization kernels on multi-GB tensors,
/// against a device-to-device copy of the same order of size. `gib`: packed weight size.
/// Size of the backend's pinned staging buffer.
const STAGE_BYTES: usize = 256 << 20;

pub fn bench(g: &mut Gpu, gib: f64) -> Result<Vec<BenchLine>> {
    let mut out = Vec::new();
    let reps = 5;
    // device-to-device copy
    let cb = (gib * (1u64 << 30) as f64) as usize * 2;
    let (a, b) = (g.alloc(cb)?, g.alloc(cb)?);
    g.memset(a.ptr, 0x3F, cb)?;
    let ms = time_ms(g, reps, || {
        unsafe { cudarc::driver::result::memcpy_dtod_async(b.ptr, a.ptr, cb, g.stream.cu_stream()) }
            .map_err(|e| crate::Error::Backend(format!("cuda: dtod: {e:?}")))
    })?;
    let d2d = 2.0 * cb as f64 / (ms * 1e-3) / 1e9;
    out.push(BenchLine {
        what: format!(
            "device-to-device copy {:.1} GiB",
            cb as f64 / (1u64 << 30) as f64
        ),
        bytes: 2 * cb as u64,
        median_ms: ms,
        gb_per_s: d2d,
        vs_d2d: 1.0,
    });
    drop((a, b));
    // host-to-device copy from pinned memory (the warm run's floor is bytes / this rate)
    let hb = g.alloc(STAGE_BYTES)?;
    let mut n = 0;
    let ms = time_ms(g, reps, || {
        n = g.copy_pinned_to(hb.ptr)?;
        Ok(())
    })?;
    out.push(BenchLine {
        what: format!("host-to-device copy from pinned memory, {} MiB", n >> 20),
        bytes: n as u64,
        median_ms: ms,
        gb_per_s: n as f64 / (ms * 1e-3) / 1e9,
        vs_d2d: n as f64 / (ms * 1e-3) / 1e9 / d2d,
    });
    drop(hb);
    // NVFP4 weight dequantization
    let pk = (gib * (1u64 << 30) as f64) as usize / 8 * 8;
    let nb = (pk / 8) as u64;
    let (p, s) = (g.alloc(pk)?, g.alloc(pk / 8)?);
    g.memset(p.ptr, 0x5A, pk)?;
    g.memset(s.ptr, 0x38, pk / 8)?;
    // v1 and v2 kernels on the same buffers, one row each, side by side
    let prev_v2 = g.v2;
    for (ok, elem, name) in [(1, 2usize, "bf16"), (0, 4, "f32")] {
        let o = g.alloc(pk * 2 * elem)?;
        for (v2, kname) in [(false, "dequant_nvfp4"), (true, "dequant_nvfp4_v2")] {
            g.v2 = v2;
            let ms = time_ms(g, reps, || {
                let dec = Nvfp4Decode {
                    global: 1.5,
                    conv: 0,
                    post: None,
                    swap: false,
                    out_bf16: ok == 1,
                };
                g.dequant_nvfp4(p.ptr, s.ptr, nb, dec, o.ptr)
            });
            g.v2 = prev_v2;
            let ms = ms?;
            let bytes = (pk + pk / 8 + pk * 2 * elem) as u64;
            let bw = bytes as f64 / (ms * 1e-3) / 1e9;
            out.push(BenchLine {
                what: format!(
                    "{kname} {:.1} GiB packed -> {name} ({:.1} GiB)",
                    pk as f64 / (1u64 << 30) as f64,
                    (pk * 2 * elem) as f64 / (1u64 << 30) as f64
                ),
                bytes,
                median_ms: ms,
                gb_per_s: bw,
                vs_d2d: bw / d2d,
            });
        }
    }
    drop((p, s));
    // NVFP4 activation quantization: f32 in, codes + scale bytes (+ the BF16 GEMM operand) out
    let n = (gib * (1u64 << 30) as f64) as usize / 16 * 16; // elements: 4·gib GiB of f32
    let x = g.alloc(n * 4)?;
    g.memset(x.ptr, 0x3F, n * 4)?;
    let (po, so, qo) = (g.alloc(n / 2)?, g.alloc(n / 16)?, g.alloc(n * 2)?);
    let h = g.alloc(H_SLOTS * 8)?;
    g.memset(h.ptr, 0, H_SLOTS * 8)?;
    let nb = (n / 16) as u64;
    // (codes and scale bytes, BF16 GEMM operand, what): the first two are a W4A4 kernel's own
    // outputs; the last two are the calls the served paths make (W4A4 emulation: the BF16 operand
    // and the health counters; W4A16: the counters alone). Counters are computed in every row.
    for (with_c, with_q, name) in [
        (true, false, "codes + scales"),
        (true, true, "codes + scales + bf16 GEMM operand"),
        (false, true, "bf16 GEMM operand (served W4A4 call)"),
        (false, false, "health counters only (served W4A16 call)"),
    ] {
        let prev_k = g.aq_kernel;
        let all = [
            (false, "act_quant_nvfp4"),
            (true, "act_quant_nvfp4_v2"),
            (true, "act_quant_nvfp4_v3"),
        ];
        for (v2, kname) in all {
            g.v2 = v2;
            if v2 {
                g.aq_kernel = kname;
            }
            let ms = time_ms(g, reps, || {
                let outs = ActQuantOut {
                    packed: if with_c { po.ptr } else { 0 },
                    scales: if with_c { so.ptr } else { 0 },
                    xq16: if with_q { qo.ptr } else { 0 },
                    health: h.ptr,
                    ..Default::default()
                };
                g.act_quant_nvfp4(x.ptr, nb, 3.0, outs)
            });
            g.v2 = prev_v2;
            g.aq_kernel = prev_k;
            let ms = ms?;
            let codes = if with_c { n / 2 + n / 16 } else { 0 };
            let bytes = (n * 4 + codes + if with_q { n * 2 } else { 0 }) as u64;
            let bw = bytes as f64 / (ms * 1e-3) / 1e9;
            out.push(BenchLine {
                what: format!(
                    "{kname} {:.1} GiB f32 -> {name}",
                    (n * 4) as f64 / (1u64 << 30) as f64
                ),
                bytes,
                median_ms: ms,
                gb_per_s: bw,
                vs_d2d: bw / d2d,
            });
        }
    }
    Ok(out)
}

/// rcp.approx.ftz − correctly rounded reciprocal, in ulps, for every mantissa of [1, 2).
pub fn rcp_table(g: &mut Gpu) -> Result<Vec<i8>> {
    let o = g.alloc(1 << 23)?;
    g.memset(o.ptr, 0x7F, 1 << 23)?;
    g.kern().rcp_table(1 << 23, o.ptr)?;
    g.download(o.ptr, 1 << 23)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe;

    /// The record comparison behind the self-test's chunking check: blind to f64 sums' last
    /// bits, not to an amax, a count or a string.
    #[test]
    fn differing_ops_sees_amax_and_counts_but_not_f64_sum_noise() {
        let ck = crate::synth::builtin(0).expect("built-in model");
        let cfg = ck.model_config().expect("config").clone();
        let tokens = probe::synthetic_tokens(8, cfg.vocab_size, 3);
        let opts = probe::RunOptions::new((0, 1), tokens);
        let r = probe::run(&ck, &opts).expect("run");
        let a = &r.records;
        assert!(differing_ops(a, &a.clone()).is_empty());
        let key = |b: &[probe::OpRecord]| b[3].stats.keys().next().cloned().expect("stats");
        let k = key(a);
        let mut b = a.clone();
        b[3].stats.get_mut(&k).expect("stats").mean_abs *= 1.0 + 1e-12;
        assert!(
            differing_ops(a, &b).is_empty(),
            "sum noise is not a difference"
        );
        b[3].stats.get_mut(&k).expect("stats").mean_abs *= 1.0 + 1e-6;
        let d = differing_ops(a, &b);
        assert!(d.len() == 1 && d[0].contains("mean_abs"), "{d:?}");
        let mut b = a.clone();
        let am = &mut b[3].stats.get_mut(&k).expect("stats").amax;
        *am = f64::from_bits(am.to_bits() + 1);
        let d = differing_ops(a, &b);
        assert!(d.len() == 1 && d[0].contains(".amax"), "{d:?}");
        let mut b = a.clone();
        let k5 = key(&b[5..]);
        b[5].stats.get_mut(&k5).expect("stats").nan += 1;
        b[7].divergent = !b[7].divergent;
        assert_eq!(differing_ops(a, &b).len(), 2);
        assert_eq!(differing_ops(a, &a[1..]).len(), 1, "a missing op");
    }
}
