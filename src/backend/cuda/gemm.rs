//! GEMMs: exact (operands widened to f64, cuBLAS DGEMM or `gemm_small_f64`, rounded once to
//! f32, bit-equal to the CPU reference) or the hardware's (cuBLAS FP32 without TF32, BF16 with
//! FP32 accumulation).

use super::*;

/// Rows per cuBLAS DGEMM call of [`Gpu::gemm`]: a chunked run (`--chunk` a multiple of it) gets the
/// same bits as the whole prompt.
pub(crate) const GEMM_ROWS: usize = 512;

impl Gpu {
    /// f32 or BF16-bits [rows, cols] with row stride `ld` → contiguous f64.
    pub(crate) fn widen(
        &self,
        src: u64,
        bf: i32,
        rows: usize,
        cols: usize,
        ld: usize,
        dst: u64,
    ) -> Result<()> {
        self.kern().to_f64(
            (rows * cols) as u64,
            src,
            bf,
            rows as u64,
            cols as u64,
            ld as u64,
            dst,
        )
    }

    /// Contiguous f64 [rows, cols] → f32 with row stride `ld`, each value rounded once.
    pub(crate) fn narrow(
        &self,
        src: u64,
        rows: usize,
        cols: usize,
        ld: usize,
        dst: u64,
    ) -> Result<()> {
        self.kern().from_f64(
            (rows * cols) as u64,
            src,
            rows as u64,
            cols as u64,
            ld as u64,
            dst,
        )
    }

    /// y[m, n] (f32, row stride ldy) = x[m, k] · w[n, k]ᵀ, both row-major, operands of type
    /// `ty`. With `exact64` (the default) the operands are widened to f64 and multiplied by cuBLAS
    /// DGEMM, then rounded once to f32 — the CPU reference's accumulation
    /// (`device::gemm::matmul_nt`), so both backends give the same bits; otherwise
    /// [`Gpu::gemm_native`].
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &mut self,
        ty: Ty,
        x: u64,
        ldx: usize,
        w: u64,
        y: u64,
        ldy: usize,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        if !self.exact64 {
            return self.gemm_native(ty, x, ldx, w, y, ldy, m, n, k);
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        Work::add(&self.work.dgemm, 2.0 * (m * n * k) as f64);
        let bf = (ty == Ty::Bf16) as i32;
        if m <= 8 {
            // one warp per four output columns
            return self.kern().gemm_small_f64(
                // one block of 8 warps (the grid's 256 threads) per four output columns
                (n.div_ceil(4) * 256) as u64,
                x,
                w,
                bf,
                m as u64,
                n as u64,
                k as u64,
                ldx as u64,
                y,
                ldy as u64,
            );
        }
        let xd = self.scratch("gx64", m * k.max(1) * 8)?;
        let wd = self.scratch("gw64", n * k.max(1) * 8)?;
        let yd = self.scratch("gy64", m * n * 8)?;
        self.widen(x, bf, m, k, ldx, xd)?;
        self.widen(w, bf, n, k, k, wd)?;
        if k == 0 {
            self.memset(yd, 0, m * n * 8)?;
        } else {
            // in blocks of GEMM_ROWS rows: cuBLAS picks its algorithm (and so each row's order of
            // summation) by a call's shape, so a prompt run whole and in chunks of a multiple of
            // GEMM_ROWS tokens (`--chunk`) sums every row alike
            self.timed("cuBLAS DGEMM", || {
                (0..m).step_by(GEMM_ROWS).try_for_each(|r0| {
                    let mb = GEMM_ROWS.min(m - r0);
                    self.dgemm(
                        xd + (r0 * k * 8) as u64,
                        wd,
                        yd + (r0 * n * 8) as u64,
                        mb,
                        n,
                        k,
                    )
                })
            })?;
        }
        self.narrow(yd, m, n, ldy, y)
    }

    /// [`Gpu::gemm`] over `groups` blocks: x block g (m rows from row g·m) times weight rows
    /// g·n.. (n of them) into columns g·n.. of y.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm_g(
        &mut self,
        ty: Ty,
        x: u64,
        ldx: usize,
        w: u64,
        y: u64,
        ldy: usize,
        m: usize,
        n: usize,
        k: usize,
        groups: usize,
    ) -> Result<()> {
        let es = if ty == Ty::F32 { 4 } else { 2 };
        for g in 0..groups {
            self.gemm(
                ty,
                x + (g * m * ldx * es) as u64,
                ldx,
                w + (g * n * k * es) as u64,
                y + (g * n * 4) as u64,
                ldy,
                m,
                n,
                k,
            )?;
        }
        Ok(())
    }

    /// The hardware GEMM: F32 operands with `CUBLAS_COMPUTE_32F_PEDANTIC` (no TF32), BF16
    /// operands with FP32 accumulation (`gemm_ex`, tensor cores).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_native(
        &self,
        ty: Ty,
        x: u64,
        ldx: usize,
        w: u64,
        y: u64,
        ldy: usize,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        if m == 0 || n == 0 {
            return Ok(());
        }
        Work::add(&self.work.native, 2.0 * (m * n * k) as f64);
        if k == 0 {
            for r in 0..m {
                self.memset(y + (r * ldy * 4) as u64, 0, n * 4)?;
            }
            return Ok(());
        }
        let (dt, ct) = match ty {
            Ty::F32 => (
                bsys::cudaDataType::CUDA_R_32F,
                bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F_PEDANTIC,
            ),
            Ty::Bf16 => (
                bsys::cudaDataType::CUDA_R_16BF,
                bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let what = if ty == Ty::F32 {
            "cuBLAS GEMM f32"
        } else {
            "cuBLAS GEMM bf16"
        };
        let err = format!("GEMM {m}x{n}x{k} {ty:?}");
        let cfg = (dt, bsys::cudaDataType::CUDA_R_32F, ct);
        let scal = ((&alpha as *const f32).cast(), (&beta as *const f32).cast());
        self.timed(what, || {
            self.gemm_nt(x, ldx, w, y, ldy, (m, n, k), cfg, scal, &err)
        })
    }

    /// y[m, n] = x[m, k] · w[n, k]ᵀ on contiguous row-major f64 operands (cuBLAS DGEMM).
    pub(crate) fn dgemm(&self, x: u64, w: u64, y: u64, m: usize, n: usize, k: usize) -> Result<()> {
        let (alpha, beta) = (1.0f64, 0.0f64);
        let f64t = bsys::cudaDataType::CUDA_R_64F;
        let cfg = (f64t, f64t, bsys::cublasComputeType_t::CUBLAS_COMPUTE_64F);
        let scal = ((&alpha as *const f64).cast(), (&beta as *const f64).cast());
        self.gemm_nt(
            x,
            k,
            w,
            y,
            n,
            (m, n, k),
            cfg,
            scal,
            &format!("DGEMM {m}x{n}x{k}"),
        )
    }

    /// cuBLAS `gemm_ex` of row-major y[m, n] (row stride `ldy`) = x[m, k] (row stride `ldx`) ·
    /// w[n, k]ᵀ, as the column-major Yᵀ[n, m] = W[k, n]ᵀ · Xᵀ[k, m]: `cfg` = (operand type,
    /// output type, compute type), `scal` = pointers to alpha = 1 and beta = 0 of the compute
    /// type; `what` names a failure.
    #[allow(clippy::too_many_arguments)]
    fn gemm_nt(
        &self,
        x: u64,
        ldx: usize,
        w: u64,
        y: u64,
        ldy: usize,
        (m, n, k): (usize, usize, usize),
        cfg: (
            bsys::cudaDataType,
            bsys::cudaDataType,
            bsys::cublasComputeType_t,
        ),
        scal: (*const std::ffi::c_void, *const std::ffi::c_void),
        what: &str,
    ) -> Result<()> {
        let (dt, dt_y, ct) = cfg;
        // SAFETY: the pointers are device allocations of the shapes given (the callers' checks)
        // and `scal` points at host scalars of the compute type that outlive the call.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                bsys::cublasOperation_t::CUBLAS_OP_T,
                bsys::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                m as i32,
                k as i32,
                scal.0,
                w as *const _,
                dt,
                k as i32,
                x as *const _,
                dt,
                ldx as i32,
                scal.1,
                y as *mut _,
                dt_y,
                ldy as i32,
                ct,
                bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| cuda_err(what, e))
    }

    /// `batch` column-major f64 products C_b[m, n] = op(A_b) · op(B_b) (cuBLAS strided batched
    /// DGEMM): `ta` / `tb` transpose A / B; (pointer, leading dimension, stride between batches)
    /// per operand. Every product of two f32-valued operands is exact in f64 and the sum is f64,
    /// as in [`Gpu::gemm`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn dgemm_batched(
        &self,
        (ta, tb): (bool, bool),
        (m, n, k): (usize, usize, usize),
        a: (u64, usize, usize),
        b: (u64, usize, usize),
        c: (u64, usize, usize),
        batch: usize,
    ) -> Result<()> {
        if batch == 0 || m == 0 || n == 0 {
            return Ok(());
        }
        let (alpha, beta) = (1.0f64, 0.0f64);
        let f64t = bsys::cudaDataType::CUDA_R_64F;
        let op = |t: bool| {
            if t {
                bsys::cublasOperation_t::CUBLAS_OP_T
            } else {
                bsys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        // SAFETY: the pointers are device allocations holding `batch` operands of the shapes and
        // strides given (the caller's layout); alpha and beta outlive the call.
        self.timed("cuBLAS DGEMM batched", || {
            unsafe {
                blas::gemm_strided_batched_ex(
                    *self.blas.handle(),
                    op(ta),
                    op(tb),
                    m as i32,
                    n as i32,
                    k as i32,
                    (&alpha as *const f64).cast(),
                    a.0 as *const _,
                    f64t,
                    a.1 as i32,
                    a.2 as i64,
                    b.0 as *const _,
                    f64t,
                    b.1 as i32,
                    b.2 as i64,
                    (&beta as *const f64).cast(),
                    c.0 as *mut _,
                    f64t,
                    c.1 as i32,
                    c.2 as i64,
                    batch as i32,
                    bsys::cublasComputeType_t::CUBLAS_COMPUTE_64F,
                    bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| cuda_err(&format!("DGEMM batched {batch}x{m}x{n}x{k}"), e))
        })
    }

    /// Seconds of `f`'s work on the stream: the median of three after a warm-up.
    fn median_secs(&mut self, mut f: impl FnMut(&mut Gpu) -> Result<()>) -> Result<f64> {
        f(self)?;
        self.sync()?;
        let mut ts = Vec::new();
        for _ in 0..3 {
            let t = std::time::Instant::now();
            f(self)?;
            self.sync()?;
            ts.push(t.elapsed().as_secs_f64());
        }
        ts.sort_by(f64::total_cmp);
        Ok(ts[1])
    }

    /// The device's f64 GEMM rate in flops per second: cuBLAS DGEMM of f64 operands
    /// [n, n] · [n, n]ᵀ (the FLOP floor's rate).
    pub fn dgemm_rate(&mut self, n: usize) -> Result<f64> {
        let bytes = n * n * 8;
        let (a, b, c) = (self.alloc(bytes)?, self.alloc(bytes)?, self.alloc(bytes)?);
        self.memset(a.ptr, 0x3F, bytes)?;
        self.memset(b.ptr, 0x3F, bytes)?;
        let s = self.median_secs(|g| g.dgemm(a.ptr, b.ptr, c.ptr, n, n, n))?;
        Ok(2.0 * (n as f64).powi(3) / s)
    }

    /// The device's FP32 GEMM rate in flops per second (the hardware GEMM the runner uses
    /// without exact f64 accumulation, [`Gpu::gemm_native`]; no TF32): [n, n] · [n, n]ᵀ. Not
    /// counted as the run's work.
    pub fn sgemm_rate(&mut self, n: usize) -> Result<f64> {
        let bytes = n * n * 4;
        let (a, b, c) = (self.alloc(bytes)?, self.alloc(bytes)?, self.alloc(bytes)?);
        self.memset(a.ptr, 0x3F, bytes)?;
        self.memset(b.ptr, 0x3F, bytes)?;
        let before = self.work.native.get();
        let s = self.median_secs(|g| g.gemm_native(Ty::F32, a.ptr, n, b.ptr, c.ptr, n, n, n, n));
        self.work.native.set(before);
        Ok(2.0 * (n as f64).powi(3) / s?)
    }

    /// The host → device rate from pinned memory in bytes per second (the staging buffer): the
    /// host→device floor's rate.
    pub fn pinned_h2d_rate(&mut self) -> Result<f64> {
        let n = self.pinned.first().map_or(0, |p| p.1);
        if n == 0 {
            return Ok(f64::NAN);
        }
        let d = self.alloc(n)?;
        let s = self.median_secs(|g| g.copy_pinned_to(d.ptr).map(|_| ()))?;
        Ok(n as f64 / s)
    }
}
