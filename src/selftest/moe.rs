//! Self-test of the grouped routed-experts kernels (`moe_gemm_f64` in kernels/stats.cu,
//! `act_quant_nvfp4_seg` in kernels/quant.cu) on fresh random data.
//!
//! `moe_gemm_f64` against the CPU reference built from independent pieces: the NVFP4 / MXFP4
//! dequantization of `numerics`, the host GEMM `device::gemm::matmul_nt` per expert, and the
//! epilogue bf16(y · mul), in every decode mode the runner uses. `act_quant_nvfp4_seg` against
//! `act_quant_nvfp4_v3` run segment by segment (v3 is itself checked against the CPU reference in
//! the kernel table): every output bit and every health counter.

use super::{exact, exact_u, nvfp4_scale_bytes, Check};
use crate::backend::cuda::{
    ActQuantOut, AqSeg, Gpu, MoeKernel, MoeTile, H_SLOTS, MMA_R, MOE_R, MT_EPI, MT_POST, MT_SWAP,
    MT_WBF16,
};
use crate::device::gemm::matmul_nt;
use crate::model::mem_env::Rng;
use crate::numerics::nvfp4::{self, Convention};
use crate::numerics::{bf16, mxfp4};
use crate::Result;

/// One expert's stored weight: packed E2M1 codes, E4M3 block scales (16) and UE8M0 ones (32).
struct Expert {
    packed: Vec<u8>,
    nv_scales: Vec<u8>,
    mx_scales: Vec<u8>,
    global: f32,
}

/// A decode mode of the grouped GEMM: (name, decode 0..3, flags, post, epilogue multiplier,
/// BF16 activations).
type Mode = (&'static str, u32, u32, f32, f32, bool);

pub fn checks(g: &mut Gpu, rng: &mut Rng, s: usize, out: &mut Vec<Check>) -> Result<()> {
    // row counts that leave partial tiles of both kernels (MOE_R and MMA_R rows), fill one
    // 8-row fragment exactly, and split experts over three FMA tiles and two tensor-core ones
    let rows = [1usize, 3, MOE_R, 5, 2 * MOE_R + 1, 8, 17, 33, MMA_R + 6];
    let (n, k) = (72 * s + 3, 544); // n not a multiple of the 8- or 64-column groups
    let starts: Vec<usize> = rows
        .iter()
        .scan(0, |a, &r| {
            let s0 = *a;
            *a += r;
            Some(s0)
        })
        .collect();
    let total: usize = rows.iter().sum();
    let experts: Vec<Expert> = (0..rows.len())
        .map(|e| {
            let mut nv_scales = nvfp4_scale_bytes(rng, n * k / 16);
            if e != 3 {
                // NaN block scales only in expert 3: elsewhere most outputs stay finite
                for b in nv_scales.iter_mut() {
                    if *b & 0x7F == 0x7F {
                        *b &= 0xFE;
                    }
                }
            }
            let mx_scales = (0..n * k / 32)
                .map(|i| {
                    if e == 3 && i % 29 == 5 {
                        0xFF
                    } else {
                        (118 + rng.below(18)) as u8
                    }
                })
                .collect();
            Expert {
                packed: (0..n * k / 2).map(|_| rng.next_u64() as u8).collect(),
                nv_scales,
                mx_scales,
                global: [
                    1234.567f32,
                    3.1e-4,
                    448.0 * 6.0,
                    0.731,
                    17.0,
                    2.5,
                    0.05,
                    99.0,
                    1.0,
                ][e],
            }
        })
        .collect();
    // f32 activations (not BF16 values) and their BF16 roundings; rows of different magnitudes
    let x: Vec<f32> = (0..total * k)
        .map(|i| {
            let r = i / k;
            let v = (rng.normal() * 10f64.powi(r as i32 % 5 - 2)) as f32;
            if v == 0.0 {
                1e-3
            } else {
                v
            }
        })
        .collect();
    let x16: Vec<u16> = x.iter().map(|&v| bf16::to_bits(v)).collect();
    let xr: Vec<f32> = x.iter().map(|&v| bf16::round(v)).collect();
    let (xb, x16b) = (g.upload(&x)?, g.upload(&x16)?);
    let dev: Vec<_> = experts
        .iter()
        .map(|e| -> Result<_> {
            Ok((
                g.upload(&e.packed)?,
                g.upload(&e.nv_scales)?,
                g.upload(&e.mx_scales)?,
            ))
        })
        .collect::<Result<_>>()?;
    let modes: [Mode; 5] = [
        ("nvfp4 compressed-tensors, f32", 0, 0, 1.0, 1.0, false),
        ("nvfp4 ModelOpt, BF16 operands", 1, MT_WBF16, 1.0, 1.0, true),
        (
            "nvfp4 served e2m1*s, swapped nibbles, x post, bf16(y*alpha)",
            2,
            MT_WBF16 | MT_SWAP | MT_POST | MT_EPI,
            0.37,
            1.7e-3,
            true,
        ),
        ("mxfp4, f32, bf16(y) epilogue", 3, MT_EPI, 1.0, 1.0, false),
        ("mxfp4, BF16 operands", 3, MT_WBF16, 1.0, 1.0, true),
    ];
    // NVFP4 rows also of an odd number of 16-element steps (k % 32 == 16: moe_mma_f64's second
    // register set then has no last step), the same buffers read as [n, k - 16] matrices
    let ks = |conv: u32| if conv == 3 { vec![k] } else { vec![k, k - 16] };
    for ((name, conv, flags, post, mul, xbf), kernel, k) in modes.iter().flat_map(|&m| {
        MoeKernel::ALL
            .into_iter()
            .flat_map(move |kn| ks(m.1).into_iter().map(move |k| (m, kn, k)))
    }) {
        let (kname, per) = (kernel.name(), kernel.tile_rows());
        let mut tiles = Vec::new();
        for (e, ex) in experts.iter().enumerate() {
            let (p, nv, mx) = &dev[e];
            for a in (0..rows[e]).step_by(per) {
                tiles.push(MoeTile {
                    packed: p.ptr,
                    scales: if conv == 3 { mx.ptr } else { nv.ptr },
                    row0: (starts[e] + a) as u32,
                    rows: per.min(rows[e] - a) as u32,
                    global: ex.global,
                    post,
                    mul,
                    flags: conv | flags,
                });
            }
        }
        let mut want = Vec::with_capacity(total * n);
        for (e, ex) in experts.iter().enumerate() {
            let w = decode(ex, conv, flags, post, n, k);
            let xs = if xbf { &xr } else { &x };
            let xe = &xs[starts[e] * k..(starts[e] + rows[e]) * k];
            let ye = matmul_nt(xe, &w, rows[e], k, n);
            want.extend(ye.into_iter().map(|v| {
                if flags & MT_EPI != 0 {
                    bf16::round(v * mul)
                } else {
                    v
                }
            }));
        }
        let finite = want.iter().filter(|v| v.is_finite()).count();
        let y = g.alloc(total * n * 4)?;
        g.memset(y.ptr, 0xFF, total * n * 4)?;
        let xp = if xbf { x16b.ptr } else { xb.ptr };
        g.moe_gemm(kernel, xp, xbf, k, &tiles, n, k, y.ptr, n)?;
        let got: Vec<f32> = g.download(y.ptr, total * n)?;
        let mut c = exact(
            &format!("grouped experts GEMM ({kname}): {name}, k {k}"),
            &got,
            &want,
        );
        c.note = format!(
            "{} experts of {rows:?} rows in {} tiles, [{n}, {k}] weights; {finite} finite outputs",
            rows.len(),
            tiles.len()
        );
        out.push(c);
    }

    // ---- act_quant_nvfp4_seg = act_quant_nvfp4_v3 segment by segment ----
    let gs = [0.5f32, 37.0, 1234.5, 3.1e-4, 6.0, 2.0, 0.75, 99.0, 1e-2];
    let nbl = |r: usize| (r * k / 16) as u64;
    let mut xq = x.clone();
    xq[37] = f32::NAN;
    xq[k * 4 + 100] = f32::INFINITY;
    let xqb = g.upload(&xq)?;
    let bufs = |g: &Gpu| -> Result<[crate::backend::cuda::Buf; 5]> {
        let mk = |bytes: usize| -> Result<crate::backend::cuda::Buf> {
            let b = g.alloc(bytes)?;
            g.memset(b.ptr, 0xFF, bytes)?;
            Ok(b)
        };
        let nb = total * k / 16;
        Ok([
            mk(nb * 8)?,
            mk(nb)?,
            mk(total * k * 2)?,
            mk(total * k * 4)?,
            {
                let h = g.alloc(rows.len() * H_SLOTS * 8)?;
                g.memset(h.ptr, 0, rows.len() * H_SLOTS * 8)?;
                h
            },
        ])
    };
    let seg_out = |b: &[crate::backend::cuda::Buf; 5], block0: u64, health: u64| ActQuantOut {
        packed: b[0].ptr + block0 * 8,
        scales: b[1].ptr + block0,
        xq16: b[2].ptr + block0 * 32,
        xhat: b[3].ptr + block0 * 64,
        xhat_bf16: true,
        health,
    };
    let (want_b, got_b) = (bufs(g)?, bufs(g)?);
    let mut segs = Vec::new();
    for (e, &r) in rows.iter().enumerate() {
        let b0 = nbl(starts[e]);
        let hp = |b: &[crate::backend::cuda::Buf; 5]| b[4].ptr + (e * H_SLOTS * 8) as u64;
        let o = seg_out(&want_b, b0, hp(&want_b));
        g.act_quant_nvfp4(xqb.ptr + b0 * 64, nbl(r), gs[e], o)?;
        segs.push(AqSeg {
            block0: b0,
            nblocks: nbl(r),
            g: gs[e],
            pad: 0,
            health: hp(&got_b),
        });
    }
    let o = seg_out(&got_b, 0, 0);
    g.act_quant_nvfp4_seg(xqb.ptr, &segs, o)?;
    let nb = total * k / 16;
    let get = |b: &crate::backend::cuda::Buf, n: usize| -> Result<Vec<u8>> { g.download(b.ptr, n) };
    let mut c = exact_u(
        "grouped act quant nvfp4 (per-expert scales) = v3 per segment: codes, scales, BF16 operand, xhat",
        &[
            get(&got_b[0], nb * 8)?,
            get(&got_b[1], nb)?,
            get(&got_b[2], total * k * 2)?,
            get(&got_b[3], total * k * 4)?,
        ]
        .concat(),
        &[
            get(&want_b[0], nb * 8)?,
            get(&want_b[1], nb)?,
            get(&want_b[2], total * k * 2)?,
            get(&want_b[3], total * k * 4)?,
        ]
        .concat(),
    );
    c.note = format!(
        "{} segments, input scales {gs:?}, one NaN and one Inf",
        rows.len()
    );
    out.push(c);
    let hg: Vec<u64> = g.download(got_b[4].ptr, rows.len() * H_SLOTS)?;
    let hw: Vec<u64> = g.download(want_b[4].ptr, rows.len() * H_SLOTS)?;
    let mut c = exact_u(
        "grouped act quant nvfp4: health counters and amax per segment = v3",
        &hg,
        &hw,
    );
    c.note = format!(
        "blocks per segment {:?}",
        hw.chunks(H_SLOTS).map(|h| h[0]).collect::<Vec<_>>()
    );
    out.push(c);
    Ok(())
}

/// The CPU reference's weight for a decode mode: `numerics` dequantization, then the flags.
/// The expert's bytes are read as an [n, k] matrix (k at most the k they were made for).
fn decode(e: &Expert, conv: u32, flags: u32, post: f32, n: usize, k: usize) -> Vec<f32> {
    let packed = &e.packed[..n * k / 2];
    let w = if conv == 3 {
        mxfp4::dequantize(packed, &e.mx_scales[..n * k / 32], n, k)
    } else {
        let packed: Vec<u8> = if flags & MT_SWAP != 0 {
            packed.iter().map(|&b| b.rotate_left(4)).collect()
        } else {
            packed.to_vec()
        };
        let nv = &e.nv_scales[..n * k / 16];
        match conv {
            0 => nvfp4::dequantize(&packed, nv, e.global, Convention::CompressedTensors, n, k),
            1 => nvfp4::dequantize(&packed, nv, e.global, Convention::ModelOpt, n, k),
            // e2m1 · s: ModelOpt's s · global with global 1 (an exact multiplication)
            _ => nvfp4::dequantize(&packed, nv, 1.0, Convention::ModelOpt, n, k),
        }
    };
    w.into_iter()
        .map(|v| {
            let v = if flags & MT_POST != 0 { v * post } else { v };
            if flags & MT_WBF16 != 0 {
                bf16::round(v)
            } else {
                v
            }
        })
        .collect()
}
