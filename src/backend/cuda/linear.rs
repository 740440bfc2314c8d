//! The linears of every path on the device: the FP32 and BF16 oracles, the served linear under
//! the profile's recipe (activation quantization, GEMM operand, epilogue) and its observation
//! (health counters, activation amax); per-linear, row-range and grouped entries.

use super::*;

/// Which weight rows a linear uses.
#[derive(Clone, Copy, Debug)]
pub(super) enum WRows {
    All,
    /// Rows r0..r0 + n.
    Range(usize, usize),
    /// G equal slices, each multiplying its own block of activation rows.
    Groups(usize),
}

impl Gpu {
    /// f32 → BF16 bits into a scratch buffer.
    pub(super) fn bf16_copy(&mut self, name: &'static str, x: u64, n: usize) -> Result<u64> {
        let p = self.scratch(name, n * 2)?;
        self.kern().round_bf16(n as u64, x, 0, n as u64, p)?;
        Ok(p)
    }

    /// One linear of one path, all on the device: x [m, k] f32 at `x` (row stride k) →
    /// y [m, rows] f32 at `y` (row stride `ldy`), using the weight rows `rows` selects
    /// ([`WRows::Groups`]: x holds G blocks of m rows, block g multiplied by the g-th slice of
    /// n / G weight rows into columns g·n/G.. of y; one activation quantization over all blocks).
    /// `x_bf16`: x holds BF16 values exactly (lets the BF16 GEMM be used without rounding x).
    /// `health`: H_SLOTS device counters for the served NVFP4 activation quantization.
    /// Returns the served NVFP4 parameters when the served path quantized the activation.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn linear_dev(
        &mut self,
        lc: &LinearCtx,
        kind: PathKind,
        base: &str,
        x: u64,
        m: usize,
        x_bf16: bool,
        rows: WRows,
        y: u64,
        ldy: usize,
        health: Option<u64>,
    ) -> Result<Option<Nvfp4Params>> {
        self.ensure_weight(lc, base)?;
        self.counters.linears += 1;
        let w = self.weights.remove(base).expect("ensured above");
        let r = self.linear_with(lc, kind, &w, x, m, x_bf16, rows, y, ldy, health);
        self.weights.insert(base.to_string(), w);
        r
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn linear_with(
        &mut self,
        lc: &LinearCtx,
        kind: PathKind,
        w: &DevWeight,
        x: u64,
        m: usize,
        x_bf16: bool,
        rows: WRows,
        y: u64,
        ldy: usize,
        health: Option<u64>,
    ) -> Result<Option<Nvfp4Params>> {
        let (n, k) = (w.n, w.k);
        let (r0, nr, groups) = match rows {
            WRows::All => (0, n, 1),
            WRows::Range(r0, nr) => (r0, nr, 1),
            WRows::Groups(g) => (0, n / g.max(1), g.max(1)),
        };
        let nk = n * k;
        let off = |ptr: u64, elem: usize| ptr + (r0 * k * elem) as u64;
        match kind {
            PathKind::OracleFp32 => {
                let wp = self.scratch("w32", nk * 4)?;
                self.dequant(w, wp, Ty::F32, false, false, None)?;
                self.gemm_g(Ty::F32, x, k, off(wp, 4), y, ldy, m, nr, k, groups)?;
                Ok(None)
            }
            PathKind::OracleBf16 => {
                if x_bf16 {
                    let wp = self.scratch("w16", nk * 2)?;
                    self.dequant(w, wp, Ty::Bf16, false, true, None)?;
                    let xp = self.bf16_copy("x16", x, m * groups * k)?;
                    self.gemm_g(Ty::Bf16, xp, k, off(wp, 2), y, ldy, m, nr, k, groups)?;
                } else {
                    let wp = self.scratch("w32", nk * 4)?;
                    self.dequant(w, wp, Ty::F32, false, true, None)?;
                    self.gemm_g(Ty::F32, x, k, off(wp, 4), y, ldy, m, nr, k, groups)?;
                }
                Ok(None)
            }
            PathKind::Served => {
                self.served_linear(lc, w, x, m, x_bf16, (r0, nr, groups), y, ldy, health)
            }
        }
    }

    /// Epilogue y = bf16(y · mul) over an [m, n] block with row stride ldy.
    pub(super) fn epilogue(&self, y: u64, m: usize, n: usize, ldy: usize, mul: f32) -> Result<()> {
        if ldy == n {
            self.kern()
                .scale_round((m * n) as u64, y, (m * n) as u64, mul, 1)
        } else {
            for r in 0..m {
                self.kern()
                    .scale_round(n as u64, y + (r * ldy * 4) as u64, n as u64, mul, 1)?;
            }
            Ok(())
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn served_linear(
        &mut self,
        _lc: &LinearCtx,
        w: &DevWeight,
        x: u64,
        m: usize,
        x_bf16: bool,
        (r0, nr, groups): (usize, usize, usize),
        y: u64,
        ldy: usize,
        health: Option<u64>,
    ) -> Result<Option<Nvfp4Params>> {
        let (n, k) = (w.n, w.k);
        let nk = n * k;
        let off = |ptr: u64, elem: usize| ptr + (r0 * k * elem) as u64;
        let mk = (m * groups * k) as u64;
        // the operand the served GEMM multiplies: (pointer, type), weight decode without tensor scale for NVFP4
        let (nv, host_w, fp8_act, non_pow2, dense) = match &w.served {
            ServedDev::Native { nv, non_pow2, .. } => (
                *nv,
                None,
                w.fmt.served() == crate::checkpoint::formats::Served::Fp8Act,
                *non_pow2,
                w.fmt.served() == crate::checkpoint::formats::Served::Dense,
            ),
            ServedDev::Host {
                w: hw,
                nv,
                fp8_act,
                non_pow2,
                dense,
            } => (*nv, Some(hw.ptr), *fp8_act, *non_pow2, *dense),
        };
        if dense {
            // BF16 weight, f32 output, no rounding inside the linear
            let wp = match host_w {
                Some(p) => p,
                None => {
                    let wp = self.scratch("w32", nk * 4)?;
                    self.dequant(w, wp, Ty::F32, false, true, None)?;
                    wp
                }
            };
            self.gemm_g(Ty::F32, x, k, off(wp, 4), y, ldy, m, nr, k, groups)?;
            return Ok(None);
        }
        if fp8_act {
            let wp = match host_w {
                Some(p) => p,
                None => {
                    let wp = self.scratch("w32", nk * 4)?;
                    self.dequant(w, wp, Ty::F32, true, false, None)?;
                    wp
                }
            };
            let xq = self.exact_act(_lc.profile.exact_act(w.recipe), non_pow2, x, m * groups, k)?;
            self.gemm_g(Ty::F32, xq, k, off(wp, 4), y, ldy, m, nr, k, groups)?;
            self.epilogue(y, m, nr * groups, ldy, 1.0)?;
            return Ok(None);
        }
        let p = nv.ok_or_else(|| Error::Backend("cuda: NVFP4 weight without parameters".into()))?;
        // e2m1·s_w (exact in BF16) as BF16 bits, or bf(e2m1·s_w·d_w) where the recipe's weight
        // operand is the BF16-dequantized weight
        let recipe = _lc.profile.recipe();
        let wq16 = self.scratch("wq16", nk * 2)?;
        let post = (recipe.weight == WeightOperand::Bf16Dequantized).then_some(p.d_w);
        match host_w {
            Some(hp) => {
                if let Some(d) = post {
                    // the host weight is e2m1·s_w: bf(wq · d_w)
                    let tmp = self.scratch("w32", nk * 4)?;
                    self.copy_on_device(tmp, hp, nk)?;
                    self.kern().scale_round(nk as u64, tmp, nk as u64, d, 1)?;
                    self.kern().round_bf16(nk as u64, tmp, 0, nk as u64, wq16)?;
                } else {
                    self.kern().round_bf16(nk as u64, hp, 0, nk as u64, wq16)?;
                }
            }
            None => self.dequant(w, wq16, Ty::Bf16, true, false, post)?,
        }
        let h = health.unwrap_or(0);
        let mul = recipe.epilogue.multiplier(&p);
        match recipe.act {
            ActQuant::Nvfp4Codes => {
                let xq = self.scratch("xq16", m * groups * k * 2)?;
                let o = ActQuantOut {
                    xq16: xq,
                    health: h,
                    ..Default::default()
                };
                self.act_quant_nvfp4(x, mk / 16, p.g_x, o)?;
                self.gemm_g(Ty::Bf16, xq, k, off(wq16, 2), y, ldy, m, nr, k, groups)?;
                self.epilogue(y, m, nr * groups, ldy, mul)?;
            }
            ActQuant::Nvfp4Bf16 => {
                let xh = self.scratch("xq32", m * groups * k * 4)?;
                let o = ActQuantOut {
                    xhat: xh,
                    xhat_bf16: true,
                    health: h,
                    ..Default::default()
                };
                self.act_quant_nvfp4(x, mk / 16, p.g_x, o)?;
                let xp = self.bf16_copy("x16", xh, m * groups * k)?;
                self.gemm_g(Ty::Bf16, xp, k, off(wq16, 2), y, ldy, m, nr, k, groups)?;
                self.epilogue(y, m, nr * groups, ldy, mul)?;
            }
            ActQuant::Bf16 => {
                // activations stay BF16; the amax is still observed
                let o = ActQuantOut {
                    health: h,
                    ..Default::default()
                };
                self.act_quant_nvfp4(x, mk / 16, p.g_x, o)?;
                if x_bf16 {
                    let xp = self.bf16_copy("x16", x, m * groups * k)?;
                    self.gemm_g(Ty::Bf16, xp, k, off(wq16, 2), y, ldy, m, nr, k, groups)?;
                } else {
                    let wp = match host_w {
                        Some(hp) => hp,
                        None => {
                            let wp = self.scratch("w32", nk * 4)?;
                            self.dequant(w, wp, Ty::F32, true, false, None)?;
                            wp
                        }
                    };
                    self.gemm_g(Ty::F32, x, k, off(wp, 4), y, ldy, m, nr, k, groups)?;
                }
                self.epilogue(y, m, nr * groups, ldy, mul)?;
            }
        }
        Ok(Some(p))
    }

    /// The activation an exact-served weight (FP8 block, MXFP4) multiplies: x [rows, k] (f32)
    /// quantize-dequantized as `act` says (`served::apply`'s CPU reference), or x itself.
    pub(super) fn exact_act(
        &mut self,
        act: crate::served::ExactAct,
        non_pow2: bool,
        x: u64,
        rows: usize,
        k: usize,
    ) -> Result<u64> {
        use crate::served::ExactAct;
        let (r, c) = (rows as u64, k as u64);
        Ok(match act {
            ExactAct::Bf16 => x,
            ExactAct::Fp8x128 => {
                let xq = self.scratch("xq32", rows * k * 4)?;
                self.kern()
                    .act_quant_fp8(r * c.div_ceil(128), x, r, c, non_pow2 as i32, xq)?;
                xq
            }
            ExactAct::Mxfp8 => {
                let xq = self.scratch("xq32", rows * k * 4)?;
                self.kern()
                    .act_quant_mxfp8(r * c.div_ceil(32), x, r, c, xq)?;
                xq
            }
        })
    }

    /// Observation of one served NVFP4 linear from its device counters.
    pub(super) fn observation(p: Option<Nvfp4Params>, h: &[u64], profile: Profile) -> LinearObs {
        let Some(p) = p else {
            return LinearObs::default();
        };
        let amax = f32::from_bits(h[7] as u32) as f64;
        let calib = 2688.0 / p.g_x as f64;
        let health = profile.recipe().observes_health().then_some(QuantHealth {
            blocks: h[0],
            scale_zero: h[1],
            scale_max: h[2],
            scale_nan: h[3],
            clipped: h[4],
            dead_zone: h[5],
            elements: h[6],
        });
        LinearObs {
            health,
            act_amax_over_calib: (calib.is_finite() && calib > 0.0).then_some(amax / calib),
            params: Some(p),
        }
    }

    /// y = x · Wᵀ for host x [m, k]: the per-linear entry of `PathEnv`.
    pub fn linear(
        &mut self,
        lc: &LinearCtx,
        kind: PathKind,
        base: &str,
        x: &Data,
        m: usize,
    ) -> Result<(Data, usize, Option<LinearObs>)> {
        self.linear_rows(lc, kind, base, x, m, None)
    }

    /// [`Gpu::linear`] with weight rows `r0..r0+n` only (`rows` = (r0, n); all when None): one
    /// group of a grouped projection, observed on its own as the CPU reference observes it.
    pub fn linear_rows(
        &mut self,
        lc: &LinearCtx,
        kind: PathKind,
        base: &str,
        x: &Data,
        m: usize,
        rows: Option<(usize, usize)>,
    ) -> Result<(Data, usize, Option<LinearObs>)> {
        self.ensure_weight(lc, base)?;
        let (n_all, k) = {
            let w = &self.weights[base];
            (w.n, w.k)
        };
        let n = match rows {
            Some((r0, nr)) if r0 + nr <= n_all => nr,
            Some((r0, nr)) => {
                return Err(Error::bad(
                    lc.ckpt.location(),
                    Some(base),
                    format!("rows {r0}..{} of a weight with {n_all} outputs", r0 + nr),
                ))
            }
            None => n_all,
        };
        if x.len() != m * k {
            return Err(Error::bad(
                lc.ckpt.location(),
                Some(base),
                format!(
                    "weight has {k} input features but the activation has {} per row",
                    x.len() / m.max(1)
                ),
            ));
        }
        let xb = self.input(x)?;
        let yb = self.alloc(m * n * 4)?;
        let hb = self.alloc(H_SLOTS * 8)?;
        self.memset(hb.ptr, 0, H_SLOTS * 8)?;
        // only the BF16 and served paths choose their operand by it
        let exact = kind != PathKind::OracleFp32 && self.bf16_exact(x)?;
        let p = self.linear_dev(
            lc,
            kind,
            base,
            xb.ptr,
            m,
            exact,
            rows.map_or(WRows::All, |(r0, nr)| WRows::Range(r0, nr)),
            yb.ptr,
            n,
            Some(hb.ptr),
        )?;
        let y = self.output(yb, m * n, false);
        let obs = if kind == PathKind::Served && p.is_some() {
            let h: Vec<u64> = self.download(hb.ptr, H_SLOTS)?;
            Some(Self::observation(p, &h, lc.profile))
        } else if kind == PathKind::Served {
            Some(LinearObs::default())
        } else {
            None
        };
        Ok((y, n, obs))
    }

    /// Grouped projection (wo_a): x [rows, G, K], weight [G·R, K] → [rows, G, R]; returns the
    /// output and one observation for the whole projection (counters summed over groups).
    pub fn linear_grouped(
        &mut self,
        lc: &LinearCtx,
        kind: PathKind,
        base: &str,
        x: &Data,
        rows: usize,
        groups: usize,
    ) -> Result<(Data, usize, Option<LinearObs>)> {
        self.ensure_weight(lc, base)?;
        let (n, k) = {
            let w = &self.weights[base];
            (w.n, w.k)
        };
        if n % groups != 0 || x.len() != rows * groups * k {
            return Err(Error::bad(
                lc.ckpt.location(),
                Some(base),
                format!("grouped projection: weight [{n}, {k}] does not fit {groups} groups of {k} inputs"),
            ));
        }
        let r = n / groups;
        let xb = self.input(x)?;
        // all groups' rows at once, group-major: block g holds x[t, g, :] for every token t
        let xg = self.alloc(groups * rows * k * 4)?;
        let yb = self.alloc(rows * n * 4)?;
        let hb = self.alloc(H_SLOTS * 8)?;
        self.memset(hb.ptr, 0, H_SLOTS * 8)?;
        let exact = kind != PathKind::OracleFp32 && self.bf16_exact(x)?;
        let idx: Vec<i32> = (0..groups)
            .flat_map(|g| (0..rows).map(move |t| (t * groups + g) as i32))
            .collect();
        let ib = self.upload(&idx)?;
        self.gather_rows(xb.ptr, ib.ptr, groups * rows, k, xg.ptr)?;
        let p = self.linear_dev(
            lc,
            kind,
            base,
            xg.ptr,
            rows,
            exact,
            WRows::Groups(groups),
            yb.ptr,
            n,
            Some(hb.ptr),
        )?;
        let y = self.output(yb, rows * n, false);
        let obs = if kind == PathKind::Served {
            let h: Vec<u64> = self.download(hb.ptr, H_SLOTS)?;
            Some(Self::observation(p, &h, lc.profile))
        } else {
            None
        };
        Ok((y, r, obs))
    }
}
