//! The kernels of `kernels/*.cu` on the compute stream: launch configuration, the launch by
//! name the typed launchers of `launch.rs` call (timed when the kernel timer is on), and the
//! launches that take argument structures (NVFP4 decode, activation quantization, the grouped experts GEMM,
//! row gathers, SwiGLU).

use super::*;

/// Pieces (one 16-byte store each) per lane and step of `dequant_nvfp4_v2` (`DQ2_U` in
/// kernels/formats.cu).
const DQ2_U: u64 = 4;

/// The faster NVFP4 activation quantization kernels (same arguments and output bits as
/// `act_quant_nvfp4`), with the 16-element blocks each work item covers: `_v2` gives a block to
/// four lanes (a work item is two float4 of one lane), `_v3` gives a block to one lane.
pub const AQ_KERNELS: [(&str, f64); 2] = [("act_quant_nvfp4_v2", 0.5), ("act_quant_nvfp4_v3", 1.0)];

/// The default of [`Gpu::aq_kernel`] (`NVFP4_PROBE_AQ_KERNEL` names another of [`AQ_KERNELS`]):
/// v3, 90 % of the copy bandwidth on the H200 where v2 reaches 60 % (codes + scales).
pub const AQ_KERNEL_DEFAULT: &str = "act_quant_nvfp4_v3";

/// How `dequant_nvfp4` decodes: per-block multiplier `conv` (0 = s / global, compressed-tensors;
/// 1 = s · global, ModelOpt; 2 = s, the served operand), an optional multiplier after decoding,
/// the nibble order, and the output (BF16 bits or f32).
#[derive(Clone, Copy, Debug)]
pub struct Nvfp4Decode {
    pub global: f32,
    pub conv: i32,
    pub post: Option<f32>,
    pub swap: bool,
    pub out_bf16: bool,
}

/// Outputs of `act_quant_nvfp4` (device addresses; 0 = not written).
#[derive(Clone, Copy, Debug, Default)]
pub struct ActQuantOut {
    pub packed: u64,
    pub scales: u64,
    /// BF16 bits of e2m1 · s (the W4A4 GEMM operand).
    pub xq16: u64,
    /// Quantize-dequantize e2m1 · s / g, rounded to BF16 when `xhat_bf16`.
    pub xhat: u64,
    pub xhat_bf16: bool,
    /// H_SLOTS counters.
    pub health: u64,
}

impl ActQuantOut {
    /// Whether v3 (and the segmented kernel) may run on input `x` with these outputs: they load
    /// and store whole blocks with 8- and 16-byte accesses.
    fn v3_aligned(&self, x: u64) -> bool {
        x.is_multiple_of(16)
            && self.packed.is_multiple_of(8)
            && self.xq16.is_multiple_of(16)
            && self.xhat.is_multiple_of(16)
    }
}

/// One tile of `moe_gemm_f64` (kernels/stats.cu, same layout): up to [`MOE_R`] consecutive rows
/// of the gathered activations multiplied by one expert weight decoded from its stored bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MoeTile {
    pub packed: u64,
    pub scales: u64,
    pub row0: u32,
    pub rows: u32,
    /// NVFP4 tensor scale (conv 0: divided by, 1: multiplied by).
    pub global: f32,
    /// Multiplier after decoding, with [`MT_POST`].
    pub post: f32,
    /// Epilogue multiplier, with [`MT_EPI`]: y = bf16(y · mul).
    pub mul: f32,
    /// Decode (bits 0-1: 0 compressed-tensors, 1 ModelOpt, 2 served e2m1·s, 3 MXFP4) and the
    /// `MT_*` flags.
    pub flags: u32,
}

/// Rows per [`MoeTile`] (`MOE_R` in kernels/stats.cu).
pub const MOE_R: usize = 4;

/// Output columns per CUDA block of `moe_gemm_f64` (`MOE_C`).
const MOE_C: usize = 8;

/// Rows per [`MoeTile`] of `moe_mma_f64` (`MMA_R` in kernels/stats.cu).
pub const MMA_R: usize = 64;

/// The grouped experts' GEMM kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeKernel {
    /// `moe_gemm_f64`: FP64 FMA units, tiles of [`MOE_R`] rows, 8 columns per block.
    Fma,
    /// `moe_mma_f64`: FP64 tensor cores, tiles of up to [`MMA_R`] rows, 128 columns per block.
    Mma,
    /// `moe_mmt_f64`: `moe_mma_f64`'s tiles with each block's weights decoded through a
    /// per-tile table in shared memory straight into the B fragments (the default).
    Mmt,
}

impl MoeKernel {
    pub const ALL: [MoeKernel; 3] = [MoeKernel::Fma, MoeKernel::Mma, MoeKernel::Mmt];

    /// The kernel's name in kernels/stats.cu.
    pub fn name(self) -> &'static str {
        match self {
            MoeKernel::Fma => "moe_gemm_f64",
            MoeKernel::Mma => "moe_mma_f64",
            MoeKernel::Mmt => "moe_mmt_f64",
        }
    }

    /// Rows per tile.
    pub fn tile_rows(self) -> usize {
        match self {
            MoeKernel::Fma => MOE_R,
            _ => MMA_R,
        }
    }

    /// Whether one grouped launch per linear takes an op of `total` gathered rows over `experts`
    /// experts, the busiest with `most_rows`: the FMA kernel only experts of at most
    /// [`GROUPED_MAX_ROWS`](super::moe::GROUPED_MAX_ROWS) rows (more run per expert through
    /// cuBLAS), the tensor-core kernel any, as long as the tiles fit one launch's grid.
    pub fn takes(self, most_rows: usize, total: usize, experts: usize) -> bool {
        match self {
            MoeKernel::Fma => most_rows <= super::moe::GROUPED_MAX_ROWS,
            _ => total / MMA_R + experts <= 65_535,
        }
    }

    /// Output columns per CUDA block.
    fn cols(self) -> usize {
        match self {
            MoeKernel::Fma => MOE_C,
            _ => 128,
        }
    }

    /// `NVFP4_PROBE_MOE_KERNEL=fma` or `mma`, else `moe_mmt_f64`.
    pub fn from_env() -> MoeKernel {
        match std::env::var("NVFP4_PROBE_MOE_KERNEL")
            .ok()
            .as_deref()
            .map(str::trim)
        {
            Some("fma") => MoeKernel::Fma,
            Some("mma") => MoeKernel::Mma,
            _ => MoeKernel::Mmt,
        }
    }
}

pub const MT_POST: u32 = 4;

pub const MT_SWAP: u32 = 8;

pub const MT_WBF16: u32 = 16;

pub const MT_EPI: u32 = 32;

/// One segment of `act_quant_nvfp4_seg` (kernels/quant.cu, same layout).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AqSeg {
    pub block0: u64,
    pub nblocks: u64,
    pub g: f32,
    pub pad: u32,
    /// H_SLOTS device counters, or 0.
    pub health: u64,
}

impl Gpu {
    pub(super) fn grid(&self, name: &str, n: u64) -> LaunchConfig {
        // reductions end in per-warp atomics: keep their grids small; element-wise kernels get
        // one thread per item (many short-lived blocks keep the most memory requests in flight)
        let cap = match name {
            // fused_stats ends in 16 atomics per warp on the same 16 words: two blocks per SM
            // keep that contention small (at 16 per SM a 2M-element pair took 128 µs)
            "fused_stats" => self.sm_count as u64 * 2,
            "rcp_sweep" | "count_inexact_bf16" => self.sm_count as u64 * 16,
            "act_quant_nvfp4" => self.sm_count as u64 * 64,
            // v2 kernels: warp-strided loops over shared tables built once per CUDA block. The
            // cap keeps the table build well under 2 % of a block's work on multi-GB tensors,
            // and 120 blocks per SM is a whole number of waves at 4, 5, 6 or 8 resident blocks
            // of 256 threads (no partly filled last wave)
            "dequant_nvfp4_v2" | "act_quant_nvfp4_v2" | "act_quant_nvfp4_v3" => {
                self.sm_count as u64 * 120
            }
            _ => 1 << 22,
        };
        let blocks = n.div_ceil(256).clamp(1, cap) as u32;
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Launch kernel `name` over `n` work items (grid-stride).
    pub(super) fn launch(&self, name: &str, n: u64, args: &[A]) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.launch_cfg(name, self.grid(name, n), args)
    }

    /// Launch kernel `name` with an explicit grid, block and dynamic shared memory.
    pub(super) fn launch_cfg(&self, name: &str, cfg: LaunchConfig, args: &[A]) -> Result<()> {
        let _s = crate::profile::span("host: launch");
        let f = self
            .funcs
            .get(name)
            .ok_or_else(|| Error::Backend(format!("cuda: no kernel {name}")))?;
        let mut b = self.stream.launch_builder(f);
        for a in args {
            match a {
                A::P(v) | A::U(v) => b.arg(v),
                A::I(v) => b.arg(v),
                A::F(v) => b.arg(v),
                A::U32(v) => b.arg(v),
            };
        }
        let key = self.funcs.get_key_value(name).map_or("?", |(k, _)| *k);
        self.timed(key, || {
            unsafe { b.launch(cfg) }.map_err(|e| cuda_err(&format!("launch {name}"), e))?;
            Ok(())
        })
    }

    /// out[r] = x[rows[r]] for `nrows` rows of width `d` (`rows`: device i32 row indices).
    pub fn gather_rows(&self, x: u64, rows: u64, nrows: usize, d: usize, out: u64) -> Result<()> {
        // a block per output row (grid x holds at most 2^31 - 1), 256 columns per block
        const MAX_ROWS: usize = 1 << 30;
        if d == 0 {
            return Ok(());
        }
        (0..nrows).step_by(MAX_ROWS).try_for_each(|r0| {
            let n = MAX_ROWS.min(nrows - r0);
            let cfg = LaunchConfig {
                grid_dim: (n as u32, d.div_ceil(256) as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            self.kern().gather_rows(
                cfg,
                x,
                rows + (r0 * 4) as u64,
                n as u64,
                d as u64,
                out + (r0 * d * 4) as u64,
            )
        })
    }

    /// `dequant_nvfp4` over `nblocks` 16-element blocks (see kernels/formats.cu); the v2 kernel
    /// when `self.v2`.
    pub fn dequant_nvfp4(
        &self,
        packed: u64,
        scales: u64,
        nblocks: u64,
        d: Nvfp4Decode,
        out: u64,
    ) -> Result<()> {
        let k = self.kern();
        let (post, post_mul) = (d.post.unwrap_or(1.0), d.post.is_some() as i32);
        let (swap, ok) = (d.swap as i32, d.out_bf16 as i32);
        if self.v2 {
            // one work item per lane-step of DQ2_U pieces: 16-byte stores of 8 BF16 (2 per
            // block) or 4 f32 (4 per block)
            let pieces = nblocks * if d.out_bf16 { 2 } else { 4 };
            let n = pieces.div_ceil(DQ2_U);
            k.dequant_nvfp4_v2(
                n, packed, scales, nblocks, d.global, d.conv, post, post_mul, swap, ok, out,
            )
        } else {
            k.dequant_nvfp4(
                nblocks * 4,
                packed,
                scales,
                nblocks,
                d.global,
                d.conv,
                post,
                post_mul,
                swap,
                ok,
                out,
            )
        }
    }

    /// `act_quant_nvfp4` of `nblocks` 16-element blocks at `x` with encode scale `g`.
    /// `self.aq_kernel` (same bits, faster) when `self.v2`.
    pub fn act_quant_nvfp4(&self, x: u64, nblocks: u64, g: f32, o: ActQuantOut) -> Result<()> {
        let (name, n) = if self.v2 {
            // v3 stores whole blocks with 8- and 16-byte stores: aligned buffers only
            let aligned = o.v3_aligned(x);
            let (name, per) = AQ_KERNELS
                .iter()
                .copied()
                .find(|&(k, _)| k == self.aq_kernel && (aligned || k != "act_quant_nvfp4_v3"))
                .unwrap_or(AQ_KERNELS[0]);
            (name, (nblocks as f64 / per).ceil() as u64)
        } else {
            ("act_quant_nvfp4", nblocks * 4)
        };
        let k = self.kern();
        let (p, sc, q, xh, xb, h) = (
            o.packed,
            o.scales,
            o.xq16,
            o.xhat,
            o.xhat_bf16 as i32,
            o.health,
        );
        match name {
            "act_quant_nvfp4_v2" => k.act_quant_nvfp4_v2(n, x, nblocks, g, p, sc, q, xh, xb, h),
            "act_quant_nvfp4_v3" => k.act_quant_nvfp4_v3(n, x, nblocks, g, p, sc, q, xh, xb, h),
            _ => k.act_quant_nvfp4(n, x, nblocks, g, p, sc, q, xh, xb, h),
        }
    }

    /// `act_quant_nvfp4_v3`'s work over many segments in one launch: segment i quantizes its
    /// blocks with its own encode scale and counts into its own health slots. The outputs of `o`
    /// are shared buffers indexed as v3 indexes them (`o.health` is ignored). Needs v3's alignment.
    pub fn act_quant_nvfp4_seg(&self, x: u64, segs: &[AqSeg], o: ActQuantOut) -> Result<()> {
        if segs.is_empty() {
            return Ok(());
        }
        if !o.v3_aligned(x) || segs.len() > 65_535 {
            return Err(Error::Backend(
                "cuda: act_quant_nvfp4_seg needs 16-byte aligned buffers and at most 65535 segments"
                    .into(),
            ));
        }
        let most = segs.iter().map(|s| s.nblocks).max().unwrap_or(0);
        let sb = self.upload(segs)?;
        let cfg = LaunchConfig {
            grid_dim: (most.div_ceil(256).clamp(1, 64) as u32, segs.len() as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        self.kern().act_quant_nvfp4_seg(
            cfg,
            x,
            sb.ptr,
            o.packed,
            o.scales,
            o.xq16,
            o.xhat,
            o.xhat_bf16 as i32,
        )
    }

    /// For every tile, y[rows, n] = x[rows, k] · decode(w)ᵀ accumulated in f64 and rounded once
    /// (then the tile's epilogue), x f32 or BF16 bits (`xbf`) with row stride `ldx`, y f32 with
    /// row stride `ldy`, by `kernel` (tiles of at most its [`MoeKernel::tile_rows`]). Needs
    /// k % 16 == 0 (k % 32 for MXFP4) and 16-byte aligned rows.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gemm(
        &self,
        kernel: MoeKernel,
        x: u64,
        xbf: bool,
        ldx: usize,
        tiles: &[MoeTile],
        n: usize,
        k: usize,
        y: u64,
        ldy: usize,
    ) -> Result<()> {
        if tiles.is_empty() || n == 0 {
            return Ok(());
        }
        let name = kernel.name();
        let es = if xbf { 2 } else { 4 };
        if !k.is_multiple_of(16) || !(ldx * es).is_multiple_of(16) || !x.is_multiple_of(16) {
            return Err(Error::Backend(format!(
                "cuda: {name} needs k % 16 == 0 and 16-byte aligned rows (k {k}, ldx {ldx})"
            )));
        }
        if tiles.len() > 65_535 {
            return Err(Error::Backend(format!(
                "cuda: {name}: {} tiles, at most 65535",
                tiles.len()
            )));
        }
        let (most, cols) = (kernel.tile_rows(), kernel.cols());
        if let Some(t) = tiles.iter().find(|t| t.rows as usize > most || t.rows == 0) {
            return Err(Error::Backend(format!(
                "cuda: {name}: a tile of {} rows (1 to {most})",
                t.rows
            )));
        }
        let rows: usize = tiles.iter().map(|t| t.rows as usize).sum();
        super::Work::add(&self.work.experts, 2.0 * (rows * n * k) as f64);
        let tb = self.upload(tiles)?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(cols).min(65_535) as u32, tiles.len() as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let (xbf, ldx, n, k, ldy) = (xbf as i32, ldx as u64, n as u64, k as u64, ldy as u64);
        let kn = self.kern();
        match kernel {
            MoeKernel::Fma => kn.moe_gemm_f64(cfg, x, xbf, ldx, tb.ptr, n, k, y, ldy),
            MoeKernel::Mma => kn.moe_mma_f64(cfg, x, xbf, ldx, tb.ptr, n, k, y, ldy),
            MoeKernel::Mmt => kn.moe_mmt_f64(cfg, x, xbf, ldx, tb.ptr, n, k, y, ldy),
        }
    }

    /// act = silu(min(gt, L)) · clamp(up, ±L) over `n` elements, rounded to BF16 when `round`;
    /// with `store_inputs` gt and up are rounded to BF16 first (an expert's stored projections).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn swiglu_clamp(
        &self,
        gt: u64,
        up: u64,
        n: usize,
        limit: f32,
        round: bool,
        store_inputs: bool,
        act: u64,
    ) -> Result<()> {
        let mode = round as i32 | (store_inputs as i32) << 1;
        self.kern()
            .swiglu_clamp(n as u64, gt, up, n as u64, limit, mode, act)
    }
}
