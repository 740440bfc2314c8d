//! How the grouped routed-experts launches compute each expert linear on a path: the activation
//! operand (one kind for all experts), the `moe_gemm_f64` tile per expert, the segmented
//! activation quantization and the SwiGLU store (used by `experts`).

use super::*;

/// The routed-experts op's output, the served observations per expert linear (sub id, what it
/// saw), the weight bases it read, and per expert that received tokens (in expert order) the
/// amax of the activation its w2 was fed (whatever the path; NaN-ignoring, as the CPU's fold).
pub type ExpertsOut = crate::served::FusedExperts;

/// With the FMA kernel (`NVFP4_PROBE_MOE_KERNEL=fma`) the grouped experts op takes experts of up
/// to this many rows; an op where some expert sees more tokens runs per expert (cuBLAS DGEMM for
/// its many rows). The tensor-core kernel takes any number of rows.
pub(super) const GROUPED_MAX_ROWS: usize = 64;

/// The `act_quant_nvfp4_seg` segments of rows (first row, row count) of a [.., k] activation:
/// segment i with encode scale `g(i)` and counters at `health(i)`.
pub(super) fn aq_segs(
    segs: &[(usize, usize)],
    k: usize,
    g: &dyn Fn(usize) -> f32,
    health: &dyn Fn(usize) -> u64,
) -> Vec<AqSeg> {
    segs.iter()
        .enumerate()
        .map(|(i, &(r0, rows))| AqSeg {
            block0: (r0 * k / 16) as u64,
            nblocks: (rows * k / 16) as u64,
            g: g(i),
            pad: 0,
            health: health(i),
        })
        .collect()
}

/// What one path multiplies a routed expert linear's weight with, in the grouped experts op.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum MoeAct {
    /// The f32 activation (FP32 oracle).
    F32,
    /// bf16(x) (BF16 oracle).
    Bf16,
    /// The NVFP4 fake-quantized BF16 operand e2m1·s (served W4A4).
    Nvfp4W4a4,
    /// bf16 of the quantize-dequantize (served emulation).
    Nvfp4Emul,
    /// bf16(x), the amax and counters observed (served W4A16).
    Nvfp4W4a16,
    /// The exact-served experts' activation (served MXFP4 experts): FP8 1×128, MXFP8 or x as is,
    /// as the family's recipe says under the profile (`Gpu::exact_act`).
    Exact {
        act: crate::served::ExactAct,
        non_pow2: bool,
    },
}

impl Gpu {
    /// How the grouped experts op computes linear `j` (0 w1, 1 w3, 2 w2) of every routed expert
    /// on this path: the activation operand (one kind for all experts) and per expert the tile
    /// template and the served NVFP4 parameters. None when some weight needs the per-expert
    /// sequence (a format other than NVFP4/MXFP4, a served reading prepared on the host, NVFP4
    /// served without parameters, experts of different shapes or activation kinds).
    #[allow(clippy::type_complexity)]
    pub(super) fn moe_plan(
        &self,
        kind: PathKind,
        profile: Profile,
        used: &[usize],
        bases: &[String],
    ) -> Option<([MoeAct; 3], [Vec<(MoeTile, Option<Nvfp4Params>)>; 3], usize)> {
        let first = &self.weights[&bases[3 * *used.first()?]];
        let inter = first.n;
        let mut acts = [MoeAct::F32; 3];
        let mut plans: [Vec<(MoeTile, Option<Nvfp4Params>)>; 3] = Default::default();
        for (j, (act, plan)) in acts.iter_mut().zip(plans.iter_mut()).enumerate() {
            for (i, &e) in used.iter().enumerate() {
                let w = self.weights.get(&bases[3 * e + j])?;
                if (j < 2 && w.n != inter) || (j == 2 && w.k != inter) {
                    return None;
                }
                if matches!(w.fmt, DevFmt::Mx { .. }) && !self.grouped_mx {
                    return None;
                }
                let (a, t, p) = Self::moe_linear(kind, profile, w)?;
                if i == 0 {
                    *act = a;
                } else if a != *act {
                    return None;
                }
                plan.push((t, p));
            }
        }
        Some((acts, plans, inter))
    }

    /// One expert linear of the grouped op: what [`Gpu::linear_with`] does with this weight on
    /// this path, as an activation kind and a `moe_gemm_f64` tile template.
    fn moe_linear(
        kind: PathKind,
        profile: Profile,
        w: &DevWeight,
    ) -> Option<(MoeAct, MoeTile, Option<Nvfp4Params>)> {
        let (packed, stored, conv, global, mx) = match &w.fmt {
            DevFmt::Nv {
                packed,
                scales,
                conv,
                global,
            } => {
                let c = match conv {
                    Convention::CompressedTensors => 0,
                    Convention::ModelOpt => 1,
                };
                (packed.ptr, scales.ptr, c, *global, false)
            }
            DevFmt::Mx { packed, scales } => (packed.ptr, scales.ptr, 3, 1.0, true),
            _ => return None,
        };
        let t = MoeTile {
            packed,
            scales: stored,
            global,
            flags: conv,
            ..Default::default()
        };
        match kind {
            PathKind::OracleFp32 => Some((MoeAct::F32, t, None)),
            // the experts' activations are BF16 values on this path (`x_bf16`)
            PathKind::OracleBf16 => Some((
                MoeAct::Bf16,
                MoeTile {
                    flags: conv | MT_WBF16,
                    ..t
                },
                None,
            )),
            PathKind::Served => {
                let ServedDev::Native {
                    nv,
                    swap,
                    non_pow2,
                    scales,
                    ..
                } = &w.served
                else {
                    return None;
                };
                if mx {
                    // dequant_mxfp4 of the served operand (no nibble-order flag), the activation
                    // of the family's recipe under the profile, bf16(y) epilogue
                    return Some((
                        MoeAct::Exact {
                            act: profile.exact_act(w.recipe),
                            non_pow2: *non_pow2,
                        },
                        MoeTile {
                            flags: 3 | MT_EPI,
                            mul: 1.0,
                            ..t
                        },
                        None,
                    ));
                }
                let p = (*nv)?;
                let t = MoeTile {
                    scales: scales.as_ref().map_or(stored, |(b, _)| b.ptr),
                    flags: 2 | MT_WBF16 | MT_EPI | if *swap { MT_SWAP } else { 0 },
                    ..t
                };
                let r = profile.recipe();
                let act = match r.act {
                    ActQuant::Nvfp4Codes => MoeAct::Nvfp4W4a4,
                    ActQuant::Nvfp4Bf16 => MoeAct::Nvfp4Emul,
                    ActQuant::Bf16 => MoeAct::Nvfp4W4a16,
                };
                let t = match r.weight {
                    WeightOperand::Bf16Dequantized => MoeTile {
                        post: p.d_w,
                        flags: t.flags | MT_POST,
                        ..t
                    },
                    WeightOperand::E2m1Scaled => t,
                };
                Some((
                    act,
                    MoeTile {
                        mul: r.epilogue.multiplier(&p),
                        ..t
                    },
                    Some(p),
                ))
            }
        }
    }

    /// The activation operand of one grouped expert linear over all gathered rows x [total, k]:
    /// (pointer, BF16 bits?). NVFP4 served kinds quantize each expert's rows with its own input
    /// scale into its own health slots (`health(ui)`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_act(
        &mut self,
        act: MoeAct,
        x: u64,
        total: usize,
        k: usize,
        segs: &[(usize, usize)],
        plan: &[(MoeTile, Option<Nvfp4Params>)],
        health: &dyn Fn(usize) -> u64,
    ) -> Result<(u64, bool)> {
        let n = total * k;
        let aq = |g: &dyn Fn(usize) -> f32| aq_segs(segs, k, g, health);
        let gx = |ui: usize| plan[ui].1.map_or(f32::NAN, |p| p.g_x);
        Ok(match act {
            MoeAct::F32 => (x, false),
            MoeAct::Bf16 => (self.bf16_copy("x16", x, n)?, true),
            MoeAct::Nvfp4W4a4 => {
                let xq = self.scratch("xq16", n * 2)?;
                let o = ActQuantOut {
                    xq16: xq,
                    ..Default::default()
                };
                self.act_quant_nvfp4_seg(x, &aq(&gx), o)?;
                (xq, true)
            }
            MoeAct::Nvfp4Emul => {
                let xh = self.scratch("xq32", n * 4)?;
                let o = ActQuantOut {
                    xhat: xh,
                    xhat_bf16: true,
                    ..Default::default()
                };
                self.act_quant_nvfp4_seg(x, &aq(&gx), o)?;
                (self.bf16_copy("x16", xh, n)?, true)
            }
            MoeAct::Nvfp4W4a16 => {
                self.act_quant_nvfp4_seg(x, &aq(&gx), ActQuantOut::default())?;
                (self.bf16_copy("x16", x, n)?, true)
            }
            MoeAct::Exact { act, non_pow2 } => (self.exact_act(act, non_pow2, x, total, k)?, false),
        })
    }

    /// The store of an expert's gate and up projections (BF16 rounding when `round`), then SwiGLU
    /// with the clamp and its store, over `n` elements.
    pub(super) fn swiglu_store(
        &self,
        gt: u64,
        up: u64,
        act: u64,
        n: usize,
        limit: f32,
        round: bool,
    ) -> Result<()> {
        // the kernel stores gate and up itself (one pass instead of three)
        self.swiglu_clamp(gt, up, n, limit, round, round, act)
    }
}
